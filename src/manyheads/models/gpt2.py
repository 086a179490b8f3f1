"""GPT-2 in NumPy with every attention layer on manyheads.

A block is ``x + attn(ln_1(x))`` then ``x + proj(gelu(fc(ln_2(x))))`` with LayerNorms
(weight and bias) and learned absolute position embeddings.  GPT-2 checkpoints store
their projections as ``Conv1D`` weights, already (in, out): they are used as they are.
The query, key and value projection is one (d, 3d) matrix, which is exactly the fused
module's packed ``W_qkv``.

:func:`manyheads.models.from_pretrained` reads a checkpoint folder (no torch);
:meth:`GPT2.from_transformers` takes a live Hugging Face ``GPT2LMHeadModel`` instead and
reads its state dict into the same arrays.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..cache import KVCache
from ..modules import MultiHeadAttention
from ._checkpoint import ArrayTensors, TensorSource, config_float, config_int
from ._decoder import DecoderModel, eos_of, layer_norm, project

__all__ = ["GPT2", "GPT2Block"]

_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
ACTIVATIONS = _TANH_GELUS + ("gelu",)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh form, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, in place."""
    t = np.square(x)
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= _SQRT_2_OVER_PI
    np.tanh(t, out=t)
    t += np.float32(1.0)
    x *= t
    x *= np.float32(0.5)
    return x


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """The exact GELU, ``x Phi(x)`` with the normal CDF through erf, in place."""
    from scipy.special import erf  # type: ignore[import-untyped]

    t = x * np.float32(0.7071067811865476)
    erf(t, out=t)
    t += np.float32(1.0)
    x *= t
    x *= np.float32(0.5)
    return x


class GPT2Block:
    """One GPT-2 block: LayerNorm, attention, residual; LayerNorm, GELU MLP, residual."""

    def __init__(self, attn: MultiHeadAttention, ln_1: tuple[np.ndarray, np.ndarray],
                 ln_2: tuple[np.ndarray, np.ndarray], fc: tuple[np.ndarray, np.ndarray],
                 proj: tuple[np.ndarray, np.ndarray], eps: float, exact_gelu: bool) -> None:
        self.attn = attn
        self.ln_1, self.ln_2, self.fc, self.proj = ln_1, ln_2, fc, proj
        self.eps = eps
        self.gelu = gelu_erf if exact_gelu else gelu_tanh

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        return layer_norm(x, *self.ln_1, self.eps)

    def __call__(self, x: np.ndarray, cache: KVCache | None,
                 pad: np.ndarray | None) -> np.ndarray:
        x += self.attn(layer_norm(x, *self.ln_1, self.eps), cache=cache, key_padding_mask=pad)
        h = self.gelu(project(layer_norm(x, *self.ln_2, self.eps), *self.fc))
        x += project(h, *self.proj)
        return x


