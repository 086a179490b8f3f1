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
"""
from __future__ import annotations

import functools
import json
import os
import resource
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


def run(quick: bool = False, out_dir: str | None = None, repeats: int = 7,
        progress: bool = True, peers: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the whole comparison; return (and optionally write) the results.

    ``peers`` names the peers to include (default: every one in ``PEER_NAMES``);
    those that are not installed are left out and recorded as None.
    """
    names = list(PEER_NAMES if peers is None else peers)
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(PEER_NAMES)}")
    versions = peer_versions(names)
    others = [n for n in _peers.PEERS if versions.get(n)]
    torch = _torch() if versions.get("torch") else None
    threads = mh.get_num_threads()
    Ts = [128, 512, 1024, 2048] if quick else [128, 512, 1024, 2048, 4096]
    side = [] if quick else [(2048, 32, np.float32), (2048, 128, np.float32),
                             (1024, 64, np.float64), (2048, 64, np.float64)]
    n_steps = 1 + len(Ts) + len(side) + (0 if quick else 2) + 3
    bar = Progress(n_steps, progress)
    results: dict[str, Any] = {
        "config": mh._config.config(),
        "torch": None if torch is None else torch.__version__,
        "peers": versions,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "load_average": {"start": _load_average()},
    }
    results["sgemm_gflops"] = sgemm_gflops()
    results["numpy_blas"] = numpy_blas()
    time.sleep(0.5)
    bar.step("SGEMM 2048x2048")
    rows = []
    for T in Ts:
        rows.append(kernel_case(T, 64, np.float32, threads, repeats, torch is not None,
                                with_oracle=T <= 2048, peers=others))
        bar.step(f"causal SDPA T={T} D=64 float32")
    for T, D, dt in side:
        rows.append(kernel_case(T, D, dt, threads, repeats, torch is not None, with_oracle=False,
                                peers=others))
        bar.step(f"causal SDPA T={T} D={D} {np.dtype(dt).name}")
    results["kernel"] = [asdict(r) for r in rows]
    if not quick:
        results["thread_scaling_T2048"] = thread_scaling(2048, threads, repeats)
        bar.step("1 thread against all, T=2048")
        results["peak_extra_mib_T16384"] = peak_extra_memory_mib(16384)
        bar.step("peak memory, T=16384")
    results["module"] = module_case(threads, max(5, repeats // 2 + 1), torch is not None)
    bar.step("module B=8 T=1024 d=768 H=12")
    results["bandwidth_gbs"] = read_bandwidth_gbs(threads)
    bar.step("memory read rate, 1 GiB")
    results["decode"] = decode_cases(threads, repeats, torch is not None,
                                     (1024, 4096) if quick else (1024, 4096, 16384),
                                     peers=others)
    bar.step("decode q_len=1")
    results["load_average"]["end"] = _load_average()
    text = format_markdown(results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump(results, fh, indent=2, default=str)
        with open(os.path.join(out_dir, "results.md"), "w") as fh:
            fh.write(text)
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
    sg = r["sgemm_gflops"]
    cfg = r["config"]
    versions = r.get("peers") or {"torch": r["torch"]}
    peers = _timed_peers(r)
    installed = ", ".join(f"{n} {v}" for n, v in versions.items() if v)
    absent = [n for n, v in versions.items() if not v]
    lines = [
        f"manyheads {cfg['version']}, kernel path {cfg['kernel_isa']}, {r['threads']} threads; "
        f"peers on the same thread count: {installed or 'none'}"
        + (f" ({', '.join(absent)} not installed)" if absent else "")
        + f". SGEMM (NumPy float32 2048²{_blas_text(r)}) {sg:.0f} GFLOP/s at the start "
        "(each row's % uses the SGEMM rate measured just before that row).",
        *_load_line(r),
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
    if "decode" in r:
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
    return "\n".join(lines) + "\n"


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
