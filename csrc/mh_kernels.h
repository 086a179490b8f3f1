/*
 * manyheads kernel contract.
 *
 * The kernels compute one "work item" of causal (or masked) scaled dot-product
 * attention: a block of up to MH_BLOCK_Q query rows of one (batch, head) pair,
 * streamed over blocks of MH_BLOCK_K keys with an online (running max, running
 * sum) softmax.  The score matrix is never materialised beyond one
 * MH_BLOCK_K x MH_BLOCK_Q tile that lives in the caller-provided scratch.
 *
 * Layout.  Every tensor is addressed as  base + off[bh] + row * row_stride + col
 * with all offsets and strides in ELEMENTS (not bytes); the last axis is
 * contiguous.  `bh` is the flat (batch, query head) index; the caller folds
 * broadcasting and grouped-query head sharing into the per-bh offset tables,
 * so the kernels never see batch shapes.
 *
 * Contract.  Kernels do not allocate, do not take locks, do not touch Python,
 * and write only the output rows (and weight rows) of their own work item, so
 * any number of work items may run concurrently and the result does not depend
 * on how they are scheduled.  No validation happens here: the Python layer
 * checks shapes, dtypes, strides and alignment before calling.
 *
 * This header is plain C99 and has no Python dependency.
 */
#ifndef MANYHEADS_KERNELS_H
#define MANYHEADS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_MSC_VER) && !defined(__cplusplus) && !defined(inline)
#define inline __inline /* older MSVC C modes spell it __inline */
#endif
#if defined(_MSC_VER)
#define MH_RESTRICT __restrict
#else
#define MH_RESTRICT restrict
#endif

#define MH_BLOCK_Q 64 /* query rows per work item */
#define MH_BLOCK_K 64 /* keys per streamed block */
#define MH_DOT_ROWS 4 /* up to this many query rows use dot-product scores (decode) */

enum mh_mask_kind { MH_MASK_NONE = 0, MH_MASK_BOOL = 1, MH_MASK_ADD = 2 };
enum mh_isa { MH_ISA_BASELINE = 0, MH_ISA_AVX2 = 1, MH_ISA_AVX512 = 2, MH_ISA_COUNT = 3 };

typedef struct mh_attn_args {
    int64_t n_bh;     /* number of (batch, query head) pairs */
    int64_t q_len;    /* L: query rows per pair */
    int64_t kv_len;   /* S: keys per pair */
    int64_t head_dim; /* E: query/key width */
    int64_t v_dim;    /* Ev: value/output width */

    const void *q; const int64_t *q_off; int64_t q_row;   /* (n_bh, L, E)  */
    const void *k; const int64_t *k_off; int64_t k_row;   /* (n_bh, S, E)  */
    const void *v; const int64_t *v_off; int64_t v_row;   /* (n_bh, S, Ev) */
    void *out;     const int64_t *out_off; int64_t out_row; /* (n_bh, L, Ev) */

    /* Optional mask (n_bh, L, S): MH_MASK_BOOL reads bytes, nonzero = may
       attend; MH_MASK_ADD reads the kernel's float type and adds it to the
       scaled scores.  Row and column strides may be 0 (broadcast). */
    int mask_kind;
    const void *mask; const int64_t *mask_off; int64_t mask_row; int64_t mask_col;

    /* Causal: query row i may attend key j iff j <= i + causal_offset.
       0 is PyTorch's top-left alignment; S - L aligns queries to the end.
       window > 0 (causal only) also hides keys j <= i + causal_offset - window. */
    int causal;
    int64_t causal_offset;
    int64_t window;

    /* K and V hold float16 (read and widened by the kernels; float32 only) */
    int kv_half;

    double scale;       /* multiplies q.k */
    double dropout_p;   /* probability of dropping an attention weight */
    uint64_t seed;      /* dropout stream: see mh_dropout_bits() */

    /* Optional: dense weights (n_bh, L, S), C-contiguous, pre-zeroed by the
       caller; when set, the kernel also writes the (post-dropout) weights. */
    void *weights;

    /* Decode split (mh_split_item / mh_merge_item): keys cut into n_split
       ranges of split_keys; partial outputs (n_bh, n_split, L, Ev), row max
       and row sum (n_bh, n_split, L), all of the kernel's float type. */
    int64_t n_split, split_keys;
    void *part_acc, *part_max, *part_sum;
} mh_attn_args;

/* One work item: pair `bh`, query rows [q_start, min(q_start + MH_BLOCK_Q, L)).
   `scratch` must hold mh_scratch_bytes(E, Ev, sizeof(T)) bytes, 64-byte aligned. */
typedef void (*mh_fwd_item_fn)(const mh_attn_args *args, int64_t bh, int64_t q_start,
                               void *scratch);

typedef struct mh_kernel_table {
    const char *name;
    mh_fwd_item_fn fwd_f32;
    mh_fwd_item_fn fwd_f64;
    mh_fwd_item_fn split_f32; /* (args, bh, split index, scratch) */
    mh_fwd_item_fn split_f64;
    mh_fwd_item_fn merge_f32; /* (args, bh, unused, scratch of >= Ev elements) */
    mh_fwd_item_fn merge_f64;
    void (*exp_f32)(const float *x, float *y, int64_t n);   /* the path's vector exp */
    void (*exp_f64)(const double *x, double *y, int64_t n);
} mh_kernel_table;

/* Bytes of per-thread scratch needed by one work item. */
size_t mh_scratch_bytes(int64_t head_dim, int64_t v_dim, size_t elem_size);

/* 1 if this CPU and OS can run `isa`, 0 otherwise. */
int mh_cpu_supports(int isa);

/* 1 if this build contains the code path for `isa`, 0 otherwise. */
int mh_isa_compiled(int isa);

/* The kernels of `isa`, or NULL when not compiled in.  Does not check the CPU. */
const mh_kernel_table *mh_kernels(int isa);

/* Dropout stream: 64 pseudo-random bits for element (bh, i, j) of a call with
   the given seed.  The element is kept iff (bits >> 40) * 2^-24 >= p.
   Counter-based, so the same on every thread count and ISA path; the NumPy
   oracle implements the same function. */
static inline uint64_t mh_dropout_bits(uint64_t seed, uint64_t bh, uint64_t i, uint64_t j,
                                       uint64_t q_len, uint64_t kv_len)
{
    uint64_t z = seed + ((bh * q_len + i) * kv_len + j) * UINT64_C(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* IEEE half -> float, exactly (subnormals, infinities and NaN included). */
static inline float mh_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } r;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24 */
        return sign ? -f : f;
    }
    r.u = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                    : (sign | ((exp + 112u) << 23) | (mant << 13));
    return r.f;
}

#ifdef __cplusplus
}
#endif
#endif /* MANYHEADS_KERNELS_H */
