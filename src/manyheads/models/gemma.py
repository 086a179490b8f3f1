"""Gemma 2 and Gemma 3 (text) decoders in NumPy, on the Llama block with Gemma's settings.

Both: RMSNorm weights used as ``1 + w``, norms before *and after* the attention and
the MLP, embeddings times ``sqrt(hidden_size)`` (in float32, the dtype the model runs
in), scores scaled by ``query_pre_attn_scalar ** -0.5``, a GELU-tanh gated MLP,
``head_dim`` of its own, tied embeddings, and layers alternating between a sliding
window of ``sliding_window`` keys and full attention (``layer_types``).

* Gemma 2: soft caps ``c * tanh(s / c)`` of the attention scores
  (``attn_logit_softcapping``, 50 by default) and of the final logits
  (``final_logit_softcapping``, 30); every other layer slides, the first one first.
* Gemma 3 (``model_type`` gemma3_text): RMSNorm of each head's queries and keys, no
  score cap (transformers ignores ``attn_logit_softcapping`` there too), five sliding
  layers to one full (``sliding_window_pattern``), and the sliding layers' own rotary
  base ``rope_local_base_freq`` (10000; full layers ``rope_theta``, 1000000, with the
  ``rope_scaling`` of the config).  A multimodal ``gemma3`` checkpoint (vision tower
  plus text model) is not read: :func:`~manyheads.models.from_pretrained` says so.
"""
from __future__ import annotations

from typing import Any

from ._checkpoint import config_int
from .llama import Llama

__all__ = ["Gemma2", "Gemma3"]


class Gemma2(Llama):
    """A Gemma 2 checkpoint (``model_type`` gemma2): :class:`~manyheads.models.llama.Llama`
    with Gemma's norms, scales and soft caps."""

    model_type = "gemma2"
    gemma = True
    tie_default = True
    head_dim_default = 256
    activation_keys = ("hidden_activation",)  # (transformers' Gemma 2 and 3 read no hidden_act)
    activation_default = "gelu_pytorch_tanh"
    reads_layer_types = True
    window_default = 4096
    attn_softcap_key: str | None = "attn_logit_softcapping"
    attn_softcap_default: float | None = 50.0
    final_softcap_default: float | None = 30.0

    def _default_layer_types(self, cfg: dict[str, Any]) -> list[str]:
        """Without layer_types: every n-th layer full, the others sliding."""
        n = self._sliding_pattern(cfg)
        return ["sliding_attention" if (i + 1) % n else "full_attention"
                for i in range(self.num_layers)]

    def _sliding_pattern(self, cfg: dict[str, Any]) -> int:
        return 2


class Gemma3(Gemma2):
    """A Gemma 3 text checkpoint (``model_type`` gemma3_text):
    :class:`~manyheads.models.gemma.Gemma2` with q/k RMSNorm, no score cap, and a
    rotary base of the sliding layers' own."""

    model_type = "gemma3_text"
    qk_norm = True
    attn_softcap_key = None
    final_softcap_default = None
    default_theta = 1_000_000.0
    rope_local_theta = ("rope_local_base_freq", 10000.0)

    def _sliding_pattern(self, cfg: dict[str, Any]) -> int:
        return config_int(cfg, "sliding_window_pattern", default=6)
