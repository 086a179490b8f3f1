"""Projection weights in their own precision: float16, bfloat16 and int8.

:func:`manyheads.linear` reads a weight ``(in_features, out_features)`` stored as
float32, float64, float16, bfloat16 (``ml_dtypes.bfloat16``) or as an
:class:`Int8Weight`, in place: the kernels widen each vector of weights as they load
it, so a half-precision weight is read at half the bytes of float32 and an int8
weight at about a quarter.  :func:`convert_weight` makes any of them from a float
array; the model runner uses it for ``from_pretrained(..., weight_dtype=...)``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _formats, _kernels
from ._validate import dtype_name

__all__ = ["Int8Weight", "WEIGHT_DTYPES", "convert_weight", "weight_format", "join_columns",
           "gather_columns"]

WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "int8")
# float types ml_dtypes adds (NumPy's kind "V"), which quantize widens like any float
_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


class Int8Weight:
    """A weight ``(k, n)`` quantised to int8 with float32 scales, symmetric.

    ``value[i, j] = data[i, j] * scales[i // group_size, j]``: one scale per output
    column (``group_size`` = k, PyTorch's per-channel quantisation) or per group of
    ``group_size`` input rows and output column (llama.cpp's Q8_0 uses groups of 32
    along the input).  Build one with :meth:`quantize`.

    The values are held in the order the kernels stream them (passes of eight input
    rows, each pass one contiguous run of blocks of 16 output columns, a block's rows in
    pairs side by side), made once at construction; :attr:`data` gives them back in
    (k, n) order.

    Attributes
    ----------
    data : ndarray of int8, shape (k, n)
    scales : ndarray of float32, shape (ceil(k / group_size), n)
    group_size : int
    """

    __slots__ = ("_blocked", "_scales", "_group_size", "_shape")

    def __init__(self, data: np.ndarray, scales: np.ndarray, group_size: int) -> None:
        if not isinstance(data, np.ndarray) or data.dtype != np.int8 or data.ndim != 2:
            raise TypeError("data must be a 2-D int8 array (in_features, out_features)")
        k, n = data.shape
        self._check(k, n, scales, group_size)
        self._blocked = _blocked_empty(k, n)
        _place_columns(self._blocked, 0, data)
        self._scales = np.ascontiguousarray(scales)
        self._group_size = int(group_size)
        self._shape = (int(k), int(n))

    @staticmethod
    def _check(k: int, n: int, scales: Any, group_size: Any) -> None:
        if (not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool)
                or not 1 <= group_size <= max(k, 1)):
            raise ValueError(f"group_size must be an int in [1, {max(k, 1)}], got {group_size!r}")
        groups = -(-k // int(group_size))
        if (not isinstance(scales, np.ndarray) or scales.dtype != np.float32
                or not scales.dtype.isnative or scales.shape != (groups, n)):
            raise TypeError(f"scales must be a float32 array of shape ({groups}, {n})")

    @classmethod
    def _from_blocked(cls, blocked: np.ndarray, shape: tuple[int, int], scales: np.ndarray,
                      group_size: int) -> "Int8Weight":
        """One of shape (k, n) made of values already in the kernels' order
        (:func:`_blocked_empty`, :func:`_place_columns`)."""
        self = cls.__new__(cls)
        cls._check(shape[0], shape[1], scales, group_size)
        self._blocked, self._scales = blocked, np.ascontiguousarray(scales)
        self._group_size, self._shape = int(group_size), (int(shape[0]), int(shape[1]))
        return self

    # read-only: the kernels trust that data, scales and group_size agree
    @property
    def data(self) -> np.ndarray:
        """The int8 values, (in_features, out_features): a new C-contiguous array."""
        return _columns_of(self._blocked, *self._shape, slice(None))

    @property
    def scales(self) -> np.ndarray:
        """The float32 scales, (ceil(in_features / group_size), out_features)."""
        return self._scales

    @property
    def group_size(self) -> int:
        """Input rows that share a scale (in_features: one scale per output column)."""
        return self._group_size

    @classmethod
    def quantize(cls, w: Any, group_size: int | None = None) -> "Int8Weight":
        """``w`` (k, n) rounded to int8 with scale ``max|w| / 127`` per output column
        (``group_size`` None) or per group of ``group_size`` rows and column."""
        a = np.asarray(w)
        if a.ndim != 2 or not (a.dtype.kind == "f" or a.dtype.name in _ML_FLOATS):
            raise TypeError(f"w must be a 2-D float array, got {a.dtype} of shape {a.shape}")
        k, n = a.shape
        g = max(k, 1) if group_size is None else group_size
        if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or not 1 <= g <= max(k, 1):
            raise ValueError(f"group_size must be None or an int in [1, {k}], got {group_size!r}")
        g = max(int(g), 1)
        check_storable(a, "int8")
        data, scales = _quantized(a, g)
        return cls(data, scales, g)

    @property
    def shape(self) -> tuple[int, int]:
        """(in_features, out_features)."""
        return self._shape

    @property
    def nbytes(self) -> int:
        """Bytes held: the int8 values (in_features padded to a multiple of 8,
        out_features to a multiple of 16) and their scales."""
        return int(self._blocked.nbytes + self.scales.nbytes)

    def dequantize(self) -> np.ndarray:
        """The float32 weight these values and scales stand for."""
        return self.columns(slice(None))

    def columns(self, cols: Any) -> np.ndarray:
        """Columns ``cols`` (an index or slice of the output axis) as float32, (k, len)."""
        scales = np.repeat(self.scales[:, cols], self.group_size, axis=0)[: self.shape[0]]
        out: np.ndarray = _columns_of(self._blocked, *self._shape, cols).astype(np.float32) * scales
        return out

    def _column_rows(self, ids: np.ndarray) -> np.ndarray:
        """Columns ``ids`` (an integer array, checked) as float32 rows, ids.shape + (k,):
        the embedding rows of tokens, one gather with no (k, len) intermediate."""
        k, n = self._shape
        c = np.ascontiguousarray(ids, dtype=np.intp).reshape(-1)
        if c.size and c.min() < 0:
            c = np.where(c < 0, c + n, c)
        out = np.empty((c.size, k), np.float32)
        _kernels.gather_int8_columns(self._blocked, self._scales, k, self._group_size, c, out)
        return out.reshape(ids.shape + (k,))

    def __repr__(self) -> str:
        k, n = self.shape
        return f"Int8Weight(shape=({k}, {n}), group_size={self.group_size})"


_kernels.register_int8_weight(Int8Weight)  # its parts, read by linear_plain


def _quantized(a: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """``a`` (k, n) as int8 values (k, n) and float32 scales (ceil(k / g), n), symmetric,
    ``max|a| / 127`` per group of ``g`` rows and column."""
    k, n = a.shape
    groups = -(-k // g)
    data = np.empty((k, n), np.int8)
    scales = np.empty((groups, n), np.float32)
    for i in range(groups):
        # one float32 copy of the group, worked on in place: a loader quantises slice
        # after slice, and each temporary of the size of a slice that the allocator
        # handed out and took back stayed resident (1 MB more at the peak of loading a
        # 25 MB int8 model in one run of three, and the peak moved from run to run)
        q = a[i * g:(i + 1) * g].astype(np.float32)
        amax = np.maximum(q.max(axis=0), -q.min(axis=0))  # (NaN propagates, as max|q|)
        scale = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            # (float32's largest value over 127 rounds up: 127 times it would be inf, so
            # the scale goes one float lower, as the int8 cache's does)
            over = np.isinf(np.float32(127) * scale) & np.isfinite(scale)
            scale[over] = np.nextafter(scale[over], np.float32(0))
            inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
            tiny = np.isinf(inv)  # (a scale below about 3e-39: divided by, not inverted)
            small = q[:, tiny] / scale[tiny] if tiny.any() else None
            q *= inv
            if small is not None:
                q[:, tiny] = small
        # (a group holding NaN or inf has a NaN or inf scale: its values are NaN anyway)
        q[~np.isfinite(q)] = 0
        np.rint(q, out=q)
        np.clip(q, -127, 127, out=q)
        data[i * g:(i + 1) * g] = q
        scales[i] = scale
    return data, scales


# The kernels' order of int8 weight values (csrc/mh_kernels.h, mh_linear_index): the
# rows in passes of _PASS (k padded with zero rows to a multiple of _PASS), a pass's
# columns in blocks of _BLOCK (n padded with zero columns to a multiple of _BLOCK), a
# block's rows in pairs, a pair's columns side by side, the even row's value first.
_PASS, _BLOCK = 8, 16


def _blocked_empty(k: int, n: int, arena: WeightArena | None = None) -> np.ndarray:
    """Zeroed storage for a (k, n) int8 weight in the kernels' order: (k, n) padded
    (in ``arena`` if one is given)."""
    shape = (-(-k // _PASS) * _PASS, -(-n // _BLOCK) * _BLOCK)
    if arena is None:
        return np.zeros(shape, np.int8)
    out = arena.empty(shape, np.int8)
    out[...] = 0
    return out


class WeightArena:
    """Storage for a model's weights, side by side in blocks of :attr:`BLOCK` bytes.

    Decoding reads every weight once a token, a few MB at a time.  Weights of a few
    MB each held apart sit on the system's small pages: each page begins with a
    translation miss and the hardware prefetchers stop at its end.  NumPy asks the
    system for huge pages from 4 MB, so a block of this arena gets them (where the
    system grants them on request, as Linux does by default), and weights of a few
    MB packed into it share them.  A block is only address space until written, so
    its unused end costs no memory; few blocks leave few part-used huge pages (32 MB
    blocks held 24 MiB more for a float32 SmolLM2-135M).  A weight larger than a
    quarter of a block gets an array of its own.  Measured on a SmolLM2-shaped
    model, 2 threads, an AMD EPYC, alternating token by token in one process against
    the same weights held apart: 1.04-1.05x the tokens/s with int8 weights,
    1.03-1.04x with bfloat16, 1.00-1.01x with float32 (whose gate and up
    projections were on huge pages already); peak memory unchanged.
    """

    BLOCK = 256 << 20

    def __init__(self) -> None:
        self._block: np.ndarray | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array on a 64-byte boundary (a cache line)."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if n > self.BLOCK // 4:
            return np.empty(shape, dt)
        block = self._block
        # the first free byte at a 64-byte address (the block's address + _used, rounded)
        start = 0 if block is None else self._used + (-(block.ctypes.data + self._used) % 64)
        if block is None or start + n > block.nbytes:
            try:
                block = self._block = np.empty(self.BLOCK + 64, np.uint8)
            except MemoryError:  # (address space refused, as under strict overcommit)
                return np.empty(shape, dt)
            start = -block.ctypes.data % 64
        self._used = start + n
        out: np.ndarray = block[start:start + n].view(dt).reshape(shape)
        return out


def _blocked_view(blocked: np.ndarray) -> np.ndarray:
    """Blocked storage as (pass, column block, pair of rows, column, row of the pair)."""
    rows, width = blocked.shape
    return blocked.reshape(rows // _PASS, width // _BLOCK, _PASS // 2, _BLOCK, 2)


def _place_columns(blocked: np.ndarray, c0: int, part: np.ndarray) -> None:
    """Write ``part`` (k, m) as columns [c0, c0 + m) of blocked storage; c0 is a multiple
    of 16, and so is m unless the columns end the weight."""
    k, m = part.shape
    rows = blocked.shape[0]
    part = np.pad(part, ((0, rows - k), (0, -m % _BLOCK)))
    b0, b1 = c0 // _BLOCK, (c0 + part.shape[1]) // _BLOCK
    _blocked_view(blocked)[:, b0:b1] = part.reshape(
        rows // _PASS, _PASS // 2, 2, b1 - b0, _BLOCK).transpose(0, 3, 1, 4, 2)


def _columns_of(blocked: np.ndarray, k: int, n: int, cols: Any) -> np.ndarray:
    """Columns ``cols`` (an index, slice or integer array of the n columns) of blocked
    storage of a (k, n) weight as int8, (k,) + the shape of ``cols``'s result."""
    rows, width = blocked.shape
    if isinstance(cols, slice) and cols == slice(None):
        out = _blocked_view(blocked).transpose(0, 2, 4, 1, 3).reshape(rows, width)
        return np.ascontiguousarray(out[:k, :n])
    c = np.arange(n)[cols]
    kk = np.arange(k).reshape((k,) + (1,) * c.ndim)
    index = (kk // _PASS * _PASS * width + c // _BLOCK * (_PASS * _BLOCK)
             + kk % _PASS // 2 * (2 * _BLOCK) + c % _BLOCK * 2 + kk % 2)
    values: np.ndarray = blocked.reshape(-1)[index]
    return values


def weight_format(w: Any) -> str:
    """The storage of a weight :func:`manyheads.linear` reads: float32, float64,
    float16, bfloat16 or int8; TypeError for anything else."""
    if isinstance(w, Int8Weight):
        return "int8"
    dt = getattr(w, "dtype", None)
    name = dtype_name(w.dtype) if isinstance(w, np.ndarray) else None
    if name in ("float32", "float64", "float16", "bfloat16"):
        if not w.dtype.isnative:
            raise TypeError(f"weight must be in the machine's byte order, got {w.dtype.str}; "
                            "convert it with weight.astype(weight.dtype.newbyteorder('='))")
        return str(name)
    raise TypeError("weight must be an ndarray of float32, float64, float16 or "
                    f"ml_dtypes.bfloat16, or an Int8Weight; got {type(w).__name__}"
                    + (f" of dtype {dt}" if dt is not None else ""))


def check_storable(a: np.ndarray, dtype: str, what: str = "w") -> None:
    """ValueError where ``a`` stored as ``dtype`` would not stand for it: a finite value
    that rounds to inf in float16 or bfloat16, or (int8) a value that is not finite or
    (float64) beyond float32's range, whose float32 scale would make every value of its
    column (or group) NaN."""
    if a.dtype.name == dtype:
        return
    if dtype in ("float16", "bfloat16"):
        top, limit = (_formats.F16_MAX, _formats.F16_ROUNDS_TO_INF) if dtype == "float16" \
            else (_formats.BF16_MAX, _formats.BF16_ROUNDS_TO_INF)
        mag = _formats.largest_beyond(a, limit)
        if mag is not None:
            raise ValueError(f"a {dtype} weight holds values up to {top:.6g} in magnitude, "
                             f"and {what} has one of {mag:.6g}, which would be inf; keep "
                             f"it in float32" + (" or bfloat16" if dtype == "float16" else ""))
    elif dtype == "int8" and a.size and not np.isfinite(a).all():
        raise ValueError(f"an int8 weight needs finite values (a NaN or inf would make its "
                         f"column's scale, and every value of the column, NaN), and {what} "
                         f"holds {a[~np.isfinite(a)].flat[0]}; keep it in a float format")
    elif dtype == "int8" and a.dtype.itemsize > 4:
        mag = _formats.largest_beyond(a, _formats.F32_ROUNDS_TO_INF)
        if mag is not None:
            raise ValueError(f"an int8 weight's scales are float32, and {what} has a value of "
                             f"{mag:.6g}, beyond float32's range (its column's scale, and "
                             f"every value of the column, would be NaN); scale it down")


def convert_weight(w: Any, dtype: str, group_size: int | None = None) -> Any:
    """``w`` (k, n) stored as ``dtype``: 'float32', 'bfloat16', 'float16' (ndarrays,
    rounded to nearest even) or 'int8' (an :class:`Int8Weight`, per-column scales or
    groups of ``group_size`` rows).  ValueError where a value cannot be stored so
    (:func:`check_storable`)."""
    if not isinstance(dtype, str) or dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(map(repr, WEIGHT_DTYPES))} "
                         f"(a string), got {dtype!r}")
    if dtype == "int8":
        return Int8Weight.quantize(w, group_size)
    if group_size is not None:
        raise ValueError(f"group_size applies to int8 weights only; a {dtype} weight has "
                         "no scales (leave group_size None)")
    target = _formats.FORMATS[dtype].dtype
    a = np.asarray(w)
    if a.dtype == target:
        return np.ascontiguousarray(a)
    check_storable(a, dtype)
    return np.ascontiguousarray(a.astype(target))


def join_columns(parts: list[Any], arena: WeightArena | None = None) -> Any:
    """Weights (k, n_i) side by side: (k, sum n_i), as stored (in ``arena`` if one is
    given).  Float weights of different formats (a checkpoint whose q, k and v were
    saved in different precisions, read in their own) are joined as float32 (float64
    if one is), which holds each exactly."""
    if not parts:
        raise ValueError("join_columns needs at least one weight to join, got none")
    if all(isinstance(p, Int8Weight) for p in parts):
        groups = {p.group_size for p in parts}
        ks = {p.shape[0] for p in parts}
        if len(groups) != 1 or len(ks) != 1:
            raise ValueError("int8 weights joined side by side need one group size and "
                             "one number of rows")
        k, group = ks.pop(), groups.pop()
        scales = np.concatenate([p.scales for p in parts], axis=1)
        n = sum(p.shape[1] for p in parts)
        if k and all(p.shape[1] % _BLOCK == 0 for p in parts[:-1]):
            # a pass of the join is the parts' passes side by side: no unblocking
            passes = -(-k // _PASS)
            runs = [p._blocked.reshape(passes, -1) for p in parts]
            width = sum(r.shape[1] for r in runs)
            blocked = np.concatenate(runs, axis=1, out=None if arena is None else
                                     arena.empty((passes, width), np.int8))
            return Int8Weight._from_blocked(blocked.reshape(passes * _PASS, -1), (k, n),
                                            scales, group)
        return Int8Weight(np.concatenate([p.data for p in parts], axis=1), scales, group)
    formats = {weight_format(p) for p in parts}
    if "int8" in formats and len(formats) > 1:
        raise TypeError("int8 weights can only be joined side by side with int8 weights")
    if len(formats) > 1:
        wide = np.float64 if "float64" in formats else np.float32
        parts = [np.asarray(p, dtype=wide) for p in parts]
    if arena is None or not parts:
        return np.concatenate(parts, axis=1)
    shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))
    return np.concatenate(parts, axis=1, out=arena.empty(shape, parts[0].dtype))


def gather_columns(w: Any, ids: Any) -> np.ndarray:
    """Columns ``ids`` (integers, any shape) of weight ``w`` (k, n) as float32, shape
    ids.shape + (k,): rows of an embedding table held as (d, vocab) columns."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got an array of {ids.dtype}")
    n = w.shape[1]
    if ids.size and (ids.min() < -n or ids.max() >= n):
        raise IndexError(f"index out of range for {n} columns")
    if isinstance(w, Int8Weight):
        return w._column_rows(ids)
    return np.ascontiguousarray(w.T[ids], dtype=np.float32)
