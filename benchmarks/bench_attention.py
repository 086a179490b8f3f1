"""Compare manyheads with its CPU peers, the NumPy oracle and the machine's SGEMM rate.

    python benchmarks/bench_attention.py [--quick] [--repeats N] [--peers LIST]
                                         [--section LIST] [--out DIR]

Same as ``python -m manyheads bench`` (peers: PyTorch SDPA, ONNX Runtime's
GroupQueryAttention, OpenVINO's ScaledDotProductAttention; ``pip install
'.[bench]'`` installs them, and ``'.[test]'`` brings transformers for the
inference section's GPT-2 generation) except that results.md, results.json and
attention_time.png go to DIR, by default this folder's results/, the tables and
plot the README shows.  ``--section inference`` runs the inference part alone
(layer decode step, GPT-2 generation, tiny SDPA, the torch-free and
OPENBLAS_NUM_THREADS=1 subprocesses, the bars).  All figures are ratios
measured in this one run (medians); see the README's performance section.
"""
import os
import sys

from manyheads.__main__ import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    sys.exit(main(["bench", *args]))
