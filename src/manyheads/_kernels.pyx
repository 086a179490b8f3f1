# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Thin scheduling layer over the C kernels in ``csrc/``.

One typed call object, :class:`AttentionCall`, owns the plan and the C
argument struct of one attention call: it asks the C planner
(``mh_plan_attention``) once what the call will do, the Python core
(``manyheads._core``) fills the operands through named setters (offset tables
and row strides, mask, causal structure, dropout, weights), and
:meth:`AttentionCall.run` runs the plan's work items over an OpenMP thread
team with the GIL released.  Nothing here validates: ``manyheads._core`` has
checked everything before it builds a call.  The C declarations are in
``_csrc.pxd``.
"""
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.math cimport fabs, frexpf, isfinite, ldexpf, sqrt
from libc.string cimport memcpy, memmove, memset
from cpython.pythread cimport PyThread_get_thread_ident

cimport numpy as cnp
import os
import threading
import numpy as np

cnp.import_array()

from manyheads._csrc cimport *

cdef extern from "Python.h":
    int PyErr_CheckSignals()  # called with the GIL held; -1 with the exception set


I4_GROUP = MH_I4_GROUP
BLOCK_Q = MH_BLOCK_Q
BLOCK_K = MH_BLOCK_K
FEW_ROWS = MH_FEW_ROWS
LINEAR_BLOCK_BYTES = MH_LINEAR_BLOCK_BYTES
SIGNAL_CHECK_SECONDS = 0.05  # how often a long call looks for Ctrl-C
cdef double SIGNAL_CHECK_WORK = 1 << 22  # a call of fewer multiply-adds never looks
PATH_NAMES = {MH_PATH_TILE: "tile", MH_PATH_PAIRS: "tile, bfloat16 pair products",
              MH_PATH_FEW_ROWS: "few rows"}
READ_NAMES = {MH_READ_IN_PLACE: "in place", MH_READ_COPIED: "copied",
              MH_READ_WIDENED: "widened once per thread"}


def storage_table():
    """The storage formats of csrc/mh_formats.h, in code order: (name, NumPy dtype
    name of the stored elements, code, bits per element, scale layout, group)."""
    return tuple((mh_storage_table[i].name.decode(), mh_storage_table[i].dtype.decode(),
                  mh_storage_table[i].code, mh_storage_table[i].bits,
                  mh_storage_table[i].scales, mh_storage_table[i].group)
                 for i in range(MH_STORAGE_COUNT))


cdef const mh_kernel_table *_table = mh_kernels(MH_ISA_COUNT - 1)  # the baseline
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
    return tuple(mh_isa_name(i).decode() for i in range(MH_ISA_COUNT))


def isa_compiled(str name):
    """True if the build contains the kernels for ISA ``name``."""
    return bool(mh_isa_compiled(_isa_index(name)))


def cpu_supports(str name):
    """True if this CPU and OS can run the kernels for ISA ``name``."""
    return bool(mh_cpu_supports(_isa_index(name)))


def set_byte_permutes(bint allow):
    """Allow (the default) or forbid the int4 value mix's AVX512-VBMI byte permutes in
    later plans; True if they are now in use (never on a CPU without them).  For tests:
    both ways give the same results."""
    return bool(mh_set_byte_permutes(allow))


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


def quantize_rows(cnp.ndarray x, int code):
    """(stored values, scales) of a C-contiguous float32 array (rows, D) in the KV
    cache's int8 storage (int8 values, float32 scales (rows, 1)) or int4 storage (uint8
    bytes (rows, D/2), float16 (scale, min) pairs (rows, 2 * D/32)), ``code`` the
    storage code; see cache.quantize."""
    cdef int64_t rows = x.shape[0], n = x.shape[1]
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef cnp.ndarray q, s
    if code == MH_STORE_I8:
        q = np.empty((rows, n), np.int8)
        s = np.empty((rows, 1), np.float32)
        with nogil:
            mh_quantize_i8(src, rows, n, <int8_t *>cnp.PyArray_DATA(q),
                           <float *>cnp.PyArray_DATA(s))
        return q, s
    if code != MH_STORE_I4:
        raise ValueError(f"storage code {code} is not a quantised format")
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


# ---- the threads a call asks for: _config's settings, kept here so that small calls
# resolve them without Python (_config.get_num_threads and resolve_num_threads read them)
cdef int _threads_setting = 0      # set_num_threads' value; 0: OpenMP's default
cdef bint _threads_serial = False  # no OpenMP, or a forked child: every call on one thread
cdef int _threads_most = 1         # the cap on any request (_config.max_threads)
cdef unsigned long _main_thread = threading.main_thread().ident


def set_thread_settings(int setting, bint serial, int most):
    """_config's thread settings: set_num_threads' value (0: OpenMP's default), whether
    every call runs on one thread, the cap on any request."""
    global _threads_setting, _threads_serial, _threads_most
    _threads_setting = setting
    _threads_serial = serial
    _threads_most = most


cdef int _default_threads() noexcept:
    """get_num_threads(): 1 when serial, else the setting or OpenMP's default."""
    cdef int n
    if _threads_serial:
        return 1
    if _threads_setting > 0:
        return _threads_setting
    n = mh_omp_max_threads()
    return n if n > 1 else 1


cdef int _call_threads(object n) except -1:
    """The threads of a call that asks for ``n`` (None: the default), within the cap; 0
    for anything but None or an int of at least 1 (its caller's checks explain it)."""
    cdef int d
    if n is None:
        d = _default_threads()
        return d if d < _threads_most else _threads_most
    if type(n) is not int or n < 1:
        return 0
    if _threads_serial:
        return 1
    return _threads_most if n >= _threads_most else <int>n


def default_threads():
    """The threads of a call that does not say (``get_num_threads``)."""
    return _default_threads()


def call_threads(object n):
    """The threads of a call that asks for ``n`` (see _call_threads; 0: not checked)."""
    return _call_threads(n)


def after_fork_in_child():
    """In a forked child the forking thread is the only one, and the one that receives
    signals: its long calls look for Ctrl-C (it may not have been the parent's main
    thread)."""
    global _main_thread
    _main_thread = PyThread_get_thread_ident()


cdef inline bint _on_main_thread() noexcept:
    """Only the main thread receives signals: its long calls look for Ctrl-C."""
    return PyThread_get_thread_ident() == _main_thread


def on_main_thread():
    """Whether the caller is the main thread (the one that receives signals)."""
    return _on_main_thread()


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
    mh_linear_widen_fn widen
    void (*tile)(const mh_linear_args *args, int64_t tile) noexcept nogil
    int64_t n_blocks  # query blocks per pair
    int64_t n_runs    # split items (runs of key ranges) per pair
    char *scratch     # per-thread areas, `stride` bytes apart
    size_t stride

ctypedef void (*item_fn)(const Job *job, int64_t item, char *scratch) noexcept nogil


cdef void _block_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    # pair by pair (threads share one pair's keys and values in cache) and, within
    # a pair, heaviest query block (the bottom of the causal triangle) first
    cdef int64_t blk = j.n_blocks - 1 - it % j.n_blocks
    j.block(j.attn, it // j.n_blocks, blk * MH_BLOCK_Q, scratch)


cdef void _split_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    j.split(j.attn, it // j.n_runs, it % j.n_runs, scratch)


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
    cdef double t_start = 0, t_worked = 0, t_end
    cdef double *worked_ptr = &t_worked
    cdef double period = SIGNAL_CHECK_SECONDS
    cdef double next_check = mh_seconds() + period if check_signals else 0
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
            t_end = mh_seconds()
            if waited_for_absent_threads(t_start, t_worked, t_end) and waited_again(t_end):
                _contended_until = t_end + _contended_seconds
    finally:
        _active_calls -= 1
    if stop:
        return -1  # the signal handler's exception is set
    return 0


# When two split calls less than AGAIN_SECONDS apart find their other threads absent
# (the calling thread did its items, then waited at the end for threads that had no
# core), the plans of the next CONTENDED_SECONDS count as contended: calls up to a
# larger size run on the calling thread alone (mh_plan_threads), since waiting for a
# descheduled thread costs more than such a call.  Results do not depend on the
# thread count, so this changes only the time.  Two waits, not one: a virtual machine
# takes a core away for half a millisecond or more a few times a second while nothing
# else runs, and each such wait had made the small calls of the next 0.25 s run on
# one thread, at half the memory's rate.  On an Intel Xeon VM with 2 cores, one-row
# products of 576 x 3072 on 2 threads back to back for 10 s: with each wait counting
# alone (after the first), 54% of the calls planned as contended; on two 50 ms apart,
# 2.5%.  With other processes on the cores the waits come close together: with one or
# two busy processes, back-to-back products of 576 x 1536 took the same time as on one
# wait (92 against 95 us a call, 143 against 149), where two waits in a row (the calls
# in between did not wait) took 2.4-2.9x the time.
cdef double _contended_until = 0
cdef double _contended_seconds = 0.25
CONTENDED_SECONDS = _contended_seconds
cdef double _again_seconds = 0.05
AGAIN_SECONDS = _again_seconds
cdef double _last_wait = -1e300  # when a split call last waited for absent threads


cpdef bint waited_again(double now) noexcept:
    """Notes that a split call waited for absent threads at ``now`` (seconds); True when
    another did less than AGAIN_SECONDS before (the calls then plan as contended)."""
    global _last_wait
    cdef bint again = now - _last_wait < _again_seconds
    _last_wait = now
    return again


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


cdef inline int _share(int requested):
    """This call's share of a budget of ``requested`` threads, given the calls in flight."""
    return threads_for_call(requested, _active_calls + 1)


def contended():
    """Whether threads were found without a core less than CONTENDED_SECONDS ago (a
    model's compiled decoding step then runs on one thread)."""
    return _contended()


def clear_contended():
    """Forget threads found without a core: the next calls plan as on free cores (the
    tests' starting point, since their results do not depend on it)."""
    global _contended_until, _last_wait
    _contended_until = 0
    _last_wait = -1e300


cdef inline bint _contended():
    """Threads were found without a core less than CONTENDED_SECONDS ago."""
    global _contended_until
    if _contended_until == 0:  # (the usual case: no clock read)
        return False
    if mh_seconds() < _contended_until:
        return True
    _contended_until = 0
    return False


cdef inline int _clamp_threads(int nt, int64_t n_items, double work):
    """Threads for n_items items of ``work`` multiply-adds in all (mh_plan_threads)."""
    return mh_plan_threads(_share(nt), n_items, work, _contended())


cdef struct LinearPlan:
    int64_t n_items, tile_m, tile_n, k_chunk, chunks
    int threads


cdef int64_t STRIPE_BYTES = 1 << 20  # widened weights per stripe of the more-rows path
# few rows of a narrow w: chunks of k, one per core of the machine, 2 to 8 (from the
# machine, never the call's threads, so that the sums' order does not depend on them;
# one count for every weight format, so that half-precision weights give the bits of
# the same weights widened to float32).  Each chunk's sums are written and then added:
# the fewer chunks the better, while there is one for each thread.  16 had made 576
# rows 15 chunks of 40, one thread's share a chunk more than the other's; 8 took whole
# SmolLM2-shaped decoding steps on 2 threads 1.13x less time with int8 weights and
# 1.05x with bfloat16.  2 against 8 on 2 cores, alternating in one process: decoding
# steps 1.06-1.18x (int8), 1.01-1.12x (bfloat16), 0.99-1.02x (float32); one cold row
# of 576 x 3072 1.22x, 1.06x and 0.98x, of 1536 x 576 1.05x, 1.04x and 0.97x
LINEAR_K_CHUNKS = min(8, max(2, os.cpu_count() or 1))
cdef int64_t _k_chunks = LINEAR_K_CHUNKS
cdef int64_t LINEAR_K_ROWS = 32      # ... of at least this many rows
# up to this many rows: the few-rows product on groups of up to MH_LINEAR_ROWS rows,
# each group reading w once; more rows through BLAS.  A BLAS call on so few rows copies
# the weights it reads into its own layout, every call, and weights stored in another
# format are widened for it first.  With each weight vector loaded once for a group's
# rows (FN(pass_rows)), on an Intel Xeon with 2 threads and 768 x 1536 weights: float32
# 16 rows 264 us against 609 through BLAS, 32 rows 477 against 1027; bfloat16 32 rows
# 441 us against 622 as widened stripes.  At 64 rows BLAS and the stripes were ahead.
LINEAR_GROUPED_ROWS = 32         # every weight format
cdef double LINEAR_READ_WEIGHT = 8   # a few-rows multiply-add against the planner's unit


cdef LinearPlan _plan_linear(int64_t m, int64_t k, int64_t n, int num_threads, int itemsize,
                             bint grouped=False, bint widened=False):
    """Work items of out (m, n) = x (m, k) @ w (k, n), sums of ``itemsize`` bytes.  Up to
    FEW_ROWS rows (the kernels' own product): a w whose row's sums fit in
    LINEAR_BLOCK_BYTES (half that with ``grouped`` int8 scales) is cut along k into up
    to LINEAR_K_CHUNKS chunks, each a contiguous run of w, whose sums are added in
    order afterwards; a wider one into column blocks of a multiple of 16 columns within
    that limit, as many as give every thread the same number of blocks.  More rows:
    BLAS tiles from the shape alone (never the thread count): rows in tiles of up to
    256, columns split until there are about 64 tiles, in multiples of 64 (an odd
    count of tiles below 8 one more column tile, in multiples of 16); with ``widened``
    weights (not float32), stripes of every row and at most STRIPE_BYTES of widened
    weights: an even number of equal ones at least 64 columns wide where n has one,
    else about an eighth of n in multiples of 64 columns."""
    cdef LinearPlan p
    cdef int64_t m_tiles, n_tiles, target = 64, blocks, share, limit
    p.tile_m = p.tile_n = 0
    p.k_chunk = k
    p.chunks = 1
    if m <= MH_LINEAR_ROWS:
        limit = MH_LINEAR_BLOCK_BYTES // (2 * itemsize if grouped else itemsize)
        p.tile_m = m
        if n <= limit and k >= 2 * LINEAR_K_ROWS:
            # narrow: one block of every column, LINEAR_K_CHUNKS chunks of k (from the
            # shape alone, so the sums' order never depends on the threads)
            p.tile_n = n
            p.chunks = min(_k_chunks, k // LINEAR_K_ROWS)
            p.k_chunk = ((k + p.chunks - 1) // p.chunks + 7) // 8 * 8
            p.chunks = (k + p.k_chunk - 1) // p.k_chunk
            p.n_items = p.chunks
        else:
            blocks = (n + limit - 1) // limit
            share = max(1, min(num_threads, (n + 15) // 16))
            blocks = (blocks + share - 1) // share * share
            p.tile_n = ((n + blocks - 1) // blocks + 15) // 16 * 16
            p.n_items = (n + p.tile_n - 1) // p.tile_n
    elif widened:
        p.tile_m = m
        limit = max(64, STRIPE_BYTES // (4 * max(k, 1)) // 64 * 64)
        # an even number of equal stripes (6 to 16, whole blocks of 16 columns, at least
        # 64 wide: a narrower one re-reads x for little) where n has one: 576 columns
        # were 5 stripes, 4 of 128 and one of 64, which left a thread without work at
        # the end (2 threads, 128 rows, alternating in one process: 576 x 576 and
        # 1536 x 576 took 0.86-0.97x the time as 6 stripes of 96, the same bits); else
        # about an eighth of n in multiples of 64 columns
        blocks = (n + 15) // 16
        share = max(6, (n + limit - 1) // limit)
        share += share % 2
        while share <= 16 and (blocks % share or blocks // share * 16 > limit):
            share += 2
        if share <= 16 and blocks // share >= 4:  # (stripes of 64 columns or more)
            p.tile_n = blocks // share * 16
        else:
            p.tile_n = min(limit, ((n + 7) // 8 + 63) // 64 * 64)
        p.n_items = (n + p.tile_n - 1) // p.tile_n
    else:
        p.tile_m = m if m < 256 else 256
        m_tiles = (m + p.tile_m - 1) // p.tile_m
        n_tiles = 1
        if m_tiles < target:
            n_tiles = min((target + m_tiles - 1) // m_tiles, (n + 255) // 256)
        p.tile_n = ((n + n_tiles - 1) // n_tiles + 63) // 64 * 64
        n_tiles = (n + p.tile_n - 1) // p.tile_n
        if m_tiles * n_tiles % 2 and 1 < n_tiles and m_tiles * n_tiles < 8:
            # an odd count of few tiles leaves a thread without work at the end: one
            # more, in multiples of 16 columns (128 rows of 576 x 576 and 1536 x 576 on
            # 2 threads took 0.73-0.77x the time as 4 tiles of 144 columns as 3 of 192,
            # alternating in one process, the same bits)
            n_tiles += 1
            p.tile_n = ((n + n_tiles - 1) // n_tiles + 15) // 16 * 16
            n_tiles = (n + p.tile_n - 1) // p.tile_n
        p.n_items = m_tiles * n_tiles
    # few rows are bound by reading w, several times slower a multiply-add than the
    # compute-bound calls the serial thresholds were set for: a 576 x 576 product
    # already runs 1.4-1.5 times as fast on two threads
    p.threads = _clamp_threads(num_threads, p.n_items,
                               <double>m * k * n *
                               (LINEAR_READ_WEIGHT if m <= MH_LINEAR_ROWS else 1))
    return p


def explain_linear(int64_t m, int64_t k, int64_t n, int num_threads, int itemsize=4,
                   weight_format="float32", bint grouped=False):
    """The plan of :func:`linear` for these sizes (bytes per sum, the weights' storage
    format, int8 scales in groups), as a dict: a tile is (rows, columns) of the output
    per work item."""
    cdef bint widened = weight_format not in ("float32", "float64")
    cdef int64_t groups = 1
    if MH_LINEAR_ROWS < m <= LINEAR_GROUPED_ROWS:
        groups = (m + MH_LINEAR_ROWS - 1) // MH_LINEAR_ROWS
        m = (m + groups - 1) // groups  # the largest group's rows
    cdef LinearPlan p = _plan_linear(m, k, n, num_threads, itemsize, grouped, widened)
    path = "few rows" if m <= MH_LINEAR_ROWS else ("widened stripes" if widened else "BLAS tiles")
    return {"path": path, "work_items": p.n_items, "tile": (p.tile_m, p.tile_n),
            "k_chunk": p.k_chunk, "threads": p.threads, "row_groups": groups}


cdef struct ReadJob:
    const float *data
    int64_t n, per_item
    float *sums


cdef void _read_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    cdef const ReadJob *r = <const ReadJob *>j.lin
    cdef int64_t start = it * r.per_item
    cdef int64_t count = min(r.per_item, r.n - start)
    r.sums[it] = mh_read_sum(r.data + start, count)


def read_sum(const float[::1] data, int num_threads):
    """Sum of ``data`` read as the few-rows product reads its weights: items of 1 MiB,
    each read as four runs side by side, on ``num_threads`` of manyheads' threads (the
    benchmark times it for the machine's read rate; one run at a time, in items of 64
    KiB, it read 21 GB/s where the products read 32 on an Intel Xeon).  The sum keeps
    the reads from being optimised away."""
    cdef Job job
    cdef ReadJob r
    cdef int64_t n_items
    r.data = &data[0] if data.shape[0] else NULL
    r.n = data.shape[0]
    r.per_item = 262144
    n_items = (r.n + r.per_item - 1) // r.per_item
    sums = np.zeros(max(n_items, 1), np.float32)
    cdef float[::1] sv = sums
    r.sums = &sv[0]
    job.lin = <const mh_linear_args *>&r
    job.scratch = NULL
    job.stride = 0
    _run_items(&job, _read_item, n_items, max(1, min(num_threads, n_items)), False)
    return float(sums.sum(dtype=np.float64))


cdef void _stripe_item(const Job *j, int64_t it, char *scratch) noexcept nogil:
    mh_linear_stripe_f32(j.lin, it, <float *>scratch, j.widen)


cdef float _largest_finite(const float *x, int64_t m, int64_t k, int64_t row) noexcept nogil:
    """The largest finite magnitude of x (m rows of k, ``row`` apart), 0 if none: as the
    bits of magnitudes, which order as the values do, in signed integers (a loop GCC
    vectorises with SSE2, which has no unsigned maximum)."""
    cdef int32_t big = 0, v
    cdef const int32_t *u
    cdef int64_t r, j
    cdef float out
    for r in range(m):
        u = <const int32_t *>(x + r * row)
        for j in range(k):
            v = u[j] & 0x7fffffff
            v = v if v < 0x7f800000 else 0  # (inf and NaN)
            big = v if v > big else big
    memcpy(&out, &big, 4)
    return out


cdef inline float _int8_x_limit(int64_t k) noexcept nogil:
    """The magnitude of x from which the sums of an int8 product over k rows, in units of
    the weights' scales (up to 127 times the weights), might pass float32's largest."""
    return 3.4028234663852886e38 / (128.0 * (k if k > 0 else 1))


cdef int _linear_int8_scaled(mh_linear_args *a, int num_threads, bint check_signals,
                             float big, float limit) except -1:
    """_linear_few_rows for int8 weights and an x so large that the sums of x times the
    int8 values (the weights over their scales, up to 127 times the weights) might pass
    float32's range while the product does not: the product of x times 2^-e, with e the
    exponent that brings x below ``limit`` (exact, but for values so far below the
    largest that they become subnormal), times 2^e, the bias added after."""
    cdef int e = 0
    cdef int64_t r, j
    cdef float *xs
    cdef float *o
    cdef const float *b = <const float *>a.bias
    cdef const void *x0 = a.x
    cdef int64_t x_row = a.x_row
    frexpf(big / limit, &e)
    e += 1
    xs = <float *>malloc(max(a.m * a.k, 1) * sizeof(float))
    if xs == NULL:
        raise MemoryError("cannot allocate the projection's scaled rows")
    try:
        for r in range(a.m):
            for j in range(a.k):
                xs[r * a.k + j] = ldexpf((<const float *>x0)[r * x_row + j], -e)
        a.x = xs
        a.x_row = a.k
        a.bias = NULL
        _linear_few_rows(a, num_threads, check_signals, False)
        for r in range(a.m):
            o = <float *>a.out + r * a.out_row
            for j in range(a.n):
                o[j] = ldexpf(o[j], e) + (b[j] if b != NULL else 0.0)
    finally:
        a.x = x0
        a.x_row = x_row
        a.bias = b
        free(xs)
    return 0


cdef int _linear_few_rows(mh_linear_args *a, int num_threads, bint check_signals,
                          bint f64) except -1:
    """The kernels' own product of a (up to FEW_ROWS rows, every operand set but the
    plan's fields): planned, run and its chunks' sums added.  int8 weights take x in
    passes as integers times the int8 values, scaled by the weights' scale after each
    group: an x within a factor 128 k of float32's largest takes _linear_int8_scaled."""
    cdef Job job
    cdef float big, limit
    if not f64 and a.w_fmt == MH_STORE_I8:
        big = _largest_finite(<const float *>a.x, a.m, a.k, a.x_row)
        limit = _int8_x_limit(a.k)
        if big >= limit:
            return _linear_int8_scaled(a, num_threads, check_signals, big, limit)
    cdef size_t itemsize = 8 if f64 else 4
    cdef LinearPlan p = _plan_linear(a.m, a.k, a.n, num_threads, itemsize,
                                     a.w_fmt == MH_STORE_I8 and a.group < a.k,
                                     a.w_fmt != MH_STORE_F32 and a.w_fmt != MH_STORE_F64)
    a.sgemm = _sgemm
    a.dgemm = _dgemm
    a.tile_m = p.tile_m
    a.tile_n = p.tile_n
    a.k_chunk = p.k_chunk
    a.partial = NULL
    job.lin = a
    job.scratch = NULL
    job.stride = 0
    job.rows = _table.linear_rows_f64 if f64 else _table.linear_rows_f32
    if p.chunks > 1:
        a.partial = malloc(p.chunks * a.m * a.n * itemsize)
        if a.partial == NULL:
            raise MemoryError("cannot allocate the projection's partial sums")
    try:
        _run_items(&job, _rows_item, p.n_items, p.threads, check_signals)
        if p.chunks > 1:
            with nogil:
                if f64:
                    mh_linear_merge_f64(a, p.chunks)
                else:
                    mh_linear_merge_f32(a, p.chunks)
    finally:
        free(a.partial)
        a.partial = NULL
    return 0


#: the class of manyheads.weights.Int8Weight (registered by that module), whose parts
#: linear_plain reads
cdef object _int8_weight_class = None


def register_int8_weight(cls):
    """Tell :func:`linear_plain` the Int8Weight class (manyheads.weights does, on import)."""
    global _int8_weight_class
    _int8_weight_class = cls


#: ml_dtypes' bfloat16 type number once linear_plain has seen one (-1 before: it is
#: given when the type is registered, so it is learnt, not assumed)
cdef int _bf16_typenum = -1


cdef bint _is_bf16(cnp.ndarray a):
    global _bf16_typenum
    if a.dtype.name == "bfloat16":
        _bf16_typenum = cnp.PyArray_TYPE(a)
        return True
    return False


cdef bint _plain_rows(cnp.ndarray a, int typenum):
    """A C-contiguous, aligned array of native byte order and type ``typenum``."""
    return cnp.PyArray_TYPE(a) == typenum and cnp.PyArray_IS_C_CONTIGUOUS(a) and \
        cnp.PyArray_ISALIGNED(a) and cnp.PyArray_ISNOTSWAPPED(a)


def linear_plain(object x, object w, object bias, object num_threads,
                 object check_signals=None):
    """``x @ w + bias`` of a plain call of up to FEW_ROWS rows, or None when the call is
    not that case: x a C-contiguous aligned float32 or float64 array (..., k) of 1 to
    FEW_ROWS rows, k at least 1; w (k, n), n at least 1, an array of x's type, or with
    float32 x of float16 or bfloat16, whose rows are contiguous, aligned, in order and
    apart, or an Int8Weight; bias None or a C-contiguous (n,) array of x's type;
    ``num_threads`` None or an int of at least 1.  :func:`manyheads.linear`'s checks and
    ``_core.linear`` take everything else, and give these calls the same plan and bits;
    this one leaves out their Python work, most of a small product's time.
    ``check_signals`` None: when called on the main thread."""
    cdef cnp.ndarray xa, wa, ba = None, sa = None, out
    cdef int nd, typenum, wt, i, fmt
    cdef cnp.npy_intp dims[32]
    cdef cnp.npy_intp *xd
    cdef cnp.npy_intp *ws
    cdef int64_t m = 1, k, n, group = 0
    cdef Py_ssize_t wsize
    cdef mh_linear_args a
    cdef int threads = _call_threads(num_threads)
    if threads == 0 or type(x) is not cnp.ndarray:
        return None
    xa = x
    nd = cnp.PyArray_NDIM(xa)
    typenum = cnp.PyArray_TYPE(xa)
    if nd < 1 or nd > 32 or (typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64) or \
            not _plain_rows(xa, typenum):
        return None
    xd = cnp.PyArray_DIMS(xa)
    k = xd[nd - 1]
    for i in range(nd - 1):
        m *= xd[i]
        dims[i] = xd[i]
    if k < 1 or m < 1 or m > MH_FEW_ROWS:
        return None
    if type(w) is cnp.ndarray:
        wa = w
        if cnp.PyArray_NDIM(wa) != 2 or cnp.PyArray_DIMS(wa)[0] != k:
            return None
        wt = cnp.PyArray_TYPE(wa)
        wsize = cnp.PyArray_ITEMSIZE(wa)
        if wt == typenum:
            fmt = MH_STORE_F64 if typenum == cnp.NPY_FLOAT64 else MH_STORE_F32
        elif typenum == cnp.NPY_FLOAT32 and wt == cnp.NPY_FLOAT16:
            fmt = MH_STORE_F16
        elif typenum == cnp.NPY_FLOAT32 and wsize == 2 and (
                wt == _bf16_typenum or _bf16_typenum < 0 and _is_bf16(wa)):
            fmt = MH_STORE_BF16
        else:
            return None
        n = cnp.PyArray_DIMS(wa)[1]
        ws = cnp.PyArray_STRIDES(wa)
        if n < 1 or not _rows_in_place(wa, <int>wsize) or ws[0] < n * wsize:
            return None
    elif type(w) is _int8_weight_class and typenum == cnp.NPY_FLOAT32:
        wa = w._blocked
        sa = w.scales
        group = w.group_size
        n = w.shape[1]
        if w.shape[0] != k or n < 1:
            return None
        fmt = MH_STORE_I8
    else:
        return None
    if bias is not None:
        if type(bias) is not cnp.ndarray:
            return None
        ba = bias
        if cnp.PyArray_NDIM(ba) != 1 or cnp.PyArray_DIMS(ba)[0] != n or \
                not _plain_rows(ba, typenum):
            return None
    dims[nd - 1] = n
    out = cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    memset(&a, 0, sizeof(mh_linear_args))
    a.m, a.k, a.n = m, k, n
    a.x = _data(xa)
    a.x_row = k
    a.w = _data(wa)
    a.w_row = cnp.PyArray_STRIDES(wa)[0] // cnp.PyArray_ITEMSIZE(wa)
    a.w_fmt = fmt
    a.w_scales = <const float *>_data(sa) if sa is not None else NULL
    a.group = group if group > 0 else k
    a.bias = _data(ba) if ba is not None else NULL
    a.out = _data(out)
    a.out_row = n
    _linear_few_rows(&a, threads, _on_main_thread() if check_signals is None
                     else check_signals, typenum == cnp.NPY_FLOAT64)
    return out


def linear(x, w, bias, out, int num_threads, bint check_signals=False, int w_fmt=-1,
           scales=None, int64_t group=0):
    """out (m, n) = x (m, k) @ w (k, n) (+ bias (n,)), x, bias and out of one float dtype.

    w is of that dtype too (``w_fmt`` -1), or, for float32, stored in format ``w_fmt``
    (a storage code: float16, bfloat16 as uint16 bits, or int8 with float32 ``scales``
    (ceil(k / group), n), contiguous; int8 values are (k, n padded to a multiple of 16)
    in the kernels' blocked order, ``Int8Weight``'s storage).  x, w and out have
    contiguous rows (row strides are read from the arrays; n from out's).  Up to
    MH_LINEAR_ROWS (8) rows: the kernels' own product, reading w once; up to
    LINEAR_GROUPED_ROWS rows: that product on groups of rows; more rows need the BLAS
    set by :func:`set_blas`.
    """
    cdef mh_linear_args a
    cdef Job job
    cdef cnp.ndarray xa = x, wa = w, oa = out
    cdef bint f64 = oa.dtype.itemsize == 8
    cdef LinearPlan p
    cdef void *raw = NULL
    cdef bint native
    if xa.ndim != 2 or wa.ndim != 2 or oa.ndim != 2 or xa.shape[0] != oa.shape[0] or \
            wa.shape[0] < xa.shape[1] or wa.shape[1] < oa.shape[1] or (bias is not None and (
                (<cnp.ndarray?>bias).ndim != 1 or (<cnp.ndarray>bias).shape[0] < oa.shape[1])):
        # (the callers check the shapes; this keeps the kernels inside the arrays whatever
        # reaches them)
        raise ValueError(f"linear: x {(<object>xa).shape}, weight {(<object>wa).shape}, bias "
                         f"{None if bias is None else bias.shape} and out "
                         f"{(<object>oa).shape} do not fit")
    a.m = xa.shape[0]
    a.k = xa.shape[1]
    a.n = oa.shape[1]  # not w's: int8 values in the kernels' order have padded rows
    a.x = _data(xa)
    a.x_row = xa.strides[0] // xa.itemsize
    a.w = _data(wa)
    a.w_row = wa.strides[0] // wa.itemsize
    a.w_fmt = w_fmt if w_fmt >= 0 else (MH_STORE_F64 if f64 else MH_STORE_F32)
    a.w_scales = <const float *>_data(scales) if scales is not None else NULL
    a.group = group if group > 0 else a.k
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
    if MH_LINEAR_ROWS < a.m <= LINEAR_GROUPED_ROWS:
        # groups of rows as even as they come (9 rows as 4 + 5, 17 as 5 + 6 + 6); a row's
        # sums do not depend on the rows beside it: the same bits as one row at a time
        n_groups = (a.m + MH_LINEAR_ROWS - 1) // MH_LINEAR_ROWS
        start = 0
        for g in range(n_groups):
            end = start + (a.m - start) // (n_groups - g)
            linear(xa[start:end], w, bias, oa[start:end], num_threads, check_signals, w_fmt,
                   scales, group)
            start = end
        return
    if a.m <= MH_LINEAR_ROWS:
        _linear_few_rows(&a, num_threads, check_signals, f64)
        return
    native = a.w_fmt == MH_STORE_F32 or a.w_fmt == MH_STORE_F64
    p = _plan_linear(a.m, a.k, a.n, num_threads, oa.dtype.itemsize,
                     a.w_fmt == MH_STORE_I8 and a.group < a.k, not native)
    a.tile_m = p.tile_m
    a.tile_n = p.tile_n
    a.k_chunk = p.k_chunk
    a.partial = NULL
    if not has_blas():
        raise RuntimeError("no BLAS set for projections of more than "
                           f"{LINEAR_GROUPED_ROWS} rows")
    if native:
        job.tile = mh_linear_tile_f64 if f64 else mh_linear_tile_f32
        _run_items(&job, _tile_item, p.n_items, p.threads, check_signals)
        return
    job.widen = _table.linear_widen_f32
    job.stride = (a.k * p.tile_n * sizeof(float) + MH_SCRATCH_ALIGN - 1) \
        // MH_SCRATCH_ALIGN * MH_SCRATCH_ALIGN
    raw = malloc(job.stride * p.threads + MH_SCRATCH_ALIGN)
    if raw == NULL:
        raise MemoryError("cannot allocate the widened weights' scratch")
    try:
        job.scratch = <char *>mh_scratch_align(raw)
        _run_items(&job, _stripe_item, p.n_items, p.threads, check_signals)
    finally:
        free(raw)


cdef void _batch_offsets(cnp.ndarray view, int n_batch, int64_t *out) noexcept:
    """Element offsets of every index over the first ``n_batch`` axes (C order), counted
    as an odometer (a division per index and axis took most of a small call's setup)."""
    cdef Py_ssize_t total = 1, i
    cdef int d
    cdef int64_t off = 0
    cdef int64_t step[64]
    cdef int64_t idx[64]
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(view)
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(view)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(view)
    for d in range(n_batch):
        total *= shape[d]
        step[d] = strides[d] // itemsize
        idx[d] = 0
    for i in range(total):
        out[i] = off
        d = n_batch - 1
        while d >= 0:
            idx[d] += 1
            off += step[d]
            if idx[d] < shape[d]:
                break
            off -= step[d] * shape[d]
            idx[d] = 0
            d -= 1


cdef inline void *_data(object arr):
    return cnp.PyArray_DATA(<cnp.ndarray>arr)


# the largest scale or soft cap the kernels take: times log2(e), finite in the scores' type
# (the limits of the Python checks, which also word the error)
from manyheads._validate import FACTOR_MAX as _FACTOR_MAX, check_factor as _check_factor
cdef double _F32_FACTOR_MAX = _FACTOR_MAX[False]
cdef double _F64_FACTOR_MAX = _FACTOR_MAX[True]


cdef class AttentionCall:
    """One attention call: its plan and the C struct of arguments the kernels read.

    Built from what the planner needs (shapes, storage format codes, key and
    value row strides, what is asked for); the plan (``mh_plan_attention``)
    is made here, once, and says among other things how many query heads one
    work item serves (``group``), which the caller needs to lay out its views.
    Then the caller hands the operands to the setters, as array views whose
    leading axes enumerate the pairs the items serve (broadcast views welcome)
    and whose last two axes are (rows, columns) with whole-element strides;
    the call computes the per-pair offset tables itself.  Arrays handed to the
    setters are referenced until the call object dies, so the pointers stay
    valid.  :meth:`run` runs the plan.
    """
    cdef mh_attn_args a
    cdef mh_plan plan
    cdef mh_call_desc desc
    cdef const mh_kernel_table *table
    cdef bint is_f64
    cdef list _keep         # the arrays the call points into: one per table, and weights
    cdef object _parts      # the split partial sums of the latest run (see _prepare)
    cdef int _requested     # threads asked for
    cdef int64_t *_offsets  # 10 tables: q, k, v, out, mask, k_scale, v_scale, alibi, sinks, lse
    cdef int64_t _table_len

    def __cinit__(self, *args, **kwargs):
        self.table = _table
        self._keep = [None] * 11

    def __init__(self, bint float64, tuple shape, tuple formats, tuple kv,
                 int64_t gqa=1, int mask=0, bint weights=False, bint dropout=False,
                 int split=-1, int threads=1):
        """shape: (query pairs, L, S, E, Ev); formats: storage codes of (q, k and v,
        out); kv: the (keys, values) arrays, for their row strides; gqa: query heads per
        kv head (1 without grouped-query attention); mask: 0 none, 1 the same for every
        query head, 2 per query head; split: -1 automatic, 0 never, 1 when allowed;
        threads: requested."""
        cdef cnp.ndarray k = kv[0], v = kv[1]
        self._setup(float64, shape[0], shape[1], shape[2], shape[3], shape[4], formats[0],
                    formats[1], formats[2], cnp.PyArray_STRIDES(k)[cnp.PyArray_NDIM(k) - 2],
                    cnp.PyArray_STRIDES(v)[cnp.PyArray_NDIM(v) - 2], gqa, mask, weights,
                    dropout, split, threads)

    cdef int _setup(self, bint float64, int64_t n_pairs, int64_t q_len, int64_t kv_len,
                    int64_t head_dim, int64_t v_dim, int q_format, int kv_format,
                    int out_format, int64_t k_row_bytes, int64_t v_row_bytes, int64_t gqa,
                    int mask, bint weights, bint dropout, int split, int threads) except -1:
        """The constructor's work on C values (the plain calls' paths build calls with
        ``AttentionCall.__new__`` and this, without the constructor's tuples)."""
        cdef mh_call_desc *d = &self.desc
        self.is_f64 = float64
        d.n_pairs, d.q_len, d.kv_len, d.head_dim, d.v_dim = n_pairs, q_len, kv_len, head_dim, v_dim
        d.q_format, d.kv_format, self.a.out_format = q_format, kv_format, out_format
        d.k_row_bytes = k_row_bytes
        d.v_row_bytes = v_row_bytes
        d.gqa = gqa
        d.elem_size = 8 if float64 else 4
        d.mask = mask > 0
        d.mask_per_head = mask > 1
        d.weights = weights
        d.dropout = dropout
        d.split = split
        self._requested = threads
        d.threads = _share(threads)
        d.contended = _contended()
        mh_plan_attention(d, self.table.caps_f64 if float64 else self.table.caps_f32,
                          &self.plan)
        # the query and output tables hold n_pairs * group entries
        self._table_len = (self.plan.n_pairs if self.plan.n_pairs > 0 else 1) * self.plan.group
        free(self._offsets)
        self._offsets = <int64_t *>malloc(10 * sizeof(int64_t) * self._table_len)
        if self._offsets == NULL:
            raise MemoryError("cannot allocate the offset tables")
        self.a.n_pairs = self.plan.n_pairs
        self.a.q_len = d.q_len
        self.a.kv_len = d.kv_len
        self.a.head_dim = d.head_dim
        self.a.v_dim = d.v_dim
        self.a.plan = &self.plan
        self.a.q_format = d.q_format
        self.a.kv_format = d.kv_format
        self.a.scale = 1.0
        self.a.mask_kind = MH_MASK_NONE
        return 0

    def __dealloc__(self):
        free(self._offsets)

    @property
    def group(self):
        """Query heads one work item serves (1: none grouped)."""
        return self.plan.group

    def explain(self):
        """The plan as a dict of plain values (see manyheads.explain)."""
        cdef mh_plan *p = &self.plan
        kinds = []  # (count, item plan): the blocks but the last of each pair, then the last
        if p.n_split:
            kinds.append((p.n_items, p.item[0]))
        elif p.n_blocks > 1 and p.item[0].rows == p.item[1].rows:
            kinds.append((p.n_items, p.item[0]))
        else:
            if p.n_blocks > 1:
                kinds.append((p.n_pairs * (p.n_blocks - 1), p.item[0]))
            kinds.append((p.n_pairs, p.item[1]))
        # (the item plans come as dicts of their fields)
        items = [{"count": count, "rows": ip["rows"], "path": PATH_NAMES[ip["path"]],
                  "keys": READ_NAMES[ip["k_read"]], "values": READ_NAMES[ip["v_read"]]}
                 for count, ip in kinds]
        return {"isa": self.table.name.decode(), "float64": bool(self.is_f64),
                "pairs": p.n_pairs, "group": p.group, "query_blocks": p.n_blocks,
                "key_ranges": p.n_split, "range_keys": p.split_keys,
                "ranges_per_item": p.split_run if p.n_split else 0, "work_items": p.n_items,
                "items": items, "threads": p.threads,
                "merge_threads": p.merge_threads if p.n_split else 0,
                "prefetch": bool(p.prefetch), "widened_rows": p.widened_rows,
                "scratch_bytes_per_thread": p.scratch_stride,
                "partial_bytes": p.partial_elems * (8 if self.is_f64 else 4),
                "multiply_adds": p.work}

    cdef int _operand(self, mh_operand *op, int table, cnp.ndarray view, int n_batch) except -1:
        cdef int nd = cnp.PyArray_NDIM(view)
        cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(view)
        cdef int64_t *off = self._offsets + table * self._table_len
        self._keep[table] = view  # (an operand set again lets its last array go)
        _batch_offsets(view, n_batch, off)
        op.base = cnp.PyArray_DATA(view)
        op.off = off
        op.row = strides[nd - 2] // view.itemsize
        op.col = strides[nd - 1] // view.itemsize
        return 0

    cpdef set_query(self, cnp.ndarray q, int n_batch):
        """Queries (.., L, E) in the storage the call was planned with (a 16-bit format
        as uint16 bits).  With grouped heads the batch axes end with (kv heads, group)."""
        self._operand(&self.a.q, 0, q, n_batch)

    cpdef set_keys_values(self, cnp.ndarray k, cnp.ndarray v, int n_batch,
                          cnp.ndarray k_scale=None, cnp.ndarray v_scale=None):
        """Keys (.., S, E) and values (.., S, Ev) in the planned storage: 16-bit formats as
        uint16 bits, int8, or int4 as uint8 bytes (.., S, E/2); int8 takes per-row
        float32 scales (.., S, 1), int4 float16 (scale, min) pairs per group as uint16
        bits (.., S, 2 * groups)."""
        self._operand(&self.a.k, 1, k, n_batch)
        self._operand(&self.a.v, 2, v, n_batch)
        if k_scale is not None:
            self._operand(&self.a.k_scale, 5, k_scale, n_batch)
            self._operand(&self.a.v_scale, 6, v_scale, n_batch)

    cpdef set_output(self, cnp.ndarray out, int n_batch):
        """Output (.., L, Ev) in the planned storage (a 16-bit format as uint16 bits,
        rounded to nearest even as the kernels write it)."""
        self._operand(&self.a.out, 3, out, n_batch)

    def set_mask(self, cnp.ndarray mask, int n_batch):
        """Mask (.., L, S): bool (True = may attend) or the call's float type (added);
        row and column strides may be 0 (broadcast)."""
        self._operand(&self.a.mask, 4, mask, n_batch)
        self.a.mask_kind = MH_MASK_BOOL if mask.dtype == np.bool_ else MH_MASK_ADD

    cpdef set_causal(self, int64_t offset, int64_t window=0):
        """Query i sees keys j <= i + offset (and j > i + offset - window if window > 0)."""
        self.a.causal.enabled = 1
        self.a.causal.offset = offset
        self.a.causal.window = window

    cpdef set_scale(self, double scale):
        self.a.scale = self._factor(scale, "scale")

    def set_softcap(self, double cap):
        """Scores become cap * tanh(score / cap) (scaled scores; cap > 0)."""
        self.a.softcap = self._factor(cap, "softcap")

    cdef double _factor(self, double x, str name) except? -1.0:
        """x, when the scores' type can take it times log2(e) (the kernels' units);
        ValueError otherwise, so that a module's scale or soft cap changed after its
        checks cannot reach the kernels (float32 scores had all become NaN)."""
        if not fabs(x) <= (_F64_FACTOR_MAX if self.is_f64 else _F32_FACTOR_MAX):
            _check_factor(x, name, np.float64 if self.is_f64 else np.float32)  # (raises)
        return x

    def set_alibi(self, cnp.ndarray slopes, int n_batch):
        """ALiBi slopes, one per query head: a view (.., 1, 1) of the call's float type
        whose leading axes enumerate the pairs as the queries' do."""
        self._operand(&self.a.alibi, 7, slopes, n_batch)

    def set_sinks(self, cnp.ndarray sinks, int n_batch):
        """Sink logits, one per query head, laid out as set_alibi's slopes."""
        self._operand(&self.a.sinks, 8, sinks, n_batch)

    def set_lse(self, cnp.ndarray lse, int n_batch):
        """Float32 (.., L, 1), laid out as the queries: written with each row's
        log-sum-exp."""
        self._operand(&self.a.lse, 9, lse, n_batch)

    def retarget(self, int64_t kv_len, object causal_offset, int64_t window=0):
        """The next token of a decoding stream: the same operands, now ``kv_len`` keys
        and values long (the caller keeps their arrays' rows that long, from the same
        first row), the query at ``causal_offset`` (None: no causal limit) with the
        window; planned again for them.  False, and the call unusable, where the new
        plan would serve the pairs otherwise (a new group or pair count): build a new
        call then."""
        cdef int64_t group = self.plan.group, pairs = self.plan.n_pairs
        if kv_len < 1 or self.a.weights != NULL or self.a.dropout_p > 0 or \
                self.a.mask.base != NULL:
            return False
        self.desc.kv_len = kv_len
        self.desc.threads = _share(self._requested)
        self.desc.contended = _contended()
        mh_plan_attention(&self.desc, self.table.caps_f64 if self.is_f64 else self.table.caps_f32,
                          &self.plan)
        if self.plan.group != group or self.plan.n_pairs != pairs:
            return False
        self.a.kv_len = kv_len
        if causal_offset is None:
            self.a.causal.enabled = 0
        else:
            self.set_causal(causal_offset, window)
        return True

    def set_dropout(self, double p, uint64_t seed):
        self.a.dropout_p = p
        self.a.seed = seed

    def set_weights(self, weights):
        """Dense (pairs, L, S) C-contiguous zeros of the call's float type, filled by the run."""
        self._keep[10] = weights
        self.a.weights = _data(weights)

    cdef int _prepare(self, Job *job) except -1:
        """Fill ``job`` for this call's items (the split partial sums allocated and
        kept with the call); the caller provides the scratch."""
        cdef const mh_plan *p = &self.plan
        cdef size_t elem = 8 if self.is_f64 else 4
        cdef size_t rows
        job.attn = &self.a
        job.n_blocks = p.n_blocks
        job.n_runs = p.n_items // p.n_pairs if p.n_split else 0
        job.block = self.table.block_f64 if self.is_f64 else self.table.block_f32
        job.split = self.table.split_f64 if self.is_f64 else self.table.split_f32
        job.merge = self.table.merge_f64 if self.is_f64 else self.table.merge_f32
        job.stride = p.scratch_stride
        if p.n_split:
            # (a call retargeted token after token keeps its buffer while it is long enough)
            if self._parts is None or self._parts.shape[0] < p.partial_elems:
                self._parts = np.empty(p.partial_elems,
                                       dtype=np.float64 if self.is_f64 else np.float32)
            parts = self._parts
            rows = p.n_pairs * p.n_split * self.a.q_len * p.group  # (ranges, rows) maxima, sums
            self.a.split.acc = _data(parts)
            self.a.split.row_max = <char *>_data(parts) + elem * rows * self.a.v_dim
            self.a.split.row_sum = <char *>self.a.split.row_max + elem * rows
        return 0

    cpdef run(self, bint check_signals=False):
        """Run the plan's work items on its threads, GIL released.

        With ``check_signals`` (the main thread's calls) a pending Ctrl-C stops the
        work within about SIGNAL_CHECK_SECONDS plus one work item and raises.
        """
        cdef const mh_plan *p = &self.plan
        cdef int t
        cdef void *raw
        cdef Job job
        if p.n_items == 0:
            return
        # a call of little work ends before a Ctrl-C would wait on it: no clock reads
        # (a tiny decoding call's items take less than a microsecond each)
        check_signals = check_signals and p.work >= SIGNAL_CHECK_WORK
        self._prepare(&job)
        raw = malloc(job.stride * p.threads + MH_SCRATCH_ALIGN)
        if raw == NULL:
            raise MemoryError("cannot allocate the kernels' scratch")
        job.scratch = <char *>mh_scratch_align(raw)
        if p.widened_rows:
            for t in range(p.threads):
                mh_widened_reset(job.scratch + t * job.stride, self.a.head_dim, self.a.v_dim)
        try:
            if p.n_split:
                # every (pair, run of key ranges) on its own, then each pair's ranges merged
                # in order
                _run_items(&job, _split_item, p.n_items, p.threads, check_signals)
                _run_items(&job, _merge_item, p.n_pairs, p.merge_threads, check_signals)
            else:
                _run_items(&job, _block_item, p.n_items, p.threads, check_signals)
        finally:
            free(raw)


cdef inline bint _plain_scale(object scale, int64_t E, double *s):
    """*s = the score scale of a plain call (None: 1/sqrt(E)); False for anything but
    None or a Python float that float32 scores can take times log2(e) (the general path
    checks and explains it: _validate.check_factor)."""
    if scale is None:
        s[0] = 1.0 / sqrt(<double>E)
    elif type(scale) is float and fabs(<double>scale) <= _F32_FACTOR_MAX:
        s[0] = scale
    else:
        return False
    return True


def attend_plain(object query, object key, object value, object scale, bint causal,
                 object num_threads, object check_signals=None):
    """The output of a plain attention call (no mask, dropout, grouped heads, score
    features, weights or log-sum-exp), or None when the call is not the simplest case
    this takes: C-contiguous aligned float32 or float64 arrays of one type and the same
    batch shape (..., L|S, E|Ev), every size at least 1, ``scale`` None or a finite
    float, ``num_threads`` None or an int of at least 1.  The general path
    (``_core.attention``) takes everything else, and gives these calls the same plan
    and the same bits; this one only leaves out its Python layout work, most of a small
    call's time.  ``check_signals`` None: when called on the main thread."""
    cdef cnp.ndarray q, k, v, out
    cdef int nd, typenum, i
    cdef cnp.npy_intp *qd
    cdef cnp.npy_intp *kd
    cdef cnp.npy_intp *vd
    cdef cnp.npy_intp dims[32]
    cdef int64_t pairs = 1
    cdef double s = 0  # (_plain_scale sets it)
    cdef int threads = _call_threads(num_threads)
    if threads == 0 or type(query) is not cnp.ndarray or type(key) is not cnp.ndarray or \
            type(value) is not cnp.ndarray:
        return None
    q, k, v = query, key, value
    nd = cnp.PyArray_NDIM(q)
    typenum = cnp.PyArray_TYPE(q)
    if nd < 2 or nd > 32 or cnp.PyArray_NDIM(k) != nd or cnp.PyArray_NDIM(v) != nd or \
            (typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64) or \
            cnp.PyArray_TYPE(k) != typenum or cnp.PyArray_TYPE(v) != typenum:
        return None
    for arr in (q, k, v):
        if not (cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISALIGNED(arr)) or \
                not cnp.PyArray_ISNOTSWAPPED(arr):
            return None
    qd, kd, vd = cnp.PyArray_DIMS(q), cnp.PyArray_DIMS(k), cnp.PyArray_DIMS(v)
    for i in range(nd - 2):
        if qd[i] != kd[i] or qd[i] != vd[i]:
            return None
        pairs *= qd[i]
        dims[i] = qd[i]
    if pairs == 0 or qd[nd - 2] == 0 or qd[nd - 1] == 0 or kd[nd - 2] == 0 or \
            vd[nd - 1] == 0 or kd[nd - 1] != qd[nd - 1] or vd[nd - 2] != kd[nd - 2]:
        return None
    if not _plain_scale(scale, qd[nd - 1], &s):
        return None
    cdef int fmt = MH_STORE_F64 if typenum == cnp.NPY_FLOAT64 else MH_STORE_F32
    cdef AttentionCall call = AttentionCall.__new__(AttentionCall)
    call._setup(typenum == cnp.NPY_FLOAT64, pairs, qd[nd - 2], kd[nd - 2], qd[nd - 1],
                vd[nd - 1], fmt, fmt, fmt, cnp.PyArray_STRIDES(k)[nd - 2],
                cnp.PyArray_STRIDES(v)[nd - 2], 1, 0, False, False, -1, threads)
    dims[nd - 2] = qd[nd - 2]
    dims[nd - 1] = vd[nd - 1]
    out = cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    call.set_query(q, nd - 2)
    call.set_keys_values(k, v, nd - 2)
    call.set_output(out, nd - 2)
    if causal:
        call.set_causal(0, 0)
    call.set_scale(s)
    call.run(_on_main_thread() if check_signals is None else check_signals)
    return out


cdef bint _rows_in_place(cnp.ndarray a, int itemsize):
    """Elements of ``itemsize`` bytes, aligned, the last axis contiguous, every stride a
    whole number of elements: what the kernels read (or write) in place."""
    cdef int nd = cnp.PyArray_NDIM(a), i
    cdef cnp.npy_intp *st = cnp.PyArray_STRIDES(a)
    if cnp.PyArray_ITEMSIZE(a) != itemsize or not cnp.PyArray_ISALIGNED(a) or \
            not cnp.PyArray_ISNOTSWAPPED(a) or st[nd - 1] != itemsize:
        return False
    for i in range(nd - 1):
        if st[i] % itemsize:
            return False
    return True


def attend_heads(object query, object key, object value, object out, int fmt, object scale,
                 bint causal, int64_t window, int threads, bint check_signals):
    """A decoding-sized attention call on arrays laid out as PyTorch's heads are, written
    into ``out``; False (nothing done) when the call is not one this takes.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev) and out (B, Hq, L, Ev)
    (any strides with a contiguous last axis: transposed and sliced views) of storage
    ``fmt`` (float32, or float16 / bfloat16 as 16-bit integers), Hq a multiple of Hkv,
    every size at least 1, no mask or score features; ``causal`` top-left, with a
    sliding ``window`` of keys if it is positive.  The plan must serve each kv head's
    query heads together (or Hq == Hkv).  The general path (``_core.attention``) takes
    everything else and gives these calls the same plan and bits; this one leaves out
    its Python layout work (the views, the batch shapes), most of a small call's time."""
    cdef cnp.ndarray q, k, v, o
    cdef cnp.npy_intp *qd
    cdef cnp.npy_intp *kd
    cdef cnp.npy_intp *vd
    cdef cnp.npy_intp *od
    cdef int64_t B, Hq, Hkv, G, L, S, E, Ev
    cdef int itemsize = 4 if fmt == MH_STORE_F32 else 2
    cdef AttentionCall call
    cdef double s = 0  # (_plain_scale sets it)
    if (fmt != MH_STORE_F32 and fmt != MH_STORE_F16 and fmt != MH_STORE_BF16) or \
            type(query) is not cnp.ndarray or type(key) is not cnp.ndarray or \
            type(value) is not cnp.ndarray or type(out) is not cnp.ndarray:
        return False
    q, k, v, o = query, key, value, out
    if cnp.PyArray_NDIM(q) != 4 or cnp.PyArray_NDIM(k) != 4 or cnp.PyArray_NDIM(v) != 4 or \
            cnp.PyArray_NDIM(o) != 4 or not cnp.PyArray_ISWRITEABLE(o):
        return False
    for arr in (q, k, v, o):
        if not _rows_in_place(arr, itemsize):
            return False
    qd, kd, vd, od = cnp.PyArray_DIMS(q), cnp.PyArray_DIMS(k), cnp.PyArray_DIMS(v), \
        cnp.PyArray_DIMS(o)
    B, Hq, L, E = qd[0], qd[1], qd[2], qd[3]
    Hkv, S, Ev = kd[1], kd[2], vd[3]
    if B < 1 or Hq < 1 or L < 1 or E < 1 or Hkv < 1 or S < 1 or Ev < 1 or Hq % Hkv or \
            kd[0] != B or vd[0] != B or vd[1] != Hkv or kd[3] != E or vd[2] != S or \
            od[0] != B or od[1] != Hq or od[2] != L or od[3] != Ev:
        return False
    if not _plain_scale(scale, E, &s):
        return False
    G = Hq // Hkv
    call = AttentionCall.__new__(AttentionCall)
    call._setup(False, B * Hq, L, S, E, Ev, fmt, fmt, fmt, cnp.PyArray_STRIDES(k)[2],
                cnp.PyArray_STRIDES(v)[2], G, 0, False, False, -1, threads)
    if call.group != G:
        return False
    if G > 1:  # (B, Hkv, G, ..): each kv head's query heads together (splitting an
        # axis is a view; the output's must be, or the kernels would write a copy)
        q = q.reshape((B, Hkv, G, L, E))
        o = out.reshape((B, Hkv, G, L, Ev))
        if cnp.PyArray_DATA(o) != cnp.PyArray_DATA(<cnp.ndarray>out) or \
                not cnp.PyArray_ISWRITEABLE(o):
            return False
    call.set_query(q, 3 if G > 1 else 2)
    call.set_keys_values(k, v, 2)
    call.set_output(o, 3 if G > 1 else 2)
    if causal:
        call.set_causal(0, window if window > 0 else 0)
    call.set_scale(s)
    call.run(check_signals)
    return True


# ---- the small per-token steps of a decoder (one pass each, no temporaries) ------------------

def rms_norm_rows(const float[:, ::1] x, const float[::1] weight, float eps,
                  float[:, ::1] out):
    """out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight, row by row (sums in double)."""
    if weight.shape[0] != x.shape[1] or out.shape[0] != x.shape[0] or \
            out.shape[1] != x.shape[1]:
        raise ValueError("rms_norm_rows: shapes differ")
    if x.shape[0] and x.shape[1]:
        with nogil:
            mh_rms_norm_rows(&x[0, 0], x.shape[0], x.shape[1], x.shape[1], &weight[0], eps,
                             &out[0, 0], out.shape[1])


def gather_int8_columns(const signed char[:, ::1] blocked, const float[:, ::1] scales,
                        int64_t k, int64_t group, const Py_ssize_t[::1] cols,
                        float[:, ::1] out):
    """out[i] = column cols[i] of a (k, n) int8 weight stored in the kernels' order
    (``blocked``, mh_linear_index) times its scales (scales[kk // group, c] for row kk):
    the embedding rows of tokens, read in place, one pass without temporaries (the
    NumPy gather took 13 µs a token warm, about 90 with the caches cold)."""
    cdef mh_linear_args a
    cdef Py_ssize_t i, c, n = scales.shape[1]
    cdef int64_t kk
    cdef const signed char *w
    if (k < 1 or group < 1 or scales.shape[0] != (k + group - 1) // group
            or blocked.shape[0] < (k + 7) // 8 * 8 or blocked.shape[1] < (n + 15) // 16 * 16
            or out.shape[0] != cols.shape[0] or out.shape[1] != k):
        raise ValueError("gather_int8_columns: shapes differ")
    for i in range(cols.shape[0]):
        if not 0 <= cols[i] < n:
            raise IndexError(f"column {cols[i]} is out of range for {n} columns")
    memset(&a, 0, sizeof(a))
    a.w_fmt = MH_STORE_I8
    a.w_row = blocked.shape[1]
    if cols.shape[0]:
        w = &blocked[0, 0]
        with nogil:
            for i in range(cols.shape[0]):
                c = cols[i]
                for kk in range(k):
                    out[i, kk] = w[mh_linear_index(&a, kk, c)] * scales[kk // group, c]


def rotate_heads(cnp.ndarray x, const float[:, ::1] cos, const float[:, ::1] sin):
    """Rotate float32 x (B, H, T, D), any element strides, in place: each row's features
    (i, i + n) for i < n = cos.shape[1] become (a cos - b sin, b cos + a sin) with the
    row's position's cos and sin (T, n); the rest are left as they are."""
    cdef Py_ssize_t B, H, T, n = cos.shape[1], sb, sh, st, sd
    cdef float *p
    if (x.ndim != 4 or x.dtype != np.float32 or cos.shape[0] != x.shape[2]
            or sin.shape[0] != x.shape[2] or sin.shape[1] != n or 2 * n > x.shape[3]
            or not x.flags.writeable
            or any(st_ % 4 for st_ in (x.strides[0], x.strides[1], x.strides[2], x.strides[3]))):
        raise ValueError("rotate_heads: x must be a writable float32 (B, H, T, D) array, "
                         "cos and sin (T, n) with 2 n <= D")
    B, H, T = x.shape[0], x.shape[1], x.shape[2]
    sb, sh, st, sd = x.strides[0] // 4, x.strides[1] // 4, x.strides[2] // 4, x.strides[3] // 4
    p = <float *>cnp.PyArray_DATA(x)
    if n and x.size:
        with nogil:
            mh_rotate_heads(p, B, H, T, sb, sh, st, sd, n, &cos[0, 0], &sin[0, 0])


def gated_mul(const float[:, ::1] gu, float[:, ::1] out, bint gelu=False):
    """out = act(g) * u row by row, where g and u are the two halves of each row of gu
    (m, 2 F) and out is (m, F): ``g / (1 + exp(-a)) * u`` with a = g (SiLU) or, with
    ``gelu``, a = 2 sqrt(2/pi) (g + 0.044715 g^3) (GELU's tanh form, 0.5 g (1 +
    tanh(a / 2))), exp by the current path's vector exp.  Where exp(-a) would overflow
    (-a > 88) act(g) is g * 0 (-0.0, or NaN for g = -inf), as float32 arithmetic gives
    there."""
    if gu.shape[0] != out.shape[0] or gu.shape[1] != 2 * out.shape[1]:
        raise ValueError("gated_mul: gu must be (m, 2 F) for out (m, F)")
    if gu.shape[0] and out.shape[1]:
        with nogil:
            mh_gated_rows(&gu[0, 0], gu.shape[0], out.shape[1], gu.shape[1], gelu, &out[0, 0],
                          out.shape[1], _table.exp_f32)


def clamped_gated_mul(const float[:, ::1] gu, float[:, ::1] out, float alpha, float limit):
    """gpt-oss's clamped SwiGLU row by row: with g and u the two halves of each row of gu
    (m, 2 F) and gc = min(g, limit), out (m, F) = ``gc / (1 + exp(-alpha gc)) *
    (clip(u, -limit, limit) + 1)``, exp by the current path's vector exp (gc * 0 where
    exp(-alpha gc) would overflow, as float32 arithmetic gives there; NaN stays NaN)."""
    if gu.shape[0] != out.shape[0] or gu.shape[1] != 2 * out.shape[1]:
        raise ValueError("clamped_gated_mul: gu must be (m, 2 F) for out (m, F)")
    if gu.shape[0] and out.shape[1]:
        with nogil:
            mh_clamped_gated_rows(&gu[0, 0], gu.shape[0], out.shape[1], gu.shape[1], alpha,
                                  limit, &out[0, 0], out.shape[1], _table.exp_f32)


# ---- a compiled decoding step: every layer of one token in one parallel region ----------

cdef struct LayerStep:
    int64_t B, d, H, Hkv, D, F, n_qkv, rot_n
    float eps
    float *x     # the residual stream (B, d)
    float *h     # its norm (B, d)
    float *qkv   # (B, n_qkv): queries, keys, values
    float *att   # attention output, heads merged (B, H * D)
    float *o     # (B, d)
    float *gu    # (B, 2 F)
    float *act   # (B, F)
    float *dn    # (B, d)
    float *tmp   # (B, d): a post-norm's result
    const float *norm_attn
    const float *norm_mlp
    const float *post_attn
    const float *post_mlp
    const float *q_norm
    const float *k_norm
    mh_linear_args lin[4]  # qkv, out, gate-up, down
    int64_t chunks[4]
    int64_t items[4]
    const float *cos     # this token's rotary angles (rot_n,)
    const float *sin
    int kv_fmt
    char *kc
    char *vc
    char *ksc
    char *vsc
    int64_t kv_s[3]      # byte strides (batch, head, slot) of keys and values
    int64_t sc_s[3]      # ... and of their scales
    int64_t slot
    int gelu             # the gated MLP's activation: GELU's tanh form (else SiLU)
    int *overflow        # the program's flag: a half cache could not hold a new value, or
                         # an int8 product's x was too large for its sums (the run is void)
    void (*exp_f32)(const float *x, float *y, int64_t n) noexcept nogil


cdef struct Phase:
    void (*serial)(LayerStep *s) noexcept nogil  # NULL: items
    LayerStep *step
    const char *ahead    # the next product's weights, asked for by a thread that would
    int64_t ahead_bytes  # only wait at this phase's end (_run_phases)
    const Job *job
    item_fn item
    int64_t n_items


cdef inline void _merge_product(LayerStep *s, int i) noexcept nogil:
    cdef const mh_linear_args *a = &s.lin[i]
    if s.chunks[i] > 1:
        mh_linear_merge_f32(&s.lin[i], s.chunks[i])
    # an int8 product whose x is so large that _linear_few_rows would scale it: the run
    # is void, and the blocks' decode computes the step
    if a.w_fmt == MH_STORE_I8 and \
            _largest_finite(<const float *>a.x, a.m, a.k, a.x_row) >= _int8_x_limit(a.k):
        s.overflow[0] = 1


cdef inline void _add_residual(LayerStep *s, const float *y, const float *post) noexcept nogil:
    cdef int64_t j, n = s.B * s.d
    if post != NULL:
        mh_rms_norm_rows(y, s.B, s.d, s.d, post, s.eps, s.tmp, s.d)
        y = s.tmp
    for j in range(n):
        s.x[j] += y[j]


cdef void _st_norm_attn(LayerStep *s) noexcept nogil:
    mh_rms_norm_rows(s.x, s.B, s.d, s.d, s.norm_attn, s.eps, s.h, s.d)


cdef void _store_row(int fmt, const float *src, int64_t D, char *at,
                     char *sat) noexcept nogil:
    """One float32 row of D keys or values into a cache's row ``at`` (and its scales at
    ``sat``) in storage format ``fmt``, as cache.quantize stores it."""
    cdef int64_t j
    if fmt == MH_STORE_I8:
        mh_quantize_i8(src, 1, D, <int8_t *>at, <float *>sat)
    elif fmt == MH_STORE_I4:
        mh_quantize_i4(src, 1, D, <uint8_t *>at, <uint16_t *>sat)
    elif fmt == MH_STORE_F16:
        for j in range(D):
            (<uint16_t *>at)[j] = mh_float_to_half(src[j])
    elif fmt == MH_STORE_BF16:
        for j in range(D):
            (<uint16_t *>at)[j] = mh_float_to_bf16(src[j])
    else:
        memmove(at, src, D * sizeof(float))


cdef bint _row_overflows(int fmt, const float *src, int64_t D) noexcept nogil:
    """Whether a row cannot be stored in format ``fmt`` (cache.KVCache._converted's
    ValueError): a finite value beyond a half format's range, an int4 group's pair
    beyond float16's."""
    if fmt == MH_STORE_F16 or fmt == MH_STORE_BF16:
        return _half_overflows(src, D, fmt == MH_STORE_BF16)
    if fmt == MH_STORE_I4:
        return mh_i4_overflows(src, 1, D) != 0
    return False


cdef bint _overlaps(cnp.ndarray a, cnp.ndarray b):
    """Whether the bytes a and b may touch overlap (either's strides negative: yes)."""
    cdef char *lo[2]
    cdef char *hi[2]
    cdef int i, d
    cdef cnp.ndarray x
    for i in range(2):
        x = a if i == 0 else b
        lo[i] = <char *>cnp.PyArray_DATA(x)
        hi[i] = lo[i] + <Py_ssize_t>cnp.PyArray_ITEMSIZE(x)
        for d in range(x.ndim):
            if x.strides[d] < 0:
                return True
            if x.shape[d] == 0:
                return False
            hi[i] += (x.shape[d] - 1) * x.strides[d]
    return lo[0] < hi[1] and lo[1] < hi[0]


cdef bint _rows_like(cnp.ndarray a, cnp.ndarray ref, int64_t cols, int64_t itemsize):
    """Whether ``a`` is a writable 4-d array of ``ref``'s first three dimensions with
    rows of ``cols`` contiguous items of ``itemsize`` bytes, strided as ``ref`` is when
    ``ref`` holds the same items."""
    cdef int d
    if (a.ndim != 4 or a.shape[3] != cols or a.itemsize != itemsize
            or a.strides[3] != itemsize or not cnp.PyArray_ISWRITEABLE(a)):
        return False
    for d in range(3):
        if a.shape[d] != ref.shape[d] or (ref.itemsize == itemsize and ref.shape[3] == cols
                                          and a.strides[d] != ref.strides[d]):
            return False
    return True


def store_token(int code, cnp.ndarray k, cnp.ndarray v, cnp.ndarray keys,
                cnp.ndarray values, key_scales, value_scales, int64_t h0, int64_t slot):
    """Store one token's keys and values ``k``, ``v`` (B, h, 1, D) float32 (rows of D
    contiguous) into kv heads [h0, h0 + h) of a cache's arrays (B, Hkv, capacity, ...)
    at ``slot``, in storage format ``code``, as cache.quantize stores them (a decoding
    step's store, without the temporaries and checks of the general one).  False, with
    nothing stored, where it cannot: another dtype or layout, or a value the format
    cannot hold (the general path then stores, or says why)."""
    cdef int64_t B, h, D, b, hd, cols, scols, itemsize, sitemsize
    cdef char *kd
    cdef char *vd
    cdef char *ko
    cdef char *vo
    cdef char *kso = NULL
    cdef char *vso = NULL
    cdef cnp.ndarray ks, vs
    cdef cnp.npy_intp *kst
    cdef cnp.npy_intp *vst
    cdef cnp.npy_intp *ost
    cdef cnp.npy_intp *sst
    cdef bint over = False
    if (cnp.PyArray_TYPE(k) != cnp.NPY_FLOAT32 or cnp.PyArray_TYPE(v) != cnp.NPY_FLOAT32
            or not cnp.PyArray_ISALIGNED(k) or not cnp.PyArray_ISALIGNED(v)
            or k.ndim != 4 or v.ndim != 4 or keys.ndim != 4 or values.ndim != 4):
        return False
    B, h, D = k.shape[0], k.shape[1], k.shape[3]
    if (v.shape[0] != B or v.shape[1] != h or v.shape[3] != D or k.shape[2] != 1
            or v.shape[2] != 1 or k.strides[3] != 4 or v.strides[3] != 4 or D < 1):
        return False
    if code == MH_STORE_F32:
        cols, itemsize, scols, sitemsize = D, 4, 0, 0
    elif code == MH_STORE_F16 or code == MH_STORE_BF16:
        cols, itemsize, scols, sitemsize = D, 2, 0, 0
    elif code == MH_STORE_I8:
        cols, itemsize, scols, sitemsize = D, 1, 1, 4
    elif code == MH_STORE_I4 and D % MH_I4_GROUP == 0:
        cols, itemsize, scols, sitemsize = D // 2, 1, 2 * (D // MH_I4_GROUP), 2
    else:
        return False
    if (keys.shape[0] != B or h0 < 0 or h0 + h > keys.shape[1] or slot < 0
            or slot >= keys.shape[2] or not _rows_like(keys, keys, cols, itemsize)
            or not _rows_like(values, keys, cols, itemsize)):  # (keys: their layout)
        return False
    if scols:
        if not isinstance(key_scales, np.ndarray) or not isinstance(value_scales, np.ndarray):
            return False
        ks, vs = key_scales, value_scales
        if not _rows_like(ks, keys, scols, sitemsize) or not _rows_like(vs, ks, scols, sitemsize):
            return False
        sst = cnp.PyArray_STRIDES(ks)
        kso = <char *>cnp.PyArray_DATA(ks) + h0 * sst[1] + slot * sst[2]
        vso = <char *>cnp.PyArray_DATA(vs) + h0 * sst[1] + slot * sst[2]
    kst, vst, ost = cnp.PyArray_STRIDES(k), cnp.PyArray_STRIDES(v), cnp.PyArray_STRIDES(keys)
    kd, vd = <char *>cnp.PyArray_DATA(k), <char *>cnp.PyArray_DATA(v)
    # (new rows that share memory with the cache, as a view of it would: the general store)
    for a in (keys, values, key_scales, value_scales):
        if a is not None and (_overlaps(k, a) or _overlaps(v, a)):
            return False
    ko = <char *>cnp.PyArray_DATA(keys) + h0 * ost[1] + slot * ost[2]
    vo = <char *>cnp.PyArray_DATA(values) + h0 * ost[1] + slot * ost[2]
    with nogil:
        for b in range(B):  # every row checked before any is stored
            for hd in range(h):
                if (_row_overflows(code, <const float *>(kd + b * kst[0] + hd * kst[1]), D) or
                        _row_overflows(code, <const float *>(vd + b * vst[0] + hd * vst[1]), D)):
                    over = True
        if not over:
            for b in range(B):
                for hd in range(h):
                    _store_row(code, <const float *>(kd + b * kst[0] + hd * kst[1]), D,
                               ko + b * ost[0] + hd * ost[1],
                               kso + b * sst[0] + hd * sst[1] if scols else NULL)
                    _store_row(code, <const float *>(vd + b * vst[0] + hd * vst[1]), D,
                               vo + b * ost[0] + hd * ost[1],
                               vso + b * sst[0] + hd * sst[1] if scols else NULL)
    return not over


cdef void _st_store(LayerStep *s, const float *src, char *data, char *scales, int64_t b,
                    int64_t hd) noexcept nogil:
    cdef char *at = data + b * s.kv_s[0] + hd * s.kv_s[1] + s.slot * s.kv_s[2]
    cdef char *sat = scales + b * s.sc_s[0] + hd * s.sc_s[1] + s.slot * s.sc_s[2] \
        if scales != NULL else NULL
    _store_row(s.kv_fmt, src, s.D, at, sat)


cdef bint _half_overflows(const float *x, int64_t n, bint bf16) noexcept nogil:
    """Whether a finite value of x[0, n) rounds to float16 infinity (as NumPy's cast
    overflows), or with ``bf16`` to bfloat16's."""
    cdef int64_t j
    for j in range(n):
        if not isfinite(x[j]):
            continue
        if bf16:
            if (mh_float_to_bf16(x[j]) & 0x7fff) == 0x7f80:
                return True
        elif (mh_float_to_half(x[j]) & 0x7fff) == 0x7c00:
            return True
    return False


cdef void _st_qkv(LayerStep *s) noexcept nogil:
    """The projection's chunks merged, the heads' norms, the rotation, and the token's
    keys and values stored in the cache's slot."""
    cdef int64_t b, hd
    cdef float *row
    cdef float *kp
    cdef float *vp
    _merge_product(s, 0)
    for b in range(s.B):
        row = s.qkv + b * s.n_qkv
        kp = row + s.H * s.D
        if s.q_norm != NULL:
            mh_rms_norm_rows(row, s.H, s.D, s.D, s.q_norm, s.eps, row, s.D)
            mh_rms_norm_rows(kp, s.Hkv, s.D, s.D, s.k_norm, s.eps, kp, s.D)
        if s.rot_n:
            mh_rotate_heads(row, 1, s.H, 1, 0, s.D, 0, 1, s.rot_n, s.cos, s.sin)
            mh_rotate_heads(kp, 1, s.Hkv, 1, 0, s.D, 0, 1, s.rot_n, s.cos, s.sin)
    if not s.overflow[0]:
        for b in range(s.B):  # the keys and values of every row, before any is stored
            # (int4: D is whole groups, so the row's groups are its heads' groups)
            if _row_overflows(s.kv_fmt, s.qkv + b * s.n_qkv + s.H * s.D, 2 * s.Hkv * s.D):
                s.overflow[0] = 1
    if s.overflow[0]:  # this layer and those after it store nothing: the run is void
        return
    for b in range(s.B):
        kp = s.qkv + b * s.n_qkv + s.H * s.D
        vp = kp + s.Hkv * s.D
        for hd in range(s.Hkv):
            _st_store(s, kp + hd * s.D, s.kc, s.ksc, b, hd)
            _st_store(s, vp + hd * s.D, s.vc, s.vsc, b, hd)


cdef void _st_out(LayerStep *s) noexcept nogil:
    _merge_product(s, 1)
    _add_residual(s, s.o, s.post_attn)
    mh_rms_norm_rows(s.x, s.B, s.d, s.d, s.norm_mlp, s.eps, s.h, s.d)


cdef void _st_gate(LayerStep *s) noexcept nogil:
    _merge_product(s, 2)
    mh_gated_rows(s.gu, s.B, s.F, 2 * s.F, s.gelu, s.act, s.F, s.exp_f32)


cdef void _st_down(LayerStep *s) noexcept nogil:
    _merge_product(s, 3)
    _add_residual(s, s.dn, s.post_mlp)


cdef long _run_phases(const Phase *ph, int n_phases, int nt, char *scratch, size_t stride,
                      long *counters) noexcept nogil:
    """The phases in order on one team of nt threads: a serial phase on thread 0, an
    item phase's items shared out one at a time; the team meets at a spinning barrier
    after each phase (a token's step has hundreds, microseconds apart).  A thread that
    would only wait there (the others during a serial phase, all but the last to run out
    of items) asks for the start of the next product's weights until a thread arrives,
    so that the product does not begin with every read from memory (a whole
    SmolLM2-shaped model's decoding step on an AMD EPYC, 2 threads, alternating token by
    token: int8 weights 1.06-1.07x, bfloat16 1.04-1.06x, float32 1.01-1.04x).  Returns
    how often thread 0 waited more than a millisecond at a barrier (the others' waits
    are not counted: they wait for thread 0's serial phases by design)."""
    cdef mh_team_barrier_t meeting
    # (set before the parallel block, which copies them into each thread)
    cdef int i = 0, tid = 0, team = 0
    cdef int64_t it = 0, share = 0
    cdef long y = 0
    cdef long yields = 0
    cdef long *yields_ptr = &yields
    meeting.count = 0
    meeting.gen = 0
    if nt <= 1:  # no parallel region at all (as _run_items: a forked child has no pool)
        for i in range(n_phases):
            if ph[i].serial != NULL:
                ph[i].serial(ph[i].step)
            else:
                for it in range(ph[i].n_items):
                    ph[i].item(ph[i].job, it, scratch)
        return 0
    with parallel(num_threads=nt):
        tid = threadid()
        team = mh_omp_team_size()
        for i in range(n_phases):
            if ph[i].serial != NULL:
                if tid == 0:
                    ph[i].serial(ph[i].step)
                elif ph[i].ahead_bytes > 0:  # the others ask for the next product meanwhile
                    share = ph[i].ahead_bytes // (team - 1)
                    mh_read_ahead_until_arrival(ph[i].ahead + (tid - 1) * share, share,
                                                &meeting)
            else:
                it = mh_next_item(&counters[i])
                while it < ph[i].n_items:
                    ph[i].item(ph[i].job, it, scratch + tid * stride)
                    it = mh_next_item(&counters[i])
                # every thread's last fetch finds no item: all but the last to finish
                # ask for the next product while the others work
                if ph[i].ahead_bytes > 0 and it - ph[i].n_items < team - 1:
                    mh_read_ahead_until_arrival(ph[i].ahead, ph[i].ahead_bytes, &meeting)
            y = mh_team_barrier(&meeting, team)
            if tid == 0:
                yields_ptr[0] += y
    return yields


#: bytes of the next product's weights a thread asks for while it would only wait for
#: the others (it stops as soon as one of them is done)
cdef int64_t READ_AHEAD_BYTES = 1 << 19


cdef float *_f32(arr):
    return NULL if arr is None else <float *>_data(arr)


cdef class DecodeProgram:
    """One decoding step of a Llama-shaped decoder compiled into phases that one
    parallel region runs: for each layer the norms, products, rotation, cache store,
    attention and residual adds of DecoderAttention.decode and LlamaBlock.decode, with
    the same kernels and plans, so the same bits.  Built once per (model, caches, rows)
    with :meth:`set_layer`; :meth:`run` takes each token's attention calls and
    rotary angles.  Arrays handed in are kept referenced."""
    cdef LayerStep *layers
    cdef Job *jobs        # per layer: 4 products, attention items, attention merge
    cdef Phase *phases
    cdef long *counters
    cdef int n_layers, max_phases, nt
    cdef list _keep
    cdef object _partial  # the products' chunk sums, one buffer for all (run in turn)
    cdef int64_t _partial_elems
    cdef int _overflow    # the last run found a value a half cache cannot hold
    cdef double _weight_bytes  # the products' weights (and scales), every layer

    def __cinit__(self, int n_layers, int num_threads):
        self.n_layers = n_layers
        self.nt = num_threads if num_threads > 1 else 1
        self.max_phases = 11 * n_layers
        self._keep = []
        self._partial = None
        self._partial_elems = 0
        self.layers = <LayerStep *>calloc(n_layers, sizeof(LayerStep))
        self.jobs = <Job *>calloc(6 * n_layers, sizeof(Job))
        self.phases = <Phase *>calloc(self.max_phases, sizeof(Phase))
        self.counters = <long *>calloc(self.max_phases, sizeof(long))
        if not (self.layers and self.jobs and self.phases and self.counters):
            raise MemoryError("cannot allocate the decoding step")

    def __dealloc__(self):
        free(self.layers)
        free(self.jobs)
        free(self.phases)
        free(self.counters)

    def set_layer(self, int i, tuple dims, float eps, tuple buffers, tuple norms,
                  tuple products, bint gelu=False):
        """Layer i: dims (B, d, H, Hkv, D, F); buffers x, h, qkv, att, o, gu, act, dn, tmp
        (float32, C-contiguous; layers may share them, as they run in turn); norms
        (attn, mlp, post_attn, post_mlp, q, k), None where absent; products: four (w
        storage code or -1, data, scales, group, n, bias) for qkv, out, gate-up and
        down (``_core.weight_parts`` and the bias; n the output width); ``gelu``: the
        gated MLP's activation is GELU's tanh form (:func:`gated_mul`), else SiLU."""
        cdef LayerStep *s = &self.layers[i]
        cdef mh_linear_args *a
        cdef LinearPlan p
        cdef cnp.ndarray data, xa, oa
        cdef int j
        self._keep.append((buffers, norms, products))
        s.B = dims[0]
        s.d = dims[1]
        s.H = dims[2]
        s.Hkv = dims[3]
        s.D = dims[4]
        s.F = dims[5]
        s.n_qkv = (s.H + 2 * s.Hkv) * s.D
        s.eps = eps
        s.gelu = gelu
        s.x = _f32(buffers[0])
        s.h = _f32(buffers[1])
        s.qkv = _f32(buffers[2])
        s.att = _f32(buffers[3])
        s.o = _f32(buffers[4])
        s.gu = _f32(buffers[5])
        s.act = _f32(buffers[6])
        s.dn = _f32(buffers[7])
        s.tmp = _f32(buffers[8])
        s.norm_attn = _f32(norms[0])
        s.norm_mlp = _f32(norms[1])
        s.post_attn = _f32(norms[2])
        s.post_mlp = _f32(norms[3])
        s.q_norm = _f32(norms[4])
        s.k_norm = _f32(norms[5])
        ins = (buffers[1], buffers[3], buffers[1], buffers[6])
        outs = (buffers[2], buffers[4], buffers[5], buffers[7])
        for j in range(4):
            fmt, data, scales, group, n, bias = products[j]
            self._weight_bytes += data.nbytes + (scales.nbytes if scales is not None else 0)
            xa, oa = ins[j], outs[j]
            a = &s.lin[j]
            memset(a, 0, sizeof(mh_linear_args))
            a.m, a.k, a.n = xa.shape[0], xa.shape[1], n
            a.x = _data(xa)
            a.x_row = a.k
            a.w = _data(data)
            a.w_row = data.strides[0] // data.itemsize
            a.w_fmt = fmt if fmt >= 0 else MH_STORE_F32
            a.w_scales = <const float *>_data(scales) if scales is not None else NULL
            a.group = group if group > 0 else a.k
            a.bias = _data(bias) if bias is not None else NULL
            a.out = _data(oa)
            a.out_row = a.n
            p = _plan_linear(a.m, a.k, a.n, self.nt, 4,
                             a.w_fmt == MH_STORE_I8 and a.group < a.k, False)
            a.tile_m, a.tile_n, a.k_chunk = p.tile_m, p.tile_n, p.k_chunk
            s.chunks[j] = p.chunks
            s.items[j] = p.n_items
            if p.chunks > 1:
                self._partial_elems = max(self._partial_elems, p.chunks * a.m * a.n)
            self.jobs[6 * i + j].lin = a
            self.jobs[6 * i + j].rows = _table.linear_rows_f32
        s.exp_f32 = _table.exp_f32
        s.overflow = &self._overflow

    @property
    def overflowed(self):
        """Whether the last run found a key or value its float16 or bfloat16 cache (or
        an int4 cache's pairs) cannot hold, or an int8 product's x too large for the
        compiled product (see _linear_int8_scaled)."""
        return bool(self._overflow)

    cdef int _set_cache(self, LayerStep *s, tuple cache) except -1:
        """The layer's cache for this run: (storage code, keys, values, key scales, value
        scales) as stored, (B, Hkv, slots, x) (referenced by the run's calls)."""
        cdef cnp.ndarray kc, ksc
        cdef int j
        s.kv_fmt, kc, vc, ksc, vsc = cache
        s.kc, s.vc = <char *>_data(kc), <char *>_data(vc)
        s.ksc = <char *>_data(ksc) if ksc is not None else NULL
        s.vsc = <char *>_data(vsc) if vsc is not None else NULL
        for j in range(3):
            s.kv_s[j] = kc.strides[j]
            s.sc_s[j] = ksc.strides[j] if ksc is not None else 0
        return 0

    def run(self, list calls, list angles, list slots, list caches):
        """One token through every layer: ``calls[i]`` layer i's prepared AttentionCall
        (operands set, queries in its qkv buffer, keys over the cache including this
        token's slot ``slots[i]``), ``angles[i]`` its rotary (cos, sin), each (1, n),
        ``caches[i]`` its cache's arrays (see _set_cache); none is kept after the run.
        Returns how often the first thread waited more than a millisecond for the
        others; more than twice, and the calls of the next CONTENDED_SECONDS plan as
        contended (:func:`contended`).  Where a float16 or bfloat16 cache cannot hold a
        new key or value (it would round to infinity), or an int4 cache's pairs, that
        layer and the later ones store nothing and :attr:`overflowed` is set: the run is
        void (the caller must not advance the caches); so is a run in which an int8
        product's x is too large for the compiled product."""
        global _contended_until
        cdef int i, n = 0
        cdef long yields
        cdef LayerStep *s
        cdef const mh_linear_args *nxt
        cdef AttentionCall call
        cdef Job *job
        cdef size_t stride = 0
        cdef void *raw
        for i in range(self.n_layers):
            call = calls[i]
            if call.plan.widened_rows:
                raise ValueError("a decoding step's attention widens no rows")
            stride = max(stride, call.plan.scratch_stride)
        if self._partial_elems and self._partial is None:
            self._partial = np.empty(self._partial_elems, np.float32)
            for i in range(4 * self.n_layers):
                if self.layers[i // 4].chunks[i % 4] > 1:
                    self.layers[i // 4].lin[i % 4].partial = _data(self._partial)
        for i in range(self.n_layers):
            s = &self.layers[i]
            self._set_cache(s, caches[i])
            cos, sin = angles[i]
            s.rot_n = cos.shape[1]
            s.cos = _f32(cos)
            s.sin = _f32(sin)
            s.slot = slots[i]
            call = calls[i]
            job = &self.jobs[6 * i + 4]
            if self._weight_bytes >= MH_PREFETCH_MIN_BYTES:
                # the other layers' weights pushed this layer's keys and values out of
                # the caches: its attention asks for them ahead as a long call's does
                # (a SmolLM2-shaped model, 128-192 tokens, alternating token by token:
                # the attention took 1.23x less time with int8 weights, 1.31x with
                # bfloat16; the whole step 1.01-1.02x)
                call.plan.prefetch = 1
            call._prepare(job)
            nxt = &self.layers[i + 1].lin[0] if i + 1 < self.n_layers else NULL
            n = self._serial(n, _st_norm_attn, s, &s.lin[0])
            n = self._items(n, &self.jobs[6 * i], _rows_item, s.items[0], &s.lin[1])
            n = self._serial(n, _st_qkv, s, &s.lin[1])
            if call.plan.n_split:
                n = self._items(n, job, _split_item, call.plan.n_items, &s.lin[1])
                n = self._items(n, job, _merge_item, call.plan.n_pairs, &s.lin[1])
            else:
                n = self._items(n, job, _block_item, call.plan.n_items, &s.lin[1])
            n = self._items(n, &self.jobs[6 * i + 1], _rows_item, s.items[1], &s.lin[2])
            n = self._serial(n, _st_out, s, &s.lin[2])
            n = self._items(n, &self.jobs[6 * i + 2], _rows_item, s.items[2], &s.lin[3])
            n = self._serial(n, _st_gate, s, &s.lin[3])
            n = self._items(n, &self.jobs[6 * i + 3], _rows_item, s.items[3], nxt)
            n = self._serial(n, _st_down, s, nxt)
        memset(self.counters, 0, n * sizeof(long))
        self._overflow = 0
        raw = malloc(stride * self.nt + MH_SCRATCH_ALIGN)
        if raw == NULL:
            raise MemoryError("cannot allocate the kernels' scratch")
        try:
            with nogil:
                yields = _run_phases(self.phases, n, self.nt, <char *>mh_scratch_align(raw),
                                     stride, self.counters)
        finally:
            free(raw)
        if yields > 2:
            # thread 0 waited milliseconds for threads without a core: the next calls
            # plan as contended (see _run_items)
            _contended_until = mh_seconds() + _contended_seconds
        return yields

    cdef int _serial(self, int n, void (*fn)(LayerStep *s) noexcept nogil, LayerStep *s,
                     const mh_linear_args *ahead):
        """A serial phase; meanwhile the other threads ask for the first
        READ_AHEAD_BYTES of the weights of ``ahead`` (the next product, NULL for none),
        each its share."""
        self.phases[n].serial = fn
        self.phases[n].step = s
        self._ahead(n, ahead)
        return n + 1

    cdef int _items(self, int n, const Job *job, item_fn item, int64_t n_items,
                    const mh_linear_args *ahead):
        """An item phase; a thread that finds no more items while others work asks for
        the weights of ``ahead`` as a serial phase's idle threads do."""
        self.phases[n].serial = NULL
        self.phases[n].job = job
        self.phases[n].item = item
        self.phases[n].n_items = n_items
        self._ahead(n, ahead)
        return n + 1

    cdef void _ahead(self, int n, const mh_linear_args *ahead):
        # (the stored weights: k rows of w_row elements of the format table's bits)
        self.phases[n].ahead = <const char *>ahead.w if ahead != NULL else NULL
        self.phases[n].ahead_bytes = min(READ_AHEAD_BYTES, ahead.k * ahead.w_row
                                         * mh_storage_bits(ahead.w_fmt) // 8) \
            if ahead != NULL else 0
