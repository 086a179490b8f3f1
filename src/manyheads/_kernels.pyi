"""Type stub for the compiled Cython extension ``manyheads._kernels`` (see _kernels.pyx)."""
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

_Float = TypeVar("_Float", np.float32, np.float64)
_FloatArray = npt.NDArray[np.float32] | npt.NDArray[np.float64]

I4_GROUP: int
BLOCK_Q: int
BLOCK_K: int
FEW_ROWS: int
LINEAR_GROUPED_ROWS: int
LINEAR_BLOCK_BYTES: int
LINEAR_K_CHUNKS: int
CONTENDED_SECONDS: float
SIGNAL_CHECK_SECONDS: float
PATH_NAMES: dict[int, str]
READ_NAMES: dict[int, str]

def storage_table() -> tuple[tuple[str, str, int, int, int, int], ...]:
    """The storage formats of csrc/mh_formats.h, in code order: (name, NumPy dtype
    name of the stored elements, code, bits per element, scale layout, group)."""

def isa_names() -> tuple[str, ...]:
    """Every kernel path this source knows, best first (whether compiled in or not)."""

def isa_compiled(name: str) -> bool:
    """True if the build contains the kernels for ISA ``name``."""

def cpu_supports(name: str) -> bool:
    """True if this CPU and OS can run the kernels for ISA ``name``."""

def set_byte_permutes(allow: bool) -> bool:
    """Allow (the default) or forbid the int4 value mix's AVX512-VBMI byte permutes in
    later plans; True if they are now in use (never on a CPU without them).  For tests:
    both ways give the same results."""

def set_isa(name: str) -> None:
    """Route all later calls to the kernels of ``name`` (caller has checked support)."""

def current_isa() -> str: ...
@overload
def vector_exp(x: npt.NDArray[_Float]) -> npt.NDArray[_Float]:
    """exp of a contiguous float32/float64 array through the current path's vector exp."""

@overload
def vector_exp(x: npt.ArrayLike) -> _FloatArray: ...
def quantize_rows(x: npt.NDArray[np.float32], code: int
                  ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]: ...
def store_token(code: int, k: npt.NDArray[Any], v: npt.NDArray[Any], keys: npt.NDArray[Any],
                values: npt.NDArray[Any], key_scales: npt.NDArray[Any] | None,
                value_scales: npt.NDArray[Any] | None, h0: int, slot: int) -> bool: ...
def openmp_enabled() -> bool: ...
def openmp_version() -> int: ...
def omp_max_threads() -> int: ...
def openmp_entry_address() -> int:
    """Address of omp_get_max_threads as this extension bound it (0 without OpenMP)."""

def set_blas(sgemm: int, dgemm: int) -> None:
    """Use these Fortran-style sgemm/dgemm (e.g. SciPy's cython_blas) for projection tiles."""

def has_blas() -> bool: ...
def waited_again(now: float) -> bool:
    """Notes that a split call waited for absent threads at ``now`` (seconds); True when
    another did less than AGAIN_SECONDS before (the calls then plan as contended)."""

def waited_for_absent_threads(start: float, worked: float, end: float) -> bool:
    """Whether a split call's calling thread, busy from ``start`` to ``worked``, then
    waited until ``end`` for threads that had no core."""

def threads_for_call(requested: int, active_calls: int) -> int:
    """Threads one of ``active_calls`` simultaneous calls gets from a budget of ``requested``."""

def explain_linear(m: int, k: int, n: int, num_threads: int, itemsize: int = ...,
                   weight_format: str = ..., grouped: bool = ...) -> dict[str, Any]:
    """The plan of :func:`linear` for these sizes, as a dict."""

def linear(x: _FloatArray, w: np.ndarray, bias: _FloatArray | None, out: _FloatArray,
           num_threads: int, check_signals: bool = ..., w_fmt: int = ...,
           scales: np.ndarray | None = ..., group: int = ...) -> None:
    """out (m, n) = x (m, k) @ w (k, n) (+ bias), rows contiguous; w of x's dtype or
    stored in format w_fmt (int8 with scales per group of rows, its values in the
    kernels' blocked order: Int8Weight's storage)."""
def register_int8_weight(cls: type) -> None:
    """Tell :func:`linear_plain` the Int8Weight class (manyheads.weights does, on import)."""

def linear_plain(x: Any, w: Any, bias: Any, num_threads: Any,
                 check_signals: bool | None = ...) -> np.ndarray | None:
    """x @ w + bias of a plain call of up to FEW_ROWS rows (C-contiguous float arrays,
    a weight of x's type, float16, bfloat16 or Int8Weight), or None for any other call."""
