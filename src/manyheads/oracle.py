"""The pure-NumPy reference that every fast path is checked against.

Written to be read, step by step as attention is taught, not to be fast:
it materialises every score matrix.  Use it for checking and for learning;
use :func:`manyheads.scaled_dot_product_attention` or the modules
(:class:`manyheads.MultiHeadAttention` and its kin) for work.

All functions compute in the dtype they are given (pass float64 arrays, or
``dtype=np.float64``, for a high-precision reference).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = [
    "softmax",
    "causal_mask",
    "causal_attention_head",
    "stacked_multi_head_attention",
    "scaled_dot_product_attention",
    "dropout_keep_mask",
    "merge_attention",
]


def softmax(scores: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis, max-subtracted.

    Parameters
    ----------
    scores : ndarray, shape (..., S)
        One row of scores per query.

    Returns
    -------
    ndarray, shape (..., S)
        Weights that sum to 1 along the last axis.  A row whose entries are
        all -inf (every key masked) becomes all zeros, not NaN.
    """
    if scores.shape[-1] == 0:  # no keys at all: nothing to weigh
        return np.zeros_like(scores)
    row_max = np.max(scores, axis=-1, keepdims=True)
    # a fully masked row has max -inf; subtract 0 instead so exp gives zeros
    row_max = np.where(np.isneginf(row_max), 0, row_max)
    e = np.exp(scores - row_max)
    total = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total == 0, 0, e / np.where(total == 0, 1, total))


def causal_mask(num_queries: int, num_keys: int, offset: int = 0) -> np.ndarray:
    """Which keys each query must not see.

    Parameters
    ----------
    num_queries, num_keys : int
        L and S.
    offset : int, default 0
        Shifts the triangle: query i may see keys 0 .. i + offset.

    Returns
    -------
    ndarray of bool, shape (L, S)
        True where query i must NOT see key j (j > i + offset).
    """
    i = np.arange(num_queries)[:, None]
    j = np.arange(num_keys)[None, :]
    return j > i + offset


