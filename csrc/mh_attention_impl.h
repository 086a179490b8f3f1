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
 *   V_EXP2(v)    optional: 2^x per lane for x <= 0 or NaN; 2^-inf = 0
 *   V_TRANSPOSE(r)  optional: transpose the VW x VW block held in V r[VW]
 *   V_MARK_HIDDEN(p, s), VM, V_VISIBLE(p), V_FMA_VISIBLE(a, b, c, m)
 *                optional vector selects for hidden entries (see MH_IS_HIDDEN)
 *   V_NEG_INF_TO_ZERO(v)  lanes equal to -inf become 0
 *   V_HSUM(v)    sum of the lanes
 *   V_HSUM4(a, b, c, d, out)  optional: out[0..4) = the lane sums of a, b, c, d
 *   V_LOAD_HALF(p)  optional: VW float16 values widened to V (float paths)
 *   V_LOAD_BF16(p)  optional: VW bfloat16 values widened to V (float paths)
 *   V_STORE_BF16(p, v)  optional: v rounded to VW bfloat16 values (nearest even,
 *                NaN stays NaN) stored at p (float paths)
 *   V_STORE_HALF(p, v)  optional: the same to VW IEEE half values
 *   V_LOAD_I8(p)    optional: VW int8 values converted to V (float paths)
 *   V_LOAD_U4(p)    optional: VW 4-bit values from VW/2 bytes (low nibble first) to V
 *   V_LOAD_U4_SPLIT(p, lo, hi), V_SPLIT(a, b), V_UNSPLIT(a, b)  optional (VW = 16):
 *                a group of 32 4-bit values in split order, and two vectors of
 *                channels to and from that order (see FN(u4_row))
 *   S_HALF_TO_FLOAT(h)  optional: one float16 (bits) to float in an instruction
 *   V_DPBF16(acc, a, b) and VP, VP_LOAD, VP_STORE, VP_SET1, VP_LOW, VP_HIGH,
 *   VP_AS_V, VP_PAIR, VP_INTERLEAVE   optional (float, avx512bf16): the
 *                bfloat16 pair-dot tile path, see "bfloat16 pairs" below
 *
 * A work item has two paths, which share the same three steps per key block
 * (scores with every mask applied, online softmax, value mix):
 *
 *   tile path      more than MH_FEW_ROWS query rows: the query block is
 *                  transposed so a tile of scores is key-major (st[j][i]) and
 *                  the softmax reductions run down the keys with one vector op
 *                  per key for VW query rows at once;
 *   few-rows path  up to MH_FEW_ROWS rows (decode): scores are kept per row
 *                  (s[i][j]) and the softmax runs across the keys, VW keys at a
 *                  time; keys and values are read in place when their rows are
 *                  whole vectors.
 *
 * Scores are kept in log2 units: the query is pre-scaled by scale * log2(e)
 * (the bfloat16 pair path scales the finished scores instead; an additive
 * mask is scaled by log2(e) as it is added), so the softmax uses 2^x, cheaper
 * than e^x; row_max and the split-key partial maxima are
 * in the same units.
 *
 * Scratch: see mh_scratch_layout in mh_kernels.h.
 */

#define BQ MH_BLOCK_Q
#define BK MH_BLOCK_K

#ifndef MH_IMPL_COMMON_DONE
#define MH_IMPL_COMMON_DONE
#include <math.h>
#include <string.h>
#include "mh_kernels.h"
#if defined(_MSC_VER)
#define MH_INLINE static __forceinline
#else
#define MH_INLINE static inline __attribute__((always_inline))
#endif
/* A hint that the cache line at p will be read soon (no effect where unknown). */
#if defined(__GNUC__) || defined(__clang__)
#define MH_PREFETCH(p) __builtin_prefetch(p)
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <intrin.h>
#define MH_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define MH_PREFETCH(p) ((void)(p))
#endif
/* decode asks for its rows ahead only from this many bytes of K/V a call (see
   FN(prefetch_rows)) */
#define MH_PREFETCH_MIN_BYTES (8.0 * 1024 * 1024)

/* Keys [*lo, *hi) that query row `row` may see under the causal triangle and
   the sliding window (all keys without a causal mask). */
static inline void mh_visible_keys(const mh_attn_args *a, int64_t row, int64_t *lo, int64_t *hi)
{
    *lo = 0;
    *hi = a->kv_len;
    if (a->causal.enabled) {
        const int64_t last = row + a->causal.offset; /* last visible key */
        if (last + 1 < *hi) *hi = last + 1 < 0 ? 0 : last + 1;
        if (a->causal.window > 0 && last - a->causal.window + 1 > 0)
            *lo = last - a->causal.window + 1;
    }
}

/* Keys any row of [q0, q0+nq) may see, intersected with [lo, hi): *begin, *end. */
static inline void mh_key_range(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t lo,
                                int64_t hi, int64_t *begin, int64_t *end)
{
    int64_t first_lo, first_hi, last_lo, last_hi;
    mh_visible_keys(a, q0, &first_lo, &first_hi);
    mh_visible_keys(a, q0 + nq - 1, &last_lo, &last_hi);
    *begin = lo > first_lo ? lo : first_lo;
    *end = hi < last_hi ? hi : last_hi;
}

/* 1 if some row of [q0, q0+nq) cannot see some key of [k0, k0+nk) under the
   causal triangle or the window, i.e. the block needs element masking. */
static inline int mh_block_is_cut(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t k0,
                                  int64_t nk)
{
    int64_t first_lo, first_hi, last_lo, last_hi;
    if (!a->causal.enabled) return 0;
    mh_visible_keys(a, q0, &first_lo, &first_hi);
    mh_visible_keys(a, q0 + nq - 1, &last_lo, &last_hi);
    return k0 + nk > first_hi || k0 < last_lo;
}

/* Keys of block [k0, ...) visible to the item's first row: row i of the item
   sees row0_visible + i of them (causal); "all of them" without a mask. */
static inline int64_t mh_row0_visible(const mh_attn_args *a, int64_t q0, int64_t k0, int64_t nk)
{
    return a->causal.enabled ? q0 + a->causal.offset - k0 + 1 : nk + BQ;
}

/* Keys of a block of nk that rows [0, rows_end) of the item need to compute:
   the last of those rows sees row0_visible + rows_end - 1 keys. */
static inline int64_t mh_keys_needed(int64_t row0_visible, int64_t rows_end, int64_t nk)
{
    const int64_t n = row0_visible + rows_end - 1;
    return n < 0 ? 0 : (n > nk ? nk : n);
}

/* Hidden entries.  A score that the causal triangle, the window or the user
   mask hides is -inf.  On blocks that may hold such entries the softmax stores
   their probability as -0.0 (not +0.0), and the value mix skips every entry
   so marked instead of multiplying it: 0 * NaN would be NaN, so a NaN or inf
   in a hidden key's value would reach rows that never attend to it.  Blocks
   without hidden entries take none of these selects. */
#define MH_IS_HIDDEN(x) ((x) == 0 && signbit(x))

#define MH_LOG2E 1.44269504088896340736

/* What the query is multiplied by: the call's scale, in log2 units. */
static inline double mh_score_scale(const mh_attn_args *a) { return a->scale * MH_LOG2E; }

/* A key or value block is read in place by the tile path when its row stride
   is at most this many bytes, and copied otherwise. */
#define MH_DIRECT_ROW_BYTES 1024

/* Key ranges of the block [k0, k0+nk) for rows [i, i+R) of an item starting
   at q0: j[0] .. j[3] as output_tile takes them.  Without hidden entries all
   keys are plain; with only causal/window cuts the keys every row sees are
   plain and the edges go through the select; when the user mask hid entries,
   every key the rows may see goes through the select. */
static inline void mh_tile_key_ranges(const mh_attn_args *a, int64_t q0, int64_t i, int64_t R,
                                      int64_t k0, int64_t nk, int cut, int user_hid, int64_t j[4])
{
    int64_t lo_first, hi_first, lo_last, hi_last;
    if (!cut && !user_hid) {
        j[0] = j[1] = 0;
        j[2] = j[3] = nk;
        return;
    }
    mh_visible_keys(a, q0 + i, &lo_first, &hi_first);
    mh_visible_keys(a, q0 + i + R - 1, &lo_last, &hi_last);
#define MH_CLAMP(x) ((x) - k0 < 0 ? 0 : ((x) - k0 > nk ? nk : (x) - k0))
    j[0] = MH_CLAMP(lo_first);
    j[1] = MH_CLAMP(lo_last);
    j[2] = MH_CLAMP(hi_first);
    j[3] = MH_CLAMP(hi_last);
#undef MH_CLAMP
    if (user_hid || j[2] < j[1]) j[1] = j[2] = j[0]; /* no key is plain */
}

