/*
 * manyheads kernel contract.
 *
 * The kernels compute one "work item" of causal (or masked) scaled dot-product
 * attention: a block of up to MH_BLOCK_Q query rows of one (batch, head) pair,
 * streamed over blocks of MH_BLOCK_K keys with an online (running max, running
 * sum) softmax.  The score matrix is never materialised beyond one
 * MH_BLOCK_K x MH_BLOCK_Q tile that lives in the caller-provided scratch.
 *
 * Layout.  Every operand is an mh_operand: element (pair, row, col) lives at
 * base + off[pair] + row * row_stride + col * col_stride, all in ELEMENTS (not
 * bytes); col_stride is 1 except for masks.  `pair` is the flat (batch, query
 * head) index; the caller folds broadcasting and grouped-query head sharing
 * into the per-pair offset tables, so the kernels never see batch shapes.
 *
 * Contract.  Kernels do not allocate, do not take locks, do not touch Python,
 * and write only the output rows (and weight rows) of their own work item, so
 * any number of work items may run concurrently and the result does not depend
 * on how they are scheduled.  No validation happens here: the Python layer
 * checks shapes, dtypes, strides and alignment before calling.  What a call
 * does (schedule, path and reads of each kind of item, threads, scratch) is
 * decided once, by mh_plan_attention, and read by every item.
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

#include "mh_formats.h"
#include "mh_isa_list.h"

/* A hint that the cache line at p will be read soon (no effect where unknown);
   MH_PREFETCH_L2: soon, but not before lines that are nearer (into L2, not L1). */
#if defined(__GNUC__) || defined(__clang__)
#define MH_PREFETCH(p) __builtin_prefetch(p)
#define MH_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <intrin.h>
#define MH_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define MH_PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#else
#define MH_PREFETCH(p) ((void)(p))
#define MH_PREFETCH_L2(p) ((void)(p))
#endif

#define MH_BLOCK_Q 64   /* query rows per work item */
#define MH_BLOCK_K 64   /* keys per streamed block */
#define MH_FEW_ROWS 4   /* up to this many rows take the few-rows paths (decode) */
/* Decode over float32 (or float64) keys and values asks for rows ahead only when
   they take this many bytes or more (smaller ones may sit in the last-level cache,
   where the requests cost more than they save: mh_kv_rows.h, FN(prefetch_rows)), or,
   in a compiled decoding step, when the step's weights do (they push every layer's
   keys and values out before that layer's next token).  Narrower formats always ask
   (mh_plan.c). */
#define MH_PREFETCH_MIN_BYTES (4.0 * 1024 * 1024)
#define MH_SCRATCH_ALIGN 64 /* bytes; every scratch part starts on such a boundary */
#define MH_I4_MAX_GROUPS 16 /* int4 rows read in place have at most this many groups
                               (head sizes up to 512) */

enum mh_mask_kind { MH_MASK_NONE = 0, MH_MASK_BOOL = 1, MH_MASK_ADD = 2 };

/* Kernel paths: enum mh_isa { MH_ISA_AVX512BF16, ..., MH_ISA_BASELINE }, best first. */
#define MH_ISA_ENUM(ID, sfx, needs, file, flags, msvc) MH_ISA_##ID,
enum mh_isa { MH_ISA_LIST(MH_ISA_ENUM) MH_ISA_COUNT };
#undef MH_ISA_ENUM

/* One operand: see "Layout" above. */
typedef struct mh_operand {
    const void *base;
    const int64_t *off; /* one entry per (batch, query head) pair */
    int64_t row;        /* row stride */
    int64_t col;        /* column stride: 1, or 0 for a broadcast mask column */
} mh_operand;

/* Causal structure: query row i may attend key j iff j <= i + offset (and, with
   window > 0, j > i + offset - window).  offset 0 is PyTorch's top-left
   alignment; S - L aligns the queries to the end of the keys. */
typedef struct mh_causal {
    int enabled;
    int64_t offset;
    int64_t window; /* 0: none */
} mh_causal;

