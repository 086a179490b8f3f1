"""What the attention and module sections time, and how.

Each case makes its inputs from a fixed seed, checks every contender against
manyheads' output (``peers.check``) and then times the contenders together with
``timing.compare``.  Useful work of causal attention is counted as 2·B·H·T²·D
flops; the ceiling is the machine's SGEMM rate (NumPy float32 2048×2048).
"""
from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import manyheads as mh
from benchmarks import peers
from benchmarks.results import (Bandwidth, CacheFormatRow, Checks, DecodeRow,
                                GroupedQueryDecode, HalfPrefill, ModuleResult, PeakMemory,
                                PrefillRow, ThreadScaling)
from benchmarks.timing import compare, median_time, split_reduction
from manyheads import oracle
from manyheads.cache import FORMATS

#: cache formats of the low-precision decode table, in column order: every storage
#: format a float32 module's cache can take
CACHE_FORMATS = tuple(name for name in FORMATS if name != "float64")


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


def sgemm_gflops(repeats: int = 15) -> float:
    """The machine's float32 matmul rate (2048 x 2048) through NumPy's BLAS (median)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    t = median_time(lambda: a @ a, repeats)
    return 2 * 2048**3 / t / 1e9


def prefill_case(T: int, D: int, dtype: Any, threads: int, repeats: int, with_torch: bool,
                 with_oracle: bool, B: int = 1, H: int = 12,
                 others: Sequence[str] = ()) -> PrefillRow:
    """One causal attention shape: manyheads, its peers and (optionally) the oracle.

    ``others`` names the installed ONNX Runtime / OpenVINO peers to include;
    each is checked against manyheads' output before it is timed.
    """
    rng = np.random.default_rng(T + D)
    q, k, v = (rng.standard_normal((B, H, T, D)).astype(dtype) for _ in range(3))
    dtype_name = np.dtype(dtype).name
    checks = Checks()
    fns: dict[str, Callable[[], Any]] = {
        "manyheads": lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             num_threads=threads)}
    ref = np.asarray(fns["manyheads"](), dtype=np.float64)
    torch = peers.torch_module() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch() -> Any:
            with torch.inference_mode():
                return sdpa(tq, tk, tv, is_causal=True)

        if peers.check("torch", run_torch().numpy(), ref, dtype_name, checks):
            fns["torch"] = run_torch
    for name in others:
        peers.add_peer(name, functools.partial(peers.prefill, name, q, k, v, threads), ref,
                       dtype_name, fns, checks)
    del ref
    # the ceiling, measured right before this row; then a pause, because BLAS
    # worker threads keep spinning for a while after a call and would slow
    # whatever runs next
    ceiling = sgemm_gflops(10)
    time.sleep(0.5)
    # enough calls for a stable median on a shared machine: about 2 s per contender
    t0 = time.perf_counter()
    fns["manyheads"]()
    estimate = max(time.perf_counter() - t0, 1e-5)
    calls = int(min(400, max(repeats, 2.0 / estimate)))
    rounds = max(5, min(10, calls // 3))
    per_round = max(1, calls // rounds)
    res = compare(fns, rounds=rounds, per_round=per_round)
    row = PrefillRow(
        T=T, D=D, dtype=dtype_name, threads=threads, manyheads_ms=1e3 * res["manyheads"],
        flops=2.0 * B * H * T * T * D, sgemm_gflops=ceiling,
        torch_ms=1e3 * res["torch"] if "torch" in res else None,
        peers_ms={name: (1e3 * res[name] if name in res else None) for name in others},
        checks=checks)
    if with_oracle:
        row.oracle_ms = 1e3 * median_time(
            lambda: oracle.scaled_dot_product_attention(q, k, v, is_causal=True), 3, warmup=1)
    return row


def module_case(threads: int, repeats: int, with_torch: bool, B: int = 8, T: int = 1024,
                d: int = 768, H: int = 12) -> ModuleResult:
    """Whole-module time at the book's benchmark shape (ms), every variant with one weight set."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, d)).astype(np.float32)
    fused = mh.MultiHeadAttention(d, d, T, 0.0, H, dtype=np.float32, seed=0)
    stacked = fused.to_stacked()
    fns: dict[str, Callable[[], Any]] = {
        "fused": lambda: fused(x, num_threads=threads),
        "stacked": lambda: stacked(x, num_threads=threads),
    }
    torch = peers.torch_module() if with_torch else None
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
    oracle_ms = 1e3 * median_time(
        lambda: oracle.stacked_multi_head_attention(x, heads, fused.W_out, fused.b_out), 3,
        warmup=1)
    return ModuleResult(fused_ms=res["fused"], stacked_ms=res["stacked"], oracle_ms=oracle_ms,
                        torch_ms=res.get("torch"))


