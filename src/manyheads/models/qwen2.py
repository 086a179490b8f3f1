"""Qwen2 decoders (Qwen2, Qwen2.5) in NumPy: a Llama block whose query, key and value
projections always have biases and whose output projection has none."""
from __future__ import annotations

from typing import Any

from ._checkpoint import TensorSource
from .llama import Llama

__all__ = ["Qwen2"]


class Qwen2(Llama):
    """A Qwen2 checkpoint (``model_type`` qwen2): :class:`~manyheads.models.llama.Llama`
    with q/k/v biases and no output-projection bias."""

    model_type = "qwen2"
    qkv_bias_default = True
    o_bias_follows_qkv = False

    def __init__(self, cfg: dict[str, Any], ckpt: TensorSource) -> None:
        cfg = dict(cfg)
        cfg.pop("attention_bias", None)  # not a Qwen2 setting: the biases are fixed
        super().__init__(cfg, ckpt)
