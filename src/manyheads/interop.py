"""Import attention weights from PyTorch modules (torch is optional, never imported eagerly).

Supported sources, recognised by their structure:

* ``torch.nn.MultiheadAttention`` (``batch_first`` either way, with or without
  bias; same width for queries, keys and values; no ``add_bias_kv`` and no
  ``add_zero_attn``);
* the book's fused ``MultiHeadAttention``: ``W_query``, ``W_key``, ``W_value``
  and ``out_proj`` as ``nn.Linear`` layers, plus ``num_heads``;
* the book's ``MultiHeadAttentionWrapper``: a ``heads`` ModuleList of
  single-head modules with ``W_query``, ``W_key``, ``W_value`` (each head's
  ``d_out`` is per head) and no output projection;
* Hugging Face transformers' GPT-2 attention (``c_attn``/``c_proj`` Conv1D).

PyTorch stores ``nn.Linear`` weights as (out, in) for ``x @ W.T``; manyheads
uses ``x @ W`` with W of shape (in, out), so weights are transposed on import.

This module only reads weights; the modules build themselves from the
:class:`FusedWeights` it returns (``MultiHeadAttention.from_torch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FusedWeights", "fused_weights", "import_module", "context_length_of",
           "tensor_to_numpy", "SUPPORTED", "DEFAULT_CONTEXT_LENGTH"]

DEFAULT_CONTEXT_LENGTH = 1024  # when the source records none

SUPPORTED = (
    "torch.nn.MultiheadAttention, the book's MultiHeadAttention (W_query/W_key/W_value/"
    "out_proj Linear layers with num_heads), the book's MultiHeadAttentionWrapper (a `heads` "
    "list of single-head modules) and Hugging Face GPT-2 attention (c_attn/c_proj)"
)


@dataclass
class FusedWeights:
    """The weights of multi-head attention in the fused layout, NumPy convention ``x @ W``.

    ``W_q``, ``W_k``, ``W_v`` are (d_in, d_out) with head h in columns
    h*head_dim..(h+1)*head_dim; biases (d_out,) or None; ``W_out`` (d_out,
    d_out) and ``b_out`` (d_out,), or None when there is no output projection;
    ``scale`` None means 1/sqrt(head_dim); ``rope_theta`` the base of rotary
    position embeddings, None for none; ``softcap``, ``sinks`` and
    ``alibi_slopes`` the scores' soft cap and the per-head sinks and slopes.
    """

    d_in: int
    d_out: int
    num_heads: int
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    b_q: np.ndarray | None
    b_k: np.ndarray | None
    b_v: np.ndarray | None
    W_out: np.ndarray | None
    b_out: np.ndarray | None
    scale: float | None
    dropout: float
    rope_theta: float | None = None
    causal: bool = True
    softcap: float | None = None  # c of the scores' soft cap, None: none
    sinks: np.ndarray | None = None  # (num_heads,) sink logits, None: none
    alibi_slopes: np.ndarray | None = None  # (num_heads,) ALiBi slopes, None: none


def tensor_to_numpy(t: Any, dtype: Any) -> np.ndarray:
    """A torch tensor (or parameter) copied into a NumPy array of ``dtype``."""
    return np.array(t.detach().cpu().numpy(), dtype=dtype)


def _linear(layer: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(W (in, out), b or None) of an nn.Linear."""
    w = tensor_to_numpy(layer.weight, dtype).T
    b = None if getattr(layer, "bias", None) is None else tensor_to_numpy(layer.bias, dtype)
    return w, b


def _kind(m: Any) -> str:
    name = type(m).__name__
    if name == "MultiheadAttention" and hasattr(m, "in_proj_weight") and hasattr(m, "out_proj"):
        return "torch_mha"
    if hasattr(m, "c_attn") and hasattr(m, "c_proj") and hasattr(m, "num_heads"):
        return "gpt2"
    if all(hasattr(m, a) for a in ("W_query", "W_key", "W_value", "out_proj", "num_heads")):
        return "book_fused"
    heads = getattr(m, "heads", None)
    if heads is not None and len(heads) > 0 and all(
            all(hasattr(h, a) for a in ("W_query", "W_key", "W_value")) for h in heads):
        return "book_wrapper"
    raise TypeError(f"cannot import weights from {type(m).__name__}; supported: {SUPPORTED}")


