# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Thin scheduling layer over the C kernels in ``csrc/``.

One typed call object, :class:`AttentionCall`, owns the C argument struct of
one attention call: the Python core (``manyheads._core``) fills it through
named setters (operands with their offset tables and row strides, mask,
causal structure, dropout, weights) and :meth:`AttentionCall.run` runs the
work items over an OpenMP thread team with the GIL released.  Nothing here
validates: ``manyheads._core`` has checked everything before it builds a call.
"""
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "mh_kernels.h" nogil:
    enum:
        MH_BLOCK_Q
        MH_BLOCK_K
        MH_FEW_ROWS
        MH_SCRATCH_ALIGN
        MH_MASK_NONE
        MH_MASK_BOOL
        MH_MASK_ADD
        MH_KV_NATIVE
        MH_KV_F16
        MH_ISA_COUNT

    ctypedef struct mh_operand:
        const void *base
        const int64_t *off
        int64_t row
        int64_t col

    ctypedef struct mh_causal:
        int enabled
        int64_t offset
        int64_t window

    ctypedef struct mh_key_split:
        int64_t n_split, split_keys
        void *acc
        void *row_max
        void *row_sum

    ctypedef struct mh_attn_args:
        int64_t n_pairs, q_len, kv_len, head_dim, v_dim
        mh_operand q, k, v, out, mask
        int kv_format
        int mask_kind
        mh_causal causal
        double scale
        double dropout_p
        uint64_t seed
        void *weights
        mh_key_split split

    ctypedef void (*mh_block_fn)(const mh_attn_args *args, int64_t pair, int64_t q_start,
                                 void *scratch) noexcept nogil
    ctypedef void (*mh_split_fn)(const mh_attn_args *args, int64_t pair, int64_t key_range,
                                 void *scratch) noexcept nogil
    ctypedef void (*mh_merge_fn)(const mh_attn_args *args, int64_t pair,
                                 void *scratch) noexcept nogil

    ctypedef struct mh_kernel_table:
        const char *name
        mh_block_fn block_f32
        mh_block_fn block_f64
        mh_split_fn split_f32
        mh_split_fn split_f64
        mh_merge_fn merge_f32
        mh_merge_fn merge_f64
        void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil
        void (*exp_f64)(const double *x, double *y, int64_t n) noexcept nogil

    size_t mh_scratch_stride(int64_t head_dim, int64_t v_dim, size_t elem_size)
    void *mh_scratch_align(void *raw)
    const char *mh_isa_name(int isa)
    int mh_isa_by_preference(int rank)
    int mh_cpu_supports(int isa)
    int mh_isa_compiled(int isa)
    const mh_kernel_table *mh_kernels(int isa)

cdef extern from "mh_openmp.h" nogil:
    int mh_openmp_enabled()
    int mh_omp_max_threads()
    int mh_omp_version()


BLOCK_Q = MH_BLOCK_Q
BLOCK_K = MH_BLOCK_K
FEW_ROWS = MH_FEW_ROWS

cdef const mh_kernel_table *_table = mh_kernels(0)


cdef int _isa_index(str name) except -1:
    cdef int i
    for i in range(MH_ISA_COUNT):
        if mh_isa_name(i).decode() == name:
            return i
    raise ValueError(f"unknown kernel path {name!r}")


def isa_names():
    """Every kernel path this source knows, best first (whether compiled in or not)."""
    return tuple(mh_isa_name(mh_isa_by_preference(r)).decode() for r in range(MH_ISA_COUNT))


def isa_compiled(str name):
    """True if the build contains the kernels for ISA ``name``."""
    return bool(mh_isa_compiled(_isa_index(name)))


def cpu_supports(str name):
    """True if this CPU and OS can run the kernels for ISA ``name``."""
    return bool(mh_cpu_supports(_isa_index(name)))


def set_isa(str name):
    """Route all later calls to the kernels of ``name`` (caller has checked support)."""
    global _table
    cdef const mh_kernel_table *t = mh_kernels(_isa_index(name))
    if t == NULL:
        raise RuntimeError(f"kernel path {name!r} is not compiled into this build")
    _table = t


def current_isa():
    return _table.name.decode()


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


cdef inline void *_data(object arr):
    return cnp.PyArray_DATA(<cnp.ndarray>arr)


cdef class AttentionCall:
    """The arguments of one attention call, kept as the C struct the kernels read.

    Arrays handed to the setters are referenced until the call object dies, so
    the pointers stay valid.  Offsets and strides are in elements.
    """
    cdef mh_attn_args a
    cdef bint is_f64
    cdef list _keep

    def __init__(self, bint float64, int64_t n_pairs, int64_t q_len, int64_t kv_len,
                 int64_t head_dim, int64_t v_dim):
        self.is_f64 = float64
        self._keep = []
        self.a.n_pairs = n_pairs
        self.a.q_len = q_len
        self.a.kv_len = kv_len
        self.a.head_dim = head_dim
        self.a.v_dim = v_dim
        self.a.scale = 1.0
        self.a.kv_format = MH_KV_NATIVE
        self.a.mask_kind = MH_MASK_NONE

    cdef int _operand(self, mh_operand *op, arr, offsets, int64_t row, int64_t col) except -1:
        cdef const int64_t[::1] off = offsets
        self._keep += [arr, offsets]
        op.base = _data(arr)
        op.off = &off[0] if off.shape[0] else NULL
        op.row = row
        op.col = col
        return 0

    def set_query(self, q, offsets, int64_t row):
        """Queries (pairs, L, E) in the call's float type."""
        self._operand(&self.a.q, q, offsets, row, 1)

    def set_keys_values(self, k, k_offsets, int64_t k_row, v, v_offsets, int64_t v_row,
                        bint float16=False):
        """Keys (pairs, S, E) and values (pairs, S, Ev): the call's float type, or
        float16 bits viewed as uint16 (widened by the kernels) when ``float16``."""
        self._operand(&self.a.k, k, k_offsets, k_row, 1)
        self._operand(&self.a.v, v, v_offsets, v_row, 1)
        self.a.kv_format = MH_KV_F16 if float16 else MH_KV_NATIVE

    def set_output(self, out, offsets, int64_t row):
        """Output (pairs, L, Ev) in the call's float type, written by the kernels."""
        self._operand(&self.a.out, out, offsets, row, 1)

    def set_mask(self, mask, offsets, int64_t row, int64_t col):
        """Mask (pairs, L, S): bool (True = may attend) or the call's float type (added)."""
        self._operand(&self.a.mask, mask, offsets, row, col)
        self.a.mask_kind = MH_MASK_BOOL if mask.dtype == np.bool_ else MH_MASK_ADD

    def set_causal(self, int64_t offset, int64_t window=0):
        """Query i sees keys j <= i + offset (and j > i + offset - window if window > 0)."""
        self.a.causal.enabled = 1
        self.a.causal.offset = offset
        self.a.causal.window = window

    def set_scale(self, double scale):
        self.a.scale = scale

    def set_dropout(self, double p, uint64_t seed):
        self.a.dropout_p = p
        self.a.seed = seed

    def set_weights(self, weights):
        """Dense (pairs, L, S) C-contiguous zeros of the call's float type, filled by the run."""
        self._keep.append(weights)
        self.a.weights = _data(weights)

    def run(self, int num_threads, int64_t split_keys=0):
        """Run every work item on up to ``num_threads`` OpenMP threads, GIL released.

        ``split_keys > 0`` selects the split-key schedule (q_len <= BLOCK_Q):
        keys cut into ranges of that many, attended in parallel, merged in a
        fixed order.
        """
        cdef int64_t n_pairs = self.a.n_pairs, q_len = self.a.q_len
        cdef int64_t n_blocks = (q_len + MH_BLOCK_Q - 1) // MH_BLOCK_Q
        cdef int64_t n_items, n_split = 0, it, pair, blk
        cdef size_t elem = 8 if self.is_f64 else 4, stride
        cdef mh_block_fn block_fn = _table.block_f64 if self.is_f64 else _table.block_f32
        cdef mh_split_fn split_fn = _table.split_f64 if self.is_f64 else _table.split_f32
        cdef mh_merge_fn merge_fn = _table.merge_f64 if self.is_f64 else _table.merge_f32
        cdef int nt = num_threads
        cdef void *raw
        cdef char *scratch
        cdef mh_attn_args *a = &self.a

        if n_pairs == 0 or q_len == 0:
            return
        if split_keys > 0:
            n_split = (self.a.kv_len + split_keys - 1) // split_keys
            dt = np.float64 if self.is_f64 else np.float32
            parts = np.empty(n_pairs * n_split * q_len * (self.a.v_dim + 2), dtype=dt)
            self._keep.append(parts)
            self.a.split.n_split = n_split
            self.a.split.split_keys = split_keys
            self.a.split.acc = _data(parts)
            self.a.split.row_max = <char *>_data(parts) + elem * n_pairs * n_split * q_len * self.a.v_dim
            self.a.split.row_sum = <char *>self.a.split.row_max + elem * n_pairs * n_split * q_len
            n_items = n_pairs * n_split
        else:
            n_items = n_pairs * n_blocks
        if nt > n_items:
            nt = <int>n_items
        if nt < 1:
            nt = 1
        stride = mh_scratch_stride(self.a.head_dim, self.a.v_dim, elem)
        raw = malloc(stride * nt + MH_SCRATCH_ALIGN)
        if raw == NULL:
            raise MemoryError("cannot allocate the kernels' scratch")
        scratch = <char *>mh_scratch_align(raw)
        try:
            if split_keys > 0:
                # every (pair, key range) on its own, then each pair's ranges merged in order
                with nogil, parallel(num_threads=nt):
                    for it in prange(n_items, schedule="dynamic", chunksize=1):
                        split_fn(a, it // n_split, it % n_split, scratch + threadid() * stride)
                with nogil, parallel(num_threads=nt if nt < n_pairs else <int>n_pairs):
                    for it in prange(n_pairs, schedule="static"):
                        merge_fn(a, it, scratch + threadid() * stride)
                return
            # Items go out one at a time, pair by pair (so the threads share one pair's
            # keys and values in cache) and, within a pair, heaviest query block (the
            # bottom of the causal triangle) first, so no thread idles at the end.
            with nogil, parallel(num_threads=nt):
                for it in prange(n_items, schedule="dynamic", chunksize=1):
                    pair = it // n_blocks
                    blk = n_blocks - 1 - it % n_blocks
                    block_fn(a, pair, blk * MH_BLOCK_Q, scratch + threadid() * stride)
        finally:
            free(raw)