/* Grouped query heads.  With a->group = G > 1 (decode with grouped-query
   attention) an item of the few-rows path serves the G query heads that share
   one kv head: its rows are r = g * L + i (head g of the group, query row i),
   so every key and value of the kv head is read once for all of them.  `pair`
   is then the kv pair; query and output offsets are per (pair, g). */
static inline int64_t mh_group(const mh_attn_args *a) { return a->group > 1 ? a->group : 1; }

/* Element offset of row r of the item's queries (or outputs: `op` = &a->out). */
static inline int64_t mh_row_offset(const mh_attn_args *a, const mh_operand *op, int64_t pair,
                                    int64_t q0, int64_t r, int64_t rows_per_head)
{
    const int64_t g = r / rows_per_head, i = r % rows_per_head;
    return op->off[pair * mh_group(a) + g] + (q0 + i) * op->row;
}

/* int4 rows read in place have at most this many groups (head sizes up to 512). */
#define MH_I4_MAX_GROUPS 16

/* Bytes per stored K/V element. */
static inline int64_t mh_kv_bytes(int fmt, int64_t native)
{
    return fmt == MH_KV_NATIVE ? native : (fmt == MH_KV_F16 || fmt == MH_KV_BF16) ? 2 : 1;
}

/* Row j's int8 scale (1 for the other formats). */
static inline float mh_row_scale(int fmt, const char *scale, int64_t scale_bytes, int64_t j)
{
    return fmt == MH_KV_I8 ? *(const float *)(scale + j * scale_bytes) : 1.0f;
}
#endif

#ifdef S_HALF_TO_FLOAT
#define MH_HALF_TO_FLOAT(h) S_HALF_TO_FLOAT(h)
#else
#define MH_HALF_TO_FLOAT(h) mh_half_to_float(h)
#endif

/* V_HSUM4(a, b, c, d, out): out[0..4) = the lane sums of a, b, c and d (an
   ISA may define it with fewer instructions than four V_HSUMs) */
#ifndef V_HSUM4
#define V_HSUM4(a, b, c, d, out)                                              \
    do {                                                                       \
        T *o4_ = (out);                                                        \
        o4_[0] = V_HSUM(a); o4_[1] = V_HSUM(b); o4_[2] = V_HSUM(c); o4_[3] = V_HSUM(d); \
    } while (0)
#endif

#ifdef V_EXP2
#define MH_EXP2(x) V_EXP2(x)
#else
#define MH_EXP2(x) V_EXP(V_MUL((x), V_SET1((T)0.69314718055994530942)))
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

/* dst[0..n) = bfloat16 src[0..n) widened (a 16-bit shift). */
static inline void FN(bf16_row)(T *dst, const uint16_t *src, int64_t n)
{
    int64_t c = 0;
#ifdef V_LOAD_BF16
    for (; c + VW <= n; c += VW) V_STORE(dst + c, V_LOAD_BF16(src + c));
#endif
    for (; c < n; ++c) dst[c] = (T)mh_bf16_to_float(src[c]);
}

/* dst[0..n) = 16-bit src[0..n) of format fmt (MH_KV_F16 or MH_KV_BF16) widened. */
static inline void FN(half_or_bf16_row)(int fmt, T *dst, const uint16_t *src, int64_t n)
{
    if (fmt == MH_KV_F16)
        FN(half_row)(dst, src, n);
    else
        FN(bf16_row)(dst, src, n);
}

/* dst[0..n) = int8 src[0..n) * scale. */
static inline void FN(i8_row)(T *dst, const int8_t *src, int64_t n, float scale)
{
    int64_t c = 0;
#ifdef V_LOAD_I8
    const V s = V_SET1((T)scale);
    for (; c + VW <= n; c += VW) V_STORE(dst + c, V_MUL(V_LOAD_I8(src + c), s));
#endif
    for (; c < n; ++c) dst[c] = (T)((float)src[c] * scale);
}

/* dst[0..n) = 4-bit src (two per byte, low nibble first) * scale + min, one
   (scale, min) float16 pair per MH_I4_GROUP channels; n is a multiple of the group. */
static inline void FN(i4_row)(T *dst, const uint8_t *src, int64_t n, const uint16_t *pairs)
{
    for (int64_t g = 0; g < n / MH_I4_GROUP; ++g) {
        const float scale = mh_half_to_float(pairs[2 * g]);
        const float lo = mh_half_to_float(pairs[2 * g + 1]);
        const uint8_t *b = src + g * (MH_I4_GROUP / 2);
        T *d = dst + g * MH_I4_GROUP;
        int64_t c = 0;
#ifdef V_LOAD_U4
        const V vs = V_SET1((T)scale), vlo = V_SET1((T)lo);
        for (; c + VW <= MH_I4_GROUP; c += VW) V_STORE(d + c, V_FMA(V_LOAD_U4(b + c / 2), vs, vlo));
#endif
        for (; c < MH_I4_GROUP; c += 2) {
            d[c] = (T)((float)(b[c / 2] & 15) * scale + lo);
            d[c + 1] = (T)((float)(b[c / 2] >> 4) * scale + lo);
        }
    }
}

/* ---- one work item's state ------------------------------------------------ */

/* 1 if this instantiation reads `fmt` in place as whole vectors. */
static inline int FN(reads_in_place)(int fmt)
{
    switch (fmt) {
    case MH_KV_NATIVE: return 1;
#ifdef V_LOAD_HALF
    case MH_KV_F16: return 1;
#endif
#ifdef V_LOAD_BF16
    case MH_KV_BF16: return 1;
#endif
#if defined(V_LOAD_I8) && defined(V_LOAD_U4)
    case MH_KV_I8: case MH_KV_I4: return 1;
#endif
    default: return 0;
    }
}

/* Pointers into one work item's scratch (mh_scratch_plan) and flags. */
typedef struct {
    T *qt, *st, *acc, *kpack, *vpack, *row_max, *row_sum, *alpha;
    int64_t ep, evp;   /* E and Ev rounded up to 16 */
    int few_rows;      /* the few-rows path serves this item */
    int k_in_place;    /* few-rows path: keys read in place (rows of whole vectors) */
    int v_in_place;    /* few-rows path: values read in place */
    int k_direct;      /* tile path: keys read in place (native type, short row stride) */
    int v_direct;      /* tile path: values read in place (and rows of whole vectors) */
    int dp;            /* tile path: bfloat16 pair dot products (see "bfloat16 pairs") */
    uint32_t *pt2;     /* dp: the probabilities as bfloat16 pairs of keys */
    /* tile path, a->kv_widened_rows: this thread's widened rows (header: the
       pair, the rows done; keys [rows][E], values [rows][evp]) or NULL */
    int64_t *wid;
    T *kwid, *vwid;
    int prefetch;      /* few-rows path: FN(prefetch_rows) along the key and value streams */
} FN(work);

static FN(work) FN(carve)(const mh_attn_args *a, int64_t nq, void *scratch)
{
    const mh_scratch_layout s = mh_scratch_plan(a->head_dim, a->v_dim);
    T *base = (T *)scratch;
    FN(work) w;
    /* formats this path widens while it reads; the others go through load_rows
       into kpack / vpack */
    const int widens = FN(reads_in_place)(a->kv_format);
    w.qt = base + s.qt;
    w.st = base + s.st;
    w.acc = base + s.acc;
    w.kpack = base + s.kpack;
    w.vpack = base + s.vpack;
    w.row_max = base + s.row_max;
    w.row_sum = base + s.row_sum;
    w.alpha = base + s.alpha;
    w.pt2 = (uint32_t *)(base + s.pt2);
    w.ep = s.ep;
    w.evp = s.evp;
    w.few_rows = (nq <= MH_FEW_ROWS || a->group > 1) && a->weights == NULL;
    w.k_in_place = widens && a->head_dim % VW == 0 &&
                   (a->kv_format != MH_KV_I4 || a->head_dim <= MH_I4_MAX_GROUPS * MH_I4_GROUP);
    w.v_in_place = widens && a->v_dim % VW == 0 &&
                   (a->kv_format != MH_KV_I4 || a->v_dim <= MH_I4_MAX_GROUPS * MH_I4_GROUP);
    /* the tile path reads a block's rows many times: in place only when they
       lie close together (a long row stride would map them onto few cache
       sets); otherwise they are copied into kpack / vpack */
    w.k_direct = a->kv_format == MH_KV_NATIVE &&
                 a->k.row * (int64_t)sizeof(T) <= MH_DIRECT_ROW_BYTES;
    w.v_direct = a->kv_format == MH_KV_NATIVE && a->v_dim % VW == 0 &&
                 a->v.row * (int64_t)sizeof(T) <= MH_DIRECT_ROW_BYTES;
#ifdef V_DPBF16
    w.dp = !w.few_rows && a->kv_format == MH_KV_BF16 && a->q_format == MH_KV_BF16 &&
           a->head_dim % 2 == 0;
#else
    w.dp = 0;
#endif
    w.wid = 0;
    w.kwid = w.vwid = 0;
    {   /* the call's keys and values, in bytes (int4: half a byte an element) */
        const double elems = (double)a->n_pairs * (double)a->kv_len * (double)(a->head_dim + a->v_dim);
        const double bytes = a->kv_format == MH_KV_I4 ? elems / 2
                                                      : elems * (double)mh_kv_bytes(a->kv_format, sizeof(T));
        w.prefetch = bytes >= MH_PREFETCH_MIN_BYTES;
    }
    if (!w.few_rows && !w.dp && sizeof(T) == sizeof(float) && a->kv_widened_rows >= a->kv_len &&
        (a->kv_format == MH_KV_F16 || a->kv_format == MH_KV_BF16)) {
        w.wid = (int64_t *)((char *)scratch + mh_scratch_stride(a->head_dim, a->v_dim, sizeof(T)));
        w.kwid = (T *)((char *)w.wid + MH_SCRATCH_ALIGN);
        w.vwid = w.kwid + a->kv_len * a->head_dim;
    }
    return w;
}

