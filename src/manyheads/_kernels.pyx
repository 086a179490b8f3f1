# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Thin scheduling layer over the C kernels in ``csrc/``.

Takes data pointers, per-(batch, head) offset tables and row strides (all in
elements) and runs the work items of one attention call over an OpenMP thread
team with the GIL released.  Performs no validation: ``manyheads.functional``
checks everything before calling in here.
"""
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t, uint64_t, uintptr_t

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "mh_kernels.h" nogil:
    enum:
        MH_BLOCK_Q
        MH_BLOCK_K
        MH_DOT_ROWS
        MH_MASK_NONE
        MH_MASK_BOOL
        MH_MASK_ADD
        MH_ISA_BASELINE
        MH_ISA_AVX2
        MH_ISA_AVX512
        MH_ISA_COUNT

    ctypedef struct mh_attn_args:
        int64_t n_bh, q_len, kv_len, head_dim, v_dim
        const void *q
        const int64_t *q_off
        int64_t q_row
        const void *k
        const int64_t *k_off
        int64_t k_row
        const void *v
        const int64_t *v_off
        int64_t v_row
        void *out
        const int64_t *out_off
        int64_t out_row
        int mask_kind
        const void *mask
        const int64_t *mask_off
        int64_t mask_row, mask_col
        int causal
        int64_t causal_offset
        int64_t window
        int kv_half
        double scale
        double dropout_p
        uint64_t seed
        void *weights
        int64_t n_split, split_keys
        void *part_acc
        void *part_max
        void *part_sum

    ctypedef void (*mh_fwd_item_fn)(const mh_attn_args *args, int64_t bh, int64_t q_start,
                                    void *scratch) noexcept nogil

    ctypedef struct mh_kernel_table:
        const char *name
        mh_fwd_item_fn fwd_f32
        mh_fwd_item_fn fwd_f64
        mh_fwd_item_fn split_f32
        mh_fwd_item_fn split_f64
        mh_fwd_item_fn merge_f32
        mh_fwd_item_fn merge_f64
        void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil
        void (*exp_f64)(const double *x, double *y, int64_t n) noexcept nogil

    size_t mh_scratch_bytes(int64_t head_dim, int64_t v_dim, size_t elem_size)
    int mh_cpu_supports(int isa)
    int mh_isa_compiled(int isa)
    const mh_kernel_table *mh_kernels(int isa)

cdef extern from "mh_openmp.h" nogil:
    int mh_openmp_enabled()
    int mh_omp_max_threads()
    int mh_omp_version()


ISA_NAMES = ("baseline", "avx2", "avx512")
BLOCK_Q = MH_BLOCK_Q
BLOCK_K = MH_BLOCK_K
DOT_ROWS = MH_DOT_ROWS
MASK_NONE = MH_MASK_NONE
MASK_BOOL = MH_MASK_BOOL
MASK_ADD = MH_MASK_ADD

cdef const mh_kernel_table *_table = mh_kernels(MH_ISA_BASELINE)


def isa_compiled(str name):
    """True if the build contains the kernels for ISA ``name``."""
    return bool(mh_isa_compiled(ISA_NAMES.index(name)))


def cpu_supports(str name):
    """True if this CPU and OS can run the kernels for ISA ``name``."""
    return bool(mh_cpu_supports(ISA_NAMES.index(name)))


def set_isa(str name):
    """Route all later calls to the kernels of ``name`` (caller has checked support)."""
    global _table
    cdef const mh_kernel_table *t = mh_kernels(ISA_NAMES.index(name))
    if t == NULL:
        raise RuntimeError(f"kernel path {name!r} is not compiled into this build")
    _table = t


def vector_exp(x):
    """exp of a contiguous float32/float64 array through the current path's vector exp."""
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    if x.dtype == np.float32:
        _table.exp_f32(<const float *>cnp.PyArray_DATA(x), <float *>cnp.PyArray_DATA(y), x.size)
    elif x.dtype == np.float64:
        _table.exp_f64(<const double *>cnp.PyArray_DATA(x), <double *>cnp.PyArray_DATA(y), x.size)
    else:
        raise TypeError("x must be float32 or float64")
    return y


def current_isa():
    return _table.name.decode()


def openmp_enabled():
    return bool(mh_openmp_enabled())


def openmp_version():
    return mh_omp_version()


def omp_max_threads():
    return mh_omp_max_threads()