class AttentionCall:
    """One attention call: its plan (made once, at construction, by the C planner)
    and the C struct of arguments the kernels read.

    Every operand is a view whose leading axes enumerate the pairs the work items
    serve and whose last two axes are (rows, cols), in the storage the call was
    planned with (16-bit formats as uint16 bits).
    """

    def __init__(self, float64: bool, shape: tuple[int, int, int, int, int],
                 formats: tuple[int, int, int], kv: tuple[npt.NDArray[Any], ...], gqa: int = ...,
                 mask: int = ..., weights: bool = ..., dropout: bool = ..., split: int = ...,
                 threads: int = ...) -> None:
        """shape: (query pairs, L, S, E, Ev); formats: storage codes of (q, k and v, out);
        kv: the keys and values (for their row strides); mask: 0 none, 1 shared by the
        heads, 2 per head;
        split: -1 automatic, 0 never, 1 when allowed; threads: requested."""
    @property
    def group(self) -> int:
        """Query heads one work item serves (1: none grouped)."""
    def explain(self) -> dict[str, Any]:
        """The plan as a dict of plain values."""
    def set_query(self, q: npt.NDArray[Any], n_batch: int) -> None:
        """Queries (.., L, E); the first ``n_batch`` axes enumerate the pairs."""

    def set_keys_values(self, k: npt.NDArray[Any], v: npt.NDArray[Any], n_batch: int,
                        k_scale: npt.NDArray[Any] | None = ...,
                        v_scale: npt.NDArray[Any] | None = ...) -> None:
        """Keys and values in the planned storage, with int8/int4 scales."""

    def set_output(self, out: npt.NDArray[Any], n_batch: int) -> None: ...
    def set_mask(self, mask: npt.NDArray[Any], n_batch: int) -> None:
        """A bool (True = may attend) or additive float mask (.., L, S); strides may be 0."""

    def set_causal(self, offset: int, window: int = ...) -> None:
        """Query i sees keys j <= i + offset (and j > i + offset - window if window > 0)."""

    def set_scale(self, scale: float) -> None: ...
    def set_softcap(self, cap: float) -> None: ...
    def set_alibi(self, slopes: npt.NDArray[Any], n_batch: int) -> None: ...
    def set_sinks(self, sinks: npt.NDArray[Any], n_batch: int) -> None: ...
    def set_lse(self, lse: npt.NDArray[np.float32], n_batch: int) -> None: ...
    def set_dropout(self, p: float, seed: int) -> None: ...
    def set_weights(self, weights: _FloatArray) -> None:
        """Dense (pairs, L, S) C-contiguous zeros, filled with the attention weights."""

    def run(self, check_signals: bool = ...) -> None:
        """Run the plan's work items on its threads (``check_signals``: stop and raise
        on Ctrl-C)."""

def attend_plain(query: object, key: object, value: object, scale: object, causal: bool,
                 num_threads: object, check_signals: bool | None = ...) -> np.ndarray | None:
    """A plain attention call's output, or None when it is not the simplest case."""

def set_thread_settings(setting: int, serial: bool, most: int) -> None: ...
def default_threads() -> int: ...
def call_threads(n: object) -> int: ...
def on_main_thread() -> bool: ...
def after_fork_in_child() -> None: ...

def attend_heads(query: object, key: object, value: object, out: object, fmt: int,
                 scale: object, causal: bool, window: int, threads: int,
                 check_signals: bool) -> bool:
    """A decoding-sized call on PyTorch-laid-out heads written into ``out``; False when
    it is not a call this takes (nothing done)."""

def gather_int8_columns(blocked: npt.NDArray[np.int8], scales: npt.NDArray[np.float32], k: int,
                        group: int, cols: npt.NDArray[np.intp],
                        out: npt.NDArray[np.float32]) -> None:
    """out[i] = column cols[i] of a (k, n) int8 weight in the kernels' blocked order,
    times its scales."""

def rms_norm_rows(x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32], eps: float,
                  out: npt.NDArray[np.float32]) -> None:
    """out = x / sqrt(mean(x**2, -1) + eps) * weight, row by row."""

def rotate_heads(x: npt.NDArray[np.float32], cos: npt.NDArray[np.float32],
                 sin: npt.NDArray[np.float32]) -> None:
    """Rotate float32 x (B, H, T, D) in place (rotate_half layout on 2 * n features)."""

def gated_mul(gu: npt.NDArray[np.float32], out: npt.NDArray[np.float32],
              gelu: bool = False) -> None:
    """out = act(g) * u for the halves (g, u) of each row of gu (m, 2 F); out (m, F);
    act SiLU, or GELU's tanh form with ``gelu``."""

def clamped_gated_mul(gu: npt.NDArray[np.float32], out: npt.NDArray[np.float32],
                      alpha: float, limit: float) -> None:
    """out = gpt-oss's clamped SwiGLU of the halves (g, u) of each row of gu (m, 2 F)."""

def clear_contended() -> None:
    """Forget threads found without a core: the next calls plan as on free cores."""

def contended() -> bool:
    """Whether threads were found without a core less than CONTENDED_SECONDS ago."""

class DecodeProgram:
    """One decoding step of a Llama-shaped decoder, compiled into phases of one region."""
    def __init__(self, n_layers: int, num_threads: int) -> None: ...
    def set_layer(self, i: int, dims: tuple[int, ...], eps: float, buffers: tuple[Any, ...],
                  norms: tuple[Any, ...], products: tuple[Any, ...],
                  gelu: bool = False) -> None:
        """Layer i's sizes, buffers, norms and products."""
    def run(self, calls: list[Any], angles: list[Any], slots: list[int],
            caches: list[Any]) -> int:
        """One token through every layer; how often the first thread waited over 1 ms."""
    @property
    def overflowed(self) -> bool:
        """Whether the last run found a key or value its float16 cache cannot hold."""

def read_sum(data: npt.NDArray[np.float32], num_threads: int) -> float:
    """Sum of data, read in contiguous runs on manyheads' threads (a read-rate measure)."""
