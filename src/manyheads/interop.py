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
* Hugging Face transformers' GPT-2 attention (``c_attn``/``c_proj`` Conv1D);
* Hugging Face transformers' decoder attention with ``q_proj``, ``k_proj``,
  ``v_proj`` and ``o_proj`` (Llama, Mistral, Qwen2, Gemma 2, gpt-oss and the
  like): grouped key/value heads, biases, the layer's scaling, sliding window,
  soft cap (Gemma 2) and sinks (gpt-oss), and plain rotary embeddings
  (``rope_type`` "default"); the output projection keeps its width.  Layers
  with per-head q/k norms or scaled rotary embeddings are refused: the
  model runner (``manyheads.models``) serves those.

PyTorch stores ``nn.Linear`` weights as (out, in) for ``x @ W.T``; manyheads
uses ``x @ W`` with W of shape (in, out), so weights are transposed on import.

This module only reads weights; the modules build themselves from the
:class:`FusedWeights` it returns (``MultiHeadAttention.from_torch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FusedWeights", "fused_weights", "import_module", "context_length_of", "alibi_slopes",
           "tensor_to_numpy", "SUPPORTED", "DEFAULT_CONTEXT_LENGTH"]

DEFAULT_CONTEXT_LENGTH = 1024  # when the source records none

SUPPORTED = (
    "torch.nn.MultiheadAttention, the book's MultiHeadAttention (W_query/W_key/W_value/"
    "out_proj Linear layers with num_heads), the book's MultiHeadAttentionWrapper (a `heads` "
    "list of single-head modules), Hugging Face GPT-2 attention (c_attn/c_proj), Hugging "
    "Face decoder attention (q_proj/k_proj/v_proj/o_proj with a config), and BLOOM, Falcon "
    "(query_key_value/dense) and MPT (Wqkv/out_proj) attention with their ALiBi"
)


@dataclass
class FusedWeights:
    """The weights of multi-head attention in the fused layout, NumPy convention ``x @ W``.

    ``W_q``, ``W_k``, ``W_v`` are (d_in, d_out) with head h in columns
    h*head_dim..(h+1)*head_dim (keys and values: as many columns as their
    heads, fewer with grouped-query attention); biases likewise or None;
    ``W_out`` (d_out, n) and ``b_out`` (n,), n the output width (d_out but for
    layers that project back to another width), or None when there is no
    output projection;
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
    window: int | None = None  # sliding window of the layer, None: none


def tensor_to_numpy(t: Any, dtype: Any) -> np.ndarray:
    """A torch tensor (or parameter) copied into a NumPy array of ``dtype``."""
    t = t.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":  # (NumPy has no bfloat16 of its own)
        t = t.float()
    return np.array(t.numpy(), dtype=dtype)


def _linear(layer: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(W (in, out), b or None) of an nn.Linear."""
    w = tensor_to_numpy(layer.weight, dtype).T
    b = None if getattr(layer, "bias", None) is None else tensor_to_numpy(layer.bias, dtype)
    return w, b


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for ``num_heads`` heads, float64: the geometric sequence
    2^(-8/n), 2^(-16/n), ... for the largest power of two n <= num_heads, then, for the
    heads past n, every other slope of the sequence for 2n."""
    n = 1 << (int(num_heads).bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-8.0 * (2 * i + 1) / (2 * n)) for i in range(num_heads - n)]
    return np.array(slopes)


def _kind(m: Any) -> str:
    name = type(m).__name__
    if name == "MultiheadAttention" and hasattr(m, "in_proj_weight") and hasattr(m, "out_proj"):
        return "torch_mha"
    if hasattr(m, "c_attn") and hasattr(m, "c_proj") and hasattr(m, "num_heads"):
        return "gpt2"
    if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "config",
                                   "head_dim")):
        return "hf_decoder"
    if all(hasattr(m, a) for a in ("query_key_value", "dense", "num_heads", "head_dim",
                                   "inv_norm_factor")):
        return "bloom_falcon"
    if all(hasattr(m, a) for a in ("Wqkv", "out_proj", "n_heads", "head_dim", "softmax_scale")):
        return "mpt"
    if all(hasattr(m, a) for a in ("W_query", "W_key", "W_value", "out_proj", "num_heads")):
        return "book_fused"
    heads = getattr(m, "heads", None)
    if heads is not None and len(heads) > 0 and all(
            all(hasattr(h, a) for a in ("W_query", "W_key", "W_value")) for h in heads):
        return "book_wrapper"
    if _is_book_head(m):
        raise TypeError(f"{type(m).__name__} is one head (the book's CausalAttention): import it "
                        "with manyheads.CausalAttention.from_torch")
    raise TypeError(f"cannot import weights from {type(m).__name__}; supported: {SUPPORTED}")


def _is_book_head(m: Any) -> bool:
    """Whether ``m`` looks like the book's single-head ``CausalAttention``: W_query, W_key
    and W_value linear layers and neither heads nor an output projection."""
    return all(hasattr(getattr(m, a, None), "weight") for a in ("W_query", "W_key", "W_value")) \
        and not any(hasattr(m, a) for a in ("out_proj", "num_heads", "heads"))


def book_head(m: Any, dtype: Any = np.float32) -> tuple[list[tuple[np.ndarray, Any]], float]:
    """((W, b) of W_query, W_key and W_value, each W (d_in, d_out) and b (d_out,) or None;
    the dropout probability) of the book's single-head ``CausalAttention`` ``m``."""
    if not _is_book_head(m):
        raise TypeError(f"cannot import a head from {type(m).__name__}: expected the book's "
                        "CausalAttention (W_query, W_key and W_value nn.Linear layers, no "
                        "heads or output projection); for multi-head modules use "
                        "MultiHeadAttention.from_torch")
    parts = [_linear(getattr(m, n), dtype) for n in ("W_query", "W_key", "W_value")]
    if len({w.shape for w, _ in parts}) != 1:
        raise TypeError("W_query, W_key and W_value must have one shape, got "
                        f"{[w.shape for w, _ in parts]}")
    drop = getattr(getattr(m, "dropout", None), "p", 0.0)
    return parts, float(drop)


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
    if kind == "hf_decoder":
        return _hf_decoder_weights(m, dtype)
    if kind == "bloom_falcon":
        return _bloom_falcon_weights(m, dtype)
    if kind == "mpt":
        return _mpt_weights(m, dtype)
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


