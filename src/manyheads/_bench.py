"""Benchmarks: manyheads against its CPU peers, the NumPy oracle and SGEMM.

The peers are PyTorch's CPU SDPA, ONNX Runtime's GroupQueryAttention and
OpenVINO's ScaledDotProductAttention (built in ``_peers``); each is optional and
runs on manyheads' thread count.  Every peer's output is compared with
manyheads' on the same inputs before it is timed; one that differs is not
timed.  Every figure is a ratio measured in one run on one machine (medians of
repeated calls); nothing here is an absolute claim.  Each implementation's
repetitions run back to back, so one thread pool's idle spinning does not
land in another's timings.  ``python -m manyheads bench`` runs this; the
``benchmarks/`` folder of the repository calls it with its own options.

The inference section measures what a generation loop does: a layer's decode
step against torch's layer written the same way, a GPT-2-small-shaped model's
greedy generation against Hugging Face's ``generate``, a tiny SDPA call; the
layer step and manyheads' generation also run in a subprocess that never
imports torch, and the layer step in one with ``OPENBLAS_NUM_THREADS=1``.
Each result is checked (outputs, tokens) before or as it is timed, and set
against the bars of the project's issue 10 (``BARS``).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

import manyheads as mh
from manyheads import _peers, oracle

#: every peer the benchmark knows, in table order
PEER_NAMES = ("torch", *_peers.PEERS)
LABELS = {"torch": "torch SDPA", **{k: v[1] for k, v in _peers.PEERS.items()}}
SHORT = {"torch": "torch", "onnxruntime": "ORT", "openvino": "OpenVINO"}
#: largest |peer - manyheads| accepted before a peer is timed, by dtype
CHECK_ATOL = {"float32": 1e-4, "float64": 1e-9}


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def peer_versions(names: Sequence[str] = PEER_NAMES) -> dict[str, str | None]:
    """Installed version of each named peer (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        if name == "torch":
            torch = _torch()
            out[name] = None if torch is None else str(torch.__version__)
        else:
            out[name] = _peers.version(name)
    return out


def default_out_dir() -> str:
    """Where ``python -m manyheads bench`` writes without ``--out``: a per-user cache folder.

    Outside any source tree: ``$XDG_CACHE_HOME`` (or ``~/.cache``) on Linux,
    ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows, each with
    ``manyheads/bench`` below it; the system's temporary folder when that
    base is missing or not writable.
    """
    home = os.path.expanduser("~")
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA", "")
    elif sys.platform == "darwin":
        base = os.path.join(home, "Library", "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    probe = base
    while probe and not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the nearest folder that exists must be writable
    if not base or not os.access(probe, os.W_OK):
        base = tempfile.gettempdir()
    return os.path.join(base, "manyheads", "bench")


def numpy_blas() -> dict[str, str]:
    """NumPy's BLAS, its version and the kernel family it runs (threadpoolctl), for the record.

    The SGEMM ceiling is only as good as that kernel: an OpenBLAS pinned to an
    older core type (``OPENBLAS_CORETYPE``) gives a lower ceiling.
    """
    try:
        import threadpoolctl  # type: ignore[import-untyped]

        infos = threadpoolctl.threadpool_info()
    except Exception:  # threadpoolctl missing or unable to inspect the process
        return {}
    np_dir = os.path.dirname(os.path.dirname(np.__file__))
    blas = [i for i in infos if i.get("user_api") == "blas"]
    blas.sort(key=lambda i: not str(i.get("filepath", "")).startswith(np_dir))
    if not blas:
        return {}
    return {k: str(blas[0].get(k)) for k in ("internal_api", "version", "architecture")}


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _check(name: str, out: Any, ref: np.ndarray, dtype: str, row_diff: dict[str, float],
           notes: dict[str, str]) -> bool:
    """Record ``name``'s largest difference from manyheads' output; True when it is small."""
    diff = float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref)))
    row_diff[name] = diff
    if not diff <= CHECK_ATOL[dtype]:  # NaN fails too
        notes[name] = (f"differs from manyheads by {diff:.1e} "
                       f"(more than {CHECK_ATOL[dtype]:.0e}); not timed")
        sys.stderr.write(f"\nwarning: {LABELS[name]} {notes[name]}\n")
        return False
    return True


def _add_peer(name: str, build: Callable[[], _peers.PeerCall], ref: np.ndarray, dtype: str,
              fns: dict[str, Callable[[], Any]], row_diff: dict[str, float],
              notes: dict[str, str], paths: dict[str, str]) -> None:
    """Build one ONNX Runtime / OpenVINO peer, check it, and add it to ``fns`` if it agrees."""
    if dtype != "float32":
        notes[name] = "float32 only here"
        return
    try:
        call = build()
        out = call.result()
    except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
        notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        sys.stderr.write(f"\nwarning: {LABELS[name]} {notes[name]}\n")
        return
    paths[name] = call.path
    if _check(name, out, ref, dtype, row_diff, notes):
        fns[name] = call.run


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    return compare({"f": fn}, rounds=1, per_round=repeats, warmup=warmup)["f"]


