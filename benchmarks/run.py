"""Compare manyheads with its CPU peers, the NumPy oracle and the machine's SGEMM rate.

    python benchmarks/run.py [--quick] [--repeats N] [--peers LIST] [--section LIST]
                             [--out DIR] [--no-progress]

Run it from a source checkout with manyheads installed (``pip install '.[bench]'``
brings the peers; ``'.[test]'`` brings transformers for the inference
section's GPT-2 generation).  ``python -m manyheads bench`` in the checkout
runs this file too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

if __package__ in (None, ""):
    # run as a script: import the benchmark as the package it is, from the checkout's
    # root, rather than its modules as top-level names from this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import manyheads as mh  # noqa: E402
from benchmarks import cases, claims, hf_models, inference, peers, report  # noqa: E402
from benchmarks.results import BenchResult  # noqa: E402
from benchmarks.timing import Progress, load_average  # noqa: E402

#: the parts of the benchmark, in run order; ``--section`` picks some
SECTIONS = ("attention", "module", "inference", "hf")
#: where results go without --out: the folder the README's figures come from
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

DESCRIPTION = """\
Time manyheads' causal attention (prefill and decode) and its fused module
against its CPU peers, the NumPy oracle and the machine's SGEMM rate, all in
one run on the same thread count; every figure is a ratio of medians.

peers (each optional: one that is not installed is skipped with a note;
pip install '.[bench]' in the source checkout installs all three):
  torch        PyTorch's torch.nn.functional.scaled_dot_product_attention
  onnxruntime  ONNX Runtime, a one-node com.microsoft GroupQueryAttention model
  openvino     OpenVINO, an opset-13 ScaledDotProductAttention model (CPU plugin)

Each peer's output is compared with manyheads' on every shape before it is
timed; one that differs is reported and not timed.  Results (results.md,
results.json, attention_time.png) go to --out, by default benchmarks/results
in the checkout (the figures the README shows).