def _hf_rope_theta(cfg: Any) -> float:
    """The base of a transformers config's plain rotary embeddings, read as the model
    runner reads a config.json; TypeError for any other kind (scaled, partial, or given
    per layer type)."""
    from .models._rope import rope_parameters_of  # (lazily: that package imports this one)

    try:
        params = rope_parameters_of(cfg.to_dict())
    except ValueError:
        raise TypeError("rotary embeddings set per layer type cannot be imported into one "
                        "module; manyheads.models.from_pretrained runs such models") from None
    if params["rope_type"] != "default":
        raise TypeError(f"rotary embeddings of type {params['rope_type']!r} cannot be imported "
                        "(the modules rotate by plain rope_theta); "
                        "manyheads.models.from_pretrained runs such models")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise TypeError("partial rotary embeddings cannot be imported; "
                        "manyheads.models.from_pretrained runs such models")
    return float(params["rope_theta"])


def _hf_decoder_weights(m: Any, dtype: Any) -> FusedWeights:
    """A transformers decoder attention layer (q_proj/k_proj/v_proj/o_proj)."""
    if getattr(m, "q_norm", None) is not None or getattr(m, "k_norm", None) is not None:
        raise TypeError(f"{type(m).__name__} normalises each head's queries and keys "
                        "(Qwen3, Gemma 3), which the modules do not; "
                        "manyheads.models.from_pretrained runs such models")
    cfg = m.config
    H = int(cfg.num_attention_heads)
    Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
    D = int(m.head_dim)
    W_q, b_q = _linear(m.q_proj, dtype)
    W_k, b_k = _linear(m.k_proj, dtype)
    W_v, b_v = _linear(m.v_proj, dtype)
    W_out, b_out = _linear(m.o_proj, dtype)
    if W_q.shape[1] != H * D or W_k.shape[1] != Hkv * D or W_out.shape[0] != H * D:
        raise TypeError(f"{type(m).__name__}'s projections do not match {H} heads and {Hkv} "
                        f"key/value heads of {D}")
    if (b_q is None) != (b_k is None) or (b_q is None) != (b_v is None):
        raise TypeError("the query, key and value projections must all have biases or none")
    # the layer's own window (Gemma 2, gpt-oss, Qwen2: None on full layers), else the
    # config's (Mistral's applies to every layer)
    window = getattr(m, "sliding_window") if hasattr(m, "sliding_window") \
        else getattr(cfg, "sliding_window", None)
    softcap = getattr(m, "attn_logit_softcapping", None)
    sinks = getattr(m, "sinks", None)
    return FusedWeights(d_in=W_q.shape[0], d_out=H * D, num_heads=H, W_q=W_q, W_k=W_k,
                        W_v=W_v, b_q=b_q, b_k=b_k, b_v=b_v, W_out=W_out, b_out=b_out,
                        scale=float(m.scaling), dropout=float(getattr(cfg, "attention_dropout",
                                                                      0.0) or 0.0),
                        rope_theta=_hf_rope_theta(cfg),
                        softcap=None if softcap is None else float(softcap),
                        sinks=None if sinks is None else tensor_to_numpy(sinks, dtype),
                        window=None if window is None else int(window))


