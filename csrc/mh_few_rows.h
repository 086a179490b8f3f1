/*
 * The few-rows path (mh_instance.h): up to MH_FEW_ROWS query rows (decode),
 * or the rows of a group of query heads that share a kv head.  Scores are
 * kept per row (s[i][j]) and the softmax runs across the keys, VW keys at a
 * time; keys and values are read in place, in their storage format, where
 * the plan says so (rows of whole vectors), and copied otherwise.
 */

/* An int4 row's (scale, min) pairs: 2 * groups float16 bits widened into sm. */
MH_INLINE void FN(i4_pairs)(const uint16_t *pairs, int64_t groups, float *sm)
{
    int64_t h = 0;
#if MH_HAS_HALF_SCALAR
    for (; h + 4 <= 2 * groups; h += 4) S4_HALF_TO_FLOAT(sm + h, pairs + h);
#endif
    for (; h < 2 * groups; ++h) sm[h] = MH_HALF_TO_FLOAT(pairs[h]);
}

/* VW values of a stored K/V row from column `col` (a multiple of VW), widened:
   int8 values unscaled (the caller applies the row's scale), int4 with their
   group's (scale, min) from `sm` (see i4_pairs). */
MH_INLINE V FN(kv_vec)(const char *row, int64_t col, const int fmt, const float *sm)
{
    (void)sm;
    switch (fmt) {
#if MH_HAS_F16_LOAD
    case MH_STORE_F16: return V_LOAD_HALF((const uint16_t *)row + col);
#endif
#if MH_HAS_BF16_LOAD
    case MH_STORE_BF16: return V_LOAD_BF16((const uint16_t *)row + col);
#endif
#if MH_HAS_I8_LOAD && MH_HAS_U4_LOAD
    case MH_STORE_I8: return V_LOAD_I8((const int8_t *)row + col);
    case MH_STORE_I4: {
        const int64_t g = col / MH_I4_GROUP;
        return V_FMA(V_LOAD_U4((const uint8_t *)row + col / 2), V_SET1((T)sm[2 * g]),
                     V_SET1((T)sm[2 * g + 1]));
    }
#endif
    default: return V_LOAD((const T *)row + col);
    }
}

#include "mh_kv_rows.h"

#if MH_HAS_I4_DOTS
#include "mh_i4_dots.h"
#endif

#define MH_I4_SPLIT MH_HAS_U4_SPLIT
#define MH_I4_VECS (MH_I4_GROUP / VW) /* vectors a group */
#if MH_HAS_I8_LOAD && MH_HAS_U4_LOAD
/* The 4-bit values of n vectors of a stored int4 row, widened as they are (no
   scale or min).  Where the ISA has V_LOAD_U4_GROUP, each whole group comes
   in split order: its even channels (the low nibbles), then its odd channels
   (the high ones), which takes about half the instructions of widening them
   in place; the query rows (FN(attend_few_rows)) and the output columns (the
   int4 mix) are put in the same order for them. */
MH_INLINE void FN(u4_row)(const char *row, int64_t n, V *u)
{
    int64_t c = 0;
#if MH_I4_SPLIT
    for (; c + MH_I4_VECS <= n; c += MH_I4_VECS) V_LOAD_U4_GROUP((const uint8_t *)row + c * (VW / 2), u + c);
#endif
    for (; c < n; ++c) u[c] = V_LOAD_U4((const uint8_t *)row + c * (VW / 2));
}

/* int4 keys, factored by group: q . (s u + m) = s (q . u) + m (sum of q), so
   the 4-bit values u are only widened, with no multiply-add to dequantise
   each vector first.  out[r] = the lanes of row r's score before their sum:
   per group, s times the lanes of q . u, plus, spread over the lanes, the
   sum of m times the group's query sum (qm: the sums / VW, MH_I4_MAX_GROUPS a
   row).  The result is the same product as the dequantised dot product up to
   float32 rounding. */
