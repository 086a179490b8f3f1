/*
 * Few-rows dense projection (decode): out[r][c] = bias[c] + sum_k x[r][k] w[k][c]
 * for up to MH_FEW_ROWS rows, one block of columns (the plan's tile_n) per work item,
 * and the widening of a stripe of w for the more-rows path.  Instantiated per (ISA,
 * scalar type) by mh_instance.h, with the same macros.  Memory-bound: each row of w's
 * block is read once, as whole vectors, for every input row at once.
 *
 * w is stored in a->w_fmt: the native type, or (float32 kernels) float16, bfloat16,
 * or int8 with one float32 scale per (group of a->group rows of k, column).  Float
 * formats are widened as they load, so their sums are those of the widened weights,
 * bit for bit; an int8 group's sums are multiplied by the group's scale and added to
 * the total after the group.  Each output element adds its k rows eight at a time
 * from the start of its chunk (or group), in order, each eight as the pair sum of
 * FN(eight_rows), then the remaining rows one multiply-add each: the same
 * arithmetic in every column, so the column blocking never changes a bit.
 */

/* sums of T a row of a few-rows block */
#define MH_LINEAR_SUMS ((int64_t)(MH_LINEAR_BLOCK_BYTES / sizeof(T)))

/* VW weights of format fmt at element i of w, widened to V (fmt is a constant where
   this is inlined, so the switch folds away). */
MH_INLINE V FN(w_load)(const int fmt, const void *w, int64_t i)
{
    if (fmt == MH_NATIVE) return V_LOAD((const T *)w + i);
#if MH_HAS_F16_LOAD
    if (fmt == MH_STORE_F16) return V_LOAD_HALF((const uint16_t *)w + i);
#endif
#if MH_HAS_BF16_LOAD
    if (fmt == MH_STORE_BF16) return V_LOAD_BF16((const uint16_t *)w + i);
#endif
#if MH_HAS_I8_LOAD
    if (fmt == MH_STORE_I8) return V_LOAD_I8((const int8_t *)w + i);
#endif
    T lanes[VW];
    for (int l = 0; l < VW; ++l) lanes[l] = (T)mh_weight_at(fmt, w, i + l);
    return V_LOAD(lanes);
}

/* VW float32 scales at s as V (the int8 format serves float32 kernels only). */
MH_INLINE V FN(scales_load)(const float *s)
{
    if (sizeof(T) == sizeof(float)) return V_LOAD((const T *)(const void *)s);
    T lanes[VW];
    for (int l = 0; l < VW; ++l) lanes[l] = (T)s[l];
    return V_LOAD(lanes);
}

/* s + x0 w0 + ... + x7 w7 for eight rows of weights as two chains, (x0 w0 + x2 w2 + x4
   w4 + x6 w6) + (x1 w1 + ... + x7 w7), added to s: half the latency of one chain of
   eight multiply-adds, which otherwise bounds the product below the memory's rate
   for the weights that are widened as they load. */
MH_INLINE V FN(eight_rows)(const V *xs, const V *w, V s)
{
    V a = V_MUL(xs[0], w[0]), b = V_MUL(xs[1], w[1]);
    for (int i = 2; i < 8; i += 2) {
        a = V_FMA(xs[i], w[i], a);
        b = V_FMA(xs[i + 1], w[i + 1], b);
    }
    return V_ADD(s, V_ADD(a, b));
}

/* acc[r][0, nv*VW) += x[r][kk] * w[kk][c0 + ...] for kk in [k0, k1): eight rows of w
   per pass (FN(eight_rows); eight streams, and the sums loaded and stored once for
   eight rows), each a contiguous run of the block (up to MH_LINEAR_BLOCK_BYTES of
   sums, which the hardware prefetchers stream at the memory's rate), then the rows
   left one at a time. */
MH_INLINE void FN(linear_accumulate)(const int fmt, const mh_linear_args *a, int64_t c0,
                                     int64_t nv, const int R, int64_t k0, int64_t k1,
                                     T *acc, int64_t acc_row)
{
    const T *x = (const T *)a->x;
    const int64_t ld = a->w_row;
    int64_t kk = k0;
    for (; kk + 8 <= k1; kk += 8) {
        const int64_t w0 = kk * ld + c0;
        for (int r = 0; r < R; ++r) {
            const T *xr = x + r * a->x_row + kk;
            V xs[8];
            for (int i = 0; i < 8; ++i) xs[i] = V_SET1(xr[i]);
            T *ar = acc + r * acc_row;
            for (int64_t v = 0; v < nv; ++v) {
                const int64_t o = w0 + v * VW;
                V ws[8];
                for (int i = 0; i < 8; ++i) ws[i] = FN(w_load)(fmt, a->w, o + i * ld);
                V_STORE(ar + v * VW, FN(eight_rows)(xs, ws, V_LOAD(ar + v * VW)));
            }
        }
    }
    for (; kk < k1; ++kk)
        for (int r = 0; r < R; ++r) {
            const V xs = V_SET1(x[r * a->x_row + kk]);
            T *ar = acc + r * acc_row;
            for (int64_t v = 0; v < nv; ++v)
                V_STORE(ar + v * VW, V_FMA(xs, FN(w_load)(fmt, a->w, kk * ld + c0 + v * VW),
                                           V_LOAD(ar + v * VW)));
        }
}

