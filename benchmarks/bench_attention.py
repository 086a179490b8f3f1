"""Compare manyheads with its CPU peers, the NumPy oracle and the machine's SGEMM rate.

    python benchmarks/bench_attention.py [--quick] [--repeats N] [--peers LIST] [--out DIR]

Same as ``python -m manyheads bench`` (peers: PyTorch SDPA, ONNX Runtime's
GroupQueryAttention, OpenVINO's ScaledDotProductAttention; ``pip install
'.[bench]'`` installs them) except that results.md, results.json and
attention_time.png go to DIR, by default this folder's results/, the table and
plot the README shows.  All figures are ratios measured in this one run
(medians); see the README's performance section.
"""
import os
import sys

from manyheads.__main__ import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    sys.exit(main(["bench", *args]))
