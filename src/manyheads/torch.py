"""The attention kernels on PyTorch tensors (named after ``safetensors.torch``).

:func:`scaled_dot_product_attention` takes CPU tensors and returns tensors,
with the semantics of :func:`manyheads.scaled_dot_product_attention` (and so
of ``torch.nn.functional.scaled_dot_product_attention``).  Nothing is copied
on the way: each tensor is handed to the kernels as a NumPy view of its own
memory (bfloat16 through a 16-bit integer view, since NumPy has no bfloat16 of
its own), strides included, and the output the kernels write is the tensor
returned.  A decoding step's call (4-D heads, no mask or score features, the
plan serving each key/value head's query heads together) goes to the kernels
without the general path's Python layout work: about 55 rather than 110 µs for
9 query heads on 3 key/value heads and 256 cached tokens, where torch's own SDPA
takes 40-50 µs.

The function is also a ``torch.library`` operator,
``torch.ops.manyheads.scaled_dot_product_attention`` (and ``..._lse``, which
also returns the log-sum-exp), with a fake implementation that gives the
output's shape, dtype and strides without computing anything.  The Python
function calls the kernels directly in eager mode, where the dispatcher would
only add time, and goes through the operator whenever PyTorch is tracing
(``torch.compile``, ``torch.export``, ``torch.jit.trace``) or the inputs are
meta tensors or tensor subclasses (fake, functional tensors).

There is no backward pass: a call that would need one (grad mode on and an
input that requires grad) raises ``NotImplementedError`` before anything runs.
Call it under ``torch.no_grad()`` or ``torch.inference_mode()``.

Importing this module imports torch; ``import manyheads`` does not.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch as _torch

from . import _config, _core, _formats, _kernels, functional
from ._validate import check_int, check_score_features

# torch's own annotations are partial (untyped decorators and library calls): it is used
# untyped here, as the rest of the package uses foreign objects
torch: Any = _torch

__all__ = ["scaled_dot_product_attention", "SUPPORTED_DTYPES"]

#: The tensor dtypes the kernels take (all of query, key and value share one).
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_DTYPES_TEXT = "torch.float32, torch.float64, torch.float16 or torch.bfloat16"

_ml_dtypes: Any = None


def _bfloat16() -> Any:
    """NumPy's bfloat16 (ml_dtypes), imported when the first bfloat16 tensor arrives."""
    global _ml_dtypes
    if _ml_dtypes is None:
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("bfloat16 tensors need the ml_dtypes package: "
                              "pip install ml_dtypes") from None
        _ml_dtypes = ml_dtypes
    return _ml_dtypes.bfloat16


def _array(t: Any) -> np.ndarray:
    """A NumPy view of CPU tensor ``t``'s memory, with its shape and strides (no copy).

    The caller has made sure that no gradient is needed, so a tensor that
    requires grad is detached (a view too)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        a: np.ndarray = t.view(torch.int16).numpy().view(_bfloat16())
        return a
    view: np.ndarray = t.numpy()
    return view


def _tensor(a: np.ndarray) -> Any:
    """The tensor that owns NumPy array ``a``'s memory (no copy)."""
    if a.dtype.itemsize == 2 and a.dtype != np.float16:  # bfloat16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_tensors(query: Any, key: Any, value: Any, optional: tuple[tuple[str, Any], ...]
                   ) -> None:
    """TypeError / ValueError for arguments the kernels cannot take as tensors, and
    NotImplementedError for a call that needs a gradient."""
    for name, t in (("query", query), ("key", key), ("value", value)) + optional:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; manyheads runs on the CPU: "
                             f"move the tensors with .cpu()")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query has dtype {query.dtype}; supported dtypes are {_DTYPES_TEXT}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype; got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    if torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
            or any(t is not None and t.requires_grad for _, t in optional)):
        raise NotImplementedError(
            "manyheads.torch has no backward pass, and an input requires grad: call it "
            "under torch.no_grad() or torch.inference_mode(), or pass detached tensors")


def _small_float_array(t: Any) -> np.ndarray:
    """Per-head values (sinks, ALiBi slopes) as float32/float64 (half ones widened: a
    copy of a few numbers)."""
    if t.dtype not in (torch.float32, torch.float64) and t.dtype.is_floating_point:
        t = t.detach().float()
    return _array(t)