def thread_scaling(T: int, threads: int, repeats: int, D: int = 64, H: int = 12
                   ) -> ThreadScaling:
    """manyheads on 1 thread and on ``threads`` threads, same arrays, interleaved (ms)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3))
    res = compare({
        "1": lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=1),
        str(threads): lambda: mh.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              num_threads=threads),
    }, rounds=max(5, repeats), per_round=3)
    return ThreadScaling(T=T, threads=threads, one_thread_ms=1e3 * res["1"],
                         all_threads_ms=1e3 * res[str(threads)])


def read_bandwidth(threads: int) -> Bandwidth:
    """Memory read rate of NumPy reductions over a 1 GiB float32 array split across threads.

    Both ``sum`` and ``max`` are measured; ``sum`` (pairwise summation) can be
    limited by arithmetic rather than memory, so the faster one is the ceiling.
    """
    a = np.ones(2**28, dtype=np.float32)
    res = compare({"sum": split_reduction(a, threads, np.sum),
                   "max": split_reduction(a, threads, np.max)}, rounds=3, per_round=2)
    return Bandwidth(max_gbs=a.nbytes / res["max"] / 1e9, sum_gbs=a.nbytes / res["sum"] / 1e9)


def _float16_kv_decode(q: np.ndarray, k16: np.ndarray, v16: np.ndarray,
                       threads: int) -> Callable[[], Any]:
    """A float32 query against float16 keys and values, as a float16 KV cache is read.

    The public API reaches this kernel call only through ``KVCache``, which
    also stores the new token and so costs a row write per call; the table's
    column is the attention alone, so it calls the package's internal core (the
    one place the benchmark does).
    """
    from manyheads import _core

    return lambda: _core.attention(q, k16, v16, scale=0.125, num_threads=threads)


def decode_cases(threads: int, repeats: int, with_torch: bool,
                 lengths: tuple[int, ...] = (1024, 4096, 16384),
                 others: Sequence[str] = ()) -> list[DecodeRow]:
    """One new query (q_len=1) against a cache of L keys, B=1, H=12, D=64 (microseconds).

    The ONNX Runtime and OpenVINO peers append the L-th key and value to a cache
    holding the other L-1 (a generation step); manyheads and torch read all L.
    """
    torch = peers.torch_module() if with_torch else None
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
            "float16": _float16_kv_decode(q, k16, v16, threads),
        }
        ref = np.asarray(fns["float32"](), dtype=np.float64)
        checks = Checks()
        if torch is not None:
            torch.set_num_threads(threads)
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

            def run_torch() -> Any:
                with torch.inference_mode():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

            if peers.check("torch", run_torch().numpy(), ref, "float32", checks):
                fns["torch"] = run_torch
        for name in others:
            peers.add_peer(name, functools.partial(peers.decode, name, q, k, v, threads, calls),
                           ref, "float32", fns, checks)
        res = compare(fns, rounds=rounds, per_round=per_round, warmup=warmup)
        us = {name: 1e6 * t for name, t in res.items()}
        rows.append(DecodeRow(
            L=L, bytes_f32=int(k.nbytes + v.nbytes), float32_us=us["float32"],
            float16_us=us["float16"], torch_us=us.get("torch"),
            peers_us={name: us[name] for name in others if name in us}, checks=checks))
        del fns  # frees the peers' caches before the next length
    return rows


#: bytes read before each cold call: more than the last-level cache of the CPUs this runs on
EVICT_BYTES = 128 << 20
#: bytes of the caches of the layers stepped in turn (the deep-model case)
DEEP_BYTES = 256 << 20


def _cache_dtype(fmt: str) -> Any:
    """new_cache()'s dtype argument for format name ``fmt`` (None: ml_dtypes is missing)."""
    try:
        FORMATS[fmt].dtype  # bfloat16 needs ml_dtypes
    except ImportError:
        return None
    return fmt


