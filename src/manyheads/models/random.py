"""Small random checkpoints, written the way Hugging Face lays them out, without torch.

:func:`save_random_checkpoint` writes ``config.json``, ``model.safetensors`` (safetensors'
NumPy writer) and, if asked, a ``tokenizer.json`` trained by ``tokenizers`` on a few
built-in sentences: a folder that :func:`manyheads.models.from_pretrained`, the
``generate`` and ``show`` commands and ``transformers`` itself can all load.  Nothing is
downloaded.  The weights are seeded normal draws scaled by 1/sqrt(fan_in), large enough
that greedy decoding wanders through the vocabulary instead of repeating one token
(with tied embeddings, as Qwen2's default here, a random model tends to repeat its
input token: the token's own embedding dominates its logits).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ._checkpoint import require_package

__all__ = ["save_random_checkpoint", "TOKENIZER_TEXT"]

#: Text whose words make the vocabulary of a random checkpoint's tokenizer.
TOKENIZER_TEXT = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. "
    "attention lets every token look back at the tokens before it. "
    "many heads look at the same text in different ways. "
    "once upon a time there was a small model that ran on a cpu."
)

_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  hidden_act="silu", attention_bias=False, mlp_bias=False),
    "qwen2": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  hidden_act="silu", use_sliding_window=False),
    "gpt2": dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                 layer_norm_epsilon=1e-5, activation_function="gelu_new",
                 tie_word_embeddings=False),
    "gpt_oss": dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=131072, sliding_window=128, rms_norm_eps=1e-5,
                    rope_theta=150000.0, rope_scaling=dict(
                        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                        truncate=False, original_max_position_embeddings=4096),
                    attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False,
                    hidden_act="silu"),
}
_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt2": "GPT2LMHeadModel", "gpt_oss": "GptOssForCausalLM"}


def _tensors(cfg: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Named float32 weights in Hugging Face's layout (nn.Linear: (out, in))."""
    def normal(*shape: int, fan_in: int | None = None) -> np.ndarray:
        std = 1.0 if fan_in is None else fan_in ** -0.5
        w: np.ndarray = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return w

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    V = cfg["vocab_size"]
    if cfg["model_type"] == "gpt2":
        d, L = cfg["n_embd"], cfg["n_layer"]
        F = cfg.get("n_inner") or 4 * d
        t["transformer.wte.weight"] = normal(V, d)
        t["transformer.wpe.weight"] = normal(cfg["n_positions"], d) * np.float32(0.3)
        for i in range(L):
            p = f"transformer.h.{i}."
            t[p + "ln_1.weight"], t[p + "ln_1.bias"] = norm(d), normal(d) * np.float32(0.1)
            t[p + "attn.c_attn.weight"] = normal(d, 3 * d, fan_in=d)
            t[p + "attn.c_attn.bias"] = normal(3 * d) * np.float32(0.1)
            t[p + "attn.c_proj.weight"] = normal(d, d, fan_in=d)
            t[p + "attn.c_proj.bias"] = normal(d) * np.float32(0.1)
            t[p + "ln_2.weight"], t[p + "ln_2.bias"] = norm(d), normal(d) * np.float32(0.1)
            t[p + "mlp.c_fc.weight"] = normal(d, F, fan_in=d)
            t[p + "mlp.c_fc.bias"] = normal(F) * np.float32(0.1)
            t[p + "mlp.c_proj.weight"] = normal(F, d, fan_in=F)
            t[p + "mlp.c_proj.bias"] = normal(d) * np.float32(0.1)
        t["transformer.ln_f.weight"], t["transformer.ln_f.bias"] = norm(d), normal(d) * 0.1
        if not cfg["tie_word_embeddings"]:
            t["lm_head.weight"] = normal(V, d, fan_in=d)
        return t
    d, L, F = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or d // H
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    experts = cfg["model_type"] == "gpt_oss"
    t["model.embed_tokens.weight"] = normal(V, d)
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        for name, rows in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D)):
            t[p + f"self_attn.{name}_proj.weight"] = normal(rows, d, fan_in=d)
            if qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = normal(rows) * np.float32(0.1)
        t[p + "self_attn.o_proj.weight"] = normal(d, H * D, fan_in=H * D)
        if cfg["model_type"] != "qwen2" and cfg.get("attention_bias", False):
            t[p + "self_attn.o_proj.bias"] = normal(d) * np.float32(0.1)
        if not experts:
            t[p + "mlp.gate_proj.weight"] = normal(F, d, fan_in=d)
            t[p + "mlp.up_proj.weight"] = normal(F, d, fan_in=d)
            t[p + "mlp.down_proj.weight"] = normal(d, F, fan_in=F)
            continue
        # gpt-oss: sinks, a router, and experts stored for x @ W, gate and up interleaved
        E = cfg["num_local_experts"]
        t[p + "self_attn.sinks"] = normal(H)
        t[p + "mlp.router.weight"] = normal(E, d, fan_in=d)
        t[p + "mlp.router.bias"] = normal(E) * np.float32(0.1)
        t[p + "mlp.experts.gate_up_proj"] = normal(E, d, 2 * F, fan_in=d)
        t[p + "mlp.experts.gate_up_proj_bias"] = normal(E, 2 * F) * np.float32(0.1)
        t[p + "mlp.experts.down_proj"] = normal(E, F, d, fan_in=F)
        t[p + "mlp.experts.down_proj_bias"] = normal(E, d) * np.float32(0.1)
    t["model.norm.weight"] = norm(d)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = normal(V, d, fan_in=d)
    return t


