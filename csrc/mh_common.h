/*
 * The pieces both paths share (mh_instance.h): which keys a row sees, masks
 * and dropout on either score layout, loads that widen a stored format, and
 * one work item's view of its scratch and of the plan.
 *
 * Scores are kept in log2 units: the query is pre-scaled by scale * log2(e)
 * (the pair-product path scales the finished scores instead; an additive
 * mask is scaled by log2(e) as it is added), so the softmax uses 2^x, cheaper
 * than e^x; row_max and the split-key partial maxima are in the same units.
 */
#define BQ MH_BLOCK_Q
#define BK MH_BLOCK_K

#ifndef MH_IMPL_COMMON_DONE
#define MH_IMPL_COMMON_DONE
#include <float.h>
#include <math.h>
#include <string.h>
#include "mh_kernels.h"
#if defined(_MSC_VER)
#define MH_INLINE static __forceinline
#else
#define MH_INLINE static inline __attribute__((always_inline))
#endif
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

/* Grouped query heads.  With plan->group = G > 1 (decode with grouped-query
   attention) an item of the few-rows path serves the G query heads that share
   one kv head: its rows are r = g * L + i (head g of the group, query row i),
   so every key and value of the kv head is read once for all of them.  `pair`
   is then the kv pair; query and output offsets are per (pair, g). */
static inline int64_t mh_group(const mh_attn_args *a) { return a->plan->group; }

/* Element offset of row r of the item's queries (or outputs: `op` = &a->out). */
static inline int64_t mh_row_offset(const mh_attn_args *a, const mh_operand *op, int64_t pair,
                                    int64_t q0, int64_t r, int64_t rows_per_head)
{
    const int64_t g = r / rows_per_head, i = r % rows_per_head;
    return op->off[pair * mh_group(a) + g] + (q0 + i) * op->row;
}

/* The storage code of the kernel's own float type T. */
#define MH_NATIVE (sizeof(T) == sizeof(double) ? MH_STORE_F64 : MH_STORE_F32)

/* Bytes per element of a stored array of format fmt (int4: a byte holds two). */
static inline int64_t mh_stored_bytes(int fmt)
{
    const int bits = mh_storage_bits(fmt);
    return bits >= 8 ? bits / 8 : 1;
}

/* Row j's int8 scale (1 for the other formats). */
static inline float mh_row_scale(int fmt, const char *scale, int64_t scale_bytes, int64_t j)
{
    return fmt == MH_STORE_I8 ? *(const float *)(scale + j * scale_bytes) : 1.0f;
}
#endif

#if MH_HAS_HALF_SCALAR
#define MH_HALF_TO_FLOAT(h) S_HALF_TO_FLOAT(h)
#else
#define MH_HALF_TO_FLOAT(h) mh_half_to_float(h)
#endif

/* V_HSUM4(a, b, c, d, out): out[0..4) = the lane sums of a, b, c and d (an
   ISA may define it with fewer instructions than four V_HSUMs) */
#if !MH_HAS_HSUM4
#define V_HSUM4(a, b, c, d, out)                                              \
    do {                                                                       \
        T *o4_ = (out);                                                        \
        o4_[0] = V_HSUM(a); o4_[1] = V_HSUM(b); o4_[2] = V_HSUM(c); o4_[3] = V_HSUM(d); \
    } while (0)
#endif

#if MH_HAS_EXP2
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

/* dst[0..n) = 16-bit src[0..n) of format fmt (MH_STORE_F16 or MH_STORE_BF16)
   widened: a vector conversion where the path has one (bfloat16: a 16-bit
   shift), else one value at a time. */
static inline void FN(half_or_bf16_row)(int fmt, T *dst, const uint16_t *src, int64_t n)
{
    int64_t c = 0;
    if (fmt == MH_STORE_F16) {
#if MH_HAS_F16_LOAD
        for (; c + VW <= n; c += VW) V_STORE(dst + c, V_LOAD_HALF(src + c));
#endif
        for (; c < n; ++c) dst[c] = (T)mh_half_to_float(src[c]);
        return;
    }
#if MH_HAS_BF16_LOAD
    for (; c + VW <= n; c += VW) V_STORE(dst + c, V_LOAD_BF16(src + c));
#endif
    for (; c < n; ++c) dst[c] = (T)mh_bf16_to_float(src[c]);
}

