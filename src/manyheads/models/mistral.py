"""Mistral decoders in NumPy: Llama with a sliding window in every layer (each query
attends its ``sliding_window`` latest keys; null: no window) and an optional
``head_dim`` of its own (Mistral NeMo's).  A config that lists ``layer_types`` slides
in the layers it names (transformers reads such a Mistral config as Ministral's), as
does ``model_type`` ministral."""
from __future__ import annotations

from .llama import Llama

__all__ = ["Mistral", "Ministral"]


class Mistral(Llama):
    """A Mistral checkpoint (``model_type`` mistral): :class:`~manyheads.models.llama.Llama`
    whose every layer has the config's ``sliding_window``."""

    model_type = "mistral"
    slides_everywhere = True  # (without layer_types)
    reads_layer_types = True
    window_default = 4096


class Ministral(Mistral):
    """A Ministral checkpoint (``model_type`` ministral): :class:`Mistral` whose
    ``layer_types`` say which layers slide."""

    model_type = "ministral"
