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
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
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
        MH_KV_BF16
        MH_KV_I8
        MH_KV_I4
        MH_I4_GROUP
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
        int q_format, out_format
        int kv_format
        mh_operand k_scale, v_scale
        int mask_kind
        mh_causal causal
        double scale
        double dropout_p
        uint64_t seed
        void *weights
        mh_key_split split
        int64_t group
        int64_t kv_widened_rows

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
        mh_sgemm_fn sgemm
        mh_dgemm_fn dgemm

    ctypedef void (*mh_linear_rows_fn)(const mh_linear_args *args, int64_t block) noexcept nogil
    void mh_linear_tile_f32(const mh_linear_args *args, int64_t tile)
    void mh_linear_tile_f64(const mh_linear_args *args, int64_t tile)
    enum:
        MH_LINEAR_COLS

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
        void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil
        void (*exp_f64)(const double *x, double *y, int64_t n) noexcept nogil

    size_t mh_scratch_stride(int64_t head_dim, int64_t v_dim, size_t elem_size)
    void *mh_scratch_align(void *raw)
    size_t mh_widened_bytes(int64_t head_dim, int64_t v_dim, int64_t rows)
    void mh_widened_reset(void *thread_scratch, int64_t head_dim, int64_t v_dim)
    const char *mh_isa_name(int isa)
    int mh_isa_by_preference(int rank)
    int mh_cpu_supports(int isa)
    int mh_isa_compiled(int isa)
    const mh_kernel_table *mh_kernels(int isa)
    void mh_quantize_i8(const float *x, int64_t rows, int64_t n, int8_t *q, float *scale)
    void mh_quantize_i4(const float *x, int64_t rows, int64_t n, uint8_t *q, uint16_t *pairs)
    enum:
        MH_I4_GROUP

cdef extern from "mh_runtime.h" nogil:
    int mh_openmp_enabled()
    int mh_omp_max_threads()
    int mh_omp_version()
    void *mh_omp_entry_address()
    double mh_seconds()
    int mh_flag_get(const int *flag)
    void mh_flag_set(int *flag)

cdef extern from "Python.h":
    int PyErr_CheckSignals()  # called with the GIL held; -1 with the exception set


# storage formats of keys and values (see mh_kernels.h)
KV_FORMATS = {"native": MH_KV_NATIVE, "float16": MH_KV_F16, "bfloat16": MH_KV_BF16,
              "int8": MH_KV_I8, "int4": MH_KV_I4}
I4_GROUP = MH_I4_GROUP
BLOCK_Q = MH_BLOCK_Q
BLOCK_K = MH_BLOCK_K
FEW_ROWS = MH_FEW_ROWS
# bytes of widened keys and values all threads together may keep in a half-precision
# prefill (each thread: the rows of the pair it last served, see mh_widened_bytes)
cdef size_t WIDENED_BYTES = 64 << 20
LINEAR_COLS = MH_LINEAR_COLS
SIGNAL_CHECK_SECONDS = 0.05  # how often a long call looks for Ctrl-C
# Work (multiply-adds) below which a call runs on the calling thread alone: waking
# the pool costs more than the split saves.
cdef double _serial_work = 524288
SERIAL_WORK = _serial_work


cdef const mh_kernel_table *_table = mh_kernels(0)
cdef mh_sgemm_fn _sgemm = NULL
cdef mh_dgemm_fn _dgemm = NULL


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