MH_INLINE void FN(i4_key_lanes)(const T *qp, int64_t ep, const T *qm, const char *krow,
                                const float *sm, int64_t groups, V *out, const int R)
{
    T mq[4] = {0, 0, 0, 0};
    for (int r = 0; r < R; ++r) out[r] = V_ZERO();
    for (int64_t g = 0; g < groups; ++g) {
        V dot[4], u[MH_I4_VECS]; /* (a group widened at a time: fewer registers live) */
        FN(u4_row)(krow + g * (MH_I4_GROUP / 2), MH_I4_VECS, u);
        for (int r = 0; r < R; ++r) dot[r] = V_ZERO();
        for (int c = 0; c < MH_I4_VECS; ++c)
            for (int r = 0; r < R; ++r)
                dot[r] = V_FMA(V_LOAD(qp + r * ep + g * MH_I4_GROUP + c * VW), u[c], dot[r]);
        const V sg = V_SET1((T)sm[2 * g]);
        for (int r = 0; r < R; ++r) {
            out[r] = V_FMA(dot[r], sg, out[r]);
            mq[r] += (T)sm[2 * g + 1] * qm[r * MH_I4_MAX_GROUPS + g];
        }
    }
    for (int r = 0; r < R; ++r) out[r] = V_ADD(out[r], V_SET1(mq[r]));
}
#endif

/* s[r][j] = qp_r . k_j for R (<= 4, a constant) rows from qp and nk keys of
   nvk vectors each, keys read in place in format `fmt`.  One or two rows take
   4 keys at a time, each key vector widened once for the rows, and reduce the
   4 keys' accumulators of a row together (V_HSUM4) into 4 adjacent scores;
   3 or 4 rows take one key at a time and reduce their rows together.  Row j
   of `pf` is prefetched with key j (FN(prefetch_rows)). */
MH_INLINE void FN(few_rows_dots_r)(const T *qp, int64_t ep, const T *qm, FN(kv_rows) k,
                                   int64_t nk, int64_t nvk, T *s, const int R, const int fmt,
                                   FN(kv_rows) pf)
{
    (void)qm;
    float pairs[4][2 * MH_I4_MAX_GROUPS];
    const int64_t groups = nvk * VW / MH_I4_GROUP;
    int64_t j = 0;
    if (R <= 2) {
        for (; j + 4 <= nk; j += 4) {
            const char *k0 = k.base + j * k.row_bytes, *k1 = k0 + k.row_bytes;
            const char *k2 = k1 + k.row_bytes, *k3 = k2 + k.row_bytes;
            FN(prefetch_rows)(pf, j, 4);
            if (fmt == MH_STORE_I4)
                for (int u = 0; u < 4; ++u)
                    FN(i4_pairs)((const uint16_t *)(k.scale + (j + u) * k.scale_bytes), groups,
                                 pairs[u]);
            V a0[2], a1[2], a2[2], a3[2];
#if MH_HAS_I8_LOAD && MH_HAS_U4_LOAD
            if (fmt == MH_STORE_I4) {
                FN(i4_key_lanes)(qp, ep, qm, k0, pairs[0], groups, a0, R);
                FN(i4_key_lanes)(qp, ep, qm, k1, pairs[1], groups, a1, R);
                FN(i4_key_lanes)(qp, ep, qm, k2, pairs[2], groups, a2, R);
                FN(i4_key_lanes)(qp, ep, qm, k3, pairs[3], groups, a3, R);
                for (int r = 0; r < R; ++r) V_HSUM4(a0[r], a1[r], a2[r], a3[r], s + r * BK + j);
                continue;
            }
#endif
            for (int r = 0; r < R; ++r) a0[r] = a1[r] = a2[r] = a3[r] = V_ZERO();
#define MH_DOTS4_STEP(c)                                                        \
            do {                                                                \
                V qv[2];                                                        \
                for (int r = 0; r < R; ++r) qv[r] = V_LOAD(qp + r * ep + (c) * VW); \
                const V x0 = FN(kv_vec)(k0, (c) * VW, fmt, pairs[0]);          \
                for (int r = 0; r < R; ++r) a0[r] = V_FMA(qv[r], x0, a0[r]);    \
                const V x1 = FN(kv_vec)(k1, (c) * VW, fmt, pairs[1]);          \
                for (int r = 0; r < R; ++r) a1[r] = V_FMA(qv[r], x1, a1[r]);    \
                const V x2 = FN(kv_vec)(k2, (c) * VW, fmt, pairs[2]);          \
                for (int r = 0; r < R; ++r) a2[r] = V_FMA(qv[r], x2, a2[r]);    \
                const V x3 = FN(kv_vec)(k3, (c) * VW, fmt, pairs[3]);          \
                for (int r = 0; r < R; ++r) a3[r] = V_FMA(qv[r], x3, a3[r]);    \
            } while (0)
            int64_t c = 0;
            for (; c + 2 <= nvk; c += 2) { /* two vectors a step: half the loop overhead */
                MH_DOTS4_STEP(c);
                MH_DOTS4_STEP(c + 1);
            }
            if (c < nvk) MH_DOTS4_STEP(c);
#undef MH_DOTS4_STEP
            if (fmt == MH_STORE_I8) { /* the row scales go on before the lane sums: a store
                                      of the sums and a reload to scale them would wait
                                      on store forwarding */
                const char *sc = k.scale;
                const int64_t sb = k.scale_bytes;
                for (int r = 0; r < R; ++r) {
                    a0[r] = V_MUL(a0[r], V_SET1((T)mh_row_scale(fmt, sc, sb, j)));
                    a1[r] = V_MUL(a1[r], V_SET1((T)mh_row_scale(fmt, sc, sb, j + 1)));
                    a2[r] = V_MUL(a2[r], V_SET1((T)mh_row_scale(fmt, sc, sb, j + 2)));
                    a3[r] = V_MUL(a3[r], V_SET1((T)mh_row_scale(fmt, sc, sb, j + 3)));
                }
            }
            for (int r = 0; r < R; ++r) V_HSUM4(a0[r], a1[r], a2[r], a3[r], s + r * BK + j);
        }
    }
    for (; j < nk; ++j) {
        const char *kr = k.base + j * k.row_bytes;
        FN(prefetch_rows)(pf, j, 1);
        const T ks = (T)mh_row_scale(fmt, k.scale, k.scale_bytes, j);
        if (fmt == MH_STORE_I4)
            FN(i4_pairs)((const uint16_t *)(k.scale + j * k.scale_bytes), groups, pairs[0]);
        V acc[4];
#if MH_HAS_I8_LOAD && MH_HAS_U4_LOAD
        if (fmt == MH_STORE_I4) {
            FN(i4_key_lanes)(qp, ep, qm, kr, pairs[0], groups, acc, R);
        } else
#endif
        {
            for (int r = 0; r < R; ++r) acc[r] = V_ZERO();
            for (int64_t c = 0; c < nvk; ++c) {
                const V kc = FN(kv_vec)(kr, c * VW, fmt, pairs[0]);
                for (int r = 0; r < R; ++r) acc[r] = V_FMA(V_LOAD(qp + r * ep + c * VW), kc, acc[r]);
            }
        }
        if (fmt == MH_STORE_I8) /* as the 4-key loop: the scale before the lane sums */
            for (int r = 0; r < R; ++r) acc[r] = V_MUL(acc[r], V_SET1(ks));
        if (R >= 3) {
            T sums[4];
            V_HSUM4(acc[0], acc[1], acc[2], R == 4 ? acc[3] : V_ZERO(), sums);
            for (int r = 0; r < R; ++r) s[r * BK + j] = sums[r];
        } else {
            for (int r = 0; r < R; ++r) s[r * BK + j] = V_HSUM(acc[r]);
        }
    }
}

