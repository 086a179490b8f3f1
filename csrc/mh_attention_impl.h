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
 *   V_HSUM(v)    sum of the lanes
 *   V_LOAD_HALF(p)  optional: VW float16 values widened to V (float paths)
 *
 * Scratch of one work item (all 64-byte aligned, T elements):
 *   qt      [E][BQ]      query block, transposed and multiplied by `scale`
 *                        (dot mode, <= MH_DOT_ROWS rows: [rows][EP] row-major)
 *   st      [BK][BQ]     one tile of scores, transposed (key-major), then
 *                        overwritten by its unnormalised probabilities
 *   acc     [BQ][EVP]    output accumulator, EVP = Ev rounded up to 16
 *   kpack   [BK][EP]     key block copied contiguous (keys of a fused QKV
 *                        buffer lie a whole row of Q, K and V apart); rows
 *                        of E, or of EP = E rounded up to 16 in dot mode
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
        T *MH_RESTRICT d = dst + j * dst_row;
        const T *MH_RESTRICT s = src + j * src_row;
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

/* dst[0..n) = float16 src[0..n) widened (vector conversion where the path has one). */
static inline void FN(half_row)(T *dst, const uint16_t *src, int64_t n)
{
    int64_t c = 0;
#ifdef V_LOAD_HALF
    for (; c + VW <= n; c += VW) V_STORE(dst + c, V_LOAD_HALF(src + c));
#endif
    for (; c < n; ++c) dst[c] = (T)mh_half_to_float(src[c]);
}

/* Keys of block [k0, k0+nk) visible to the item's first row (row i sees
   kvis0 + i of them); nk + BQ, i.e. "all", without a causal mask. */
static inline int64_t FN(causal_kvis0)(const mh_attn_args *a, int64_t q0, int64_t k0, int64_t nk)
{
    return a->causal ? q0 + a->causal_offset - k0 + 1 : nk + BQ;
}

/* Pointers into one work item's scratch (layout in the header comment). */
typedef struct {
    T *qt, *st, *acc, *kpack, *vpack, *row_max, *row_sum, *alpha;
    int64_t evp, ep;  /* padded value width; padded key row (dot mode) */
    int dot;          /* few query rows: dot-product scores instead of the tile */
} FN(work);

static FN(work) FN(carve)(const mh_attn_args *a, int64_t nq, void *scratch)
{
    FN(work) w;
    const int64_t E = a->head_dim;
    w.evp = MH_ALIGN_UP(a->v_dim, 16);
    w.ep = MH_ALIGN_UP(E, 16);
    w.dot = nq <= MH_DOT_ROWS && a->weights == NULL;
    w.qt = (T *)scratch;
    w.st = w.qt + MH_ALIGN_UP(E * BQ, 16);
    w.acc = w.st + BK * BQ;
    w.kpack = w.acc + BQ * w.evp;
    w.vpack = w.kpack + BK * w.ep;
    w.row_max = w.vpack + BK * w.evp;
    w.row_sum = w.row_max + BQ;
    w.alpha = w.row_sum + BQ;
    return w;
}

/* dst[j][0..n) = K or V rows [row0, row0 + rows) of this pair, converted from
   float16 when the cache stores halves; columns [n, dst_row) are left alone. */
static void FN(load_rows)(const mh_attn_args *a, const void *base, int64_t off, int64_t row_stride,
                          int64_t row0, int64_t rows, int64_t n, T *dst, int64_t dst_row)
{
    if (a->kv_half) {
        const uint16_t *src = (const uint16_t *)base + off + row0 * row_stride;
        for (int64_t j = 0; j < rows; ++j) FN(half_row)(dst + j * dst_row, src + j * row_stride, n);
    } else {
        FN(copy_rows)(dst, dst_row, (const T *)base + off + row0 * row_stride, row_stride, rows, n);
    }
}

/* The user mask of rows [q0, q0+nq) and keys [k0, k0+nk), applied to scores
   s[i * row_step + j * key_step] (boolean: -inf where not allowed; float: added).
   The tile layout is key-major (row_step 1, key_step BQ), the few-rows layout
   row-major (row_step BK, key_step 1). */
