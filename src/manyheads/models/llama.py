"""Llama-family decoders (Llama, SmolLM, TinyLlama; Qwen2 in :mod:`.qwen2`) in NumPy.

A block is ``x + attn(rms_norm(x))`` then ``x + down(silu(gate(h)) * up(h))`` with
``h = rms_norm(x)``; the attention is a fused :class:`~manyheads.MultiHeadAttention`
with rotary position embeddings (``rotate_half`` layout, base ``rope_theta``) and
grouped-query key/value heads.  RMSNorm divides by ``sqrt(mean(x**2) + eps)`` and then
multiplies by its weight.  The gate and up projections are packed into one
(d_model, 2 * d_ff) matrix, so one :func:`manyheads.linear` call serves both.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..cache import KVCache
from ..functional import linear
from ..modules import MultiHeadAttention
from ._checkpoint import TensorSource, config_float, config_int
from ._decoder import DecoderModel, eos_of, rms_norm

__all__ = ["Llama", "LlamaBlock"]


def rope_theta_of(cfg: dict[str, Any]) -> float:
    """The rotary base of a config (``rope_parameters`` of transformers 5, else
    ``rope_theta``); ValueError for rotary scaling, which the modules do not have."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"malformed config.json: 'rope_parameters' must be an object, "
                         f"got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"malformed config.json: 'rope_scaling' must be an object or null, "
                         f"got {scaling!r}")
    for p in (params, scaling):
        kind = None if p is None else p.get("rope_type", p.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"rotary scaling {kind!r} is not supported: only plain rotary "
                             "embeddings (rope_type 'default')")
    if params is not None and "rope_theta" in params:
        return config_float(params, "rope_theta")
    return config_float(cfg, "rope_theta", default=10000.0)


def silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` written into ``gate`` (one temporary)."""
    t = np.negative(gate)
    with np.errstate(over="ignore"):  # exp(-gate) -> inf gives silu -> 0, as it should
        np.exp(t, out=t)
    t += 1.0
    np.divide(gate, t, out=gate)
    gate *= up
    return gate


class LlamaBlock:
    """One Llama block: RMSNorm, attention, residual; RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, attn: MultiHeadAttention, norm_attn: np.ndarray, norm_mlp: np.ndarray,
                 w_gate_up: np.ndarray, b_gate_up: np.ndarray | None, w_down: np.ndarray,
                 b_down: np.ndarray | None, eps: float) -> None:
        self.attn = attn
        self.norm_attn, self.norm_mlp = norm_attn, norm_mlp
        self.w_gate_up, self.b_gate_up = w_gate_up, b_gate_up
        self.w_down, self.b_down = w_down, b_down
        self.d_ff = w_down.shape[0]
        self.eps = eps

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.norm_attn, self.eps)

    def __call__(self, x: np.ndarray, cache: KVCache | None,
                 pad: np.ndarray | None) -> np.ndarray:
        x += self.attn(rms_norm(x, self.norm_attn, self.eps), cache=cache, key_padding_mask=pad)
        gu = linear(rms_norm(x, self.norm_mlp, self.eps), self.w_gate_up, self.b_gate_up)
        F = self.d_ff
        x += linear(silu_times(gu[..., :F], gu[..., F:]), self.w_down, self.b_down)
        return x


class Llama(DecoderModel):
    """A Llama-family checkpoint (``model_type`` llama; SmolLM and TinyLlama use it too).

    Build it with :func:`manyheads.models.from_pretrained`; see
    :class:`~manyheads.models._decoder.DecoderModel` for ``logits`` and ``generate``.
    """

    model_type = "llama"
    qkv_bias_default = False   # Llama: config "attention_bias" (q, k, v and o together)
    o_bias_follows_qkv = True  # Qwen2: q, k, v biases always, no o bias
    tie_default = False

    def __init__(self, cfg: dict[str, Any], ckpt: TensorSource) -> None:
        self._read_config(cfg)
        d, H, Hkv, D, F = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.d_ff
        prefix = "model." if "model.embed_tokens.weight" in ckpt else ""
        embed = ckpt.get(f"{prefix}embed_tokens.weight", (self.vocab_size, d))
        head_name = "lm_head.weight"
        self.tied_embeddings = self.tie
        if self.tied_embeddings:
            self.head = np.ascontiguousarray(embed.T)
            self.embed: np.ndarray | None = None  # rows are read from the head's columns
        else:
            self.head = ckpt.linear(head_name, d, self.vocab_size)
            self.embed = embed
        del embed
        self.blocks: list[LlamaBlock] = []
        for i in range(self.num_layers):
            p = f"{prefix}layers.{i}."
            attn = MultiHeadAttention(d, H * D, self.context_length, 0.0, H, self.qkv_bias,
                                      num_kv_heads=Hkv, rope_theta=self.rope_theta, seed=0)
            attn.W_qkv[:, :H * D] = ckpt.linear(p + "self_attn.q_proj.weight", d, H * D)
            attn.W_qkv[:, H * D:H * D + Hkv * D] = ckpt.linear(p + "self_attn.k_proj.weight",
                                                               d, Hkv * D)
            attn.W_qkv[:, H * D + Hkv * D:] = ckpt.linear(p + "self_attn.v_proj.weight",
                                                          d, Hkv * D)
            if attn.b_qkv is not None:
                attn.b_qkv[...] = np.concatenate([
                    ckpt.get(p + "self_attn.q_proj.bias", (H * D,)),
                    ckpt.get(p + "self_attn.k_proj.bias", (Hkv * D,)),
                    ckpt.get(p + "self_attn.v_proj.bias", (Hkv * D,))])
            attn.W_out[...] = ckpt.linear(p + "self_attn.o_proj.weight", H * D, d)
            attn.b_out[...] = (ckpt.get(p + "self_attn.o_proj.bias", (d,)) if self.o_bias
                               else 0.0)
            w_gu = np.empty((d, 2 * F), dtype=np.float32)
            w_gu[:, :F] = ckpt.linear(p + "mlp.gate_proj.weight", d, F)
            w_gu[:, F:] = ckpt.linear(p + "mlp.up_proj.weight", d, F)
            b_gu = b_down = None
            if self.mlp_bias:
                b_gu = np.concatenate([ckpt.get(p + "mlp.gate_proj.bias", (F,)),
                                       ckpt.get(p + "mlp.up_proj.bias", (F,))])
                b_down = ckpt.get(p + "mlp.down_proj.bias", (d,))
            self.blocks.append(LlamaBlock(
                attn, ckpt.get(p + "input_layernorm.weight", (d,)),
                ckpt.get(p + "post_attention_layernorm.weight", (d,)), w_gu, b_gu,
                ckpt.linear(p + "mlp.down_proj.weight", F, d), b_down, self.eps))
        self.norm = ckpt.get(f"{prefix}norm.weight", (d,))

    def _read_config(self, cfg: dict[str, Any]) -> None:
        self.vocab_size = config_int(cfg, "vocab_size")
        self.d_model = config_int(cfg, "hidden_size")
        self.d_ff = config_int(cfg, "intermediate_size")
        self.num_layers = config_int(cfg, "num_hidden_layers")
        self.num_heads = config_int(cfg, "num_attention_heads")
        self.num_kv_heads = config_int(cfg, "num_key_value_heads", default=self.num_heads)
        self.context_length = config_int(cfg, "max_position_embeddings")
        self.eps = config_float(cfg, "rms_norm_eps", default=1e-6)
        self.rope_theta = rope_theta_of(cfg)
        if self.d_model % self.num_heads:
            raise ValueError(f"malformed config.json: hidden_size {self.d_model} is not a "
                             f"multiple of num_attention_heads {self.num_heads}")
        self.head_dim = config_int(cfg, "head_dim", default=self.d_model // self.num_heads)
        if self.head_dim * self.num_heads != self.d_model:
            raise ValueError(f"head_dim {self.head_dim} x {self.num_heads} heads != hidden_size "
                             f"{self.d_model}: not supported (the attention's output "
                             "projection is square)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"malformed config.json: num_attention_heads {self.num_heads} is "
                             f"not a multiple of num_key_value_heads {self.num_kv_heads}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported: only 'silu' (SwiGLU)")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        self.qkv_bias = bool(cfg.get("attention_bias", self.qkv_bias_default))
        self.o_bias = self.qkv_bias and self.o_bias_follows_qkv
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.tie = bool(cfg.get("tie_word_embeddings", self.tie_default))
        self.eos_token_id = eos_of(cfg)

    def _embed(self, ids: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        return self._token_rows(self.embed, ids)

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.norm, self.eps)

    def _describe(self) -> str:
        bias = ", qkv bias" if self.qkv_bias else ""
        return f"RMSNorm, SwiGLU MLP, rotary theta {self.rope_theta:g}{bias}"

    def parameters(self) -> list[np.ndarray]:
        ps = [self.head, self.norm] + ([] if self.embed is None else [self.embed])
        for b in self.blocks:
            ps += [b.attn.W_qkv, b.attn.W_out, b.norm_attn, b.norm_mlp, b.w_gate_up, b.w_down]
            ps += [a for a in (b.attn.b_qkv, b.b_gate_up, b.b_down) if a is not None]
            if self.o_bias:
                ps.append(b.attn.b_out)
        return ps