/* s[i][j] = qp_i . k_j for nq rows and nk keys of nvk vectors each, keys read
   in place in format `fmt`: 4 rows at a time, then the 1 to 3 left; `pf`
   prefetched along the first rows. */
MH_INLINE void FN(few_rows_dots)(const T *qp, int64_t ep, const T *qm, int64_t nq,
                                 FN(kv_rows) k, int64_t nk, int64_t nvk, T *s, const int fmt,
                                 FN(kv_rows) pf)
{
    int64_t r0 = 0;
#if MH_HAS_I4_DOTS
    /* whole runs of 16 int4 keys by integer dot products, a row at a time (a row
       whose query the digits cannot hold: the float path), then the rest below */
    if (fmt == MH_STORE_I4 && FN(i4_dots_fit)(nvk * VW) && nk >= 16) {
        const int64_t E = nvk * VW, n16 = nk / 16 * 16;
        for (int64_t i = 0; i < nq; ++i) {
            const T *qmi = qm + i * MH_I4_MAX_GROUPS;
            const T dq = qmi[MH_I4_DQ_SLOT];
            const FN(kv_rows) pfi = i == 0 ? pf : FN(no_rows);
            if (dq < 0) {
                FN(few_rows_dots_r)(qp + i * ep, ep, qmi, k, n16, nvk, s + i * BK, 1, fmt, pfi);
                continue;
            }
            T qs[8];
            for (int64_t g = 0; g < E / MH_I4_GROUP; ++g) qs[g] = qmi[g] * VW; /* (sums / VW) */
            const int8_t *dig = MH_I4_DIGITS(qm, i, E);
            /* (rows side by side or apart decided once: gcc otherwise tests it for
               each pair of keys; one int4 thread over a cache in L2 0.90-0.96x the time) */
            if (MH_I4_ADJACENT(k))
                for (int64_t j = 0; j < n16; j += 16)
                    FN(i4_dots16)(dig, qs, dq, FN(kv_skip)(k, j), E, s + i * BK + j,
                                  FN(kv_skip)(pfi, j), 1);
            else
                for (int64_t j = 0; j < n16; j += 16)
                    FN(i4_dots16)(dig, qs, dq, FN(kv_skip)(k, j), E, s + i * BK + j,
                                  FN(kv_skip)(pfi, j), 0);
        }
        k = FN(kv_skip)(k, n16);
        pf = FN(kv_skip)(pf, n16);
        s += n16;
        nk -= n16;
    }
#endif
#define MH_DOTS_R1(RR, PF, NVK)                                                            \
    FN(few_rows_dots_r)(qp + r0 * ep, ep, qm + r0 * MH_I4_MAX_GROUPS, k, nk, NVK,          \
                        s + r0 * BK, RR, fmt, PF)
    /* int4 rows of 64 and 128: the group loops of FN(i4_key_lanes) unrolled */
#define MH_DOTS_R(RR, PF)                                                                  \
    do {                                                                                   \
        if (fmt == MH_STORE_I4 && nvk * VW == 64) MH_DOTS_R1(RR, PF, 64 / VW);                \
        else if (fmt == MH_STORE_I4 && nvk * VW == 128) MH_DOTS_R1(RR, PF, 128 / VW);         \
        else MH_DOTS_R1(RR, PF, nvk);                                                      \
    } while (0)
    for (; r0 + 4 <= nq; r0 += 4) MH_DOTS_R(4, r0 == 0 ? pf : FN(no_rows));
    if (r0 > 0) pf = FN(no_rows);
    switch (nq - r0) {
    case 1: MH_DOTS_R(1, pf); break;
    case 2: MH_DOTS_R(2, pf); break;
    case 3: MH_DOTS_R(3, pf); break;
    default: break;
    }
#undef MH_DOTS_R
#undef MH_DOTS_R1
}

