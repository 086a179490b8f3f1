"""Functional attention on NumPy arrays, with PyTorch's semantics.

Everything a caller can get wrong is checked here, before the kernels run
(the rules live in ``manyheads._validate``); ``manyheads._core`` then folds
broadcasting, grouped-query head sharing and strides into one kernel call.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from . import _config, _core, _kernels
from ._core import CallPlan, ItemPlan
from .weights import Int8Weight, weight_format
from ._validate import (ATTENTION_DTYPES_TEXT, FLOAT_DTYPES,
                        as_attention_array, as_float_array, check_bool,
                        check_dropout, check_factor, check_optional_real, check_score_features,
                        is_half, seed_value)

__all__ = ["scaled_dot_product_attention", "merge_attention", "explain", "CallPlan", "ItemPlan",
           "linear", "SUPPORTED_DTYPES"]

_NUMBERS = (float, int)  # dropout_p's exact classes the plainest call takes

SUPPORTED_DTYPES = FLOAT_DTYPES


def _check_mask(attn_mask: Any, dtype: np.dtype) -> np.ndarray:
    mask = attn_mask if isinstance(attn_mask, np.ndarray) else np.asarray(attn_mask)
    if mask.dtype == np.bool_:
        return mask
    # (a mask in the other byte order: astype converts it)
    native = mask.dtype if mask.dtype.isnative else mask.dtype.newbyteorder("=")
    if not (native in FLOAT_DTYPES or is_half(native)):
        raise TypeError(
            f"attn_mask has dtype {mask.dtype}; expected bool (True = may attend) "
            f"or a float mask ({ATTENTION_DTYPES_TEXT}) added to the scores"
        )
    return mask.astype(dtype, copy=False)


def _check_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
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


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2:
        name, shape = next((n, a.shape) for n, a in (("query", q), ("key", k), ("value", v))
                           if a.ndim < 2)
        raise ValueError(f"{name} must have at least 2 dimensions (..., length, features), "
                         f"got shape {shape}")
    if qs[-1] != ks[-1]:
        raise ValueError(
            f"query and key must have the same last dimension (E); got query {qs} "
            f"and key {ks}"
        )
    if ks[-2] != vs[-2]:
        raise ValueError(
            f"key and value must have the same length (S, axis -2); got key {ks} "
            f"and value {vs}"
        )
    if qs[-1] == 0:
        raise ValueError("query and key must have a last dimension (E) of at least 1")


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
    softcap: float | None = None, sinks: Any = None, alibi_slopes: Any = None,
    return_lse: bool = False, return_weights: bool = False, seed: Any = None,
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
        float32, float64, float16 or ``ml_dtypes.bfloat16``, all the same
        dtype.  Half precision is widened as it is read and computed in
        float32 (scores, softmax statistics, output accumulator); the output
        has the input dtype.  Batch dimensions broadcast.  Non-contiguous
        views are read in place when the last axis is contiguous.
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
    softcap : float, optional, keyword-only
        Soft cap c > 0 of the scaled scores: each becomes ``c * tanh(s / c)``
        (Gemma 2, flash-attn), before the ALiBi bias and the masks.
    sinks : array-like, shape (Hq,), optional, keyword-only
        Attention sinks (gpt-oss): one logit per query head, in the units of the
        scaled scores, that joins each row's softmax denominator and has no
        value: ``softmax(cat(scores, sink))[..., :-1] @ value``.
    alibi_slopes : array-like, shape (Hq,) or (B, Hq), optional, keyword-only
        ALiBi: the bias ``-slope * |i + S - L - j|`` is added to the scaled
        scores (queries aligned to the end of the keys, as flash-attn does).
        It is computed from the slopes as the kernels go; no (L, S) bias is
        stored.
    return_lse : bool, keyword-only
        Also return the log-sum-exp (..., Hq, L), float32: the natural log of
        each row's softmax denominator, with the soft cap, the bias, the mask
        and the sink applied; -inf for a row that sees no key (and has no
        sink).  :func:`merge_attention` combines results over disjoint keys.
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
    lse : ndarray, shape (..., Hq, L), float32
        Only with ``return_lse=True`` (after the weights, if both are asked for).

    Notes
    -----
    A query row with every key masked gives zeros (and zero weights), never
    NaN.  Results are identical for every thread count on one kernel path.
    """
    if attn_mask is None and enable_gqa is False and return_weights is False and \
            return_lse is False and softcap is None and sinks is None and \
            alibi_slopes is None and (is_causal is False or is_causal is True) and \
            dropout_p.__class__ in _NUMBERS and dropout_p == 0:
        # the plainest call (contiguous arrays of one float type and batch shape): planned
        # and run in Cython, without the layout work below (most of a small call's time);
        # None for anything else, which the general path takes
        res = _kernels.attend_plain(query, key, value, scale, is_causal, num_threads)
        if res is not None:
            return res
    q, k, v, mask, p, causal, s, gqa, rw, nt, half = _checked(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights,
        num_threads)
    # half precision: queries, keys and values are read in place and widened by the
    # kernels, which round the float32 result to the input type as they write it
    features = check_score_features(q, softcap, sinks, alibi_slopes, return_lse)
    res = _core.attention(q, k, v, mask=mask, causal_offset=0 if causal else None, scale=s,
                          dropout_p=p, seed=seed_value(seed) if p > 0 else 0, enable_gqa=gqa,
                          return_weights=rw, num_threads=nt, features=features)
    if half is not None and rw:
        return (res[0], res[1].astype(half)) + tuple(res[2:])
    return res


