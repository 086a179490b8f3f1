"""The checked-input core: turns NumPy arrays into one kernel call.

Everything here trusts its arguments (the public entry points in
``functional``, ``modules`` and ``cache`` have checked them).  Its job is to
describe the call to the planner (``_kernels.AttentionCall``, which decides
once what the call does: schedule, grouped heads, paths, threads, scratch),
then to fold batch broadcasting, grouped-query head sharing and arbitrary
strides into one offset table per operand as the plan needs them, since the
kernels address every operand as ``base + offset[pair] + row * row_stride +
col``, and to fill the call through its named setters.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _blas, _formats, _kernels, weights
from ._validate import ScoreFeatures, check_factor, dtype_name

__all__ = ["attention", "explain", "CallPlan", "ItemPlan", "linear", "apply_rope", "rotate", "rope_tables", "kernel_ready"]


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


def _split_axis(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    """A view of ``a`` with axis ``axis`` (length m * n) split into (m, n)."""
    axis %= a.ndim
    shape = a.shape[:axis] + (a.shape[axis] // n, n) + a.shape[axis + 1:]
    out = a.reshape(shape)  # splitting one axis never needs a copy: always a view
    assert out.base is not None or a.size == 0
    return out


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


_FORMAT_OF: dict[tuple[np.dtype, bool], _formats.StorageFormat] = {}


def _format(arr: np.ndarray, quantized: bool = False) -> _formats.StorageFormat:
    """The storage format of ``arr`` (remembered by dtype: a call looks it up twice)."""
    key = (arr.dtype, quantized)
    fmt = _FORMAT_OF.get(key)
    if fmt is None:
        found = _formats.of_dtype(dtype_name(arr.dtype), quantized)
        assert found is not None, arr.dtype  # the public entry points have checked it
        fmt = _FORMAT_OF[key] = found
    return fmt


def _heads_batch(q: np.ndarray, kvs: tuple[np.ndarray, ...], enable_gqa: bool
                 ) -> tuple[int, ...]:
    """The (..., query heads) batch shape of the call's output."""
    if enable_gqa:
        outer = broadcast_shapes("query, key and value", q.shape[:-3],
                                 *(a.shape[:-3] for a in kvs))
        return outer + (q.shape[-3],)
    return broadcast_shapes("query, key and value", q.shape[:-2], *(a.shape[:-2] for a in kvs))


_FLOAT32 = np.dtype(np.float32)
_FORMAT_F32 = _formats.FORMATS["float32"]


@dataclass(frozen=True)
class ItemPlan:
    """The work items of one kind in a :class:`CallPlan`."""

    count: int  # work items of this kind
    rows: int  # query rows each serves
    path: str  # "tile", "tile, bfloat16 pair products" or "few rows"
    keys: str  # how it reads the keys: "in place", "copied", "widened once per thread"
    values: str  # ... and the values


