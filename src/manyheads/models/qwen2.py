"""Qwen2 decoders (Qwen2, Qwen2.5) in NumPy: a Llama block whose query, key and value
projections always have biases and whose output projection has none; with
``use_sliding_window`` the layers from ``max_window_layers`` on (or those that
``layer_types`` names) attend a window of ``sliding_window`` keys."""
from __future__ import annotations

from typing import Any

from ._checkpoint import config_int
from .llama import Llama

__all__ = ["Qwen2"]


class Qwen2(Llama):
    """A Qwen2 checkpoint (``model_type`` qwen2): :class:`~manyheads.models.llama.Llama`
    with q/k/v biases and no output-projection bias."""

    model_type = "qwen2"
    bias_key: str | None = None  # not a Qwen2 setting: the biases are fixed
    qkv_bias_default = True
    o_bias_follows_qkv = False
    reads_layer_types = True
    window_default = 4096

    def _window_size(self, cfg: dict[str, Any]) -> int | None:
        return super()._window_size(cfg) if cfg.get("use_sliding_window") else None

    def _default_layer_types(self, cfg: dict[str, Any]) -> list[str]:
        first = config_int(cfg, "max_window_layers", default=28, minimum=0)
        slide = self._window_size(cfg) is not None
        return ["sliding_attention" if slide and i >= first else "full_attention"
                for i in range(self.num_layers)]
