"""gpt-oss decoders in NumPy: Llama's attention with biases and sinks, and a mixture of
experts in place of the MLP.

* Attention: q, k, v and o biases; a learned sink logit per head, which joins each
  row's softmax and takes its share of the weight without a value
  (``softmax(cat(scores, sink))[..., :-1] @ v``, the kernels' ``sinks=``); layers
  alternating between a sliding window of ``sliding_window`` keys (128) and full
  attention (``layer_types``, the first one sliding); YaRN rotary scaling (a config
  without rotary settings gets transformers' default for gpt-oss: YaRN x32 over 4096
  positions, base 150000); ``head_dim`` 64 unless the config says.
* Mixture of experts: a router (a linear layer with bias) scores the
  ``num_local_experts`` experts for each token; the ``num_experts_per_tok`` best are
  weighted by the softmax of their scores.  Each expert is ``down(glu) + b`` of
  ``(up + 1) * gate * sigmoid(alpha * gate)`` with ``gate`` clamped to at most
  ``swiglu_limit`` and ``up`` to ``[-limit, limit]`` (``swiglu_alpha``, 1.702).
  The checkpoint stores each expert's gate and up columns interleaved
  (``gate_up_proj`` (experts, d, 2 ff): gate, up, gate, ...); they are held
  side by side here, gate then up.
* Expert weights are read either as float tensors or as MXFP4 (``*_blocks`` and
  ``*_scales``: 4-bit e2m1 values, two a byte, low nibble first, and one power of two
  a block of 32), as OpenAI's checkpoints store them; MXFP4 values are exact in
  bfloat16, which ``weight_dtype="auto"`` keeps.  The router and its bias stay
  float32 whatever ``weight_dtype`` says: rounding them could change which experts a
  token takes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _kernels
from .._config import resolve_num_threads
from .._kernels import FEW_ROWS
from ..cache import KVCache
from ._checkpoint import TensorSource, config_float, config_int
from ._decoder import project, rms_norm
from ._step import CompiledStep, Watched
from .llama import DecoderAttention, Llama

__all__ = ["GptOss", "ExpertsBlock"]


class ExpertsBlock(Watched):
    """One gpt-oss block: norm, attention, residual; norm, mixture of experts, residual."""

    WATCHED = frozenset(("attn", "norm_attn", "norm_mlp", "router", "b_router",
                         "w_gate_up", "b_gate_up", "w_down", "b_down", "eps"))

    def __init__(self, attn: DecoderAttention, norms: dict[str, np.ndarray], router: np.ndarray,
                 b_router: np.ndarray, w_gate_up: list[Any], b_gate_up: np.ndarray,
                 w_down: list[Any], b_down: np.ndarray, top_k: int, alpha: float,
                 limit: float, eps: float) -> None:
        self.attn = attn
        self.norm_attn, self.norm_mlp = norms["attn"], norms["mlp"]
        self.router, self.b_router = router, b_router  # (d, experts), (experts,) float32
        self.w_gate_up, self.b_gate_up = w_gate_up, b_gate_up  # per expert (d, 2 ff): gate, up
        self.w_down, self.b_down = w_down, b_down  # per expert (ff, d)
        self.d_ff = b_gate_up.shape[1] // 2
        self.top_k, self.alpha, self.limit = top_k, np.float32(alpha), np.float32(limit)
        self.eps = eps

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.norm_attn, self.eps)

    def __call__(self, x: np.ndarray, cache: KVCache | None,
                 pad: np.ndarray | None) -> np.ndarray:
        x += self.attn(rms_norm(x, self.norm_attn, self.eps), cache=cache, key_padding_mask=pad)
        x += self.experts(rms_norm(x, self.norm_mlp, self.eps))
        return x

    def decode(self, x: np.ndarray, cache: KVCache) -> np.ndarray:
        """One decoding step (x (B, 1, d), no padding): the attention on the lean path of
        :meth:`DecoderAttention.decode` (or the general one where that declines)."""
        B = x.shape[0]
        if B > FEW_ROWS or x.dtype != np.float32:
            return self(x, cache, None)
        x2 = x.reshape(B, -1)
        a = self.attn.decode(rms_norm(x2, self.norm_attn, self.eps), cache,
                             resolve_num_threads(None))
        if a is None:
            return self(x, cache, None)
        x2 += a
        x2 += self.experts(rms_norm(x2, self.norm_mlp, self.eps))
        return x2.reshape(x.shape)

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts each row of h (N, d) takes, (N, top_k) best first, and their
        weights, the softmax of their router scores (N, top_k) float32."""
        scores = project(h, self.router, self.b_router)
        k = self.top_k
        # the k largest, best first; among equal scores the lower expert index first
        chosen = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, chosen, axis=1)
        top -= top[:, :1]
        np.exp(top, out=top)
        top /= top.sum(axis=1, keepdims=True)
        return chosen, top

    def experts(self, h: np.ndarray) -> np.ndarray:
        """The mixture of experts' output for h (..., d): a new float32 array."""
        shape = h.shape
        h = np.ascontiguousarray(h.reshape(-1, shape[-1]))
        chosen, weights = self.route(h)
        out = np.zeros_like(h)
        if h.shape[0] == 1:  # a decoding step: as below, with less indexing
            for slot in np.argsort(chosen[0], kind="stable").tolist():
                y = self._expert(h, int(chosen[0, slot]))
                y *= weights[0, slot]
                out += y
            return out.reshape(shape)
        for e in np.unique(chosen):  # (in the order of the experts, as transformers)
            rows, slot = np.nonzero(chosen == e)  # (a row takes an expert at most once)
            y = self._expert(h[rows], int(e))
            y *= weights[rows, slot][:, None]
            out[rows] += y
        return out.reshape(shape)

    def _expert(self, h: np.ndarray, e: int) -> np.ndarray:
        """Expert e's output for the rows h (n, d)."""
        gu = project(h, self.w_gate_up[e], self.b_gate_up[e])
        act = np.empty((gu.shape[0], self.d_ff), np.float32)
        _kernels.clamped_gated_mul(gu, act, self.alpha, self.limit)
        return project(act, self.w_down[e], self.b_down[e])

    def norms(self) -> list[np.ndarray]:
        return [self.norm_attn, self.norm_mlp]

    def mlp_parameters(self) -> list[Any]:
        return [self.router, self.b_router, *self.w_gate_up, self.b_gate_up, *self.w_down,
                self.b_down]


