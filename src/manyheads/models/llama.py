"""Llama-shaped decoders in NumPy: Llama itself (SmolLM, TinyLlama) and, through a few
settings, every family built like it (Mistral, Qwen2/3, Gemma 2/3, Phi-3 in their own
files).

A block is ``x + attn(norm(x))`` then ``x + down(act(gate(h)) * up(h))`` with
``h = norm(x)``; the attention is a :class:`DecoderAttention` (a fused
:class:`~manyheads.MultiHeadAttention`) with rotary position embeddings
(``rotate_half`` layout, any scaling of :mod:`._rope`) and grouped-query key/value
heads.  RMSNorm divides by ``sqrt(mean(x**2) + eps)`` and then multiplies by its
weight.  The gate and up projections are packed into one (d_model, 2 * d_ff) matrix,
so one :func:`manyheads.linear` call serves both (checkpoints that store them fused,
``gate_up_proj``, and likewise ``qkv_proj``, are read as they are).

What a family changes, each read from its config by :meth:`Llama._read_config`:

* ``head_dim`` independent of ``hidden_size / num_attention_heads`` (the output
  projection maps the heads' width to ``hidden_size``);
* each layer's kind, ``full_attention`` or ``sliding_attention`` (a window of
  ``sliding_window`` keys, the kernels' ``window=``), and its rotary settings;
* RMSNorm of each head's queries and keys before the rotation (Qwen3, Gemma 3);
* Gemma's RMSNorm weight ``1 + w`` (added once, as the weights load), norms after
  the attention and the MLP as well as before, embeddings times ``sqrt(hidden_size)``,
  the score scale ``query_pre_attn_scalar ** -0.5``, soft caps ``c * tanh(s / c)`` of
  the attention scores and of the final logits, and a GELU-tanh gate.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..cache import KVCache, CacheStep
from ..modules import MultiHeadAttention
from ._checkpoint import TensorSource, config_float, config_int
from .. import _kernels
from .._config import resolve_num_threads
from .._core import project_rows
from .._kernels import FEW_ROWS
from ._decoder import DecoderModel, eos_of, prepared, project, rms_norm
from ..weights import join_columns
from ._rope import LAYER_TYPES, Rotary, rope_parameters_of
from ._step import CompiledStep, Watched
from .gpt2 import gelu_erf, gelu_tanh

__all__ = ["Llama", "LlamaBlock", "DecoderAttention", "silu"]


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in place (one temporary)."""
    t = np.negative(x)
    with np.errstate(over="ignore"):  # exp(-x) -> inf gives silu -> 0, as it should
        np.exp(t, out=t)
    t += 1.0
    np.divide(x, t, out=x)
    return x


#: hidden_act / hidden_activation of a config -> the gate's activation (in place)
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": silu, "swish": silu, "gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh, "gelu": gelu_erf}
_ACT_NAMES: dict[Callable[[np.ndarray], np.ndarray], str] = {silu: "SwiGLU", gelu_tanh: "GeGLU (tanh)", gelu_erf: "GeGLU"}