def quantize_rows(cnp.ndarray x, str fmt):
    """(stored values, scales) of a C-contiguous float32 array (rows, D) in the KV
    cache's "int8" (int8 values, float32 scales (rows, 1)) or "int4" format (uint8
    bytes (rows, D/2), float16 (scale, min) pairs (rows, 2 * D/32)); see cache.quantize."""
    cdef int64_t rows = x.shape[0], n = x.shape[1]
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef cnp.ndarray q, s
    if fmt == "int8":
        q = np.empty((rows, n), np.int8)
        s = np.empty((rows, 1), np.float32)
        with nogil:
            mh_quantize_i8(src, rows, n, <int8_t *>cnp.PyArray_DATA(q),
                           <float *>cnp.PyArray_DATA(s))
        return q, s
    q = np.empty((rows, n // 2), np.uint8)
    s = np.empty((rows, 2 * (n // MH_I4_GROUP)), np.float16)
    with nogil:
        mh_quantize_i4(src, rows, n, <uint8_t *>cnp.PyArray_DATA(q),
                       <uint16_t *>cnp.PyArray_DATA(s))
    return q, s


def openmp_enabled():
    return bool(mh_openmp_enabled())


def openmp_version():
    return mh_omp_version()


def omp_max_threads():
    return mh_omp_max_threads()


def openmp_entry_address():
    """Address of omp_get_max_threads as this extension bound it (0 without OpenMP)."""
    return <uintptr_t>mh_omp_entry_address()


def set_blas(uintptr_t sgemm, uintptr_t dgemm):
    """Use these Fortran-style sgemm/dgemm (e.g. SciPy's cython_blas) for projection tiles."""
    global _sgemm, _dgemm
    _sgemm = <mh_sgemm_fn>sgemm
    _dgemm = <mh_dgemm_fn>dgemm


def has_blas():
    return _sgemm != NULL and _dgemm != NULL


# ---- running work items -------------------------------------------------------------------

cdef struct Job:
    const mh_attn_args *attn
    const mh_linear_args *lin
    mh_block_fn block
    mh_split_fn split
    mh_merge_fn merge
    mh_linear_rows_fn rows
    void (*tile)(const mh_linear_args *args, int64_t tile) noexcept nogil
    int64_t n_blocks  # query blocks per pair
    int64_t n_split   # key ranges per pair
    char *scratch     # per-thread areas, `stride` bytes apart
    size_t stride

ctypedef void (*item_fn)(const Job *job, int64_t item, char *scratch) noexcept nogil


cdef void _block_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    # pair by pair (threads share one pair's keys and values in cache) and, within
    # a pair, heaviest query block (the bottom of the causal triangle) first
    cdef int64_t blk = j.n_blocks - 1 - it % j.n_blocks
    j.block(j.attn, it // j.n_blocks, blk * MH_BLOCK_Q, scratch)


cdef void _split_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    j.split(j.attn, it // j.n_split, it % j.n_split, scratch)


cdef void _merge_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    j.merge(j.attn, it, scratch)


cdef void _rows_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    j.rows(j.lin, it)


cdef void _tile_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    j.tile(j.lin, it)


cdef int _run_items(const Job *job, item_fn fn, int64_t n_items, int nt,
                    bint check_signals) except -1:
    """Items 0 .. n_items-1 on nt OpenMP threads (on the calling thread alone when
    nt == 1), dynamic schedule.  With ``check_signals`` the calling thread looks
    for a pending signal (Ctrl-C) every SIGNAL_CHECK_SECONDS between its items;
    if the handler raises, every thread skips its remaining items and the
    exception propagates.  The call counts as in flight meanwhile."""
    global _active_calls, _contended_until
    cdef int stop = 0
    cdef int *stop_flag = &stop
    cdef double t_start = 0, t_worked = 0
    cdef double *worked_ptr = &t_worked
    cdef double period = SIGNAL_CHECK_SECONDS
    cdef double next_check = mh_seconds() + period
    cdef double *next_ptr = &next_check
    cdef int64_t it
    _active_calls += 1
    try:
        if nt <= 1:
            with nogil:
                for it in range(n_items):
                    fn(job, it, job.scratch)
                    if check_signals and mh_seconds() >= next_check:
                        next_check = mh_seconds() + period
                        with gil:
                            if PyErr_CheckSignals() != 0:
                                stop = 1
                        if stop:
                            break
        else:
            t_start = mh_seconds()
            t_worked = t_start
            with nogil, parallel(num_threads=nt):
                for it in prange(n_items, schedule="dynamic", chunksize=1):
                    if not mh_flag_get(stop_flag):
                        fn(job, it, job.scratch + threadid() * job.stride)
                        if threadid() == 0:
                            worked_ptr[0] = mh_seconds()
                        if check_signals and threadid() == 0 and worked_ptr[0] >= next_ptr[0]:
                            next_ptr[0] = worked_ptr[0] + period
                            with gil:
                                if PyErr_CheckSignals() != 0:
                                    mh_flag_set(stop_flag)
            if waited_for_absent_threads(t_start, t_worked, mh_seconds()):
                _contended_until = mh_seconds() + _contended_seconds
    finally:
        _active_calls -= 1
    if stop:
        return -1  # the signal handler's exception is set
    return 0


# When a split call finds its other threads absent (the calling thread did its
# items, then waited at the end for threads that had no core), calls of up to
# _serial_work_contended multiply-adds run on the calling thread alone for the next
# CONTENDED_SECONDS: waiting for a descheduled thread costs more than such a call.
# Results do not depend on the thread count, so this changes only the time.
cdef double _serial_work_contended = 8388608
SERIAL_WORK_CONTENDED = _serial_work_contended
cdef double _contended_until = 0
cdef double _contended_seconds = 0.25
CONTENDED_SECONDS = _contended_seconds


cpdef bint waited_for_absent_threads(double start, double worked, double end) noexcept:
    """The calling thread ran items from ``start`` to ``worked`` and the call ended at
    ``end``.  Waiting for the others longer than twice its own work (and 0.5 ms) is no
    imbalance (their last items are no longer than its own): they had no core."""
    cdef double wait = end - worked, own = worked - start
    return wait > 0.0005 and wait > 2 * own


# Kernel calls in flight from all Python threads: together they use about the
# requested budget instead of that many threads each.  Changed only with the GIL held.
cdef int _active_calls = 0


cpdef int threads_for_call(int requested, int active_calls) noexcept:
    """Threads one of ``active_calls`` simultaneous calls gets from a budget of ``requested``."""
    cdef int n = requested // (active_calls if active_calls > 1 else 1)
    return n if n > 1 else 1


cdef inline int _clamp_threads(int nt, int64_t n_items, double work=1e300):
    """Threads for n_items items of ``work`` multiply-adds in all, given the calls in flight."""
    nt = threads_for_call(nt, _active_calls + 1)
    if nt > n_items:
        nt = <int>n_items
    if work < _serial_work or (work < _serial_work_contended and nt > 1
                               and mh_seconds() < _contended_until):
        nt = 1
    return nt if nt > 1 else 1


def linear(x, w, bias, out, int num_threads, bint check_signals=False):
    """out (m, n) = x (m, k) @ w (k, n) (+ bias (n,)), all of one float dtype.

    x, w and out have contiguous rows (row strides are read from the arrays);
    more than FEW_ROWS rows need the BLAS set by :func:`set_blas`.
    """
    cdef mh_linear_args a
    cdef Job job
    cdef cnp.ndarray xa = x, wa = w, oa = out
    cdef bint f64 = oa.dtype.itemsize == 8
    cdef int64_t n_items, m_tiles, n_tiles, target = 64
    a.m = xa.shape[0]
    a.k = xa.shape[1]
    a.n = wa.shape[1]
    a.x = _data(xa)
    a.x_row = xa.strides[0] // xa.itemsize
    a.w = _data(wa)
    a.w_row = wa.strides[0] // wa.itemsize
    a.bias = _data(bias) if bias is not None else NULL
    a.out = _data(oa)
    a.out_row = oa.strides[0] // oa.itemsize
    a.sgemm = _sgemm
    a.dgemm = _dgemm
    job.lin = &a
    job.scratch = NULL
    job.stride = 0
    if a.m == 0 or a.n == 0:
        return
    if a.m <= MH_FEW_ROWS:
        job.rows = _table.linear_rows_f64 if f64 else _table.linear_rows_f32
        n_items = (a.n + MH_LINEAR_COLS - 1) // MH_LINEAR_COLS
        _run_items(&job, _rows_item, n_items,
                   _clamp_threads(num_threads, n_items, <double>a.m * a.k * a.n), check_signals)
        return
    if not has_blas():
        raise RuntimeError("no BLAS set for projections of more than FEW_ROWS rows")
    # tiles from the shape alone (never the thread count): rows in tiles of up to
    # 256, columns split until there are about `target` tiles, in multiples of 64
    a.tile_m = a.m if a.m < 256 else 256
    m_tiles = (a.m + a.tile_m - 1) // a.tile_m
    n_tiles = 1
    if m_tiles < target:
        n_tiles = min((target + m_tiles - 1) // m_tiles, (a.n + 255) // 256)
    a.tile_n = ((a.n + n_tiles - 1) // n_tiles + 63) // 64 * 64
    n_tiles = (a.n + a.tile_n - 1) // a.tile_n
    job.tile = mh_linear_tile_f64 if f64 else mh_linear_tile_f32
    n_items = m_tiles * n_tiles
    _run_items(&job, _tile_item, n_items,
               _clamp_threads(num_threads, n_items, <double>a.m * a.k * a.n), check_signals)


cdef void _batch_offsets(cnp.ndarray view, int n_batch, int64_t *out) noexcept:
    """Element offsets of every index over the first ``n_batch`` axes (C order)."""
    cdef Py_ssize_t total = 1, i, rem
    cdef int d
    cdef int64_t off
    cdef Py_ssize_t itemsize = view.itemsize
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(view)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(view)
    for d in range(n_batch):
        total *= shape[d]
    for i in range(total):
        rem = i
        off = 0
        for d in range(n_batch - 1, -1, -1):
            off += (rem % shape[d]) * (strides[d] // itemsize)
            rem //= shape[d]
        out[i] = off


cdef inline void *_data(object arr):
    return cnp.PyArray_DATA(<cnp.ndarray>arr)


cdef class AttentionCall:
    """The arguments of one attention call, kept as the C struct the kernels read.

    Every operand is given as an array view whose leading axes enumerate the
    (batch, head) pairs (n_pairs of them in all, broadcast views welcome) and
    whose last two axes are (rows, columns) with whole-element strides; the
    call computes the per-pair offset tables itself.  Arrays handed to the
    setters are referenced until the call object dies, so the pointers stay
    valid.
    """
    cdef mh_attn_args a
    cdef bint is_f64
    cdef list _keep
    cdef int64_t *_offsets  # 7 tables: q, k, v, out, mask, k_scale, v_scale
    cdef int64_t _table_len

    def __cinit__(self, bint float64, int64_t n_pairs, int64_t q_len, int64_t kv_len,
                  int64_t head_dim, int64_t v_dim, int64_t group=1):
        # with grouped query heads the query and output tables hold n_pairs * group entries
        self._table_len = (n_pairs if n_pairs > 0 else 1) * (group if group > 1 else 1)
        self._offsets = <int64_t *>malloc(7 * sizeof(int64_t) * self._table_len)
        if self._offsets == NULL:
            raise MemoryError("cannot allocate the offset tables")
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
        self.a.group = group if group > 1 else 1

    def __dealloc__(self):
        free(self._offsets)

    cdef int _operand(self, mh_operand *op, int table, cnp.ndarray view, int n_batch) except -1:
        cdef int nd = cnp.PyArray_NDIM(view)
        cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(view)
        cdef int64_t *off = self._offsets + table * self._table_len
        self._keep.append(view)
        _batch_offsets(view, n_batch, off)
        op.base = cnp.PyArray_DATA(view)
        op.off = off
        op.row = strides[nd - 2] // view.itemsize
        op.col = strides[nd - 1] // view.itemsize
        return 0

    def set_query(self, cnp.ndarray q, int n_batch, str fmt="native"):
        """Queries (.., L, E) in the call's float type, or (``fmt`` "float16" or
        "bfloat16", float32 calls) 16-bit bits (uint16) widened as they are read;
        with bfloat16 keys and values too, the avx512bf16 path takes the dot
        products in bfloat16 pairs.  With grouped heads the batch axes end with
        (kv heads, group)."""
        self._operand(&self.a.q, 0, q, n_batch)
        self.a.q_format = KV_FORMATS[fmt]

    def set_keys_values(self, cnp.ndarray k, cnp.ndarray v, int n_batch, str fmt="native",
                        cnp.ndarray k_scale=None, cnp.ndarray v_scale=None):
        """Keys (.., S, E) and values (.., S, Ev) stored as ``fmt`` (a KV_FORMATS name):
        the call's float type, 16-bit formats as uint16 bits, int8, or int4 as uint8
        bytes (.., S, E/2); int8 takes per-row float32 scales (.., S, 1), int4
        float16 (scale, min) pairs per group as uint16 bits (.., S, 2 * groups)."""
        self._operand(&self.a.k, 1, k, n_batch)
        self._operand(&self.a.v, 2, v, n_batch)
        self.a.kv_format = KV_FORMATS[fmt]
        if k_scale is not None:
            self._operand(&self.a.k_scale, 5, k_scale, n_batch)
            self._operand(&self.a.v_scale, 6, v_scale, n_batch)

    def set_output(self, cnp.ndarray out, int n_batch, str fmt="native"):
        """Output (.., L, Ev) in the call's float type, or (``fmt`` "float16" or
        "bfloat16", float32 calls) as 16-bit bits (uint16) rounded to nearest even,
        written by the kernels."""
        self._operand(&self.a.out, 3, out, n_batch)
        self.a.out_format = KV_FORMATS[fmt]

    def set_mask(self, cnp.ndarray mask, int n_batch):
        """Mask (.., L, S): bool (True = may attend) or the call's float type (added);
        row and column strides may be 0 (broadcast)."""
        self._operand(&self.a.mask, 4, mask, n_batch)
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

    def run(self, int num_threads, int64_t split_keys=0, bint check_signals=False):
        """Run every work item on up to ``num_threads`` OpenMP threads, GIL released.

        ``split_keys > 0`` selects the split-key schedule (q_len <= BLOCK_Q):
        keys cut into ranges of that many, attended in parallel, merged in a
        fixed order.  With ``check_signals`` (the main thread's calls) a
        pending Ctrl-C stops the work within about SIGNAL_CHECK_SECONDS plus
        one work item and raises.
        """
        cdef int64_t n_pairs = self.a.n_pairs, q_len = self.a.q_len * self.a.group, n_items
        cdef size_t elem = 8 if self.is_f64 else 4
        cdef int nt, t
        cdef void *raw
        cdef Job job
        job.attn = &self.a
        job.n_blocks = (q_len + MH_BLOCK_Q - 1) // MH_BLOCK_Q
        job.block = _table.block_f64 if self.is_f64 else _table.block_f32
        job.split = _table.split_f64 if self.is_f64 else _table.split_f32
        job.merge = _table.merge_f64 if self.is_f64 else _table.merge_f32

        if n_pairs == 0 or q_len == 0:
            return
        if split_keys > 0:
            job.n_split = (self.a.kv_len + split_keys - 1) // split_keys
            dt = np.float64 if self.is_f64 else np.float32
            n_items = n_pairs * job.n_split
            parts = np.empty(n_items * q_len * (self.a.v_dim + 2), dtype=dt)
            self._keep.append(parts)
            self.a.split.n_split = job.n_split
            self.a.split.split_keys = split_keys
            self.a.split.acc = _data(parts)
            self.a.split.row_max = <char *>_data(parts) + elem * n_items * q_len * self.a.v_dim
            self.a.split.row_sum = <char *>self.a.split.row_max + elem * n_items * q_len
        else:
            n_items = n_pairs * job.n_blocks
        nt = _clamp_threads(num_threads, n_items, <double>n_pairs * q_len * self.a.kv_len
                            * (self.a.head_dim + self.a.v_dim))
        job.stride = mh_scratch_stride(self.a.head_dim, self.a.v_dim, elem)
        # prefill over float16 / bfloat16 keys and values: each thread keeps the rows it
        # widened for a pair, for that pair's next query blocks (WIDENED_BYTES in all)
        self.a.kv_widened_rows = 0
        if (split_keys == 0 and not self.is_f64 and self.a.group == 1
                and q_len > MH_BLOCK_Q
                and (self.a.kv_format == MH_KV_F16 or self.a.kv_format == MH_KV_BF16)
                and mh_widened_bytes(self.a.head_dim, self.a.v_dim, self.a.kv_len) * nt
                <= WIDENED_BYTES):
            self.a.kv_widened_rows = self.a.kv_len
            job.stride += mh_widened_bytes(self.a.head_dim, self.a.v_dim, self.a.kv_len)
        raw = malloc(job.stride * nt + MH_SCRATCH_ALIGN)
        if raw == NULL:
            raise MemoryError("cannot allocate the kernels' scratch")
        job.scratch = <char *>mh_scratch_align(raw)
        if self.a.kv_widened_rows:
            for t in range(nt):
                mh_widened_reset(job.scratch + t * job.stride, self.a.head_dim, self.a.v_dim)
        try:
            if split_keys > 0:
                # every (pair, key range) on its own, then each pair's ranges merged in order
                _run_items(&job, _split_item, n_items, nt, check_signals)
                _run_items(&job, _merge_item, n_pairs, _clamp_threads(nt, n_pairs),
                           check_signals)
            else:
                _run_items(&job, _block_item, n_items, nt, check_signals)
        finally:
            free(raw)