def merge_attention(outs: Sequence[Any], lses: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Combine attention computed over disjoint sets of keys into the attention over
    their union.

    Each part is the output of :func:`scaled_dot_product_attention` over some keys
    and its log-sum-exp (``return_lse=True``).  The result is the output and
    log-sum-exp over all the keys, within rounding: a sliced cache, keys sharded
    across processes or machines, chunked prefill.  A part that saw nothing
    (lse -inf) contributes nothing; if no part saw anything the output is zeros
    and the lse -inf.  (A sink belongs in one part only.)

    Parameters
    ----------
    outs : sequence of ndarrays, shape (..., L, Ev), one dtype
    lses : sequence of ndarrays, shape (..., L)

    Returns
    -------
    out : ndarray, shape (..., L, Ev), the dtype of the outputs
    lse : ndarray, shape (..., L), float32
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"give one lse per output, at least one of each; got {len(outs)} "
                         f"outputs and {len(lses)} lses")
    parts = [as_attention_array(o, f"outs[{i}]") for i, o in enumerate(outs)]
    logs = [as_float_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
    for i, (o, x) in enumerate(zip(parts, logs)):
        if o.shape != parts[0].shape or o.dtype != parts[0].dtype:
            raise ValueError(f"outs[{i}] has shape {o.shape} and dtype {o.dtype}; every output "
                             f"must match outs[0] ({parts[0].shape}, {parts[0].dtype})")
        if x.shape != o.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {o.shape[:-1]} (the output's without "
                             f"its last axis), got {x.shape}")
    acc = np.float64 if parts[0].dtype == np.float64 else np.float32
    lse = np.stack([x.astype(acc, copy=False) for x in logs])
    top = lse.max(axis=0)
    top = np.where(np.isneginf(top), 0, top)
    share = np.exp(lse - top)  # each part's denominator, on the common scale
    total = share.sum(axis=0)
    merged = np.zeros(parts[0].shape, acc)
    for w, o in zip(share, parts):
        merged += w[..., None] * o.astype(acc, copy=False)
    with np.errstate(divide="ignore"):
        inv = np.where(total == 0, 0, 1 / np.where(total == 0, 1, total))
        merged_lse = (np.log(total) + top).astype(np.float32)
    return (merged * inv[..., None]).astype(parts[0].dtype, copy=False), merged_lse


# the checked arguments: q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
# return_weights, num_threads, and the half dtype (float16 / bfloat16 inputs) or None
_Checked = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None", float, bool, float,
                 bool, bool, int, "np.dtype | None"]


def _checked(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any,
             scale: Any, enable_gqa: Any, return_weights: Any, num_threads: Any) -> _Checked:
    """scaled_dot_product_attention's arguments, checked (TypeError / ValueError); a plain
    tuple (see _Checked), cheap for the smallest calls."""
    q = as_attention_array(query, "query")
    k = as_attention_array(key, "key")
    v = as_attention_array(value, "value")
    _check_shapes(q, k, v)
    causal = check_bool(is_causal, "is_causal")
    if causal and attn_mask is not None:
        raise ValueError("give either attn_mask or is_causal=True, not both")
    p = check_dropout(dropout_p)
    s = check_factor(check_optional_real(scale, "scale"), "scale", q.dtype)
    nt = _config.resolve_num_threads(num_threads)
    gqa = check_bool(enable_gqa, "enable_gqa")
    if gqa:
        _check_gqa(q, k, v)
    elif q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3] and k.shape[-3] > 1 \
            and q.shape[-3] % k.shape[-3] == 0:
        raise ValueError(f"query has {q.shape[-3]} heads and key/value {k.shape[-3]}: for "
                         f"grouped-query attention pass enable_gqa=True")
    half = q.dtype if q.dtype not in FLOAT_DTYPES else None
    compute = np.dtype(np.float32) if half is not None else q.dtype
    mask = None if attn_mask is None else _check_mask(attn_mask, compute)
    rw = check_bool(return_weights, "return_weights")
    return (q, k, v, mask, p, causal, 1.0 / math.sqrt(q.shape[-1]) if s is None else s,
            gqa, rw, nt, half)