class GPT2(DecoderModel):
    """A GPT-2 checkpoint (``model_type`` gpt2).

    Build it with :func:`manyheads.models.from_pretrained` (a folder) or
    :meth:`from_transformers` (a live Hugging Face model); ``logits`` and
    ``generate`` are :class:`~manyheads.models._decoder.DecoderModel`'s.
    """

    model_type = "gpt2"
    learned_positions = True

    def __init__(self, cfg: dict[str, Any], ckpt: TensorSource) -> None:
        self.vocab_size = config_int(cfg, "vocab_size")
        d = self.d_model = config_int(cfg, "n_embd", "hidden_size")
        self.num_layers = config_int(cfg, "n_layer", "num_hidden_layers")
        H = self.num_heads = self.num_kv_heads = config_int(cfg, "n_head", "num_attention_heads")
        self.context_length = config_int(cfg, "n_positions", "max_position_embeddings")
        self.d_ff = config_int(cfg, "n_inner", default=4 * d)
        self.eps = config_float(cfg, "layer_norm_epsilon", default=1e-5)
        if d % H:
            raise ValueError(f"malformed config.json: n_embd {d} is not a multiple of n_head {H}")
        self.head_dim = d // H
        act = cfg.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation_function {act!r} is not supported: one of "
                             f"{', '.join(ACTIVATIONS)}")
        self.activation = str(act)
        if cfg.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention is not a decoder-only model")
        tie = bool(cfg.get("tie_word_embeddings", True))
        self.eos_token_id = eos_of(cfg)
        scale_weights = bool(cfg.get("scale_attn_weights", True))
        by_layer = bool(cfg.get("scale_attn_by_inverse_layer_idx", False))

        p = "transformer." if "transformer.wte.weight" in ckpt else ""
        # wte (vocab, d) is held as (d, vocab) columns, the LM head itself when tied
        wte = ckpt.linear(p + "wte.weight", d, self.vocab_size)
        self.tied_embeddings = ckpt.tied_head(tie, p + "wte.weight")
        self.wpe = ckpt.get(p + "wpe.weight", (self.context_length, d))
        self.wte: Any = None if self.tied_embeddings else wte
        self.head = wte if self.tied_embeddings else \
            ckpt.linear("lm_head.weight", d, self.vocab_size)
        del wte
        self.blocks: list[GPT2Block] = []
        for i in range(self.num_layers):
            b = f"{p}h.{i}."
            scale = None  # 1/sqrt(head_dim), the module's default
            if by_layer or not scale_weights:
                scale = (self.head_dim ** -0.5 if scale_weights else 1.0) / (i + 1 if by_layer
                                                                            else 1)
            attn = MultiHeadAttention(d, d, self.context_length, 0.0, H, qkv_bias=True,
                                      scale=scale, seed=0)
            attn.W_qkv = ckpt.linear(b + "attn.c_attn.weight", d, 3 * d, transposed=False)
            assert attn.b_qkv is not None
            attn.b_qkv[...] = ckpt.get(b + "attn.c_attn.bias", (3 * d,))
            attn.W_out = ckpt.linear(b + "attn.c_proj.weight", d, d, transposed=False)
            attn.b_out[...] = ckpt.get(b + "attn.c_proj.bias", (d,))
            self.blocks.append(GPT2Block(
                attn,
                (ckpt.get(b + "ln_1.weight", (d,)), ckpt.get(b + "ln_1.bias", (d,))),
                (ckpt.get(b + "ln_2.weight", (d,)), ckpt.get(b + "ln_2.bias", (d,))),
                (ckpt.linear(b + "mlp.c_fc.weight", d, self.d_ff, transposed=False),
                 ckpt.get(b + "mlp.c_fc.bias", (self.d_ff,))),
                (ckpt.linear(b + "mlp.c_proj.weight", self.d_ff, d, transposed=False),
                 ckpt.get(b + "mlp.c_proj.bias", (d,))),
                self.eps, exact_gelu=self.activation == "gelu"))
        self.ln_f = (ckpt.get(p + "ln_f.weight", (d,)), ckpt.get(p + "ln_f.bias", (d,)))

    @classmethod
    def from_transformers(cls, model: Any) -> "GPT2":
        """The same model built from a live Hugging Face ``GPT2LMHeadModel`` (or
        ``GPT2Model``): its config and state dict are copied into NumPy arrays."""
        from ..interop import tensor_to_numpy

        cfg = model.config.to_dict()
        cfg.setdefault("model_type", "gpt2")
        arrays = {k: tensor_to_numpy(v, np.float32) for k, v in model.state_dict().items()}
        if "transformer.wte.weight" not in arrays and "wte.weight" not in arrays:
            raise TypeError(f"{type(model).__name__} is not a Hugging Face GPT-2 model "
                            "(no wte.weight in its state dict)")
        return cls(cfg, ArrayTensors(arrays))

    def _embed(self, ids: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        assert positions is not None
        x = self._token_rows(self.wte, ids)
        x += self.wpe[positions]
        return x

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        return layer_norm(x, *self.ln_f, self.eps)

    def _describe(self) -> str:
        return f"LayerNorm, {self.activation} MLP, learned positions"

    def parameters(self) -> list[np.ndarray]:
        ps = [self.head, self.wpe, *self.ln_f] + ([] if self.wte is None else [self.wte])
        for b in self.blocks:
            assert b.attn.b_qkv is not None
            ps += [b.attn.W_qkv, b.attn.b_qkv, b.attn.W_out, b.attn.b_out, *b.ln_1, *b.ln_2,
                   *b.fc, *b.proj]
        return ps