@dataclass(frozen=True)
class CallPlan:
    """What one attention call does, decided once before any kernel runs.

    Returned by :func:`manyheads.explain`; ``str(plan)`` says it in words.
    """

    isa: str  # the kernel path (manyheads.kernel_isa())
    dtype: str  # the kernels' float type: "float32" or "float64"
    query_format: str  # storage of the queries and outputs (float32, float16, ...)
    kv_format: str  # storage of the keys and values (float32, ..., int8, int4)
    batch: tuple[int, ...]  # (..., query heads)
    query_rows: int  # L
    keys: int  # S
    head_dim: int  # E
    value_dim: int  # Ev
    pairs: int  # (batch, head) pairs the work items serve (kv heads when grouped)
    group: int  # query heads one work item serves (1: none grouped)
    query_blocks: int  # query blocks per pair (block schedule)
    key_ranges: int  # key ranges per pair (split-key schedule), 0: block schedule
    range_keys: int  # keys per range
    ranges_per_item: int  # consecutive key ranges one work item takes in turn
    work_items: int
    items: tuple[ItemPlan, ...]
    threads: int
    merge_threads: int  # threads of the merge pass (split-key schedule), 0: none
    prefetch: bool  # the few-rows path asks for key and value rows ahead
    widened_rows: int  # rows of float16/bfloat16 keys and values a thread keeps widened
    scratch_bytes: int  # per thread
    partial_bytes: int  # split-key partial results
    multiply_adds: float

    @property
    def schedule(self) -> str:
        return "split keys" if self.key_ranges else "query blocks"

    def __str__(self) -> str:
        def n(count: int, what: str) -> str:
            return f"{count} {what}{'' if count == 1 else 's'}"

        b = "x".join(str(n) for n in self.batch) or "1"
        lines = [f"{self.dtype} attention on the {self.isa} kernels, {n(self.threads, 'thread')}",
                 f"  (batch, query heads) {b}: {n(self.query_rows, 'query row')} against "
                 f"{n(self.keys, 'key')}, head size {self.head_dim}, value size "
                 f"{self.value_dim}; queries {self.query_format}, keys and values "
                 f"{self.kv_format}"]
        pairs = f"{self.pairs} (batch, {'kv ' if self.group > 1 else ''}head) pairs"
        if self.key_ranges:
            lines.append(f"  split keys: {pairs} x {n(self.key_ranges, 'key range')} of "
                         f"{self.range_keys}, {self.ranges_per_item} in turn a work item = "
                         f"{n(self.work_items, 'work item')}, then "
                         f"{n(self.pairs, 'merge')} on {n(self.merge_threads, 'thread')}")
        else:
            lines.append(f"  query blocks: {pairs} x {n(self.query_blocks, 'block')} = "
                         f"{n(self.work_items, 'work item')}")
        if self.group > 1:
            lines.append(f"  each work item serves the {self.group} query heads that share "
                         f"its kv head (each key and value read once for them)")
        for it in self.items:
            lines.append(f"  {n(it.count, 'item')} of {n(it.rows, 'row')}: {it.path} path, "
                         f"keys {it.keys}, values {it.values}")
        extras = [f"scratch {self.threads} x {self.scratch_bytes / 1024:.0f} KiB"]
        if self.partial_bytes:
            extras.append(f"partial results {self.partial_bytes / 1024:.0f} KiB")
        if self.widened_rows:
            extras.append(f"{self.widened_rows} rows kept widened per thread")
        if any(it.path == "few rows" for it in self.items):
            extras.append("key and value rows prefetched" if self.prefetch else "no prefetch")
        lines.append("  " + "; ".join(extras))
        return "\n".join(lines)


def explain(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, num_threads: int,
            mask: np.ndarray | None = None, enable_gqa: bool = False,
            return_weights: bool = False, dropout_p: float = 0.0, split: bool | None = None,
            k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None) -> CallPlan:
    """The plan :func:`attention` would run for these checked arguments."""
    plan: CallPlan = attention(q, k, v, scale=1.0, num_threads=num_threads, mask=mask,
                               enable_gqa=enable_gqa, return_weights=return_weights,
                               dropout_p=dropout_p, split=split, k_scale=k_scale,
                               v_scale=v_scale, explain_only=True)
    return plan