/* dst[j][0..n) = K or V rows [row0, row0 + rows) of this pair, widened from the
   storage format (see mh_kv_format; `scale` is the matching k_scale / v_scale);
   columns [n, dst_row) are left alone. */
static void FN(load_rows)(const mh_attn_args *a, const mh_operand *src,
                          const mh_operand *scale, int64_t pair, int64_t row0, int64_t rows,
                          int64_t n, T *dst, int64_t dst_row)
{
    const int64_t start = src->off[pair] + row0 * src->row;
    switch (a->kv_format) {
    case MH_KV_F16: {
        const uint16_t *p = (const uint16_t *)src->base + start;
        for (int64_t j = 0; j < rows; ++j) FN(half_row)(dst + j * dst_row, p + j * src->row, n);
        break;
    }
    case MH_KV_BF16: {
        const uint16_t *p = (const uint16_t *)src->base + start;
        for (int64_t j = 0; j < rows; ++j) FN(bf16_row)(dst + j * dst_row, p + j * src->row, n);
        break;
    }
    case MH_KV_I8: {
        const int8_t *p = (const int8_t *)src->base + start;
        const float *s = (const float *)scale->base + scale->off[pair] + row0 * scale->row;
        for (int64_t j = 0; j < rows; ++j)
            FN(i8_row)(dst + j * dst_row, p + j * src->row, n, s[j * scale->row]);
        break;
    }
    case MH_KV_I4: {
        const uint8_t *p = (const uint8_t *)src->base + start;
        const uint16_t *s = (const uint16_t *)scale->base + scale->off[pair] + row0 * scale->row;
        for (int64_t j = 0; j < rows; ++j)
            FN(i4_row)(dst + j * dst_row, p + j * src->row, n, s + j * scale->row);
        break;
    }
    default:
        FN(copy_rows)(dst, dst_row, (const T *)src->base + start, src->row, rows, n);
    }
}

/* ---- masks and dropout, on either score layout ------------------------------
   Scores s[i * row_step + j * key_step] of rows [q0, q0+rows) and keys
   [k0, k0+nk): the tile is key-major (row_step 1, key_step BQ), the few-rows
   layout row-major (row_step BK, key_step 1). */

/* -inf where the causal triangle or the window hides the key (called only
   with a causal mask).  Each run of hidden entries is contiguous in memory:
   per row in the row-major layout, per key in the key-major one. */
static void FN(mask_causal_window)(const mh_attn_args *a, int64_t q0, int64_t rows, int64_t k0,
                                   int64_t nk, T *s, int64_t row_step, int64_t key_step)
{
    const T neg_inf = (T)(-INFINITY);
    if (row_step == 1) {
        /* key j: rows [0, before) see only earlier keys, rows [after, rows)
           have left it behind their window */
        const int64_t off = k0 - q0 - a->causal.offset;
        for (int64_t j = 0; j < nk; ++j) {
            int64_t before = off + j;
            int64_t after = a->causal.window > 0 ? off + j + a->causal.window : rows;
            before = before < 0 ? 0 : (before > rows ? rows : before);
            after = after < before ? before : (after > rows ? rows : after);
            T *sj = s + j * key_step;
            for (int64_t i = 0; i < before; ++i) sj[i] = neg_inf;
            for (int64_t i = after; i < rows; ++i) sj[i] = neg_inf;
        }
        return;
    }
    for (int64_t i = 0; i < rows; ++i) {
        int64_t lo, hi;
        mh_visible_keys(a, q0 + i, &lo, &hi);
        lo -= k0;
        hi -= k0;
        if (lo > nk) lo = nk;
        if (hi < 0) hi = 0;
        for (int64_t j = 0; j < lo; ++j) s[i * row_step + j * key_step] = neg_inf;
        for (int64_t j = hi; j < nk; ++j) s[i * row_step + j * key_step] = neg_inf;
    }
}

/* The user mask (boolean: -inf where not allowed; float: added, in log2 units).  Returns 1
   if it may have hidden an entry (a False, or an added -inf), 0 if not. */
static int FN(mask_user)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t rows,
                         int64_t k0, int64_t nk, T *s, int64_t row_step, int64_t key_step)
{
    const mh_operand *m = &a->mask;
    int hid = 0;
    if (a->mask_kind == MH_MASK_BOOL) {
        const unsigned char *mb = (const unsigned char *)m->base + m->off[pair];
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < nk; ++j)
                if (!mb[(q0 + i) * m->row + (k0 + j) * m->col]) {
                    s[i * row_step + j * key_step] = (T)(-INFINITY);
                    hid = 1;
                }
    } else if (a->mask_kind == MH_MASK_ADD) {
        const T *mf = (const T *)m->base + m->off[pair];
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < nk; ++j) {
                const T add = mf[(q0 + i) * m->row + (k0 + j) * m->col];
                s[i * row_step + j * key_step] += add * (T)MH_LOG2E; /* log2 units */
                hid |= add == (T)(-INFINITY);
            }
    }
    return hid;
}

/* Probabilities times the dropout keep mask / (1 - p). */
static void FN(apply_dropout)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t rows,
                              int64_t k0, int64_t nk, T *s, int64_t row_step, int64_t key_step)
{
    const double p = a->dropout_p;
    const T keep_scale = p >= 1.0 ? (T)0 : (T)(1.0 / (1.0 - p));
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < nk; ++j) {
            uint64_t bits = mh_dropout_bits(a->seed, (uint64_t)pair, (uint64_t)(q0 + i),
                                            (uint64_t)(k0 + j), (uint64_t)a->q_len,
                                            (uint64_t)a->kv_len);
            double u = (double)(bits >> 40) * (1.0 / 16777216.0);
            T *e = s + i * row_step + j * key_step;
            *e = u >= p ? *e * keep_scale : (T)0;
        }
}

/* ---- tile path --------------------------------------------------------------- */

/* bfloat16 pairs (the dp path: bfloat16 queries, keys and values on a path
   with V_DPBF16).  Two neighbours along the dot product's axis are one 32-bit
   word, and one vdpbf16ps does the work of two FMAs:
     scores  qt holds the query block as words qt2[d/2][i] = (q_i[d], q_i[d+1])
             (unscaled: the words are the caller's bfloat16 numbers, so nothing
             rounds; the scale multiplies the finished scores), and each key's
             word (k[d], k[d+1]) is broadcast straight from the stored rows;
     mix     vpack holds the value block as words (v[j][e], v[j+1][e]) and pt2
             the probabilities as words (p[j][i], p[j+1][i]), rounded to
             bfloat16 (the one rounding this path adds: at most 2^-8 of each
             probability).  A pair is only taken where both keys are visible
             to every row of the output tile; keys that need the hidden-entry
             select go one at a time, widened from their half of the word,
             with the float probability. */
#ifdef V_DPBF16
static inline uint32_t mh_load_word(const uint16_t *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}
#endif

/* Score tile: st[r][c*VW ..] = k_r . qt[., c*VW ..] for R keys (R <= JR) and NV
   query vectors (NV <= NVQ); JR x NVQ accumulators stay in registers while d
   runs over the head dimension, four steps at a time. */
#define MH_SCORE_STEP(dd)                                                          \
    do {                                                                           \
        V qv_[NVQ];                                                                \
        for (int c_ = 0; c_ < NV; ++c_) qv_[c_] = V_LOAD(qt + (dd) * BQ + c_ * VW); \
        for (int r_ = 0; r_ < R; ++r_) {                                           \
            const V kb_ = V_SET1(k[r_ * k_row + (dd)]);                            \
            for (int c_ = 0; c_ < NV; ++c_) acc[r_][c_] = V_FMA(kb_, qv_[c_], acc[r_][c_]); \
        }                                                                          \
    } while (0)

