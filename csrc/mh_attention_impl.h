/*
 * Tiled online-softmax attention forward: one source, instantiated once per
 * (ISA, scalar type) by the per-ISA files, which define before including it:
 *
 *   T            scalar type (float or double)
 *   V            vector type holding VW lanes of T
 *   VW           lanes per vector
 *   NVQ, JR      score tile: NVQ query vectors x JR keys in registers
 *   NVO, IR      output tile: IR query rows x NVO value vectors in registers
 *   FN(x)        x with the (type, ISA) suffix appended
 *   V_ZERO() V_SET1(x) V_LOAD(p) V_STORE(p, v)          (unaligned memory)
 *   V_ADD V_SUB V_MUL V_MAX(a, b) V_FMA(a, b, c) = a*b+c
 *   V_EXP(v)     exp per lane; exp(-inf) = 0; NaN stays NaN
 *   V_NEG_INF_TO_ZERO(v)  lanes equal to -inf become 0
 *
 * Scratch of one work item (all 64-byte aligned, T elements):
 *   qt      [E][BQ]      query block, transposed and multiplied by `scale`
 *   st      [BK][BQ]     one tile of scores, transposed (key-major), then
 *                        overwritten by its unnormalised probabilities
 *   acc     [BQ][EVP]    output accumulator, EVP = Ev rounded up to 16
 *   kpack   [BK][E]      key block copied contiguous (keys of a fused QKV
 *                        buffer lie a whole row of Q, K and V apart)
 *   vpack   [BK][EVP]    value block copied contiguous, zero padded
 *   row_max, row_sum, alpha   [BQ]
 *
 * The key-major score tile makes the softmax reductions vertical: the running
 * max and sum of 16 (or 8) query rows advance with one vector op per key.
 */

#define BQ MH_BLOCK_Q
#define BK MH_BLOCK_K

#ifndef MH_IMPL_COMMON_DONE
#define MH_IMPL_COMMON_DONE
#include <math.h>
#include "mh_kernels.h"
#if defined(_MSC_VER)
#define MH_INLINE static __forceinline
#else
#define MH_INLINE static inline __attribute__((always_inline))
#endif
#define MH_ALIGN_UP(n, a) (((n) + (a) - 1) / (a) * (a))
#endif

/* dst[j][0..n) = src[j][0..n) for `rows` rows; an inline loop the compiler
   vectorises (short rows make a memcpy call per row cost more than the copy). */
static inline void FN(copy_rows)(T *dst, int64_t dst_row, const T *src, int64_t src_row,
                                 int64_t rows, int64_t n)
{
    for (int64_t j = 0; j < rows; ++j) {
        T *restrict d = dst + j * dst_row;
        const T *restrict s = src + j * src_row;
        for (int64_t c = 0; c < n; ++c) d[c] = s[c];
    }
}