class GptOss(Llama):
    """A gpt-oss checkpoint (``model_type`` gpt_oss): :class:`~manyheads.models.llama.Llama`
    attention with biases and sinks, and a mixture of experts (float or MXFP4 weights)."""

    model_type = "gpt_oss"
    qkv_bias_default = True
    reads_layer_types = True
    window_default = 128
    sinks = True
    head_dim_default = 64
    default_theta = 150000.0
    # transformers' GptOssConfig without rope_scaling or rope_parameters (gpt-oss's own)
    rope_default = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "truncate": False, "original_max_position_embeddings": 4096}

    def _read_config(self, cfg: dict[str, Any]) -> None:
        super()._read_config(cfg)
        self.num_experts = config_int(cfg, "num_local_experts")
        self.top_k = config_int(cfg, "num_experts_per_tok", "experts_per_token", default=4)
        if self.top_k > self.num_experts:
            raise ValueError(f"malformed config.json: num_experts_per_tok {self.top_k} exceeds "
                             f"num_local_experts {self.num_experts}")
        self.alpha = config_float(cfg, "swiglu_alpha", default=1.702)
        self.limit = config_float(cfg, "swiglu_limit", default=7.0)
        quant = cfg.get("quantization_config")
        if quant is not None and (not isinstance(quant, dict)
                                  or quant.get("quant_method") != "mxfp4"):
            raise ValueError(f"gpt-oss quantization_config {quant!r} is not supported: only "
                             "MXFP4 experts (quant_method 'mxfp4') and float weights are read")

    def _default_layer_types(self, cfg: dict[str, Any]) -> list[str]:
        """Without layer_types: sliding and full layers in turn, a sliding one first."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_layers)]

    def _block(self, ckpt: TensorSource, p: str, attn: DecoderAttention,
               norms: dict[str, np.ndarray]) -> ExpertsBlock:
        d, F, E = self.d_model, self.d_ff, self.num_experts
        m = p + "mlp."
        router = np.ascontiguousarray(ckpt.get(m + "router.weight", (E, d)).T)
        b_router = ckpt.get(m + "router.bias", (E,))
        # interleaved gate, up columns -> gate columns, then up columns
        order = np.concatenate([np.arange(0, 2 * F, 2), np.arange(1, 2 * F, 2)])
        w_gu = ckpt.experts(m + "experts.gate_up_proj", E, d, 2 * F, order)
        b_gu = ckpt.get(m + "experts.gate_up_proj_bias", (E, 2 * F))
        b_gu = np.ascontiguousarray(b_gu[:, order])
        w_down = ckpt.experts(m + "experts.down_proj", E, F, d)
        b_down = ckpt.get(m + "experts.down_proj_bias", (E, d))
        return ExpertsBlock(attn, norms, router, b_router, w_gu, b_gu, w_down, b_down,
                            self.top_k, self.alpha, self.limit, self.eps)

    def _mlp_text(self) -> str:
        return (f"{self.top_k} of {self.num_experts} experts (clamped SwiGLU, limit "
                f"{self.limit:g}), attention sinks")

    def _decode_step(self, caches: list[KVCache], rows: int) -> CompiledStep | None:
        return None  # (sinks and experts: the blocks' own path)