static void FN(apply_user_mask)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                                int64_t k0, int64_t nk, T *s, int64_t row_step,
                                int64_t key_step)
{
    if (a->mask_kind == MH_MASK_BOOL) {
        const unsigned char *m = (const unsigned char *)a->mask + a->mask_off[bh];
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t j = 0; j < nk; ++j)
                if (!m[(q0 + i) * a->mask_row + (k0 + j) * a->mask_col])
                    s[i * row_step + j * key_step] = (T)(-INFINITY);
    } else if (a->mask_kind == MH_MASK_ADD) {
        const T *m = (const T *)a->mask + a->mask_off[bh];
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t j = 0; j < nk; ++j)
                s[i * row_step + j * key_step] += m[(q0 + i) * a->mask_row + (k0 + j) * a->mask_col];
    }
}

/* Multiply probabilities p[i * row_step + j * key_step] by the dropout keep
   mask / (1 - p) (layouts as in apply_user_mask). */
static void FN(apply_dropout)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                              int64_t k0, int64_t nk, T *s, int64_t row_step, int64_t key_step)
{
    const double p = a->dropout_p;
    const T keep_scale = p >= 1.0 ? (T)0 : (T)(1.0 / (1.0 - p));
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < nk; ++j) {
            uint64_t bits = mh_dropout_bits(a->seed, (uint64_t)bh, (uint64_t)(q0 + i),
                                            (uint64_t)(k0 + j), (uint64_t)a->q_len,
                                            (uint64_t)a->kv_len);
            double u = (double)(bits >> 40) * (1.0 / 16777216.0);
            T *e = s + i * row_step + j * key_step;
            *e = u >= p ? *e * keep_scale : (T)0;
        }
}

/* Scaled scores of keys [k0, k0+nk) for the work item's rows, with the causal
   triangle, the sliding window and the user mask applied (masked entries
   become -inf).  Loads the key block into kpack first. */
static void FN(masked_scores)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                              int64_t nvq, int64_t k0, int64_t nk, FN(work) *w)
{
    const T neg_inf = (T)(-INFINITY);
    const int64_t E = a->head_dim, lanes = nvq * VW;
    T *st = w->st;
    FN(load_rows)(a, a->k, a->k_off[bh], a->k_row, k0, nk, E, w->kpack, E);
    FN(scores)(w->qt, E, w->kpack, E, nk, nvq, FN(causal_kvis0)(a, q0, k0, nk), st);
    /* only blocks that cross the diagonal need element masking */
    if (a->causal && k0 + nk - 1 > q0 + a->causal_offset) {
        for (int64_t j = 0; j < nk; ++j) {
            /* rows i < first cannot see key k0 + j (padding lanes too: keep all defined) */
            int64_t first = k0 + j - a->causal_offset - q0;
            if (first > lanes) first = lanes;
            for (int64_t i = 0; i < first; ++i) st[j * BQ + i] = neg_inf;
        }
    }
    /* sliding window: row i sees keys j > i + offset - window */
    if (a->window > 0 && k0 <= q0 + nq - 1 + a->causal_offset - a->window) {
        for (int64_t j = 0; j < nk; ++j) {
            int64_t last = k0 + j + a->window - a->causal_offset - q0; /* rows i >= last lose it */
            if (last < 0) last = 0;
            for (int64_t i = last; i < lanes; ++i) st[j * BQ + i] = neg_inf;
        }
    }
    FN(apply_user_mask)(a, bh, q0, nq, k0, nk, st, 1, BQ);
}

/* Keys any row of [q0, q0+nq) may see, intersected with [lo, hi): *begin, *end. */
static void FN(key_range)(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t lo, int64_t hi,
                          int64_t *begin, int64_t *end)
{
    int64_t b = lo, e = hi < a->kv_len ? hi : a->kv_len;
    if (a->causal) {
        const int64_t limit = q0 + nq + a->causal_offset; /* exclusive, last row */
        if (limit < e) e = limit;
        if (a->window > 0) {
            const int64_t first = q0 + a->causal_offset - a->window + 1; /* first row's start */
            if (first > b) b = first;
        }
    }
    *begin = b;
    *end = e;
}

/* acc[r] = alpha[r]*acc[r] + sum_j p[r][j] * v[j] for R (<= MH_DOT_ROWS) rows whose
   probabilities are stored key-major per row (p[r * BK + j]). */
#ifdef V_LOAD_HALF
#define MH_LOAD_KV(ptr, half) ((half) ? V_LOAD_HALF((const uint16_t *)(ptr)) : V_LOAD((const T *)(ptr)))
#else
#define MH_LOAD_KV(ptr, half) V_LOAD((const T *)(ptr))
#endif

