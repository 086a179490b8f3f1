"""Compare manyheads with PyTorch's CPU SDPA, the NumPy oracle and the machine's SGEMM rate.

    python benchmarks/bench_attention.py [--quick] [--repeats N] [--out DIR]

Same as ``python -m manyheads bench``; writes results.md, results.json and
attention_time.png into DIR (default: benchmarks/results).  All figures are
ratios measured in this one run (medians); see the README's performance section.
"""
import os
import sys

from manyheads.__main__ import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    sys.exit(main(["bench", *args]))
