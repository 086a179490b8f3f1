"""One-row products at the memory limit: ``mh.linear`` reading weights in each storage
format, against the machine's read rate measured in the same run.

Decoding one token reads every weight once, so a one-row product is bound by how fast
the weights stream from memory. The read rate is a plain streaming sum of a 512 MiB
float32 buffer on manyheads' own threads (``_kernels.read_sum``: items of 1 MiB, each
read as four runs side by side, the way the product reads eight rows of a weight). Each
product's weights are cold as in a deep model: enough copies of them (at least 256 MiB)
are cycled through that none is in the last-level cache when it is read again. Each
format's copies are held two ways: apart (an array each, as a user's own arrays are) and
packed in a ``WeightArena`` (as ``manyheads.models`` holds a checkpoint's weights, on huge
pages where the system grants them; a weight above a quarter of the arena's block keeps
an array of its own, so the head's two placements are alike). NumPy's
rounds come after manyheads' (OpenBLAS's threads spin after a call and would slow
manyheads' threads if the two alternated). Shapes are SmolLM2-135M's: the fused gate and
up projection (576 x 3072), the down projection (1536 x 576) and the output head (576 x
49152). NumPy's ``x @ W`` (float32, its BLAS's threads) is shown beside.

Medians of interleaved rounds; every ratio from one run.  Two read rates: beside (each
round's products against the mean of the reads just before and just after that round,
the median over rounds: a VM's read rate moves by 1.5-2x within seconds, and this is
the rate the round could have read) and best (the best read of the run, what the
machine can do at its best).

    python benchmarks/bench_linear.py [--rounds 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import manyheads as mh  # noqa: E402
from manyheads import _core, _kernels  # noqa: E402
from manyheads.weights import (WEIGHT_DTYPES, WeightArena, convert_weight,  # noqa: E402
                               join_columns)

SHAPES = {"gate+up 576x3072": (576, 3072), "down 1536x576": (1536, 576),
          "head 576x49152": (576, 49152)}
FORMATS = WEIGHT_DTYPES
COLD_BYTES = 256 << 20
READ_BYTES = 512 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    threads = mh.get_num_threads()
    rng = np.random.default_rng(0)
    buf = np.ones(READ_BYTES // 4, np.float32)

    cases = {}
    for label, (k, n) in SHAPES.items():
        base = rng.standard_normal((k, n), dtype=np.float32)
        for fmt in FORMATS + ("numpy",):
            one = convert_weight(base, "float32" if fmt == "numpy" else fmt)
            copies = [one] + [convert_weight(base + np.float32(i), "float32" if fmt == "numpy"
                                             else fmt)
                              for i in range(1, -(-COLD_BYTES // one.nbytes))]
            cases[(label, fmt, "apart")] = copies
            if fmt != "numpy":
                arena = WeightArena()
                cases[(label, fmt, "arena")] = [join_columns([w], arena) for w in copies]
    x = {k: rng.standard_normal((1, k), dtype=np.float32) for k, _ in SHAPES.values()}

    def run(label: str, fmt: str, place: str) -> float:
        ws = cases[(label, fmt, place)]
        xs = x[ws[0].shape[0]]
        t = time.perf_counter()
        for w in ws:
            if fmt == "numpy":
                xs @ w
            else:
                _core.linear(xs, w, None, threads)
        return (time.perf_counter() - t) / len(ws)

    def read() -> float:
        t = time.perf_counter()
        _kernels.read_sum(buf, threads)
        return time.perf_counter() - t

    times: dict[object, list[float]] = {key: [] for key in cases}
    reads: list[float] = []
    ours = [key for key in cases if key[1] != "numpy"]
    for key in ours:  # warm-up: first touches, thread start
        run(*key)
    read()
    for _ in range(args.rounds):
        reads.append(read())
        for key in ours:
            times[key].append(run(*key))
    reads.append(read())
    # NumPy's after manyheads' rounds: OpenBLAS's threads spin for a while after each
    # call, and interleaved they would take the two cores from manyheads' threads
    for key in cases:
        if key[1] == "numpy":
            run(*key)
            times[key] = [run(*key) for _ in range(args.rounds)]
    read_rate = READ_BYTES / min(reads) / 1e9  # what the machine can do: the best round
    rates = [READ_BYTES / t / 1e9 for t in reads]
    beside = [(a + b) / 2 for a, b in zip(rates, rates[1:])]  # each of our rounds'

    lines = [f"manyheads {mh.__version__} ({mh.kernel_isa()}), {threads} threads; "
             f"medians of {args.rounds} interleaved rounds",
             f"read rate (streaming sum of 512 MiB on manyheads' threads): best round "
             f"{read_rate:.1f} GB/s; beside manyheads' rounds (mean of the reads before and "
             "after each) " + ", ".join(f"{b:.1f}" for b in beside),
             "",
             f"{'one-row product':<20}{'weights':<10}{'held':<7}{'MiB':>8}{'us':>10}"
             f"{'GB/s':>8}{'of beside':>11}{'of best':>9}"]
    for (label, fmt, place), ts in times.items():
        w = cases[(label, fmt, place)][0]
        sec = float(np.median(ts))
        rate = w.nbytes / sec / 1e9
        name = "NumPy f32" if fmt == "numpy" else fmt
        # NumPy's rounds come after ours: no read beside them
        of_beside = (f"{np.median([w.nbytes / t / 1e9 / b for t, b in zip(ts, beside)]):11.0%}"
                     if fmt != "numpy" else f"{'':11}")
        lines.append(f"{label:<20}{name:<10}{place:<7}{w.nbytes / 2**20:8.1f}{sec * 1e6:10.0f}"
                     f"{rate:8.1f}{of_beside}{rate / read_rate:9.0%}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