/* Step 1: s[i][j] = (s q_i) . k_j (s: mh_score_scale) for keys [k0, k0+nk), every mask
   applied (per query head of a group: rows g*L .. g*L+L-1 are positions q0 ..
   q0+L-1), the vector padding lanes up to a whole vector set to -inf.
   Returns 1 if the user mask may have hidden an entry. */
static int FN(few_rows_masked_scores)(const mh_attn_args *a, int64_t pair, int64_t q0,
                                       int64_t nq, int64_t k0, int64_t nk, FN(work) *w)
{
    const int64_t E = a->head_dim, ep = w->ep, G = mh_group(a), L = nq / G;
    const int64_t nk_pad = (nk + VW - 1) / VW * VW;
    int user_hid = 0;
    if (w->k_in_place) {
        const FN(kv_rows) kr = FN(kv_in_place)(a, &a->k, &a->k_scale, pair, k0);
        /* this block's values, for the mix (int4: the next block's) */
        const int64_t pv = k0 + MH_AHEAD(a);
        const FN(kv_rows) pf = w->prefetch && w->v_in_place && pv + nk <= a->kv_len
                                   ? FN(kv_in_place)(a, &a->v, &a->v_scale, pair, pv)
                                   : FN(no_rows);
#define MH_DOTS(F) FN(few_rows_dots)(w->qt, ep, w->kpack, nq, kr, nk, E / VW, w->st, F, pf)
        switch (a->kv_format) {
        case MH_STORE_F16: MH_DOTS(MH_STORE_F16); break;
        case MH_STORE_BF16: MH_DOTS(MH_STORE_BF16); break;
        case MH_STORE_I8: MH_DOTS(MH_STORE_I8); break;
        case MH_STORE_I4: MH_DOTS(MH_STORE_I4); break;
        default: MH_DOTS(MH_NATIVE); break;
        }
#undef MH_DOTS
    } else {
        FN(kv_rows) kr = FN(no_rows);
        FN(load_rows)(a, &a->k, &a->k_scale, pair, k0, nk, E, w->kpack, ep);
        kr.base = (const char *)w->kpack;
        kr.row_bytes = ep * (int64_t)sizeof(T);
        FN(few_rows_dots)(w->qt, ep, w->kpack, nq, kr, nk, ep / VW, w->st, MH_NATIVE,
                          FN(no_rows));
    }
    if (a->softcap > 0 || a->alibi.base) FN(transform_scores)(a, pair, q0, nq, L, k0, nk, w->st, 0);
    const int cut = mh_block_is_cut(a, q0, L, k0, nk);
    for (int64_t g = 0; g < G; ++g) {
        T *sg = w->st + g * L * BK;
        if (cut) FN(mask_causal_window)(a, q0, L, k0, nk, sg, BK, 1);
        user_hid |= FN(mask_user)(a, pair, q0, L, k0, nk, sg, BK, 1);
    }
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = nk; j < nk_pad; ++j) w->st[i * BK + j] = (T)(-INFINITY);
    return user_hid;
}

