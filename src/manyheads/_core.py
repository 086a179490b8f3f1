"""The checked-input core: turns NumPy arrays into one kernel call.

Everything here trusts its arguments (the public entry points in
``functional``, ``modules`` and ``cache`` have checked them).  Its job is to
fold batch broadcasting, grouped-query head sharing and arbitrary strides into
one offset table per operand, since the kernels address every operand as
``base + offset[pair] + row * row_stride + col``, and to fill a
``_kernels.AttentionCall`` through its named setters.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np

from . import _blas, _kernels
from ._validate import dtype_name

__all__ = ["attention", "linear", "apply_rope", "rope_tables", "kernel_ready", "SPLIT_KEYS"]

# keys per range in the split-key schedule; fixed, so results never depend on the thread count
SPLIT_KEYS = 512


def kernel_ready(arr: np.ndarray, contiguous_rows: bool = True) -> np.ndarray:
    """The array itself when the kernels can read it through strides, else a copy.

    The kernels need an aligned buffer, strides that are whole elements and
    (except for masks) a contiguous last axis; transposed or sliced views
    usually qualify.  Call this before broadcasting, so a copy stays small.
    """
    flags = arr.flags  # a new flags object on every access: read it once
    if flags.c_contiguous and flags.aligned:
        return arr
    item = arr.itemsize
    ok = flags.aligned and not any(s % item for s in arr.strides)
    if ok and contiguous_rows and arr.ndim and arr.shape[-1] > 1 and arr.strides[-1] != item:
        ok = False
    # a fresh copy: ascontiguousarray would hand back a contiguous but misaligned array
    return arr if ok else np.array(arr, order="C", copy=True)


def broadcast_shapes(names: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The common shape of ``shapes``; ValueError naming ``names`` if they do not broadcast."""
    if all(s == shapes[0] for s in shapes[1:]):
        return tuple(shapes[0])
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(
            f"batch dimensions of {names} do not broadcast: " + ", ".join(str(s) for s in shapes)
        ) from None