/* ---- the plan of one call --------------------------------------------------

   What a call does is decided once, by mh_plan_attention (mh_plan.c), before
   any work item runs; the items read the plan and decide nothing.

   Schedules.  Block: every (pair, query block of up to MH_BLOCK_Q rows) is an
   item (mh_block_fn).  Split (a few query rows against many keys): every
   (pair, run of split_run consecutive key ranges of split_keys keys) is an
   item (mh_split_fn) that writes a partial (output, row max, row sum) triple
   per range, and a second pass merges each pair's ranges in range order
   (mh_merge_fn).  A thread then streams a run's keys and values in one go
   (its read-ahead runs on across the ranges), while a range's result is the
   same in any run.

   Paths.  An item of a few rows (decode) takes the few-rows path: scores per
   row, keys and values read in place where their format and width allow.
   Larger items take the tile path (the query block transposed, scores key-
   major), or its bfloat16 pair-product variant (vdpbf16ps) where the ISA has
   one and the queries, keys and values are all bfloat16. */
enum mh_path { MH_PATH_TILE = 0, MH_PATH_PAIRS = 1, MH_PATH_FEW_ROWS = 2 };

/* How an item reads a key or value block: in place (strided rows, widened
   as they load), copied (widened) into the item's scratch block by block, or
   from the rows its thread keeps widened for the pair (half-precision tile
   path, kept across the pair's query blocks). */
enum mh_read { MH_READ_IN_PLACE = 0, MH_READ_COPIED = 1, MH_READ_WIDENED = 2 };

/* The items of one kind. */
typedef struct mh_item_plan {
    int64_t rows;       /* query rows of such an item */
    int path;           /* enum mh_path */
    int k_read, v_read; /* enum mh_read */
} mh_item_plan;

typedef struct mh_plan {
    int64_t n_pairs;    /* pairs the items serve: (batch, query head), or
                           (batch, kv head) when query heads are grouped */
    int64_t group;      /* query heads served together by one item (1: none) */
    int64_t n_blocks;   /* query blocks per pair (block schedule) */
    int64_t n_split;    /* key ranges per pair; 0: block schedule */
    int64_t split_keys; /* keys per range */
    int64_t split_run;  /* ranges per item, taken in turn (split schedule) */
    int64_t n_items;    /* items of the first pass */
    mh_item_plan item[2]; /* [0] every item, except [1] a pair's last query
                             block in the block schedule */
    int threads;        /* OpenMP threads of the first pass */
    int merge_threads;  /* ... and of the merge pass */
    int prefetch;       /* the few-rows path asks for rows ahead (large K/V) */
    int prefetch_near;  /* ... int4 rows one phase ahead, into L1 (mh_kv_rows.h) */
    int i4_permutes;    /* int4 values mixed through byte permutes (mh_i4_dots.h) */
    int64_t widened_rows; /* tile path over float16/bfloat16 K/V: rows each
                             thread keeps widened (kv_len), 0: none */
    size_t scratch_stride; /* bytes between two threads' scratch areas */
    size_t partial_elems;  /* split schedule: partial results, elements of
                              the kernel's float type (acc, max, sum) */
    double work;        /* multiply-adds of the call (scores and mix) */
} mh_plan;

/* What the planner needs to know of a call (no data pointers). */
typedef struct mh_call_desc {
    int64_t n_pairs;    /* (batch, query head) pairs */
    int64_t q_len, kv_len, head_dim, v_dim;
    int64_t gqa;        /* query heads per kv head sharing it (1: none) */
    int elem_size;      /* the kernel's float type: 4 or 8 bytes */
    int q_format, kv_format; /* enum mh_storage */
    int64_t k_row_bytes, v_row_bytes; /* row strides of keys and values */
    int mask;           /* a user mask is given */
    int mask_per_head;  /* ... and it differs between query heads */
    int weights;        /* the dense weights are written */
    int dropout;        /* dropout_p > 0 */
    int split;          /* split schedule: -1 automatic, 0 never, 1 if allowed */
    int threads;        /* the call's share of the thread budget */
    int contended;      /* threads were recently found without a core */
} mh_call_desc;

/* What an instantiation (ISA, float type) can do, for the planner. */
typedef struct mh_caps {
    int lanes;          /* elements per vector */
    unsigned in_place;  /* bit (1 << fmt): few-rows path reads fmt in place */
    int pair_dot;       /* bfloat16 pair dot products (MH_PATH_PAIRS) */
    int byte_permutes;  /* an int4 value mix through AVX512-VBMI byte permutes,
                           for CPUs that have them (mh_i4_dots.h) */
} mh_caps;

/* Fills *plan for the call *d on an instantiation with capabilities *caps. */
void mh_plan_attention(const mh_call_desc *d, const mh_caps *caps, mh_plan *plan);