def batch_offsets(cnp.ndarray view, int n_batch):
    """Element offsets of every index over the first ``n_batch`` axes (C order), as int64."""
    cdef Py_ssize_t total = 1, i, rem
    cdef int d
    cdef int64_t off
    cdef Py_ssize_t itemsize = view.itemsize
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(view)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(view)
    for d in range(n_batch):
        total *= shape[d]
    out = np.empty(total, dtype=np.int64)
    cdef int64_t[::1] o = out
    for i in range(total):
        rem = i
        off = 0
        for d in range(n_batch - 1, -1, -1):
            off += (rem % shape[d]) * (strides[d] // itemsize)
            rem //= shape[d]
        o[i] = off
    return out


cdef inline const void *_ptr(object arr):
    return <const void *>cnp.PyArray_DATA(<cnp.ndarray>arr)


def attention_forward(q, const int64_t[::1] q_off, int64_t q_row,
                      k, const int64_t[::1] k_off, int64_t k_row,
                      v, const int64_t[::1] v_off, int64_t v_row,
                      out, const int64_t[::1] out_off, int64_t out_row,
                      int mask_kind, mask, const int64_t[::1] mask_off,
                      int64_t mask_row, int64_t mask_col,
                      int64_t q_len, int64_t kv_len, int64_t head_dim, int64_t v_dim,
                      bint causal, int64_t causal_offset, int64_t window, bint kv_half,
                      double scale, double dropout_p, uint64_t seed, weights,
                      int64_t split_keys, int num_threads):
    """Run every work item of one attention call; q and out share one float dtype.

    Offsets and strides are in elements relative to each array's data pointer.
    ``split_keys > 0`` selects the decode schedule (q_len <= BLOCK_Q): keys cut
    into ranges of that many, attended in parallel, merged in a fixed order.
    """
    cdef mh_attn_args a
    cdef int64_t n_bh = q_off.shape[0]
    cdef int64_t n_qb = (q_len + MH_BLOCK_Q - 1) // MH_BLOCK_Q
    cdef int64_t n_items
    cdef bint is_f64 = (<cnp.ndarray>out).dtype.itemsize == 8
    cdef mh_fwd_item_fn fn = _table.fwd_f64 if is_f64 else _table.fwd_f32
    cdef mh_fwd_item_fn merge_fn = _table.merge_f64 if is_f64 else _table.merge_f32
    cdef size_t item_bytes, stride_bytes
    cdef int64_t it, bh, qb, n_split = 0
    cdef char *scratch_base
    cdef int nt = num_threads

    if n_bh == 0 or q_len == 0:
        return
    a.n_bh = n_bh
    a.q_len = q_len
    a.kv_len = kv_len
    a.head_dim = head_dim
    a.v_dim = v_dim
    a.q = _ptr(q)
    a.q_off = &q_off[0]
    a.q_row = q_row
    a.k = _ptr(k)
    a.k_off = &k_off[0]
    a.k_row = k_row
    a.v = _ptr(v)
    a.v_off = &v_off[0]
    a.v_row = v_row
    a.out = <void *>_ptr(out)
    a.out_off = &out_off[0]
    a.out_row = out_row
    a.mask_kind = mask_kind
    a.mask = _ptr(mask) if mask_kind != MH_MASK_NONE else NULL
    a.mask_off = &mask_off[0] if mask_kind != MH_MASK_NONE else NULL
    a.mask_row = mask_row
    a.mask_col = mask_col
    a.causal = causal
    a.causal_offset = causal_offset
    a.window = window
    a.kv_half = kv_half
    a.scale = scale
    a.dropout_p = dropout_p
    a.seed = seed
    a.weights = <void *>_ptr(weights) if weights is not None else NULL
    a.n_split = 0
    a.split_keys = 0
    a.part_acc = NULL
    a.part_max = NULL
    a.part_sum = NULL

    if split_keys > 0:
        n_split = (kv_len + split_keys - 1) // split_keys
        a.n_split = n_split
        a.split_keys = split_keys
        dt = (<cnp.ndarray>out).dtype
        part_acc = np.empty(n_bh * n_split * q_len * v_dim, dtype=dt)
        part_max = np.empty(n_bh * n_split * q_len, dtype=dt)
        part_sum = np.empty(n_bh * n_split * q_len, dtype=dt)
        a.part_acc = <void *>cnp.PyArray_DATA(part_acc)
        a.part_max = <void *>cnp.PyArray_DATA(part_max)
        a.part_sum = <void *>cnp.PyArray_DATA(part_sum)
        fn = _table.split_f64 if is_f64 else _table.split_f32
        n_items = n_bh * n_split
    else:
        n_items = n_bh * n_qb

    if nt > n_items:
        nt = <int>n_items
    if nt < 1:
        nt = 1
    item_bytes = mh_scratch_bytes(head_dim, v_dim, 8 if is_f64 else 4)
    stride_bytes = (item_bytes + 63) // 64 * 64
    scratch = np.empty(stride_bytes * nt + 64, dtype=np.uint8)
    scratch_base = <char *>cnp.PyArray_DATA(scratch)
    scratch_base += (64 - (<uintptr_t>scratch_base) % 64) % 64

    if split_keys > 0:
        # every (pair, key range) on its own, then each pair's ranges merged in order
        with nogil, parallel(num_threads=nt):
            for it in prange(n_items, schedule="dynamic", chunksize=1):
                fn(&a, it // n_split, it % n_split, scratch_base + threadid() * stride_bytes)
        with nogil, parallel(num_threads=nt if nt < n_bh else <int>n_bh):
            for it in prange(n_bh, schedule="static"):
                merge_fn(&a, it, 0, scratch_base + threadid() * stride_bytes)
        return

    # Items go out one at a time, pair by pair (so the threads share one pair's
    # keys and values in cache) and, within a pair, heaviest query block (the
    # bottom of the causal triangle) first, so no thread idles at the end.
    with nogil, parallel(num_threads=nt):
        for it in prange(n_items, schedule="dynamic", chunksize=1):
            bh = it // n_qb
            qb = n_qb - 1 - it % n_qb
            fn(&a, bh, qb * MH_BLOCK_Q, scratch_base + threadid() * stride_bytes)
