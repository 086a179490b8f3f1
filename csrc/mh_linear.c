/*
 * The more-rows path of the dense projection: one tile of the output through
 * a BLAS gemm (single-threaded; the caller's OpenMP threads run the tiles).
 * Compiled without ISA flags: it moves the bias, asks for the weights and calls the
 * BLAS (weights in another format are widened by the ISA kernels first, a stripe of
 * columns at a time).
 *
 * Row-major out = x @ w is, read column-major, out^T = w^T x^T, so the call is
 * gemm("N", "N", tile_n, tile_m, k, 1, w + n0, w_row, x + m0 * x_row, x_row,
 *      beta, out + m0 * out_row + n0, out_row) with beta = 1 after the tile
 * was filled with the bias (0 without one).
 *
 * The first tile of a column stripe (m0 == 0) first asks for the stripe's weights,
 * a line at a time into L2, and then calls the gemm.  The gemm copies them into its
 * own layout in blocks whose rows are runs of tile_n weights a whole row of w apart,
 * and from memory (as a model's prefill finds each layer's weights) those runs came
 * slowly: a tile took about 1.4x its time with the weights in cache.  Asked for
 * first, on an Intel Xeon with AVX-512 (2 threads, alternating in one process): a
 * SmolLM2-shaped float32 model's prefill of 128 tokens took 0.84x the time, of 512
 * tokens 0.92x, of 2048 tokens 0.94x; single products of 128 rows with their weights
 * from memory 0.87-0.90x (576 x 3072, 576 x 960) and 0.95-0.97x (1536 x 576), and
 * with the weights in cache 1.0-1.1x.  Later row tiles of the stripe find them in
 * cache and ask for nothing; a stripe of more than MH_TILE_ASK_BYTES asks for its
 * first rows only.
 */
#include "mh_kernels.h"

/* A stripe's first rows asked for, at most: the whole of a larger one, asked for
   first, took 1.04-1.07x the time (128 rows of 4096 x 11008, 11008 x 4096, and 512
   rows of 4096 x 4096 in 4 MB stripes, float32, weights from memory), its first
   1 MB about the same time as not asking. */
#define MH_TILE_ASK_BYTES ((int64_t)1 << 20)

/* Asks for rows [0, k) of `bytes` bytes each, `stride` bytes apart, from p, up to
   MH_TILE_ASK_BYTES of them (a macro: as a function of its own, which has no effect
   the compiler sees, its calls went away). */
#define MH_TILE_ASK(p, k, bytes, stride)                                                   \
    do {                                                                                   \
        const char *ask_ = (p);                                                            \
        const int64_t most_ = MH_TILE_ASK_BYTES / (bytes), rows_ = (k) < most_ ? (k) : most_; \
        for (int64_t r_ = 0; r_ < rows_; ++r_, ask_ += (stride))                           \
            for (int64_t c_ = 0; c_ < (bytes); c_ += 64) MH_PREFETCH_L2(ask_ + c_);         \
    } while (0)

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
    if (m0 == 0)                                                                           \
        MH_TILE_ASK((const char *)((const T *)a->w + n0), k, (int64_t)cols * (int64_t)sizeof(T), \
                    a->w_row * (int64_t)sizeof(T));                                          \
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