sections (--section, comma-separated; default all):
  attention    causal SDPA prefill and decode against every peer, threads, memory;
               a layer's decode step through float32, float16, bfloat16, int8 and
               int4 caches (bytes per token, read rate; at the longest L also with
               the cache evicted before each call: the claim int4 >= 1.5x int8
               cold); grouped-query decode (32
               query heads on 8 kv heads) against the kv heads repeated; float16
               and bfloat16 prefill against float32
  module       the fused and stacked modules at B=8, T=1024, d=768, 12 heads
  inference    (brings module along) float32, against PyTorch:
               - a layer decode step: one fused layer (d=768, 12 heads, qkv bias)
                 and one new token against a KV cache of 1024 tokens, against
                 torch's layer written the same way (qkv F.linear, SDPA over a
                 preallocated KV buffer, output F.linear), same weights;
               - GPT-2-small-shaped generation (random seeded weights): a
                 200-token prompt then 32 greedy tokens, manyheads' runner
                 against Hugging Face generate(do_sample=False) (needs
                 transformers), tokens/s and whether the tokens are identical;
               - one tiny SDPA call (12 heads x 1 query x 16 keys);
               - the layer step and manyheads' generation again in a subprocess
                 that never imports torch, and the layer step in a subprocess
                 with OPENBLAS_NUM_THREADS=1 (this process sets no variable);
               - the claims a user can check, each met or not with its measured
                 ratio: layer step >= 1.5x torch, generation >= 1.3x Hugging
                 Face's tokens/s with identical tokens, module prefill >= 1.2x
                 torch, tiny SDPA >= 1.5x torch, layer step within 1.2x
                 of the OPENBLAS_NUM_THREADS=1 run.
  hf           whole Hugging Face models with random weights (needs torch and
               transformers; a note otherwise), attn_implementation="manyheads"
               against transformers' own backend on the same weights, the whole
               forward and the time inside the attention function (each backend
               timed through the same AttentionInterface wrapper):
               - SmolLM2-135M's shape: prefill at T = 512, 2048, 4096 and a
                 decode step at a context of 4096, against "sdpa";
               - Gemma-2-2B's shape, 4 layers: prefill at T = 4096, against
                 "eager" (transformers runs Gemma 2's soft cap eagerly);
               - its claims: SmolLM2 attention >= 1.4x and whole forward >= 1.1x
                 "sdpa" at T=4096, decode no slower; Gemma 2 attention >= 3x and
                 whole forward >= 1.25x "eager".

The machine's 1-minute load average is recorded at the start and the end: on
a busy machine every figure moves, and not evenly.
"""


def parse_sections(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Sections to run from "all", a comma-separated string or a list (ValueError if unknown).

    ``inference`` brings ``module`` along: one of its claims is the module's prefill.
    """
    if spec is None:
        return SECTIONS
    items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [x for x in items if x]
    if not items or "all" in items:
        return SECTIONS
    unknown = [x for x in items if x not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; expected all or some of "
                         f"{', '.join(SECTIONS)}")
    if "inference" in items:
        items.append("module")
    return tuple(x for x in SECTIONS if x in items)


def parse_peers(spec: str | Sequence[str] | None) -> list[str]:
    """Peer names from a comma-separated string or a list (ValueError if unknown)."""
    if spec is None:
        return list(peers.PEER_NAMES)
    items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [x for x in items if x]
    unknown = [n for n in names if n not in peers.PEER_NAMES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(peers.PEER_NAMES)}")
    return names


def run(quick: bool = False, repeats: int = 7, progress: bool = True,
        peer_names: str | Sequence[str] | None = None,
        sections: str | Sequence[str] | None = None) -> BenchResult:
    """Run the comparison and return what it measured.

    ``peer_names`` names the peers to include (default: every one in
    ``peers.PEER_NAMES``); those that are not installed are left out and
    recorded as None.  ``sections`` picks parts of the run (default: all of
    ``SECTIONS``).
    """
    names = parse_peers(peer_names)
    parts = parse_sections(sections)
    versions = peers.versions(names)
    others = [n for n in peers.PEERS if versions.get(n)]
    with_torch = peers.torch_module() is not None if versions.get("torch") else False
    threads = mh.get_num_threads()
    Ts = [128, 512, 1024, 2048] if quick else [128, 512, 1024, 2048, 4096]
    side = [] if quick else [(2048, 32, np.float32), (2048, 128, np.float32),
                             (1024, 64, np.float64), (2048, 64, np.float64)]
    n_steps = 0
    if "attention" in parts:
        n_steps += 1 + len(Ts) + len(side) + (0 if quick else 2) + 3
    n_steps += ("module" in parts) + 4 * ("inference" in parts)
    n_steps += hf_models.steps(quick) if "hf" in parts else 0
    steps = Progress(n_steps, progress)
    res = BenchResult(config=mh.show_config(mode="dicts"), threads=threads,
                      cpu_count=os.cpu_count(), sections=list(parts), peers=versions,
                      numpy_blas={}, load_start=load_average())
    res.numpy_blas = cases.numpy_blas()
    if "attention" in parts:
        res.sgemm_gflops = cases.sgemm_gflops()
        time.sleep(0.5)
        steps.step("SGEMM 2048x2048")
        rows = []
        for T in Ts:
            rows.append(cases.prefill_case(T, 64, np.float32, threads, repeats, with_torch,
                                           with_oracle=T <= 2048, others=others))
            steps.step(f"causal SDPA T={T} D=64 float32")
        for T, D, dt in side:
            rows.append(cases.prefill_case(T, D, dt, threads, repeats, with_torch,
                                           with_oracle=False, others=others))
            steps.step(f"causal SDPA T={T} D={D} {np.dtype(dt).name}")
        res.prefill = rows
        if not quick:
            res.thread_scaling = cases.thread_scaling(2048, threads, repeats)
            steps.step("1 thread against all, T=2048")
            res.peak_memory = cases.peak_memory(16384)
            steps.step("peak memory, T=16384")
    if "module" in parts:
        res.module = cases.module_case(threads, max(5, repeats // 2 + 1), with_torch)
        steps.step("module B=8 T=1024 d=768 H=12")
    if "attention" in parts:
        res.bandwidth = cases.read_bandwidth(threads)
        steps.step("memory read rate, 1 GiB")
        res.decode = cases.decode_cases(threads, repeats, with_torch,
                                        (1024, 4096) if quick else (1024, 4096, 16384),
                                        others=others)
        steps.step("decode q_len=1")
        res.cache_formats = cases.cache_format_cases(threads, with_torch,
                                                     (1024,) if quick else (1024, 16384))
        res.gqa = cases.gqa_case(threads, 4096 if quick else 16384)
        res.half_prefill = cases.half_prefill_case(threads, 512 if quick else 2048)
        steps.step("cache formats, GQA, half-precision prefill")
    if "inference" in parts:
        res.inference = inference.inference_section(threads, with_torch, quick, steps.step)
    if "hf" in parts:
        res.hf_models = hf_models.hf_models_section(threads, quick, steps.step)
    if "inference" in parts or "hf" in parts or "attention" in parts:
        res.claims = claims.evaluate(res)
    res.load_end = load_average()
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/run.py", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per case (median)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="folder for table, JSON and plot (default: benchmarks/results in "
                        "the checkout)")
    p.add_argument("--peers", default=",".join(peers.PEER_NAMES),
                   help="comma-separated peers to include (default: %(default)s)")
    p.add_argument("--section", default="all",
                   help="parts to run, comma-separated: attention, module, inference "
                        "(inference brings module along), hf, or all (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = parse_peers(args.peers)
        sections = parse_sections(args.section)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for name, version in peers.versions(names).items():
        if version is None:
            print(peers.missing_note(name))
    res = run(quick=args.quick, repeats=args.repeats, progress=not args.no_progress,
              peer_names=names, sections=sections)
    written = report.write(res, args.out)
    print(report.format_markdown(res))
    plot = ""
    if "attention" in sections:
        plot = (", attention_time.png" if "plot" in written
                else " (no plot: pip install matplotlib)")
    print(f"wrote results.md, results.json{plot} to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
