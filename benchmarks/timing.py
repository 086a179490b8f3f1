"""How the benchmark times things: medians of interleaved rounds, and a progress line.

Every figure the benchmark reports is a median of repeated calls, and every
comparison is a ratio of two medians measured in the same run.  Contenders run
in blocks (one library's idle thread pool, still spinning after its calls, then
lands at most in the first call of the next block, which is discarded) and the
blocks alternate, so a slow spell of a shared machine hits every contender
alike.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np


def compare(fns: dict[str, Callable[[], Any]], rounds: int = 5, per_round: int = 2,
            warmup: int = 1, before: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds.

    Each round runs every function ``per_round`` times back to back, plus one
    leading call that is discarded when ``per_round > 1``; the rounds
    alternate between the functions.  ``warmup`` untimed calls of each come
    first.  ``before``, if given, runs untimed before every timed call (e.g. to
    evict the caches).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            block = []
            for _ in range(per_round + (1 if per_round > 1 else 0)):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fn()
                block.append(time.perf_counter() - t0)
            times[name] += block[1:] if per_round > 1 else block
    return {name: float(np.median(t)) for name, t in times.items()}


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    return compare({"f": fn}, rounds=1, per_round=repeats, warmup=warmup)["f"]


def adaptive_compare(fns: dict[str, Callable[[], Any]], seconds: float = 1.5,
                     lo: int = 40, hi: int = 2000) -> dict[str, float]:
    """compare() with enough calls for about ``seconds`` per contender (the slowest decides)."""
    estimate = 1e-6
    for fn in fns.values():
        t0 = time.perf_counter()
        fn()
        estimate = max(estimate, time.perf_counter() - t0)
    calls = int(min(hi, max(lo, seconds / estimate)))
    rounds = 10
    return compare(fns, rounds=rounds, per_round=max(1, calls // rounds), warmup=2)


def split_reduction(a: np.ndarray, threads: int,
                    fn: Callable[[np.ndarray], Any]) -> Callable[[], None]:
    """A call that reads ``a`` once on ``threads`` threads: each applies the NumPy
    reduction ``fn`` to its share (NumPy lets go of the GIL inside it, so the shares are
    read at once), the calling thread taking the first."""
    parts = np.array_split(a.reshape(-1), threads)

    def run() -> None:
        workers = [threading.Thread(target=fn, args=(p,)) for p in parts[1:]]
        for w in workers:
            w.start()
        fn(parts[0])
        for w in workers:
            w.join()
    return run


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


class Progress:
    """How far the run is, on one line of stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.1f}s  {label[:40]:<40}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
