"""``attn_implementation="manyheads"`` for Hugging Face transformers.

After :func:`register`, a model whose attention layers call transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, Phi-3, Gemma 2, gpt-oss and
most decoders of transformers 5) runs its attention on manyheads' kernels::

    import manyheads.transformers
    name = manyheads.transformers.register()          # "manyheads"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

How a call looks from here.  transformers hands :func:`attention_forward`
the query (B, Hq, T, D) and the keys and values (B, Hkv, S, D) after its
cache has been updated, so they are the cache's own tensors (a dynamic
cache's concatenation, a static cache's whole buffer) and they are read in
place; the output (B, T, Hq, D) is written by the kernels in the layout the
output projection reads.  The masks come from transformers' ``sdpa`` mask
builder, registered under the same name by :func:`register` with one
change: a sliding window alone does not make it build a mask.  So the mask
is ``None`` when the pattern is causal attention without padding, with or
without the layer's sliding window, and the kernels then use their causal
schedule with the window (``sliding_window``, as transformers'
flash-attention backend takes it), never looking at the keys above the
diagonal or behind the window; otherwise (padding, decoding from a static
cache) it is a 4-D boolean mask, True where a query may attend.
Grouped-query heads are shared by the kernels, not repeated; ``scaling``,
``dropout``, ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss sinks) go to the
kernels.

Importing this module imports torch and transformers; ``import manyheads``
does neither.
"""
from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

from . import torch as _mh_torch

__all__ = ["register", "attention_forward", "NAME", "MIN_TRANSFORMERS"]

#: The name models are given as ``attn_implementation``.
NAME = "manyheads"

#: The oldest transformers release this backend works with (its 5.x attention and mask
#: interfaces, and the keyword arguments the attention layers pass).
MIN_TRANSFORMERS = "5.0.0"


def register() -> str:
    """Make ``attn_implementation="manyheads"`` available to transformers.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface``
    and transformers' ``sdpa`` mask builder with
    ``transformers.AttentionMaskInterface``, both under :data:`NAME`.  Calling
    it again does no harm.

    Returns
    -------
    str
        The name to pass as ``attn_implementation`` (``"manyheads"``).

    Raises
    ------
    ImportError
        If the installed transformers is older than :data:`MIN_TRANSFORMERS`.
    """
    found = transformers.__version__
    if Version(found) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"manyheads.transformers needs transformers>={MIN_TRANSFORMERS}, "
                          f"found {found}")
    transformers.AttentionInterface.register(NAME, attention_forward)
    transformers.AttentionMaskInterface.register(NAME, _mask)
    return NAME


def _mask(*args: Any, local_size: int | None = None, **kwargs: Any) -> Any:
    """transformers' sdpa mask, or None wherever it would be causal (with the layer's
    sliding window, which the kernels apply themselves) without padding.

    ``sdpa_mask`` skips the mask for causal patterns only when the layer has
    no window the keys reach beyond (``local_size``); without ``local_size``
    it skips it in the same cases for sliding layers too, and still builds the
    sliding mask wherever a mask is needed.  ``local_size`` is dropped only for
    a causal sliding window: transformers gives it for other patterns too
    (ModernBERT's bidirectional window, Llama 4's chunks), which the kernels'
    window does not describe, so those keep their mask."""
    from transformers.masking_utils import sdpa_mask

    if local_size is not None and not (kwargs.get("allow_is_causal_skip", True) and
                                       _causal_window(kwargs.get("mask_function"), local_size)):
        kwargs["local_size"] = local_size
    return sdpa_mask(*args, **kwargs)


def _causal_window(mask_function: Any, w: int) -> bool:
    """Whether the causal pattern ``mask_function`` (batch, head, query, key -> may
    attend) that transformers gives a span ``w`` is a sliding window (query q sees the
    keys q - w < k <= q) rather than chunks of w (query w does not see key w - 1),
    bidirectional (query w - 1 sees key w) or unbounded (query w sees key 0).  Three
    probes a mask (it is built once a forward, some 0.1 ms); anything they cannot
    evaluate counts as another pattern."""
    import torch

    if mask_function is None or w < 2:  # (a window of 1 is a chunk of 1: either way)
        return False
    if torch.compiler.is_compiling():  # (a probe's bool() of a tensor breaks the graph: the
        # mask keeps its window there, the same attention)
        return False
    zero, q, k = torch.tensor(0), torch.tensor(w), torch.tensor(w - 1)
    try:
        return (bool(mask_function(zero, zero, q, k)) and not bool(mask_function(zero, zero, k, q))
                and not bool(mask_function(zero, zero, q, zero)))
    except Exception:  # (a pattern that reads other tensors at these positions)
        return False


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: Any = None, is_causal: bool | None = None, **kwargs: Any
                      ) -> tuple[Any, None]:
    """One attention call of a transformers model, on manyheads' kernels.

    transformers calls it with the arguments below (and others it ignores);
    it is not meant to be called directly.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` attribute is read when
        ``is_causal`` is not given).
    query : Tensor, shape (B, Hq, T, D)
    key, value : Tensor, shape (B, Hkv, S, D)
        After the cache update; Hq a multiple of Hkv.
    attention_mask : Tensor or None
        A 4-D mask broadcastable to (B, Hq, T, S), boolean (True = may
        attend) or additive; ``None`` means causal attention (top-left
        aligned) when T > 1 and no mask at all for one query.
    dropout : float
        Dropout on the attention weights (0 in eval mode).
    scaling : float, optional
        Score scale; defaults to ``1 / sqrt(D)``.
    sliding_window : int, optional
        The layer's window: each query sees its ``sliding_window`` latest
        keys.  Applied by the kernels when there is no mask (a mask from
        transformers already holds it).
    softcap : float, optional
        Soft cap of the scaled scores (Gemma 2).
    s_aux : Tensor, shape (Hq,), optional
        Attention sinks (gpt-oss).
    is_causal : bool, optional
        Overrides ``module.is_causal``.

    Returns
    -------
    out : Tensor, shape (B, T, Hq, D), contiguous
    weights : None
        Attention weights are not returned.
    """
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("attn_implementation='manyheads' does not take a "
                                  "position_bias (T5-style relative attention)")
    L = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(L > 1 and attention_mask is None and is_causal)
    window = sliding_window if attention_mask is None and is_causal else None
    if causal and key.shape[2] > L:
        # a static cache's first forward: the keys past the queries are empty slots,
        # which top-left causal attention never reads; the views make that explicit
        key, value = key[:, :, :L], value[:, :, :L]
    elif attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
        attention_mask = attention_mask[..., :key.shape[2]]
    if not causal and window is not None:
        # one query without a mask: the latest key is its own; the window is a view
        if key.shape[2] > window:
            key, value = key[:, :, -window:], value[:, :, -window:]
        window = None
    out = _mh_torch.scaled_dot_product_attention(
        query, key, value, attention_mask, dropout, causal, scaling,
        query.shape[1] != key.shape[1], softcap=softcap, sinks=s_aux, window=window,
        transpose_out=True)
    return out, None