def _call_plan(call: Any, q_fmt: _formats.StorageFormat, kv_fmt: _formats.StorageFormat,
               heads_batch: tuple[int, ...], shape: tuple[int, int, int, int]) -> CallPlan:
    p: dict[str, Any] = call.explain()
    return CallPlan(
        isa=p["isa"], dtype="float64" if p["float64"] else "float32",
        query_format=q_fmt.name, kv_format=kv_fmt.name, batch=tuple(heads_batch),
        query_rows=shape[0], keys=shape[1], head_dim=shape[2], value_dim=shape[3],
        pairs=p["pairs"], group=p["group"],
        query_blocks=p["query_blocks"], key_ranges=p["key_ranges"], range_keys=p["range_keys"],
        ranges_per_item=p["ranges_per_item"], work_items=p["work_items"],
        items=tuple(ItemPlan(**it) for it in p["items"]),
        threads=p["threads"], merge_threads=p["merge_threads"], prefetch=p["prefetch"],
        widened_rows=p["widened_rows"], scratch_bytes=p["scratch_bytes_per_thread"],
        partial_bytes=p["partial_bytes"], multiply_adds=p["multiply_adds"])


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
    features: ScoreFeatures | None = None,
    explain_only: bool = False,
) -> Any:
    """softmax(q kᵀ scale + mask) v over checked (..., L|S, E) arrays.

    ``causal_offset=c`` lets query ``i`` see keys ``j <= i + c`` (None: no
    causal mask); ``window=W`` (with a causal offset) also hides keys more
    than W-1 positions back.  ``out``, if given, is a writable view of the
    output shape (it may be strided, e.g. the merged-heads layout of a fused
    module).  With q float32, k and v may be stored in any storage format of
    ``_formats`` (int8 and int4 with their ``k_scale``/``v_scale``; see
    ``KVCache``).  q, k and v may also all be float16 or
    ``ml_dtypes.bfloat16``: the kernels then compute in float32, read q as it
    is and round the output to q's type as they write it; weights come back
    float32.  ``split`` forces (True) or forbids (False) the split-key
    schedule; by default the plan chooses.  ``features`` (see
    ``_validate.ScoreFeatures``) is the soft cap of the scaled scores (c tanh(s /
    c)), the sinks and the ALiBi slopes (one value per query head, broadcast
    against the (..., query heads) batch) and whether to return the log-sum-exp.
    Returns the output, then the weights with ``return_weights`` and the float32
    log-sum-exp (..., L) if asked for; with ``explain_only``, the plan (nothing
    runs).
    """
    # describe the call to the planner (_kernels.AttentionCall, which plans it once),
    # then lay the operands out as the plan says
    q_fmt = _format(q)
    compute = _FLOAT32 if q_fmt.bits == 16 else q.dtype
    # keys and values: the queries' type, or (float32 queries) a cache format
    kv_fmt = q_fmt if k.dtype == q.dtype else _format(k, k_scale is not None)
    L, E = q.shape[-2:]
    S = v.shape[-2]
    Ev = v.shape[-1] * 8 * v.itemsize // kv_fmt.bits  # int4: two values a byte
    q = kernel_ready(q)
    if kv_fmt.bits == 16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    kvs: tuple[np.ndarray, ...] = (kernel_ready(k), kernel_ready(v))
    if k_scale is not None and v_scale is not None:  # int4: float16 pairs, read as bits
        kvs += tuple(kernel_ready(a.view(np.uint16) if a.dtype == np.float16 else a)
                     for a in (k_scale, v_scale))
    common = not enable_gqa and q.shape[:-2] == kvs[0].shape[:-2] == kvs[1].shape[:-2] and \
        (len(kvs) == 2 or q.shape[:-2] == kvs[2].shape[:-2] == kvs[3].shape[:-2])
    heads_batch = q.shape[:-2] if common else _heads_batch(q, kvs, enable_gqa)
    call = _kernels.AttentionCall(
        q_fmt.bits == 64, (math.prod(heads_batch), L, S, E, Ev),
        (q_fmt.code, kv_fmt.code, (q_fmt if out is None else _format(out)).code), kvs,
        q.shape[-3] // k.shape[-3] if enable_gqa else 1,
        0 if mask is None else (2 if mask.ndim >= 3 and mask.shape[-3] != 1 else 1),
        return_weights, dropout_p > 0, -1 if split is None else int(bool(split)), num_threads)
    if explain_only:
        return _call_plan(call, q_fmt, kv_fmt, heads_batch, (L, S, E, Ev))
    group = call.group
    if group > 1:  # each kv head read once for the query heads that share it
        batch, qv, kv_views, n_kv_batch = _grouped_views(q, kvs, group)
        nb = n_kv_batch + 1  # q and out: (.., kv heads, group, L, x)
        mask_batch = batch[:-1]
    elif common:
        # the common case, kept off the function call: nothing to broadcast
        batch, qv, kv_views, n_kv_batch = q.shape[:-2], q, list(kvs), q.ndim - 2
    else:
        batch, qv, kv_views, n_kv_batch = _pair_views(q, kvs, enable_gqa)
    if group == 1:
        nb = len(batch)
        mask_batch = batch
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
    weights = np.zeros(batch + (L, S), dtype=compute) if return_weights else None
    lse = None
    if features is not None and features[3]:
        lse = np.empty(heads_batch + (L,), np.float32)
    n_pairs = math.prod(heads_batch)
    if n_pairs and L and (S == 0 or Ev == 0):
        out[...] = 0
        if lse is not None:  # nothing seen: the sink alone, else -inf
            assert features is not None
            sinks = features[1]
            lse[...] = -np.inf if sinks is None else np.broadcast_to(
                np.asarray(sinks, np.float32)[..., None], lse.shape)
    if n_pairs and L and S and Ev:
        call.set_query(qv.view(np.uint16) if qv.dtype.itemsize == 2 else qv, nb)
        scale_views = kv_views[2:] if len(kv_views) == 4 else (None, None)
        call.set_keys_values(kv_views[0], kv_views[1], n_kv_batch, scale_views[0],
                             scale_views[1])
        ov = out.view(np.uint16) if out.dtype.itemsize == 2 else out
        call.set_output(ov if group == 1 else _split_axis(ov, -3, group), nb)
        if mv is not None:
            call.set_mask(mv, n_kv_batch if group > 1 else nb)
        if causal_offset is not None:
            call.set_causal(int(causal_offset), 0 if window is None else int(window))
        call.set_scale(float(scale))
        if features is not None:
            _set_features(call, features, lse, compute, heads_batch, group, nb)
        if dropout_p > 0:
            call.set_dropout(float(dropout_p), int(seed))
        if weights is not None:
            call.set_weights(weights)
        call.run(_on_main_thread())
    if lse is not None:
        return (out, weights, lse) if return_weights else (out, lse)
    return (out, weights) if return_weights else out


