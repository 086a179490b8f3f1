"""Qwen3 decoders in NumPy: Qwen2's layout with Llama's biases (``attention_bias``, none
by default), an RMSNorm of each head's queries and keys before the rotation, and a
``head_dim`` of its own (128 unless the config says)."""
from __future__ import annotations

from .qwen2 import Qwen2

__all__ = ["Qwen3"]


class Qwen3(Qwen2):
    """A Qwen3 checkpoint (``model_type`` qwen3): :class:`~manyheads.models.qwen2.Qwen2`
    with per-head q/k RMSNorm and Llama's ``attention_bias``."""

    model_type = "qwen3"
    bias_key = "attention_bias"
    qkv_bias_default = False
    o_bias_follows_qkv = True
    qk_norm = True
    head_dim_default = 128
