/*
 * Few-rows dense projection (decode): out[r][c] = bias[c] + sum_k x[r][k] w[k][c]
 * for up to MH_FEW_ROWS rows, one block of columns (the plan's tile_n) per work item.
 * Instantiated per (ISA, scalar type) by mh_instance.h, with the same
 * macros.  Memory-bound: each row of w's block is read once, as whole vectors,
 * for every input row at once.  Each output element adds k = 0, 1, ... in
 * order with the path's multiply-add, so the column blocking never changes a
 * bit.
 */

/* Columns [c0, c0 + nv*VW) of R rows.  The block's partial sums live in `acc` (L1/L2),
   and w is read a whole block row at a time, four rows of k per pass: contiguous
   runs of up to MH_LINEAR_BLOCK_BYTES, which the hardware prefetchers stream at the
   memory's rate (a few vectors per row of w with a stride of n, as before, touched a
   new page at every row and read 576 x 49152 float32 at a third of the rate).  Each
   sum still adds k = 0, 1, ... in order: the bits do not depend on the blocks. */
static void FN(linear_rows_block)(const mh_linear_args *a, int64_t c0, int64_t nv, const int R)
{
    const T *x = (const T *)a->x, *w = (const T *)a->w + c0, *bias = (const T *)a->bias;
    const int64_t k = a->k, ld = a->w_row;
    T *out = (T *)a->out + c0;
    T acc[MH_FEW_ROWS][MH_LINEAR_BLOCK_BYTES / sizeof(T)];
    for (int r = 0; r < R; ++r)
        for (int64_t v = 0; v < nv; ++v)
            V_STORE(acc[r] + v * VW, bias ? V_LOAD(bias + c0 + v * VW) : V_ZERO());
    int64_t kk = 0;
    for (; kk + 4 <= k; kk += 4) {
        const T *w0 = w + kk * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
        for (int r = 0; r < R; ++r) {
            const T *xr = x + r * a->x_row + kk;
            const V x0 = V_SET1(xr[0]), x1 = V_SET1(xr[1]), x2 = V_SET1(xr[2]),
                    x3 = V_SET1(xr[3]);
            T *ar = acc[r];
            for (int64_t v = 0; v < nv; ++v) {
                const int64_t o = v * VW;
                V s = V_FMA(x0, V_LOAD(w0 + o), V_LOAD(ar + o));
                s = V_FMA(x1, V_LOAD(w1 + o), s);
                s = V_FMA(x2, V_LOAD(w2 + o), s);
                V_STORE(ar + o, V_FMA(x3, V_LOAD(w3 + o), s));
            }
        }
    }
    for (; kk < k; ++kk)
        for (int r = 0; r < R; ++r) {
            const V xs = V_SET1(x[r * a->x_row + kk]);
            for (int64_t v = 0; v < nv; ++v)
                V_STORE(acc[r] + v * VW,
                        V_FMA(xs, V_LOAD(w + kk * ld + v * VW), V_LOAD(acc[r] + v * VW)));
        }
    for (int r = 0; r < R; ++r)
        for (int64_t v = 0; v < nv; ++v)
            V_STORE(out + r * a->out_row + v * VW, V_LOAD(acc[r] + v * VW));
}

/* One column c < VW-wide tail, lane 0 of a vector, so the arithmetic is the
   vector lanes' own. */
static void FN(linear_rows_column)(const mh_linear_args *a, int64_t c, int64_t rows)
{
    const T *x = (const T *)a->x, *w = (const T *)a->w + c, *bias = (const T *)a->bias;
    T *out = (T *)a->out + c;
    T lanes[VW];
    for (int64_t r = 0; r < rows; ++r) {
        V acc = V_SET1(bias ? bias[c] : (T)0);
        for (int64_t kk = 0; kk < a->k; ++kk)
            acc = V_FMA(V_SET1(x[r * a->x_row + kk]), V_SET1(w[kk * a->w_row]), acc);
        V_STORE(lanes, acc);
        out[r * a->out_row] = lanes[0];
    }
}

/* mh_linear_rows_fn: columns [block * a->tile_n, ...) of every row (the plan makes a
   block at most MH_LINEAR_BLOCK_BYTES of a row of w, and a multiple of 16 columns). */
void FN(mh_linear_rows_item)(const mh_linear_args *a, int64_t block)
{
    const int64_t start = block * a->tile_n;
    const int64_t end = start + a->tile_n < a->n ? start + a->tile_n : a->n;
    const int64_t nv = (end - start) / VW;
    const int R = a->m < MH_FEW_ROWS ? (int)a->m : MH_FEW_ROWS;
    if (nv > 0) FN(linear_rows_block)(a, start, nv, R);
    for (int64_t c = start + nv * VW; c < end; ++c) FN(linear_rows_column)(a, c, a->m);
}