def decode_call(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_scale: np.ndarray | None,
                v_scale: np.ndarray | None, *, scale: float, causal_offset: int | None,
                window: int | None, softcap: float | None, num_threads: int,
                out: np.ndarray, sinks: np.ndarray | None = None) -> Any:
    """One decoding step's attention over a cache, planned and with its operands set
    but not run, without :func:`attention`'s general layout work: float32 queries q
    (B, Hq, L, E) (a strided view of the projection), the cache's keys and values
    (B, Hkv, S, x) in their storage format (int8 and int4 with their scales) and out
    (B, Hq, L, Ev), a view; optionally each query head's sink logit (Hq,) float32; no
    mask, weights or dropout.  None when the plan does not
    serve the query heads of a kv head together (the layout laid out here) or there is
    nothing to attend; :func:`attention` then takes the call."""
    kv_fmt = _format(k, k_scale is not None)
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv or not S or not (q.flags.aligned and q.strides[-1] == 4):
        return None
    gqa = Hq // Hkv
    Ev = v.shape[-1] * 8 * v.itemsize // kv_fmt.bits  # int4: two values a byte
    if kv_fmt.bits == 16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    kvs: tuple[np.ndarray, ...] = (k, v)
    if k_scale is not None and v_scale is not None:  # int4: float16 pairs, read as bits
        kvs += tuple(a.view(np.uint16) if a.dtype == np.float16 else a
                     for a in (k_scale, v_scale))
    code = _FORMAT_F32.code
    call = _kernels.AttentionCall(False, (B * Hq, L, S, E, Ev), (code, kv_fmt.code, code), kvs,
                                  gqa, 0, False, False, -1, num_threads)
    if call.group != gqa or not Ev:
        return None
    grouped = gqa > 1
    decode_rebind(call, q, out)
    call.set_keys_values(kvs[0], kvs[1], 2, *(kvs[2:] if len(kvs) == 4 else (None, None)))
    if causal_offset is not None:
        call.set_causal(int(causal_offset), 0 if window is None else int(window))
    call.set_scale(float(scale))
    if softcap is not None:
        call.set_softcap(float(softcap))
    if sinks is not None:  # (laid out as the queries)
        view = _broadcast(np.asarray(sinks, np.float32)[:, None, None], (B, Hq, 1, 1))
        call.set_sinks(_split_axis(view, 1, gqa) if grouped else view, 3 if grouped else 2)
    return call