def _broadcast(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return arr if arr.shape == shape else np.broadcast_to(arr, shape)


def _pair_views(q: np.ndarray, kvs: tuple[np.ndarray, ...], enable_gqa: bool
                ) -> tuple[tuple[int, ...], np.ndarray, list[np.ndarray], int]:
    """Batch shape (.., Hq) and views of q and the key-side arrays ``kvs`` (keys, values
    and any per-row scales) with one (rows, cols) matrix per pair.

    With grouped-query attention, kv head h // group serves query head h: the
    key-side arrays become (.., Hkv, group, S, x) broadcast views.  Returns the
    batch shape, q's view, the key-side views and their number of leading axes.
    """
    L, E = q.shape[-2:]
    if enable_gqa:
        hq, hkv = q.shape[-3], kvs[0].shape[-3]
        outer = broadcast_shapes("query, key and value", q.shape[:-3],
                                 *(a.shape[:-3] for a in kvs))
        batch = outer + (hq,)
        kv_shape = outer + (hkv, hq // hkv)
        views = [np.broadcast_to(a[..., :, None, :, :], kv_shape + a.shape[-2:]) for a in kvs]
        return batch, _broadcast(q, batch + (L, E)), views, len(kv_shape)
    batch = broadcast_shapes("query, key and value", q.shape[:-2],
                             *(a.shape[:-2] for a in kvs))
    return (batch, _broadcast(q, batch + (L, E)),
            [_broadcast(a, batch + a.shape[-2:]) for a in kvs], len(batch))


_STORAGE_BY_DTYPE = {"float16": "float16", "bfloat16": "bfloat16", "int8": "int8",
                     "uint8": "int4"}


def _decode_group(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None,
                  return_weights: bool, dropout_p: float) -> int:
    """Query heads per kv head to serve together under grouped-query attention
    (1: no grouping).

    Decode with grouped queries (a few query rows, each kv head shared by
    several query heads) reads every key and value once for all the heads that
    share it, when nothing differs between those heads but their queries: no
    weights, no dropout, a mask (if any) the same for every head.
    """
    if return_weights or dropout_p > 0:
        return 1
    group = int(q.shape[-3] // k.shape[-3])
    L = q.shape[-2]
    if group < 2 or L > _kernels.FEW_ROWS or group * L > _kernels.BLOCK_Q:
        return 1
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] != 1:
        return 1
    return group


def _split_axis(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    """A view of ``a`` with axis ``axis`` (length m * n) split into (m, n)."""
    axis %= a.ndim
    shape = a.shape[:axis] + (a.shape[axis] // n, n) + a.shape[axis + 1:]
    strides = a.strides[:axis] + (a.strides[axis] * n, a.strides[axis]) + a.strides[axis + 1:]
    return np.lib.stride_tricks.as_strided(a, shape, strides, writeable=a.flags.writeable)


def _grouped_views(q: np.ndarray, kvs: tuple[np.ndarray, ...], group: int
                   ) -> tuple[tuple[int, ...], np.ndarray, list[np.ndarray], int]:
    """Batch shape (.., kv heads, group), q as (.., kv heads, group, L, E) and the key-side
    arrays as (.., kv heads, S, x), for a grouped call; the last is the key side's
    number of batch axes."""
    L, E = q.shape[-2:]
    hkv = kvs[0].shape[-3]
    outer = broadcast_shapes("query, key and value", q.shape[:-3], *(a.shape[:-3] for a in kvs))
    qv = _split_axis(_broadcast(q, outer + (hkv * group, L, E)), -3, group)
    views = [_broadcast(a, outer + a.shape[-3:]) for a in kvs]
    return outer + (hkv, group), qv, views, len(outer) + 1


def storage_format(k: np.ndarray) -> str:
    """The kernels' name for the storage of keys/values of dtype ``k.dtype``."""
    return _STORAGE_BY_DTYPE.get(dtype_name(k.dtype), "native")


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    num_threads: int,
    mask: np.ndarray | None = None,
    causal_offset: int | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    enable_gqa: bool = False,
    return_weights: bool = False,
    out: np.ndarray | None = None,
    split: bool | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> Any:
    """softmax(q kᵀ scale + mask) v over checked (..., L|S, E) arrays.

    ``causal_offset=c`` lets query ``i`` see keys ``j <= i + c`` (None: no
    causal mask); ``window=W`` (with a causal offset) also hides keys more
    than W-1 positions back.  ``out``, if given, is a writable view of the
    output shape (it may be strided, e.g. the merged-heads layout of a fused
    module).  With q float32, k and v may be stored as float16, bfloat16, int8
    (with per-row float32 ``k_scale``/``v_scale`` (.., S, 1)) or int4 (uint8
    bytes (.., S, E/2), with float16 (scale, min) pairs per group of 32
    channels (.., S, 2 * E/32)); see ``KVCache``.  q, k and v may also all be
    float16 or ``ml_dtypes.bfloat16``: the kernels then compute in float32 (the
    avx512bf16 path with bfloat16 pair dot products for bfloat16), read q as it
    is and round the output to q's type as they write it; weights come back
    float32.  ``split`` forces (True) or forbids
    (False) the split-key schedule; by default it serves a few query rows
    against many keys.  Returns the output, or ``(output, weights)`` with
    ``return_weights``.
    """
    q_fmt = storage_format(q)  # a 16-bit q ("float16", "bfloat16"): float32 inside
    compute = np.dtype(np.float32) if q_fmt != "native" else q.dtype
    fmt = "native" if k.dtype == compute else storage_format(k)
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2], v.shape[-1] * (2 if fmt == "int4" else 1)
    q = kernel_ready(q)
    if fmt in ("float16", "bfloat16"):
        k, v = k.view(np.uint16), v.view(np.uint16)
    kvs: tuple[np.ndarray, ...] = (kernel_ready(k), kernel_ready(v))
    if k_scale is not None and v_scale is not None:  # int4: float16 pairs, read as bits
        kvs += tuple(kernel_ready(a.view(np.uint16) if a.dtype == np.float16 else a)
                     for a in (k_scale, v_scale))
    group = _decode_group(q, kvs[0], mask, return_weights, dropout_p) if enable_gqa else 1
    if group > 1:  # each kv head read once for the query heads that share it
        batch, qv, kv_views, n_kv_batch = _grouped_views(q, kvs, group)
        nb = n_kv_batch + 1  # q and out: (.., kv heads, group, L, x)
        mask_batch = batch[:-1]
    elif not enable_gqa and len(kvs) == 2 and \
            kvs[0].shape[:-2] == q.shape[:-2] == kvs[1].shape[:-2]:
        # the common case, kept off the function call: nothing to broadcast
        batch, qv, kv_views, n_kv_batch = q.shape[:-2], q, list(kvs), q.ndim - 2
    else:
        batch, qv, kv_views, n_kv_batch = _pair_views(q, kvs, enable_gqa)
    if group == 1:
        nb = len(batch)
        mask_batch = batch
    # the (.., query heads) batch the caller sees (grouped: (.., kv heads, group) inside)
    heads_batch = batch if group == 1 else batch[:-2] + (batch[-2] * group,)
    mv = None
    if mask is not None:
        mask = kernel_ready(mask, contiguous_rows=False)
        try:
            # grouped: the mask's head axis (1) broadcasts over the kv heads
            mv = _broadcast(mask, mask_batch + (L, S))
        except ValueError:
            raise ValueError(
                f"attn_mask of shape {mask.shape} does not broadcast to "
                f"{heads_batch + (L, S)}"
            ) from None

    if out is None:
        out = np.empty(heads_batch + (L, Ev), dtype=q.dtype)
    out_fmt = storage_format(out)  # a 16-bit output: rounded as it is written
    weights = np.zeros(batch + (L, S), dtype=compute) if return_weights else None
    n_pairs = math.prod(batch) if group == 1 else math.prod(batch[:-1])
    if n_pairs and L and (S == 0 or Ev == 0):
        out[...] = 0
    if n_pairs and L and S and Ev:
        call = _kernels.AttentionCall(compute == np.float64, n_pairs, L, S, E, Ev, group)
        call.set_query(qv.view(np.uint16) if q_fmt != "native" else qv, nb, q_fmt)
        scales = kv_views[2:] if len(kv_views) == 4 else (None, None)
        call.set_keys_values(kv_views[0], kv_views[1], n_kv_batch, fmt, scales[0], scales[1])
        ov = out.view(np.uint16) if out_fmt != "native" else out
        call.set_output(ov if group == 1 else _split_axis(ov, -3, group), nb, out_fmt)
        if mv is not None:
            call.set_mask(mv, n_kv_batch if group > 1 else nb)
        if causal_offset is not None:
            call.set_causal(int(causal_offset), 0 if window is None else int(window))
        call.set_scale(float(scale))
        if dropout_p > 0:
            call.set_dropout(float(dropout_p), int(seed))
        if weights is not None:
            call.set_weights(weights)
        if split is None:
            split = L <= _kernels.FEW_ROWS and S >= 2 * SPLIT_KEYS
        split = bool(split) and weights is None and dropout_p == 0 and L <= _kernels.BLOCK_Q
        call.run(int(num_threads), SPLIT_KEYS if split else 0, _on_main_thread())
    return (out, weights) if return_weights else out


_MAIN_THREAD_ID = threading.main_thread().ident


def _on_main_thread() -> bool:
    """Only the main thread receives signals: its long calls look for Ctrl-C."""
    return threading.get_ident() == _MAIN_THREAD_ID


def _rows_ready(a: np.ndarray) -> np.ndarray:
    """``a`` (2-D) itself if its rows are contiguous and aligned, else a contiguous copy."""
    if a.flags.aligned and (a.shape[1] <= 1 or a.strides[1] == a.itemsize) and \
            a.strides[0] % a.itemsize == 0 and a.strides[0] >= a.shape[1] * a.itemsize:
        return a
    return np.array(a, order="C", copy=True)


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, num_threads: int
           ) -> np.ndarray:
    """``x @ w + bias`` for x (..., k), w (k, n), bias (n,) or None, one float dtype.

    Runs on manyheads' threads: a few rows (decode) through the kernels' own
    memory-bound product, more rows as BLAS tiles (see ``_blas``).  The result
    is the same bits for any thread count.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows_ready(x.reshape(-1, k))
    w2 = _rows_ready(w)
    n = w2.shape[1]
    out = np.empty((x2.shape[0], n), dtype=x2.dtype)
    b = bias if bias is None or bias.flags.c_contiguous else np.ascontiguousarray(bias)
    if x2.shape[0] <= _kernels.FEW_ROWS:  # the kernels' own product, no BLAS
        _kernels.linear(x2, w2, b, out, int(num_threads), _on_main_thread())
    elif _blas.available():
        with _blas.single_threaded():
            _kernels.linear(x2, w2, b, out, int(num_threads), _on_main_thread())
    else:
        np.matmul(x2, w2, out=out)
        if b is not None:
            out += b
    return out.reshape(lead + (n,))


@functools.lru_cache(maxsize=32)
def rope_tables(theta: float, head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (length, head_dim // 2) float32, of the rotary angles p * theta^(-2i/D).

    The angles are computed in float64 and rounded once: Hugging Face's
    models form them in float32, whose rounding at position p is about
    p * 2^-24 radians; the two agree to that.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def apply_rope(x: np.ndarray, theta: float, start: int) -> None:
    """Rotate x (..., T, D) in place by positions start .. start+T-1 (``rotate_half`` layout).

    Each head's two halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin),
    Hugging Face's ``apply_rotary_pos_emb``.  x may be a strided view (the
    query or key columns of a packed projection).
    """
    T, D = x.shape[-2:]
    half = D // 2
    length = 1 << max(10, (start + T - 1).bit_length())  # tables grow in powers of two
    cos, sin = rope_tables(float(theta), D, length)
    c, s = cos[start:start + T], sin[start:start + T]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    r1 = x1 * c - x2 * s
    x2 *= c
    x2 += x1 * s
    x1[...] = r1