MH_INLINE void FN(few_output)(T *acc, int64_t evp, const T *alpha, const T *p, int64_t nk,
                              const void *vbase, int64_t v_row, int64_t nvv, const int R,
                              const int half)
{
    const T *v = (const T *)vbase;
    const uint16_t *vh = (const uint16_t *)vbase;
#define MH_VROW(j, col) (half ? (const void *)(vh + (j) * v_row + (col)) \
                              : (const void *)(v + (j) * v_row + (col)))
    int64_t c = 0;
    for (; c + NVO <= nvv; c += NVO) {
        V o[MH_DOT_ROWS][NVO];
        for (int r = 0; r < R; ++r) {
            const V a = V_SET1(alpha[r]);
            for (int u = 0; u < NVO; ++u) o[r][u] = V_MUL(V_LOAD(acc + r * evp + (c + u) * VW), a);
        }
        for (int64_t j = 0; j < nk; ++j) {
            V vv[NVO];
            for (int u = 0; u < NVO; ++u) vv[u] = MH_LOAD_KV(MH_VROW(j, (c + u) * VW), half);
            for (int r = 0; r < R; ++r) {
                const V pj = V_SET1(p[r * BK + j]);
                for (int u = 0; u < NVO; ++u) o[r][u] = V_FMA(pj, vv[u], o[r][u]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < NVO; ++u) V_STORE(acc + r * evp + (c + u) * VW, o[r][u]);
    }
    for (; c < nvv; ++c) {
        V o[MH_DOT_ROWS];
        for (int r = 0; r < R; ++r) o[r] = V_MUL(V_LOAD(acc + r * evp + c * VW), V_SET1(alpha[r]));
        for (int64_t j = 0; j < nk; ++j) {
            const V vv = MH_LOAD_KV(MH_VROW(j, c * VW), half);
            for (int r = 0; r < R; ++r) o[r] = V_FMA(V_SET1(p[r * BK + j]), vv, o[r]);
        }
        for (int r = 0; r < R; ++r) V_STORE(acc + r * evp + c * VW, o[r]);
    }
#undef MH_VROW
}

/* s[i][j] = qp_i . k_j for nq rows and nk keys of nvk vectors each (keys read as
   float16 when `half`). */
MH_INLINE void FN(few_scores)(const T *qp, int64_t ep, int64_t nq, const void *kbase,
                              int64_t k_row, int64_t nk, int64_t nvk, T *s, const int half)
{
    const T *kf = (const T *)kbase;
    const uint16_t *kh = (const uint16_t *)kbase;
    for (int64_t j = 0; j < nk; ++j) {
        const void *kr = half ? (const void *)(kh + j * k_row) : (const void *)(kf + j * k_row);
        for (int64_t i = 0; i < nq; ++i) {
            const T *qr = qp + i * ep;
            V acc0 = V_ZERO(), acc1 = V_ZERO();
            int64_t c = 0;
            for (; c + 2 <= nvk; c += 2) {
                const void *k1 = half ? (const void *)((const uint16_t *)kr + c * VW)
                                      : (const void *)((const T *)kr + c * VW);
                const void *k2 = half ? (const void *)((const uint16_t *)kr + (c + 1) * VW)
                                      : (const void *)((const T *)kr + (c + 1) * VW);
                acc0 = V_FMA(V_LOAD(qr + c * VW), MH_LOAD_KV(k1, half), acc0);
                acc1 = V_FMA(V_LOAD(qr + (c + 1) * VW), MH_LOAD_KV(k2, half), acc1);
            }
            if (c < nvk) {
                const void *k1 = half ? (const void *)((const uint16_t *)kr + c * VW)
                                      : (const void *)((const T *)kr + c * VW);
                acc0 = V_FMA(V_LOAD(qr + c * VW), MH_LOAD_KV(k1, half), acc0);
            }
            s[i * BK + j] = V_HSUM(V_ADD(acc0, acc1));
        }
    }
}

/* Few query rows (decode, <= MH_DOT_ROWS): scores are kept per row and key-major,
   so the online softmax runs across keys, 16 (or 8) at a time; keys and values
   are read in place when their rows are whole vectors of the kernel's type. */
static void FN(attend_few)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq,
                           int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp, ep = w->ep;
    const T *q = (const T *)a->q + a->q_off[bh] + q0 * a->q_row;
    const T scale = (T)a->scale, neg_inf = (T)(-INFINITY);
#ifdef V_LOAD_HALF
    const int can_half = 1; /* this path widens float16 vectors while it reads */
#else
    const int can_half = 0;
#endif
    const int half = a->kv_half;
    const int k_direct = (!half || can_half) && E % VW == 0;
    const int v_direct = (!half || can_half) && Ev % VW == 0;
    const int64_t nvk = k_direct ? E / VW : ep / VW;
    const int64_t nvv = (Ev + VW - 1) / VW;
    T *qp = w->qt, *s = w->st;

    for (int64_t i = 0; i < nq; ++i) {
        for (int64_t d = 0; d < E; ++d) qp[i * ep + d] = q[i * a->q_row + d] * scale;
        for (int64_t d = E; d < ep; ++d) qp[i * ep + d] = 0;
        w->row_max[i] = neg_inf;
        w->row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * evp; ++i) w->acc[i] = 0;
    if (!k_direct)
        for (int64_t i = 0; i < BK * ep; ++i) w->kpack[i] = 0;
    if (!v_direct)
        for (int64_t i = 0; i < BK * evp; ++i) w->vpack[i] = 0;

    int64_t k_begin, k_end;
    FN(key_range)(a, q0, nq, k_lo, k_hi, &k_begin, &k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        const int64_t nk_pad = (nk + VW - 1) / VW * VW;
        /* scores s[i][j] = (scale q_i) . k_j, then every mask */
        if (k_direct && half) {
            const uint16_t *kb = (const uint16_t *)a->k + a->k_off[bh] + k0 * a->k_row;
            FN(few_scores)(qp, ep, nq, kb, a->k_row, nk, nvk, s, 1);
        } else if (k_direct) {
            const T *kb = (const T *)a->k + a->k_off[bh] + k0 * a->k_row;
            FN(few_scores)(qp, ep, nq, kb, a->k_row, nk, nvk, s, 0);
        } else {
            FN(load_rows)(a, a->k, a->k_off[bh], a->k_row, k0, nk, E, w->kpack, ep);
            FN(few_scores)(qp, ep, nq, w->kpack, ep, nk, nvk, s, 0);
        }
        FN(apply_user_mask)(a, bh, q0, nq, k0, nk, s, BK, 1);
        for (int64_t i = 0; i < nq; ++i) {
            T *sr = s + i * BK;
            const int64_t row = q0 + i;
            for (int64_t j = nk; j < nk_pad; ++j) sr[j] = neg_inf;
            if (a->causal) {
                const int64_t hi = row + a->causal_offset - k0; /* last visible j */
                for (int64_t j = (hi + 1 > 0 ? hi + 1 : 0); j < nk; ++j) sr[j] = neg_inf;
                if (a->window > 0) {
                    const int64_t lo = row + a->causal_offset - a->window - k0; /* j <= lo hidden */
                    for (int64_t j = 0; j <= lo && j < nk; ++j) sr[j] = neg_inf;
                }
            }
            /* online softmax across this block's keys */
            V mv = V_LOAD(sr);
            for (int64_t j = VW; j < nk_pad; j += VW) mv = V_MAX(mv, V_LOAD(sr + j));
            T lanes[VW];
            V_STORE(lanes, mv);
            T m_blk = lanes[0];
            for (int l = 1; l < VW; ++l) m_blk = lanes[l] > m_blk ? lanes[l] : m_blk;
            const T m_old = w->row_max[i];
            const T m_new = m_blk > m_old ? m_blk : m_old;
            const T m_use = m_new == neg_inf ? (T)0 : m_new;
            const V mu = V_SET1(m_use);
            V sum = V_ZERO();
            for (int64_t j = 0; j < nk_pad; j += VW) {
                const V p = V_EXP(V_SUB(V_LOAD(sr + j), mu));
                V_STORE(sr + j, p);
                sum = V_ADD(sum, p);
            }
            V_STORE(lanes, V_EXP(V_SET1(m_old - m_use)));
            w->alpha[i] = lanes[0];
            w->row_sum[i] = w->row_sum[i] * lanes[0] + V_HSUM(sum);
            w->row_max[i] = m_new;
        }
        if (a->dropout_p > 0) FN(apply_dropout)(a, bh, q0, nq, k0, nk, s, BK, 1);
        const void *vb;
        int64_t v_stride;
        int v_half = 0;
        if (v_direct) {
            v_half = half;
            vb = half ? (const void *)((const uint16_t *)a->v + a->v_off[bh] + k0 * a->v_row)
                      : (const void *)((const T *)a->v + a->v_off[bh] + k0 * a->v_row);
            v_stride = a->v_row;
        } else {
            FN(load_rows)(a, a->v, a->v_off[bh], a->v_row, k0, nk, Ev, w->vpack, evp);
            vb = w->vpack;
            v_stride = evp;
        }
#define MH_FEW(R)                                                                          \
    (v_half ? FN(few_output)(w->acc, evp, w->alpha, s, nk, vb, v_stride, nvv, R, 1)        \
            : FN(few_output)(w->acc, evp, w->alpha, s, nk, vb, v_stride, nvv, R, 0))
        switch (nq) {
        case 1: MH_FEW(1); break;
        case 2: MH_FEW(2); break;
        case 3: MH_FEW(3); break;
        default: MH_FEW(4); break;
        }
#undef MH_FEW
    }
}