def decode_rebind(call: Any, q: np.ndarray, out: np.ndarray) -> None:
    """Set a :func:`decode_call`'s queries and output: its own, or the next token's,
    laid out as its first were (the same shapes and strides; after ``retarget``)."""
    gqa = call.group
    call.set_query(_split_axis(q, 1, gqa) if gqa > 1 else q, 3 if gqa > 1 else 2)
    call.set_output(_split_axis(out, 1, gqa) if gqa > 1 else out, 3 if gqa > 1 else 2)


def _set_features(call: Any, features: ScoreFeatures, lse: np.ndarray | None,
                  compute: np.dtype, heads_batch: tuple[int, ...], group: int, nb: int) -> None:
    """The soft cap, the per-query-head slopes and sinks (laid out as the queries) and
    the log-sum-exp output of a call."""
    softcap, sinks, alibi, _ = features
    if softcap is not None:
        call.set_softcap(float(softcap))
    if alibi is not None and np.size(alibi):  # (a module's slopes may have been set late)
        check_factor(float(np.abs(alibi).max()), "alibi_slopes", compute)
    for values, setter in ((alibi, call.set_alibi), (sinks, call.set_sinks)):
        if values is not None:
            arr = np.asarray(values, compute)
            if not heads_batch:  # a query without a head axis is one head: (1,) values
                arr = arr.reshape(())
            view = _broadcast(arr[..., None, None], heads_batch + (1, 1))
            setter(view if group == 1 else _split_axis(view, -3, group), nb)
    if lse is not None:
        lv = lse[..., None]
        call.set_lse(lv if group == 1 else _split_axis(lv, -3, group), nb)


#: whether the caller is the main thread: only it receives signals, so only its long
#: calls look for Ctrl-C
_on_main_thread = _kernels.on_main_thread


def _rows_ready(a: np.ndarray) -> np.ndarray:
    """``a`` (2-D) itself if its rows are contiguous and aligned, else a contiguous copy."""
    if a.flags.aligned and (a.shape[1] <= 1 or a.strides[1] == a.itemsize) and \
            a.strides[0] % a.itemsize == 0 and a.strides[0] >= a.shape[1] * a.itemsize:
        return a
    return np.array(a, order="C", copy=True)


def linear(x: np.ndarray, w: Any, bias: np.ndarray | None, num_threads: int) -> np.ndarray:
    """``x @ w + bias`` for x (..., k), w (k, n), bias (n,) or None.

    x, bias and the result share one float dtype; w is of that dtype, or (float32)
    float16, bfloat16 or an :class:`~manyheads.weights.Int8Weight`, read in place and
    widened as the kernels load it.  Runs on manyheads' threads: a few rows (decode;
    up to 32 rows, in groups of up to eight)
    through the kernels' own memory-bound product, more rows as BLAS tiles (see
    ``_blas``; other weight formats are widened a stripe of columns at a time).  The
    result is the same bits for any thread count.
    """
    out = _kernels.linear_plain(x, w, bias, num_threads)  # a plain call of a few rows
    if out is not None:
        return out
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows_ready(x.reshape(math.prod(lead), k))
    _check_weight_types(x2.dtype, w, bias)
    fmt, data, scales, group, n = weight_parts(w)
    if len(w.shape) != 2 or w.shape[0] != k or (bias is not None and bias.shape != (n,)):
        # (a module's weight or bias assigned with another shape, say nn.Linear's (out, in))
        raise ValueError(f"a weight of shape {tuple(w.shape)}"
                         + ("" if bias is None else f" and a bias of shape {bias.shape}")
                         + f" cannot take rows of {k} features: they must be ({k}, "
                         "out_features) and (out_features,)")
    if fmt >= 0 and x2.dtype != _FLOAT32:  # stored weights serve float32 kernels only
        fmt, data, scales, group = -1, _widened(w).astype(x2.dtype), None, 0
    out = np.empty((x2.shape[0], n), dtype=x2.dtype)
    b = bias if bias is None or bias.flags.c_contiguous else np.ascontiguousarray(bias)
    if k == 0:  # an empty sum: the bias alone
        out[...] = 0 if b is None else b
        return out.reshape(lead + (n,))
    if x2.shape[0] <= _kernels.LINEAR_GROUPED_ROWS:  # the kernels' own product
        _kernels.linear(x2, data, b, out, int(num_threads), _on_main_thread(), fmt, scales,
                        group)
    elif _blas.available():
        with _blas.single_threaded():
            _kernels.linear(x2, data, b, out, int(num_threads), _on_main_thread(), fmt,
                            scales, group)
    else:
        np.matmul(x2, data if fmt < 0 else _widened(w), out=out)
        if b is not None:
            out += b
    return out.reshape(lead + (n,))