MH_INLINE void FN(score_tile)(const T *qt, int64_t E, const void *kp, int64_t k_row,
                              T *st, const int R, const int NV, const int DP, T scale)
{
    V acc[JR][NVQ];
    int64_t d = 0;
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = V_ZERO();
#ifdef V_DPBF16
    if (DP) { /* qt: words [E/2][BQ]; kp: bfloat16 rows; see "bfloat16 pairs" */
        const uint32_t *qw = (const uint32_t *)qt;
        const uint16_t *kh = (const uint16_t *)kp;
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
        return;
    }
#else
    (void)DP;
    (void)scale;
#endif
    const T *k = (const T *)kp;
    for (; d + 4 <= E; d += 4) {
        MH_SCORE_STEP(d);
        MH_SCORE_STEP(d + 1);
        MH_SCORE_STEP(d + 2);
        MH_SCORE_STEP(d + 3);
    }
    for (; d < E; ++d) MH_SCORE_STEP(d);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(st + r * BQ + c * VW, acc[r][c]);
}
#undef MH_SCORE_STEP

/* Keys [0, nkc) against NV query vectors: whole JR-key tiles, then one tile
   of the keys left over.  k: the key rows (bfloat16 with DP, else T). */
MH_INLINE void FN(score_keys)(const T *qt, int64_t E, const void *k, int64_t k_row, int64_t nkc,
                              T *st, const int NV, const int DP, T scale)
{
    const int64_t row_bytes = k_row * (DP ? 2 : (int64_t)sizeof(T));
    const char *kb = (const char *)k;
    int64_t j = 0;
    for (; j + JR <= nkc; j += JR)
        FN(score_tile)(qt, E, kb + j * row_bytes, k_row, st + j * BQ, JR, NV, DP, scale);
    kb += j * row_bytes;
    st += j * BQ;
    switch (nkc - j) { /* 0 .. JR-1 keys left; the guards keep R <= JR at compile time */
#define MH_REST(n) \
    case n: if (n < JR) FN(score_tile)(qt, E, kb, k_row, st, n < JR ? n : JR, NV, DP, scale); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* st[j][i] = (s q_i) . k_j (s: mh_score_scale) for j < nk keys and the first
   nvq query vectors: s is already in qt, or, with DP, qt holds unscaled words,
   k is bfloat16 and the scores are multiplied by `scale`.  On a tile that
   crosses the causal diagonal, each group of query vectors only computes the
   keys some of its rows can see (mh_keys_needed); the entries it skips are
   masked to -inf afterwards like their neighbours. */
MH_INLINE void FN(tile_scores)(const T *qt, int64_t E, const void *k, int64_t k_row,
                                  int64_t nk, int64_t nvq, int64_t row0_visible, T *st,
                                  const int DP, T scale)
{
    int64_t c = 0;
    for (; c + NVQ <= nvq; c += NVQ)
        FN(score_keys)(qt + c * VW, E, k, k_row, mh_keys_needed(row0_visible, (c + NVQ) * VW, nk),
                       st + c * VW, NVQ, DP, scale);
    switch (nvq - c) { /* 0 .. NVQ-1 query vectors left */
#define MH_REST(n) case n: if (n < NVQ) FN(score_keys)(qt + c * VW, E, k, k_row, \
        mh_keys_needed(row0_visible, (c + n) * VW, nk), st + c * VW, n < NVQ ? n : NVQ, DP, \
        scale); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* Keys and values [from, to) of pair `pair` widened into this thread's area
   (w->wid: keys [kv_len][E], values [kv_len][evp] zero padded). */
static void FN(widen_range)(const mh_attn_args *a, int64_t pair, int64_t from, int64_t to,
                            FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp;
    FN(load_rows)(a, &a->k, &a->k_scale, pair, from, to - from, E, w->kwid + from * E, E);
    FN(load_rows)(a, &a->v, &a->v_scale, pair, from, to - from, Ev, w->vwid + from * evp, evp);
    for (int64_t j = from; j < to; ++j)
        for (int64_t d = Ev; d < evp; ++d) w->vwid[j * evp + d] = 0;
}

/* Rows [k0, k0 + nk) of pair `pair` widened in this thread's area: the header
   holds the pair and the rows [lo, hi) already there, which grow to cover
   each block the pair's next query blocks on this thread ask for, so no row
   is widened twice (and, with a window, rows no block sees are not). */
static void FN(widen_block)(const mh_attn_args *a, int64_t pair, int64_t k0, int64_t nk,
                            FN(work) *w)
{
    int64_t *hdr = w->wid; /* pair, lo, hi */
    if (hdr[0] != pair || hdr[1] >= hdr[2]) {
        hdr[0] = pair;
        hdr[1] = hdr[2] = k0;
    }
    if (k0 < hdr[1]) {
        FN(widen_range)(a, pair, k0, hdr[1], w);
        hdr[1] = k0;
    }
    if (k0 + nk > hdr[2]) {
        FN(widen_range)(a, pair, hdr[2], k0 + nk, w);
        hdr[2] = k0 + nk;
    }
}

/* Step 1: scaled scores of keys [k0, k0+nk) for the item's rows (and the
   vector padding lanes after them), every mask applied (-inf = hidden).
   Reads the key block in place, from the thread's widened rows, or copies it
   into kpack first.  Returns 1 if the user mask may have hidden an entry. */

static int FN(tile_masked_scores)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                                  int64_t nvq, int64_t k0, int64_t nk, FN(work) *w)
{
    const int64_t E = a->head_dim;
    if (w->dp) { /* bfloat16 key rows in place, or copied when far apart */
#ifdef V_DPBF16
        const uint16_t *kh = (const uint16_t *)a->k.base + a->k.off[pair] + k0 * a->k.row;
        int64_t kh_row = a->k.row;
        if (kh_row * 2 > MH_DIRECT_ROW_BYTES) {
            uint16_t *dst = (uint16_t *)w->kpack;
            for (int64_t j = 0; j < nk; ++j) memcpy(dst + j * E, kh + j * kh_row, 2 * (size_t)E);
            kh = dst;
            kh_row = E;
        }
        FN(tile_scores)(w->qt, E, kh, kh_row, nk, nvq, mh_row0_visible(a, q0, k0, nk), w->st,
                        1, (T)mh_score_scale(a));
#endif
    } else {
        const T *k = w->kpack;
        int64_t k_row = E;
        if (w->k_direct) {
            k = (const T *)a->k.base + a->k.off[pair] + k0 * a->k.row;
            k_row = a->k.row;
        } else if (w->wid) {
            FN(widen_block)(a, pair, k0, nk, w);
            k = w->kwid + k0 * E;
        } else {
            FN(load_rows)(a, &a->k, &a->k_scale, pair, k0, nk, E, w->kpack, E);
        }
        FN(tile_scores)(w->qt, E, k, k_row, nk, nvq, mh_row0_visible(a, q0, k0, nk), w->st, 0,
                        (T)1);
    }
    /* only blocks that cross the diagonal or the window edge need element
       masking; padding lanes are masked too so every entry is defined */
    if (mh_block_is_cut(a, q0, nq, k0, nk))
        FN(mask_causal_window)(a, q0, nvq * VW, k0, nk, w->st, 1, BQ);
    return FN(mask_user)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
}

/* p where s is not -inf; -0.0 where it is (the mark of a hidden entry). */
MH_INLINE V FN(mark_hidden)(V p, V s)
{
#ifdef V_MARK_HIDDEN
    return V_MARK_HIDDEN(p, s);
#else
    T pl[VW], sl[VW];
    V_STORE(pl, p);
    V_STORE(sl, s);
    for (int l = 0; l < VW; ++l)
        if (sl[l] == (T)(-INFINITY)) pl[l] = (T)(-0.0);
    return V_LOAD(pl);
#endif
}

/* Step 2: online softmax, vectorised across query rows: st becomes the
   unnormalised probabilities, alpha the rescale of the accumulator.  With
   `mark`, hidden entries (-inf) become -0.0 so the mix can skip them. */
static void FN(tile_softmax)(FN(work) *w, int64_t nvq, int64_t nk, int mark)
{
    for (int64_t c = 0; c < nvq; ++c) {
        T *s = w->st + c * VW;
        const V m_old = V_LOAD(w->row_max + c * VW);
        /* four running maxima and two running sums: short dependency chains */
        V mx[4] = {m_old, m_old, m_old, m_old}, sum[2] = {V_ZERO(), V_ZERO()};
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4)
            for (int u = 0; u < 4; ++u) mx[u] = V_MAX(mx[u], V_LOAD(s + (j + u) * BQ));
        for (; j < nk; ++j) mx[0] = V_MAX(mx[0], V_LOAD(s + j * BQ));
        const V m_new = V_MAX(V_MAX(mx[0], mx[1]), V_MAX(mx[2], mx[3]));
        const V m_use = V_NEG_INF_TO_ZERO(m_new); /* rows with nothing visible yet */
        const V al = MH_EXP2(V_SUB(m_old, m_use));
        if (mark) {
            for (j = 0; j < nk; ++j) {
                const V sj = V_LOAD(s + j * BQ);
                const V p = FN(mark_hidden)(MH_EXP2(V_SUB(sj, m_use)), sj);
                V_STORE(s + j * BQ, p);
                sum[j & 1] = V_ADD(sum[j & 1], p);
            }
        } else {
            for (j = 0; j + 2 <= nk; j += 2)
                for (int u = 0; u < 2; ++u) {
                    const V p = MH_EXP2(V_SUB(V_LOAD(s + (j + u) * BQ), m_use));
                    V_STORE(s + (j + u) * BQ, p);
                    sum[u] = V_ADD(sum[u], p);
                }
            if (j < nk) {
                const V p = MH_EXP2(V_SUB(V_LOAD(s + j * BQ), m_use));
                V_STORE(s + j * BQ, p);
                sum[0] = V_ADD(sum[0], p);
            }
        }
        V_STORE(w->row_sum + c * VW,
                V_FMA(V_LOAD(w->row_sum + c * VW), al, V_ADD(sum[0], sum[1])));
        V_STORE(w->row_max + c * VW, m_new);
        V_STORE(w->alpha + c * VW, al);
    }
}

/* acc + p*x, or acc unchanged when the probability ps is marked hidden (p is ps,
   or ps times an int8 row's scale: the mark is read from ps, which a NaN scale
   cannot unmark). */
MH_INLINE V FN(fma_visible)(T ps, V p, V x, V acc)
{
#ifdef V_FMA_VISIBLE
    return V_FMA_VISIBLE(p, x, acc, V_VISIBLE(V_SET1(ps)));
#else
    return MH_IS_HIDDEN(ps) ? acc : V_FMA(p, x, acc);
#endif
}

/* Value vector c of key jj: from T rows, or (DP) from its half of the pair word. */
#ifdef V_DPBF16
#define MH_VALUE(jj, c)                                                              \
    (DP ? (((jj) & 1) ? VP_HIGH(VP_LOAD((const uint32_t *)v + ((jj) >> 1) * v_row + (c) * VW)) \
                      : VP_LOW(VP_LOAD((const uint32_t *)v + ((jj) >> 1) * v_row + (c) * VW))) \
        : V_LOAD(v + (jj) * v_row + (c) * VW))
#else
#define MH_VALUE(jj, c) V_LOAD(v + (jj) * v_row + (c) * VW)
#endif

/* One key of the output tile: o[r][c] += p[j][r] * v[j][c]; with `select`,
   entries marked hidden (p == -0.0) are skipped rather than multiplied. */
#define MH_MIX_KEY(jj, select)                                                       \
    do {                                                                             \
        V vv_[NVO];                                                                  \
        for (int c_ = 0; c_ < NV; ++c_) vv_[c_] = MH_VALUE(jj, c_);                   \
        for (int r_ = 0; r_ < R; ++r_) {                                             \
            const T ps_ = pt[(jj) * BQ + r_];                                         \
            const V p_ = V_SET1(ps_);                                                \
            for (int c_ = 0; c_ < NV; ++c_)                                          \
                o[r_][c_] = (select) ? FN(fma_visible)(ps_, p_, vv_[c_], o[r_][c_])  \
                                     : V_FMA(p_, vv_[c_], o[r_][c_]);                \
        }                                                                            \
    } while (0)

#ifdef V_DPBF16
/* Keys 2*j2 and 2*j2+1 of the output tile (DP): one vdpbf16ps per row and vector. */
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
#endif

/* acc[r] = alpha[r]*acc[r] + sum_j p[j][r] * v[j] for R rows (R <= IR) and NV
   value vectors (NV <= NVO): keys [j1, j2) are visible to every row; keys
   [j0, j1) and [j2, j3) only to some, so they go through the select.  The
   rescale is skipped when no row's running max moved (alpha == 1).  With DP,
   v holds pair words (v_row words per pair of keys) and the keys of [j1, j2)
   go in pairs with the probability words pw. */
MH_INLINE void FN(output_tile)(T *acc, int64_t evp, const T *alpha, const T *pt,
                               const uint32_t *pw, const T *v, int64_t v_row, int64_t j0,
                               int64_t j1, int64_t j2, int64_t j3, const int R, const int NV,
                               const int DP)
{
    V o[IR][NVO];
    int moved = 0;
    for (int r = 0; r < R; ++r) moved |= alpha[r] != (T)1;
    if (moved) {
        for (int r = 0; r < R; ++r) {
            const V a = V_SET1(alpha[r]);
            for (int c = 0; c < NV; ++c) o[r][c] = V_MUL(V_LOAD(acc + r * evp + c * VW), a);
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < NV; ++c) o[r][c] = V_LOAD(acc + r * evp + c * VW);
    }
    int64_t j = j0;
    for (; j < j1; ++j) MH_MIX_KEY(j, 1);
#ifdef V_DPBF16
    if (DP) {
        if ((j & 1) && j < j2) {
            MH_MIX_KEY(j, 0);
            ++j;
        }
        for (; j + 2 <= j2; j += 2) MH_MIX_PAIR(j >> 1);
    }
#else
    (void)pw;
    (void)DP;
#endif
    for (; j < j2; ++j) MH_MIX_KEY(j, 0);
    for (; j < j3; ++j) MH_MIX_KEY(j, 1);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(acc + r * evp + c * VW, o[r][c]);
}
#undef MH_MIX_KEY
#undef MH_VALUE
#ifdef MH_MIX_PAIR
#undef MH_MIX_PAIR
#endif

/* Output tiles of rows [0, nq) for NV value vectors starting at column vector c. */
MH_INLINE void FN(mix_rows)(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                            int cut, int user_hid, const T *v, int64_t v_row, int64_t c,
                            FN(work) *w, const int NV, const int DP)
{
    const int64_t evp = w->evp;
    int64_t i = 0, j[4];
    /* (DP: v holds 32-bit words, as many per pair of keys as T per key otherwise) */
    v += c * VW;
    for (; i + IR <= nq; i += IR) {
        mh_tile_key_ranges(a, q0, i, IR, k0, nk, cut, user_hid, j);
        FN(output_tile)(w->acc + i * evp + c * VW, evp, w->alpha + i, w->st + i, w->pt2 + i, v,
                        v_row, j[0], j[1], j[2], j[3], IR, NV, DP);
    }
    if (i < nq) mh_tile_key_ranges(a, q0, i, nq - i, k0, nk, cut, user_hid, j);
    switch (nq - i) { /* 0 .. IR-1 rows left */
#define MH_REST(n)                                                                              \
    case n: if (n < IR) FN(output_tile)(w->acc + i * evp + c * VW, evp, w->alpha + i, w->st + i, \
                                        w->pt2 + i, v, v_row, j[0], j[1], j[2], j[3],            \
                                        n < IR ? n : IR, NV, DP); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* The value vectors of the block, NVO at a time, for every row tile. */
MH_INLINE void FN(mix_columns)(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t k0,
                               int64_t nk, int cut, int user_hid, const T *v, int64_t v_row,
                               FN(work) *w, const int DP)
{
    const int64_t nvv = (a->v_dim + VW - 1) / VW;
    int64_t c = 0;
    for (; c + NVO <= nvv; c += NVO)
        FN(mix_rows)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, c, w, NVO, DP);
    switch (nvv - c) { /* 0 .. NVO-1 value vectors left */
#define MH_REST(n)                                                                         \
    case n: if (n < NVO) FN(mix_rows)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, c, w, \
                                      n < NVO ? n : NVO, DP); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* Step 3: acc[i][0 .. nvv*VW) = alpha[i]*acc[i] + P^T[:, i] . v for i < nq,
   the value block read in place or copied into vpack first (DP: interleaved
   into pair words in vpack, and the probabilities into pt2); each row tile
   stops at the last key its rows can see. */
static void FN(tile_mix)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                         int64_t k0, int64_t nk, int cut, int user_hid, FN(work) *w)
{
    if (w->dp) {
#ifdef V_DPBF16
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
        FN(mix_columns)(a, q0, nq, k0, nk, cut, user_hid, (const T *)vw, w->evp, w, 1);
#endif
    } else {
        const T *v = w->vpack;
        int64_t v_row = w->evp;
        if (w->v_direct) {
            v = (const T *)a->v.base + a->v.off[pair] + k0 * a->v.row;
            v_row = a->v.row;
        } else if (w->wid) { /* (widened with the keys of this block) */
            v = w->vwid + k0 * w->evp;
        } else {
            FN(load_rows)(a, &a->v, &a->v_scale, pair, k0, nk, a->v_dim, w->vpack, w->evp);
        }
        FN(mix_columns)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, w, 0);
    }
}

/* qt[d][i] = scale * q[i][d] for rows i < nq; 0 in the padding lanes up to
   nvq * VW.  Whole VW x VW blocks go through the path's vector transpose. */
static void FN(load_qt)(const T *q, int64_t q_row, int64_t nq, int64_t nvq, int64_t E, T scale,
                        T *qt)
{
    int64_t d0 = 0;
#ifdef V_TRANSPOSE
    const V vs = V_SET1(scale);
    for (; d0 + VW <= E; d0 += VW)
        for (int64_t i0 = 0; i0 < nvq * VW; i0 += VW) {
            V r[VW];
            for (int l = 0; l < VW; ++l)
                r[l] = i0 + l < nq ? V_MUL(V_LOAD(q + (i0 + l) * q_row + d0), vs) : V_ZERO();
            V_TRANSPOSE(r);
            for (int l = 0; l < VW; ++l) V_STORE(qt + (d0 + l) * BQ + i0, r[l]);
        }
#endif
    for (int64_t d = d0; d < E; ++d) {
        for (int64_t i = 0; i < nq; ++i) qt[d * BQ + i] = q[i * q_row + d] * scale;
        for (int64_t i = nq; i < nvq * VW; ++i) qt[d * BQ + i] = 0;
    }
}

#ifdef V_DPBF16
/* DP: qt[d/2][i] = the word (q[i][d], q[i][d+1]) of bfloat16 rows q for
   i < nq (the 32-bit view of each row, transposed), 0 in the padding lanes up
   to nvq * VW. */
static void FN(load_qt_words)(const uint16_t *q, int64_t q_row, int64_t nq, int64_t nvq,
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
#endif

/* Tile path over keys [k_lo, k_hi): leaves the unnormalised output in w->acc
   and the running max and sum in w->row_max, w->row_sum. */
static void FN(attend_tile)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                            int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp;
    const int64_t nvq = (nq + VW - 1) / VW, nvv = (Ev + VW - 1) / VW;
    const int64_t q_start = a->q.off[pair] + q0 * a->q.row;

    if (w->dp) {
#ifdef V_DPBF16
        FN(load_qt_words)((const uint16_t *)a->q.base + q_start, a->q.row, nq, nvq, E,
                          (uint32_t *)w->qt);
#endif
    } else {
        const T *q = (const T *)a->q.base + q_start;
        int64_t q_row = a->q.row;
        if (a->q_format != MH_KV_NATIVE) { /* widened into kpack, free until the first key block */
            for (int64_t i = 0; i < nq; ++i)
                FN(half_or_bf16_row)(a->q_format, w->kpack + i * w->ep,
                                     (const uint16_t *)a->q.base + q_start + i * a->q.row, E);
            q = w->kpack;
            q_row = w->ep;
        }
        FN(load_qt)(q, q_row, nq, nvq, E, (T)mh_score_scale(a), w->qt);
    }
    for (int64_t i = 0; i < BQ; ++i) {
        w->row_max[i] = (T)(-INFINITY);
        w->row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * evp; i += VW) V_STORE(w->acc + i, V_ZERO());
    /* the last value vector reads padding columns: keep them 0 */
    if (!w->v_direct && nvv * VW > Ev)
        for (int64_t i = 0; i < BK * evp; ++i) w->vpack[i] = 0;

    int64_t k_begin, k_end;
    mh_key_range(a, q0, nq, k_lo, k_hi, &k_begin, &k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        const int cut = mh_block_is_cut(a, q0, nq, k0, nk);
        const int user_hid = FN(tile_masked_scores)(a, pair, q0, nq, nvq, k0, nk, w);
        FN(tile_softmax)(w, nvq, nk, cut || user_hid);
        if (a->dropout_p > 0) FN(apply_dropout)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
        FN(tile_mix)(a, pair, q0, nq, k0, nk, cut, user_hid, w);
    }
}

/* ---- few-rows path ----------------------------------------------------------- */





/* An int4 row's (scale, min) pairs: 2 * groups float16 bits widened into sm. */
MH_INLINE void FN(i4_pairs)(const uint16_t *pairs, int64_t groups, float *sm)
{
    int64_t h = 0;
#ifdef S4_HALF_TO_FLOAT
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
#ifdef V_LOAD_HALF
    case MH_KV_F16: return V_LOAD_HALF((const uint16_t *)row + col);
#endif
#ifdef V_LOAD_BF16
    case MH_KV_BF16: return V_LOAD_BF16((const uint16_t *)row + col);
#endif
#if defined(V_LOAD_I8) && defined(V_LOAD_U4)
    case MH_KV_I8: return V_LOAD_I8((const int8_t *)row + col);
    case MH_KV_I4: {
        const int64_t g = col / MH_I4_GROUP;
        return V_FMA(V_LOAD_U4((const uint8_t *)row + col / 2), V_SET1((T)sm[2 * g]),
                     V_SET1((T)sm[2 * g + 1]));
    }
#endif
    default: return V_LOAD((const T *)row + col);
    }
}