/* Step 2: online softmax of each row across the block's keys; with `mark`,
   hidden entries (-inf) become -0.0 so the mix can skip them. */
static void FN(few_rows_softmax)(FN(work) *w, int64_t nq, int64_t nk, int mark)
{
    const T neg_inf = (T)(-INFINITY);
    const int64_t nk_pad = (nk + VW - 1) / VW * VW;
    T lanes[VW];
    for (int64_t i = 0; i < nq; ++i) {
        T *sr = w->st + i * BK;
        V mv = V_LOAD(sr);
        for (int64_t j = VW; j < nk_pad; j += VW) mv = V_MAX(mv, V_LOAD(sr + j));
        V_STORE(lanes, mv);
        T m_blk = lanes[0];
        for (int l = 1; l < VW; ++l) m_blk = lanes[l] > m_blk ? lanes[l] : m_blk;
        const T m_old = w->row_max[i];
        const T m_new = m_blk > m_old ? m_blk : m_old;
        const T m_use = m_new == neg_inf ? (T)0 : m_new;
        const V mu = V_SET1(m_use);
        V sum = V_ZERO();
        for (int64_t j = 0; j < nk_pad; j += VW) {
            const V sj = V_LOAD(sr + j);
            V p = MH_EXP2(V_SUB(sj, mu));
            if (mark) p = FN(mark_hidden)(p, sj);
            V_STORE(sr + j, p);
            sum = V_ADD(sum, p);
        }
        V_STORE(lanes, MH_EXP2(V_SET1(m_old - m_use)));
        w->alpha[i] = lanes[0];
        w->row_sum[i] = w->row_sum[i] * lanes[0] + V_HSUM(sum);
        w->row_max[i] = m_new;
    }
}

/* Columns [c * VW, (c + NC) * VW) of acc[r] = alpha[r]*acc[r] + sum_j p[r][j] * v[j]
   for R (<= MH_FEW_ROWS) rows whose probabilities are stored per row
   (p[r * BK + j]); values read in place in format `fmt` (an int8 row's scale
   folded into its probabilities), each value vector widened once for the R
   rows; `select` skips hidden entries.  R * NC accumulators.  Row j of `pf`
   is prefetched with value j. */
