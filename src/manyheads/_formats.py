"""Storage formats: how the elements of a query, key, value or output array are stored.

The table has one definition, ``MH_STORAGE_LIST`` in ``csrc/mh_formats.h``:
the C enum the kernels switch on is generated from it, and so is this module's
:data:`FORMATS`, read from the extension at import.  Everything on the Python
side derives from :data:`FORMATS`: what a KV cache allocates, what
:func:`manyheads.cache.quantize` and ``dequantize`` do, the kernel call's
storage codes, the formats named in error messages and the benchmark's lists.

(name, stored dtype, C code, bits per element, scales, group) per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _kernels

__all__ = ["StorageFormat", "FORMATS", "CACHE_FORMATS_TEXT", "by_name", "of_dtype", "cache_format"]

# csrc/mh_formats.h, enum mh_scales
_SCALE_LAYOUTS = {0: "none", 1: "row", 2: "group pairs"}


@dataclass(frozen=True, slots=True)
class StorageFormat:
    """One row of the table.

    ``scales`` is ``"none"``, ``"row"`` (one float32 scale per stored row: value =
    q * scale) or ``"group pairs"`` (one (scale, min) pair of float16 per ``group``
    channels: value = q * scale + min).
    """

    name: str
    dtype_name: str  # NumPy dtype of the stored elements
    code: int  # the C storage code (enum mh_storage)
    bits: int  # bits per element
    scales: str
    group: int  # channels that share one scale entry; 0: the whole row

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of the stored elements (bfloat16 needs ml_dtypes)."""
        dt: np.dtype = np.dtype(_bfloat16() if self.dtype_name == "bfloat16" else self.dtype_name)
        return dt

    @property
    def quantized(self) -> bool:
        """Values stored with scales (int8, int4)."""
        return self.scales != "none"

    @property
    def scale_dtype(self) -> np.dtype | None:
        """The NumPy dtype of the scales (None without scales)."""
        return {"none": None, "row": np.dtype(np.float32),
                "group pairs": np.dtype(np.float16)}[self.scales]

    def stored_columns(self, d: int) -> int:
        """Columns of the stored array for rows of ``d`` values (int4: two per byte)."""
        return d * self.bits // (8 * self.dtype.itemsize)

    def scale_columns(self, d: int) -> int:
        """Scale entries per stored row of ``d`` values (pairs count twice)."""
        if self.scales == "row":
            return 1
        if self.scales == "group pairs":
            return 2 * (d // self.group)
        return 0

    def row_bytes(self, d: int) -> int:
        """Bytes of one stored row of ``d`` values, scales included."""
        scales = self.scale_columns(d) * (self.scale_dtype.itemsize if self.scale_dtype else 0)
        return d * self.bits // 8 + scales


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bfloat16 storage needs ml_dtypes: pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


FORMATS: dict[str, StorageFormat] = {
    name: StorageFormat(name, dtype, int(code), int(bits), _SCALE_LAYOUTS[int(scales)], int(group))
    for name, dtype, code, bits, scales, group in _kernels.storage_table()
}

# formats of float arrays the kernels read, by NumPy dtype name
_BY_DTYPE = {f.dtype_name: f for f in FORMATS.values() if not f.quantized}
# the stored arrays of quantised keys and values, by NumPy dtype name
_QUANTIZED_BY_DTYPE = {f.dtype_name: f for f in FORMATS.values() if f.quantized}


def _names_text(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


CACHE_FORMATS_TEXT = _names_text([
    "ml_dtypes.bfloat16 (or 'bfloat16')" if f.name == "bfloat16"
    else (f"'{f.name}'" if f.quantized else f.name)
    for f in FORMATS.values()])


def by_name(name: str) -> StorageFormat:
    """The format called ``name``; ValueError naming the formats otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"storage format must be one of {', '.join(FORMATS)}, "
                         f"not {name!r}") from None


def of_dtype(dtype_name: str, quantized: bool = False) -> StorageFormat | None:
    """The format of an array of dtype ``dtype_name``: a float format, or with
    ``quantized`` the stored values of a quantised format (int8, uint8 for int4)."""
    return (_QUANTIZED_BY_DTYPE if quantized else _BY_DTYPE).get(dtype_name)


def cache_format(dtype: Any) -> StorageFormat:
    """The format of what ``new_cache(dtype=...)`` accepts: a float dtype, or a name."""
    if isinstance(dtype, str) and dtype in FORMATS:
        return FORMATS[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    fmt = None if dt is None else _BY_DTYPE.get(str(dt.name))
    if fmt is None:
        raise TypeError(f"cache dtype must be one of {CACHE_FORMATS_TEXT}, got {dtype!r}")
    return fmt


#: the largest finite bfloat16, and the smallest float32 that rounds to bfloat16's inf
#: (halfway between the two, a tie, rounds to the even one: inf); float16's likewise
BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))
BF16_ROUNDS_TO_INF = float(np.uint32(0x7F7F8000).view(np.float32))
F16_MAX, F16_ROUNDS_TO_INF = 65504.0, 65520.0
# the float64 magnitude from which a value rounds to inf in float32 (2^128 - 2^103)
F32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103


def largest_beyond(x: np.ndarray, limit: float) -> float | None:
    """The largest finite magnitude of x if it is ``limit`` or more, else None (one pass
    for each extreme, NaN and inf ignored, in the usual case)."""
    if x.size == 0:
        return None
    top, bottom = float(np.fmax.reduce(x, axis=None)), float(np.fmin.reduce(x, axis=None))
    if limit <= top < math.inf or -math.inf < bottom <= -limit:
        return max(top if top < math.inf else 0.0, -bottom if bottom > -math.inf else 0.0)
    if top < math.inf and bottom > -math.inf:
        return None
    mags = np.abs(x[np.isfinite(x)])  # (an inf hides the finite extremes: look again)
    big = float(mags.max(initial=0.0))
    return big if big >= limit else None