/* Where the keys (or values) of rows [k0, ...) of a pair are, in place. */
typedef struct {
    const char *base; int64_t row_bytes; /* row j at base + j * row_bytes */
    int64_t data_bytes; /* the bytes a row holds (<= row_bytes) */
    const char *scale; int64_t scale_bytes; /* int8 / int4: row j's scale(s) */
} FN(kv_rows);

static FN(kv_rows) FN(kv_in_place)(const mh_attn_args *a, const mh_operand *src,
                                   const mh_operand *scale, int64_t pair, int64_t k0)
{
    const int64_t eb = mh_kv_bytes(a->kv_format, (int64_t)sizeof(T));
    FN(kv_rows) r;
    const int64_t n = src == &a->k ? a->head_dim : a->v_dim;
    r.base = (const char *)src->base + (src->off[pair] + k0 * src->row) * eb;
    r.row_bytes = src->row * eb;
    r.data_bytes = a->kv_format == MH_KV_I4 ? n / 2 : n * eb;
    r.scale = 0;
    r.scale_bytes = 0;
    if (a->kv_format == MH_KV_I8 || a->kv_format == MH_KV_I4) {
        const int64_t sb = a->kv_format == MH_KV_I8 ? 4 : 2; /* float32 / float16 */
        r.scale = (const char *)scale->base + (scale->off[pair] + k0 * scale->row) * sb;
        r.scale_bytes = scale->row * sb;
    }
    return r;
}


