"""Type stub for the compiled Cython extension ``manyheads._kernels`` (see _kernels.pyx)."""
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

_Float = TypeVar("_Float", np.float32, np.float64)

ISA_NAMES: tuple[str, str, str]
BLOCK_Q: int
BLOCK_K: int
DOT_ROWS: int
MASK_NONE: int
MASK_BOOL: int
MASK_ADD: int

def isa_compiled(name: str) -> bool:
    """True if the build contains the kernels for ISA ``name``."""

def cpu_supports(name: str) -> bool:
    """True if this CPU and OS can run the kernels for ISA ``name``."""

def set_isa(name: str) -> None:
    """Route all later calls to the kernels of ``name`` (caller has checked support)."""

@overload
def vector_exp(x: npt.NDArray[_Float]) -> npt.NDArray[_Float]:
    """exp of a contiguous float32/float64 array through the current path's vector exp."""

@overload
def vector_exp(x: npt.ArrayLike) -> npt.NDArray[np.float32] | npt.NDArray[np.float64]: ...
def current_isa() -> str: ...
def openmp_enabled() -> bool: ...
def openmp_version() -> int: ...
def omp_max_threads() -> int: ...
def batch_offsets(view: npt.NDArray[Any], n_batch: int) -> npt.NDArray[np.int64]:
    """Element offsets of every index over the first ``n_batch`` axes (C order), as int64."""

def attention_forward(
    q: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    q_off: npt.NDArray[np.int64],
    q_row: int,
    k: npt.NDArray[Any],
    k_off: npt.NDArray[np.int64],
    k_row: int,
    v: npt.NDArray[Any],
    v_off: npt.NDArray[np.int64],
    v_row: int,
    out: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    out_off: npt.NDArray[np.int64],
    out_row: int,
    mask_kind: int,
    mask: npt.NDArray[Any] | None,
    mask_off: npt.NDArray[np.int64] | None,
    mask_row: int,
    mask_col: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    v_dim: int,
    causal: bool,
    causal_offset: int,
    window: int,
    kv_half: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    weights: npt.NDArray[np.float32] | npt.NDArray[np.float64] | None,
    split_keys: int,
    num_threads: int,
) -> None:
    """Run every work item of one attention call; q and out share one float dtype.

    k and v are float32/float64 like q, or the raw bits of float16 viewed as
    uint16 when ``kv_half``; ``mask`` is bool or q's float dtype (``None`` and
    ``mask_off=None`` with ``MASK_NONE``).  Offsets are int64 tables, one entry
    per (batch, head) pair; offsets and strides are in elements.
    """