#: dtype -> (storage code, NumPy dtype of the bits the kernels read) of the direct path
_HEADS_FORMATS = {torch.float32: (_formats.FORMATS["float32"].code, None),
                  torch.float16: (_formats.FORMATS["float16"].code, np.uint16),
                  torch.bfloat16: (_formats.FORMATS["bfloat16"].code, torch.int16)}


def _heads_forward(query: Any, key: Any, value: Any, is_causal: Any, scale: Any,
                   enable_gqa: Any, window: Any, transpose_out: bool, num_threads: Any) -> Any:
    """The output tensor of a call without a mask, dropout or score features on 4-D
    CPU tensors (B, H, L|S, E), what a transformers model's decoding step makes, through
    ``_kernels.attend_heads``: the checks and views of the general path cost several
    times a small call's kernels.  None (nothing done) for any other call, which
    ``_forward`` then takes, with its checks and errors."""
    dt = query.dtype
    fmt = _HEADS_FORMATS.get(dt)
    if fmt is None or type(query) is not torch.Tensor or type(key) is not torch.Tensor or \
            type(value) is not torch.Tensor or key.dtype != dt or value.dtype != dt or \
            not (query.is_cpu and key.is_cpu and value.is_cpu) or \
            query.requires_grad or key.requires_grad or value.requires_grad or \
            query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or \
            (is_causal is not True and is_causal is not False) or \
            (enable_gqa is not True and enable_gqa is not False) or \
            (not enable_gqa and query.shape[1] != key.shape[1]) or \
            (window is not None and (type(window) is not int or window < 1 or not is_causal)):
        return None
    code, bits = fmt
    if bits is None:
        q, k, v = query.numpy(), key.numpy(), value.numpy()
    elif bits is np.uint16:
        q, k, v = (t.numpy().view(np.uint16) for t in (query, key, value))
    else:
        q, k, v = (t.view(bits).numpy() for t in (query, key, value))
    B, Hq, L = q.shape[:3]
    Ev = v.shape[3]
    store = np.empty((B, L, Hq, Ev) if transpose_out else (B, Hq, L, Ev),
                     dtype=np.float32 if bits is None else np.int16)
    if not _kernels.attend_heads(q, k, v, store.swapaxes(1, 2) if transpose_out else store,
                                 code, scale, is_causal, window or 0,
                                 _config.resolve_num_threads(num_threads),
                                 _core._on_main_thread()):
        return None
    result = torch.from_numpy(store)
    return result if bits is None else result.view(dt)


def _forward(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
             is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float | None,
             sinks: Any, alibi_slopes: Any, return_lse: bool, transpose_out: bool,
             window: int | None, num_threads: int | None) -> Any:
    """The kernels on tensors: the output tensor, or (output, lse) with ``return_lse``.

    The arguments get the NumPy function's checks (``functional._checked``),
    then the core writes the output tensor directly, in the (..., L, Hq, Ev)
    layout with ``transpose_out``."""
    if attn_mask is None and sinks is None and alibi_slopes is None and softcap is None and \
            not return_lse and dropout_p.__class__ in (float, int) and dropout_p == 0:
        result = _heads_forward(query, key, value, is_causal, scale, enable_gqa, window,
                                transpose_out, num_threads)
        if result is not None:
            return result
    _check_tensors(query, key, value,
                   (("attn_mask", attn_mask), ("sinks", sinks), ("alibi_slopes", alibi_slopes)))
    q, k, v, mask, p, causal, s, gqa, _, nt, _ = functional._checked(
        _array(query), _array(key), _array(value),
        None if attn_mask is None else _array(attn_mask), dropout_p, is_causal, scale,
        enable_gqa, False, num_threads)
    features = check_score_features(
        q, softcap, None if sinks is None else _small_float_array(sinks),
        None if alibi_slopes is None else _small_float_array(alibi_slopes), return_lse)
    if window is not None:
        window = check_int(window, "window", 1)
        if not causal:
            raise ValueError("window needs is_causal=True (a sliding window of the causal "
                             "mask)")
    # dropout draws its seed from torch's generator, so torch.manual_seed repeats it
    seed = int(torch.randint(0, 2**62, ()).item()) if p > 0 else 0
    result = out = None
    if transpose_out:
        if q.ndim < 3:
            raise ValueError(f"transpose_out=True needs a head axis (-3) in query, "
                             f"got shape {tuple(query.shape)}")
        batch = _heads_batch(q.shape, k.shape, v.shape, gqa)
        result = torch.empty(batch[:-1] + (q.shape[-2], batch[-1], v.shape[-1]),
                             dtype=query.dtype)
        out = _array(result).swapaxes(-3, -2)
    res = _core.attention(q, k, v, mask=mask, causal_offset=0 if causal else None,
                          window=window, scale=s, dropout_p=p, seed=seed, enable_gqa=gqa,
                          num_threads=nt, out=out, features=features)
    if result is None:
        result = _tensor(res[0] if return_lse else res)
    return (result, torch.from_numpy(res[1])) if return_lse else result