class DecoderAttention(Watched, MultiHeadAttention):
    """The attention of a decoder layer: a fused :class:`~manyheads.MultiHeadAttention`
    whose queries and keys are RMS-normed per head (optional) and rotated by a
    :class:`~manyheads.models._rope.Rotary`, and whose output projection ``W_out``
    (num_heads * head_dim, d_model) maps the heads' width (``d_out``) to the model's."""

    WATCHED = frozenset(("W_qkv", "b_qkv", "W_out", "b_out", "qk_norm", "eps", "sinks",
                         "alibi_slopes"))

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 context_length: int, qkv_bias: bool, *, rotary: Rotary,
                 window: int | None = None, scale: float | None = None,
                 softcap: float | None = None,
                 qk_norm: tuple[np.ndarray, np.ndarray] | None = None,
                 eps: float = 1e-6, sinks: bool = False) -> None:
        super().__init__(d_model, num_heads * head_dim, context_length, 0.0, num_heads,
                         qkv_bias, num_kv_heads=num_kv_heads, window=window, scale=scale,
                         softcap=softcap, sinks=sinks, seed=0)
        self.W_out = np.zeros((num_heads * head_dim, d_model), dtype=np.float32)
        self.b_out = np.zeros(d_model, dtype=np.float32)
        self.rotary = rotary
        self.qk_norm = qk_norm
        self.eps = eps

    def _rotate(self, q: np.ndarray, k: np.ndarray, step: CacheStep | None) -> None:
        if step is None:
            self._rotate_from(q, k, 0)
        else:
            self._rotate_from(q, k, step.start, self._padded_slots(step))

    def _padded_slots(self, step: CacheStep) -> np.ndarray | None:
        """Each row's padded slots (B,) under dynamic scaling (None otherwise, or
        without padding): the rows' positions then count from their first tokens.

        transformers' ``generate`` counts a row's positions from its attention mask.  A
        shift of all of a row's positions cancels in its scores as long as the
        frequencies stay, but dynamic ones change at every step past ``max_position``,
        and the keys cached earlier keep theirs."""
        if self.rotary.kind != "dynamic":
            return None
        # (left padding: every padded slot comes before the row's tokens)
        pads = step.cache._padded
        if step.pad_new is not None:
            pads = pads + step.pad_new.sum(axis=1, dtype=np.intp)
        return pads if pads.any() else None

    def _rotate_from(self, q: np.ndarray, k: np.ndarray, start: int,
                     padded: np.ndarray | None = None) -> None:
        if self.qk_norm is not None:
            q[...] = rms_norm(q, self.qk_norm[0], self.eps)
            k[...] = rms_norm(k, self.qk_norm[1], self.eps)
        if padded is None:
            self.rotary.apply(q, start)
            self.rotary.apply(k, start)
            return
        # each row from its own first token, at the frequencies of the batch's furthest
        # position, as transformers' generate does (positions from the mask)
        length = start + q.shape[-2] - int(padded.min())
        self.rotary.apply_rows(q, start - padded, length)
        self.rotary.apply_rows(k, start - padded, length)

    def decode(self, h: np.ndarray, cache: KVCache, num_threads: int) -> np.ndarray | None:
        """One decoding step of B (<= FEW_ROWS) tokens h (B, d_model), float32, through
        ``cache`` (no padding in it): the attention block's output (B, d_model), what
        ``self(h[:, None], cache=cache)`` gives, with the weights' kernel layout worked
        out once and the cache attended directly.  None, with nothing changed, when this
        step needs the general path."""
        B = h.shape[0]
        self._check_cache_call(cache, None, B, 1)
        if cache._any_padding or self.alibi_slopes is not None:
            return None
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = project_rows(h, prepared(self, "W_qkv"), self.b_qkv, num_threads)
        kv0, kv1 = self.d_out, self.d_out + self.kv_dim
        q = qkv[:, :kv0].reshape(B, H, 1, D)
        k = qkv[:, kv0:kv1].reshape(B, Hkv, 1, D)
        v = qkv[:, kv1:].reshape(B, Hkv, 1, D)
        self._rotate_from(q, k, len(cache))
        merged = np.empty((B, H * D), dtype=np.float32)
        scale = 1.0 / np.sqrt(D) if self.scale is None else self.scale
        done = cache._decode_attend(q, k, v, scale=scale, softcap=self.softcap,
                                   num_threads=num_threads, out=merged.reshape(B, H, 1, D),
                                   sinks=self.sinks)
        assert done  # (the cache's padding was checked above)
        return project_rows(merged, prepared(self, "W_out"), self.b_out, num_threads)


