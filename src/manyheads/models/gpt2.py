"""GPT-2 run in NumPy with every attention layer on manyheads.

:class:`GPT2` takes a Hugging Face ``GPT2LMHeadModel`` (torch is needed only
to read its weights): embeddings, LayerNorms and MLPs are NumPy; each block's
attention is a fused :class:`~manyheads.MultiHeadAttention` fed a KV cache
when decoding.  float32 throughout.
"""
from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from ..functional import linear
from ..interop import tensor_to_numpy
from ..modules import MultiHeadAttention

__all__ = ["GPT2"]


class _Block(TypedDict):
    """One transformer block of :class:`GPT2`: LayerNorm (weight, bias) pairs, attention, MLP."""

    ln1: tuple[np.ndarray, np.ndarray]
    attn: MultiHeadAttention
    ln2: tuple[np.ndarray, np.ndarray]
    fc: tuple[np.ndarray, np.ndarray]
    proj: tuple[np.ndarray, np.ndarray]


class GPT2:
    """A Hugging Face ``GPT2LMHeadModel`` run in NumPy, every attention layer on manyheads.

    Embeddings, LayerNorms and GELU are NumPy; the MLP and LM-head products
    run through :func:`manyheads.linear` on the same threads as the attention;
    each block's attention is a fused :class:`~manyheads.MultiHeadAttention`
    imported with ``from_torch`` and fed a KV cache when decoding.  float32
    throughout.

    >>> runner = GPT2(hf_model)                     # doctest: +SKIP
    >>> tokens = runner.generate([464, 3290], 20)   # greedy, with the KV cache
    """

    def __init__(self, model: Any) -> None:
        tr = getattr(model, "transformer", model)
        cfg = model.config
        if getattr(cfg, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {cfg.activation_function!r}")
        f32 = np.float32
        self.eps = float(cfg.layer_norm_epsilon)
        self.n_positions = int(cfg.n_positions)
        self.wte = tensor_to_numpy(tr.wte.weight, f32)
        self.wpe = tensor_to_numpy(tr.wpe.weight, f32)
        lm_head = getattr(model, "lm_head", None)
        self.head = self.wte.T.copy() if lm_head is None else tensor_to_numpy(lm_head.weight, f32).T.copy()
        self.blocks: list[_Block] = []
        for blk in tr.h:
            self.blocks.append({
                "ln1": (tensor_to_numpy(blk.ln_1.weight, f32), tensor_to_numpy(blk.ln_1.bias, f32)),
                "attn": MultiHeadAttention.from_torch(blk.attn, context_length=self.n_positions),
                "ln2": (tensor_to_numpy(blk.ln_2.weight, f32), tensor_to_numpy(blk.ln_2.bias, f32)),
                "fc": (tensor_to_numpy(blk.mlp.c_fc.weight, f32), tensor_to_numpy(blk.mlp.c_fc.bias, f32)),
                "proj": (tensor_to_numpy(blk.mlp.c_proj.weight, f32), tensor_to_numpy(blk.mlp.c_proj.bias, f32)),
            })
        self.ln_f = (tensor_to_numpy(tr.ln_f.weight, f32), tensor_to_numpy(tr.ln_f.bias, f32))

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

    def logits(self, ids: Any, start: int = 0, caches: list[Any] | None = None, *,
               last_only: bool = False) -> np.ndarray:
        """Logits (B, T, vocab) for token ids (B, T) at positions start.. (caches hold the rest).

        ``last_only`` computes the logits of the last position only, (B, 1, vocab).
        """
        ids = np.atleast_2d(np.asarray(ids))
        x = self.wte[ids] + self.wpe[start:start + ids.shape[1]]
        for i, b in enumerate(self.blocks):
            h = b["attn"](self._ln(x, b["ln1"]), cache=None if caches is None else caches[i])
            x = x + h
            m = self._gelu(linear(self._ln(x, b["ln2"]), *b["fc"]))
            x = x + linear(m, *b["proj"])
        if last_only:
            x = x[:, -1:]
        return linear(self._ln(x, self.ln_f), self.head)

    def generate(self, prompt: Any, n: int) -> list[int]:
        """Greedy decoding of n tokens after the prompt, with the KV cache."""
        tokens = [int(t) for t in prompt]
        caches = self.new_caches(1, len(tokens) + n)
        logits = self.logits([tokens], 0, caches, last_only=True)[0, -1]
        out: list[int] = []
        for step in range(n):
            out.append(int(np.argmax(logits)))
            if step + 1 < n:
                logits = self.logits([[out[-1]]], len(tokens) + step, caches,
                                     last_only=True)[0, -1]
        return out
