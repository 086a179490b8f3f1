"""KV cache for incremental (token-by-token) decoding.

A :class:`KVCache` keeps the keys and values of every token a module has seen,
per key/value head, so each new token's query attends to them without
recomputing their projections.  New queries are aligned to the end of the
keys: the query at absolute position p sees keys 0..p (and only the last
``window`` of them with a sliding window).

Layout: ``keys`` and ``values`` are (batch, kv_heads, capacity, head_dim)
arrays in the storage format; the kernels read them in place and widen them to
float32 block by block (there is never a widened copy of the cache).  With a
sliding window the capacity is the window and the cache is a ring buffer:
position p lives in slot p % capacity.  ``padding`` (batch, capacity) marks
keys that are padding (True), for batches of left-padded prompts.

Storage formats (``dtype=``), for a float32 module unless noted; the error is
the relative RMS of the attention output for unit-normal keys and values,
measured by ``tests/test_cache_formats.py``:

* float32 / float64 - the module's own type, exact;
* float16, ``ml_dtypes.bfloat16`` - half the bytes (rounded once, when appended);
* ``"int8"`` - a quarter of the bytes plus one float32 scale per (token, kv head):
  symmetric, value = q * scale with scale = max|x| / 127.  Chosen over groups of
  32 channels because the error is nearly the same (0.8% against 0.7% for
  unit-normal data) while one scale per row is the cheapest to apply;
* ``"int4"`` - two values per byte plus (scale, minimum) float16 pairs per group
  of 32 channels: asymmetric, value = q * scale + minimum (about 10% error:
  for long contexts where memory is the limit; float16 pairs keep it under
  0.16 of a float32 cache's bytes, their rounding adds nothing measurable).

Keys and values are quantised once, when they are appended.

Make one with ``module.new_cache(batch_size, max_len, dtype=None)``; pass it as
``module(x_new, cache=cache)``.  A cache is not safe to share between threads
that call a module at the same time (see docs/guarantees.md).
"""
from __future__ import annotations

import math
import operator
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import _config, _core, _formats, _kernels
from ._validate import (ScoreFeatures, as_float_array, check_bool, check_int,
                        check_factor, check_optional_int, check_optional_real,
                        check_score_features)

__all__ = ["KVCache", "CacheStep", "FORMATS", "StorageFormat", "quantize", "dequantize"]

#: the storage formats, by name: manyheads._formats' table (csrc/mh_formats.h)
FORMATS = _formats.FORMATS
StorageFormat = _formats.StorageFormat
I4_GROUP = _formats.FORMATS["int4"].group  # channels per (scale, minimum) pair of an int4 cache


def quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(stored values, scales or None) of float array x (..., D) in storage format ``fmt``.

    The formats and their layouts are ``manyheads._formats.FORMATS``.  int8:
    symmetric per row, float32 scales (..., 1).  int4: asymmetric per group of
    32 channels, two values per byte (channel 2c in the low nibble), float16
    scales (..., 2 * D/32) as (scale, minimum) pairs.  A row holding NaN or inf
    comes back as NaN when widened.
    """
    f = _formats.by_name(fmt)
    if not f.quantized:
        return x.astype(f.dtype), None
    # int8: scale = max|x| / 127, q = rint(x / scale) clipped to +-127; int4 per group:
    # step = (max - min) / 15, q = rint((x - min) / step) clipped to [0, 15]; a zero
    # scale or step divides by 1 (written in C, once per appended row)
    if f.group and x.shape[-1] % f.group:
        raise ValueError(f"{f.name} rows must hold a multiple of {f.group} values, "
                         f"not {x.shape[-1]}")
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    q, scales = _kernels.quantize_rows(rows, f.code)
    return q.reshape(x.shape[:-1] + q.shape[-1:]), scales.reshape(x.shape[:-1] + scales.shape[-1:])


def dequantize(q: np.ndarray, scales: np.ndarray | None, fmt: str) -> np.ndarray:
    """The float32 values the kernels read from stored values (the inverse of :func:`quantize`)."""
    f = _formats.by_name(fmt)
    if not f.quantized:
        return q.astype(np.float64 if f.name == "float64" else np.float32)
    assert scales is not None
    if f.scales == "row":
        widened: np.ndarray = q.astype(np.float32) * scales
        return widened
    nib = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float32)
    nib[..., 0::2], nib[..., 1::2] = q & 15, q >> 4
    assert f.group is not None
    groups = 2 * q.shape[-1] // f.group  # (given, not -1: a reshape of no rows cannot infer it)
    pairs = scales.astype(np.float32).reshape(scales.shape[:-1] + (groups, 2))
    g = nib.reshape(nib.shape[:-1] + (groups, f.group))
    return (g * pairs[..., 0:1] + pairs[..., 1:2]).reshape(nib.shape)


class _Stored(NamedTuple):
    """Stored keys and values of some slots, with their int8/int4 scales (else None)."""

    k: Any
    v: Any
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None


def _zeros_together(shapes: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
    """Zero arrays of these (shape, dtype)s, each on a 64-byte boundary of one buffer.

    NumPy asks the system for huge pages for an allocation from 4 MB (as
    :class:`~manyheads.weights.WeightArena` relies on), so a cache's scale rows, a
    quarter of its keys' bytes or less, share the huge pages of its keys and values
    instead of sitting on small pages of their own.  Layers stepped in turn (12 heads,
    L = 16384, 256 MiB of caches, 2 threads, an AMD EPYC, one process): an int4 step
    took 0.96-0.97x the time, int8 0.97-0.99x.
    """
    sizes = [math.prod(s) * np.dtype(d).itemsize for s, d in shapes]  # (Python ints)
    offsets, end = [], 0
    for size in sizes:
        end += -end % 64
        offsets.append(end)
        end += size
    buf = np.zeros(end + 64, np.uint8)
    start = -buf.ctypes.data % 64
    return [buf[start + o:start + o + size].view(d).reshape(s)
            for o, size, (s, d) in zip(offsets, sizes, shapes)]


class KVCache:
    """Keys and values of the tokens seen so far.

    Parameters
    ----------
    batch_size : int
    max_len : int
        Most tokens the cache accepts in total (appending past it raises).
    num_kv_heads, head_dim : int
        Must match the module the cache is used with.
    dtype : float32, float64, float16, ml_dtypes.bfloat16, "int8" or "int4"
        Storage format (see the module docstring); every format but the
        module's own type serves float32 modules and is widened to float32 as
        the kernels read it.
    window : int or None
        Sliding window of the module: only the last ``window`` keys are kept.
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: Any = np.float32, *, window: int | None = None) -> None:
        batch_size = check_int(batch_size, "batch_size", 1)
        max_len = check_int(max_len, "max_len", 1)
        num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        head_dim = check_int(head_dim, "head_dim", 1)
        window = check_optional_int(window, "window", 1)
        fmt = _formats.cache_format(dtype)
        if fmt.group and head_dim % fmt.group:
            raise ValueError(f"an {fmt.name} cache needs head_dim to be a multiple of "
                             f"{fmt.group}, got {head_dim}")
        self.format = fmt.name
        self._code = fmt.code  # (the kernels' storage code)
        self.batch_size = int(batch_size)
        self.max_len = int(max_len)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.window = window
        self.capacity = self.max_len if self.window is None else min(self.max_len, self.window)
        rows = (self.batch_size, self.num_kv_heads, self.capacity)
        # the storage layout of the format's rows, allocated as zeros; int8: a float32
        # scale per stored row; int4: float16 (scale, minimum) pairs per group of
        # channels (see quantize)
        shapes = [(rows + (fmt.stored_columns(self.head_dim),), fmt.dtype)] * 2
        if fmt.scale_dtype is not None:
            shapes += [(rows + (fmt.scale_columns(self.head_dim),), fmt.scale_dtype)] * 2
        nbytes = sum(math.prod(shape) * np.dtype(d).itemsize for shape, d in shapes)
        if nbytes > np.iinfo(np.intp).max // 2:  # (past what an address space holds)
            raise ValueError(f"a cache of batch_size={batch_size}, max_len={max_len}, "
                             f"num_kv_heads={num_kv_heads} and head_dim={head_dim} would "
                             f"take {nbytes:.3g} bytes")
        parts = _zeros_together(shapes)
        self.keys: np.ndarray = parts[0]
        self.values: np.ndarray = parts[1]
        self.key_scales: np.ndarray | None = parts[2] if len(parts) > 2 else None
        self.value_scales: np.ndarray | None = parts[3] if len(parts) > 2 else None
        self.padding: np.ndarray = np.zeros((self.batch_size, self.capacity), dtype=bool)
        self._len = 0
        # False only while no slot of `padding` is True, the slots past the tokens
        # included: a step that writes padding sets it first (CacheStep.attend), so a
        # decoding step without padding need not clear its new slot
        self._any_padding = False
        # each row's padding tokens, those a wrapped ring has overwritten included
        self._padded = np.zeros(self.batch_size, dtype=np.intp)
        self._busy = threading.Lock()
        # the thread whose model call holds the cache for all its layers (hold_caches), 0:
        # none; that call's own steps then go through without taking the lock again
        self._holder = 0
        # the last decoding steps' attention calls, for the next token (_decode_into)
        self._calls: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    @property
    def dtype(self) -> Any:
        """The storage format as given to ``new_cache``: a numpy dtype, or "int8"/"int4"."""
        return self.format if _formats.FORMATS[self.format].quantized else self.keys.dtype

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype of the queries, keys and values that go in (float32 but for float64)."""
        return np.dtype(np.float64 if self.format == "float64" else np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes held: keys, values and (int8/int4) their scales."""
        scales = 0 if self.key_scales is None or self.value_scales is None else \
            self.key_scales.nbytes + self.value_scales.nbytes
        return int(self.keys.nbytes + self.values.nbytes + scales)

    def __len__(self) -> int:
        """Number of tokens appended so far."""
        return self._len

    def __repr__(self) -> str:
        w = f", window={self.window}" if self.window is not None else ""
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.format}{w}, len={self._len})")

    def reset(self) -> None:
        """Forget every token (the storage is kept); always possible, also after a
        sliding-window cache has wrapped around."""
        with self._holding():
            self._len = 0
            self.padding[:] = False
            self._any_padding = False
            self._padded[:] = 0

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` tokens (speculative decoding, beam search).

        A sliding-window cache can roll back only while it has not wrapped
        around: once the ring buffer has overwritten a position, the tokens
        before it are gone.
        """
        n = check_int(n, "n", 0)
        if n > self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} tokens to {n}")
        if n < self._len and self._len > self.capacity:
            raise ValueError(f"this sliding-window cache has wrapped around (it keeps the last "
                             f"{self.capacity} of {self._len} tokens) and cannot roll back")
        with self._holding():
            self._len = n
            if self._any_padding:  # (else no slot is padding: nothing to clear or look at)
                self.padding[:, n:] = False
                if self._len <= self.capacity:  # (a wrapped ring keeps its count: n = len)
                    self._padded = self.padding[:, :n].sum(axis=1, dtype=np.intp)
                # (padding overwritten by a ring still counts: rows' positions then differ)
                self._any_padding = bool(self.padding[:, :n].any() or self._padded.any())

    def copy(self) -> KVCache:
        """An independent cache with the same tokens (to branch decoding from one prompt)."""
        stored = ("keys", "values", "key_scales", "value_scales")
        with self._holding():
            state = {name: value.copy() if isinstance(value, np.ndarray) else value
                     for name, value in vars(self).items()
                     if name not in ("_busy", "_calls") and name not in stored}
            # (together, as the original's: see _zeros_together)
            held = {n: getattr(self, n) for n in stored if getattr(self, n) is not None}
            twins = _zeros_together([(a.shape, a.dtype) for a in held.values()])
            state.update(dict.fromkeys(stored))
            for (name, a), twin_a in zip(held.items(), twins):
                twin_a[...] = a
                state[name] = twin_a
        twin = KVCache.__new__(KVCache)
        twin.__setstate__(state)
        return twin

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        return self.copy()

    def __getstate__(self) -> dict[str, Any]:
        with self._holding():
            state = dict(vars(self))
        del state["_busy"]
        state.pop("_calls", None)
        state.pop("_holder", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_padded" not in state:  # (a cache pickled before it was kept; a wrapped
            # ring's overwritten padding is not known then)
            self._padded = self.padding[:, :min(self._len, self.capacity)].sum(
                axis=1, dtype=np.intp)
        self._busy = threading.Lock()
        self._holder = 0
        self._calls = {}

    def _holding(self) -> _Held:
        """The cache's lock for one operation (RuntimeError if another holds it)."""
        return _Held(self)

    def attend(self, query: Any, key: Any, value: Any, *, key_padding_mask: Any = None,
               scale: float | None = None, softcap: float | None = None, sinks: Any = None,
               alibi_slopes: Any = None, return_lse: bool = False,
               return_weights: bool = False, num_threads: int | None = None) -> Any:
        """Append ``key``/``value`` for the new tokens and attend ``query`` over the whole cache.

        The functional side of the cache, for blocks with their own projections
        (or their own rotary embeddings): the split-key decode and the cache's
        storage type come along.  New queries are aligned to the end of the
        keys: the query of absolute position p sees keys 0..p (the last
        ``window`` of them with a sliding window).

        Parameters
        ----------
        query : ndarray, shape (B, Hq, T, D)
            Hq a multiple of the cache's kv heads (grouped queries share them).
        key, value : ndarray, shape (B, Hkv, T, D)
            The new tokens' keys and values; the cache's length grows by T.
        key_padding_mask : bool array (B, T), optional
            True marks padding tokens among the new ones (never attended to).
        scale : float, optional
            Defaults to ``1 / sqrt(D)``.
        softcap, sinks, alibi_slopes, return_lse
            As in :func:`manyheads.scaled_dot_product_attention`; ALiBi measures
            distances between absolute positions (the query of position p and
            the key of position j are p - j apart).
        return_weights : bool
            Also return the weights, shape (B, Hq, T, S) over the S keys attended.
        num_threads : int, optional

        Returns
        -------
        out : ndarray, shape (B, Hq, T, D)
        weights : ndarray, with ``return_weights=True``
        lse : ndarray, shape (B, Hq, T), float32, with ``return_lse=True``
        """
        q = as_float_array(query, "query")
        k = as_float_array(key, "key")
        v = as_float_array(value, "value")
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        for name, arr in (("key", k), ("value", v)):
            if arr.ndim != 4 or arr.shape[0] != B or arr.shape[1] != Hkv or arr.shape[3] != D:
                raise ValueError(f"{name} must have shape (batch={B}, kv_heads={Hkv}, tokens, "
                                 f"head_dim={D}), got {arr.shape}")
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(f"key and value must have the same tokens, got {k.shape} and "
                             f"{v.shape}")
        if q.ndim != 4 or q.shape[0] != B or q.shape[2] != T or q.shape[3] != D or \
                q.shape[1] % Hkv or not q.shape[1]:
            raise ValueError(f"query must have shape (batch={B}, heads (a positive multiple "
                             f"of {Hkv}), tokens={T}, head_dim={D}), got {q.shape}")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"query, key and value must share one dtype; got {q.dtype}, "
                            f"{k.dtype}, {v.dtype}")
        compute = self.compute_dtype
        if q.dtype != compute:
            raise TypeError(f"a {self.dtype} cache takes {compute} queries, keys and values, "
                            f"got {q.dtype}")
        pad = None
        if key_padding_mask is not None:
            pad = np.asarray(key_padding_mask)
            if pad.dtype != np.bool_ or pad.shape != (B, T):
                raise ValueError(f"key_padding_mask must be a bool array of shape {(B, T)}, "
                                 f"got {pad.dtype} {pad.shape}")
        s = check_factor(check_optional_real(scale, "scale"), "scale", self.compute_dtype)
        rw = check_bool(return_weights, "return_weights")
        features = check_score_features(q, softcap, sinks, alibi_slopes, return_lse)
        nt = _config.resolve_num_threads(num_threads)
        if self._len + T > self.max_len:
            raise ValueError(f"cache is full: {self._len} tokens + {T} new > "
                             f"max_len={self.max_len}")
        scale_ = 1.0 / math.sqrt(D) if s is None else s
        with self.step(T, pad) as step:
            return step.attend(q, k, v, scale=scale_, num_threads=nt, return_weights=rw,
                               features=features)

    # -- storage -------------------------------------------------------------------------
    def _converted(self, k: np.ndarray, v: np.ndarray
                   ) -> tuple[tuple[np.ndarray, np.ndarray | None], ...]:
        """(stored, scales) of new keys and values in the cache's format (``quantize``);
        ValueError, before anything is stored, where a finite value is beyond float16's
        range (float16) or bfloat16's (bfloat16), or a group's float16 (step, minimum)
        pair would be (int4): it would be stored as inf, and every score against it would
        be NaN."""
        if k.dtype == self.keys.dtype:  # float32/float64 caches: no conversion
            return (k, None), (v, None)
        if self.format == "int4":
            stored = quantize(k, "int4"), quantize(v, "int4")
            for name, x, (_, pairs) in zip(("key", "value"), (k, v), stored):
                assert pairs is not None
                if np.isinf(pairs).any():  # (a group holding NaN or inf has NaN pairs)
                    over = np.isinf(pairs.reshape(pairs.shape[:-1] + (-1, 2))).any(axis=-1)
                    g = x.reshape(x.shape[:-1] + (-1, I4_GROUP))[over][0]
                    raise ValueError(
                        f"an int4 cache stores each group of {I4_GROUP} channels as a float16 "
                        f"minimum (at most 65504) and step (largest - minimum) / 15, so a "
                        f"group needs its minimum at -65504 or above and its step at 65504 "
                        f"or below; a new {name} has a group from {float(g.min()):.6g} to "
                        f"{float(g.max()):.6g}; use an int8, bfloat16 or float32 cache")
            return stored
        if self.format == "bfloat16":
            top, limit = _formats.BF16_MAX, _formats.BF16_ROUNDS_TO_INF
            for name, x in (("key", k), ("value", v)):
                mag = _formats.largest_beyond(x, limit)
                if mag is not None:
                    raise ValueError(
                        f"a bfloat16 cache holds values up to {top:.6g} in magnitude "
                        f"(float32 values from {limit:.6g} round to inf), and a "
                        f"new {name} has magnitude {mag:.6g}; use a float32 cache")
        if self.format != "float16":
            return quantize(k, self.format), quantize(v, self.format)
        try:
            with np.errstate(over="raise"):  # (a cast that overflows sets the flag)
                return quantize(k, self.format), quantize(v, self.format)
        except FloatingPointError:
            big = max((float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0)), name)
                      for name, x in (("key", k), ("value", v)))
            raise ValueError(
                f"a float16 cache holds values up to 65504 in magnitude, and a new {big[1]} has "
                f"magnitude {big[0]:.6g}; use a bfloat16, int8 or float32 cache") from None

    def _store(self, heads: slice, slots: Any, k: np.ndarray, v: np.ndarray) -> None:
        """Quantise (B, h, n, D) keys and values into the slots of kv heads ``heads``."""
        for data, scales, (stored, s) in zip((self.keys, self.values),
                                             (self.key_scales, self.value_scales),
                                             self._converted(k, v)):
            data[:, heads, slots] = stored
            if scales is not None:
                scales[:, heads, slots] = s

    def _stored(self, heads: slice, slots: Any) -> _Stored:
        """Keys and values of the slots and (int8/int4) their scales, as stored."""
        arrays = (self.keys, self.values, self.key_scales, self.value_scales)
        if isinstance(slots, slice):
            return _Stored(*(None if a is None else a[:, heads, slots] for a in arrays))
        return _Stored(*(None if a is None else a[:, heads][:, :, slots] for a in arrays))

    # -- the modules' side ---------------------------------------------------------------
    def check_compatible(self, *, batch: int, num_kv_heads: int, head_dim: int,
                         dtype: np.dtype, window: int | None, new_tokens: int) -> None:
        """ValueError/TypeError unless a module with these properties may append here."""
        if (self.num_kv_heads, self.head_dim) != (num_kv_heads, head_dim):
            raise ValueError(
                f"cache holds {self.num_kv_heads} kv heads of size {self.head_dim}; the module "
                f"needs {num_kv_heads} of size {head_dim}: make the cache with module.new_cache()"
            )
        if self.batch_size != batch:
            raise ValueError(f"cache was made for batch_size={self.batch_size}, x has batch {batch}")
        if self.window != window:
            raise ValueError(f"cache window {self.window} differs from the module's window {window}")
        if self.compute_dtype != dtype:
            raise TypeError(f"a {dtype} module cannot use a {self.format} cache (float32 and "
                            f"float64 caches serve modules of their own type, the other "
                            f"formats float32 modules)")
        if self._len + new_tokens > self.max_len:
            raise ValueError(
                f"cache is full: {self._len} tokens + {new_tokens} new > max_len={self.max_len}"
            )

    def _decode_attend(self, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, *,
                       scale: float, softcap: float | None, num_threads: int,
                       out: np.ndarray, sinks: np.ndarray | None = None) -> bool:
        """A module's decoding step without padding: append one token's keys and values
        (B, Hkv, 1, D) and write its queries' (B, Hq, 1, D) attention over everything
        cached into ``out``, as :meth:`CacheStep.attend` does, with less per-call work
        (:func:`manyheads._core.decode_call`, kept for the next token).  False, with
        nothing changed, when the cache holds padding (the general step takes it)."""
        if self._any_padding or k_new.shape[2] != 1:
            return False
        with _Held(self):  # (the module has checked the room: check_compatible)
            self._decode_into(q, k_new, v_new, scale=scale, softcap=softcap,
                              num_threads=num_threads, out=out, sinks=sinks)
            self._len += 1
        return True

    def _decode_into(self, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                     heads: slice = slice(None), *, scale: float, softcap: float | None,
                     num_threads: int, out: np.ndarray,
                     sinks: np.ndarray | None = None) -> None:
        """The body of :meth:`_decode_attend`, the cache held and without padding: store
        one token's keys and values of kv heads ``heads``, write its queries' attention
        (with ``sinks``, float32 (Hq,), those sink logits) into ``out``; the length is
        the caller's to advance."""
        slot, n, offset, window = self._decode_slot()
        # (in C where it can: the general store's conversion, checks and temporaries
        # cost a quantised cache's step some 10 us)
        h0, h1, every = heads.indices(self.num_kv_heads)
        if every != 1 or k_new.shape[1] != h1 - h0 or not _kernels.store_token(
                self._code, k_new, v_new, self.keys, self.values, self.key_scales,
                self.value_scales, h0, slot):
            self._store(heads, slice(slot, slot + 1), k_new, v_new)
        # the last step's call over the same arrays with the same settings, planned again
        # for one key more (as the compiled model step does): building a call and the
        # views of the stored rows took some 5 us of a step
        arrays = (self.keys, self.values, self.key_scales, self.value_scales)
        key = (h0, h1, q.shape, q.strides, out.shape, out.strides, scale, softcap,
               num_threads) if sinks is None and every == 1 and q.flags.aligned else None
        last = self._calls.pop(key, None) if key is not None else None
        st = None
        if last is not None and all(map(operator.is_, last[1], arrays)) and \
                last[0].retarget(n, offset, window or 0):
            call = last[0]
            _core.decode_rebind(call, q, out)
        else:
            st = self._stored(heads, slice(0, n))
            call = _core.decode_call(q, st.k, st.v, st.k_scale, st.v_scale, scale=scale,
                                     causal_offset=offset, window=window, softcap=softcap,
                                     num_threads=num_threads, out=out, sinks=sinks)
        if call is not None:
            if key is not None:
                if len(self._calls) >= 64:  # (a stack's heads: a call each)
                    self._calls.clear()
                self._calls[key] = (call, arrays)
            call.run(_core._on_main_thread())
        else:  # (no call was planned, so st holds the stored rows' views)
            assert st is not None
            features = None if softcap is None and sinks is None else \
                (softcap, sinks, None, False)
            _core.attention(q, st.k, st.v, k_scale=st.k_scale, v_scale=st.v_scale,
                            causal_offset=offset, window=window, scale=scale,
                            num_threads=num_threads, out=out,
                            enable_gqa=q.shape[1] != st.k.shape[1], features=features)

    def _decode_slot(self) -> tuple[int, int, int | None, int | None]:
        """Where one more token goes and what it attends: (its slot, the slots attended
        from the first, the causal offset, the window), as :meth:`CacheStep.attend`
        lays out a step of one token."""
        past, cap = self._len, self.capacity
        if past < cap:  # slot == position; the query sees the window's keys
            return past, past + 1, past, self.window
        return past % cap, cap, None, None  # a full ring: exactly the query's window

    def step(self, new_tokens: int, key_padding_mask: np.ndarray | None = None) -> CacheStep:
        """Hold the cache for one decoding step that appends ``new_tokens`` tokens.

        Use it as ``with cache.step(n) as step:``.  Inside,
        :meth:`~manyheads.cache.CacheStep.attend` appends keys and values (per group of
        kv heads) and attends over everything cached; when the block ends
        without an exception the cache's length advances by ``new_tokens``.
        A second caller while a step is open gets RuntimeError.
        """
        return CacheStep(self, new_tokens, key_padding_mask)


IN_USE = ("KVCache is in use by another call: a cache belongs to one decoding stream "
          "(give each thread its own cache)")


def take(cache: KVCache) -> bool:
    """Take ``cache``'s lock for a call: True, to be released; False when this thread's
    model call holds it for all its layers (:func:`hold_caches`); RuntimeError when
    another call holds it."""
    if cache._busy.acquire(blocking=False):
        return True
    if cache._holder == threading.get_ident():
        return False
    raise RuntimeError(IN_USE)


class hold_caches:
    """Holds every cache of a model's call for the whole call (a ``with`` block): its
    length is read, its tokens appended and, if the call fails, taken back under the
    lock, so that a call from another thread gets RuntimeError and cannot see or
    change the caches in between (the layers' own steps go through)."""

    __slots__ = ("caches", "held")

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = caches
        self.held: list[KVCache] = []

    def __enter__(self) -> None:
        me, held = threading.get_ident(), self.held
        for c in self.caches:
            if c._busy.acquire(False):
                c._holder = me
                held.append(c)
            elif not (c._holder == me and c in held):  # (a list may name a cache twice)
                self.__exit__()
                raise RuntimeError(IN_USE)

    def __exit__(self, *exc: object) -> None:
        for c in self.held:
            c._holder = 0
            c._busy.release()
        self.held.clear()


class _Held:
    """Holds a cache's lock for a ``with`` block (a plain class: a generator-based
    context manager costs microseconds a decoding step need not pay)."""

    __slots__ = ("cache", "took")

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.took = False

    def __enter__(self) -> None:
        self.took = take(self.cache)

    def __exit__(self, *exc: object) -> None:
        if self.took:
            self.cache._busy.release()


class CacheStep:
    """One open step of a :class:`~manyheads.KVCache` (see :meth:`manyheads.KVCache.step`)."""

    def __init__(self, cache: KVCache, new_tokens: int, pad_new: np.ndarray | None) -> None:
        self.cache = cache
        self.new_tokens = new_tokens
        self.pad_new = pad_new
        self.start = cache._len  # absolute position of the first new token
        self.took = False  # whether __enter__ took the lock (see take)
        self._ring_padding: np.ndarray | None = None  # see attend

    def __enter__(self) -> CacheStep:
        c = self.cache
        self.took = take(c)
        if c._len + self.new_tokens > c.max_len:  # (checked before, but in another call
            # from another thread the room may have gone since)
            if self.took:
                c._busy.release()
            raise ValueError(f"cache is full: {c._len} tokens + {self.new_tokens} new > "
                             f"max_len={c.max_len}")
        self.start = c._len
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        c = self.cache
        try:
            if exc_type is None:
                c._len += self.new_tokens
                if self.pad_new is not None and self.pad_new.any():
                    c._any_padding = True
                    c._padded += self.pad_new.sum(axis=1, dtype=np.intp)
        finally:
            if self.took:
                c._busy.release()

    def attend(self, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
               heads: slice = slice(None), *, scale: float, num_threads: int,
               out: np.ndarray | None = None, return_weights: bool = False,
               dropout_p: float = 0.0, seed: int = 0,
               features: ScoreFeatures | None = None) -> Any:
        """Attend q (B, Hq, T, D) to the cached keys plus the T new ones of kv heads ``heads``.

        Writes the new keys, values and padding into the cache; the length
        advances when the step ends.  ``features`` as in ``_core.attention``.
        """
        c, pad_new = self.cache, self.pad_new
        T = k_new.shape[2]
        if T == 1 and pad_new is None and not c._any_padding and not return_weights and \
                dropout_p == 0 and (features is None or (features[1] is None and
                                                         features[2] is None and
                                                         not features[3])):
            # one token, no padding, no weights and no score feature but a soft cap (a
            # module's or KVCache.attend's decoding step; a stack's, one head at a time):
            # the lean step, the same bits with less layout work per call
            if out is None:
                out = np.empty(q.shape, q.dtype)
            c._decode_into(q, k_new, v_new, heads, scale=scale, softcap=None
                           if features is None else features[0], num_threads=num_threads,
                           out=out)
            return out
        past, cap = c._len, c.capacity
        kw: dict[str, Any] = dict(scale=scale, num_threads=num_threads, out=out,
                                  return_weights=return_weights, dropout_p=dropout_p, seed=seed,
                                  enable_gqa=q.shape[1] != c.keys[:, heads].shape[1])
        if features is not None:
            kw["features"] = features
        alibi = None if features is None else features[2]
        any_pad = c._any_padding or (pad_new is not None and bool(pad_new.any()))
        if any_pad:  # (before the padding is written: see KVCache._any_padding)
            c._any_padding = True
        if past + T <= cap:
            # no wrap: slot == position
            c._store(heads, slice(past, past + T), k_new, v_new)
            c.padding[:, past:past + T] = False if pad_new is None else pad_new
            n = past + T
            mask = ~c.padding[:, None, None, :n] if any_pad else None
            st = c._stored(heads, slice(0, n))
            return _core.attention(q, st.k, st.v, k_scale=st.k_scale, v_scale=st.v_scale,
                                   mask=mask, causal_offset=past, window=c.window, **kw)
        assert c.window is not None  # only a windowed cache is smaller than max_len
        if T == 1 and alibi is None:  # (ALiBi needs the keys in position order: below)
            # the ring holds exactly the window of the new query: every slot is visible
            slot = past % cap
            c._store(heads, slice(slot, slot + 1), k_new, v_new)
            c.padding[:, slot] = False if pad_new is None else pad_new[:, 0]
            mask = ~c.padding[:, None, None, :] if any_pad else None
            st = c._stored(heads, slice(None))
            res = _core.attention(q, st.k, st.v, k_scale=st.k_scale, v_scale=st.v_scale,
                                  mask=mask, causal_offset=None, **kw)
            if not return_weights:
                return res
            # the weights in the keys' position order, as every other step gives them:
            # the oldest key (position past + 1 - cap) is in slot (past + 1) % cap
            return (res[0], np.roll(res[1], -((past + 1) % cap), axis=-1)) + tuple(res[2:])
        # several new tokens past the window: lay the old window out in order, then attend
        n_old = min(past, cap - 1)
        old = np.arange(past - n_old, past) % cap
        (new_k, new_ks), (new_v, new_vs) = c._converted(k_new, v_new)
        st = _Stored(*(None if a is None or b is None else np.concatenate([a, b], axis=2)
                       for a, b in zip(c._stored(heads, old), (new_k, new_v, new_ks, new_vs))))
        # (the old slots' padding as the step found it: a stack's heads attend one at a
        # time, and the first one's new tokens overwrite slots the next ones still read)
        if self._ring_padding is None:
            self._ring_padding = c.padding[:, old].copy()
        Pc = np.concatenate([self._ring_padding, np.zeros((c.padding.shape[0], T), bool)
                             if pad_new is None else pad_new], axis=1)
        assert st.k is not None and st.v is not None
        res = _core.attention(q, st.k, st.v, k_scale=st.k_scale, v_scale=st.v_scale,
                              mask=~Pc[:, None, None, :] if any_pad else None,
                              causal_offset=n_old, window=c.window, **kw)
        keep = min(T, cap)
        slots = np.arange(past + T - keep, past + T) % cap
        c._store(heads, slots, k_new[:, :, T - keep:], v_new[:, :, T - keep:])
        c.padding[:, slots] = False if pad_new is None else pad_new[:, T - keep:]
        return res