/* Threads for n_items work items of `work` multiply-adds in all, from a share
   of `threads`: at most one per item, and one for a call too small to wake
   the pool for (a larger bound while `contended`: threads were recently
   found without a core).  The rule of every call, projections included. */
int mh_plan_threads(int threads, int64_t n_items, double work, int contended);

/* Split-key partial buffers, kernel float type: acc (n_pairs, n_split, L, Ev),
   row max and row sum (n_pairs, n_split, L). */
typedef struct mh_partials {
    void *acc, *row_max, *row_sum;
} mh_partials;

typedef struct mh_attn_args {
    int64_t n_pairs;  /* (batch, query head) pairs, or kv pairs with plan->group > 1 */
    int64_t q_len;    /* L: query rows per pair */
    int64_t kv_len;   /* S: keys per pair */
    int64_t head_dim; /* E: query/key width */
    int64_t v_dim;    /* Ev: value/output width */
    const mh_plan *plan;

    mh_operand q;     /* (pairs, L, E)  q_format */
    /* float kernels: their own type, or F16 / BF16 bits widened as they are
       read (the pairs path reads bfloat16 words as they are) */
    int q_format;
    mh_operand k;     /* (pairs, S, E)  kv_format */
    mh_operand v;     /* (pairs, S, Ev) kv_format */
    mh_operand out;   /* (pairs, L, Ev) out_format, written */
    int out_format;   /* the kernel's type, or F16 / BF16 bits rounded to
                         nearest even as they are written (float kernels) */
    int kv_format;    /* enum mh_storage */
    mh_operand k_scale, v_scale; /* I8 / I4 only: per row (see mh_formats.h) */

    /* Optional mask (pairs, L, S): MH_MASK_BOOL reads bytes, nonzero = may
       attend; MH_MASK_ADD reads the kernel's float type and adds it to the
       scaled scores.  Row and column strides may be 0 (broadcast). */
    int mask_kind;
    mh_operand mask;

    mh_causal causal;
    double scale;       /* multiplies q.k */

    /* Transforms of the scaled scores s, in this order (each off by default):
       softcap s = c tanh(s / c); the ALiBi bias s -= slope |i + S - L - j|
       (queries aligned to the end of the keys); then the masks.  A sink joins
       each row's softmax denominator as one more logit, with no value.  The
       per-query-head values are addressed as the queries are (off[pair * G +
       g]), one element each. */
    double softcap;     /* c > 0, or 0: none */
    mh_operand alibi;   /* the slope, kernel float type; base NULL: none */
    mh_operand sinks;   /* the sink logit, kernel float type; base NULL: none */
    /* Optional output (pairs, L), float32, addressed as the queries are: the
       natural log of each row's softmax denominator (sink included), -inf for
       a row that saw nothing; base NULL: not asked for. */
    mh_operand lse;
    double dropout_p;   /* probability of dropping an attention weight */
    uint64_t seed;      /* dropout stream: see mh_dropout_bits() */

    /* Optional: dense weights (pairs, L, S), C-contiguous, pre-zeroed by the
       caller; when set, the kernel also writes the (post-dropout) weights. */
    void *weights;

    mh_partials split;  /* split schedule only */

    /* Grouped query heads (plan->group = G > 1, decode with grouped-query
       attention): a pair is a kv pair, the q and out offset tables hold
       n_pairs * G entries (pair * G + g), and an item's rows are (g, query
       row) for every g: the few-rows path then reads each key and value once
       for the G heads (no dropout, no weights; the mask, if any, is per kv
       pair). */
} mh_attn_args;

/* Query block: pair `pair`, rows [q_start, min(q_start + MH_BLOCK_Q, L)). */
typedef void (*mh_block_fn)(const mh_attn_args *args, int64_t pair, int64_t q_start,
                            void *scratch);
/* Split-key item: every query row of pair `pair` against each key range of
   the pair's run `run` (ranges [run * split_run, (run + 1) * split_run)). */
typedef void (*mh_split_fn)(const mh_attn_args *args, int64_t pair, int64_t run,
                            void *scratch);
/* Merge of pair `pair`'s ranges into the output (scratch: >= Ev elements). */
typedef void (*mh_merge_fn)(const mh_attn_args *args, int64_t pair, void *scratch);

