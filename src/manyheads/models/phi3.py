"""Phi-3 decoders in NumPy: Llama with its query, key and value projections stored as one
``qkv_proj`` and its gate and up projections as one ``gate_up_proj`` (read as they
are), an optional ``sliding_window`` in every layer and an optional
``partial_rotary_factor`` (Phi-4-mini).  The long-context LongRoPE scaling
(``rope_scaling`` type ``longrope`` or ``su``) is refused with a ValueError."""
from __future__ import annotations

from .llama import Llama

__all__ = ["Phi3"]


class Phi3(Llama):
    """A Phi-3 checkpoint (``model_type`` phi3): :class:`~manyheads.models.llama.Llama`
    with fused projections; plain rotary embeddings only (no LongRoPE)."""

    model_type = "phi3"
    bias_key: str | None = None  # Phi-3 projections have no biases
    slides_everywhere = True
    partial_rotary = True