/* Columns [c0, c0 + nv*VW) of R rows over rows [k0, k1) of w, weights of format fmt,
   into dst (rows dst_row apart), starting from the bias (with_bias) or from zero.  The
   block's sums live in L1/L2 (at most MH_LINEAR_BLOCK_BYTES of them per row; half of
   it for int8 in groups, whose groups have sums of their own, scaled as each group
   ends; int8 with one scale per column scales the whole sums at the end). */
MH_INLINE void FN(linear_rows_block)(const int fmt, const mh_linear_args *a, int64_t c0,
                                     int64_t nv, const int R, int64_t k0, int64_t k1, T *dst,
                                     int64_t dst_row, int with_bias)
{
    const T *bias = with_bias ? (const T *)a->bias : NULL;
    T acc[MH_FEW_ROWS][MH_LINEAR_SUMS];
    for (int r = 0; r < R; ++r)
        for (int64_t v = 0; v < nv; ++v)
            V_STORE(acc[r] + v * VW, bias ? V_LOAD(bias + c0 + v * VW) : V_ZERO());
    if (fmt != MH_STORE_I8) {
        FN(linear_accumulate)(fmt, a, c0, nv, R, k0, k1, acc[0], MH_LINEAR_SUMS);
    } else if (a->group >= a->k) { /* one scale per column: scale the sums at the end */
        const float *scale = a->w_scales + c0;
        for (int r = 0; r < R; ++r)
            for (int64_t v = 0; v < nv; ++v) V_STORE(acc[r] + v * VW, V_ZERO());
        FN(linear_accumulate)(fmt, a, c0, nv, R, k0, k1, acc[0], MH_LINEAR_SUMS);
        for (int r = 0; r < R; ++r)
            for (int64_t v = 0; v < nv; ++v)
                V_STORE(acc[r] + v * VW, V_FMA(FN(scales_load)(scale + v * VW),
                                               V_LOAD(acc[r] + v * VW),
                                               bias ? V_LOAD(bias + c0 + v * VW) : V_ZERO()));
    } else { /* groups: the plan keeps the block to half a row of acc; the group's own
                sums live in the other half */
        const int64_t half = MH_LINEAR_SUMS / 2;
        for (int64_t g0 = k0, g1; g0 < k1; g0 = g1) {
            g1 = (g0 / a->group + 1) * a->group < k1 ? (g0 / a->group + 1) * a->group : k1;
            const float *scale = a->w_scales + (g0 / a->group) * a->n + c0;
            for (int r = 0; r < R; ++r)
                for (int64_t v = 0; v < nv; ++v) V_STORE(acc[r] + half + v * VW, V_ZERO());
            FN(linear_accumulate)(fmt, a, c0, nv, R, g0, g1, acc[0] + half, MH_LINEAR_SUMS);
            for (int r = 0; r < R; ++r)
                for (int64_t v = 0; v < nv; ++v)
                    V_STORE(acc[r] + v * VW, V_FMA(FN(scales_load)(scale + v * VW),
                                                   V_LOAD(acc[r] + half + v * VW),
                                                   V_LOAD(acc[r] + v * VW)));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int64_t v = 0; v < nv; ++v)
            V_STORE(dst + r * dst_row + v * VW, V_LOAD(acc[r] + v * VW));
}

/* One column c < VW-wide tail over rows [k0, k1) of w, lane 0 of a vector (so the
   arithmetic is the vector lanes' own), into dst (rows dst_row apart). */
static void FN(linear_rows_column)(const mh_linear_args *a, int64_t c, int R, int64_t k0,
                                   int64_t k1, T *dst, int64_t dst_row, int with_bias)
{
    const T *x = (const T *)a->x, *bias = with_bias ? (const T *)a->bias : NULL;
    const int fmt = a->w_fmt;
    const int64_t group = fmt == MH_STORE_I8 ? a->group : a->k;
    T lanes[VW];
    for (int r = 0; r < R; ++r) {
        V acc = V_SET1(bias ? bias[c] : (T)0);
        for (int64_t g0 = k0, g1; g0 < k1; g0 = g1) {
            g1 = (g0 / group + 1) * group < k1 ? (g0 / group + 1) * group : k1;
            V part = fmt == MH_STORE_I8 ? V_ZERO() : acc;
            int64_t kk = g0;
            for (; kk + 8 <= g1; kk += 8) { /* as FN(linear_accumulate) */
                V xs[8], ws[8];
                for (int i = 0; i < 8; ++i) {
                    xs[i] = V_SET1(x[r * a->x_row + kk + i]);
                    ws[i] = V_SET1((T)mh_weight_at(fmt, a->w, (kk + i) * a->w_row + c));
                }
                part = FN(eight_rows)(xs, ws, part);
            }
            for (; kk < g1; ++kk)
                part = V_FMA(V_SET1(x[r * a->x_row + kk]),
                             V_SET1((T)mh_weight_at(fmt, a->w, kk * a->w_row + c)), part);
            acc = fmt == MH_STORE_I8
                      ? V_FMA(V_SET1((T)a->w_scales[(g0 / group) * a->n + c]), part, acc)
                      : part;
        }
        V_STORE(lanes, acc);
        dst[r * dst_row] = lanes[0];
    }
}

/* mh_linear_rows_fn: item = (chunk of k, block of columns), block-minor.  With one chunk
   (a->partial NULL) an item writes its columns of the output, bias included; with
   several, its chunk's sums into a->partial, which mh_linear_merge adds in chunk order.
   The plan makes a block's sums at most MH_LINEAR_BLOCK_BYTES a row (half for int8 in
   groups), a multiple of 16 columns or, for a narrow w cut along k, all of them. */
void FN(mh_linear_rows_item)(const mh_linear_args *a, int64_t item)
{
    const int64_t n_blocks = (a->n + a->tile_n - 1) / a->tile_n;
    const int64_t chunk = item / n_blocks, block = item % n_blocks;
    const int64_t k0 = chunk * a->k_chunk;
    const int64_t k1 = k0 + a->k_chunk < a->k ? k0 + a->k_chunk : a->k;
    const int64_t start = block * a->tile_n;
    const int64_t end = start + a->tile_n < a->n ? start + a->tile_n : a->n;
    const int64_t nv = (end - start) / VW;
    const int R = a->m < MH_FEW_ROWS ? (int)a->m : MH_FEW_ROWS;
    const int whole = a->partial == NULL;
    T *dst = whole ? (T *)a->out : (T *)a->partial + chunk * R * a->n;
    const int64_t dst_row = whole ? a->out_row : a->n;
    if (nv > 0) {
#define MH_ROWS_BLOCK(F) FN(linear_rows_block)(F, a, start, nv, R, k0, k1, dst + start, dst_row, whole)
        switch (a->w_fmt) {
        case MH_STORE_F16: MH_ROWS_BLOCK(MH_STORE_F16); break;
        case MH_STORE_BF16: MH_ROWS_BLOCK(MH_STORE_BF16); break;
        case MH_STORE_I8: MH_ROWS_BLOCK(MH_STORE_I8); break;
        default: MH_ROWS_BLOCK(MH_NATIVE); break;
        }
#undef MH_ROWS_BLOCK
    }
    for (int64_t c = start + nv * VW; c < end; ++c)
        FN(linear_rows_column)(a, c, R, k0, k1, dst + c, dst_row, whole);
}

/* mh_linear_widen_fn: dst (k, cols) = w[:, c0 : c0 + cols] as T (int8: times its
   group's scale), rows `cols` apart, for the more-rows path's BLAS. */
void FN(mh_linear_widen)(const mh_linear_args *a, int64_t c0, int64_t cols, T *dst)
{
    const int fmt = a->w_fmt;
    for (int64_t kk = 0; kk < a->k; ++kk) {
        T *d = dst + kk * cols;
        const int64_t at = kk * a->w_row + c0;
        int64_t c = 0;
        if (fmt == MH_STORE_I8) {
            const float *s = a->w_scales + (kk / a->group) * a->n + c0;
            for (; c + VW <= cols; c += VW)
                V_STORE(d + c, V_MUL(FN(w_load)(MH_STORE_I8, a->w, at + c), FN(scales_load)(s + c)));
            for (; c < cols; ++c) d[c] = (T)mh_weight_at(fmt, a->w, at + c) * s[c];
        } else if (fmt == MH_STORE_F16) {
            for (; c + VW <= cols; c += VW) V_STORE(d + c, FN(w_load)(MH_STORE_F16, a->w, at + c));
        } else if (fmt == MH_STORE_BF16) {
            for (; c + VW <= cols; c += VW) V_STORE(d + c, FN(w_load)(MH_STORE_BF16, a->w, at + c));
        }
        for (; c < cols; ++c) d[c] = (T)mh_weight_at(fmt, a->w, at + c);
    }
}
