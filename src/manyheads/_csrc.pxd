# The C declarations the Cython layer uses, written once (csrc/mh_kernels.h is the
# contract; the comments there say what each field means).
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uint64_t


cdef extern from "mh_kernels.h" nogil:
    const double MH_PREFETCH_MIN_BYTES
    enum:
        MH_BLOCK_Q
        MH_BLOCK_K
        MH_FEW_ROWS
        MH_LINEAR_ROWS
        MH_SCRATCH_ALIGN
        MH_LINEAR_BLOCK_BYTES
        MH_I4_GROUP
        MH_ISA_COUNT
        MH_STORAGE_COUNT
        MH_STORE_F32
        MH_STORE_F64
        MH_STORE_I8
        MH_STORE_I4
        MH_STORE_F16
        MH_STORE_BF16
        MH_MASK_NONE
        MH_MASK_BOOL
        MH_MASK_ADD
        MH_PATH_TILE
        MH_PATH_PAIRS
        MH_PATH_FEW_ROWS
        MH_READ_IN_PLACE
        MH_READ_COPIED
        MH_READ_WIDENED

    ctypedef struct mh_storage_info:
        const char *name
        const char *dtype
        int code, bits, scales, group

    const mh_storage_info mh_storage_table[]
    int mh_storage_bits(int fmt)

    ctypedef struct mh_operand:
        const void *base
        const int64_t *off
        int64_t row
        int64_t col

    ctypedef struct mh_causal:
        int enabled
        int64_t offset
        int64_t window

    ctypedef struct mh_item_plan:
        int64_t rows
        int path
        int k_read, v_read

    ctypedef struct mh_plan:
        int64_t n_pairs, group, n_blocks, n_split, split_keys, split_run, n_items
        mh_item_plan item[2]
        int threads, merge_threads, prefetch
        int64_t widened_rows
        size_t scratch_stride, partial_elems
        double work

    ctypedef struct mh_call_desc:
        int64_t n_pairs, q_len, kv_len, head_dim, v_dim, gqa
        int elem_size, q_format, kv_format
        int64_t k_row_bytes, v_row_bytes
        int mask, mask_per_head, weights, dropout, split, threads, contended

    ctypedef struct mh_caps:
        int lanes
        unsigned in_place
        int pair_dot

    void mh_plan_attention(const mh_call_desc *d, const mh_caps *caps, mh_plan *plan)
    int mh_plan_threads(int threads, int64_t n_items, double work, int contended)

    ctypedef struct mh_partials:
        void *acc
        void *row_max
        void *row_sum

    ctypedef struct mh_attn_args:
        int64_t n_pairs, q_len, kv_len, head_dim, v_dim
        const mh_plan *plan
        mh_operand q, k, v, out, mask
        int q_format, out_format, kv_format
        mh_operand k_scale, v_scale
        int mask_kind
        mh_causal causal
        double scale
        double softcap
        mh_operand alibi, sinks, lse
        double dropout_p
        uint64_t seed
        void *weights
        mh_partials split

    ctypedef void (*mh_block_fn)(const mh_attn_args *args, int64_t pair, int64_t q_start,
                                 void *scratch) noexcept nogil
    ctypedef void (*mh_split_fn)(const mh_attn_args *args, int64_t pair, int64_t key_range,
                                 void *scratch) noexcept nogil
    ctypedef void (*mh_merge_fn)(const mh_attn_args *args, int64_t pair,
                                 void *scratch) noexcept nogil

    ctypedef void (*mh_sgemm_fn)(const char *transa, const char *transb, const int *m,
                                 const int *n, const int *k, const float *alpha, const float *a,
                                 const int *lda, const float *b, const int *ldb,
                                 const float *beta, float *c, const int *ldc) noexcept nogil
    ctypedef void (*mh_dgemm_fn)(const char *transa, const char *transb, const int *m,
                                 const int *n, const int *k, const double *alpha,
                                 const double *a, const int *lda, const double *b,
                                 const int *ldb, const double *beta, double *c,
                                 const int *ldc) noexcept nogil

    ctypedef struct mh_linear_args:
        int64_t m, k, n
        const void *x
        int64_t x_row
        const void *w
        int64_t w_row
        const void *bias
        void *out
        int64_t out_row
        int64_t tile_m, tile_n
        int w_fmt
        const float *w_scales
        int64_t group
        int64_t k_chunk
        void *partial
        mh_sgemm_fn sgemm
        mh_dgemm_fn dgemm

    int64_t mh_linear_index(const mh_linear_args *a, int64_t kk, int64_t c)
    ctypedef void (*mh_linear_rows_fn)(const mh_linear_args *args, int64_t block) noexcept nogil
    void mh_linear_tile_f32(const mh_linear_args *args, int64_t tile)
    void mh_linear_tile_f64(const mh_linear_args *args, int64_t tile)
    float mh_read_sum(const float *p, int64_t n)
    void mh_linear_merge_f32(const mh_linear_args *args, int64_t n_chunks)
    void mh_linear_merge_f64(const mh_linear_args *args, int64_t n_chunks)
    ctypedef void (*mh_linear_widen_fn)(const mh_linear_args *args, int64_t c0, int64_t cols,
                                        float *dst) noexcept nogil
    void mh_linear_stripe_f32(const mh_linear_args *args, int64_t stripe, float *scratch,
                              mh_linear_widen_fn widen)

    ctypedef struct mh_kernel_table:
        const char *name
        mh_block_fn block_f32
        mh_block_fn block_f64
        mh_split_fn split_f32
        mh_split_fn split_f64
        mh_merge_fn merge_f32
        mh_merge_fn merge_f64
        mh_linear_rows_fn linear_rows_f32
        mh_linear_rows_fn linear_rows_f64
        mh_linear_widen_fn linear_widen_f32
        void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil
        void (*exp_f64)(const double *x, double *y, int64_t n) noexcept nogil
        const mh_caps *caps_f32
        const mh_caps *caps_f64

    void *mh_scratch_align(void *raw)
    void mh_widened_reset(void *thread_scratch, int64_t head_dim, int64_t v_dim)
    const char *mh_isa_name(int isa)
    int mh_cpu_supports(int isa)
    int mh_isa_compiled(int isa)
    int mh_byte_permutes()
    int mh_set_byte_permutes(int allow)
    const mh_kernel_table *mh_kernels(int isa)
    void mh_quantize_i8(const float *x, int64_t rows, int64_t n, int8_t *q, float *scale)
    void mh_quantize_i4(const float *x, int64_t rows, int64_t n, uint8_t *q, uint16_t *pairs)
    int64_t mh_i4_overflows(const float *x, int64_t rows, int64_t n)
    uint16_t mh_float_to_half(float f)
    uint16_t mh_float_to_bf16(float f)
    void mh_rms_norm_rows(const float *x, int64_t rows, int64_t n, int64_t x_row,
                          const float *w, float eps, float *out, int64_t out_row)
    void mh_rotate_heads(float *x, int64_t B, int64_t H, int64_t T, int64_t sb, int64_t sh,
                         int64_t st, int64_t sd, int64_t n, const float *cos, const float *sin)
    void mh_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row, int gelu,
                       float *out, int64_t out_row,
                       void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil)
    void mh_clamped_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row,
                               float alpha, float limit, float *out, int64_t out_row,
                               void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil)
    ctypedef struct mh_team_barrier_t:
        long count, gen
    int mh_team_barrier(mh_team_barrier_t *b, int n)
    void mh_read_ahead_until_arrival(const char *p, int64_t n, mh_team_barrier_t *b)
    int64_t mh_next_item(long *counter)


cdef extern from "mh_runtime.h" nogil:
    int mh_openmp_enabled()
    int mh_omp_max_threads()
    int mh_omp_version()
    void *mh_omp_entry_address()
    int mh_omp_team_size()
    double mh_seconds()
    int mh_flag_get(const int *flag)
    void mh_flag_set(int *flag)