def explain(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
    softcap: float | None = None, sinks: Any = None, alibi_slopes: Any = None,
    return_lse: bool = False, return_weights: bool = False, seed: Any = None,
    num_threads: int | None = None,
) -> CallPlan:
    """What :func:`scaled_dot_product_attention` would do with these arguments.

    Nothing is computed: the call is checked and planned as it would be, and
    the plan is returned.  The plan is made once per call, in one place, and
    the kernels follow it: the schedule (blocks of query rows, or, for a few
    query rows against many keys, key ranges attended in parallel and then
    merged), how many query heads one work item serves (grouped-query
    decode), each kind of work item's path (tile, few rows, bfloat16 pair
    products) and how it reads the keys and values (in place, copied, or
    widened once per thread), the threads, and the scratch memory.

    Takes the arguments of :func:`scaled_dot_product_attention`, checked as it checks
    them.  The score features (``softcap``, ``sinks``, ``alibi_slopes``,
    ``return_lse``) and the dropout ``seed`` change the arithmetic of each score,
    not the plan.

    Returns
    -------
    CallPlan
        A frozen dataclass; ``str(plan)`` describes it in words.

    Examples
    --------
    >>> import numpy as np, manyheads as mh
    >>> q = np.zeros((1, 12, 1, 64), np.float32)
    >>> k = v = np.zeros((1, 12, 16384, 64), np.float32)
    >>> plan = mh.explain(q, k, v, num_threads=2)
    >>> plan.key_ranges, plan.items[0].path
    (32, 'few rows')
    """
    q, k, v, mask, p, _, _, gqa, rw, nt, _ = _checked(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights,
        num_threads)
    check_score_features(q, softcap, sinks, alibi_slopes, return_lse)
    if p > 0:
        seed_value(seed)
    return _core.explain(q, k, v, mask=mask, enable_gqa=gqa, return_weights=rw, dropout_p=p,
                         num_threads=nt)


def linear(x: Any, weight: Any, bias: Any = None, *, num_threads: int | None = None
           ) -> np.ndarray:
    """``x @ weight + bias`` on manyheads' own threads (NumPy's convention, weight (in, out)).

    The product the modules use for their projections, for the rest of a model
    (MLPs, the LM head): one to four rows (decode) run through a memory-bound
    kernel that reads ``weight`` once, up to 32 rows through that kernel in
    groups of up to eight rows, each row the bits it gets alone; more rows run
    as single-threaded BLAS tiles on manyheads' threads, so no second thread
    pool competes with the attention.
    Results are the same bits for any thread count.

    Parameters
    ----------
    x : ndarray, shape (..., in_features)
    weight : ndarray or Int8Weight, shape (in_features, out_features)
        Of x's dtype, or, with float32 x, stored in its own precision and read in
        place: float16, ``ml_dtypes.bfloat16`` or an
        :class:`~manyheads.weights.Int8Weight` (int8 with float32 scales).  With
        up to 32 rows, a half-precision weight gives the bits of the same
        product with the weight widened to float32 first (more rows: the same
        values within float32 rounding).
    bias : ndarray, shape (out_features,), optional
        Of x's dtype (float32 or float64).
    num_threads : int, optional, keyword-only
        Threads for this call; defaults to :func:`manyheads.get_num_threads`.

    Returns
    -------
    ndarray, shape (..., out_features), of x's dtype
    """
    out = _kernels.linear_plain(x, weight, bias, num_threads)  # checked there (a plain call)
    if out is not None:
        return out
    xa = as_float_array(x, "x")
    if not isinstance(weight, (np.ndarray, Int8Weight)):  # an array-like: float64 or float32
        weight = as_float_array(weight, "weight")
    fmt = weight_format(weight)
    w = weight if fmt in ("int8", "float16", "bfloat16") else as_float_array(weight, "weight")
    b = None if bias is None else as_float_array(bias, "bias")
    if fmt in ("float32", "float64"):
        if w.dtype != xa.dtype or (b is not None and b.dtype != xa.dtype):
            raise TypeError(f"x, weight and bias must share one dtype; got {xa.dtype}, "
                            f"{w.dtype}" + ("" if b is None else f", {b.dtype}"))
    elif xa.dtype != np.float32 or (b is not None and b.dtype != np.float32):
        raise TypeError(f"{'an' if fmt == 'int8' else 'a'} {fmt} weight needs float32 x "
                        f"and bias; got {xa.dtype}"
                        + ("" if b is None else f", {b.dtype}"))
    shape = w.shape
    if xa.ndim < 1 or len(shape) != 2 or xa.shape[-1] != shape[0]:
        raise ValueError(f"weight must have shape (in_features, out_features) = "
                         f"({xa.shape[-1] if xa.ndim else '?'}, n); got x {xa.shape} and "
                         f"weight {tuple(shape)}")
    if b is not None and b.shape != (shape[1],):
        raise ValueError(f"bias must have shape ({shape[1]},), got {b.shape}")
    return _core.linear(xa, w, b, _config.resolve_num_threads(num_threads))
