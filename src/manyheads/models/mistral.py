"""Mistral decoders in NumPy: Llama with a sliding window in every layer (each query
attends its ``sliding_window`` latest keys; null: no window) and an optional
``head_dim`` of its own (Mistral NeMo's)."""
from __future__ import annotations

from .llama import Llama

__all__ = ["Mistral"]


class Mistral(Llama):
    """A Mistral checkpoint (``model_type`` mistral): :class:`~manyheads.models.llama.Llama`
    whose every layer has the config's ``sliding_window``."""

    model_type = "mistral"
    slides_everywhere = True
    window_default = 4096