def _bloom_falcon_weights(m: Any, dtype: Any) -> FusedWeights:
    """A BLOOM or Falcon attention layer: one fused query_key_value projection, dense.

    BLOOM (and Falcon with ``alibi``) add ALiBi with the paper's slopes; BLOOM to the
    scaled scores, Falcon before the scale, so its slopes are scaled too.  Falcon
    rounds its slopes to bfloat16, and so does this; it also rounds each position's
    bias (slope times distance) to bfloat16, which a slope cannot say: exact where the
    products are (8 heads or fewer), within 2^-9 of each bias elsewhere.  Falcon
    without ALiBi rotates by plain rotary embeddings.  query_key_value's rows are head
    by head (q, k, v) for BLOOM and Falcon's first layout, (q heads of a key/value
    head, k, v) per key/value head for Falcon's new decoder architecture, or all the q
    heads, then one k and one v head with ``multi_query``."""
    cfg: Any = getattr(m, "config", None)  # Falcon keeps its config; BLOOM does not
    falcon = getattr(cfg, "model_type", None) == "falcon"
    H, D = int(m.num_heads), int(m.head_dim)
    W, b = _linear(m.query_key_value, dtype)  # (d_in, rows of the fused projection)

    def split(a: np.ndarray) -> list[np.ndarray]:
        """q, k and v of the fused projection's last axis."""
        lead = a.shape[:-1]
        if falcon and cfg.new_decoder_architecture:
            Hkv = int(cfg.num_kv_heads)
            heads = a.reshape(lead + (Hkv, H // Hkv + 2, D))
            return [heads[..., :-2, :].reshape(lead + (H * D,)),
                    heads[..., -2, :].reshape(lead + (Hkv * D,)),
                    heads[..., -1, :].reshape(lead + (Hkv * D,))]
        if falcon and cfg.multi_query:
            return [a[..., :H * D], a[..., H * D:(H + 1) * D], a[..., (H + 1) * D:]]
        heads = a.reshape(lead + (H, 3, D))
        return [heads[..., i, :].reshape(lead + (H * D,)) for i in range(3)]

    W_q, W_k, W_v = split(W)
    b_q, b_k, b_v = [None, None, None] if b is None else split(b)
    W_out, b_out = _linear(m.dense, dtype)
    scale = float(m.inv_norm_factor)
    alibi = bool(cfg.alibi) if falcon else True
    slopes = None
    if alibi and falcon:  # Falcon rounds its slopes to bfloat16 (and each bias too)
        import torch

        slopes = torch.tensor(alibi_slopes(H), dtype=torch.float32).bfloat16().double() \
            .numpy() * scale
    elif alibi:
        slopes = alibi_slopes(H)
    drop = getattr(getattr(m, "attention_dropout", None), "p", 0.0)
    return FusedWeights(d_in=W.shape[0], d_out=H * D, num_heads=H, W_q=W_q, W_k=W_k, W_v=W_v,
                        b_q=b_q, b_k=b_k, b_v=b_v, W_out=W_out, b_out=b_out, scale=scale,
                        dropout=float(drop),
                        rope_theta=None if alibi or not falcon else _hf_rope_theta(cfg),
                        alibi_slopes=None if slopes is None else slopes.astype(dtype))


def _mpt_weights(m: Any, dtype: Any) -> FusedWeights:
    """An MPT attention layer: Wqkv (q, k, v side by side), out_proj, ALiBi with MPT's
    slopes (2^(-8 i / n) for i = 1 .. n, n the power of two at or above the heads;
    for fewer heads than n, the odd-numbered ones first, then the even-numbered)."""
    if getattr(m, "clip_qkv", None):
        raise TypeError("MPT attention with clip_qkv (its q, k and v clamped) cannot be "
                        "imported")
    H, D = int(m.n_heads), int(m.head_dim)
    W, b = _linear(m.Wqkv, dtype)
    W_out, b_out = _linear(m.out_proj, dtype)
    n = 1 << max(0, (H - 1).bit_length())
    slopes = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
    if n != H:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:H]
    E = H * D
    return FusedWeights(d_in=W.shape[0], d_out=E, num_heads=H, W_q=W[:, :E], W_k=W[:, E:2 * E],
                        W_v=W[:, 2 * E:], b_q=None if b is None else b[:E],
                        b_k=None if b is None else b[E:2 * E],
                        b_v=None if b is None else b[2 * E:], W_out=W_out, b_out=b_out,
                        scale=float(m.softmax_scale), dropout=float(m.attn_dropout_p or 0.0),
                        alibi_slopes=slopes.astype(dtype))


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
    """The module's context length when it records one (the book's mask buffer, that of
    the first of a wrapper's heads, GPT-2's config)."""
    mask = getattr(m, "mask", None)
    heads = getattr(m, "heads", None)
    if mask is None and heads is not None and hasattr(heads, "__getitem__") and len(heads):
        mask = getattr(heads[0], "mask", None)  # (the book's MultiHeadAttentionWrapper)
    if mask is not None and hasattr(mask, "shape") and len(mask.shape) == 2:
        return int(mask.shape[-1])
    if getattr(m, "max_seq_length", None):  # MPT
        return int(m.max_seq_length)
    cfg = getattr(m, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        if cfg is not None and getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return default