/* Decode streams two arrays, the keys while it takes the scores and then the
   values while it mixes them.  Each phase asks for the other array's rows at
   the pace it reads its own: the scores for the same block's values, the mix
   for the next block's keys.  So both streams stay in flight, and the hardware
   prefetchers do not start again from a cold page at every block.  Measured
   on one decode call (12 heads of 64, L=16384, 2 threads, caches evicted
   between calls): float32 -17%, int8 -17 to -26%, int4 -16%, float16 -10%;
   with the cache warm (L=2048, 1 thread) +4 to +8% for the added instructions,
   so a call whose keys and values take less than MH_PREFETCH_MIN_BYTES (they
   may well sit in the last-level cache) does not ask: a fused layer's decode
   step at L=1024 (6 MB of float32 K/V) keeps its time.  A whole block asked
   for at once was slower: its misses queue ahead of the loads the loop waits
   on.  p.data_bytes 0: nothing. */
static inline void FN(prefetch_rows)(FN(kv_rows) p, int64_t j, int64_t n)
{
    for (int64_t x = 0; x < p.data_bytes; x += 64) /* (one compare when there is nothing) */
        for (int64_t r = j; r < j + n; ++r) MH_PREFETCH(p.base + r * p.row_bytes + x);
}

static const FN(kv_rows) FN(no_rows) = {0, 0, 0, 0, 0};

#if defined(V_LOAD_I8) && defined(V_LOAD_U4)
/* The 4-bit values of n vectors of a stored int4 row, widened as they are (no
   scale or min).  Where the ISA has V_LOAD_U4_SPLIT (VW = MH_I4_GROUP / 2),
   each group comes in split order: its even channels (the low nibbles) in one
   vector, its odd channels in the next, which takes fewer instructions; the
   query rows (FN(attend_few_rows)) and the output columns (the int4 mix) are
   put in the same order for them. */
