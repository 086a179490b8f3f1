/*
 * The tile path's bfloat16 pair products (MH_PATH_PAIRS: bfloat16 queries,
 * keys and values on an ISA with MH_HAS_BF16_DOT).  Two neighbours along a
 * dot product's axis are one 32-bit word, and one V_DPBF16 (vdpbf16ps) does
 * the work of two FMAs:
 *   scores  qt holds the query block as words qt2[d/2][i] = (q_i[d], q_i[d+1])
 *           (unscaled: the words are the caller's bfloat16 numbers, so nothing
 *           rounds; the scale multiplies the finished scores), and each key's
 *           word (k[d], k[d+1]) is broadcast straight from the stored rows;
 *   mix     vpack holds the value block as words (v[j][e], v[j+1][e]) and pt2
 *           the probabilities as words (p[j][i], p[j+1][i]), rounded to
 *           bfloat16 (the one rounding this path adds: at most 2^-8 of each
 *           probability).  A pair is only taken where both keys are visible
 *           to every row of the output tile; keys that need the hidden-entry
 *           select go one at a time, widened from their half of the word,
 *           with the float probability.
 * The tile path (mh_tile.h) calls these pieces where its plan says
 * MH_PATH_PAIRS; the rest (masks, softmax, tiling loops) is its own.
 */

#ifndef MH_PAIR_COMMON_DONE
#define MH_PAIR_COMMON_DONE
/* The 32-bit word at p: two bfloat16 numbers, p[0] in the low half. */
static inline uint32_t mh_load_word(const uint16_t *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}
#endif

/* Score tile: st[r][c*VW ..] = scale * k_r . q[., c*VW ..] for R keys (R <=
   JR) and NV query vectors (NV <= NVQ), qw the query words [E/2][BQ], kh the
   bfloat16 key rows. */
MH_INLINE void FN(pair_score_tile)(const uint32_t *qw, int64_t E, const uint16_t *kh,
                                   int64_t k_row, T *st, const int R, const int NV, T scale)
{
    V acc[JR][NVQ];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = V_ZERO();
    for (int64_t d2 = 0; d2 < E / 2; ++d2) {
        VP qv[NVQ];
        for (int c = 0; c < NV; ++c) qv[c] = VP_LOAD(qw + d2 * BQ + c * VW);
        for (int r = 0; r < R; ++r) {
            const VP kb = VP_SET1(mh_load_word(kh + r * k_row + 2 * d2));
            for (int c = 0; c < NV; ++c) acc[r][c] = V_DPBF16(acc[r][c], kb, qv[c]);
        }
    }
    const V vs = V_SET1(scale);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(st + r * BQ + c * VW, V_MUL(acc[r][c], vs));
}

/* Value vector c of key j, widened from its half of the pair words v (v_row
   words per pair of keys). */
MH_INLINE V FN(pair_value)(const uint32_t *v, int64_t v_row, int64_t j, int64_t c)
{
    const VP x = VP_LOAD(v + (j >> 1) * v_row + c * VW);
    return (j & 1) ? VP_HIGH(x) : VP_LOW(x);
}

/* Keys 2*j2 and 2*j2+1 of an output tile o[R][NV]: one V_DPBF16 per row and
   vector, with the probability words pw and the value words v. */
#define MH_MIX_PAIR(j2)                                                                    \
    do {                                                                                   \
        VP vv_[NVO];                                                                       \
        for (int c_ = 0; c_ < NV; ++c_)                                                    \
            vv_[c_] = VP_LOAD((const uint32_t *)v + (j2) * v_row + c_ * VW);                \
        for (int r_ = 0; r_ < R; ++r_) {                                                   \
            const VP p_ = VP_SET1(pw[(j2) * BQ + r_]);                                      \
            for (int c_ = 0; c_ < NV; ++c_) o[r_][c_] = V_DPBF16(o[r_][c_], p_, vv_[c_]);   \
        }                                                                                  \
    } while (0)

/* The key block [k0, k0 + nk) of pair `pair` as bfloat16 rows: in place, or
   copied into kpack when the plan found the rows far apart; *k_row is set to
   their stride. */
static const uint16_t *FN(pair_keys)(const mh_attn_args *a, int64_t pair, int64_t k0,
                                     int64_t nk, FN(work) *w, int64_t *k_row)
{
    const int64_t E = a->head_dim;
    const uint16_t *kh = (const uint16_t *)a->k.base + a->k.off[pair] + k0 * a->k.row;
    *k_row = a->k.row;
    if (!w->k_in_place) {
        uint16_t *dst = (uint16_t *)w->kpack;
        for (int64_t j = 0; j < nk; ++j) memcpy(dst + j * E, kh + j * a->k.row, 2 * (size_t)E);
        *k_row = E;
        return dst;
    }
    return kh;
}

/* The value block [k0, k0 + nk) interleaved into pair words in vpack
   ([BK/2][evp]: (v[j][e], v[j+1][e]), zero past Ev and past the last key) and
   the probabilities of the item's rows into pt2 ([BK/2][BQ]); returns vpack. */
static const uint32_t *FN(pair_pack)(const mh_attn_args *a, int64_t pair, int64_t nq,
                                     int64_t k0, int64_t nk, FN(work) *w)
{
    const uint16_t *vh = (const uint16_t *)a->v.base + a->v.off[pair] + k0 * a->v.row;
    const int64_t vr = a->v.row, nvq = (nq + VW - 1) / VW;
    uint32_t *vw = (uint32_t *)w->vpack;
    for (int64_t j = 0; j < nk; j += 2) {
        const int two = j + 1 < nk;
        VP_INTERLEAVE(vw + (j / 2) * w->evp, vh + j * vr, two ? vh + (j + 1) * vr : NULL,
                      a->v_dim, w->evp);
        for (int64_t c = 0; c < nvq; ++c)
            VP_STORE(w->pt2 + (j / 2) * BQ + c * VW,
                     VP_PAIR(V_LOAD(w->st + j * BQ + c * VW),
                             two ? V_LOAD(w->st + (j + 1) * BQ + c * VW) : V_ZERO()));
    }
    return vw;
}

/* qw[d/2][i] = the word (q[i][d], q[i][d+1]) of bfloat16 rows q for i < nq
   (the 32-bit view of each row, transposed), 0 in the padding lanes up to
   nvq * VW. */
static void FN(pair_load_queries)(const uint16_t *q, int64_t q_row, int64_t nq, int64_t nvq,
                                  int64_t E, uint32_t *qw)
{
    int64_t d0 = 0;
    for (; d0 + 2 * VW <= E; d0 += 2 * VW)
        for (int64_t i0 = 0; i0 < nvq * VW; i0 += VW) {
            V r[VW];
            for (int l = 0; l < VW; ++l)
                r[l] = i0 + l < nq ? VP_AS_V(VP_LOAD(q + (i0 + l) * q_row + d0)) : V_ZERO();
            V_TRANSPOSE(r);
            for (int l = 0; l < VW; ++l) V_STORE((T *)qw + (d0 / 2 + l) * BQ + i0, r[l]);
        }
    for (int64_t d = d0; d < E; d += 2) {
        for (int64_t i = 0; i < nq; ++i) qw[(d / 2) * BQ + i] = mh_load_word(q + i * q_row + d);
        for (int64_t i = nq; i < nvq * VW; ++i) qw[(d / 2) * BQ + i] = 0;
    }
}