class LlamaBlock(Watched):
    """One block: norm, attention, (norm,) residual; norm, gated MLP, (norm,) residual."""

    WATCHED = frozenset(("attn", "norm_attn", "norm_mlp", "post_attn", "post_mlp",
                         "w_gate_up", "b_gate_up", "w_down", "b_down", "eps", "act"))

    def __init__(self, attn: DecoderAttention, norms: dict[str, np.ndarray],
                 w_gate_up: np.ndarray, b_gate_up: np.ndarray | None, w_down: np.ndarray,
                 b_down: np.ndarray | None, eps: float,
                 act: Callable[[np.ndarray], np.ndarray] = silu) -> None:
        self.attn = attn
        self.norm_attn, self.norm_mlp = norms["attn"], norms["mlp"]
        self.post_attn, self.post_mlp = norms.get("post_attn"), norms.get("post_mlp")
        self.w_gate_up, self.b_gate_up = w_gate_up, b_gate_up
        self.w_down, self.b_down = w_down, b_down
        self.d_ff = w_down.shape[0]
        self.eps = eps
        self.act = act

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.norm_attn, self.eps)

    def __call__(self, x: np.ndarray, cache: KVCache | None,
                 pad: np.ndarray | None) -> np.ndarray:
        a = self.attn(rms_norm(x, self.norm_attn, self.eps), cache=cache, key_padding_mask=pad)
        x += a if self.post_attn is None else rms_norm(a, self.post_attn, self.eps)
        gu = project(rms_norm(x, self.norm_mlp, self.eps), self.w_gate_up, self.b_gate_up)
        m = project(self._gated(gu), self.w_down, self.b_down)
        x += m if self.post_mlp is None else rms_norm(m, self.post_mlp, self.eps)
        return x

    def _gated(self, gu: np.ndarray) -> np.ndarray:
        """act(gate) * up of the packed (..., 2 d_ff) projection: one compiled pass for
        SwiGLU and GELU-tanh GeGLU in float32 (a new array either way)."""
        F = self.d_ff
        if self.act in (silu, gelu_tanh) and gu.dtype == np.float32 and gu.flags.c_contiguous:
            out = np.empty(gu.shape[:-1] + (F,), np.float32)
            _kernels.gated_mul(gu.reshape(-1, 2 * F), out.reshape(-1, F), self.act is gelu_tanh)
            return out
        gate = self.act(gu[..., :F])
        gate *= gu[..., F:]
        return np.ascontiguousarray(gate)

    def decode(self, x: np.ndarray, cache: KVCache) -> np.ndarray:
        """One decoding step (x (B, 1, d_model), no padding) on the lean path of
        :meth:`DecoderAttention.decode`, or the general one where that declines."""
        B = x.shape[0]
        if B > FEW_ROWS or x.dtype != np.float32:
            return self(x, cache, None)
        nt = resolve_num_threads(None)
        x2 = x.reshape(B, -1)
        a = self.attn.decode(rms_norm(x2, self.norm_attn, self.eps), cache, nt)
        if a is None:
            return self(x, cache, None)
        x2 += a if self.post_attn is None else rms_norm(a, self.post_attn, self.eps)
        gu = project_rows(rms_norm(x2, self.norm_mlp, self.eps), prepared(self, "w_gate_up"),
                          self.b_gate_up, nt)
        m = project_rows(self._gated(gu), prepared(self, "w_down"), self.b_down, nt)
        x2 += m if self.post_mlp is None else rms_norm(m, self.post_mlp, self.eps)
        return x2.reshape(x.shape)

    def norms(self) -> list[np.ndarray]:
        return [n for n in (self.norm_attn, self.norm_mlp, self.post_attn, self.post_mlp)
                if n is not None]

    def mlp_parameters(self) -> list[Any]:
        return [a for a in (self.w_gate_up, self.w_down, self.b_gate_up, self.b_down)
                if a is not None]