MH_INLINE void FN(few_rows_output_cols)(T *acc, int64_t evp, const T *alpha, const T *p,
                                        int64_t nk, FN(kv_rows) v, int64_t c,
                                        const int NC, const int R, const int fmt,
                                        const int select, FN(kv_rows) pf)
{
    float pairs[2 * MH_I4_MAX_GROUPS];
    V o[MH_FEW_ROWS][4 * NVO];
    for (int r = 0; r < R; ++r) {
        const V a = V_SET1(alpha[r]);
        for (int u = 0; u < NC; ++u) o[r][u] = V_MUL(V_LOAD(acc + r * evp + (c + u) * VW), a);
    }
    /* int4: the groups this chunk's columns fall in, widened at their own places */
    const int64_t g0 = c * VW / MH_I4_GROUP;
    const int64_t g1 = ((c + NC) * VW + MH_I4_GROUP - 1) / MH_I4_GROUP;
#if MH_I4_SPLIT
    /* (whole groups: the chunks of 16, 8 and 4 vectors; columns that come one
       vector at a time are the last nvv % 4 whatever the rows, so a column
       takes the same path for any number of rows) */
    if (fmt == MH_STORE_I4 && !select && NC % MH_I4_VECS == 0 && c % MH_I4_VECS == 0) {
        /* factored by group as the keys (FN(i4_key_lanes)): p (s u + m) summed
           over the keys is (p s) u summed, plus the sum of p m once per group */
        const int NG = NC / MH_I4_VECS, per = MH_I4_VECS;
        T pm[MH_FEW_ROWS][4 * NVO / MH_I4_VECS + 1];
        for (int r = 0; r < R; ++r)
            for (int uu = 0; uu < NC; uu += per) V_SPLIT_GROUP(o[r] + uu);
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < NG; ++g) pm[r][g] = 0;
        /* rows [0, from[r]) of query row r taken by integer dot products */
        int64_t from[MH_FEW_ROWS] = {0}, j = 0;
#if MH_HAS_I4_DOTS
        /* whole runs of 16 rows by integer dot products (mh_i4_dots.h), two groups at a
           time, for each query row whose weights can be written as digits (a row's
           result does not depend on the others) */
        if (NC % 4 == 0 && nk >= 16) {
            const int64_t n16 = nk / 16 * 16;
            j = n16;
            for (int r = 0; r < R; ++r) {
                const FN(kv_rows) pfr = r == 0 ? pf : FN(no_rows);
                if (!FN(i4_mix_dots)(p + r * BK, v, g0, n16, NC / 4, o[r], pfr)) {
                    j = 0;
                    continue;
                }
                from[r] = n16;
            }
        }
#endif
        for (; j < nk; ++j) {
            const char *vr = v.base + j * v.row_bytes;
            FN(prefetch_rows)(pf, j, 1);
            FN(i4_pairs)((const uint16_t *)(v.scale + j * v.scale_bytes) + 2 * g0, NG, pairs);
            V u[4 * NVO];
            FN(u4_row)(vr + c * (VW / 2), NC, u);
            for (int r = 0; r < R; ++r) {
                if (j < from[r]) continue;
                const T ps = p[r * BK + j];
                for (int g = 0; g < NG; ++g) {
                    const V psg = V_SET1(ps * (T)pairs[2 * g]);
                    for (int uu = g * per; uu < (g + 1) * per; ++uu) o[r][uu] = V_FMA(psg, u[uu], o[r][uu]);
                    pm[r][g] += ps * (T)pairs[2 * g + 1];
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            for (int uu = 0; uu < NC; ++uu) o[r][uu] = V_ADD(o[r][uu], V_SET1(pm[r][uu / per]));
            for (int uu = 0; uu < NC; uu += per) V_UNSPLIT_GROUP(o[r] + uu);
            for (int uu = 0; uu < NC; ++uu) V_STORE(acc + r * evp + (c + uu) * VW, o[r][uu]);
        }
        return;
    }
#endif
    for (int64_t j = 0; j < nk; ++j) {
        const char *vr = v.base + j * v.row_bytes;
        FN(prefetch_rows)(pf, j, 1);
        const T vs = (T)mh_row_scale(fmt, v.scale, v.scale_bytes, j);
        if (fmt == MH_STORE_I4)
            FN(i4_pairs)((const uint16_t *)(v.scale + j * v.scale_bytes) + 2 * g0, g1 - g0,
                         pairs + 2 * g0);
        V vv[4 * NVO];
        for (int u = 0; u < NC; ++u) vv[u] = FN(kv_vec)(vr, (c + u) * VW, fmt, pairs);
        for (int r = 0; r < R; ++r) {
            const T ps = p[r * BK + j];
            const V pj = V_SET1(fmt == MH_STORE_I8 ? ps * vs : ps);
            for (int u = 0; u < NC; ++u)
                o[r][u] = select ? FN(fma_visible)(ps, pj, vv[u], o[r][u])
                                 : V_FMA(pj, vv[u], o[r][u]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NC; ++u) V_STORE(acc + r * evp + (c + u) * VW, o[r][u]);
}

/* acc[r] = alpha[r]*acc[r] + sum_j p[r][j] * v[j] for R (<= MH_FEW_ROWS) rows
   (few_rows_output_cols): the value columns in chunks as wide as the registers
   allow, NVO vectors for 3 or 4 rows, 2 * NVO for 2 and 4 * NVO for 1, so that
   fewer rows read every value row fewer times; then NVO and single vectors.
   `pf` is prefetched along the first chunk. */
MH_INLINE void FN(few_rows_output)(T *acc, int64_t evp, const T *alpha, const T *p, int64_t nk,
                                   FN(kv_rows) v, int64_t nvv, const int R, const int fmt,
                                   const int select, FN(kv_rows) pf)
{
    const int NC = R == 1 ? 4 * NVO : R == 2 ? 2 * NVO : NVO;
    int64_t c = 0;
#define MH_COLS(N)                                                                         \
    do {                                                                                   \
        FN(few_rows_output_cols)(acc, evp, alpha, p, nk, v, c, N, R, fmt, select, pf);     \
        pf = FN(no_rows);                                                                  \
    } while (0)
    /* int4 groups wider than NVO vectors: a group at a time for any rows (one row's
       two groups' accumulators, values and scales would not fit in the registers) */
    if (MH_I4_SPLIT && NVO < MH_I4_VECS && fmt == MH_STORE_I4)
        for (; c + MH_I4_VECS <= nvv; c += MH_I4_VECS) MH_COLS(MH_I4_VECS);
    for (; c + NC <= nvv; c += NC) MH_COLS(NC);
    if (NC > NVO)
        for (; c + NVO <= nvv; c += NVO) MH_COLS(NVO);
    for (; c < nvv; ++c) MH_COLS(1);
#undef MH_COLS
}

/* Step 3: acc = alpha * acc + P V for the block's values (in place, or copied
   into vpack when this path cannot read their format or their rows are not
   whole vectors), 4 rows at a time, prefetching the next block's keys. */
static void FN(few_rows_mix)(const mh_attn_args *a, int64_t pair, int64_t nq, int64_t k0,
                             int64_t nk, int select, FN(work) *w)
{
    const int64_t evp = w->evp, nvv = (a->v_dim + VW - 1) / VW;
    const int64_t pk = k0 + BK + MH_AHEAD(a); /* a next block's keys (int4: the one after) */
    FN(kv_rows) pf = w->prefetch && w->k_in_place && pk + nk <= a->kv_len
                         ? FN(kv_in_place)(a, &a->k, &a->k_scale, pair, pk) : FN(no_rows);
    FN(kv_rows) vr;
    int fmt = MH_NATIVE;
    if (w->v_in_place) {
        fmt = a->kv_format;
        vr = FN(kv_in_place)(a, &a->v, &a->v_scale, pair, k0);
    } else {
        FN(load_rows)(a, &a->v, &a->v_scale, pair, k0, nk, a->v_dim, w->vpack, evp);
        vr = FN(no_rows);
        vr.base = (const char *)w->vpack;
        vr.row_bytes = evp * (int64_t)sizeof(T);
    }
    /* (int4 groups wider than NVO vectors: 2 rows at a time, which take whole
       groups, so each row's columns take the same path whatever the rows) */
    const int64_t rows = MH_I4_SPLIT && NVO < MH_I4_VECS && fmt == MH_STORE_I4 ? 2 : MH_FEW_ROWS;
    for (int64_t r0 = 0; r0 < nq; r0 += rows) {
        const int64_t R = nq - r0 < rows ? nq - r0 : rows;
        T *acc = w->acc + r0 * evp;
        const T *alpha = w->alpha + r0, *p = w->st + r0 * BK;
#define MH_MIX3(RR, F, S) FN(few_rows_output)(acc, evp, alpha, p, nk, vr, nvv, RR, F, S, pf)
#define MH_MIX2(RR, F) (select ? MH_MIX3(RR, F, 1) : MH_MIX3(RR, F, 0))
#define MH_MIX(RR)                                        \
        switch (fmt) {                                    \
        case MH_STORE_F16: MH_MIX2(RR, MH_STORE_F16); break;    \
        case MH_STORE_BF16: MH_MIX2(RR, MH_STORE_BF16); break;  \
        case MH_STORE_I8: MH_MIX2(RR, MH_STORE_I8); break;      \
        case MH_STORE_I4: MH_MIX2(RR, MH_STORE_I4); break;      \
        default: MH_MIX2(RR, MH_NATIVE); break;        \
        }
        switch (R) {
        case 1: MH_MIX(1); break;
        case 2: MH_MIX(2); break;
        case 3: MH_MIX(3); break;
        default: MH_MIX(4); break;
        }
        pf = FN(no_rows);
#undef MH_MIX
#undef MH_MIX2
#undef MH_MIX3
    }
}

/* The few-rows path's query rows of an item, ready for any keys: scaled (and
   widened) into qt, with int4 keys their group sums and digits in kpack; the
   padding columns of copied rows zeroed. */
static void FN(few_rows_prep)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                              FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, ep = w->ep, evp = w->evp, L = nq / mh_group(a);
    const T scale = (T)mh_score_scale(a);

    /* (local pointers: the compiler cannot know that these stores leave *w alone) */
    T *qt = w->qt;
    const V vscale = V_SET1(scale);
    for (int64_t i = 0; i < nq; ++i) {
        const int64_t off = mh_row_offset(a, &a->q, pair, q0, i, L);
        const T *q = (const T *)a->q.base + off;
        T *qi = qt + i * ep;
        int64_t d = 0;
        if (a->q_format != MH_NATIVE) { /* widened in place, then scaled */
            FN(half_or_bf16_row)(a->q_format, qi, (const uint16_t *)a->q.base + off, E);
            q = qi;
        }
        for (; d + VW <= E; d += VW) V_STORE(qi + d, V_MUL(V_LOAD(q + d), vscale));
        for (; d < E; ++d) qi[d] = q[d] * scale;
        for (; d < ep; ++d) qi[d] = 0;
    }
    if (w->k_in_place && a->kv_format == MH_STORE_I4) /* FN(i4_key_lanes)'s query sums, in kpack */
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t g = 0; g < E / MH_I4_GROUP; ++g) {
                T *qg = qt + i * ep + g * MH_I4_GROUP;
                V sum = V_ZERO();
                for (int64_t d = 0; d < MH_I4_GROUP; d += VW) sum = V_ADD(sum, V_LOAD(qg + d));
                w->kpack[i * MH_I4_MAX_GROUPS + g] = V_HSUM(sum) * ((T)1 / VW);
#if MH_I4_SPLIT
                V u[MH_I4_VECS]; /* the keys' order (FN(u4_row)) */
                for (int c = 0; c < MH_I4_VECS; ++c) u[c] = V_LOAD(qg + c * VW);
                V_SPLIT_GROUP(u);
                for (int c = 0; c < MH_I4_VECS; ++c) V_STORE(qg + c * VW, u[c]);
#endif
            }
#if MH_HAS_I4_DOTS
    if (w->k_in_place && a->kv_format == MH_STORE_I4 && FN(i4_dots_fit)(E))
        for (int64_t i = 0; i < nq; ++i) FN(i4_digits)(qt + i * ep, E, w->kpack, i);
#endif
    /* copied key / value rows: load_rows writes columns [0, E) and [0, Ev) of
       the rows it copies and the dots and the mix read only those rows, so
       only the padding columns up to ep / evp must be (finite) zeros */
    if (!w->k_in_place && ep > E)
        for (int64_t j = 0; j < BK; ++j)
            for (int64_t d = E; d < ep; ++d) w->kpack[j * ep + d] = 0;
    if (!w->v_in_place && evp > Ev)
        for (int64_t j = 0; j < BK; ++j)
            for (int64_t d = Ev; d < evp; ++d) w->vpack[j * evp + d] = 0;
}

/* No key seen yet: row maxima -inf, sums and outputs 0. */
static void FN(few_rows_reset)(FN(work) *w, int64_t nq)
{
    T *acc = w->acc;
    for (int64_t i = 0; i < nq; ++i) {
        w->row_max[i] = (T)(-INFINITY);
        w->row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * w->evp; i += VW) V_STORE(acc + i, V_ZERO());
}

/* The prepared rows (FN(few_rows_prep)) against keys [k_lo, k_hi), onto the
   running maxima, sums and outputs. */
static void FN(few_rows_blocks)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                                int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    const int64_t L = nq / mh_group(a);
    int64_t k_begin, k_end;
    mh_key_range(a, q0, L, k_lo, k_hi, &k_begin, &k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        const int cut = mh_block_is_cut(a, q0, L, k0, nk);
        const int user_hid = FN(few_rows_masked_scores)(a, pair, q0, nq, k0, nk, w);
        FN(few_rows_softmax)(w, nq, nk, cut || user_hid);
        if (a->dropout_p > 0) FN(apply_dropout)(a, pair, q0, nq, k0, nk, w->st, BK, 1);
        FN(few_rows_mix)(a, pair, nq, k0, nk, cut || user_hid, w);
    }
}

/* Few-rows path over keys [k_lo, k_hi): same results layout as attend_tile. */
static void FN(attend_few_rows)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                                int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    FN(few_rows_prep)(a, pair, q0, nq, w);
    FN(few_rows_reset)(w, nq);
    FN(few_rows_blocks)(a, pair, q0, nq, k_lo, k_hi, w);
}