/* A dense projection out = x @ w (+ bias), row-major, strides in elements:
   x (m, k), w (k, n), bias (n,) or NULL, out (m, n).  Work items:
   - few rows (m <= MH_LINEAR_ROWS): column blocks of tile_n columns (at most
     MH_LINEAR_BLOCK_BYTES of sums a row) times chunks of k_chunk rows of w, computed
     by the ISA kernels (mh_linear_rows_fn), memory-bound: w is streamed once; a
     narrow w is cut along k, so that each item reads one contiguous run of it, and
     the chunks' sums are added in order afterwards (mh_linear_merge_*);
   - more rows: tiles of tile_m x tile_n, each one single-threaded call of a
     BLAS gemm (mh_linear_tile_f32/f64 below).
   Every output element is summed over k in the same order whatever the
   tiling and thread count, so results are reproducible bit for bit. */
#define MH_LINEAR_BLOCK_BYTES 32768 /* of a row of w per few-rows block (4 rows' sums: 128 KiB) */
/* Rows the few-rows product takes at once (more: groups of up to this many, each
   reading w again).  Above MH_FEW_ROWS a block's columns go through in two halves,
   so that the sums of every row stay within the same 128 KiB. */
#define MH_LINEAR_ROWS 8
/* what a few-rows pass asks for ahead of its reads (mh_linear_impl.h, FN(pass_cols)) */
#define MH_PASS_AHEAD_NONE 0
#define MH_PASS_AHEAD_ROWS 1 /* a line of each of the next pass's rows at a time */
#define MH_PASS_AHEAD_RUN 2  /* the next pass's rows as one run, in order */

/* Fortran BLAS gemm (column-major), as SciPy's cython_blas exposes it. */
typedef void (*mh_sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                            const int *k, const float *alpha, const float *a, const int *lda,
                            const float *b, const int *ldb, const float *beta, float *c,
                            const int *ldc);
typedef void (*mh_dgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                            const int *k, const double *alpha, const double *a, const int *lda,
                            const double *b, const int *ldb, const double *beta, double *c,
                            const int *ldc);

typedef struct mh_linear_args {
    int64_t m, k, n;
    const void *x; int64_t x_row;
    const void *w; int64_t w_row;
    const void *bias;
    void *out; int64_t out_row;
    int64_t tile_m, tile_n; /* BLAS tiles (more rows); tile_n: column blocks (few rows) */
    int w_fmt;              /* w's storage (mh_formats.h): native, or F16, BF16, I8 (f32;
                               blocked: mh_linear_index) */
    const float *w_scales;  /* I8: (ceil(k / group), n) scales, rows n apart; else NULL */
    int64_t group;          /* I8: rows of k that share a scale */
    int64_t k_chunk;        /* few rows: rows of k per work item (k: one chunk) */
    void *partial;          /* several chunks: (chunks, rows, n) sums of the kernel's type */
    mh_sgemm_fn sgemm;
    mh_dgemm_fn dgemm;
} mh_linear_args;

/* Where element (kk, c) of w lies, in elements from a->w.  Float weights are rows
   a->w_row apart.  int8 weights are blocked for the few-rows product's passes of eight
   rows of k (k padded with zero rows to a multiple of 8), each pass a->w_row * 8
   bytes (w_row: n padded to a multiple of 16).  A pass holds the columns in blocks of
   16, 128 bytes each; a block its four pairs of rows 32 bytes apart; a pair its 16
   columns 2 bytes apart, the even row's value first.  So a pass is one contiguous
   stream, and the values of one pair of rows and up to 16 columns, starting at a
   multiple of their count, are contiguous: what a 16-bit integer multiply-add of pairs
   takes (mh_linear_impl.h, FN(i8_pass)).  (manyheads.weights.Int8Weight lays its
   values out so.) */
static inline int64_t mh_linear_index(const mh_linear_args *a, int64_t kk, int64_t c)
{
    if (a->w_fmt != MH_STORE_I8) return kk * a->w_row + c;
    return (kk & ~(int64_t)7) * a->w_row + (c >> 4) * 128 + ((kk & 7) >> 1) * 32 +
           (c & 15) * 2 + (kk & 1);
}

/* Column block `block` of the few-rows path (ISA kernels). */
typedef void (*mh_linear_rows_fn)(const mh_linear_args *args, int64_t block);

/* Several chunks of k (few rows): out = bias + the chunks' partial sums, in chunk order,
   on the calling thread. */
void mh_linear_merge_f32(const mh_linear_args *args, int64_t n_chunks);
void mh_linear_merge_f64(const mh_linear_args *args, int64_t n_chunks);

