/*
 * The more-rows path of the dense projection: one tile of the output through
 * a BLAS gemm (single-threaded; the caller's OpenMP threads run the tiles).
 * Compiled without ISA flags: it only moves the bias and calls the BLAS (weights in
 * another format are widened by the ISA kernels first, a stripe of columns at a time).
 *
 * Row-major out = x @ w is, read column-major, out^T = w^T x^T, so the call is
 * gemm("N", "N", tile_n, tile_m, k, 1, w + n0, w_row, x + m0 * x_row, x_row,
 *      beta, out + m0 * out_row + n0, out_row) with beta = 1 after the tile
 * was filled with the bias (0 without one).
 */
#include "mh_kernels.h"

#define MH_TILE_BODY(T, GEMM)                                                            \
    const int64_t n_tiles = (a->n + a->tile_n - 1) / a->tile_n;                           \
    const int64_t m0 = (tile / n_tiles) * a->tile_m, n0 = (tile % n_tiles) * a->tile_n;   \
    const int rows = (int)(a->m - m0 < a->tile_m ? a->m - m0 : a->tile_m);                \
    const int cols = (int)(a->n - n0 < a->tile_n ? a->n - n0 : a->tile_n);                \
    const int k = (int)a->k, lw = (int)a->w_row, lx = (int)a->x_row, lo = (int)a->out_row; \
    const T one = 1, zero = 0;                                                             \
    const T *bias = (const T *)a->bias;                                                    \
    T *out = (T *)a->out + m0 * a->out_row + n0;                                           \
    if (bias)                                                                              \
        for (int r = 0; r < rows; ++r)                                                     \
            for (int c = 0; c < cols; ++c) out[r * a->out_row + c] = bias[n0 + c];         \
    a->GEMM("N", "N", &cols, &rows, &k, &one, (const T *)a->w + n0, &lw,                    \
            (const T *)a->x + m0 * a->x_row, &lx, bias ? &one : &zero, out, &lo);

void mh_linear_tile_f32(const mh_linear_args *a, int64_t tile) { MH_TILE_BODY(float, sgemm) }

void mh_linear_tile_f64(const mh_linear_args *a, int64_t tile) { MH_TILE_BODY(double, dgemm) }

void mh_linear_stripe_f32(const mh_linear_args *a, int64_t stripe, float *scratch,
                          mh_linear_widen_fn widen)
{
    const int64_t n0 = stripe * a->tile_n;
    const int cols = (int)(a->n - n0 < a->tile_n ? a->n - n0 : a->tile_n);
    const int rows = (int)a->m, k = (int)a->k, lx = (int)a->x_row, lo = (int)a->out_row;
    const float one = 1, zero = 0;
    const float *bias = (const float *)a->bias;
    float *out = (float *)a->out + n0;
    widen(a, n0, cols, scratch);
    if (bias)
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) out[r * a->out_row + c] = bias[n0 + c];
    a->sgemm("N", "N", &cols, &rows, &k, &one, scratch, &cols, (const float *)a->x, &lx,
             bias ? &one : &zero, out, &lo);
}

#define MH_MERGE_BODY(T)                                                                   \
    const int64_t R = a->m, n = a->n;                                                      \
    const T *bias = (const T *)a->bias, *part = (const T *)a->partial;                     \
    for (int64_t r = 0; r < R; ++r) {                                                      \
        T *out = (T *)a->out + r * a->out_row;                                             \
        for (int64_t c = 0; c < n; ++c) out[c] = bias ? bias[c] : (T)0;                   \
        for (int64_t ch = 0; ch < n_chunks; ++ch) {                                        \
            const T *p = part + (ch * R + r) * n;                                          \
            for (int64_t c = 0; c < n; ++c) out[c] += p[c];                                \
        }                                                                                  \
    }

void mh_linear_merge_f32(const mh_linear_args *a, int64_t n_chunks) { MH_MERGE_BODY(float) }

void mh_linear_merge_f64(const mh_linear_args *a, int64_t n_chunks) { MH_MERGE_BODY(double) }

/* The sum of p[0 .. n): a plain streaming read of n floats, for measuring the
   machine's read rate the way the few-rows product reads its weights, several runs side
   by side: the four quarters of p, a line of each in turn (16 sums a quarter, so the
   adds keep up with the memory). */
float mh_read_sum(const float *p, int64_t n)
{
    float s[4][16] = {{0}};
    const int64_t q = n / 64 * 16;
    for (int64_t i = 0; i < q; i += 16)
        for (int r = 0; r < 4; ++r)
            for (int l = 0; l < 16; ++l) s[r][l] += p[r * q + i + l];
    for (int64_t i = 4 * q; i < n; ++i) s[0][0] += p[i];
    float total = 0;
    for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 16; ++l) total += s[r][l];
    return total;
}
