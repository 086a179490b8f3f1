"""Whole decoder models run in NumPy with manyheads attention, from checkpoint folders.

:func:`from_pretrained` reads a Hugging Face style folder (``config.json`` plus
``model.safetensors`` or its shards) with safetensors' NumPy API: torch is never
imported.  One file per architecture:

* :mod:`manyheads.models.gpt2` - GPT-2 (LayerNorm, GELU MLP, learned positions);
* :mod:`manyheads.models.llama` - Llama, SmolLM, TinyLlama (RMSNorm, SwiGLU, rotary
  embeddings with linear, dynamic, YaRN or Llama 3 scaling, grouped-query attention);
  the families below are this decoder with settings read from their configs;
* :mod:`manyheads.models.mistral` - Mistral (a sliding window in every layer) and
  Ministral (in the layers its ``layer_types`` name);
* :mod:`manyheads.models.qwen2` - Qwen2 and Qwen2.5 (Llama with q/k/v biases);
* :mod:`manyheads.models.qwen3` - Qwen3 (per-head q/k RMSNorm);
* :mod:`manyheads.models.gemma` - Gemma 2 and Gemma 3 text models (soft caps, norms
  around attention and MLP, alternating sliding and global layers, GELU-tanh);
* :mod:`manyheads.models.phi3` - Phi-3 (fused qkv and gate/up projections);
* :mod:`manyheads.models.gpt_oss` - gpt-oss (attention sinks, a mixture of experts,
  float or MXFP4 expert weights).

Reading checkpoints needs the ``models`` extra (``safetensors``; ``ml_dtypes`` for
bfloat16 files; ``tokenizers`` for the ``generate`` command's text prompts, ``jinja2`` for
the ``chat`` command's templates); Hub ids (``org/name``) need the ``hub`` extra
(``huggingface_hub``).
"""
from __future__ import annotations

import os
from typing import Any

from .. import _blas
from ..weights import WeightArena
from ._checkpoint import WEIGHT_DTYPES, Checkpoint, read_config
from ._decoder import DecoderModel
from ._hub import resolve_checkpoint
from .gemma import Gemma2, Gemma3
from .gpt2 import GPT2
from .gpt_oss import GptOss
from .llama import Llama
from .mistral import Ministral, Mistral
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen3 import Qwen3

__all__ = ["from_pretrained", "DecoderModel", "GPT2", "Llama", "Mistral", "Ministral", "Qwen2",
           "Qwen3", "Gemma2", "Gemma3", "Phi3", "GptOss", "ARCHITECTURES"]

#: model_type of config.json -> the class that runs it
ARCHITECTURES: dict[str, type[Any]] = {
    "gpt2": GPT2, "llama": Llama, "mistral": Mistral, "ministral": Ministral, "qwen2": Qwen2,
    "qwen3": Qwen3, "gemma2": Gemma2, "gemma3_text": Gemma3, "phi3": Phi3, "gpt_oss": GptOss}

#: model_types that are known but not run, and why
REFUSED = {
    "gemma3": "a multimodal Gemma 3 checkpoint (vision tower and text model) is not "
              "supported: manyheads.models runs Gemma 3 text models only (model_type "
              "'gemma3_text', e.g. google/gemma-3-1b-it)",
}


def from_pretrained(path: str | os.PathLike[str], *, revision: str | None = None,
                    weight_dtype: str = "float32") -> DecoderModel:
    """The model of a checkpoint folder or Hugging Face Hub id.

    Parameters
    ----------
    path : str or path-like
        A folder with ``config.json`` and ``model.safetensors`` (or shards listed
        in ``model.safetensors.index.json``), e.g. one written by
        ``save_pretrained`` or fetched with ``hf download``; or, when no such
        folder exists, a Hub id ``org/name``, read from the local Hugging Face
        cache or else downloaded into it (only the files needed), with
        ``huggingface_hub`` (the ``hub`` extra).
    revision : str, optional
        With a Hub id: the branch, tag or commit hash (default: ``main``).
    weight_dtype : {"float32", "auto", "bfloat16", "float16", "int8"}, optional
        How the projections and embeddings are held (norms and biases stay
        float32; activations are float32 throughout).  ``"float32"`` (default)
        widens every weight; ``"auto"`` keeps each tensor's precision in the
        file (a bfloat16 checkpoint stays bfloat16: half the memory, and half
        the bytes each decoded token reads); ``"bfloat16"`` and ``"float16"``
        round to that; ``"int8"`` quantises each output column symmetrically
        (``max|w| / 127``) as it loads, about a quarter of float32.  Weights are
        read a slice at a time, so loading holds little beyond the result.

    Returns
    -------
    DecoderModel
        With ``logits(ids)`` -> (B, T, vocab) float32 and
        ``generate(ids, max_new_tokens)`` -> (B, max_new_tokens) token ids.

    Raises
    ------
    FileNotFoundError
        No such folder, no config.json, or no safetensors weights.
    ValueError
        An unsupported ``model_type`` or setting, a malformed config.json, or
        weights that do not match the config.
    ImportError
        ``safetensors`` (or ``ml_dtypes`` for bfloat16) is not installed, or a
        Hub id is given without ``huggingface_hub``.
    OSError
        A Hub id that is neither cached nor downloadable.
    """
    if not isinstance(weight_dtype, str) or weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(map(repr, WEIGHT_DTYPES))} "
                         f"(a string), got {weight_dtype!r}")
    path = resolve_checkpoint(path, revision)
    cfg = read_config(path)
    kind = cfg["model_type"]
    if kind in REFUSED:
        raise ValueError(f"model_type {kind!r}: {REFUSED[kind]}")
    if kind not in ARCHITECTURES:
        raise ValueError(f"model_type {kind!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    quant = cfg.get("quantization_config")
    if quant is not None and kind != "gpt_oss":  # (gpt-oss reads its MXFP4 experts)
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantised checkpoints are not supported (quantization_config "
                         f"with quant_method {method!r}): use the unquantised checkpoint, "
                         "and weight_dtype='int8' to quantise it at load")
    # the BLAS the prefill's projections use, loaded now: its threads start with it and
    # spin for about 0.1 s, which the loading covers rather than the first prompt (a
    # SmolLM2-shaped float32 model's first 128-token prefill took 260-320 ms against
    # 200-220 once they had settled)
    _blas.available()
    with Checkpoint(path) as ckpt:
        ckpt.weight_dtype = weight_dtype
        ckpt.arena = WeightArena()  # the projections side by side, on huge pages
        model: DecoderModel = ARCHITECTURES[kind](cfg, ckpt)
    return model
