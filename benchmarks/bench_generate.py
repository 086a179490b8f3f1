"""Greedy generation of a whole model: manyheads.models against transformers on torch.

A SmolLM2-135M-shaped checkpoint (30 layers, d=576, 9 heads, 3 key/value heads, MLP 1536,
vocabulary 49152, tied embeddings) with seeded random weights is written as safetensors;
manyheads loads it with ``from_pretrained`` (NumPy, no torch) and transformers with
``AutoModelForCausalLM.from_pretrained``, in the same process on the same thread count.
Both generate greedily with a KV cache; their tokens must be identical.

Printed: tokens/s of ``generate`` at a 128-token prompt with 32 new tokens (the whole
call, prompt included), the decode rate alone, and the time to the first token at a
512-token prompt.  Medians of interleaved rounds (``benchmarks.timing.compare``), every
ratio from one run.

    python benchmarks/bench_generate.py [--rounds 5] [--layers 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    # run as a script: import the benchmark package from the checkout's root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import manyheads as mh  # noqa: E402
from benchmarks.timing import compare  # noqa: E402
from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    ap.add_argument("--layers", type=int, default=30, help="fewer for a quick look")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--out", help="folder to keep the checkpoint in (default: a temporary one)")
    args = ap.parse_args()

    import warnings

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values' new name

    threads = mh.get_num_threads()
    torch.set_num_threads(threads)
    folder = args.out or tempfile.mkdtemp(prefix="bench-generate-")
    cfg = dict(SMOLLM2_135M, num_hidden_layers=args.layers)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        save_random_checkpoint(folder, "llama", seed=0, **cfg)
    ours = from_pretrained(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)  # float32 weights
    theirs.eval()
    print(f"manyheads {mh.__version__} ({mh.kernel_isa()}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {threads} threads on both sides")
    print(ours)

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg["vocab_size"], size=(1, args.prompt))
    long_prompt = rng.integers(0, cfg["vocab_size"], size=(1, args.ttft_prompt))
    tp, tlp = torch.from_numpy(prompt), torch.from_numpy(long_prompt)

    def hf_generate(ids: torch.Tensor, n: int) -> np.ndarray:
        with torch.inference_mode():
            out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].numpy()

    a, b = ours.generate(prompt, args.new), hf_generate(tp, args.new)
    same = bool(np.array_equal(a, b))
    print(f"greedy tokens identical ({args.new} after a {args.prompt}-token prompt): {same}")
    if not same:
        print(f"  manyheads:    {a[0].tolist()}\n  transformers: {b[0].tolist()}")

    steps = args.new - 1

    def ours_decode() -> float:
        """Seconds of the decode steps after a prefill (not timed) of the prompt."""
        caches = ours.new_caches(1, args.prompt + args.new)
        tok = np.argmax(ours.logits(prompt, caches=caches, last_only=True)[:, -1], -1)[:, None]
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = np.argmax(ours.logits(tok, caches=caches, last_only=True)[:, -1], -1)[:, None]
        return time.perf_counter() - t0

    def hf_decode() -> float:
        """The same with transformers' forward and its DynamicCache (no generate)."""
        with torch.inference_mode():
            out = theirs(input_ids=tp, use_cache=True, logits_to_keep=1)
            pkv = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = theirs(input_ids=tok, past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

    decode_s: dict[str, list[float]] = {"manyheads": [], "transformers": []}
    t_start = time.perf_counter()
    gen = compare({
        "manyheads": lambda: ours.generate(prompt, args.new),
        "transformers": lambda: hf_generate(tp, args.new),
    }, rounds=args.rounds, per_round=2)
    ttft = compare({
        "manyheads": lambda: ours.generate(long_prompt, 1),
        "transformers": lambda: hf_generate(tlp, 1),
    }, rounds=args.rounds, per_round=2)
    for _ in range(args.rounds):  # interleaved; the first of each block is a warm-up
        for name, fn in (("manyheads", ours_decode), ("transformers", hf_decode)):
            decode_s[name] += [fn() for _ in range(2)][1:]
    dec = {k: steps / float(np.median(v)) for k, v in decode_s.items()}
    elapsed = time.perf_counter() - t_start

    rate = {k: args.new / v for k, v in gen.items()}
    print(f"\ngenerate, {args.prompt}-token prompt + {args.new} greedy tokens "
          f"(whole call; medians of {args.rounds} interleaved rounds):")
    print(f"  manyheads     {gen['manyheads'] * 1e3:8.1f} ms  {rate['manyheads']:6.1f} tokens/s")
    print(f"  transformers  {gen['transformers'] * 1e3:8.1f} ms  "
          f"{rate['transformers']:6.1f} tokens/s")
    print(f"  ratio (manyheads tokens/s / transformers tokens/s): "
          f"{rate['manyheads'] / rate['transformers']:.2f}x")
    print(f"time to first token, {args.ttft_prompt}-token prompt:")
    print(f"  manyheads     {ttft['manyheads'] * 1e3:8.1f} ms")
    print(f"  transformers  {ttft['transformers'] * 1e3:8.1f} ms")
    print(f"  ratio (transformers time / manyheads time): "
          f"{ttft['transformers'] / ttft['manyheads']:.2f}x")
    print(f"decode steps alone ({steps} after the prompt; transformers as forward calls "
          f"with its DynamicCache, no generate):")
    print(f"  manyheads     {dec['manyheads']:6.1f} tokens/s")
    print(f"  transformers  {dec['transformers']:6.1f} tokens/s")
    print(f"  ratio: {dec['manyheads'] / dec['transformers']:.2f}x")
    print(f"(benchmark ran {elapsed:.0f} s; a shared 2-core machine moves single runs by "
          "10-30%: repeat it)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
