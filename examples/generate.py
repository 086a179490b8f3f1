"""A small GPT-style decoder on manyheads, generating with and without a KV cache.

    python examples/generate.py [--tokens 64] [--prompt "text"] [--layers 4]

Byte-level vocabulary (256 tokens), token and position embeddings, N blocks of
LayerNorm -> MultiHeadAttention -> residual, LayerNorm -> MLP (GELU) ->
residual, a final LayerNorm and an output projection.  Weights are random
(seeded): the text is gibberish, but the computation is a real decoder, so the
two generation loops must produce the same tokens, and the cache must make the
second one faster.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import manyheads as mh


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * gain + bias


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))


class TinyGPT:
    def __init__(self, d: int = 256, heads: int = 8, layers: int = 4, context: int = 512,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        f32 = np.float32
        self.context = context
        self.tok = (rng.standard_normal((256, d)) * 0.5).astype(f32)
        self.pos = (rng.standard_normal((context, d)) * 0.1).astype(f32)
        self.blocks = []
        for i in range(layers):
            self.blocks.append({
                "ln1": (np.ones(d, f32), np.zeros(d, f32)),
                "attn": mh.MultiHeadAttention(d, d, context, 0.0, heads, qkv_bias=True,
                                              seed=seed * 100 + i),
                "ln2": (np.ones(d, f32), np.zeros(d, f32)),
                "w1": (rng.standard_normal((d, 4 * d)) / np.sqrt(d)).astype(f32),
                "w2": (rng.standard_normal((4 * d, d)) / np.sqrt(4 * d)).astype(f32),
            })
        self.ln_f = (np.ones(d, f32), np.zeros(d, f32))
        self.head = (rng.standard_normal((d, 256)) * 2 / np.sqrt(d)).astype(f32)

    def new_caches(self, max_len: int) -> list[mh.KVCache]:
        return [b["attn"].new_cache(1, max_len) for b in self.blocks]

    def logits(self, tokens: list[int], start: int = 0,
               caches: list[mh.KVCache] | None = None) -> np.ndarray:
        """Logits of the last position for tokens[start:], given caches holding tokens[:start]."""
        ids = np.array(tokens[start:])
        x = self.tok[ids] + self.pos[start:start + len(ids)]
        for i, b in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = x + b["attn"](layer_norm(x, *b["ln1"]), cache=cache)
            x = x + gelu(layer_norm(x, *b["ln2"]) @ b["w1"]) @ b["w2"]
        return layer_norm(x[-1], *self.ln_f) @ self.head


def generate(model: TinyGPT, prompt: list[int], n: int, use_cache: bool) -> tuple[list[int], float]:
    tokens = list(prompt)
    caches = model.new_caches(len(prompt) + n) if use_cache else None
    t0 = time.perf_counter()
    logits = model.logits(tokens, 0, caches)
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == len(prompt) + n:
            break
        if use_cache:
            logits = model.logits(tokens, len(tokens) - 1, caches)
        else:
            logits = model.logits(tokens)
    return tokens[len(prompt):], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Attention on a CPU, one token at a time: ")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    model = TinyGPT(layers=args.layers)
    prompt = list(args.prompt.encode("utf-8"))
    if len(prompt) + args.tokens > model.context:
        raise SystemExit(f"prompt + tokens must fit the context of {model.context}")
    print(f"TinyGPT: {args.layers} layers, d=256, 8 heads, byte vocabulary; kernel path "
          f"{mh.kernel_isa()}, {mh.get_num_threads()} threads")
    print(f"prompt: {len(prompt)} tokens; generating {args.tokens} greedily")
    slow, t_slow = generate(model, prompt, args.tokens, use_cache=False)
    fast, t_fast = generate(model, prompt, args.tokens, use_cache=True)
    print(f"without cache: {args.tokens / t_slow:8.1f} tokens/s")
    print(f"with KV cache: {args.tokens / t_fast:8.1f} tokens/s  ({t_slow / t_fast:.1f}x)")
    print(f"identical tokens: {slow == fast}")
    print("text:", repr(bytes(fast).decode("utf-8", errors="replace")))
    if slow != fast:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