def causal_attention_head(
    x: np.ndarray,
    W_query: np.ndarray,
    W_key: np.ndarray,
    W_value: np.ndarray,
    b_query: np.ndarray | None = None,
    b_key: np.ndarray | None = None,
    b_value: np.ndarray | None = None,
    *,
    dtype: type | None = None,
    return_weights: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """One head of causal self-attention, the way the course spells it out.

    Parameters
    ----------
    x : ndarray, shape (T, d_in) or (B, T, d_in)
        The input tokens.
    W_query, W_key, W_value : ndarray, shape (d_in, d_head)
        The head's projections (``x @ W``).
    b_query, b_key, b_value : ndarray, shape (d_head,), optional
        Their biases.
    dtype : numpy dtype, optional, keyword-only
        Compute in this dtype (e.g. ``np.float64`` for a reference).
    return_weights : bool, default False, keyword-only
        Also return the attention weights.

    Returns
    -------
    context : ndarray, shape (..., T, d_head)
        The context vectors Z_h.
    weights : ndarray, shape (..., T, T)
        Only with ``return_weights=True``.
    """
    if dtype is not None:
        x = x.astype(dtype)
        W_query, W_key, W_value = (w.astype(dtype) for w in (W_query, W_key, W_value))
    # 1. every token gets its own query, key and value vector
    queries = x @ W_query
    keys = x @ W_key
    values = x @ W_value
    if b_query is not None:
        queries = queries + b_query.astype(queries.dtype)
    if b_key is not None:
        keys = keys + b_key.astype(keys.dtype)
    if b_value is not None:
        values = values + b_value.astype(values.dtype)
    # 2. attention scores: how well each query matches each key
    d_k = keys.shape[-1]
    scores = queries @ np.swapaxes(keys, -1, -2)
    scores = scores / np.sqrt(d_k).astype(scores.dtype)
    # 3. causal mask: a token may not look at tokens that come after it
    T = x.shape[-2]
    scores = np.where(causal_mask(T, T), -np.inf, scores)
    # 4. softmax turns the scores of each query into weights that sum to 1
    weights = softmax(scores)
    # 5. each context vector is the weighted sum of the value vectors
    context = weights @ values
    return (context, weights) if return_weights else context


def stacked_multi_head_attention(
    x: np.ndarray,
    heads: Sequence[
        tuple[np.ndarray, ...]
        | tuple[np.ndarray, np.ndarray, np.ndarray,
                np.ndarray | None, np.ndarray | None, np.ndarray | None]
    ],
    W_out: np.ndarray | None = None,
    b_out: np.ndarray | None = None,
    *,
    dtype: type | None = None,
) -> np.ndarray:
    """Multi-head attention as a stack of independent heads.

    Each head computes its own Z_h with :func:`causal_attention_head`; the
    Z_h are concatenated along the feature axis into one matrix Z, which goes
    through the output projection when ``W_out`` is given.

    Parameters
    ----------
    x : ndarray, shape (T, d_in) or (B, T, d_in)
        The input tokens.
    heads : sequence of tuples
        One tuple (W_query, W_key, W_value[, b_query, b_key, b_value]) per
        head, each W of shape (d_in, d_head).
    W_out : ndarray, shape (num_heads * d_head, d_out), optional
        The output projection.
    b_out : ndarray, shape (d_out,), optional
        Its bias.
    dtype : numpy dtype, optional, keyword-only
        Compute in this dtype.

    Returns
    -------
    ndarray, shape (..., T, d_out) or (..., T, num_heads * d_head)
        Z after the output projection, or Z itself without ``W_out``.
    """
    contexts = [causal_attention_head(x, *h, dtype=dtype) for h in heads]
    Z = np.concatenate(contexts, axis=-1)  # (..., T, num_heads * d_head)
    if W_out is not None:
        Z = Z @ (W_out if dtype is None else W_out.astype(dtype))
        if b_out is not None:
            Z = Z + b_out.astype(Z.dtype)
    return Z


def dropout_keep_mask(
    seed: int, shape: tuple[int, ...], p: float
) -> np.ndarray:
    """The keep/drop pattern of the kernels' dropout stream for weights of ``shape``.

    Parameters
    ----------
    seed : int
        The dropout stream's seed.
    shape : tuple of int
        (..., L, S), the shape of the attention weights; the leading axes are
        counted as one (batch, head) pair index.
    p : float
        Dropout probability.

    Returns
    -------
    ndarray of bool, shape ``shape``
        Element (pair, i, j) is kept (True) iff the top 24 bits of a
        counter-based hash of (seed, pair, i, j) are at least p * 2^24.
    """
    *batch, L, S = shape
    n_pairs = int(np.prod(batch, dtype=np.int64))
    idx = np.arange(n_pairs * L * S, dtype=np.uint64)  # (pair * L + i) * S + j
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + idx * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u: np.ndarray = (z >> np.uint64(40)).astype(np.float64) / 16777216.0
    return (u >= p).reshape(shape)


def _per_head(values: Any, scores: np.ndarray) -> np.ndarray:
    """Per-head values (sinks, ALiBi slopes) as the scores' dtype; scores (L, S) without a
    head axis are one head, whose values come as shape (1,)."""
    arr = np.asarray(values, dtype=scores.dtype)
    return arr.reshape(()) if scores.ndim == 2 else arr


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    return_lse: bool = False,
    causal_offset: int = 0,
    window: int | None = None,
    seed: int = 0,
    return_weights: bool = False,
    dtype: type | None = None,
) -> Any:
    """Reference for :func:`manyheads.scaled_dot_product_attention` (same semantics).

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        As in :func:`manyheads.scaled_dot_product_attention`.
    softcap, sinks, alibi_slopes, return_lse : keyword-only
        As in :func:`manyheads.scaled_dot_product_attention`: the scaled scores
        become ``softcap * tanh(s / softcap)``, then ``- slope * |i + S - L - j|``;
        a sink is one more logit in each row's softmax, with no value.
    causal_offset : int, default 0, keyword-only
        Shifts the causal triangle: query i sees keys j <= i + offset.
    window : int, optional, keyword-only
        A sliding window of W keys: also hides keys j <= i + offset - W.
    seed : int, default 0, keyword-only
        Selects the same dropout pattern as the kernels (see
        :func:`dropout_keep_mask`).
    return_weights : bool, default False, keyword-only
        Also return the attention weights.
    dtype : numpy dtype, optional, keyword-only
        Compute in this dtype.

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
        The attention output.
    weights : ndarray, shape (..., Hq, L, S)
        Only with ``return_weights=True``.
    lse : ndarray, shape (..., Hq, L)
        Only with ``return_lse=True``: the natural log of each row's softmax
        denominator (the sink included), -inf for a row that sees nothing.
    """
    if dtype is not None:
        query, key, value = (a.astype(dtype) for a in (query, key, value))
    L, E = query.shape[-2:]
    S = key.shape[-2]
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key = np.repeat(key, group, axis=-3)  # kv head h serves query heads h*g .. h*g+g-1
        value = np.repeat(value, group, axis=-3)
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    scores = (query @ np.swapaxes(key, -1, -2)) * np.asarray(scale, dtype=query.dtype)
    if softcap is not None:  # Gemma 2's soft cap on the scaled scores
        scores = softcap * np.tanh(scores / softcap)
    if alibi_slopes is not None:  # a linear penalty on the distance, queries at the end
        distance = np.abs(np.arange(L)[:, None] + (S - L) - np.arange(S)[None, :])
        slopes = _per_head(alibi_slopes, scores)[..., None, None]
        scores = scores - slopes * distance.astype(scores.dtype)
    if is_causal:
        scores = np.where(causal_mask(L, S, causal_offset), -np.inf, scores)
        if window is not None:
            too_old = ~causal_mask(L, S, causal_offset - window)  # j <= i + offset - window
            scores = np.where(too_old, -np.inf, scores)
    if attn_mask is not None:
        if attn_mask.dtype == np.bool_:
            scores = np.where(attn_mask, scores, -np.inf)
        else:
            scores = scores + attn_mask.astype(scores.dtype)
    if sinks is not None:  # one more logit per row, whose weight is dropped
        sink = np.broadcast_to(_per_head(sinks, scores)[..., None, None],
                               scores.shape[:-1] + (1,))
        logits = np.concatenate([scores, sink], axis=-1)
        weights = softmax(logits)[..., :-1]
    else:
        logits = scores
        weights = softmax(scores)
    if return_lse:
        top = np.max(logits, axis=-1, keepdims=True) if logits.shape[-1] else \
            np.full(logits.shape[:-1] + (1,), -np.inf, logits.dtype)
        top = np.where(np.isneginf(top), 0, top)
        with np.errstate(divide="ignore"):
            lse = (np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)) + top)[..., 0]
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, weights.shape, dropout_p)
        factor = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
        weights = np.where(keep, weights * np.asarray(factor, weights.dtype), 0)
    if np.isfinite(value).all():
        out = weights @ value
    else:
        # a masked key contributes nothing, even a NaN or inf value (0 * NaN would be NaN)
        hidden = np.isneginf(scores)
        terms = weights[..., :, :, None] * value[..., None, :, :]
        out = np.where(hidden[..., None], 0, terms).sum(axis=-2)
    result = (out,) + ((weights,) if return_weights else ()) + ((lse,) if return_lse else ())
    return result if len(result) > 1 else out


def merge_attention(outs: Any, lses: Any) -> tuple[np.ndarray, np.ndarray]:
    """Reference for :func:`manyheads.merge_attention`: attention over disjoint key
    sets, each given as its output (..., L, Ev) and log-sum-exp (..., L), combined
    into the attention over their union, step by step."""
    lse = np.stack([np.asarray(x, np.float64) for x in lses])  # (parts, ..., L)
    top = np.max(lse, axis=0)
    top = np.where(np.isneginf(top), 0, top)
    share = np.exp(lse - top)  # each part's denominator over the common one's scale
    total = share.sum(axis=0)
    out = sum(w[..., None] * np.asarray(o, np.float64) for w, o in zip(share, outs))
    with np.errstate(divide="ignore", invalid="ignore"):
        merged = np.where(total[..., None] == 0, 0, out / np.where(total == 0, 1, total)[..., None])
        return merged, np.log(total) + top
