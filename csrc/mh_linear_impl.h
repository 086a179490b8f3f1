/*
 * Few-rows dense projection (decode): out[r][c] = bias[c] + sum_k x[r][k] w[k][c]
 * for up to MH_FEW_ROWS rows, one block of MH_LINEAR_COLS columns per work item.
 * Instantiated per (ISA, scalar type) by mh_instance.h, with the same
 * macros.  Memory-bound: each row of w's block is read once, as whole vectors,
 * for every input row at once.  Each output element adds k = 0, 1, ... in
 * order with the path's multiply-add, so the column blocking never changes a
 * bit.
 */

/* NV vectors of columns [c0, c0 + NV*VW) for R rows. */
MH_INLINE void FN(linear_rows_tile)(const mh_linear_args *a, int64_t c0, const int R,
                                    const int NV)
{
    const T *x = (const T *)a->x, *w = (const T *)a->w + c0, *bias = (const T *)a->bias;
    T *out = (T *)a->out + c0;
    V acc[MH_FEW_ROWS][4];
    for (int v = 0; v < NV; ++v) {
        const V b = bias ? V_LOAD(bias + c0 + v * VW) : V_ZERO();
        for (int r = 0; r < R; ++r) acc[r][v] = b;
    }
    for (int64_t kk = 0; kk < a->k; ++kk) {
        V wv[4];
        for (int v = 0; v < NV; ++v) wv[v] = V_LOAD(w + kk * a->w_row + v * VW);
        for (int r = 0; r < R; ++r) {
            const V xs = V_SET1(x[r * a->x_row + kk]);
            for (int v = 0; v < NV; ++v) acc[r][v] = V_FMA(xs, wv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) V_STORE(out + r * a->out_row + v * VW, acc[r][v]);
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

#define MH_LINEAR_ROWS(R)                                                                 \
    do {                                                                                   \
        for (; c + 4 * VW <= end; c += 4 * VW) FN(linear_rows_tile)(a, c, R, 4);          \
        for (; c + VW <= end; c += VW) FN(linear_rows_tile)(a, c, R, 1);                  \
    } while (0)

/* mh_linear_rows_fn: columns [block * MH_LINEAR_COLS, ...) of every row. */
void FN(mh_linear_rows_item)(const mh_linear_args *a, int64_t block)
{
    const int64_t start = block * MH_LINEAR_COLS;
    const int64_t end = start + MH_LINEAR_COLS < a->n ? start + MH_LINEAR_COLS : a->n;
    int64_t c = start;
    switch (a->m) {
    case 1: MH_LINEAR_ROWS(1); break;
    case 2: MH_LINEAR_ROWS(2); break;
    case 3: MH_LINEAR_ROWS(3); break;
    default: MH_LINEAR_ROWS(4); break;
    }
    for (; c < end; ++c) FN(linear_rows_column)(a, c, a->m);
}
#undef MH_LINEAR_ROWS