/* The sum of p[0 .. n), read once as a stream (the benchmark's read-rate measure). */
float mh_read_sum(const float *p, int64_t n);

/* Columns [c0, c0 + cols) of w widened to float32 (int8: with their scales) into dst,
   (k, cols) with rows cols apart (ISA kernels, float32 only). */
typedef void (*mh_linear_widen_fn)(const mh_linear_args *args, int64_t c0, int64_t cols,
                                   float *dst);

/* Tile `tile` (row-tile major) of the more-rows path through the BLAS. */
void mh_linear_tile_f32(const mh_linear_args *args, int64_t tile);
void mh_linear_tile_f64(const mh_linear_args *args, int64_t tile);
/* Stripe `stripe` (tile_n columns, every row) of the more-rows path for weights not in
   float32: the stripe widened into scratch (k * tile_n floats) by `widen`, then one
   BLAS sgemm. */
void mh_linear_stripe_f32(const mh_linear_args *args, int64_t stripe, float *scratch,
                          mh_linear_widen_fn widen);

typedef struct mh_kernel_table {
    const char *name;   /* NULL: this path is not compiled into the build */
    mh_block_fn block_f32, block_f64;
    mh_split_fn split_f32, split_f64;
    mh_merge_fn merge_f32, merge_f64;
    mh_linear_rows_fn linear_rows_f32, linear_rows_f64;
    mh_linear_widen_fn linear_widen_f32;
    void (*exp_f32)(const float *x, float *y, int64_t n);   /* the path's vector exp */
    void (*exp_f64)(const double *x, double *y, int64_t n);
    const mh_caps *caps_f32, *caps_f64; /* what each instantiation can do */
} mh_kernel_table;

/* The table of kernel path `sfx`, at the end of its ISA file (mh_instance.h
   has defined the functions), and the empty table of a path the build has
   not compiled (a foreign architecture, or a compiler without the ISA).
   MH_KERNEL_TABLE_F64_OF takes the float64 entries from path `sfx64`. */
#define MH_KERNEL_TABLE_F64_OF(sfx, sfx64)                                                 \
    const mh_kernel_table mh_table_##sfx = {                                               \
        #sfx, mh_block_item_f32_##sfx, mh_block_item_f64_##sfx64, mh_split_item_f32_##sfx,  \
        mh_split_item_f64_##sfx64, mh_merge_item_f32_##sfx, mh_merge_item_f64_##sfx64,      \
        mh_linear_rows_item_f32_##sfx, mh_linear_rows_item_f64_##sfx64,                    \
        mh_linear_widen_f32_##sfx,                                                         \
        mh_exp_array_f32_##sfx, mh_exp_array_f64_##sfx64, &mh_caps_f32_##sfx,               \
        &mh_caps_f64_##sfx64};
#define MH_KERNEL_TABLE(sfx) MH_KERNEL_TABLE_F64_OF(sfx, sfx)
#define MH_EMPTY_TABLE(sfx) const mh_kernel_table mh_table_##sfx = {0};

/* Where each part of one work item's scratch starts, in elements of the
   kernel's float type from a MH_SCRATCH_ALIGN-aligned base (every part is a
   multiple of 16 elements, so every part is aligned too):
     qt      [E][BQ]    query block, transposed, times scale
                        (few-rows path: [rows][ep] row-major; bfloat16 pair
                        path: [E/2][BQ] words of the unscaled queries)
     st      [BK][BQ]   one tile of scores, key-major, then its probabilities
     acc     [BQ][evp]  output accumulator
     kpack   [BK][ep]   key block copied contiguous (tile path: first the
                        item's 16-bit query rows, widened; few-rows path with
                        int4 keys read in place: the query rows' group sums,
                        [rows][16])
     vpack   [BK][evp]  value block copied contiguous, zero padded
                        (bfloat16 pair path: [BK/2][evp] words)
     row_max, row_sum, alpha   [BQ]
     pt2     [BK/2][BQ] probabilities as bfloat16 pairs of keys (avx512bf16 path)
   ep = E and evp = Ev rounded up to 16. */
typedef struct mh_scratch_layout {
    int64_t ep, evp;
    int64_t qt, st, acc, kpack, vpack, row_max, row_sum, alpha, pt2;
    int64_t elems; /* total */
} mh_scratch_layout;

mh_scratch_layout mh_scratch_plan(int64_t head_dim, int64_t v_dim);