def cache_format_cases(threads: int, with_torch: bool, lengths: tuple[int, ...] = (1024, 16384)
                       ) -> list[CacheFormatRow]:
    """One fused layer's decode step (d_in=64, 12 heads of 64) with a cache of L tokens
    in every format, and torch's SDPA over float32 K/V of the same L (µs).

    Each cache is filled once (its L keys and values appended in one step, quantised
    as they are stored); each timed call appends one token and is rolled back with
    ``cache.truncate(L)``.  At the longest L the formats are also timed cold, two ways:

    * flushed: before each call, reading EVICT_BYTES of other memory pushes the cache
      out of the last-level cache.  That leaves everything else the call touches cold
      too (its code, the module's weights, the interpreter's objects), and on a virtual
      machine whose other tenants share the cache, a few milliseconds of other work
      do the same: this adds a cost that does not depend on L or the format;
    * in a deep model: layers of the same shape, each with its own cache (DEEP_BYTES
      of caches in all), are stepped in turn, so each finds its cache out of the
      last-level cache while the code path stays warm, as in a model's decode.
    """
    H, D, d_in = 12, 64, 64
    rows = []
    evict = np.ones(EVICT_BYTES // 8, dtype=np.int64)
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
        torch = peers.torch_module() if with_torch else None
        if torch is not None:
            torch.set_num_threads(threads)
            tq, tk, tv = (torch.from_numpy(a) for a in (q1, k, v))

            def run_torch() -> Any:
                with torch.inference_mode():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

            fns["torch_sdpa_f32"] = run_torch
        res = compare(fns, rounds=7, per_round=max(2, 40960 // L))
        us = {name: 1e6 * t for name, t in res.items()}
        cold: dict[str, float] = {}
        if L == max(lengths):
            cold_fns = {fmt: fns[fmt] for fmt in CACHE_FORMATS if fmt in fns}
            cold = {name: 1e6 * t for name, t in compare(
                cold_fns, rounds=7, per_round=3, before=lambda: int(evict.max())).items()}
        deep: dict[str, float] = {}
        if L == max(lengths):
            del fns, cold_fns
            deep = _deep_steps(L, threads, k, v, q1, x, [f for f in CACHE_FORMATS if f in us])
        rows.append(CacheFormatRow(
            L=L, bytes_per_token=per_token, skipped=skipped,
            step_us={fmt: us[fmt] for fmt in CACHE_FORMATS if fmt in us},
            torch_sdpa_f32_us=us.get("torch_sdpa_f32"), cold_step_us=cold,
            deep_step_us=deep))
    return rows


def _deep_steps(L: int, threads: int, k: np.ndarray, v: np.ndarray, q1: np.ndarray,
                x: np.ndarray, fmts: list[str]) -> dict[str, float]:
    """µs of a layer's decode step over a cache of L tokens in each format, in a stack of
    layers (each with its own cache, DEEP_BYTES of caches in all) stepped in turn."""
    H, D = k.shape[1], k.shape[3]
    fns: dict[str, Callable[[], Any]] = {}
    cycle = 0
    for fmt in fmts:
        stack = []
        while not stack or sum(c.nbytes for _, c in stack) < DEEP_BYTES:
            layer = mh.MultiHeadAttention(x.shape[-1], H * D, L + 1, 0.0, H,
                                          seed=len(stack) + 1)
            cache = layer.new_cache(1, L + 1, dtype=_cache_dtype(fmt))
            with cache.step(L) as st:
                st.attend(q1, k, v, scale=0.125, num_threads=threads)
            stack.append((layer, cache))
        cycle = max(cycle, len(stack))

        def step(turns: Iterator[Any] = itertools.cycle(stack)) -> Any:
            layer, cache = next(turns)
            y = layer(x, cache=cache, num_threads=threads)
            cache.truncate(L)
            return y

        fns[fmt] = step
    res = compare(fns, rounds=7, per_round=cycle, warmup=cycle)
    return {fmt: 1e6 * t for fmt, t in res.items()}


def gqa_case(threads: int, L: int = 16384, Hq: int = 32, Hkv: int = 8) -> GroupedQueryDecode:
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
    return GroupedQueryDecode(L=L, heads=Hq, kv_heads=Hkv, max_abs_diff=diff,
                              grouped_us=1e6 * res["grouped"],
                              repeated_us=1e6 * res["repeated"])


def half_prefill_case(threads: int, T: int = 2048) -> HalfPrefill:
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
    return HalfPrefill(T=T, ms={name: 1e3 * t for name, t in res.items()},
                       avx512_bf16=cpu_flag("avx512_bf16"), path=mh.kernel_isa())


def cpu_flag(flag: str) -> bool | None:
    """Whether /proc/cpuinfo lists ``flag`` (None where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("flags") and flag in line.split() for line in fh)
    except OSError:
        return None


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


def peak_memory(T: int, D: int = 64, H: int = 12) -> PeakMemory:
    """Peak RSS growth of one call beyond its inputs and output, in MiB (Linux only).

    The subprocess allocates the inputs and touches (then frees) an
    output-sized buffer first, so the baseline already covers the output.
    """
    if not sys.platform.startswith("linux"):
        return PeakMemory(T=T, extra_mib=None)
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(T), str(D), str(H)],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return PeakMemory(T=T, extra_mib=None)
    return PeakMemory(T=T, extra_mib=int(res.stdout.strip().splitlines()[-1]) / 2**20)