class Llama(DecoderModel):
    """A Llama-family checkpoint (``model_type`` llama; SmolLM and TinyLlama use it too).

    Rotary scaling (``rope_scaling``): ``linear``, ``dynamic``, ``yarn`` and ``llama3``,
    computed as transformers computes them.  Build it with
    :func:`manyheads.models.from_pretrained`; see
    :class:`~manyheads.models._decoder.DecoderModel` for ``logits`` and ``generate``.
    """

    model_type = "llama"
    bias_key: str | None = "attention_bias"  # q, k, v and o biases together; None: fixed
    qkv_bias_default = False
    o_bias_follows_qkv = True  # Qwen2: q, k, v biases always, no o bias
    tie_default = False
    head_dim_default: int | None = None  # None: hidden_size // num_attention_heads
    activation_keys: tuple[str, ...] = ("hidden_act",)
    activation_default = "silu"
    reads_layer_types = False  # True: config "layer_types" says which layers slide
    slides_everywhere = False  # Mistral, Phi-3: every layer has the config's sliding_window
    window_default: int | None = None  # sliding_window when the config does not say
    qk_norm = False            # RMSNorm of each head's queries and keys (Qwen3, Gemma 3)
    gemma = False              # Gemma's norms, embedding scale, score scale and soft caps
    attn_softcap_key: str | None = None  # Gemma 2's attn_logit_softcapping
    attn_softcap_default: float | None = None
    final_softcap_default: float | None = None
    rope_local_theta: tuple[str, float] | None = None  # Gemma 3's base of sliding layers
    default_theta = 10000.0
    sinks = False              # a learned sink logit per head (gpt-oss), self_attn.sinks
    rope_default: dict[str, Any] | None = None  # rotary settings of a config that gives none
    partial_rotary = False     # Phi-3: partial_rotary_factor applies to its plain rotary

    def __init__(self, cfg: dict[str, Any], ckpt: TensorSource) -> None:
        self._read_config(cfg)
        d, H, Hkv, D = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        prefix = "model." if "model.embed_tokens.weight" in ckpt else ""
        # the token embedding (vocab, d) is held as (d, vocab) columns in the weights'
        # format: with tied embeddings it is the LM head itself
        embed = ckpt.linear(f"{prefix}embed_tokens.weight", d, self.vocab_size)
        self.tied_embeddings = ckpt.tied_head(self.tie, f"{prefix}embed_tokens.weight")
        self.embed: Any = None if self.tied_embeddings else embed
        self.head = embed if self.tied_embeddings else \
            ckpt.linear("lm_head.weight", d, self.vocab_size)
        del embed
        norm_names = {"attn": "input_layernorm", "mlp": "post_attention_layernorm"}
        if self.gemma:
            norm_names = {"attn": "input_layernorm", "post_attn": "post_attention_layernorm",
                          "mlp": "pre_feedforward_layernorm",
                          "post_mlp": "post_feedforward_layernorm"}
        self.blocks: list[LlamaBlock] = []
        for i in range(self.num_layers):
            p = f"{prefix}layers.{i}."
            qk = None
            if self.qk_norm:
                qk = (self._norm(ckpt, p + "self_attn.q_norm.weight", D),
                      self._norm(ckpt, p + "self_attn.k_norm.weight", D))
            attn = DecoderAttention(d, H, Hkv, D, self.context_length, self.qkv_bias,
                                    rotary=self.rotaries[self.layer_types[i]],
                                    window=self.windows[i], scale=self.scale,
                                    softcap=self.attn_softcap, qk_norm=qk, eps=self.eps,
                                    sinks=self.sinks)
            self._read_attention(ckpt, p + "self_attn.", attn)
            norms = {k: self._norm(ckpt, p + name + ".weight", d) for k, name in norm_names.items()}
            self.blocks.append(self._block(ckpt, p, attn, norms))
        self.norm = self._norm(ckpt, f"{prefix}norm.weight", d)

    def _norm(self, ckpt: TensorSource, name: str, size: int) -> np.ndarray:
        """An RMSNorm weight; Gemma's ``1 + w`` is added here, once."""
        w = ckpt.get(name, (size,))
        if self.gemma:
            w += np.float32(1.0)
        return w

    def _read_attention(self, ckpt: TensorSource, p: str, attn: DecoderAttention) -> None:
        d, H, Hkv, D = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        widths = (H * D, Hkv * D, Hkv * D)
        if p + "qkv_proj.weight" in ckpt:  # fused (Phi-3): q, k, v rows one after another
            attn.W_qkv = ckpt.linear(p + "qkv_proj.weight", d, sum(widths))
        else:
            attn.W_qkv = join_columns(
                [ckpt.linear(p + f"{n}_proj.weight", d, w, part=True)
                 for n, w in zip("qkv", widths)], ckpt.arena)
            if attn.b_qkv is not None:
                attn.b_qkv[...] = np.concatenate(
                    [ckpt.get(p + f"{n}_proj.bias", (w,)) for n, w in zip("qkv", widths)])
        if attn.sinks is not None:
            attn.sinks = ckpt.get(p + "sinks", (H,))
        attn.W_out = ckpt.linear(p + "o_proj.weight", H * D, d)
        if self.o_bias:
            attn.b_out[...] = ckpt.get(p + "o_proj.bias", (d,))

    def _block(self, ckpt: TensorSource, p: str, attn: DecoderAttention,
               norms: dict[str, np.ndarray]) -> Any:
        """Layer ``p``'s block around ``attn``: its MLP read from the checkpoint."""
        w_gu, b_gu, w_down, b_down = self._read_mlp(ckpt, p + "mlp.")
        return LlamaBlock(attn, norms, w_gu, b_gu, w_down, b_down, self.eps, self.act)

    def _read_mlp(self, ckpt: TensorSource, p: str
                  ) -> tuple[Any, np.ndarray | None, Any, np.ndarray | None]:
        d, F = self.d_model, self.d_ff
        if p + "gate_up_proj.weight" in ckpt:  # fused (Phi-3): gate rows, then up rows
            w_gu = ckpt.linear(p + "gate_up_proj.weight", d, 2 * F)
        else:
            w_gu = join_columns([ckpt.linear(p + f"{n}_proj.weight", d, F, part=True)
                                 for n in ("gate", "up")], ckpt.arena)
        b_gu = b_down = None
        if self.mlp_bias:
            b_gu = np.concatenate([ckpt.get(p + "gate_proj.bias", (F,)),
                                   ckpt.get(p + "up_proj.bias", (F,))])
            b_down = ckpt.get(p + "down_proj.bias", (d,))
        return w_gu, b_gu, ckpt.linear(p + "down_proj.weight", F, d), b_down

    # -- the config ---------------------------------------------------------------------
    def _read_config(self, cfg: dict[str, Any]) -> None:
        if cfg.get("use_bidirectional_attention"):  # (Gemma's encoders, as EmbeddingGemma)
            raise ValueError(f"a {cfg.get('model_type')!r} model with use_bidirectional_attention "
                             "is an encoder (every token sees every other): this runner is "
                             "causal, a decoder's")
        self.vocab_size = config_int(cfg, "vocab_size")
        self.d_model = config_int(cfg, "hidden_size")
        self.d_ff = config_int(cfg, "intermediate_size")
        self.num_layers = config_int(cfg, "num_hidden_layers")
        self.num_heads = config_int(cfg, "num_attention_heads")
        self.num_kv_heads = config_int(cfg, "num_key_value_heads", default=self.num_heads)
        max_position = config_int(cfg, "max_position_embeddings")
        self.eps = config_float(cfg, "rms_norm_eps", default=1e-6)
        default_dim = self.head_dim_default
        if default_dim is None and cfg.get("head_dim") is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"malformed config.json: hidden_size {self.d_model} is not a "
                                 f"multiple of num_attention_heads {self.num_heads} (and no "
                                 "head_dim is given)")
            default_dim = self.d_model // self.num_heads
        self.head_dim = config_int(cfg, "head_dim", default=default_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"malformed config.json: num_attention_heads {self.num_heads} is "
                             f"not a multiple of num_key_value_heads {self.num_kv_heads}")
        act = next((cfg[k] for k in self.activation_keys if cfg.get(k) is not None),
                   self.activation_default)
        if act not in ACTIVATIONS:
            raise ValueError(f"{self.activation_keys[0]} {act!r} is not supported: one of "
                             f"{', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.qkv_bias = self.qkv_bias_default if self.bias_key is None else \
            bool(cfg.get(self.bias_key, self.qkv_bias_default))
        self.o_bias = self.qkv_bias and self.o_bias_follows_qkv
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.tie = bool(cfg.get("tie_word_embeddings", self.tie_default))
        self.eos_token_id = eos_of(cfg)
        self.layer_types = self._layer_types(cfg)
        window = self._window_size(cfg)
        self.windows = [window if t == "sliding_attention" else None for t in self.layer_types]
        self._read_rotary(cfg, max_position)
        self.scale: float | None = None
        self.attn_softcap: float | None = None
        self.embed_scale: np.float32 | None = None
        if self.gemma:
            self.scale = config_float(cfg, "query_pre_attn_scalar", default=256.0) ** -0.5
            self.embed_scale = np.float32(self.d_model ** 0.5)
            self.final_softcap = self._optional_float(cfg, "final_logit_softcapping",
                                                      self.final_softcap_default)
        if self.attn_softcap_key is not None:
            self.attn_softcap = self._optional_float(cfg, self.attn_softcap_key,
                                                     self.attn_softcap_default)

    @staticmethod
    def _optional_float(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
        """``cfg[key]`` (null: None), or ``default`` when the key is absent."""
        if key not in cfg:
            return default
        return None if cfg[key] is None else config_float(cfg, key)

    def _read_rotary(self, cfg: dict[str, Any], max_position: int) -> None:
        """The :class:`Rotary` of each kind of layer (one shared by all unless the
        family's sliding layers have their own, as Gemma 3's) and the context length
        the used ones allow."""
        local = self.rope_local_theta
        if self.rope_default is not None and cfg.get("rope_scaling") is None and \
                cfg.get("rope_parameters") is None:
            cfg = {**cfg, "rope_parameters": dict(self.rope_default)}
        if local is None:
            one = Rotary(rope_parameters_of(cfg, default_theta=self.default_theta,
                                            partial=self.partial_rotary),
                         self.head_dim, max_position)
            self.rotaries = {t: one for t in LAYER_TYPES}
        else:
            self.rotaries = {t: Rotary(rope_parameters_of(cfg, t, default_theta=self.default_theta,
                                                          local_theta=local,
                                                          partial=self.partial_rotary),
                                       self.head_dim, max_position) for t in LAYER_TYPES}
        self.context_length = max(self.rotaries[t].context_length for t in self.layer_types)

    def _layer_types(self, cfg: dict[str, Any]) -> list[str]:
        """Each layer's kind: config "layer_types" (families that read it) or the
        family's default (:meth:`_default_layer_types`)."""
        given = cfg.get("layer_types") if self.reads_layer_types else None
        if given is None:
            return self._default_layer_types(cfg)
        if not isinstance(given, list) or len(given) != self.num_layers or \
                any(t not in LAYER_TYPES for t in given):
            raise ValueError(f"malformed config.json: 'layer_types' must list "
                             f"{self.num_layers} of {', '.join(map(repr, LAYER_TYPES))}, "
                             f"got {given!r}")
        return list(given)

    def _default_layer_types(self, cfg: dict[str, Any]) -> list[str]:
        kind = "sliding_attention" if self.slides_everywhere else "full_attention"
        return [kind] * self.num_layers

    def _window_size(self, cfg: dict[str, Any]) -> int | None:
        """The window of the sliding layers (None: they see every key)."""
        if "sliding_window" not in cfg:
            return self.window_default
        return None if cfg["sliding_window"] is None else config_int(cfg, "sliding_window")

    # -- running --------------------------------------------------------------------------
    def _embed(self, ids: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        x = self._token_rows(self.embed, ids)
        if self.embed_scale is not None:
            x *= self.embed_scale
        return x

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.norm, self.eps)

    def _describe(self) -> str:
        norm = "RMSNorm (1 + weight) before and after attention and MLP" if self.gemma \
            else "RMSNorm"
        parts = [norm, self._mlp_text()]
        used = sorted(set(self.layer_types))
        if self.rope_local_theta is None or len(used) == 1:
            parts.append(repr(self.rotaries[used[0]]))
        else:
            parts += [f"{t.split('_')[0]} layers {self.rotaries[t]!r}" for t in used]
        if self.qkv_bias:
            parts.append("qkv bias")
        if self.qk_norm:
            parts.append("q/k RMSNorm")
        slid = [w for w in self.windows if w is not None]
        if slid:
            parts.append(f"sliding window {slid[0]} in {len(slid)} of {self.num_layers} layers")
        caps = [f"{what} {c:g}" for what, c in (("scores", self.attn_softcap),
                                                  ("logits", self.final_softcap)) if c]
        if caps:
            parts.append(f"soft caps: {', '.join(caps)}")
        return ", ".join(parts)

    def _mlp_text(self) -> str:
        return f"{_ACT_NAMES[self.act]} MLP"

    def _decode_step(self, caches: list[KVCache], rows: int) -> CompiledStep | None:
        # Compiled also when threads were lately found without a core (the lean path
        # measured no faster then, and 1.2-1.6x slower when a virtual machine's cores
        # are taken away for milliseconds at a time), but on one thread until
        # CONTENDED_SECONDS pass: a team waits for a descheduled thread at each of
        # some 300 barriers a token.  int8 SmolLM2-shaped decoding beside two
        # processes that kept both cores busy: 12.9 ms a token on one thread against
        # 52.5 on two (5.4 on two when the cores were free).  The same bits either way.
        nt = resolve_num_threads(None)
        if nt > 1 and _kernels.contended():
            nt = 1
        steps: dict[int, CompiledStep] = self.__dict__.setdefault("_steps", {})
        step = steps.get(nt)
        if step is not None and step.matches(self.blocks, caches, rows, nt):
            return step
        if not CompiledStep.serves(self.blocks, caches, rows, silu, nt):
            return None
        step = steps[nt] = CompiledStep(self.blocks, caches, rows, nt)
        return step

    def parameters(self) -> list[np.ndarray]:
        ps = [self.head, self.norm] + ([] if self.embed is None else [self.embed])
        for b in self.blocks:
            ps += [b.attn.W_qkv, b.attn.W_out, *b.norms(), *b.mlp_parameters()]
            ps += [a for a in (b.attn.b_qkv, b.attn.sinks) if a is not None]
            if b.attn.qk_norm is not None:
                ps += list(b.attn.qk_norm)
            if self.o_bias:
                ps.append(b.attn.b_out)
        return ps