/* The layout's size in bytes of `elem_size`, rounded up to MH_SCRATCH_ALIGN;
   a thread's scratch area is this, plus mh_widened_bytes when the plan keeps
   widened rows (mh_plan.widened_rows). */
size_t mh_scratch_stride(int64_t head_dim, int64_t v_dim, size_t elem_size);

/* `raw` rounded up to MH_SCRATCH_ALIGN; allocate MH_SCRATCH_ALIGN extra bytes. */
void *mh_scratch_align(void *raw);

/* Bytes to add to each thread's float32 scratch stride for `rows` widened key
   and value rows (mh_plan.widened_rows): a header, then rows x E keys
   and rows x evp values, a multiple of MH_SCRATCH_ALIGN.  mh_widened_reset
   marks one thread's area empty; call it for every thread before a run. */
size_t mh_widened_bytes(int64_t head_dim, int64_t v_dim, int64_t rows);
void mh_widened_reset(void *thread_scratch, int64_t head_dim, int64_t v_dim);

/* Quantise `rows` rows of n float32 values into the KV cache's storage formats
   (mh_formats.h; n a multiple of MH_I4_GROUP for int4): int8 values and one
   scale per row; int4 bytes and (scale, min) float16 pairs per group, the codes
   worked out from the pair as stored (mh_quantize.c).  A row (int4: a group) holding NaN or inf gets NaN scales. */
void mh_quantize_i8(const float *x, int64_t rows, int64_t n, int8_t *q, float *scale);
void mh_quantize_i4(const float *x, int64_t rows, int64_t n, uint8_t *q, uint16_t *pairs);
/* how many groups of finite values of x (rows, n) have an int4 (step, minimum) pair
   beyond float16's range (mh_quantize_i4 stores inf in those) */
int64_t mh_i4_overflows(const float *x, int64_t rows, int64_t n);

/* The per-token steps of a decoder (mh_step.c), one implementation for the one-at-a-
   time calls and the compiled decoding step.  RMSNorm of `rows` rows of n values
   (sums of squares in double); the rotary rotation of x (B, H, T, D) at element
   strides (sb, sh, st, sd): features (i, i + n) of each row become (a cos - e sin,
   e cos + a sin) with its position's cos and sin (T, n), contiguous; a gated MLP's
   act(g) * u for the halves (g, u) of each row of gu (rows, 2 F), act SiLU or (gelu)
   GELU's tanh form, each as g * sigmoid(a) by the kernel path's exp (g * 0 where
   exp(-a) would overflow). */
void mh_rms_norm_rows(const float *x, int64_t rows, int64_t n, int64_t x_row,
                      const float *w, float eps, float *out, int64_t out_row);
void mh_rotate_heads(float *x, int64_t B, int64_t H, int64_t T, int64_t sb, int64_t sh,
                     int64_t st, int64_t sd, int64_t n, const float *cos, const float *sin);
void mh_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row, int gelu,
                   float *out, int64_t out_row,
                   void (*exp_f32)(const float *x, float *y, int64_t n));
/* gpt-oss's clamped SwiGLU of each row's halves g and u (gu, m x 2F): with gc =
   min(g, limit), gc * sigmoid(alpha gc) * (clamp(u, -limit, limit) + 1) (gc * 0
   where exp(-alpha gc) would overflow), by the kernel path's exp. */
void mh_clamped_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row,
                           float alpha, float limit, float *out, int64_t out_row,
                           void (*exp_f32)(const float *x, float *y, int64_t n));

/* A barrier for the n threads of one parallel region that spins instead of sleeping
   (a compiled decoding step meets at it hundreds of times a token, a few microseconds
   apart), and after 0.2 ms yields its core at every turn.  Zero-initialise it.
   Returns 1 when this thread waited more than 1 ms (a sign that a thread of the team
   had no core), else 0. */
typedef struct mh_team_barrier_t {
    volatile long count, gen;
} mh_team_barrier_t;
int mh_team_barrier(mh_team_barrier_t *b, int n);
/* Asks for [p, p + n) a cache line at a time until a thread arrives at *b: what a
   thread does that would otherwise only wait there for the others. */
void mh_read_ahead_until_arrival(const char *p, int64_t n, mh_team_barrier_t *b);
/* The next item of a shared counter (zero-initialised): 0, 1, 2, ... across threads. */
int64_t mh_next_item(volatile long *counter);