def save_random_checkpoint(path: str | os.PathLike[str], model_type: str = "llama", *,
                           seed: int = 0, tokenizer: bool = False, dtype: Any = np.float32,
                           **config: Any) -> str:
    """Write a seeded random checkpoint folder and return its path.

    Parameters
    ----------
    path : str or path-like
        The folder (created if needed).
    model_type : {"llama", "qwen2", "gpt2", "gpt_oss"}
    seed : int
    tokenizer : bool
        Also write a ``tokenizer.json``: the words of :data:`TOKENIZER_TEXT` (needs
        ``tokenizers``); the model's vocabulary is then that of the tokenizer unless
        ``vocab_size`` is given.
    dtype : float32 or float16
        Storage type of the weights.
    **config
        Overrides of the small default config (e.g. ``num_hidden_layers=30``).
    """
    if model_type not in _DEFAULTS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(_DEFAULTS))}")
    st_numpy = require_package("safetensors.numpy", "writing a checkpoint")
    cfg: dict[str, Any] = {"model_type": model_type, "architectures": [_ARCHITECTURE[model_type]],
                           **_DEFAULTS[model_type], **config}
    cfg.setdefault("bos_token_id", None)
    cfg.setdefault("eos_token_id", None)
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    if tokenizer:
        size = write_tokenizer(folder, cfg["vocab_size"])
        if "vocab_size" not in config:
            cfg["vocab_size"] = size
    tensors = {k: v.astype(dtype) for k, v in
               _tensors(cfg, np.random.default_rng(seed)).items()}
    cfg["torch_dtype"] = np.dtype(dtype).name
    st_numpy.save_file(tensors, os.path.join(folder, "model.safetensors"),
                       metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return folder


def write_tokenizer(folder: str, vocab_size: int) -> int:
    """A word-level ``tokenizer.json`` for the words of :data:`TOKENIZER_TEXT`; returns its
    size.  (A random model over byte-level pieces prints bytes that are no text; over
    whole words its output stays readable.)"""
    tk = require_package("tokenizers", "writing a tokenizer")
    tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    trainer = tk.trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"],
                                           show_progress=False)
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return int(tok.get_vocab_size())