def compare(fns: dict[str, Callable[[], Any]], rounds: int = 5, per_round: int = 2,
            warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds.

    Each round runs every function ``per_round`` times back to back (so one
    library's idle thread pool spinning after its calls does not land inside
    another's timings, beyond the first call of a block), and the rounds
    alternate, so a slow spell of a shared machine hits every contender alike.
    The first call of each block is discarded when ``per_round > 1``.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(warmup):
            f()
    for _ in range(rounds):
        for name, f in fns.items():
            block = []
            for _ in range(per_round + (1 if per_round > 1 else 0)):
                t0 = time.perf_counter()
                f()
                block.append(time.perf_counter() - t0)
            times[name] += block[1:] if per_round > 1 else block
    return {k: float(np.median(v)) for k, v in times.items()}


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

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


@dataclass
class KernelRow:
    T: int
    D: int
    dtype: str
    threads: int
    manyheads_ms: float
    torch_ms: float | None = None
    oracle_ms: float | None = None
    flops: float = 0.0
    peers_ms: dict[str, float | None] = field(default_factory=dict)  # ONNX Runtime, OpenVINO
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # each peer vs manyheads
    notes: dict[str, str] = field(default_factory=dict)  # why a peer was not timed
    paths: dict[str, str] = field(default_factory=dict)  # what each peer ran
    extra: dict[str, float] = field(default_factory=dict)


def sgemm_gflops(repeats: int = 15) -> float:
    """The machine's float32 matmul rate (2048 x 2048) through NumPy's BLAS (median)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    t = median_time(lambda: a @ a, repeats)
    return 2 * 2048**3 / t / 1e9


def kernel_case(T: int, D: int, dtype: Any, threads: int, repeats: int, with_torch: bool,
                with_oracle: bool, B: int = 1, H: int = 12,
                peers: Sequence[str] = ()) -> KernelRow:
    """One causal attention shape: manyheads, its peers and (optionally) the oracle.

    ``peers`` names the installed ONNX Runtime / OpenVINO peers to include;
    each is checked against manyheads' output before it is timed.
    """
    rng = np.random.default_rng(T + D)
    q, k, v = (rng.standard_normal((B, H, T, D)).astype(dtype) for _ in range(3))
    row = KernelRow(T=T, D=D, dtype=np.dtype(dtype).name, threads=threads, manyheads_ms=0.0,
                    flops=2.0 * B * H * T * T * D)
    fns: dict[str, Callable[[], Any]] = {
        "manyheads": lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             num_threads=threads)}
    ref = np.asarray(fns["manyheads"](), dtype=np.float64)
    torch = _torch() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch() -> Any:
            with torch.inference_mode():
                return sdpa(tq, tk, tv, is_causal=True)

        if _check("torch", run_torch().numpy(), ref, row.dtype, row.max_abs_diff, row.notes):
            fns["torch"] = run_torch
    for name in peers:
        _add_peer(name, functools.partial(_peers.prefill, name, q, k, v, threads), ref,
                  row.dtype, fns, row.max_abs_diff, row.notes, row.paths)
    del ref
    # the ceiling, measured right before this row; then a pause, because BLAS
    # worker threads keep spinning for a while after a call and would slow
    # whatever runs next
    row.extra["sgemm_gflops"] = sgemm_gflops(10)
    time.sleep(0.5)
    # enough calls for a stable median on a shared machine: about 2 s per contender
    t0 = time.perf_counter()
    fns["manyheads"]()
    est = max(time.perf_counter() - t0, 1e-5)
    calls = int(min(400, max(repeats, 2.0 / est)))
    rounds = max(5, min(10, calls // 3))
    per_round = max(1, calls // rounds)
    res = compare(fns, rounds=rounds, per_round=per_round)
    row.manyheads_ms = 1e3 * res["manyheads"]
    row.torch_ms = 1e3 * res["torch"] if "torch" in res else None
    row.peers_ms = {name: (1e3 * res[name] if name in res else None) for name in peers}
    if with_oracle:
        row.oracle_ms = 1e3 * median_time(
            lambda: oracle.scaled_dot_product_attention(q, k, v, is_causal=True), 3, warmup=1)
    return row


def module_case(threads: int, repeats: int, with_torch: bool, B: int = 8, T: int = 1024,
                d: int = 768, H: int = 12) -> dict[str, float]:
    """Whole-module time at the book's benchmark shape (ms), every variant with one weight set."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, d)).astype(np.float32)
    fused = mh.MultiHeadAttention(d, d, T, 0.0, H, dtype=np.float32, seed=0)
    stacked = fused.to_stacked()
    fns: dict[str, Callable[[], Any]] = {
        "fused": lambda: fused(x, num_threads=threads),
        "stacked": lambda: stacked(x, num_threads=threads),
    }
    torch = _torch() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        F = torch.nn.functional
        tx = torch.from_numpy(x)
        w_qkv = torch.from_numpy(np.ascontiguousarray(fused.W_qkv.T))
        w_out = torch.from_numpy(np.ascontiguousarray(fused.W_out.T))
        b_out = torch.from_numpy(fused.b_out)

        def torch_module() -> Any:
            with torch.inference_mode():
                qkv = F.linear(tx, w_qkv)
                q, k, v = (p.view(B, T, H, d // H).transpose(1, 2) for p in qkv.split(d, dim=-1))
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return F.linear(ctx.transpose(1, 2).reshape(B, T, d), w_out, b_out)

        fns["torch"] = torch_module
    res = {k: 1e3 * v for k, v in compare(fns, rounds=max(3, repeats // 2), per_round=2).items()}
    heads = [(h.W_query, h.W_key, h.W_value) for h in stacked.heads]
    res["oracle"] = 1e3 * median_time(
        lambda: oracle.stacked_multi_head_attention(x, heads, fused.W_out, fused.b_out), 3,
        warmup=1)
    return res


def thread_scaling(T: int, threads: int, repeats: int, D: int = 64, H: int = 12) -> dict[str, float]:
    """manyheads on 1 thread and on ``threads`` threads, same arrays, interleaved (ms)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3))
    res = compare({
        "1": lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=1),
        str(threads): lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              num_threads=threads),
    }, rounds=max(5, repeats), per_round=3)
    return {k: 1e3 * v for k, v in res.items()}


def read_bandwidth_gbs(threads: int) -> dict[str, float]:
    """Memory read rate of NumPy reductions over a 1 GiB float32 array split across threads.

    Both ``sum`` and ``max`` are measured; ``sum`` (pairwise summation) can be
    limited by arithmetic rather than memory, so the faster one is the ceiling.
    """
    import threading

    a = np.ones(2**28, dtype=np.float32)

    def split(fn: Callable[[np.ndarray], Any]) -> Callable[[], None]:
        def run() -> None:
            parts = np.array_split(a, threads)
            ts = [threading.Thread(target=fn, args=(p,)) for p in parts[1:]]
            for t in ts:
                t.start()
            fn(parts[0])
            for t in ts:
                t.join()
        return run

    res = compare({"sum": split(np.sum), "max": split(np.max)}, rounds=3, per_round=2)
    return {k: a.nbytes / v / 1e9 for k, v in res.items()}


def decode_cases(threads: int, repeats: int, with_torch: bool,
                 lengths: tuple[int, ...] = (1024, 4096, 16384),
                 peers: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One new query (q_len=1) against a cache of L keys, B=1, H=12, D=64 (microseconds).

    The ONNX Runtime and OpenVINO peers append the L-th key and value to a cache
    holding the other L-1 (a generation step); manyheads and torch read all L.
    """
    from manyheads import _core

    torch = _torch() if with_torch else None
    rounds, per_round, warmup = max(5, repeats), 20, 1
    calls = warmup + rounds * (per_round + 1)  # how often compare() calls each function
    rows = []
    for L in lengths:
        rng = np.random.default_rng(L)
        q = rng.standard_normal((1, 12, 1, 64)).astype(np.float32)
        k, v = (rng.standard_normal((1, 12, L, 64)).astype(np.float32) for _ in range(2))
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
        fns: dict[str, Callable[[], Any]] = {
            "float32": lambda: mh.scaled_dot_product_attention(q, k, v, num_threads=threads),
            "float16": lambda: _core.attention(q, k16, v16, scale=0.125, num_threads=threads),
        }
        ref = np.asarray(fns["float32"](), dtype=np.float64)
        diffs: dict[str, float] = {}
        notes: dict[str, str] = {}
        paths: dict[str, str] = {}
        if torch is not None:
            torch.set_num_threads(threads)
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

            def run_torch() -> Any:
                with torch.inference_mode():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

            if _check("torch", run_torch().numpy(), ref, "float32", diffs, notes):
                fns["torch"] = run_torch
        for name in peers:
            _add_peer(name, functools.partial(_peers.decode, name, q, k, v, threads, calls),
                      ref, "float32", fns, diffs, notes, paths)
        res = compare(fns, rounds=rounds, per_round=per_round, warmup=warmup)
        row: dict[str, Any] = {"L": L, "bytes_f32": int(k.nbytes + v.nbytes)}
        row.update({f"{name}_us": 1e6 * t for name, t in res.items()})
        row.update(max_abs_diff=diffs, notes=notes, paths=paths)
        rows.append(row)
        del fns  # frees the peers' caches before the next length
    return rows


#: cache formats of the low-precision decode table, in column order
CACHE_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")


def _cache_dtype(fmt: str) -> Any:
    """new_cache()'s dtype argument for format name ``fmt`` (None: ml_dtypes is missing)."""
    if fmt in ("int8", "int4"):
        return fmt
    if fmt == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return ml_dtypes.bfloat16
    return np.dtype(fmt)


def cache_format_cases(threads: int, with_torch: bool, lengths: tuple[int, ...] = (1024, 16384)
                       ) -> list[dict[str, Any]]:
    """One fused layer's decode step (d_in=64, 12 heads of 64) with a cache of L tokens
    in every format, and torch's SDPA over float32 K/V of the same L (µs).

    Each cache is filled once (its L keys and values appended in one step, quantised
    as they are stored); each timed call appends one token and is rolled back with
    ``cache.truncate(L)``.
    """
    H, D, d_in = 12, 64, 64
    rows = []
    for L in lengths:
        layer = mh.MultiHeadAttention(d_in, H * D, L + 1, 0.0, H, seed=1)
        rng = np.random.default_rng(L + 1)
        k, v = (rng.standard_normal((1, H, L, D)).astype(np.float32) for _ in range(2))
        q1 = rng.standard_normal((1, H, 1, D)).astype(np.float32)
        x = rng.standard_normal((1, 1, d_in)).astype(np.float32)
        fns: dict[str, Callable[[], Any]] = {}
        per_token: dict[str, float] = {}
        skipped: list[str] = []
        for fmt in CACHE_FORMATS:
            dt = _cache_dtype(fmt)
            if dt is None:
                skipped.append(fmt)
                continue
            cache = layer.new_cache(1, L + 1, dtype=dt)
            with cache.step(L) as st:  # the L tokens, stored in the cache's format
                st.attend(q1, k, v, scale=0.125, num_threads=threads)
            per_token[fmt] = cache.nbytes / cache.max_len

            def step(cache: Any = cache) -> Any:
                y = layer(x, cache=cache, num_threads=threads)
                cache.truncate(L)
                return y

            fns[fmt] = step
        torch = _torch() if with_torch else None
        if torch is not None:
            torch.set_num_threads(threads)
            tq, tk, tv = (torch.from_numpy(a) for a in (q1, k, v))

            def run_torch() -> Any:
                with torch.inference_mode():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

            fns["torch_sdpa_f32"] = run_torch
        res = compare(fns, rounds=7, per_round=max(2, 40960 // L))
        row: dict[str, Any] = {"L": L, "bytes_per_token": per_token, "skipped": skipped}
        row.update({f"{n}_us": 1e6 * t for n, t in res.items()})
        rows.append(row)
    return rows


def gqa_case(threads: int, L: int = 16384, Hq: int = 32, Hkv: int = 8) -> dict[str, Any]:
    """Decode of Hq query heads on Hkv kv heads (each kv head read once for its group)
    against the same attention with the kv heads repeated to Hq (µs)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, Hq, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, Hkv, L, 64)).astype(np.float32) for _ in range(2))
    kr, vr = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    sdpa = mh.scaled_dot_product_attention
    fns: dict[str, Callable[[], Any]] = {
        "grouped": lambda: sdpa(q, k, v, enable_gqa=True, num_threads=threads),
        "repeated": lambda: sdpa(q, kr, vr, num_threads=threads)}
    diff = float(np.max(np.abs(fns["grouped"]() - fns["repeated"]())))
    res = compare(fns, rounds=7, per_round=max(2, 40960 // L))
    return {"L": L, "heads": Hq, "kv_heads": Hkv, "max_abs_diff": diff,
            **{f"{n}_us": 1e6 * t for n, t in res.items()}}


def half_prefill_case(threads: int, T: int = 2048) -> dict[str, Any]:
    """Causal prefill (B=1, 12 heads of 64) with float32, float16 and bfloat16 inputs (ms)."""
    rng = np.random.default_rng(T)
    q, k, v = (rng.standard_normal((1, 12, T, 64)).astype(np.float32) for _ in range(3))
    sdpa = mh.scaled_dot_product_attention
    fns: dict[str, Callable[[], Any]] = {}
    for fmt in ("float32", "float16", "bfloat16"):
        dt = _cache_dtype(fmt)
        if dt is None:
            continue
        fns[fmt] = functools.partial(sdpa, q.astype(dt), k.astype(dt), v.astype(dt),
                                     is_causal=True, num_threads=threads)
    res = compare(fns, rounds=5, per_round=2)
    return {"T": T, **{f"{n}_ms": 1e3 * t for n, t in res.items()},
            "avx512_bf16": _cpu_flag("avx512_bf16"), "path": mh.kernel_isa()}


def _cpu_flag(flag: str) -> bool | None:
    """Whether /proc/cpuinfo lists ``flag`` (None where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("flags") and flag in line.split() for line in fh)
    except OSError:
        return None


# ----------------------------------------------------------------------------- inference

#: the layer decode step's shape: d_model, heads, tokens held by the KV cache
LAYER_SHAPE = {"d": 768, "heads": 12, "cached": 1024}
#: the GPT-2-small-shaped model and the generation that is timed
GPT2_SHAPE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024, "prompt": 200, "new_tokens": 32}
#: the tiny SDPA call: heads, queries, keys, head size
TINY_SHAPE = {"heads": 12, "queries": 1, "keys": 16, "D": 64}
#: the issue's bars: key -> (text, threshold); ratios above the threshold meet the bar
#: (the OPENBLAS_NUM_THREADS=1 bar is a ceiling: the default run's time over that run's)
BARS: dict[str, tuple[str, float]] = {
    "layer_decode": ("layer decode step ≥ 1.5× torch's layer (process that imported and "
                     "used torch)", 1.5),
    "generation": ("GPT-2 generation ≥ 1.3× Hugging Face's tokens/s, identical tokens", 1.3),
    "module_prefill": ("module prefill B=8 T=1024 d=768 12 heads ≥ 1.2× torch's layer", 1.2),
    "tiny_sdpa": ("SDPA 12 heads × 1 query × 16 keys no slower than torch", 1.0),
    "openblas": ("layer decode step within 1.2× of the same run with OPENBLAS_NUM_THREADS=1",
                 1.2),
}


def _torch_loaded() -> bool:
    """True when this process has imported torch (``sys.modules['torch'] = None`` is not)."""
    return sys.modules.get("torch") is not None


def _adaptive_compare(fns: dict[str, Callable[[], Any]], seconds: float = 1.5,
                      lo: int = 40, hi: int = 2000) -> dict[str, float]:
    """compare() with enough calls for about ``seconds`` per contender (the slowest decides)."""
    est = 1e-6
    for f in fns.values():
        t0 = time.perf_counter()
        f()
        est = max(est, time.perf_counter() - t0)
    calls = int(min(hi, max(lo, seconds / est)))
    rounds = 10
    return compare(fns, rounds=rounds, per_round=max(1, calls // rounds), warmup=2)


def tiny_sdpa_case(threads: int, with_torch: bool) -> dict[str, Any]:
    """One SDPA call of 12 heads x 1 query x 16 keys (D=64): median microseconds per call.

    torch is called as inference code calls it (no autograd context per call:
    the tensors need no gradient), so neither side pays for more than the call.
    """
    s = TINY_SHAPE
    rng = np.random.default_rng(16)
    q = rng.standard_normal((1, s["heads"], s["queries"], s["D"])).astype(np.float32)
    k, v = (rng.standard_normal((1, s["heads"], s["keys"], s["D"])).astype(np.float32)
            for _ in range(2))
    fns: dict[str, Callable[[], Any]] = {
        "manyheads": lambda: mh.scaled_dot_product_attention(q, k, v, num_threads=threads)}
    ref = np.asarray(fns["manyheads"](), dtype=np.float64)
    row: dict[str, Any] = {"max_abs_diff": {}, "notes": {}}
    torch = _torch() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch"] = lambda: sdpa(tq, tk, tv)
        if not _check("torch", fns["torch"]().numpy(), ref, "float32", row["max_abs_diff"],
                      row["notes"]):
            del fns["torch"]
    res = compare(fns, rounds=20, per_round=200, warmup=50)
    row.update({f"{name}_us": 1e6 * t for name, t in res.items()})
    return row


def layer_decode_case(threads: int, with_torch: bool) -> dict[str, Any]:
    """One fused layer's decode step against torch's layer written the same way (µs).

    manyheads: ``MultiHeadAttention(768, 12 heads, qkv_bias=True)`` called on one
    new token with a KV cache holding 1024 tokens, rolled back to 1024 by
    ``cache.truncate`` after each call.  torch: a qkv ``F.linear``, the new key
    and value written into a preallocated buffer of 1024 + 1 positions, SDPA
    over it, an output ``F.linear``; same weights, same thread count, outputs
    compared before timing.
    """
    d, H, L = LAYER_SHAPE["d"], LAYER_SHAPE["heads"], LAYER_SHAPE["cached"]
    D = d // H
    layer = mh.MultiHeadAttention(d, d, L + 1, 0.0, H, qkv_bias=True, seed=0)
    assert layer.b_qkv is not None  # qkv_bias=True
    rng = np.random.default_rng(5)
    prompt = rng.standard_normal((1, L, d)).astype(np.float32)
    x = rng.standard_normal((1, 1, d)).astype(np.float32)
    cache = layer.new_cache(1, L + 1)
    layer(prompt, cache=cache, num_threads=threads)  # the 1024 cached tokens

    def run_manyheads() -> np.ndarray:
        y: np.ndarray = layer(x, cache=cache, num_threads=threads)
        cache.truncate(L)
        return y

    fns: dict[str, Callable[[], Any]] = {"manyheads": run_manyheads}
    ref = np.asarray(run_manyheads(), dtype=np.float64)
    row: dict[str, Any] = {"max_abs_diff": {}, "notes": {}}
    torch = _torch() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        F = torch.nn.functional
        w_qkv = torch.from_numpy(np.ascontiguousarray(layer.W_qkv.T))
        b_qkv = torch.from_numpy(layer.b_qkv.copy())
        w_out = torch.from_numpy(np.ascontiguousarray(layer.W_out.T))
        b_out = torch.from_numpy(layer.b_out.copy())
        keys, values = torch.zeros(1, H, L + 1, D), torch.zeros(1, H, L + 1, D)

        def heads(t: Any, n: int) -> Any:
            return t.view(1, n, H, D).transpose(1, 2)

        with torch.inference_mode():  # torch's own prefill fills its buffer
            _, pk, pv = F.linear(torch.from_numpy(prompt), w_qkv, b_qkv).split(d, dim=-1)
            keys[:, :, :L], values[:, :, :L] = heads(pk, L), heads(pv, L)
        tx = torch.from_numpy(x)

        def run_torch() -> Any:
            with torch.inference_mode():
                q, k, v = F.linear(tx, w_qkv, b_qkv).split(d, dim=-1)
                keys[:, :, L:] = heads(k, 1)
                values[:, :, L:] = heads(v, 1)
                ctx = F.scaled_dot_product_attention(heads(q, 1), keys, values)
                return F.linear(ctx.transpose(1, 2).reshape(1, 1, d), w_out, b_out)

        if _check("torch", run_torch().numpy(), ref, "float32", row["max_abs_diff"],
                  row["notes"]):
            fns["torch"] = run_torch
    res = _adaptive_compare(fns)
    row.update({f"{name}_us": 1e6 * t for name, t in res.items()})
    row["torch_in_process"] = _torch_loaded()
    return row


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def gpt2_checkpoint(folder: str) -> Any:
    """A seeded random GPT-2-small-shaped Hugging Face model, saved to ``folder`` (safetensors).

    Returns the model (eval mode).  Needs torch and transformers.
    """
    import torch

    transformers = _transformers()
    s = GPT2_SHAPE
    cfg = transformers.GPT2Config(n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"],
                                  vocab_size=s["vocab_size"], n_positions=s["n_positions"])
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    logging = transformers.utils.logging
    bar_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # no "Writing model shards" bar inside the bench's own
    try:
        model.save_pretrained(folder)
    finally:
        if bar_on:
            logging.enable_progress_bar()
    return model


def gpt2_runner(folder: str) -> tuple[Callable[[list[int], int], list[int]], str]:
    """manyheads' GPT-2 for a checkpoint folder: (generate(prompt, n) -> tokens, how it loaded).

    ``manyheads.models.from_pretrained``; torch is not imported.
    """
    from manyheads import models

    model = models.from_pretrained(folder)

    def generate(prompt: list[int], n: int) -> list[int]:
        return [int(t) for t in np.asarray(model.generate(np.array([prompt]), n))[0]]

    return generate, "manyheads.models.from_pretrained"


def gpt2_prompt() -> list[int]:
    """The seeded 200-token prompt."""
    rng = np.random.default_rng(200)
    return [int(t) for t in rng.integers(0, GPT2_SHAPE["vocab_size"], GPT2_SHAPE["prompt"])]


def generation_case(folder: str, threads: int, rounds: int, hf_model: Any = None
                    ) -> dict[str, Any]:
    """Greedy generation of 32 tokens after a 200-token prompt: whole-call seconds (medians).

    manyheads' runner always; Hugging Face ``generate(do_sample=False)`` on torch
    when ``hf_model`` is given, interleaved with it.  Tokens from both are kept.
    """
    n = GPT2_SHAPE["new_tokens"]
    prompt = gpt2_prompt()
    generate, loader = gpt2_runner(folder)
    out: dict[str, Any] = {"loader": loader, "rounds": rounds,
                           "torch_in_process": _torch_loaded()}
    tokens: dict[str, list[int]] = {}

    def run_manyheads() -> None:
        tokens["manyheads"] = generate(prompt, n)

    fns: dict[str, Callable[[], Any]] = {"manyheads": run_manyheads}
    if hf_model is not None:
        import torch

        transformers = _transformers()
        torch.set_num_threads(threads)
        ids = torch.tensor([prompt])
        # eos_token_id=None: always n tokens, as manyheads' runner makes them
        gen_cfg = transformers.GenerationConfig(max_new_tokens=n, do_sample=False,
                                                eos_token_id=None, pad_token_id=0)

        def run_hf() -> None:
            with torch.inference_mode():
                res = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        generation_config=gen_cfg)
            tokens["hf"] = [int(t) for t in res[0, len(prompt):]]

        fns["hf"] = run_hf
    chosen = mh._config._state["num_threads"]
    mh.set_num_threads(threads)  # the runner's calls use the default thread count
    try:
        res = compare(fns, rounds=rounds, per_round=1, warmup=1)
    finally:
        mh.set_num_threads(chosen)
    for name, t in res.items():
        out[f"{name}_s"] = t
        out[f"{name}_tokens_per_s"] = n / t
    out["tokens"] = tokens
    if "hf" in tokens:
        out["identical"] = tokens["hf"] == tokens["manyheads"]
    return out


_CHILD_SCRIPT = r"""
import json, sys
mode, folder, threads, rounds, path = sys.argv[1:6]
if mode == "no-torch":
    sys.modules["torch"] = None  # any import of torch now fails: this process never has it
from manyheads import _bench
res = _bench.child_run(mode, folder or None, int(threads), int(rounds))
with open(path, "w") as fh:
    json.dump(res, fh)
"""

#: the subprocesses of the inference section: mode -> extra environment
CHILD_MODES: dict[str, dict[str, str]] = {"no-torch": {},
                                          "openblas1": {"OPENBLAS_NUM_THREADS": "1"}}


def child_run(mode: str, folder: str | None, threads: int, rounds: int) -> dict[str, Any]:
    """What one subprocess of the inference section measures (see ``CHILD_MODES``).

    ``no-torch``: manyheads' layer decode step and (with a checkpoint folder)
    its generation, in a process where torch cannot be imported.
    ``openblas1``: the layer decode step exactly as the main run measures it
    (torch too, when installed), under ``OPENBLAS_NUM_THREADS=1``.
    """
    with_torch = mode != "no-torch" and _torch() is not None
    out: dict[str, Any] = {"mode": mode, "env": {k: os.environ.get(k)
                                                 for k in CHILD_MODES.get(mode, {})},
                           "layer": layer_decode_case(threads, with_torch)}
    if mode == "no-torch" and folder:
        out["generation"] = generation_case(folder, threads, rounds)
    out["torch_in_process"] = _torch_loaded()
    out["config"] = mh._config.config()
    return out


def run_child(mode: str, folder: str | None, threads: int, rounds: int,
              timeout: float = 1800) -> dict[str, Any]:
    """Run ``child_run`` in a fresh interpreter; its results, or {"error": ...}."""
    env = dict(os.environ, **CHILD_MODES[mode])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        try:
            res = subprocess.run([sys.executable, "-c", _CHILD_SCRIPT, mode, folder or "",
                                  str(threads), str(rounds), path],
                                 capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": f"timed out after {timeout:.0f} s"}
        if res.returncode != 0 or not os.path.exists(path):
            lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
            return {"mode": mode, "error": (lines[-1] if lines else
                                            f"exit code {res.returncode}")[:300]}
        with open(path) as fh:
            out: dict[str, Any] = json.load(fh)
    return out


def inference_section(threads: int, with_torch: bool, quick: bool = False,
                      step: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """The inference benchmarks: tiny SDPA, layer decode step, GPT-2 generation, processes.

    The layer decode step and manyheads' generation also run in a subprocess
    that never imports torch; the layer decode step once more in a subprocess
    with ``OPENBLAS_NUM_THREADS=1``, between two measurements of it here (this
    process's figure is their mean).  This process sets no environment variable.
    """
    rounds = 3 if quick else 5
    res: dict[str, Any] = {"threads": threads, "layer_shape": dict(LAYER_SHAPE),
                           "gpt2_shape": dict(GPT2_SHAPE), "tiny_shape": dict(TINY_SHAPE),
                           "generation_rounds": rounds,
                           "load_average": {"start": _load_average()}}
    res["tiny_sdpa"] = tiny_sdpa_case(threads, with_torch)
    step("SDPA 12 heads x 1 query x 16 keys")
    # this process's layer step is measured before and after the OPENBLAS_NUM_THREADS=1
    # subprocess, so a change in the machine's load between them shows and averages out
    first = layer_decode_case(threads, with_torch)
    ob1 = run_child("openblas1", None, threads, rounds)
    second = layer_decode_case(threads, with_torch)
    res["layer_decode"] = {"main": _merge_blocks([first, second]),
                           "openblas1": ob1.get("layer")}
    res["children"] = {"openblas1": {k: ob1.get(k) for k in ("error", "torch_in_process",
                                                              "env")}}
    step("layer decode step, cache 1024; again under OPENBLAS_NUM_THREADS=1")
    transformers = _transformers() if with_torch else None
    with tempfile.TemporaryDirectory() as folder:
        gen: dict[str, Any] = {}
        if transformers is None:
            gen["note"] = ("torch and transformers are needed to make the model and run "
                           "Hugging Face's generate; not measured")
            step("GPT-2 generation (skipped)")
        else:
            hf_model = gpt2_checkpoint(folder)
            gen["main"] = generation_case(folder, threads, rounds, hf_model)
            gen["transformers"] = str(transformers.__version__)
            del hf_model
            step("GPT-2 generation, 200 + 32 tokens")
        child = run_child("no-torch", folder if "main" in gen else None, threads, rounds)
        step("subprocess without torch")
    res["layer_decode"]["no_torch"] = child.get("layer")
    gen["no_torch"] = child.get("generation")
    res["generation"] = gen
    res["children"]["no-torch"] = {k: child.get(k) for k in ("error", "torch_in_process")}
    res["load_average"]["end"] = _load_average()
    return res


def _merge_blocks(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from blocks measured apart: each time the mean of the blocks' medians."""
    out: dict[str, Any] = {"max_abs_diff": {}, "notes": {}, "blocks": []}
    for b in blocks:
        out["blocks"].append({k: v for k, v in b.items() if k.endswith("_us")})
        for n, d in b.get("max_abs_diff", {}).items():
            out["max_abs_diff"][n] = max(d, out["max_abs_diff"].get(n, 0.0))
        out["notes"].update(b.get("notes", {}))
        out["torch_in_process"] = b.get("torch_in_process")
    for key in out["blocks"][0]:
        vals = [b[key] for b in out["blocks"] if key in b]
        if len(vals) == len(blocks):
            out[key] = float(np.mean(vals))
    return out


def bars(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the issue's bars with its measured ratio and whether it is met (None: not measured).

    Ratios: torch's (or Hugging Face's) time over manyheads' for the speed bars;
    the main run's layer time over the ``OPENBLAS_NUM_THREADS=1`` run's for the
    last, which must stay at or below 1.2.
    """
    out: list[dict[str, Any]] = []
    inf = r.get("inference") or {}
    layer = inf.get("layer_decode") or {}
    main = layer.get("main") or {}
    ratio: float | None = None
    if main.get("torch_us") and main.get("torch_in_process"):
        ratio = main["torch_us"] / main["manyheads_us"]
    out.append({"key": "layer_decode", "ratio": ratio})
    gen = (inf.get("generation") or {}).get("main") or {}
    ratio, identical = None, gen.get("identical")
    if gen.get("hf_s"):
        ratio = gen["hf_s"] / gen["manyheads_s"]
    out.append({"key": "generation", "ratio": ratio, "identical": identical})
    mod = r.get("module") or {}
    out.append({"key": "module_prefill",
                "ratio": mod["torch"] / mod["fused"] if "torch" in mod and "fused" in mod
                else None})
    tiny = inf.get("tiny_sdpa") or {}
    out.append({"key": "tiny_sdpa", "ratio": tiny["torch_us"] / tiny["manyheads_us"]
                if "torch_us" in tiny else None})
    ob1 = layer.get("openblas1") or {}
    out.append({"key": "openblas", "ratio": main["manyheads_us"] / ob1["manyheads_us"]
                if main and ob1 else None})
    for b in out:
        text, limit = BARS[b["key"]]
        b["bar"], b["threshold"] = text, limit
        if b["ratio"] is None:
            b["met"] = None
        elif b["key"] == "openblas":
            b["met"] = b["ratio"] <= limit
        else:
            b["met"] = b["ratio"] >= limit and b.get("identical", True) is not False
    return out


_PEAK_SCRIPT = r"""
import resource, sys, numpy as np, manyheads as mh
T, D, H = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3))
out = np.empty_like(q); out[...] = 0   # touch the output's pages before the baseline
del out
mh.scaled_dot_product_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], is_causal=True)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024)
"""


def peak_extra_memory_mib(T: int, D: int = 64, H: int = 12) -> float | None:
    """Peak RSS growth of one call beyond its inputs and output, in MiB (Linux only).

    The subprocess allocates the inputs and touches (then frees) an
    output-sized buffer first, so the baseline already covers the output.
    """
    if not sys.platform.startswith("linux"):
        return None
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(T), str(D), str(H)],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return None
    return int(res.stdout.strip().splitlines()[-1]) / 2**20


#: the parts of the benchmark, in run order; ``--section`` picks some
SECTIONS = ("attention", "module", "inference")


def parse_sections(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Sections to run from "all", a comma-separated string or a list (ValueError if unknown).

    ``inference`` brings ``module`` along: one of its bars is the module's prefill.
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


def run(quick: bool = False, out_dir: str | None = None, repeats: int = 7,
        progress: bool = True, peers: Sequence[str] | None = None,
        sections: str | Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison; return (and optionally write) the results.

    ``peers`` names the peers to include (default: every one in ``PEER_NAMES``);
    those that are not installed are left out and recorded as None.
    ``sections`` picks parts of the run (default: all of ``SECTIONS``).
    """
    names = list(PEER_NAMES if peers is None else peers)
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(PEER_NAMES)}")
    parts = parse_sections(sections)
    versions = peer_versions(names)
    others = [n for n in _peers.PEERS if versions.get(n)]
    torch = _torch() if versions.get("torch") else None
    threads = mh.get_num_threads()
    Ts = [128, 512, 1024, 2048] if quick else [128, 512, 1024, 2048, 4096]
    side = [] if quick else [(2048, 32, np.float32), (2048, 128, np.float32),
                             (1024, 64, np.float64), (2048, 64, np.float64)]
    n_steps = 0
    if "attention" in parts:
        n_steps += 1 + len(Ts) + len(side) + (0 if quick else 2) + 3
    n_steps += ("module" in parts) + 4 * ("inference" in parts)
    bar = Progress(n_steps, progress)
    results: dict[str, Any] = {
        "config": mh._config.config(),
        "torch": None if torch is None else torch.__version__,
        "peers": versions,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "sections": list(parts),
        "load_average": {"start": _load_average()},
    }
    results["numpy_blas"] = numpy_blas()
    if "attention" in parts:
        results["sgemm_gflops"] = sgemm_gflops()
        time.sleep(0.5)
        bar.step("SGEMM 2048x2048")
        rows = []
        for T in Ts:
            rows.append(kernel_case(T, 64, np.float32, threads, repeats, torch is not None,
                                    with_oracle=T <= 2048, peers=others))
            bar.step(f"causal SDPA T={T} D=64 float32")
        for T, D, dt in side:
            rows.append(kernel_case(T, D, dt, threads, repeats, torch is not None,
                                    with_oracle=False, peers=others))
            bar.step(f"causal SDPA T={T} D={D} {np.dtype(dt).name}")
        results["kernel"] = [asdict(r) for r in rows]
        if not quick:
            results["thread_scaling_T2048"] = thread_scaling(2048, threads, repeats)
            bar.step("1 thread against all, T=2048")
            results["peak_extra_mib_T16384"] = peak_extra_memory_mib(16384)
            bar.step("peak memory, T=16384")
    if "module" in parts:
        results["module"] = module_case(threads, max(5, repeats // 2 + 1), torch is not None)
        bar.step("module B=8 T=1024 d=768 H=12")
    if "attention" in parts:
        results["bandwidth_gbs"] = read_bandwidth_gbs(threads)
        bar.step("memory read rate, 1 GiB")
        results["decode"] = decode_cases(threads, repeats, torch is not None,
                                         (1024, 4096) if quick else (1024, 4096, 16384),
                                         peers=others)
        bar.step("decode q_len=1")
        results["cache_formats"] = cache_format_cases(threads, torch is not None,
                                                      (1024,) if quick else (1024, 16384))
        results["gqa"] = gqa_case(threads, 4096 if quick else 16384)
        results["half_prefill"] = half_prefill_case(threads, 512 if quick else 2048)
        bar.step("cache formats, GQA, half-precision prefill")
    if "inference" in parts:
        results["inference"] = inference_section(threads, torch is not None, quick, bar.step)
        results["bars"] = bars(results)
    results["load_average"]["end"] = _load_average()
    text = format_markdown(results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump(results, fh, indent=2, default=str)
        with open(os.path.join(out_dir, "results.md"), "w") as fh:
            fh.write(text)
        if "kernel" in results:
            png = plot_results(results, os.path.join(out_dir, "attention_time.png"))
            results["plot"] = png
    results["markdown"] = text
    return results


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _ratio(other: float | None, mine: float) -> str:
    return "—" if other is None else f"{other / mine:.2f}×"


def _timed_peers(r: dict[str, Any]) -> list[str]:
    """The ONNX Runtime / OpenVINO peers this run included (installed and selected)."""
    return [n for n in _peers.PEERS if (r.get("peers") or {}).get(n)]


def _notes_and_checks(rows: list[dict[str, Any]], names: list[str]) -> list[str]:
    """Lines under a table: each peer's largest difference from manyheads, and skips."""
    lines = []
    worst = {}
    for n in names:
        diffs = [row["max_abs_diff"][n] for row in rows if n in row.get("max_abs_diff", {})]
        if diffs:
            worst[n] = max(diffs)
    if worst:
        lines.append("Checked before timing, largest |peer − manyheads| over these rows: "
                     + ", ".join(f"{LABELS[n]} {d:.1e}" for n, d in worst.items()) + ".")
    seen: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        where = f"T={row['T']} D={row['D']} {row['dtype']}" if "T" in row else f"L={row['L']}"
        for n, note in row.get("notes", {}).items():
            if n in names:
                seen.setdefault((n, note), []).append(where)
    for (n, note), places in seen.items():
        lines.append(f"Not timed: {LABELS[n]} at {', '.join(places)}: {note}.")
    return lines


def _blas_text(r: dict[str, Any]) -> str:
    b = r.get("numpy_blas") or {}
    if not b:
        return ""
    return f", {b['internal_api']} {b['version']}, {b['architecture']} kernels"


def _load_line(r: dict[str, Any]) -> list[str]:
    """How busy the machine was: other processes on the cores slow every contender."""
    load = r.get("load_average") or {}
    if load.get("start") is None or load.get("end") is None:
        return []
    return [f"1-minute load average {load['start']:.2f} at the start, {load['end']:.2f} at the "
            f"end, on {r.get('cpu_count') or '?'} logical CPUs (this run's own work included)."]


def format_markdown(r: dict[str, Any]) -> str:
    """The report: a header (versions, kernel path, threads, load), then each section run."""
    cfg = r["config"]
    versions = r.get("peers") or {"torch": r["torch"]}
    installed = ", ".join(f"{n} {v}" for n, v in versions.items() if v)
    absent = [n for n, v in versions.items() if not v]
    head = (f"manyheads {cfg['version']}, kernel path {cfg['kernel_isa']}, {r['threads']} "
            f"threads; peers on the same thread count: {installed or 'none'}"
            + (f" ({', '.join(absent)} not installed)" if absent else "") + ".")
    if "sgemm_gflops" in r:
        head += (f" SGEMM (NumPy float32 2048²{_blas_text(r)}) {r['sgemm_gflops']:.0f} GFLOP/s "
                 "at the start (each row's % uses the SGEMM rate measured just before that row).")
    lines = [head, *_load_line(r)]
    if "kernel" in r:
        lines += _attention_lines(r)
    if "module" in r:
        lines += _module_lines(r)
    if "decode" in r:
        lines += _decode_lines(r)
    if "cache_formats" in r:
        lines += _low_precision_lines(r)
    if "inference" in r:
        lines += _inference_lines(r)
    return "\n".join(lines) + "\n"


def _attention_lines(r: dict[str, Any]) -> list[str]:
    sg = r["sgemm_gflops"]
    peers = _timed_peers(r)
    lines = [
        "Causal attention (prefill), B=1, H=12; medians; X / mh = X's time ÷ manyheads' time "
        "(above 1: manyheads is faster); useful work counted as 2·B·H·T²·D flops.",
        "",
        "| T | D | dtype | manyheads ms | torch SDPA ms | torch / mh | "
        + "".join(f"{LABELS[n]} ms | {SHORT[n]} / mh | " for n in peers)
        + "oracle ms | oracle / mh | % of SGEMM rate |",
        "|---:|---:|:---|---:|---:|---:|" + "---:|---:|" * len(peers) + "---:|---:|---:|",
    ]
    for row in r["kernel"]:
        ms = row["manyheads_ms"]
        pct = row["flops"] / (ms * 1e-3) / 1e9 / row["extra"].get("sgemm_gflops", sg) * 100
        cells = [str(row["T"]), str(row["D"]), row["dtype"], f"{ms:.2f}",
                 _fmt(row["torch_ms"]), _ratio(row["torch_ms"], ms)]
        for n in peers:
            other = row.get("peers_ms", {}).get(n)
            cells += [_fmt(other), _ratio(other, ms)]
        cells += [_fmt(row["oracle_ms"], ".1f"), _ratio(row["oracle_ms"], ms), f"{pct:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    checks = _notes_and_checks(r["kernel"], ["torch", *peers])
    if checks:
        lines += [""] + checks
    if "thread_scaling_T2048" in r:
        ts = r["thread_scaling_T2048"]
        one, many = ts["1"], ts[str(r["threads"])]
        lines += ["", f"Threads: T=2048 D=64 takes {one:.2f} ms on 1 thread, {many:.2f} ms on "
                  f"{r['threads']}: {one / many:.2f}× faster."]
    if r.get("peak_extra_mib_T16384") is not None:
        lines.append(f"Memory: at T=16384 one call's peak RSS beyond inputs and output is "
                     f"{r['peak_extra_mib_T16384']:.1f} MiB.")
    return lines


def _module_lines(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    m = r["module"]
    lines += [
        "",
        "Module at the book's shape (B=8, T=1024, d=768, 12 heads, float32, projections included):",
        "",
        "| implementation | ms | relative to fused |",
        "|:---|---:|---:|",
    ]
    for name in ("fused", "stacked", "torch", "oracle"):
        if name in m:
            label = {"fused": "manyheads fused MultiHeadAttention",
                     "stacked": "manyheads StackedMultiHeadAttention",
                     "torch": "PyTorch: same projections + SDPA",
                     "oracle": "NumPy oracle (stacked heads)"}[name]
            lines.append(f"| {label} | {m[name]:.1f} | {m[name] / m['fused']:.2f}× |")
    return lines


def _decode_lines(r: dict[str, Any]) -> list[str]:
    peers = _timed_peers(r)
    lines: list[str] = []
    bw = max(r["bandwidth_gbs"].values())
    lines += [
        "",
        "Decode: one new query against a KV cache of L keys (q_len=1, B=1, H=12, D=64), µs; "
        f"memory read rate {bw:.1f} GB/s (NumPy, 1 GiB, {r['threads']} threads: "
        f"max {r['bandwidth_gbs']['max']:.1f}, sum {r['bandwidth_gbs']['sum']:.1f}):",
        "",
        "| L | manyheads float32 | manyheads float16 cache | torch SDPA | torch / mh | "
        + "".join(f"{LABELS[n]} | {SHORT[n]} / mh | " for n in peers)
        + "float16 vs float32 | float32 cache read rate |",
        "|---:|---:|---:|---:|---:|" + "---:|---:|" * len(peers) + "---:|---:|",
    ]
    for d in r["decode"]:
        t32, t16, tt = d["float32_us"], d["float16_us"], d.get("torch_us")
        rate = d["bytes_f32"] / (t32 * 1e-6) / 1e9
        cells = [str(d["L"]), f"{t32:.0f}", f"{t16:.0f}", _fmt(tt, ".0f"), _ratio(tt, t32)]
        for n in peers:
            other = d.get(f"{n}_us")
            cells += [_fmt(other, ".0f"), _ratio(other, t32)]
        cells += [f"{t32 / t16:.2f}×", f"{rate:.1f} GB/s ({rate / bw * 100:.0f}%)"]
        lines.append("| " + " | ".join(cells) + " |")
    checks = _notes_and_checks(r["decode"], ["torch", *peers])
    if checks:
        lines += [""] + checks
    return lines


def _low_precision_lines(r: dict[str, Any]) -> list[str]:
    bw = max(r["bandwidth_gbs"].values())
    rows = r["cache_formats"]
    fmts = [f for f in CACHE_FORMATS if f"{f}_us" in rows[0]]
    lines = [
        "",
        "Decode through a KV cache in each format: one fused layer (d_in=64, 12 heads of 64) "
        "and one new token against L cached tokens, µs per step (projections included); "
        "bytes per token are the cache's own (keys, values and scales); the read rate is "
        "the cache's bytes over the step's time, against the memory read rate above. "
        "torch SDPA reads float32 K/V of the same L (attention only).",
        "",
        "| L | cache | bytes/token | × float32 bytes | µs | float16 / this | "
        "torch SDPA f32 / this | read rate |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        bpt, tt = row["bytes_per_token"], row.get("torch_sdpa_f32_us")
        for f in fmts:
            t = row[f"{f}_us"]
            rate = bpt[f] * row["L"] / (t * 1e-6) / 1e9
            lines.append("| " + " | ".join([
                str(row["L"]), f, f"{bpt[f]:.0f}", f"{bpt[f] / bpt['float32']:.3f}",
                f"{t:.0f}", _ratio(row.get("float16_us"), t), _ratio(tt, t),
                f"{rate:.1f} GB/s ({rate / bw * 100:.0f}%)"]) + " |")
    if rows[0]["skipped"]:
        lines += ["", f"Not run: {', '.join(rows[0]['skipped'])} (ml_dtypes is not installed)."]
    g = r["gqa"]
    lines += ["", f"Grouped-query decode, {g['heads']} query heads on {g['kv_heads']} kv heads, "
              f"L={g['L']}, float32: {g['grouped_us']:.0f} µs; the same with the kv heads "
              f"repeated to {g['heads']} (4× the bytes): {g['repeated_us']:.0f} µs; "
              f"{g['repeated_us'] / g['grouped_us']:.2f}× (largest difference "
              f"{g['max_abs_diff']:.1e})."]
    h = r["half_prefill"]
    halves = [f for f in ("float16", "bfloat16") if f"{f}_ms" in h]
    lines += ["", f"Half-precision prefill (causal, T={h['T']}, 12 heads of 64): float32 "
              f"{h['float32_ms']:.2f} ms; " + "; ".join(
                  f"{f} {h[f + '_ms']:.2f} ms ({h['float32_ms'] / h[f + '_ms']:.2f}× float32)"
                  for f in halves) + " (" + _half_prefill_how(h) + ")."]
    return lines


def _half_prefill_how(h: dict[str, Any]) -> str:
    """How the half-precision prefill row was computed, for its line."""
    if h.get("path") == "avx512bf16":
        return ("float16 widened to float32 as it loads; bfloat16 multiplied in pairs by "
                "AVX512-BF16's vdpbf16ps, the avx512bf16 path")
    return "widened to float32 as they load; " + {
        True: f"this CPU has AVX512-BF16, but the {h.get('path')} path ran",
        False: "this CPU has no AVX512-BF16", None: "AVX512-BF16 unknown"}[h.get("avx512_bf16")]


#: the rows of the inference tables: (key in the results, label)
PROCESS_ROWS = (("main", "this process"),
                ("openblas1", "subprocess, OPENBLAS_NUM_THREADS=1"),
                ("no_torch", "subprocess, torch never imported"))


def _process_label(key: str, row: dict[str, Any]) -> str:
    label = dict(PROCESS_ROWS)[key]
    if key != "no_torch":
        label += " (torch imported and used)" if row.get("torch_in_process") else " (no torch)"
    return label


def _inference_lines(r: dict[str, Any]) -> list[str]:
    inf = r["inference"]
    errors = {m: c["error"] for m, c in (inf.get("children") or {}).items()
              if c and c.get("error")}
    load = inf.get("load_average") or {}
    when = ""
    if load.get("start") is not None and load.get("end") is not None:
        when = (f" 1-minute load average {load['start']:.2f} when this section started, "
                f"{load['end']:.2f} when it ended.")
    lines = [
        "",
        f"Inference, float32, {inf['threads']} threads on every side, medians.{when} The "
        "subprocesses are fresh interpreters started by the bench: one with "
        "`sys.modules[\"torch\"] = None` set before manyheads is imported, so torch cannot "
        "load; one with OPENBLAS_NUM_THREADS=1 that measures what this process measures. "
        "The last column compares manyheads' time in this process with its time in that row's "
        "(above 1: slower here).",
    ]
    layer = inf.get("layer_decode") or {}
    main = layer.get("main") or {}
    s = inf["layer_shape"]
    lines += [
        "",
        f"Layer decode step: one fused layer (d={s['d']}, {s['heads']} heads, qkv bias), one new "
        f"token against a KV cache of {s['cached']} tokens (rolled back with "
        f"`cache.truncate({s['cached']})` after each call), µs per call. torch's layer: a qkv "
        f"`F.linear`, the new key and value written into a preallocated buffer of "
        f"{s['cached']} + 1 positions, SDPA over it, an output `F.linear`; same weights.",
        "",
        "| process | manyheads µs | torch layer µs | torch / mh | mh here ÷ mh there |",
        "|:---|---:|---:|---:|---:|",
    ]
    for key, _ in PROCESS_ROWS:
        row = layer.get(key)
        if not row:
            continue
        t, tt = row["manyheads_us"], row.get("torch_us")
        lines.append(f"| {_process_label(key, row)} | {t:.0f} | {_fmt(tt, '.0f')} | "
                     f"{_ratio(tt, t)} | {_ratio(main.get('manyheads_us'), t)} |")
    lines.append("")
    blocks = main.get("blocks") or []
    if len(blocks) == 2 and "manyheads_us" in blocks[0]:
        text = ", ".join(f"{b['manyheads_us']:.0f}" + (f" (torch {b['torch_us']:.0f})"
                                                         if "torch_us" in b else "")
                         for b in blocks)
        lines.append(f"This process's row is the mean of two measurements, before and after "
                     f"the OPENBLAS_NUM_THREADS=1 subprocess: manyheads {text} µs.")
    diffs = [row["max_abs_diff"]["torch"] for row in layer.values()
             if row and "torch" in row.get("max_abs_diff", {})]
    if diffs:
        lines.append(f"Checked before timing: largest |torch − manyheads| {max(diffs):.1e}.")
    for key, row in layer.items():
        for n, note in (row or {}).get("notes", {}).items():
            lines.append(f"Not timed: {n} in {dict(PROCESS_ROWS)[key]}: {note}.")
    gen = inf.get("generation") or {}
    g = inf["gpt2_shape"]
    lines += [
        "",
        f"GPT-2-small-shaped generation: {g['n_layer']} layers, d={g['n_embd']}, {g['n_head']} "
        f"heads, vocab {g['vocab_size']}, n_positions {g['n_positions']}, random weights (a "
        f"seeded `transformers.GPT2Config` model saved as safetensors); a {g['prompt']}-token "
        f"prompt, then {g['new_tokens']} greedy tokens; tokens/s = {g['new_tokens']} ÷ the "
        f"whole generate call, median of {inf.get('generation_rounds', '?')} calls after a "
        "warm-up."
        + (f" manyheads: `{gen['main']['loader']}`; Hugging Face: transformers "
           f"{gen.get('transformers')} `generate(do_sample=False)` on torch."
           if gen.get("main") else ""),
    ]
    if gen.get("note"):
        lines += ["", f"Not measured: {gen['note']}."]
    else:
        gmain = gen.get("main") or {}
        lines += [
            "",
            "| process | manyheads tokens/s | Hugging Face tokens/s | mh / HF | "
            "mh here ÷ mh there | tokens |",
            "|:---|---:|---:|---:|---:|:---|",
        ]
        for key, _ in PROCESS_ROWS:
            row = gen.get(key)
            if not row:
                continue
            tps, hf = row["manyheads_tokens_per_s"], row.get("hf_tokens_per_s")
            toks = row.get("tokens") or {}
            if "hf" in toks:
                same = "identical to HF's" if row.get("identical") else "DIFFER from HF's"
            elif toks.get("manyheads") and (gmain.get("tokens") or {}).get("manyheads"):
                same = ("identical to this process's"
                        if toks["manyheads"] == gmain["tokens"]["manyheads"]
                        else "DIFFER from this process's")
            else:
                same = "—"
            lines.append(f"| {_process_label(key, row)} | {tps:.1f} | {_fmt(hf, '.1f')} | "
                         f"{_fmt(hf and tps / hf)}{'×' if hf else ''} | "
                         f"{_ratio(gmain.get('manyheads_s'), row['manyheads_s'])} | {same} |")
    tiny = inf.get("tiny_sdpa") or {}
    t = inf["tiny_shape"]
    if tiny:
        tt = tiny.get("torch_us")
        lines += ["", f"One tiny SDPA call ({t['heads']} heads × {t['queries']} query × "
                  f"{t['keys']} keys, D={t['D']}, float32, called as inference code calls "
                  f"it): manyheads {tiny['manyheads_us']:.1f} µs"
                  + (f", torch {tt:.1f} µs: torch / mh {tt / tiny['manyheads_us']:.2f}×."
                     if tt else ".")]
    for mode, err in errors.items():
        lines.append(f"The {mode} subprocess failed: {err}")
    if r.get("bars"):
        lines += ["", "The bars (issue 10, item 6):", "", "| bar | measured | |",
                  "|:---|---:|:---|"]
        for b in r["bars"]:
            met = {True: "met", False: "**not met**", None: "not measured"}[b["met"]]
            extra = ""
            if b["key"] == "generation" and b.get("identical") is not None:
                extra = ", tokens identical" if b["identical"] else ", tokens DIFFER"
            lines.append(f"| {b['bar']} | {_fmt(b['ratio'])}{'×' if b['ratio'] else ''}"
                         f"{extra} | {met} |")
    return lines


def plot_results(r: dict[str, Any], path: str) -> str | None:
    """Time against T per implementation (log-log), D=64 float32; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [x for x in r["kernel"] if x["D"] == 64 and x["dtype"] == "float32"]
    Ts = [x["T"] for x in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ax.plot(Ts, [x["manyheads_ms"] for x in rows], "o-", label="manyheads")
    if all(x["torch_ms"] is not None for x in rows):
        ax.plot(Ts, [x["torch_ms"] for x in rows], "s-", label="PyTorch SDPA (CPU)")
    for name, marker in zip(_timed_peers(r), "Dv"):
        prow = [x for x in rows if x.get("peers_ms", {}).get(name) is not None]
        if prow:
            ax.plot([x["T"] for x in prow], [x["peers_ms"][name] for x in prow], marker + "-",
                    label=LABELS[name])
    orows = [x for x in rows if x["oracle_ms"] is not None]
    if orows:
        ax.plot([x["T"] for x in orows], [x["oracle_ms"] for x in orows], "^-",
                label="NumPy oracle")
    sg = r["sgemm_gflops"]
    ax.plot(Ts, [x["flops"] / (sg * 1e9) * 1e3 for x in rows], "k--", lw=1,
            label="at the SGEMM rate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time per call (ms, median)")
    ax.set_title(f"Causal attention, B=1, H=12, D=64, float32, {r['threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