/* ---- score tile: st[r][0 .. nvq*VW) = k_r . qt for R keys ---------------- */
MH_INLINE void FN(score_tile)(const T *qt, int64_t E, const T *k, int64_t k_row,
                              T *st, const int R, const int NV)
{
    V acc[JR][NVQ];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = V_ZERO();
    for (int64_t d = 0; d < E; ++d) {
        V qv[NVQ];
        for (int c = 0; c < NV; ++c) qv[c] = V_LOAD(qt + d * BQ + c * VW);
        for (int r = 0; r < R; ++r) {
            const V kb = V_SET1(k[r * k_row + d]);
            for (int c = 0; c < NV; ++c) acc[r][c] = V_FMA(kb, qv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(st + r * BQ + c * VW, acc[r][c]);
}

/* Keys of the tile that rows [0, rows_end) need: row i sees keys j < kvis0 + i. */
static inline int64_t FN(keys_needed)(int64_t kvis0, int64_t rows_end, int64_t nk)
{
    int64_t n = kvis0 + rows_end - 1;
    return n < 0 ? 0 : (n > nk ? nk : n);
}

/* st[j][i] = (scale*q_i) . k_j for j < nk keys and the first nvq query vectors.
   On a tile that crosses the causal diagonal, each group of query vectors only
   computes the keys some of its rows can see (kvis0: see keys_needed); the
   entries it skips are masked to -inf afterwards like their neighbours. */
static void FN(scores)(const T *qt, int64_t E, const T *k, int64_t k_row, int64_t nk,
                       int64_t nvq, int64_t kvis0, T *st)
{
    int64_t c = 0;
    for (; c + NVQ <= nvq; c += NVQ) {
        const int64_t nkc = FN(keys_needed)(kvis0, (c + NVQ) * VW, nk);
        int64_t j = 0;
        for (; j + JR <= nkc; j += JR)
            FN(score_tile)(qt + c * VW, E, k + j * k_row, k_row, st + j * BQ + c * VW, JR, NVQ);
        for (; j < nkc; ++j)
            FN(score_tile)(qt + c * VW, E, k + j * k_row, k_row, st + j * BQ + c * VW, 1, NVQ);
    }
    for (; c < nvq; ++c) {
        const int64_t nkc = FN(keys_needed)(kvis0, (c + 1) * VW, nk);
        int64_t j = 0;
        for (; j + JR <= nkc; j += JR)
            FN(score_tile)(qt + c * VW, E, k + j * k_row, k_row, st + j * BQ + c * VW, JR, 1);
        for (; j < nkc; ++j)
            FN(score_tile)(qt + c * VW, E, k + j * k_row, k_row, st + j * BQ + c * VW, 1, 1);
    }
}

/* ---- output tile: acc[r] = alpha[r]*acc[r] + sum_j p[j][r] * v[j] -------- */
MH_INLINE void FN(output_tile)(T *acc, int64_t evp, const T *alpha, const T *pt, int64_t nk,
                               const T *v, int64_t v_row, const int R, const int NV)
{
    V o[IR][NVO];
    for (int r = 0; r < R; ++r) {
        const V a = V_SET1(alpha[r]);
        for (int c = 0; c < NV; ++c) o[r][c] = V_MUL(V_LOAD(acc + r * evp + c * VW), a);
    }
    for (int64_t j = 0; j < nk; ++j) {
        V vv[NVO];
        for (int c = 0; c < NV; ++c) vv[c] = V_LOAD(v + j * v_row + c * VW);
        for (int r = 0; r < R; ++r) {
            const V p = V_SET1(pt[j * BQ + r]);
            for (int c = 0; c < NV; ++c) o[r][c] = V_FMA(p, vv[c], o[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(acc + r * evp + c * VW, o[r][c]);
}

/* acc[i][0 .. nvv*VW) = alpha[i]*acc[i] + P^T[:, i] . v  for i < nq; each row
   tile stops at the last key its rows can see (kvis0, as in scores). */
static void FN(mix_values)(T *acc, int64_t evp, const T *alpha, const T *st, int64_t nk,
                           int64_t nq, const T *v, int64_t v_row, int64_t nvv, int64_t kvis0)
{
    int64_t c = 0;
    for (; c + NVO <= nvv; c += NVO) {
        int64_t i = 0;
        for (; i + IR <= nq; i += IR)
            FN(output_tile)(acc + i * evp + c * VW, evp, alpha + i, st + i,
                            FN(keys_needed)(kvis0, i + IR, nk), v + c * VW, v_row, IR, NVO);
        for (; i < nq; ++i)
            FN(output_tile)(acc + i * evp + c * VW, evp, alpha + i, st + i,
                            FN(keys_needed)(kvis0, i + 1, nk), v + c * VW, v_row, 1, NVO);
    }
    for (; c < nvv; ++c) {
        int64_t i = 0;
        for (; i + IR <= nq; i += IR)
            FN(output_tile)(acc + i * evp + c * VW, evp, alpha + i, st + i,
                            FN(keys_needed)(kvis0, i + IR, nk), v + c * VW, v_row, IR, 1);
        for (; i < nq; ++i)
            FN(output_tile)(acc + i * evp + c * VW, evp, alpha + i, st + i,
                            FN(keys_needed)(kvis0, i + 1, nk), v + c * VW, v_row, 1, 1);
    }
}

/* Keys of block [k0, k0+nk) visible to the item's first row (row i sees
   kvis0 + i of them); nk + BQ, i.e. "all", without a causal mask. */
static inline int64_t FN(causal_kvis0)(const mh_attn_args *a, int64_t q0, int64_t k0, int64_t nk)
{
    return a->causal ? q0 + a->causal_offset - k0 + 1 : nk + BQ;
}

/* Scaled scores of keys [k0, k0+nk) for the work item's rows, with the causal
   triangle and the user mask applied (masked entries become -inf). */
static void FN(masked_scores)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                              int64_t nvq, int64_t k0, int64_t nk, const T *qt, const T *k,
                              T *kpack, T *st)
{
    const T neg_inf = (T)(-INFINITY);
    const int64_t E = a->head_dim;
    FN(copy_rows)(kpack, E, k + k0 * a->k_row, a->k_row, nk, E);
    FN(scores)(qt, E, kpack, E, nk, nvq, FN(causal_kvis0)(a, q0, k0, nk), st);
    /* only blocks that cross the diagonal need element masking */
    if (a->causal && k0 + nk - 1 > q0 + a->causal_offset) {
        const int64_t lanes = nvq * VW; /* padding lanes too: keep every entry defined */
        for (int64_t j = 0; j < nk; ++j) {
            /* rows i < first cannot see key k0 + j */
            int64_t first = k0 + j - a->causal_offset - q0;
            if (first > lanes) first = lanes;
            for (int64_t i = 0; i < first; ++i) st[j * BQ + i] = neg_inf;
        }
    }
    if (a->mask_kind == MH_MASK_BOOL) {
        const unsigned char *m = (const unsigned char *)a->mask + a->mask_off[bh];
        for (int64_t j = 0; j < nk; ++j)
            for (int64_t i = 0; i < nq; ++i)
                if (!m[(q0 + i) * a->mask_row + (k0 + j) * a->mask_col]) st[j * BQ + i] = neg_inf;
    } else if (a->mask_kind == MH_MASK_ADD) {
        const T *m = (const T *)a->mask + a->mask_off[bh];
        for (int64_t j = 0; j < nk; ++j)
            for (int64_t i = 0; i < nq; ++i)
                st[j * BQ + i] += m[(q0 + i) * a->mask_row + (k0 + j) * a->mask_col];
    }
}

/* Multiply probabilities by the dropout keep mask / (1 - p). */
static void FN(apply_dropout)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                              int64_t k0, int64_t nk, T *st)
{
    const double p = a->dropout_p;
    const T keep_scale = p >= 1.0 ? (T)0 : (T)(1.0 / (1.0 - p));
    for (int64_t j = 0; j < nk; ++j)
        for (int64_t i = 0; i < nq; ++i) {
            uint64_t bits = mh_dropout_bits(a->seed, (uint64_t)bh, (uint64_t)(q0 + i),
                                            (uint64_t)(k0 + j), (uint64_t)a->q_len,
                                            (uint64_t)a->kv_len);
            double u = (double)(bits >> 40) * (1.0 / 16777216.0);
            st[j * BQ + i] = u >= p ? st[j * BQ + i] * keep_scale : (T)0;
        }
}

/* y[i] = exp(x[i]) with this path's vector exp (exposed for accuracy tests). */
void FN(mh_exp_array)(const T *x, T *y, int64_t n)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW) V_STORE(y + i, V_EXP(V_LOAD(x + i)));
    if (i < n) {
        T buf[VW];
        for (int64_t l = 0; l < VW; ++l) buf[l] = i + l < n ? x[i + l] : (T)0;
        V_STORE(buf, V_EXP(V_LOAD(buf)));
        for (int64_t l = 0; i + l < n; ++l) y[i + l] = buf[l];
    }
}

void FN(mh_fwd_item)(const mh_attn_args *a, int64_t bh, int64_t q0, void *scratch)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, S = a->kv_len;
    const int64_t nq = (a->q_len - q0 < BQ) ? a->q_len - q0 : BQ;
    const int64_t nvq = (nq + VW - 1) / VW;
    const int64_t evp = MH_ALIGN_UP(Ev, 16);
    const int64_t nvv = (Ev + VW - 1) / VW;

    T *qt = (T *)scratch;
    T *st = qt + MH_ALIGN_UP(E * BQ, 16);
    T *acc = st + BK * BQ;
    T *kpack = acc + BQ * evp;
    T *vpack = kpack + MH_ALIGN_UP(BK * E, 16);
    T *row_max = vpack + BK * evp;
    T *row_sum = row_max + BQ;
    T *alpha = row_sum + BQ;

    const T *q = (const T *)a->q + a->q_off[bh] + q0 * a->q_row;
    const T *k = (const T *)a->k + a->k_off[bh];
    const T *v = (const T *)a->v + a->v_off[bh];
    T *out = (T *)a->out + a->out_off[bh] + q0 * a->out_row;
    const T scale = (T)a->scale;

    /* pack the query block transposed and pre-scaled; pad lanes with zeros */
    for (int64_t d = 0; d < E; ++d) {
        for (int64_t i = 0; i < nq; ++i) qt[d * BQ + i] = q[i * a->q_row + d] * scale;
        for (int64_t i = nq; i < nvq * VW; ++i) qt[d * BQ + i] = 0;
    }
    for (int64_t i = 0; i < BQ; ++i) {
        row_max[i] = (T)(-INFINITY);
        row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * evp; ++i) acc[i] = 0;
    for (int64_t i = 0; i < BK * evp; ++i) vpack[i] = 0; /* padding columns stay 0 */

    /* keys beyond the last row's causal limit are never touched */
    int64_t k_end = S;
    if (a->causal) {
        int64_t limit = q0 + nq + a->causal_offset; /* exclusive */
        if (limit < k_end) k_end = limit;
    }

    for (int64_t k0 = 0; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        FN(masked_scores)(a, bh, q0, nq, nvq, k0, nk, qt, k, kpack, st);

        /* online softmax, vectorised across query rows */
        for (int64_t c = 0; c < nvq; ++c) {
            T *s = st + c * VW;
            V m_old = V_LOAD(row_max + c * VW);
            V m_blk = V_LOAD(s);
            for (int64_t j = 1; j < nk; ++j) m_blk = V_MAX(m_blk, V_LOAD(s + j * BQ));
            V m_new = V_MAX(m_old, m_blk);
            V m_use = V_NEG_INF_TO_ZERO(m_new); /* rows with nothing visible yet */
            V al = V_EXP(V_SUB(m_old, m_use));
            V sum = V_ZERO();
            for (int64_t j = 0; j < nk; ++j) {
                V p = V_EXP(V_SUB(V_LOAD(s + j * BQ), m_use));
                V_STORE(s + j * BQ, p);
                sum = V_ADD(sum, p);
            }
            V_STORE(row_sum + c * VW, V_FMA(V_LOAD(row_sum + c * VW), al, sum));
            V_STORE(row_max + c * VW, m_new);
            V_STORE(alpha + c * VW, al);
        }
        if (a->dropout_p > 0) FN(apply_dropout)(a, bh, q0, nq, k0, nk, st);

        FN(copy_rows)(vpack, evp, v + k0 * a->v_row, a->v_row, nk, Ev);
        FN(mix_values)(acc, evp, alpha, st, nk, nq, vpack, evp, nvv,
                       FN(causal_kvis0)(a, q0, k0, nk));
    }

    /* normalise once; rows that saw no key have row_sum == 0 and give zeros */
    for (int64_t i = 0; i < nq; ++i) {
        const T inv = row_sum[i] == 0 ? (T)0 : (T)1 / row_sum[i];
        row_sum[i] = inv;
        for (int64_t d = 0; d < Ev; ++d) out[i * a->out_row + d] = acc[i * evp + d] * inv;
    }

    if (a->weights) {
        /* second sweep: recompute each tile, normalise with the final row max
           and sum, and write the dense weights of this item's rows */
        T *w = (T *)a->weights + (bh * a->q_len + q0) * S;
        for (int64_t i = 0; i < nvq * VW; ++i) row_max[i] = i < nq ? row_max[i] : 0;
        for (int64_t k0 = 0; k0 < k_end; k0 += BK) {
            const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
            FN(masked_scores)(a, bh, q0, nq, nvq, k0, nk, qt, k, kpack, st);
            for (int64_t c = 0; c < nvq; ++c) {
                V m_use = V_NEG_INF_TO_ZERO(V_LOAD(row_max + c * VW));
                V inv = V_LOAD(row_sum + c * VW);
                for (int64_t j = 0; j < nk; ++j) {
                    T *s = st + j * BQ + c * VW;
                    V_STORE(s, V_MUL(V_EXP(V_SUB(V_LOAD(s), m_use)), inv));
                }
            }
            if (a->dropout_p > 0) FN(apply_dropout)(a, bh, q0, nq, k0, nk, st);
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t j = 0; j < nk; ++j) w[i * S + k0 + j] = st[j * BQ + i];
        }
    }
}

/* the instantiation macros are consumed: the next instantiation redefines them */
#undef BQ
#undef BK
#undef T
#undef V
#undef VW
#undef NVQ
#undef JR
#undef NVO
#undef IR
#undef FN
#undef V_ZERO
#undef V_SET1
#undef V_LOAD
#undef V_STORE
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_MAX
#undef V_FMA
#undef V_EXP
#undef V_NEG_INF_TO_ZERO