/* Stream keys [k_lo, k_hi) through rows [q0, q0+nq): leaves the unnormalised
   output in w->acc and the running max and sum in w->row_max, w->row_sum. */
static void FN(attend)(const mh_attn_args *a, int64_t bh, int64_t q0, int64_t nq, int64_t k_lo,
                       int64_t k_hi, FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp;
    const int64_t nvq = (nq + VW - 1) / VW;
    const int64_t nvv = (Ev + VW - 1) / VW;
    const T *q = (const T *)a->q + a->q_off[bh] + q0 * a->q_row;
    const T scale = (T)a->scale;

    if (w->dot) {
        FN(attend_few)(a, bh, q0, nq, k_lo, k_hi, w);
        return;
    }
    /* transposed and pre-scaled; pad lanes with zeros */
    for (int64_t d = 0; d < E; ++d) {
        for (int64_t i = 0; i < nq; ++i) w->qt[d * BQ + i] = q[i * a->q_row + d] * scale;
        for (int64_t i = nq; i < nvq * VW; ++i) w->qt[d * BQ + i] = 0;
    }
    for (int64_t i = 0; i < BQ; ++i) {
        w->row_max[i] = (T)(-INFINITY);
        w->row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * evp; ++i) w->acc[i] = 0;
    if (nvv * VW > Ev) /* the last value vector reads padding columns: keep them 0 */
        for (int64_t i = 0; i < BK * evp; ++i) w->vpack[i] = 0;

    int64_t k_begin, k_end;
    FN(key_range)(a, q0, nq, k_lo, k_hi, &k_begin, &k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        T *st = w->st;
        FN(masked_scores)(a, bh, q0, nq, nvq, k0, nk, w);

        /* online softmax, vectorised across query rows */
        for (int64_t c = 0; c < nvq; ++c) {
            T *s = st + c * VW;
            V m_old = V_LOAD(w->row_max + c * VW);
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
            V_STORE(w->row_sum + c * VW, V_FMA(V_LOAD(w->row_sum + c * VW), al, sum));
            V_STORE(w->row_max + c * VW, m_new);
            V_STORE(w->alpha + c * VW, al);
        }
        if (a->dropout_p > 0) FN(apply_dropout)(a, bh, q0, nq, k0, nk, st, 1, BQ);

        FN(load_rows)(a, a->v, a->v_off[bh], a->v_row, k0, nk, Ev, w->vpack, evp);
        FN(mix_values)(w->acc, evp, w->alpha, st, nk, nq, w->vpack, evp, nvv,
                       FN(causal_kvis0)(a, q0, k0, nk));
    }
}