#if defined(V_LOAD_U4_SPLIT) && 2 * VW == MH_I4_GROUP
#define MH_I4_SPLIT 1
#else
#define MH_I4_SPLIT 0
#endif
MH_INLINE void FN(u4_row)(const char *row, int64_t n, V *u)
{
    int64_t c = 0;
#if MH_I4_SPLIT
    for (; c + 2 <= n; c += 2) V_LOAD_U4_SPLIT((const uint8_t *)row + c * (VW / 2), u[c], u[c + 1]);
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
    V u[MH_I4_MAX_GROUPS * MH_I4_GROUP / VW];
    FN(u4_row)(krow, groups * (MH_I4_GROUP / VW), u);
    for (int r = 0; r < R; ++r) out[r] = V_ZERO();
    for (int64_t g = 0; g < groups; ++g) {
        V dot[4];
        for (int r = 0; r < R; ++r) dot[r] = V_ZERO();
        for (int64_t c = g * (MH_I4_GROUP / VW); c < (g + 1) * (MH_I4_GROUP / VW); ++c)
            for (int r = 0; r < R; ++r) dot[r] = V_FMA(V_LOAD(qp + r * ep + c * VW), u[c], dot[r]);
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
            if (fmt == MH_KV_I4)
                for (int u = 0; u < 4; ++u)
                    FN(i4_pairs)((const uint16_t *)(k.scale + (j + u) * k.scale_bytes), groups,
                                 pairs[u]);
            V a0[2], a1[2], a2[2], a3[2];
#if defined(V_LOAD_I8) && defined(V_LOAD_U4)
            if (fmt == MH_KV_I4) {
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
            if (fmt == MH_KV_I8) { /* the row scales go on before the lane sums: a store
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
        if (fmt == MH_KV_I4)
            FN(i4_pairs)((const uint16_t *)(k.scale + j * k.scale_bytes), groups, pairs[0]);
        V acc[4];
#if defined(V_LOAD_I8) && defined(V_LOAD_U4)
        if (fmt == MH_KV_I4) {
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
        if (fmt == MH_KV_I8) /* as the 4-key loop: the scale before the lane sums */
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
#define MH_DOTS_R1(RR, PF, NVK)                                                            \
    FN(few_rows_dots_r)(qp + r0 * ep, ep, qm + r0 * MH_I4_MAX_GROUPS, k, nk, NVK,          \
                        s + r0 * BK, RR, fmt, PF)
    /* int4 rows of 64 and 128: the group loops of FN(i4_key_lanes) unrolled */
#define MH_DOTS_R(RR, PF)                                                                  \
    do {                                                                                   \
        if (fmt == MH_KV_I4 && nvk * VW == 64) MH_DOTS_R1(RR, PF, 64 / VW);                \
        else if (fmt == MH_KV_I4 && nvk * VW == 128) MH_DOTS_R1(RR, PF, 128 / VW);         \
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
        const FN(kv_rows) pf = /* this block's values, for the mix */
            w->prefetch && w->v_in_place ? FN(kv_in_place)(a, &a->v, &a->v_scale, pair, k0)
                                         : FN(no_rows);
#define MH_DOTS(F) FN(few_rows_dots)(w->qt, ep, w->kpack, nq, kr, nk, E / VW, w->st, F, pf)
        switch (a->kv_format) {
        case MH_KV_F16: MH_DOTS(MH_KV_F16); break;
        case MH_KV_BF16: MH_DOTS(MH_KV_BF16); break;
        case MH_KV_I8: MH_DOTS(MH_KV_I8); break;
        case MH_KV_I4: MH_DOTS(MH_KV_I4); break;
        default: MH_DOTS(MH_KV_NATIVE); break;
        }
#undef MH_DOTS
    } else {
        FN(kv_rows) kr;
        FN(load_rows)(a, &a->k, &a->k_scale, pair, k0, nk, E, w->kpack, ep);
        kr.base = (const char *)w->kpack;
        kr.row_bytes = ep * (int64_t)sizeof(T);
        kr.scale = 0;
        kr.scale_bytes = 0;
        kr.data_bytes = 0;
        FN(few_rows_dots)(w->qt, ep, w->kpack, nq, kr, nk, ep / VW, w->st, MH_KV_NATIVE,
                          FN(no_rows));
    }
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
    if (fmt == MH_KV_I4 && !select && NC % 2 == 0 && c % 2 == 0) {
        /* factored by group as the keys (FN(i4_key_lanes)): p (s u + m) summed
           over the keys is (p s) u summed, plus the sum of p m once per group */
        const int NG = NC * VW / MH_I4_GROUP, per = MH_I4_GROUP / VW;
        T pm[MH_FEW_ROWS][4 * NVO * VW / MH_I4_GROUP];
        for (int r = 0; r < R; ++r)
            for (int uu = 0; uu < NC; uu += 2) V_SPLIT(o[r][uu], o[r][uu + 1]);
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < NG; ++g) pm[r][g] = 0;
        for (int64_t j = 0; j < nk; ++j) {
            const char *vr = v.base + j * v.row_bytes;
            FN(prefetch_rows)(pf, j, 1);
            FN(i4_pairs)((const uint16_t *)(v.scale + j * v.scale_bytes) + 2 * g0, NG, pairs);
            V u[4 * NVO];
            FN(u4_row)(vr + c * (VW / 2), NC, u);
            for (int r = 0; r < R; ++r) {
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
            for (int uu = 0; uu < NC; uu += 2) V_UNSPLIT(o[r][uu], o[r][uu + 1]);
            for (int uu = 0; uu < NC; ++uu) V_STORE(acc + r * evp + (c + uu) * VW, o[r][uu]);
        }
        return;
    }
#endif
    for (int64_t j = 0; j < nk; ++j) {
        const char *vr = v.base + j * v.row_bytes;
        FN(prefetch_rows)(pf, j, 1);
        const T vs = (T)mh_row_scale(fmt, v.scale, v.scale_bytes, j);
        if (fmt == MH_KV_I4)
            FN(i4_pairs)((const uint16_t *)(v.scale + j * v.scale_bytes) + 2 * g0, g1 - g0,
                         pairs + 2 * g0);
        V vv[4 * NVO];
        for (int u = 0; u < NC; ++u) vv[u] = FN(kv_vec)(vr, (c + u) * VW, fmt, pairs);
        for (int r = 0; r < R; ++r) {
            const T ps = p[r * BK + j];
            const V pj = V_SET1(fmt == MH_KV_I8 ? ps * vs : ps);
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
    FN(kv_rows) pf = w->prefetch && w->k_in_place && k0 + BK + nk <= a->kv_len /* a next block */
                         ? FN(kv_in_place)(a, &a->k, &a->k_scale, pair, k0 + BK) : FN(no_rows);
    FN(kv_rows) vr;
    int fmt = MH_KV_NATIVE;
    if (w->v_in_place) {
        fmt = a->kv_format;
        vr = FN(kv_in_place)(a, &a->v, &a->v_scale, pair, k0);
    } else {
        FN(load_rows)(a, &a->v, &a->v_scale, pair, k0, nk, a->v_dim, w->vpack, evp);
        vr.base = (const char *)w->vpack;
        vr.row_bytes = evp * (int64_t)sizeof(T);
        vr.scale = 0;
        vr.scale_bytes = 0;
        vr.data_bytes = 0;
    }
    for (int64_t r0 = 0; r0 < nq; r0 += MH_FEW_ROWS) {
        const int64_t R = nq - r0 < MH_FEW_ROWS ? nq - r0 : MH_FEW_ROWS;
        T *acc = w->acc + r0 * evp;
        const T *alpha = w->alpha + r0, *p = w->st + r0 * BK;
#define MH_MIX3(RR, F, S) FN(few_rows_output)(acc, evp, alpha, p, nk, vr, nvv, RR, F, S, pf)
#define MH_MIX2(RR, F) (select ? MH_MIX3(RR, F, 1) : MH_MIX3(RR, F, 0))
#define MH_MIX(RR)                                        \
        switch (fmt) {                                    \
        case MH_KV_F16: MH_MIX2(RR, MH_KV_F16); break;    \
        case MH_KV_BF16: MH_MIX2(RR, MH_KV_BF16); break;  \
        case MH_KV_I8: MH_MIX2(RR, MH_KV_I8); break;      \
        case MH_KV_I4: MH_MIX2(RR, MH_KV_I4); break;      \
        default: MH_MIX2(RR, MH_KV_NATIVE); break;        \
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

/* Few-rows path over keys [k_lo, k_hi): same results layout as attend_tile. */
static void FN(attend_few_rows)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                                int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, ep = w->ep, evp = w->evp, L = nq / mh_group(a);
    const T scale = (T)mh_score_scale(a);

    /* (local pointers: the compiler cannot know that these stores leave *w alone) */
    T *qt = w->qt, *acc = w->acc;
    const V vscale = V_SET1(scale);
    for (int64_t i = 0; i < nq; ++i) {
        const int64_t off = mh_row_offset(a, &a->q, pair, q0, i, L);
        const T *q = (const T *)a->q.base + off;
        T *qi = qt + i * ep;
        int64_t d = 0;
        if (a->q_format != MH_KV_NATIVE) { /* widened in place, then scaled */
            FN(half_or_bf16_row)(a->q_format, qi, (const uint16_t *)a->q.base + off, E);
            q = qi;
        }
        for (; d + VW <= E; d += VW) V_STORE(qi + d, V_MUL(V_LOAD(q + d), vscale));
        for (; d < E; ++d) qi[d] = q[d] * scale;
        for (; d < ep; ++d) qi[d] = 0;
        w->row_max[i] = (T)(-INFINITY);
        w->row_sum[i] = 0;
    }
    if (w->k_in_place && a->kv_format == MH_KV_I4) /* FN(i4_key_lanes)'s query sums, in kpack */
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t g = 0; g < E / MH_I4_GROUP; ++g) {
                T *qg = qt + i * ep + g * MH_I4_GROUP;
                V sum = V_ZERO();
                for (int64_t d = 0; d < MH_I4_GROUP; d += VW) sum = V_ADD(sum, V_LOAD(qg + d));
                w->kpack[i * MH_I4_MAX_GROUPS + g] = V_HSUM(sum) * ((T)1 / VW);
#if MH_I4_SPLIT
                V lo = V_LOAD(qg), hi = V_LOAD(qg + VW); /* the keys' order (FN(u4_row)) */
                V_SPLIT(lo, hi);
                V_STORE(qg, lo);
                V_STORE(qg + VW, hi);
#endif
            }
    for (int64_t i = 0; i < nq * evp; i += VW) V_STORE(acc + i, V_ZERO());
    /* copied key / value rows: load_rows writes columns [0, E) and [0, Ev) of
       the rows it copies and the dots and the mix read only those rows, so
       only the padding columns up to ep / evp must be (finite) zeros */
    if (!w->k_in_place && ep > E)
        for (int64_t j = 0; j < BK; ++j)
            for (int64_t d = E; d < ep; ++d) w->kpack[j * ep + d] = 0;
    if (!w->v_in_place && evp > Ev)
        for (int64_t j = 0; j < BK; ++j)
            for (int64_t d = Ev; d < evp; ++d) w->vpack[j * evp + d] = 0;

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

static void FN(attend)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                       int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    if (w->few_rows)
        FN(attend_few_rows)(a, pair, q0, nq, k_lo, k_hi, w);
    else
        FN(attend_tile)(a, pair, q0, nq, k_lo, k_hi, w);
}

/* ---- entry points (mh_kernel_table) ----------------------------------------- */

/* Second sweep for the dense weights: recompute each tile, normalise with the
   final row max and sum (w->row_sum holds 1/sum), write rows [q0, q0+nq). */
static void FN(write_weights)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                              FN(work) *w)
{
    const int64_t S = a->kv_len, nvq = (nq + VW - 1) / VW;
    T *wt = (T *)a->weights + (pair * a->q_len + q0) * S;
    int64_t k_begin, k_end;
    mh_key_range(a, q0, nq, 0, S, &k_begin, &k_end);
    for (int64_t i = nq; i < nvq * VW; ++i) w->row_max[i] = 0;
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        FN(tile_masked_scores)(a, pair, q0, nq, nvq, k0, nk, w);
        for (int64_t c = 0; c < nvq; ++c) {
            V m_use = V_NEG_INF_TO_ZERO(V_LOAD(w->row_max + c * VW));
            V inv = V_LOAD(w->row_sum + c * VW);
            for (int64_t j = 0; j < nk; ++j) {
                T *s = w->st + j * BQ + c * VW;
                V_STORE(s, V_MUL(MH_EXP2(V_SUB(V_LOAD(s), m_use)), inv));
            }
        }
        if (a->dropout_p > 0) FN(apply_dropout)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t j = 0; j < nk; ++j) wt[i * S + k0 + j] = w->st[j * BQ + i];
    }
}

/* o[0..n) = acc[0..n) * inv in the output's storage: T, or float16 or bfloat16
   bits (a->out_format, float kernels). */
static inline void FN(store_out)(const mh_attn_args *a, int64_t offset, const T *acc, T inv,
                                 int64_t n)
{
    const V vinv = V_SET1(inv);
    int64_t d = 0;
    if (a->out_format != MH_KV_NATIVE) { /* MH_KV_F16 or MH_KV_BF16 */
        const int bf16 = a->out_format == MH_KV_BF16;
        uint16_t *o = (uint16_t *)a->out.base + offset;
#if defined(V_STORE_BF16) && defined(V_STORE_HALF)
        for (; d + VW <= n; d += VW) {
            const V x = V_MUL(V_LOAD(acc + d), vinv);
            if (bf16)
                V_STORE_BF16(o + d, x);
            else
                V_STORE_HALF(o + d, x);
        }
#endif
        for (; d < n; ++d) {
            const float x = (float)(acc[d] * inv);
            o[d] = bf16 ? mh_float_to_bf16(x) : mh_float_to_half(x);
        }
        return;
    }
    T *o = (T *)a->out.base + offset;
    for (; d + VW <= n; d += VW) V_STORE(o + d, V_MUL(V_LOAD(acc + d), vinv));
    for (; d < n; ++d) o[d] = acc[d] * inv;
}

/* mh_block_fn: rows [q0, q0 + BQ) of pair `pair` against every key (with
   grouped query heads: all G * L rows of the kv pair, q0 = 0). */
void FN(mh_block_item)(const mh_attn_args *a, int64_t pair, int64_t q0, void *scratch)
{
    const int64_t Ev = a->v_dim, S = a->kv_len, G = mh_group(a);
    const int64_t nq = G > 1 ? G * a->q_len : ((a->q_len - q0 < BQ) ? a->q_len - q0 : BQ);
    FN(work) w = FN(carve)(a, nq, scratch);

    FN(attend)(a, pair, q0, nq, 0, S, &w);

    /* normalise once; rows that saw no key have row_sum == 0 and give zeros */
    for (int64_t i = 0; i < nq; ++i) {
        const T inv = w.row_sum[i] == 0 ? (T)0 : (T)1 / w.row_sum[i];
        w.row_sum[i] = inv;
        FN(store_out)(a, mh_row_offset(a, &a->out, pair, q0, i, nq / G), w.acc + i * w.evp, inv,
                      Ev);
    }
    if (a->weights) FN(write_weights)(a, pair, q0, nq, &w);
}

/* mh_split_fn: every query row (q_len <= MH_BLOCK_Q) of pair `pair` against
   keys [range * split_keys, (range + 1) * split_keys); writes the unnormalised
   output, row max and row sum to the partial buffers for mh_merge_item. */
void FN(mh_split_item)(const mh_attn_args *a, int64_t pair, int64_t range, void *scratch)
{
    const int64_t L = a->q_len * mh_group(a), Ev = a->v_dim, keys = a->split.split_keys;
    FN(work) w = FN(carve)(a, L, scratch);
    const int64_t part = pair * a->split.n_split + range;
    T *pacc = (T *)a->split.acc + part * L * Ev;
    T *pm = (T *)a->split.row_max + part * L;
    T *pl = (T *)a->split.row_sum + part * L;
    FN(attend)(a, pair, 0, L, range * keys, (range + 1) * keys, &w);
    for (int64_t i = 0; i < L; ++i) {
        pm[i] = w.row_max[i];
        pl[i] = w.row_sum[i];
        for (int64_t d = 0; d < Ev; ++d) pacc[i * Ev + d] = w.acc[i * w.evp + d];
    }
}

/* mh_merge_fn: the n_split partial results of pair `pair` merged in range
   order (so the result does not depend on which thread computed which range)
   into the output. */
void FN(mh_merge_item)(const mh_attn_args *a, int64_t pair, void *scratch)
{
    const int64_t L = a->q_len * mh_group(a), Ev = a->v_dim, ns = a->split.n_split;
    const T *pacc = (const T *)a->split.acc + pair * ns * L * Ev;
    const T *pm = (const T *)a->split.row_max + pair * ns * L;
    const T *pl = (const T *)a->split.row_sum + pair * ns * L;
    T *acc = (T *)scratch;
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
            const T f = (T)exp2((double)(pm[s * L + i] - m_use));
            sum += pl[s * L + i] * f;
            for (int64_t d = 0; d < Ev; ++d) acc[d] += pacc[(s * L + i) * Ev + d] * f;
        }
        FN(store_out)(a, mh_row_offset(a, &a->out, pair, 0, i, a->q_len), acc,
                      sum == 0 ? (T)0 : (T)1 / sum, Ev);
    }
}

#undef MH_EXP2
