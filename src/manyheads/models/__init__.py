"""Whole models run in NumPy with manyheads attention (torch-free where possible).

* :mod:`manyheads.models.gpt2` - GPT-2, from a Hugging Face model's weights.
"""