void FN(mh_fwd_item)(const mh_attn_args *a, int64_t bh, int64_t q0, void *scratch)
{
    const int64_t Ev = a->v_dim, S = a->kv_len;
    const int64_t nq = (a->q_len - q0 < BQ) ? a->q_len - q0 : BQ;
    const int64_t nvq = (nq + VW - 1) / VW;
    FN(work) w = FN(carve)(a, nq, scratch);
    T *out = (T *)a->out + a->out_off[bh] + q0 * a->out_row;

    FN(attend)(a, bh, q0, nq, 0, S, &w);

    /* normalise once; rows that saw no key have row_sum == 0 and give zeros */
    for (int64_t i = 0; i < nq; ++i) {
        const T inv = w.row_sum[i] == 0 ? (T)0 : (T)1 / w.row_sum[i];
        w.row_sum[i] = inv;
        for (int64_t d = 0; d < Ev; ++d) out[i * a->out_row + d] = w.acc[i * w.evp + d] * inv;
    }

    if (a->weights) {
        /* second sweep: recompute each tile, normalise with the final row max
           and sum, and write the dense weights of this item's rows */
        T *wt = (T *)a->weights + (bh * a->q_len + q0) * S;
        int64_t k_begin, k_end;
        FN(key_range)(a, q0, nq, 0, S, &k_begin, &k_end);
        for (int64_t i = 0; i < nvq * VW; ++i) w.row_max[i] = i < nq ? w.row_max[i] : 0;
        for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
            const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
            FN(masked_scores)(a, bh, q0, nq, nvq, k0, nk, &w);
            for (int64_t c = 0; c < nvq; ++c) {
                V m_use = V_NEG_INF_TO_ZERO(V_LOAD(w.row_max + c * VW));
                V inv = V_LOAD(w.row_sum + c * VW);
                for (int64_t j = 0; j < nk; ++j) {
                    T *s = w.st + j * BQ + c * VW;
                    V_STORE(s, V_MUL(V_EXP(V_SUB(V_LOAD(s), m_use)), inv));
                }
            }
            if (a->dropout_p > 0) FN(apply_dropout)(a, bh, q0, nq, k0, nk, w.st, 1, BQ);
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t j = 0; j < nk; ++j) wt[i * S + k0 + j] = w.st[j * BQ + i];
        }
    }
}