/* CPU features that decide the kernel path (all zero off x86). */
typedef struct mh_cpu_features {
    unsigned avx : 1, fma : 1, f16c : 1, avx2 : 1, avx512f : 1;
    unsigned os_ymm : 1; /* the OS saves YMM state */
    unsigned os_zmm : 1; /* ... and opmask and ZMM state */
    unsigned avx512bw : 1, avx512bf16 : 1, avx512vnni : 1, avx512vbmi : 1;
    unsigned amd : 1;    /* the vendor is AuthenticAMD */
} mh_cpu_features;

mh_cpu_features mh_cpu_detect(void);

/* 1 on an AMD CPU (detected once), 0 otherwise. */
int mh_cpu_is_amd(void);

/* 1 while the int4 value mix may use AVX512-VBMI byte permutes: the CPU has them
   (detected once) and mh_set_byte_permutes has not turned them off. */
int mh_byte_permutes(void);

/* Allows (1) or forbids (0) the byte permutes for later plans, so that tests can
   run the mix without them on any CPU; returns mh_byte_permutes(). */
int mh_set_byte_permutes(int allow);

/* Name of `isa` (mh_isa_list.h), NULL when out of range.  The enum runs from
   the best path to the baseline. */
const char *mh_isa_name(int isa);

/* 1 if this CPU and OS can run `isa`, 0 otherwise. */
int mh_cpu_supports(int isa);

/* 1 if this build contains the code path for `isa`, 0 otherwise. */
int mh_isa_compiled(int isa);

/* The kernels of `isa`, or NULL when not compiled in.  Does not check the CPU. */
const mh_kernel_table *mh_kernels(int isa);

/* The storage formats (mh_formats.h), MH_STORAGE_COUNT rows in code order. */
extern const mh_storage_info mh_storage_table[];

/* Dropout stream: 64 pseudo-random bits for element (pair, i, j) of a call with
   the given seed.  The element is kept iff (bits >> 40) * 2^-24 >= p.
   Counter-based, so the same on every thread count and ISA path; the NumPy
   oracle implements the same function. */
static inline uint64_t mh_dropout_bits(uint64_t seed, uint64_t pair, uint64_t i, uint64_t j,
                                       uint64_t q_len, uint64_t kv_len)
{
    uint64_t z = seed + ((pair * q_len + i) * kv_len + j) * UINT64_C(0x9E3779B97F4A7C15);
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

/* bfloat16 -> float, exactly: the 16 bits are the high half of the float. */
static inline float mh_bf16_to_float(uint16_t b)
{
    union { uint32_t u; float f; } r;
    r.u = (uint32_t)b << 16;
    return r.f;
}

/* Element i of a weight array stored in format fmt (mh_formats.h: F32, F64, F16, BF16,
   or I8 before its scale), exactly. */
static inline double mh_weight_at(int fmt, const void *w, int64_t i)
{
    switch (fmt) {
    case MH_STORE_F64: return ((const double *)w)[i];
    case MH_STORE_F16: return mh_half_to_float(((const uint16_t *)w)[i]);
    case MH_STORE_BF16: return mh_bf16_to_float(((const uint16_t *)w)[i]);
    case MH_STORE_I8: return ((const int8_t *)w)[i];
    default: return ((const float *)w)[i];
    }
}

/* float -> IEEE half bits, rounded to nearest even (overflow to infinity,
   subnormals kept); NaN stays a (quiet) NaN. */
static inline uint16_t mh_float_to_half(float f)
{
    union { float f; uint32_t u; } x;
    x.f = f;
    const uint32_t sign = (x.u >> 16) & 0x8000u, a = x.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to 65520 or more */
    if (a >= 0x38800000u) {                                  /* 2^-14 or more: normal */
        const uint32_t h = a - 0x38000000u;                  /* exponent rebiased */
        return (uint16_t)(sign | ((h + 0x0fffu + ((h >> 13) & 1u)) >> 13));
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* below 2^-25: 0 (2^-25 itself ties to 0 below) */
    {                                           /* subnormal: m * 2^-24 */
        const uint32_t shift = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        uint32_t h = m >> shift;
        if (rem > half || (rem == half && (h & 1u))) ++h;
        return (uint16_t)(sign | h);
    }
}

/* float -> bfloat16 bits, rounded to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t mh_float_to_bf16(float f)
{
    union { float f; uint32_t u; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#ifdef __cplusplus
}
#endif
#endif /* MANYHEADS_KERNELS_H */