/* dst[0..n) = int8 src[0..n) * scale. */
static inline void FN(i8_row)(T *dst, const int8_t *src, int64_t n, float scale)
{
    int64_t c = 0;
#if MH_HAS_I8_LOAD
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
#if MH_HAS_U4_LOAD
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

/* The storage formats the few-rows path of this instantiation reads in place
   (as whole vectors, widened as they load): a bit per format, for mh_caps. */
#define MH_IN_PLACE_FORMATS                                                          \
    ((1u << MH_NATIVE) | (MH_HAS_F16_LOAD ? 1u << MH_STORE_F16 : 0u) |                 \
     (MH_HAS_BF16_LOAD ? 1u << MH_STORE_BF16 : 0u) |                                   \
     (MH_HAS_I8_LOAD && MH_HAS_U4_LOAD ? (1u << MH_STORE_I8) | (1u << MH_STORE_I4) : 0u))

/* Pointers into one work item's scratch (mh_scratch_plan) and the plan of its
   kind of item (mh_item_plan), spelled out. */
typedef struct {
    T *qt, *st, *acc, *kpack, *vpack, *row_max, *row_sum, *alpha;
    int64_t ep, evp;   /* E and Ev rounded up to 16 */
    int few_rows;      /* the few-rows path serves this item */
    int dp;            /* tile path with bfloat16 pair dot products (mh_pair_bf16.h) */
    int k_in_place;    /* keys read in place (few-rows path: rows of whole vectors;
                          tile path: the kernel's type, rows close together) */
    int v_in_place;    /* values read in place */
    uint32_t *pt2;     /* dp: the probabilities as bfloat16 pairs of keys */
    /* tile path, keys and values MH_READ_WIDENED: this thread's widened rows
       (header: the pair, the rows done; keys [rows][E], values [rows][evp]),
       else NULL */
    int64_t *wid;
    T *kwid, *vwid;
    int prefetch;      /* few-rows path: FN(prefetch_rows) along the key and value streams */
} FN(work);

/* The item's scratch sliced by mh_scratch_plan, its flags read off the plan. */
static FN(work) FN(carve)(const mh_attn_args *a, const mh_item_plan *ip, void *scratch)
{
    const mh_scratch_layout s = mh_scratch_plan(a->head_dim, a->v_dim);
    T *base = (T *)scratch;
    FN(work) w;
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
    w.few_rows = ip->path == MH_PATH_FEW_ROWS;
    w.dp = ip->path == MH_PATH_PAIRS;
    w.k_in_place = ip->k_read == MH_READ_IN_PLACE;
    w.v_in_place = ip->v_read == MH_READ_IN_PLACE;
    w.prefetch = a->plan->prefetch;
    w.wid = 0;
    w.kwid = w.vwid = 0;
    if (ip->k_read == MH_READ_WIDENED) { /* after the layout's parts (mh_widened_bytes) */
        w.wid = (int64_t *)((char *)scratch + mh_scratch_stride(a->head_dim, a->v_dim, sizeof(T)));
        w.kwid = (T *)((char *)w.wid + MH_SCRATCH_ALIGN);
        w.vwid = w.kwid + a->kv_len * a->head_dim;
    }
    return w;
}

/* dst[j][0..n) = K or V rows [row0, row0 + rows) of this pair, widened from the
   storage format (see mh_formats.h; `scale` is the matching k_scale / v_scale);
   columns [n, dst_row) are left alone. */
static void FN(load_rows)(const mh_attn_args *a, const mh_operand *src,
                          const mh_operand *scale, int64_t pair, int64_t row0, int64_t rows,
                          int64_t n, T *dst, int64_t dst_row)
{
    const int64_t start = src->off[pair] + row0 * src->row;
    switch (a->kv_format) {
    case MH_STORE_F16:
    case MH_STORE_BF16: {
        const uint16_t *p = (const uint16_t *)src->base + start;
        for (int64_t j = 0; j < rows; ++j)
            FN(half_or_bf16_row)(a->kv_format, dst + j * dst_row, p + j * src->row, n);
        break;
    }
    case MH_STORE_I8: {
        const int8_t *p = (const int8_t *)src->base + start;
        const float *s = (const float *)scale->base + scale->off[pair] + row0 * scale->row;
        for (int64_t j = 0; j < rows; ++j)
            FN(i8_row)(dst + j * dst_row, p + j * src->row, n, s[j * scale->row]);
        break;
    }
    case MH_STORE_I4: {
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

/* Probabilities times the dropout keep mask / (1 - p).  A dropped entry becomes 0,
   except a hidden one, which keeps its mark (-0.0) so that the mix still skips its
   value (a NaN or inf value hidden from a row must not reach it as 0 times inf). */
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
            *e = u >= p ? *e * keep_scale : (MH_IS_HIDDEN(*e) ? *e : (T)0);
        }
}

/* p where s is not -inf; -0.0 where it is (the mark of a hidden entry). */
MH_INLINE V FN(mark_hidden)(V p, V s)
{
#if MH_HAS_SELECT
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

/* acc + p*x, or acc unchanged when the probability ps is marked hidden (p is ps,
   or ps times an int8 row's scale: the mark is read from ps, which a NaN scale
   cannot unmark). */
MH_INLINE V FN(fma_visible)(T ps, V p, V x, V acc)
{
#if MH_HAS_SELECT
    return V_FMA_VISIBLE(p, x, acc, V_VISIBLE(V_SET1(ps)));
#else
    return MH_IS_HIDDEN(ps) ? acc : V_FMA(p, x, acc);
#endif
}