/* Decode split: every query row (q_len <= MH_BLOCK_Q) of pair `bh` against keys
   [split * split_keys, (split + 1) * split_keys); writes the unnormalised
   output, row max and row sum to the partial buffers for mh_merge. */
void FN(mh_split_item)(const mh_attn_args *a, int64_t bh, int64_t split, void *scratch)
{
    const int64_t L = a->q_len, Ev = a->v_dim;
    FN(work) w = FN(carve)(a, L, scratch);
    const int64_t part = bh * a->n_split + split;
    T *pacc = (T *)a->part_acc + part * L * Ev;
    T *pm = (T *)a->part_max + part * L;
    T *pl = (T *)a->part_sum + part * L;
    FN(attend)(a, bh, 0, L, split * a->split_keys, (split + 1) * a->split_keys, &w);
    for (int64_t i = 0; i < L; ++i) {
        pm[i] = w.row_max[i];
        pl[i] = w.row_sum[i];
        for (int64_t d = 0; d < Ev; ++d) pacc[i * Ev + d] = w.acc[i * w.evp + d];
    }
}

/* Merge the n_split partial results of pair `bh` in split order (so the result
   does not depend on which thread computed which split) into the output. */
void FN(mh_merge_item)(const mh_attn_args *a, int64_t bh, int64_t unused, void *scratch)
{
    const int64_t L = a->q_len, Ev = a->v_dim, ns = a->n_split;
    const T *pacc = (const T *)a->part_acc + bh * ns * L * Ev;
    const T *pm = (const T *)a->part_max + bh * ns * L;
    const T *pl = (const T *)a->part_sum + bh * ns * L;
    T *out = (T *)a->out + a->out_off[bh];
    T *acc = (T *)scratch;
    (void)unused;
    for (int64_t i = 0; i < L; ++i) {
        T m = (T)(-INFINITY);
        int has_nan = 0;
        for (int64_t s = 0; s < ns; ++s) {
            const T ms = pm[s * L + i];
            if (ms != ms) has_nan = 1;
            else if (ms > m) m = ms;
        }
        const T m_use = (m == (T)(-INFINITY)) ? (T)0 : m;
        T sum = has_nan ? (T)NAN : (T)0;
        for (int64_t d = 0; d < Ev; ++d) acc[d] = 0;
        for (int64_t s = 0; s < ns; ++s) {
            const T f = (T)exp((double)(pm[s * L + i] - m_use));
            sum += pl[s * L + i] * f;
            for (int64_t d = 0; d < Ev; ++d) acc[d] += pacc[(s * L + i) * Ev + d] * f;
        }
        const T inv = sum == 0 ? (T)0 : (T)1 / sum;
        for (int64_t d = 0; d < Ev; ++d) out[i * a->out_row + d] = acc[d] * inv;
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
#undef V_HSUM
#undef MH_LOAD_KV
#ifdef V_LOAD_HALF
#undef V_LOAD_HALF
#endif