def _check_weight_types(dtype: np.dtype, w: Any, bias: Any) -> None:
    """TypeError unless weight ``w`` and ``bias`` serve rows of float ``dtype``: a weight
    of that dtype, float16, bfloat16 or an Int8Weight (:func:`weights.weight_format`), a
    bias of that dtype (a module's weight assigned in another dtype had been read as the
    rows' dtype, past its end)."""
    fmt = weights.weight_format(w)  # (TypeError for anything that is no weight)
    if fmt in ("float32", "float64") and fmt != dtype.name:
        raise TypeError(f"a weight of dtype {fmt} cannot take {dtype} rows: give it as "
                        f"{dtype}, float16, bfloat16 or an Int8Weight")
    if bias is not None and (not isinstance(bias, np.ndarray) or bias.dtype != dtype):
        got = bias.dtype if isinstance(bias, np.ndarray) else type(bias).__name__
        raise TypeError(f"a bias of {got} cannot be added to {dtype} rows: give it as {dtype}")


#: (storage code or -1 for x's own dtype, the stored array (int8: in the kernels'
#: order), int8 scales, int8 group, out_features)
WeightParts = tuple[int, np.ndarray, "np.ndarray | None", int, int]


def project_rows(x2: np.ndarray, parts: WeightParts, bias: np.ndarray | None,
                 num_threads: int) -> np.ndarray:
    """``x2 @ w + bias`` for up to FEW_ROWS float32 rows x2 (m, k) with contiguous rows
    and a weight's :func:`weight_parts`: :func:`linear`'s few-rows path without its
    per-call preparation (a decoding step's products, a few microseconds each)."""
    fmt, data, scales, group, n = parts
    out = np.empty((x2.shape[0], n), dtype=np.float32)
    if x2.shape[1] == 0:
        out[...] = 0 if bias is None else bias
        return out
    _kernels.linear(x2, data, bias, out, num_threads, _on_main_thread(), fmt, scales, group)
    return out


def weight_parts(w: Any) -> WeightParts:
    """A weight as the kernels read it: (storage code or -1 for x's own dtype, the stored
    array, int8 scales, int8 group, out_features); a decoder's step works it out once
    per weight (:func:`project_rows`)."""
    if isinstance(w, np.ndarray):
        name, n = dtype_name(w.dtype), w.shape[1]
        if name in ("float16", "bfloat16"):
            return _formats.FORMATS[name].code, _rows_ready(w.view(np.uint16)), None, 0, n
        return -1, _rows_ready(w), None, 0, n
    return _formats.FORMATS["int8"].code, w._blocked, w.scales, w.group_size, w.shape[1]


def _widened(w: Any) -> np.ndarray:
    return w.astype(np.float32) if isinstance(w, np.ndarray) else w.dequantize()


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
    length = 1 << max(10, (start + T - 1).bit_length())  # tables grow in powers of two
    cos, sin = rope_tables(float(theta), D, length)
    rotate(x, cos[start:start + T], sin[start:start + T])


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate the first ``2 * n`` features of x (..., T, D) in place by angles whose cos
    and sin are (T, n) (``rotate_half`` layout within those features; the rest, as with
    a partial rotary factor, are left as they are)."""
    if x.ndim == 4 and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32 \
            and x.strides[-1] % 4 == 0 and x.flags.writeable:
        _kernels.rotate_heads(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        return
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    r1 = x1 * cos - x2 * sin
    x2 *= cos
    x2 += x1 * sin
    x1[...] = r1