def _heads_batch(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], gqa: bool
                 ) -> tuple[int, ...]:
    """The (..., Hq) batch shape of the output (batch axes broadcast)."""
    if gqa:
        return _core.broadcast_shapes("query, key and value", q[:-3], k[:-3], v[:-3]) + (q[-3],)
    return _core.broadcast_shapes("query, key and value", q[:-2], k[:-2], v[:-2])


# ---- the torch.library operators ------------------------------------------------------

# (every tensor before the keyword-only arguments, as torch.library.register_autograd
# requires; callers name sinks and alibi_slopes)
_ARGS = ("(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
         "float dropout_p=0.0, bool is_causal=False, float? scale=None, "
         "bool enable_gqa=False, Tensor? sinks=None, Tensor? alibi_slopes=None, *, "
         "float? softcap=None, int? window=None, bool transpose_out=False, "
         "int? num_threads=None)")

_LIB = torch.library.Library("manyheads", "DEF")
_LIB.define("scaled_dot_product_attention" + _ARGS + " -> Tensor")
_LIB.define("scaled_dot_product_attention_lse" + _ARGS + " -> (Tensor, Tensor)")


def _fake_shapes(query: Any, key: Any, value: Any, enable_gqa: bool, transpose_out: bool
                 ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(output shape, lse shape) of a call, from the input shapes alone."""
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if enable_gqa:
        batch = tuple(torch.broadcast_shapes(q[:-3], k[:-3], v[:-3])) + (q[-3],)
    else:
        batch = tuple(torch.broadcast_shapes(q[:-2], k[:-2], v[:-2]))
    L, Ev = q[-2], v[-1]
    out = batch[:-1] + (L, batch[-1], Ev) if transpose_out else batch + (L, Ev)
    return out, batch + (L,)


def _kernel(return_lse: bool) -> Any:
    """The operator's CPU implementation, with the log-sum-exp or without (the keyword-only
    arguments of the schema arrive as keywords)."""
    def kernel(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
               sinks: Any = None, alibi_slopes: Any = None, **kw: Any) -> Any:
        return _forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        kw.get("softcap"), sinks, alibi_slopes, return_lse,
                        kw.get("transpose_out", False), kw.get("window"), kw.get("num_threads"))
    return kernel


def _fake(return_lse: bool) -> Any:
    """The operator's fake implementation: empty tensors of the output's (and the
    log-sum-exp's) shape."""
    def fake(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             sinks: Any = None, alibi_slopes: Any = None, **kw: Any) -> Any:
        out, lse = _fake_shapes(query, key, value, enable_gqa, kw.get("transpose_out", False))
        if return_lse:
            return query.new_empty(out), query.new_empty(lse, dtype=torch.float32)
        return query.new_empty(out)
    return fake


def _no_backward(*_: Any, **__: Any) -> Any:
    """The operators' autograd: there is no backward.  torch calls this (as the setup of
    a backward) for a call that needs a gradient, on the operators directly or in a graph
    torch.compile traces, where the check of :func:`scaled_dot_product_attention` does not
    run: it raises there, where the inputs' gradients were silently left empty."""
    raise NotImplementedError(
        "manyheads.torch has no backward pass, and an input requires grad: call it "
        "under torch.no_grad() or torch.inference_mode(), or pass detached tensors")


for _name, _lse in (("scaled_dot_product_attention", False),
                    ("scaled_dot_product_attention_lse", True)):
    _LIB.impl(_name, _kernel(_lse), "CPU")
    torch.library.register_fake("manyheads::" + _name, _fake(_lse))
    torch.library.register_autograd("manyheads::" + _name, _no_backward,
                                    setup_context=_no_backward)


def _eager(query: Any) -> bool:
    """True when the kernels can be called directly: PyTorch is not tracing and the
    query is a plain tensor with data (not a meta, fake, functional or other subclass
    tensor, which the operator's fake implementation serves)."""
    return (type(query) is torch.Tensor and not query.is_meta
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
    softcap: float | None = None, sinks: Any = None, alibi_slopes: Any = None,
    return_lse: bool = False, window: int | None = None, transpose_out: bool = False,
    num_threads: int | None = None,
) -> Any:
    """Scaled dot-product attention on CPU tensors, with PyTorch's semantics.

    The arguments and the result are those of
    ``torch.nn.functional.scaled_dot_product_attention`` (and of
    :func:`manyheads.scaled_dot_product_attention`, which computes it): the
    tensors are read in place and the output tensor is the one the kernels
    write.

    Parameters
    ----------
    query : Tensor, shape (..., Hq, L, E)
    key : Tensor, shape (..., Hkv, S, E)
    value : Tensor, shape (..., Hkv, S, Ev)
        CPU tensors of one dtype: float32, float64, float16 or bfloat16
        (half precision computes in float32; bfloat16 needs the ``ml_dtypes``
        package).  Views (transposes, slices) are read through their strides
        when the last axis is contiguous.
    attn_mask : Tensor, optional
        Broadcastable to (..., Hq, L, S).  Boolean: True means the query may
        attend the key.  Float: added to the scaled scores.
    dropout_p : float
        Probability of zeroing each attention weight, applied whenever it is
        positive (the seed comes from torch's generator).
    is_causal : bool
        Query ``i`` sees keys ``0..i`` (top-left alignment).  Not together
        with ``attn_mask``.
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Each key/value head serves ``Hq // Hkv`` consecutive query heads; the
        key and value heads are not repeated in memory.
    softcap, sinks, alibi_slopes, return_lse : keyword-only
        As in :func:`manyheads.scaled_dot_product_attention`: a soft cap of
        the scaled scores, one sink logit per query head (Tensor (Hq,)),
        ALiBi slopes (Tensor (Hq,) or (B, Hq)), and the float32 log-sum-exp
        (..., Hq, L) as a second result.
    window : int, optional, keyword-only
        With ``is_causal=True``: query ``i`` sees only the ``window`` keys
        ``i - window + 1 .. i`` (a sliding window, as in Mistral's and
        Gemma 2's local layers).  The kernels skip the keys outside it.
    transpose_out : bool, keyword-only
        Return the output as (..., L, Hq, Ev), contiguous, instead of
        (..., Hq, L, Ev): the layout an output projection reads, so
        ``out.flatten(-2)`` is a view.  The kernels write it directly; there
        is no transpose copy afterwards.
    num_threads : int, optional, keyword-only
        Threads for this call; defaults to :func:`manyheads.get_num_threads`.

    Returns
    -------
    out : Tensor, shape (..., Hq, L, Ev), or (..., L, Hq, Ev) with ``transpose_out``
        In the input dtype.
    lse : Tensor, shape (..., Hq, L), float32
        Only with ``return_lse=True``.

    Raises
    ------
    NotImplementedError
        If grad mode is on and an input requires grad: there is no backward pass.

    Notes
    -----
    Registered as the operators ``torch.ops.manyheads.scaled_dot_product_attention``
    and ``torch.ops.manyheads.scaled_dot_product_attention_lse`` (the latter
    returns ``(out, lse)``), with fake implementations, so that the call can
    be traced by ``torch.compile``.  A query row that sees no key gives
    zeros, not NaN as in PyTorch.
    """
    if _eager(query):
        return _forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        softcap, sinks, alibi_slopes, return_lse, transpose_out, window,
                        num_threads)
    ops = torch.ops.manyheads
    op = ops.scaled_dot_product_attention_lse if return_lse else ops.scaled_dot_product_attention
    return op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, window=window,
              transpose_out=transpose_out, num_threads=num_threads)
