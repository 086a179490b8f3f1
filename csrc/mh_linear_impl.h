/*
 * Few-rows dense projection (decode): out[r][c] = bias[c] + sum_k x[r][k] w[k][c]
 * for up to MH_LINEAR_ROWS rows, one block of columns (the plan's tile_n) per work item,
 * and the widening of a stripe of w for the more-rows path.  Instantiated per (ISA,
 * scalar type) by mh_instance.h, with the same macros.  Memory-bound: each row of w's
 * block is read once, as whole vectors, for every input row at once.
 *
 * w is stored in a->w_fmt: the native type, or (float32 kernels) float16, bfloat16,
 * or int8 with one float32 scale per (group of a->group rows of k, column), blocked
 * (mh_linear_index).  Float formats are widened as they load, so their sums are
 * those of the widened weights, bit for bit: each output element adds its k rows
 * eight at a time from the start of its chunk, in order, each eight as the pair sum
 * of FN(eight_rows), then the remaining rows one multiply-add each.  int8 takes a
 * pass of eight rows as integers: the pass's eight x values are rounded to 16-bit
 * integers with one scale (FN(i8_pass_x): at most half a step of their largest
 * magnitude / 32767 off), each column's eight products are summed exactly in 32-bit
 * integers (16-bit multiply-adds of pairs), and that sum, rounded to T, times the
 * scale is added to the column's total with one multiply-add; rows before the first
 * whole pass of a group (groups of a size not a multiple of 8) or after the last (in
 * the middle of w), and passes with a value that is not finite or tiny, are widened
 * and added one multiply-add each.  A column past the last whole vector is summed as
 * the vector of the padded storage that holds it.
 * An int8 group's total is multiplied by the group's scale and added to the output
 * after the group.  The same arithmetic in every column, so the column blocking never
 * changes a bit.
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
    T lanes[VW];
    for (int l = 0; l < VW; ++l) lanes[l] = (T)mh_weight_at(fmt, w, i + l);
    return V_LOAD(lanes);
}

/* FN(w_load) at a byte address. */
MH_INLINE V FN(w_at)(const int fmt, const char *p)
{
    return FN(w_load)(fmt, p, 0);
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

/* What a pass asks for ahead of its reads at column vector v (mh_kernels.h):
   MH_PASS_AHEAD_ROWS a line of each of the next pass's eight rows every line's worth
   of vectors, MH_PASS_AHEAD_RUN its 8 ldb bytes in order, as many a vector as this
   pass reads (for rows that are one contiguous run); into L2 (MH_PREFETCH_L2), as a
   pass of long rows asks for more than L1 holds. */
MH_INLINE void FN(pass_ahead)(const int prefetch, const char *q0, int64_t ldb, int64_t step,
                              int64_t line, int64_t v, const char **run)
{
    if (prefetch == MH_PASS_AHEAD_RUN) {
        for (int64_t b = 0; b < 8 * step; b += 64) MH_PREFETCH_L2(*run + b);
        *run += 8 * step;
    } else if (prefetch == MH_PASS_AHEAD_ROWS && v % line == 0) {
        const char *n0 = q0 + 8 * ldb, *n4 = n0 + 4 * ldb;
        MH_PREFETCH_L2(n0);
        MH_PREFETCH_L2(n0 + ldb);
        MH_PREFETCH_L2(n0 + 2 * ldb);
        MH_PREFETCH_L2(n0 + 3 * ldb);
        MH_PREFETCH_L2(n4);
        MH_PREFETCH_L2(n4 + ldb);
        MH_PREFETCH_L2(n4 + 2 * ldb);
        MH_PREFETCH_L2(n4 + 3 * ldb);
    }
}

/* The eight weight vectors of column vector v of a pass whose rows start at q0 and q4
   (four rows further), widened. */
MH_INLINE void FN(pass_ws)(const int fmt, const char *q0, const char *q4, int64_t ldb, V *ws)
{
    const int64_t ldb3 = 3 * ldb;
    ws[0] = FN(w_at)(fmt, q0);
    ws[1] = FN(w_at)(fmt, q0 + ldb);
    ws[2] = FN(w_at)(fmt, q0 + 2 * ldb);
    ws[3] = FN(w_at)(fmt, q0 + ldb3);
    ws[4] = FN(w_at)(fmt, q4);
    ws[5] = FN(w_at)(fmt, q4 + ldb);
    ws[6] = FN(w_at)(fmt, q4 + 2 * ldb);
    ws[7] = FN(w_at)(fmt, q4 + ldb3);
}

/* acc[0, nv*VW) += the eight rows of a pass times xs (FN(eight_rows)), the rows at
   q0, q0 + ldb, ..., q0 + 7 ldb: two pointers and two strides, so that every load is
   one addressing mode and the eight row offsets need not be reloaded from the stack
   (they were: as many loads as the weights' own; 1.1-1.2x with the weights in cache).
   `prefetch`: FN(pass_ahead). */
MH_INLINE void FN(pass_cols)(const int fmt, const V *xs, const char *q0, int64_t ldb,
                             int64_t nv, T *ar, const int prefetch)
{
    const int64_t step = VW * (fmt == MH_NATIVE ? (int64_t)sizeof(T) : 2);
    const int64_t line = step >= 64 ? 1 : 64 / step; /* vectors a line */
    const char *q4 = q0 + 4 * ldb, *run = q0 + 8 * ldb;
    for (int64_t v = 0; v < nv; ++v, q0 += step, q4 += step) {
        FN(pass_ahead)(prefetch, q0, ldb, step, line, v, &run);
        V ws[8];
        FN(pass_ws)(fmt, q0, q4, ldb, ws);
        V_STORE(ar + v * VW, FN(eight_rows)(xs, ws, V_LOAD(ar + v * VW)));
    }
}

/* FN(pass_cols) for R rows at once (x: row 0's eight values of the pass, rows x_row
   apart; acc: row 0's sums, rows acc_row apart): each weight vector is loaded (and
   widened) once for the R rows instead of once a row, the rows' x broadcast as each
   vector is used.  Every sum takes the same operations in the same order as
   FN(pass_cols) row by row: the same bits.  Row by row, each row re-read the pass from
   L2 and was bound by that reading: on an Intel Xeon (AVX-512, 2 threads, weights in
   the last-level cache), 768 x 1536 with 4 rows took 165 -> 89 us (float32) and
   117 -> 72 us (bfloat16), with 8 rows 301 -> 136 us and 226 -> 117 us. */
MH_INLINE void FN(pass_rows)(const int fmt, const T *x, int64_t x_row, const int R,
                             const char *q0, int64_t ldb, int64_t nv, T *acc,
                             int64_t acc_row, const int prefetch)
{
    const int64_t step = VW * (fmt == MH_NATIVE ? (int64_t)sizeof(T) : 2);
    const int64_t line = step >= 64 ? 1 : 64 / step;
    const char *q4 = q0 + 4 * ldb, *run = q0 + 8 * ldb;
    for (int64_t v = 0; v < nv; ++v, q0 += step, q4 += step) {
        FN(pass_ahead)(prefetch, q0, ldb, step, line, v, &run);
        V ws[8];
        FN(pass_ws)(fmt, q0, q4, ldb, ws);
        for (int r = 0; r < R; ++r) {
            const T *xr = x + r * x_row;
            V xs[8];
            for (int i = 0; i < 8; ++i) xs[i] = V_SET1(xr[i]);
            T *ar = acc + r * acc_row + v * VW;
            V_STORE(ar, FN(eight_rows)(xs, ws, V_LOAD(ar)));
        }
    }
}

/* acc[r][0, nv*VW) += x[r][kk] * w[kk][c0 + ...] for kk in [k0, k1) (float weights):
   eight rows of w per pass (FN(eight_rows); eight streams, and the sums loaded and
   stored once for eight rows), each a contiguous run of the block (up to
   MH_LINEAR_BLOCK_BYTES of sums, which the hardware prefetchers stream at the memory's
   rate), then the rows left one at a time. */
MH_INLINE void FN(linear_accumulate)(const int fmt, const mh_linear_args *a, int64_t c0,
                                     int64_t nv, const int R, int64_t k0, int64_t k1,
                                     T *acc, int64_t acc_row)
{
    const T *x = (const T *)a->x;
    const int64_t ld = a->w_row, size = fmt == MH_NATIVE ? (int64_t)sizeof(T) : 2;
    /* The hardware prefetchers alone do not stream eight rows of a pass at the
       memory's rate, so each pass asks for the next as it reads (FN(pass_cols)).
       Half-precision weights whose block is the whole row (less than a vector left for
       the column tail) make the eight rows one run, asked for in order: a whole
       bfloat16 or float16 model's decoding step took 1.04-1.05x less time than asking
       each row for a line at a time.  Not float32, whose pass reads four lines a
       vector: 0.96-0.97x.  The next pass goes to L2: asked into L1, it pushed out
       lines before they were read where the rows are long, and long rows were better
       left to the hardware on an AMD EPYC (an Intel Xeon differed).  Into L2, on the
       EPYC with AVX-512, weights from memory, alternating in one process against
       asking into L1 for rows of at most 3072 bytes and leaving longer ones to the
       hardware: whole SmolLM2-shaped decoding 1.05-1.08x (bfloat16), 1.05-1.07x
       (float32); one row of 576 x 49152 bfloat16 1.12x, 576 x 3072 float32 1.11x,
       1536 x 576 1.19x (bfloat16) and 1.26x (float32). */
    const int whole = c0 == 0 && ld - nv * VW < VW;
    const int ahead = whole && size == 2 ? MH_PASS_AHEAD_RUN : MH_PASS_AHEAD_ROWS;
    int64_t kk = k0;
    for (; kk + 8 <= k1; kk += 8) {
        const char *q0 = (const char *)a->w + (kk * ld + c0) * size;
        const int pf = kk + 16 <= k1 ? ahead : MH_PASS_AHEAD_NONE;
        /* (one row keeps its x broadcast once a pass: through FN(pass_rows), which
           broadcasts it at every vector, one row of 576 x 3072 bfloat16 with the
           weights in cache took 1.10x the time; float32 and weights from memory the
           same within noise) */
        if (R > 1) {
            const T *xr = x + kk;
            if (pf == MH_PASS_AHEAD_RUN)
                FN(pass_rows)(fmt, xr, a->x_row, R, q0, ld * size, nv, acc, acc_row,
                              MH_PASS_AHEAD_RUN);
            else if (pf == MH_PASS_AHEAD_ROWS)
                FN(pass_rows)(fmt, xr, a->x_row, R, q0, ld * size, nv, acc, acc_row,
                              MH_PASS_AHEAD_ROWS);
            else
                FN(pass_rows)(fmt, xr, a->x_row, R, q0, ld * size, nv, acc, acc_row,
                              MH_PASS_AHEAD_NONE);
            continue;
        }
        for (int r = 0; r < R; ++r) {
            const T *xr = x + r * a->x_row + kk;
            V xs[8];
            for (int i = 0; i < 8; ++i) xs[i] = V_SET1(xr[i]);
            T *ar = acc + r * acc_row;
            if (r == 0 && pf == MH_PASS_AHEAD_RUN)
                FN(pass_cols)(fmt, xs, q0, ld * size, nv, ar, MH_PASS_AHEAD_RUN);
            else if (r == 0 && pf == MH_PASS_AHEAD_ROWS)
                FN(pass_cols)(fmt, xs, q0, ld * size, nv, ar, MH_PASS_AHEAD_ROWS);
            else
                FN(pass_cols)(fmt, xs, q0, ld * size, nv, ar, MH_PASS_AHEAD_NONE);
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

/* The x values of a pass, x[0, n) and zeros after (the pass that ends w reads its
   zero rows), rounded for the integer sums: q[i] = rint(x[i] * 32767 / m), m the
   largest |x[i]|, and the scale m / 32767 that they stand for; with MH_HAS_I8_PAIRS also the
   pairs (q0, q1), (q2, q3), ... as the bits of a 32-bit lane (the even value low)
   broadcast in xp.  Returns 0 (the pass is added in floats instead) if a value is not
   finite or m is below 2^-100 but not 0 (its inverse could overflow); scale 0 if
   every value is 0 (the pass adds nothing). */
MH_INLINE int FN(i8_pass_x)(const T *x, int n, T *scale, V *xp, int16_t *q)
{
    float v[8], m = 0;
    for (int i = 0; i < 8; ++i) {
        v[i] = i < n ? (float)x[i] : 0.0f;
        const float mag = fabsf(v[i]);
        if (!(mag <= FLT_MAX)) return 0;
        m = mag > m ? mag : m;
    }
    if (m != 0 && m < 7.8886090522101181e-31f) return 0; /* 2^-100 */
    const float inv = m > 0 ? 32767.0f / m : 0.0f; /* (a pass of zeros: q and scale 0) */
    for (int i = 0; i < 8; ++i) q[i] = (int16_t)rintf(v[i] * inv); /* |q| <= 32767 */
    *scale = (T)(m / 32767.0f);
#if MH_HAS_I8_PAIRS
    for (int j = 0; j < 4; ++j) {
        const uint32_t bits = (uint32_t)(uint16_t)q[2 * j] | (uint32_t)(uint16_t)q[2 * j + 1] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        xp[j] = V_SET1(f);
    }
#else
    (void)xp;
#endif
    return 1;
}

/* The exact sums over one pass of q[i] * w[kk + i][c + l] for the VW columns whose
   pairs start at p (mh_linear_index), as V. */
MH_INLINE V FN(i8_pass)(const int8_t *p, const V *xp, const int16_t *q)
{
#if MH_HAS_I8_PAIRS
    (void)q;
    const VI8 W = V_I8_WIDEN(p);
    return V_I8_DOT(W, xp);
#else
    (void)xp;
    T lanes[VW];
    for (int l = 0; l < VW; ++l) {
        int32_t s = 0;
        for (int j = 0; j < 4; ++j)
            s += (int32_t)q[2 * j] * p[32 * j + 2 * l] + (int32_t)q[2 * j + 1] * p[32 * j + 2 * l + 1];
        lanes[l] = (T)s;
    }
    return V_LOAD(lanes);
#endif
}

/* acc[r][0, nv*VW) += x[r][kk] * w[kk][c0 + ...] for the one row kk of blocked int8
   and the one input row r, widened: one multiply-add each. */
MH_INLINE void FN(linear_one_i8)(const mh_linear_args *a, int64_t c0, int64_t nv, int r,
                                 int64_t kk, T *acc, int64_t acc_row)
{
    const V xs = V_SET1(((const T *)a->x)[r * a->x_row + kk]);
    T *ar = acc + r * acc_row;
    T lanes[VW];
    for (int64_t v = 0; v < nv; ++v) {
        for (int l = 0; l < VW; ++l)
            lanes[l] = (T)((const int8_t *)a->w)[mh_linear_index(a, kk, c0 + v * VW + l)];
        V_STORE(ar + v * VW, V_FMA(xs, V_LOAD(lanes), V_LOAD(ar + v * VW)));
    }
}

/* The columns' pairs of vector v of a blocked int8 pass that starts at w0. */
#define MH_I8_VECTOR(w0, v) ((w0) + (((v) * VW) >> 4) * 128 + (((v) * VW) & 15) * 2)

/* acc[r][0, nv*VW) += one pass of blocked int8 (rows [kk, kk + n), starting at w0) for
   input row r, as integers (FN(i8_pass)), or widened one row at a time if the pass's x
   cannot be held by the integers; with `ahead`, the next pass is asked for in order as
   this one is read. */
MH_INLINE void FN(i8_one_pass)(const mh_linear_args *a, int64_t c0, int64_t nv, int r,
                               int64_t kk, int n, const int8_t *w0, T *acc, int64_t acc_row,
                               int ahead)
{
    T scale;
    V xp[4];
    int16_t q[8];
    if (!FN(i8_pass_x)((const T *)a->x + r * a->x_row + kk, n, &scale, xp, q)) {
        for (int i = 0; i < n; ++i) FN(linear_one_i8)(a, c0, nv, r, kk + i, acc, acc_row);
        return;
    }
    if (scale == 0) return;
    const V sv = V_SET1(scale);
    T *ar = acc + r * acc_row;
    const char *next = (const char *)w0 + 8 * a->w_row;
    for (int64_t v = 0; v < nv; ++v) {
        if (ahead)
            for (int64_t b = 0; b < 8 * VW; b += 64) MH_PREFETCH_L2(next + v * 8 * VW + b);
        V_STORE(ar + v * VW, V_FMA(FN(i8_pass)(MH_I8_VECTOR(w0, v), xp, q), sv,
                                   V_LOAD(ar + v * VW)));
    }
}

/* Asks for vector v's part of the two blocked int8 passes from `next` (pass bytes
   apart), into L2 (see FN(linear_accumulate_i8)). */
MH_INLINE void FN(i8_two_ahead)(const char *next, int64_t pass, int64_t v)
{
    for (int64_t b = 0; b < 8 * VW; b += 64) {
        MH_PREFETCH_L2(next + v * 8 * VW + b);
        MH_PREFETCH_L2(next + pass + v * 8 * VW + b);
    }
}

#if MH_HAS_I8_PAIRS
/* Two whole passes from row kk for R > 1 input rows, as FN(linear_accumulate_i8) takes
   them one row at a time, with each pass's weight vectors loaded and widened once for
   all the rows (the same bits: each row's sums take the same operations in the same
   order).  Rows whose x the integers cannot hold, or whose pass is all zeros, go
   alone (FN(i8_one_pass)). */
MH_INLINE void FN(i8_rows16)(const mh_linear_args *a, int64_t c0, int64_t nv, const int R,
                             int64_t kk, T *acc, int64_t acc_row, int ahead)
{
    const int64_t pass = 8 * a->w_row; /* bytes */
    const int8_t *w0 = (const int8_t *)a->w + mh_linear_index(a, kk, c0), *w1 = w0 + pass;
    const T *x = (const T *)a->x;
    V xp[MH_LINEAR_ROWS][8], sv[MH_LINEAR_ROWS][2];
    T *ar[MH_LINEAR_ROWS];
    int n = 0;
    for (int r = 0; r < R; ++r) {
        T s0, s1;
        int16_t q0[8], q1[8];
        if (!FN(i8_pass_x)(x + r * a->x_row + kk, 8, &s0, xp[n], q0) ||
            !FN(i8_pass_x)(x + r * a->x_row + kk + 8, 8, &s1, xp[n] + 4, q1) || s0 == 0 ||
            s1 == 0) {
            FN(i8_one_pass)(a, c0, nv, r, kk, 8, w0, acc, acc_row, 0);
            FN(i8_one_pass)(a, c0, nv, r, kk + 8, 8, w1, acc, acc_row, 0);
            continue;
        }
        sv[n][0] = V_SET1(s0);
        sv[n][1] = V_SET1(s1);
        ar[n++] = acc + r * acc_row;
    }
    const char *next = (const char *)w1 + pass;
    for (int64_t v = 0; v < nv; ++v) {
        if (ahead) FN(i8_two_ahead)(next, pass, v);
        const VI8 W0 = V_I8_WIDEN(MH_I8_VECTOR(w0, v)), W1 = V_I8_WIDEN(MH_I8_VECTOR(w1, v));
        for (int i = 0; i < n; ++i) {
            V o = V_FMA(V_I8_DOT(W0, xp[i]), sv[i][0], V_LOAD(ar[i] + v * VW));
            o = V_FMA(V_I8_DOT(W1, xp[i] + 4), sv[i][1], o);
            V_STORE(ar[i] + v * VW, o);
        }
    }
}
#endif

/* FN(linear_accumulate) for blocked int8: whole passes as integers (FN(i8_pass)), the
   pass that ends w too, the other rows (or a pass whose x the integers cannot hold)
   one at a time.  Two whole passes go through together where both are integers: each
   column's total is loaded and stored once for the two, and takes the first pass's
   multiply-add, then the second's, as one pass at a time would (the same bits).
   Measured against one pass at a time, alternating in one process (AVX2): products
   with the weights in cache 1.06-1.29x, the 576 x 49152 output head from memory
   1.18-1.34x, a whole int8 SmolLM2-shaped model's decoding step 1.02-1.03x. */
MH_INLINE void FN(linear_accumulate_i8)(const mh_linear_args *a, int64_t c0, int64_t nv,
                                        const int R, int64_t k0, int64_t k1, T *acc,
                                        int64_t acc_row)
{
    const T *x = (const T *)a->x;
    /* A block of a pass is one contiguous run (mh_linear_index), and so is the same
       block of the next pass: asked for in order as this one is read (a whole int8
       model's decoding step: 1.06-1.07x, when only whole rows of at most 3072 bytes
       did so).  Into L2 (MH_PREFETCH_L2): the next one or two passes of a wide block
       are more than L1 holds, and asked into L1 they pushed out lines before they
       were read.  Measured on an AMD EPYC with AVX-512, weights from memory,
       alternating in one process: a whole int8 SmolLM2-shaped model's decoding
       1.06-1.12x; the 576 x 49152 output head (blocks of part of a row, which asked
       for nothing before) 1.13-1.25x.  Tried on an Intel Xeon with AVX-512 instead:
       asking into L1 for the lines 2-6 KB ahead of the two passes being read.  One
       cold row of 576 x 3072 took 1.03-1.10x less time on huge pages and 0.97-0.99x
       on 4 KB pages, the output head 0.97-1.05x, but a whole int8 SmolLM2-shaped
       model decoded at 0.89-0.95x the tokens/s: not kept. */
    const int64_t pass = 8 * a->w_row; /* bytes */
    int64_t kk = k0;
    for (; kk < k1 && (kk & 7); ++kk)
        for (int r = 0; r < R; ++r) FN(linear_one_i8)(a, c0, nv, r, kk, acc, acc_row);
#if MH_HAS_I8_PAIRS
    if (R > 1) /* (rows in a group: FN(i8_rows16)) */
        for (; kk + 16 <= k1; kk += 16)
            FN(i8_rows16)(a, c0, nv, R, kk, acc, acc_row, kk + 32 <= k1);
#endif
    for (; kk + 16 <= k1; kk += 16) {
        const int8_t *w0 = (const int8_t *)a->w + mh_linear_index(a, kk, c0), *w1 = w0 + pass;
        for (int r = 0; r < R; ++r) {
            T s0, s1;
            V xp0[4], xp1[4];
            int16_t q0[8], q1[8];
            const int ahead = r == 0 && kk + 32 <= k1;
            if (!FN(i8_pass_x)(x + r * a->x_row + kk, 8, &s0, xp0, q0) ||
                !FN(i8_pass_x)(x + r * a->x_row + kk + 8, 8, &s1, xp1, q1) || s0 == 0 || s1 == 0) {
                FN(i8_one_pass)(a, c0, nv, r, kk, 8, w0, acc, acc_row, ahead);
                FN(i8_one_pass)(a, c0, nv, r, kk + 8, 8, w1, acc, acc_row, ahead);
                continue;
            }
            const V sv0 = V_SET1(s0), sv1 = V_SET1(s1);
            T *ar = acc + r * acc_row;
            const char *next = (const char *)w1 + pass;
            for (int64_t v = 0; v < nv; ++v) {
                if (ahead) FN(i8_two_ahead)(next, pass, v);
                V o = V_FMA(FN(i8_pass)(MH_I8_VECTOR(w0, v), xp0, q0), sv0, V_LOAD(ar + v * VW));
                o = V_FMA(FN(i8_pass)(MH_I8_VECTOR(w1, v), xp1, q1), sv1, o);
                V_STORE(ar + v * VW, o);
            }
        }
    }
    for (; kk < k1 && (kk + 8 <= k1 || k1 == a->k); kk += 8) {
        const int n = k1 - kk < 8 ? (int)(k1 - kk) : 8;
        const int8_t *w0 = (const int8_t *)a->w + mh_linear_index(a, kk, c0);
        for (int r = 0; r < R; ++r)
            FN(i8_one_pass)(a, c0, nv, r, kk, n, w0, acc, acc_row, r == 0 && kk + 16 <= k1);
    }
    for (; kk < k1; ++kk)
        for (int r = 0; r < R; ++r) FN(linear_one_i8)(a, c0, nv, r, kk, acc, acc_row);
}
#undef MH_I8_VECTOR

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
    /* MH_FEW_ROWS rows of MH_LINEAR_SUMS sums, or up to MH_LINEAR_ROWS of half that: a
       block wider than a row's share goes through a part of its columns at a time (the
       same arithmetic in every column: the same bits) */
    T acc[MH_FEW_ROWS * MH_LINEAR_SUMS];
    const int64_t rs =
        R <= MH_FEW_ROWS ? MH_LINEAR_SUMS : MH_LINEAR_SUMS * MH_FEW_ROWS / MH_LINEAR_ROWS;
    const int grouped = fmt == MH_STORE_I8 && a->group < a->k;
    const int64_t part = (grouped ? rs / 2 : rs) / VW; /* vectors a part */
    for (int64_t p0 = 0; p0 < nv; p0 += part) {
        const int64_t c = c0 + p0 * VW, np = nv - p0 < part ? nv - p0 : part;
        for (int r = 0; r < R; ++r)
            for (int64_t v = 0; v < np; ++v)
                V_STORE(acc + r * rs + v * VW, bias ? V_LOAD(bias + c + v * VW) : V_ZERO());
        if (fmt != MH_STORE_I8) {
            FN(linear_accumulate)(fmt, a, c, np, R, k0, k1, acc, rs);
        } else if (!grouped) { /* one scale per column: scale the sums at the end */
            const float *scale = a->w_scales + c;
            for (int r = 0; r < R; ++r)
                for (int64_t v = 0; v < np; ++v) V_STORE(acc + r * rs + v * VW, V_ZERO());
            FN(linear_accumulate_i8)(a, c, np, R, k0, k1, acc, rs);
            for (int r = 0; r < R; ++r)
                for (int64_t v = 0; v < np; ++v)
                    V_STORE(acc + r * rs + v * VW,
                            V_FMA(FN(scales_load)(scale + v * VW), V_LOAD(acc + r * rs + v * VW),
                                  bias ? V_LOAD(bias + c + v * VW) : V_ZERO()));
        } else { /* groups: a part takes half a row of acc; the group's own sums live in
                    the other half */
            const int64_t half = rs / 2;
            for (int64_t g0 = k0, g1; g0 < k1; g0 = g1) {
                g1 = (g0 / a->group + 1) * a->group < k1 ? (g0 / a->group + 1) * a->group : k1;
                const float *scale = a->w_scales + (g0 / a->group) * a->n + c;
                for (int r = 0; r < R; ++r)
                    for (int64_t v = 0; v < np; ++v)
                        V_STORE(acc + r * rs + half + v * VW, V_ZERO());
                FN(linear_accumulate_i8)(a, c, np, R, g0, g1, acc + half, rs);
                for (int r = 0; r < R; ++r)
                    for (int64_t v = 0; v < np; ++v)
                        V_STORE(acc + r * rs + v * VW,
                                V_FMA(FN(scales_load)(scale + v * VW),
                                      V_LOAD(acc + r * rs + half + v * VW),
                                      V_LOAD(acc + r * rs + v * VW)));
            }
        }
        for (int r = 0; r < R; ++r)
            for (int64_t v = 0; v < np; ++v)
                V_STORE(dst + r * dst_row + p0 * VW + v * VW, V_LOAD(acc + r * rs + v * VW));
    }
}

/* One column c of the < VW-wide tail over rows [k0, k1) of w, into dst (rows dst_row
   apart), with the arithmetic of the vector lanes: float weights in lane 0 of a
   vector, int8 as the padded storage's vector that holds c. */
static void FN(linear_rows_column)(const mh_linear_args *a, int64_t c, int R, int64_t k0,
                                   int64_t k1, T *dst, int64_t dst_row, int with_bias)
{
    const T *x = (const T *)a->x, *bias = with_bias ? (const T *)a->bias : NULL;
    const int fmt = a->w_fmt;
    T lanes[VW];
    if (fmt == MH_STORE_I8) { /* the padded vector holding c, summed as the blocks are */
        const int64_t cv = c - c % VW;
        T sums[MH_LINEAR_ROWS][VW];
        V acc[MH_LINEAR_ROWS];
        for (int r = 0; r < R; ++r) acc[r] = V_SET1(bias ? bias[c] : (T)0);
        for (int64_t g0 = k0, g1; g0 < k1; g0 = g1) {
            g1 = (g0 / a->group + 1) * a->group < k1 ? (g0 / a->group + 1) * a->group : k1;
            for (int r = 0; r < R; ++r) V_STORE(sums[r], V_ZERO());
            FN(linear_accumulate_i8)(a, cv, 1, R, g0, g1, sums[0], VW);
            for (int r = 0; r < R; ++r)
                acc[r] = V_FMA(V_SET1((T)a->w_scales[(g0 / a->group) * a->n + c]),
                               V_SET1(sums[r][c - cv]), acc[r]);
        }
        for (int r = 0; r < R; ++r) {
            V_STORE(lanes, acc[r]);
            dst[r * dst_row] = lanes[0];
        }
        return;
    }
    for (int r = 0; r < R; ++r) { /* float weights: FN(linear_accumulate)'s arithmetic */
        V acc = V_SET1(bias ? bias[c] : (T)0);
        int64_t kk = k0;
        for (; kk + 8 <= k1; kk += 8) {
            V xs[8], ws[8];
            for (int i = 0; i < 8; ++i) {
                xs[i] = V_SET1(x[r * a->x_row + kk + i]);
                ws[i] = V_SET1((T)mh_weight_at(fmt, a->w, (kk + i) * a->w_row + c));
            }
            acc = FN(eight_rows)(xs, ws, acc);
        }
        for (; kk < k1; ++kk)
            acc = V_FMA(V_SET1(x[r * a->x_row + kk]),
                        V_SET1((T)mh_weight_at(fmt, a->w, kk * a->w_row + c)), acc);
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
    const int R = a->m < MH_LINEAR_ROWS ? (int)a->m : MH_LINEAR_ROWS;
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
    if (fmt == MH_STORE_I8) { /* blocked: a pair of rows at a time, c0 a multiple of 16 */
        const int8_t *w = (const int8_t *)a->w;
        for (int64_t kk = 0; kk < a->k; kk += 2) {
            const int two = kk + 1 < a->k;
            const float *s0 = a->w_scales + (kk / a->group) * a->n + c0;
            const float *s1 = two ? a->w_scales + ((kk + 1) / a->group) * a->n + c0 : s0;
            T *d0 = dst + kk * cols, *d1 = d0 + cols;
            int64_t c = 0;
#if MH_HAS_I8_PAIRS
            for (; c + VW <= cols; c += VW) {
                V even, odd;
                V_LOAD_I8_PAIRS(w + mh_linear_index(a, kk, c0 + c), even, odd);
                V_STORE(d0 + c, V_MUL(even, FN(scales_load)(s0 + c)));
                if (two) V_STORE(d1 + c, V_MUL(odd, FN(scales_load)(s1 + c)));
            }
#endif
            for (; c < cols; ++c) {
                d0[c] = (T)w[mh_linear_index(a, kk, c0 + c)] * s0[c];
                if (two) d1[c] = (T)w[mh_linear_index(a, kk + 1, c0 + c)] * s1[c];
            }
        }
        return;
    }
    for (int64_t kk = 0; kk < a->k; ++kk) {
        T *d = dst + kk * cols;
        int64_t c = 0;
        const int64_t at = kk * a->w_row + c0;
        if (fmt == MH_STORE_F16) {
            for (; c + VW <= cols; c += VW) V_STORE(d + c, FN(w_load)(MH_STORE_F16, a->w, at + c));
        } else if (fmt == MH_STORE_BF16) {
            for (; c + VW <= cols; c += VW) V_STORE(d + c, FN(w_load)(MH_STORE_BF16, a->w, at + c));
        }
        for (; c < cols; ++c) d[c] = (T)mh_weight_at(fmt, a->w, at + c);
    }
}
