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
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np

if TYPE_CHECKING:
    from .modules import MultiHeadAttention

SUPPORTED = (
    "torch.nn.MultiheadAttention, the book's MultiHeadAttention (W_query/W_key/W_value/"
    "out_proj Linear layers with num_heads), the book's MultiHeadAttentionWrapper (a `heads` "
    "list of single-head modules) and Hugging Face GPT-2 attention (c_attn/c_proj)"
)


def _np(t: Any, dtype: Any) -> np.ndarray:
    return np.array(t.detach().cpu().numpy(), dtype=dtype)


def _linear(layer: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(W (in, out), b or None) of an nn.Linear."""
    w = _np(layer.weight, dtype).T
    b = None if getattr(layer, "bias", None) is None else _np(layer.bias, dtype)
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


def fused_weights(m: Any, dtype: Any = np.float32) -> dict[str, Any]:
    """Everything a fused :class:`~manyheads.MultiHeadAttention` needs, from module ``m``.

    Returns a dict with d_in, d_out, num_heads, W_q, W_k, W_v (d_in, d_out),
    b_q, b_k, b_v (or None), W_out (d_out, d_out), b_out, scale (or None) and
    dropout.
    """
    kind = _kind(m)
    if kind == "torch_mha":
        if m.in_proj_weight is None or not getattr(m, "_qkv_same_embed_dim", True):
            raise TypeError("nn.MultiheadAttention with kdim/vdim different from embed_dim "
                            "is not supported (queries, keys and values come from one x)")
        if m.bias_k is not None or m.add_zero_attn:
            raise TypeError("nn.MultiheadAttention with add_bias_kv or add_zero_attn "
                            "is not supported")
        E = m.embed_dim
        w = _np(m.in_proj_weight, dtype)  # (3E, E): rows q, k, v
        b = None if m.in_proj_bias is None else _np(m.in_proj_bias, dtype)
        W_out, b_out = _linear(m.out_proj, dtype)
        return dict(d_in=E, d_out=E, num_heads=m.num_heads, W_q=w[:E].T, W_k=w[E:2 * E].T,
                    W_v=w[2 * E:].T, b_q=None if b is None else b[:E],
                    b_k=None if b is None else b[E:2 * E], b_v=None if b is None else b[2 * E:],
                    W_out=W_out, b_out=b_out, scale=None, dropout=float(m.dropout))
    if kind == "gpt2":
        if getattr(m, "is_cross_attention", False):
            raise TypeError("GPT-2 cross-attention is not supported (self-attention only)")
        E = m.c_attn.weight.shape[0]
        w = _np(m.c_attn.weight, dtype)  # Conv1D: (E, 3E), already x @ W
        b = _np(m.c_attn.bias, dtype)
        scale = getattr(m, "scaling", None)
        if scale is None:
            scale = (m.head_dim ** -0.5) if getattr(m, "scale_attn_weights", True) else 1.0
            if getattr(m, "scale_attn_by_inverse_layer_idx", False):
                scale /= float(m.layer_idx + 1)
        return dict(d_in=E, d_out=E, num_heads=int(m.num_heads), W_q=w[:, :E], W_k=w[:, E:2 * E],
                    W_v=w[:, 2 * E:], b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:],
                    W_out=_np(m.c_proj.weight, dtype), b_out=_np(m.c_proj.bias, dtype),
                    scale=float(scale), dropout=0.0)
    if kind == "book_fused":
        W_q, b_q = _linear(m.W_query, dtype)
        W_k, b_k = _linear(m.W_key, dtype)
        W_v, b_v = _linear(m.W_value, dtype)
        W_out, b_out = _linear(m.out_proj, dtype)
        drop = getattr(getattr(m, "dropout", None), "p", 0.0)
        return dict(d_in=W_q.shape[0], d_out=W_q.shape[1], num_heads=int(m.num_heads), W_q=W_q,
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
            return None if bs[0] is None else np.concatenate(cast("list[np.ndarray]", bs))
        return np.concatenate([p[i][0] for p in parts], axis=1)

    drop = getattr(getattr(m.heads[0], "dropout", None), "p", 0.0)
    return dict(d_in=parts[0][0][0].shape[0], d_out=d_out, num_heads=len(parts),
                W_q=cat(0, False), W_k=cat(1, False), W_v=cat(2, False), b_q=cat(0, True),
                b_k=cat(1, True), b_v=cat(2, True), W_out=None, b_out=None, scale=None,
                dropout=float(drop))


def context_length_of(m: Any, default: int = 1024) -> int:
    """The module's context length when it records one (the book's mask buffer, GPT-2's config)."""
    mask = getattr(m, "mask", None)
    if mask is not None and hasattr(mask, "shape") and len(mask.shape) == 2:
        return int(mask.shape[-1])
    cfg = getattr(m, "config", None)
    if cfg is not None and getattr(cfg, "n_positions", None):
        return int(cfg.n_positions)
    return default


class _Block(TypedDict):
    """One transformer block of :class:`GPT2`: LayerNorm (weight, bias) pairs, attention, MLP."""

    ln1: tuple[np.ndarray, np.ndarray]
    attn: MultiHeadAttention
    ln2: tuple[np.ndarray, np.ndarray]
    fc: tuple[np.ndarray, np.ndarray]
    proj: tuple[np.ndarray, np.ndarray]


class GPT2:
    """A Hugging Face ``GPT2LMHeadModel`` run in NumPy, every attention layer on manyheads.

    Embeddings, LayerNorms and MLPs are NumPy; each block's attention is a
    fused :class:`~manyheads.MultiHeadAttention` imported with ``from_torch``
    and fed a KV cache when decoding.  float32 throughout.

    >>> runner = GPT2(hf_model)                     # doctest: +SKIP
    >>> tokens = runner.generate([464, 3290], 20)   # greedy, with the KV cache
    """

    def __init__(self, model: Any) -> None:
        from .modules import MultiHeadAttention

        tr = getattr(model, "transformer", model)
        cfg = model.config
        if getattr(cfg, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {cfg.activation_function!r}")
        f32 = np.float32
        self.eps = float(cfg.layer_norm_epsilon)
        self.n_positions = int(cfg.n_positions)
        self.wte = _np(tr.wte.weight, f32)
        self.wpe = _np(tr.wpe.weight, f32)
        lm_head = getattr(model, "lm_head", None)
        self.head = self.wte.T.copy() if lm_head is None else _np(lm_head.weight, f32).T.copy()
        self.blocks: list[_Block] = []
        for blk in tr.h:
            self.blocks.append({
                "ln1": (_np(blk.ln_1.weight, f32), _np(blk.ln_1.bias, f32)),
                "attn": MultiHeadAttention.from_torch(blk.attn, context_length=self.n_positions),
                "ln2": (_np(blk.ln_2.weight, f32), _np(blk.ln_2.bias, f32)),
                "fc": (_np(blk.mlp.c_fc.weight, f32), _np(blk.mlp.c_fc.bias, f32)),
                "proj": (_np(blk.mlp.c_proj.weight, f32), _np(blk.mlp.c_proj.bias, f32)),
            })
        self.ln_f = (_np(tr.ln_f.weight, f32), _np(tr.ln_f.bias, f32))

    def _ln(self, x: np.ndarray, p: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        y: np.ndarray = (x - mu) / np.sqrt(var + self.eps) * p[0] + p[1]
        return y

    @staticmethod
    def _gelu(x: np.ndarray) -> np.ndarray:
        y: np.ndarray = 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654)
                                                 * (x + 0.044715 * x**3)))
        return y

    def new_caches(self, batch_size: int, max_len: int) -> list[Any]:
        return [b["attn"].new_cache(batch_size, max_len) for b in self.blocks]

    def logits(self, ids: Any, start: int = 0, caches: list[Any] | None = None) -> np.ndarray:
        """Logits (B, T, vocab) for token ids (B, T) at positions start.. (caches hold the rest)."""
        ids = np.atleast_2d(np.asarray(ids))
        x = self.wte[ids] + self.wpe[start:start + ids.shape[1]]
        for i, b in enumerate(self.blocks):
            h = b["attn"](self._ln(x, b["ln1"]), cache=None if caches is None else caches[i])
            x = x + h
            m = self._gelu(self._ln(x, b["ln2"]) @ b["fc"][0] + b["fc"][1])
            x = x + (m @ b["proj"][0] + b["proj"][1])
        out: np.ndarray = self._ln(x, self.ln_f) @ self.head
        return out

    def generate(self, prompt: Any, n: int) -> list[int]:
        """Greedy decoding of n tokens after the prompt, with the KV cache."""
        tokens = [int(t) for t in prompt]
        caches = self.new_caches(1, len(tokens) + n)
        logits = self.logits([tokens], 0, caches)[0, -1]
        out: list[int] = []
        for step in range(n):
            out.append(int(np.argmax(logits)))
            if step + 1 < n:
                logits = self.logits([[out[-1]]], len(tokens) + step, caches)[0, -1]
        return out
