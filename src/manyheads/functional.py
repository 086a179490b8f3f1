"""Functional attention on NumPy arrays: validation, broadcasting, dispatch.

Everything a caller can get wrong is checked here, before the kernels run;
``manyheads._kernels`` trusts what it is given.  The kernels address every
array as ``base + offset[pair] + row * row_stride + col``, so this module's
main job besides checking is to fold batch broadcasting, grouped-query head
sharing and arbitrary strides into one offset table per array.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _config, _kernels

__all__ = ["scaled_dot_product_attention", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# keys per range in the decode schedule; fixed, so results never depend on the thread count
_SPLIT_KEYS = 512
_SUPPORTED_TEXT = "float32 or float64"


def _as_float_array(x: Any, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        arr = x
    else:
        if x is None:
            raise TypeError(f"{name} must be an array of {_SUPPORTED_TEXT}, got None")
        try:
            arr = np.asarray(x)
        except Exception as exc:  # pragma: no cover - depends on foreign objects
            raise TypeError(f"{name} must be array-like, got {type(x).__name__}") from exc
        if arr.dtype.kind in "iub" and arr.dtype != np.bool_:
            arr = arr.astype(np.float64)
    if arr.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; supported dtypes are {_SUPPORTED_TEXT}"
        )
    return arr


def _kernel_ready(arr: np.ndarray, contiguous_rows: bool = True) -> np.ndarray:
    """The array itself when the kernels can read it through strides, else a copy.

    The kernels need an aligned buffer, strides that are whole elements and
    (except for masks) a contiguous last axis; transposed or sliced views
    usually qualify.  Call this before broadcasting, so a copy stays small.
    """
    if arr.flags.c_contiguous and arr.flags.aligned:
        return arr
    item = arr.itemsize
    ok = arr.flags.aligned and not any(s % item for s in arr.strides)
    if ok and contiguous_rows and arr.ndim and arr.shape[-1] > 1 and arr.strides[-1] != item:
        ok = False
    # a fresh copy: ascontiguousarray would hand back a contiguous but misaligned array
    return arr if ok else np.array(arr, order="C", copy=True)


def _offsets(view: np.ndarray, n_batch_dims: int) -> np.ndarray:
    """Element offsets of every index over the leading ``n_batch_dims`` axes, flattened."""
    return _kernels.batch_offsets(view, n_batch_dims)


def _broadcast(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return arr if arr.shape == shape else np.broadcast_to(arr, shape)


def _row_stride(view: np.ndarray, axis: int) -> int:
    return int(view.strides[axis] // view.itemsize)


def _broadcast_shapes(names: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    if all(s == shapes[0] for s in shapes[1:]):
        return tuple(shapes[0])
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(
            f"batch dimensions of {names} do not broadcast: "
            + ", ".join(str(s) for s in shapes)
        ) from None


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def _check_dropout(p: Any, name: str = "dropout_p") -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(p).__name__}")
    value = float(p)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def _seed_value(seed: Any) -> int:
    """A 64-bit dropout seed from None (fresh entropy), an int or a numpy Generator."""
    if seed is None:
        return int(np.random.default_rng().integers(0, 2**63))
    if isinstance(seed, np.random.Generator):
        return int(seed.integers(0, 2**63))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be None, an int or a numpy Generator, got {type(seed).__name__}")
    return int(seed) & (2**64 - 1)


def _check_mask(attn_mask: Any, dtype: np.dtype) -> np.ndarray:
    mask = attn_mask if isinstance(attn_mask, np.ndarray) else np.asarray(attn_mask)
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype.kind != "f" or mask.dtype.itemsize not in (2, 4, 8):
        raise TypeError(
            f"attn_mask has dtype {mask.dtype}; expected bool (True = may attend) "
            f"or a float mask ({_SUPPORTED_TEXT}) added to the scores"
        )
    return mask.astype(dtype, copy=False)


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    seed: Any = None,
    num_threads: int | None = None,
) -> Any:
    """Scaled dot-product attention with PyTorch's semantics, on NumPy arrays.

    Computes ``softmax(query @ key.T * scale + mask) @ value`` head by head
    without forming the full score matrix (unless weights are requested).

    Parameters
    ----------
    query : ndarray, shape (..., Hq, L, E)
    key : ndarray, shape (..., Hkv, S, E)
    value : ndarray, shape (..., Hkv, S, Ev)
        float32 or float64, all the same dtype.  Batch dimensions broadcast.
        Non-contiguous views are read in place when the last axis is contiguous.
    attn_mask : ndarray, optional
        Broadcastable to (..., Hq, L, S).  Boolean: True means the query may
        attend the key.  Float: added to the scaled scores.
    dropout_p : float
        Probability of zeroing each attention weight (kept weights are scaled
        by ``1 / (1 - dropout_p)``).  Applied whenever it is positive.
    is_causal : bool
        Query ``i`` sees keys ``0..i`` (PyTorch's top-left alignment).  Cannot
        be combined with ``attn_mask``.
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention: each key/value head serves ``Hq // Hkv``
        consecutive query heads.
    return_weights : bool, keyword-only
        Also return the attention weights, shape (..., Hq, L, S) (after dropout).
    seed : int, numpy Generator or None, keyword-only
        Seed of the dropout stream; ``None`` draws fresh entropy.
    num_threads : int, optional, keyword-only
        Threads for this call; defaults to :func:`manyheads.get_num_threads`.

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
    weights : ndarray, shape (..., Hq, L, S)
        Only with ``return_weights=True``.

    Notes
    -----
    A query row with every key masked gives zeros (and zero weights), never
    NaN.  Results are identical for every thread count on one kernel path.
    """
    q = _as_float_array(query, "query")
    k = _as_float_array(key, "key")
    v = _as_float_array(value, "value")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    for name, arr in (("query", q), ("key", k), ("value", v)):
        if arr.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., length, features), "
                             f"got shape {arr.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dimension (E); got query {q.shape} "
            f"and key {k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must have the same length (S, axis -2); got key {k.shape} "
            f"and value {v.shape}"
        )
    if q.shape[-1] == 0:
        raise ValueError("query and key must have a last dimension (E) of at least 1")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal and attn_mask is not None:
        raise ValueError("give either attn_mask or is_causal=True, not both")
    p = _check_dropout(dropout_p)
    s = _check_scale(scale, q.shape[-1])
    nt = _config.resolve_num_threads(num_threads)
    if enable_gqa:
        for name, arr in (("query", q), ("key", k), ("value", v)):
            if arr.ndim < 3:
                raise ValueError(f"enable_gqa=True needs a head axis (-3) in {name}, "
                                 f"got shape {arr.shape}")
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(f"key and value must have the same number of heads; "
                             f"got {k.shape[-3]} and {v.shape[-3]}")
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] != 0:
            raise ValueError(
                f"with enable_gqa the query heads ({q.shape[-3]}) must be a multiple of "
                f"the key/value heads ({k.shape[-3]})"
            )
    mask = None if attn_mask is None else _check_mask(attn_mask, q.dtype)
    seed_value = _seed_value(seed) if p > 0 else 0
    return _attention(q, k, v, mask=mask, causal_offset=0 if is_causal else None,
                      scale=s, dropout_p=p, seed=seed_value, enable_gqa=bool(enable_gqa),
                      return_weights=bool(return_weights), num_threads=nt)


def _attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    causal_offset: int | None = None,
    scale: float,
    dropout_p: float = 0.0,
    seed: int = 0,
    enable_gqa: bool = False,
    return_weights: bool = False,
    num_threads: int,
    out: np.ndarray | None = None,
    window: int | None = None,
    split: bool | None = None,
) -> Any:
    """Checked-input core shared by the functional API and the modules.

    ``causal_offset=c`` lets query ``i`` see keys ``j <= i + c`` (None: no
    causal mask).  ``out``, if given, is a writable view of the output shape
    (it may be strided, e.g. the merged-heads layout of a fused module).
    ``window=W`` (with a causal offset) also hides keys more than W-1 positions
    back.  k and v may be float16 (a KV cache) when q is float32.  ``split``
    forces (True) or forbids (False) the split-key decode schedule; by default
    it is used for a few query rows against many keys.
    """
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    kv_half = k.dtype == np.float16
    q = _kernel_ready(q)
    k = _kernel_ready(k.view(np.uint16) if kv_half else k)
    v = _kernel_ready(v.view(np.uint16) if kv_half else v)
    if mask is not None:
        mask = _kernel_ready(mask, contiguous_rows=False)
    if enable_gqa:
        hq, hkv = q.shape[-3], k.shape[-3]
        group = hq // hkv
        outer = _broadcast_shapes("query, key and value", q.shape[:-3], k.shape[:-3], v.shape[:-3])
        batch = outer + (hq,)
        qv = _broadcast(q, batch + (L, E))
        # kv head h // group serves query head h: view (.., Hkv, group, S, E)
        kv_shape = outer + (hkv, group)
        kv = np.broadcast_to(k[..., :, None, :, :], kv_shape + (S, E))
        vv = np.broadcast_to(v[..., :, None, :, :], kv_shape + (S, Ev))
        n_kv_batch = len(kv_shape)
    else:
        batch = _broadcast_shapes("query, key and value", q.shape[:-2], k.shape[:-2], v.shape[:-2])
        qv = _broadcast(q, batch + (L, E))
        kv = _broadcast(k, batch + (S, E))
        vv = _broadcast(v, batch + (S, Ev))
        n_kv_batch = len(batch)
    nb = len(batch)
    if mask is not None:
        try:
            mv = _broadcast(mask, batch + (L, S))
        except ValueError:
            raise ValueError(
                f"attn_mask of shape {mask.shape} does not broadcast to {batch + (L, S)}"
            ) from None

    if out is None:
        out = np.empty(batch + (L, Ev), dtype=q.dtype)
    weights = np.zeros(batch + (L, S), dtype=q.dtype) if return_weights else None
    n_pairs = math.prod(batch)
    if n_pairs == 0 or L == 0:
        return (out, weights) if return_weights else out
    if S == 0 or Ev == 0:
        out[...] = 0
        return (out, weights) if return_weights else out

    mask_kind, mask_arr, mask_off, mask_row, mask_col = _kernels.MASK_NONE, None, None, 0, 0
    if mask is not None:
        mask_kind = _kernels.MASK_BOOL if mv.dtype == np.bool_ else _kernels.MASK_ADD
        mask_arr, mask_off = mv, _offsets(mv, nb)
        mask_row, mask_col = _row_stride(mv, -2), _row_stride(mv, -1)

    if split is None:
        split = L <= _kernels.DOT_ROWS and S >= 2 * _SPLIT_KEYS
    split = bool(split) and weights is None and dropout_p == 0 and L <= _kernels.BLOCK_Q
    with _config.kernel_call(int(num_threads)) as call:
        _kernels.attention_forward(
            qv, _offsets(qv, nb), _row_stride(qv, -2),
            kv, _offsets(kv, n_kv_batch), _row_stride(kv, -2),
            vv, _offsets(vv, n_kv_batch), _row_stride(vv, -2),
            out, _offsets(out, nb), _row_stride(out, -2),
            mask_kind, mask_arr, mask_off, mask_row, mask_col,
            L, S, E, Ev,
            causal_offset is not None, 0 if causal_offset is None else int(causal_offset),
            0 if window is None else int(window), kv_half,
            float(scale), float(dropout_p), int(seed), weights,
            _SPLIT_KEYS if split else 0, call.threads,
        )
    return (out, weights) if return_weights else out