def fused_weights(m: Any, dtype: Any = np.float32) -> FusedWeights:
    """The weights of PyTorch attention module ``m`` (see the module docstring), as ``dtype``."""
    kind = _kind(m)
    if kind == "torch_mha":
        if m.in_proj_weight is None or not getattr(m, "_qkv_same_embed_dim", True):
            raise TypeError("nn.MultiheadAttention with kdim/vdim different from embed_dim "
                            "is not supported (queries, keys and values come from one x)")
        if m.bias_k is not None or m.add_zero_attn:
            raise TypeError("nn.MultiheadAttention with add_bias_kv or add_zero_attn "
                            "is not supported")
        E = m.embed_dim
        w = tensor_to_numpy(m.in_proj_weight, dtype)  # (3E, E): rows q, k, v
        b = None if m.in_proj_bias is None else tensor_to_numpy(m.in_proj_bias, dtype)
        W_out, b_out = _linear(m.out_proj, dtype)
        return FusedWeights(d_in=E, d_out=E, num_heads=m.num_heads, W_q=w[:E].T, W_k=w[E:2 * E].T,
                    W_v=w[2 * E:].T, b_q=None if b is None else b[:E],
                    b_k=None if b is None else b[E:2 * E], b_v=None if b is None else b[2 * E:],
                    W_out=W_out, b_out=b_out, scale=None, dropout=float(m.dropout))
    if kind == "gpt2":
        if getattr(m, "is_cross_attention", False):
            raise TypeError("GPT-2 cross-attention is not supported (self-attention only)")
        E = m.c_attn.weight.shape[0]
        w = tensor_to_numpy(m.c_attn.weight, dtype)  # Conv1D: (E, 3E), already x @ W
        b = tensor_to_numpy(m.c_attn.bias, dtype)
        scale = getattr(m, "scaling", None)
        if scale is None:
            scale = (m.head_dim ** -0.5) if getattr(m, "scale_attn_weights", True) else 1.0
            if getattr(m, "scale_attn_by_inverse_layer_idx", False):
                scale /= float(m.layer_idx + 1)
        return FusedWeights(d_in=E, d_out=E, num_heads=int(m.num_heads), W_q=w[:, :E],
                            W_k=w[:, E:2 * E],
                    W_v=w[:, 2 * E:], b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:],
                    W_out=tensor_to_numpy(m.c_proj.weight, dtype), b_out=tensor_to_numpy(m.c_proj.bias, dtype),
                    scale=float(scale), dropout=0.0)
    if kind == "book_fused":
        W_q, b_q = _linear(m.W_query, dtype)
        W_k, b_k = _linear(m.W_key, dtype)
        W_v, b_v = _linear(m.W_value, dtype)
        W_out, b_out = _linear(m.out_proj, dtype)
        drop = getattr(getattr(m, "dropout", None), "p", 0.0)
        return FusedWeights(d_in=W_q.shape[0], d_out=W_q.shape[1], num_heads=int(m.num_heads),
                            W_q=W_q,
                    W_k=W_k, W_v=W_v, b_q=b_q, b_k=b_k, b_v=b_v, W_out=W_out, b_out=b_out,
                    scale=None, dropout=float(drop))
    # book wrapper: per-head modules, concatenated, no output projection
    parts = [tuple(_linear(getattr(h, n), dtype) for n in ("W_query", "W_key", "W_value"))
             for h in m.heads]
    d_head = parts[0][0][0].shape[1]
    d_out = d_head * len(parts)

    def cat(i: int, bias: bool) -> Any:
        if bias:
            bs = [p[i][1] for p in parts]
            return None if any(b is None for b in bs) else np.concatenate(bs)  # type: ignore[arg-type]
        return np.concatenate([p[i][0] for p in parts], axis=1)

    drop = getattr(getattr(m.heads[0], "dropout", None), "p", 0.0)
    return FusedWeights(d_in=parts[0][0][0].shape[0], d_out=d_out, num_heads=len(parts),
                W_q=cat(0, False), W_k=cat(1, False), W_v=cat(2, False), b_q=cat(0, True),
                b_k=cat(1, True), b_v=cat(2, True), W_out=None, b_out=None, scale=None,
                dropout=float(drop))


def import_module(m: Any, *, causal: bool | None,
                  dtype: Any = np.float32) -> tuple[FusedWeights, int, bool]:
    """(weights, context length, batch_first) of PyTorch module ``m`` for the modules' from_torch.

    ``nn.MultiheadAttention`` does not record whether it is causal (its mask
    comes at call time), so ``causal`` must be given for it; the book's
    modules and GPT-2 are causal by construction (``causal=None`` means True).
    """
    kind = _kind(m)
    w = fused_weights(m, dtype)  # unsupported sources and settings fail first
    if causal is None and kind == "torch_mha":
        raise TypeError("nn.MultiheadAttention does not record whether it is causal: pass "
                        "causal=True (a decoder: query i sees keys 0..i) or causal=False "
                        "(an encoder: every query sees every key)")
    if causal is not None and not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    w.causal = True if causal is None else bool(causal)
    batch_first = bool(getattr(m, "batch_first", True)) if kind == "torch_mha" else True
    return w, context_length_of(m), batch_first


def context_length_of(m: Any, default: int = DEFAULT_CONTEXT_LENGTH) -> int:
    """The module's context length when it records one (the book's mask buffer, GPT-2's config)."""
    mask = getattr(m, "mask", None)
    if mask is not None and hasattr(mask, "shape") and len(mask.shape) == 2:
        return int(mask.shape[-1])
    cfg = getattr(m, "config", None)
    if cfg is not None and getattr(cfg, "n_positions", None):
        return int(cfg.n_positions)
    return default
