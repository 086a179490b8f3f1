"""The benchmark's report: a markdown page, the JSON record and the prefill plot.

Everything here reads a :class:`~benchmarks.results.BenchResult` and times
nothing, so a report can be made again from a saved ``results.json``.
"""
from __future__ import annotations

import os

from benchmarks.peers import LABELS, PEERS, SHORT
from benchmarks.results import (BenchResult, CacheFormatRow, Checks, DecodeRow, HalfPrefill,
                                HFModelsResult, InferenceResult, LayerStep, PrefillRow,
                                to_json)

#: the rows of the inference tables: (key in the results, label)
PROCESS_ROWS = (("main", "this process"),
                ("openblas1", "subprocess, OPENBLAS_NUM_THREADS=1"),
                ("no_torch", "subprocess, torch never imported"))


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _ratio(other: float | None, mine: float) -> str:
    return "—" if other is None else f"{other / mine:.2f}×"


def timed_peers(r: BenchResult) -> list[str]:
    """The ONNX Runtime / OpenVINO peers this run included (installed and selected)."""
    return [n for n in PEERS if r.peers.get(n)]


def _notes_and_checks(rows: list[tuple[str, Checks]], names: list[str]) -> list[str]:
    """Lines under a table: each peer's largest difference from manyheads, and skips.

    ``rows`` pairs each row's place ("T=512 D=64 float32", "L=1024") with its checks.
    """
    lines = []
    worst = {}
    for n in names:
        diffs = [c.max_abs_diff[n] for _, c in rows if n in c.max_abs_diff]
        if diffs:
            worst[n] = max(diffs)
    if worst:
        lines.append("Checked before timing, largest |peer − manyheads| over these rows: "
                     + ", ".join(f"{LABELS[n]} {d:.1e}" for n, d in worst.items()) + ".")
    seen: dict[tuple[str, str], list[str]] = {}
    for where, c in rows:
        for n, note in c.notes.items():
            if n in names:
                seen.setdefault((n, note), []).append(where)
    for (n, note), places in seen.items():
        lines.append(f"Not timed: {LABELS[n]} at {', '.join(places)}: {note}.")
    return lines


def _blas_text(r: BenchResult) -> str:
    b = r.numpy_blas
    if not b:
        return ""
    return f", {b['internal_api']} {b['version']}, {b['architecture']} kernels"


def _load_line(r: BenchResult) -> list[str]:
    """How busy the machine was: other processes on the cores slow every contender."""
    if r.load_start is None or r.load_end is None:
        return []
    return [f"1-minute load average {r.load_start:.2f} at the start, {r.load_end:.2f} at the "
            f"end, on {r.cpu_count or '?'} logical CPUs (this run's own work included)."]


def format_markdown(r: BenchResult) -> str:
    """The report: a header (versions, kernel path, threads, load), then each section run."""
    cfg = r.config
    installed = ", ".join(f"{n} {v}" for n, v in r.peers.items() if v)
    absent = [n for n, v in r.peers.items() if not v]
    head = (f"manyheads {cfg['version']}, kernel path {cfg['kernel_isa']}, {r.threads} "
            f"threads; peers on the same thread count: {installed or 'none'}"
            + (f" ({', '.join(absent)} not installed)" if absent else "") + ".")
    if r.sgemm_gflops is not None:
        head += (f" SGEMM (NumPy float32 2048²{_blas_text(r)}) {r.sgemm_gflops:.0f} GFLOP/s "
                 "at the start (each row's % uses the SGEMM rate measured just before that row).")
    lines = [head, *_load_line(r)]
    if r.prefill is not None:
        lines += _attention_lines(r, r.prefill)
    if r.module is not None:
        lines += _module_lines(r)
    if r.decode is not None:
        lines += _decode_lines(r, r.decode)
    if r.cache_formats is not None:
        lines += _low_precision_lines(r, r.cache_formats)
    if r.inference is not None:
        lines += _inference_lines(r.inference)
    if r.hf_models is not None:
        lines += _hf_lines(r.hf_models)
    if r.claims:
        lines += _claim_lines(r)
    return "\n".join(lines) + "\n"


def _attention_lines(r: BenchResult, rows: list[PrefillRow]) -> list[str]:
    peers = timed_peers(r)
    lines = [
        "Causal attention (prefill), B=1, H=12; medians; X / mh = X's time ÷ manyheads' time "
        "(above 1: manyheads is faster); useful work counted as 2·B·H·T²·D flops.",
        "",
        "| T | D | dtype | manyheads ms | torch SDPA ms | torch / mh | "
        + "".join(f"{LABELS[n]} ms | {SHORT[n]} / mh | " for n in peers)
        + "oracle ms | oracle / mh | % of SGEMM rate |",
        "|---:|---:|:---|---:|---:|---:|" + "---:|---:|" * len(peers) + "---:|---:|---:|",
    ]
    for row in rows:
        ms = row.manyheads_ms
        pct = row.flops / (ms * 1e-3) / 1e9 / row.sgemm_gflops * 100
        cells = [str(row.T), str(row.D), row.dtype, f"{ms:.2f}",
                 _fmt(row.torch_ms), _ratio(row.torch_ms, ms)]
        for n in peers:
            other = row.peers_ms.get(n)
            cells += [_fmt(other), _ratio(other, ms)]
        cells += [_fmt(row.oracle_ms, ".1f"), _ratio(row.oracle_ms, ms), f"{pct:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    checks = _notes_and_checks([(f"T={x.T} D={x.D} {x.dtype}", x.checks) for x in rows],
                               ["torch", *peers])
    if checks:
        lines += [""] + checks
    if r.thread_scaling is not None:
        ts = r.thread_scaling
        one, many = ts.one_thread_ms, ts.all_threads_ms
        lines += ["", f"Threads: T={ts.T} D=64 takes {one:.2f} ms on 1 thread, {many:.2f} ms on "
                  f"{ts.threads}: {one / many:.2f}× faster."]
    if r.peak_memory is not None and r.peak_memory.extra_mib is not None:
        lines.append(f"Memory: at T={r.peak_memory.T} one call's peak RSS beyond inputs and "
                     f"output is {r.peak_memory.extra_mib:.1f} MiB.")
    return lines


def _module_lines(r: BenchResult) -> list[str]:
    m = r.module
    assert m is not None
    lines = [
        "",
        "Module at the book's shape (B=8, T=1024, d=768, 12 heads, float32, projections included):",
        "",
        "| implementation | ms | relative to fused |",
        "|:---|---:|---:|",
    ]
    for label, ms in (("manyheads fused MultiHeadAttention", m.fused_ms),
                      ("manyheads StackedMultiHeadAttention", m.stacked_ms),
                      ("PyTorch: same projections + SDPA", m.torch_ms),
                      ("NumPy oracle (stacked heads)", m.oracle_ms)):
        if ms is not None:
            lines.append(f"| {label} | {ms:.1f} | {ms / m.fused_ms:.2f}× |")
    return lines


def _decode_lines(r: BenchResult, rows: list[DecodeRow]) -> list[str]:
    peers = timed_peers(r)
    assert r.bandwidth is not None
    bw = r.bandwidth.best
    lines = [
        "",
        "Decode: one new query against a KV cache of L keys (q_len=1, B=1, H=12, D=64), µs; "
        f"memory read rate {bw:.1f} GB/s (NumPy, 1 GiB, {r.threads} threads: "
        f"max {r.bandwidth.max_gbs:.1f}, sum {r.bandwidth.sum_gbs:.1f}):",
        "",
        "| L | manyheads float32 | manyheads float16 cache | torch SDPA | torch / mh | "
        + "".join(f"{LABELS[n]} | {SHORT[n]} / mh | " for n in peers)
        + "float16 vs float32 | float32 cache read rate |",
        "|---:|---:|---:|---:|---:|" + "---:|---:|" * len(peers) + "---:|---:|",
    ]
    for d in rows:
        t32, t16, tt = d.float32_us, d.float16_us, d.torch_us
        rate = d.bytes_f32 / (t32 * 1e-6) / 1e9
        cells = [str(d.L), f"{t32:.0f}", f"{t16:.0f}", _fmt(tt, ".0f"), _ratio(tt, t32)]
        for n in peers:
            other = d.peers_us.get(n)
            cells += [_fmt(other, ".0f"), _ratio(other, t32)]
        cells += [f"{t32 / t16:.2f}×", f"{rate:.1f} GB/s ({rate / bw * 100:.0f}%)"]
        lines.append("| " + " | ".join(cells) + " |")
    checks = _notes_and_checks([(f"L={d.L}", d.checks) for d in rows], ["torch", *peers])
    if checks:
        lines += [""] + checks
    return lines


def _read_rate(bytes_per_token: float, L: int, us: float) -> float:
    """GB/s of a step that reads a cache of L tokens in ``us`` microseconds."""
    return bytes_per_token * L / (us * 1e-6) / 1e9


def _low_precision_lines(r: BenchResult, rows: list[CacheFormatRow]) -> list[str]:
    assert r.bandwidth is not None
    bw = r.bandwidth.best
    fmts = list(rows[0].step_us)
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
        bpt, tt = row.bytes_per_token, row.torch_sdpa_f32_us
        for f in fmts:
            t = row.step_us[f]
            rate = _read_rate(bpt[f], row.L, t)
            lines.append("| " + " | ".join([
                str(row.L), f, f"{bpt[f]:.0f}", f"{bpt[f] / bpt['float32']:.3f}",
                f"{t:.0f}", _ratio(row.step_us.get("float16"), t), _ratio(tt, t),
                f"{rate:.1f} GB/s ({rate / bw * 100:.0f}%)"]) + " |")
    cold_row = next((row for row in rows if row.cold_step_us), None)
    if cold_row is not None:
        c = cold_row.cold_step_us
        lines += ["", f"The same step at L={cold_row.L} with the cache cold (128 MiB of other "
                  "memory read before each call, as a deep model's other layers pass through "
                  "the last-level cache), µs: " + ", ".join(
                      f"{f} {c[f]:.0f} "
                      f"({_read_rate(cold_row.bytes_per_token[f], cold_row.L, c[f]):.1f} GB/s)"
                      for f in fmts if f in c) + "."]
    deep_row = next((row for row in rows if row.deep_step_us), None)
    if deep_row is not None:
        c = deep_row.deep_step_us
        lines += ["", f"The same step at L={deep_row.L} in a stack of such layers stepped in "
                  "turn, each with its own cache (256 MiB of caches in all), so that each "
                  "finds its cache out of the last-level cache and its code path warm, as in "
                  "a deep model's decode, µs: " + ", ".join(
                      f"{f} {c[f]:.0f} "
                      f"({_read_rate(deep_row.bytes_per_token[f], deep_row.L, c[f]):.1f} GB/s)"
                      for f in fmts if f in c) + "."]
    if rows[0].skipped:
        lines += ["", f"Not run: {', '.join(rows[0].skipped)} (ml_dtypes is not installed)."]
    g = r.gqa
    if g is not None:
        lines += ["", f"Grouped-query decode, {g.heads} query heads on {g.kv_heads} kv heads, "
                  f"L={g.L}, float32: {g.grouped_us:.0f} µs; the same with the kv heads "
                  f"repeated to {g.heads} (4× the bytes): {g.repeated_us:.0f} µs; "
                  f"{g.repeated_us / g.grouped_us:.2f}× (largest difference "
                  f"{g.max_abs_diff:.1e})."]
    h = r.half_prefill
    if h is not None:
        f32 = h.ms["float32"]
        halves = [f for f in ("float16", "bfloat16") if f in h.ms]
        lines += ["", f"Half-precision prefill (causal, T={h.T}, 12 heads of 64): float32 "
                  f"{f32:.2f} ms; " + "; ".join(
                      f"{f} {h.ms[f]:.2f} ms ({f32 / h.ms[f]:.2f}× float32)"
                      for f in halves) + " (" + _half_prefill_how(h) + ")."]
    return lines


def _half_prefill_how(h: HalfPrefill) -> str:
    """How the half-precision prefill row was computed, for its line."""
    if h.path == "avx512bf16":
        return ("float16 widened to float32 as it loads; bfloat16 multiplied in pairs by "
                "AVX512-BF16's vdpbf16ps, the avx512bf16 path")
    return "widened to float32 as they load; " + {
        True: f"this CPU has AVX512-BF16, but the {h.path} path ran",
        False: "this CPU has no AVX512-BF16", None: "AVX512-BF16 unknown"}[h.avx512_bf16]


def _process_label(key: str, torch_in_process: bool) -> str:
    label = dict(PROCESS_ROWS)[key]
    if key != "no_torch":
        label += " (torch imported and used)" if torch_in_process else " (no torch)"
    return label


def _inference_lines(inf: InferenceResult) -> list[str]:
    errors = {mode: c.error for mode, c in inf.children.items() if c.error}
    when = ""
    if inf.load_start is not None and inf.load_end is not None:
        when = (f" 1-minute load average {inf.load_start:.2f} when this section started, "
                f"{inf.load_end:.2f} when it ended.")
    lines = [
        "",
        f"Inference, float32, {inf.threads} threads on every side, medians.{when} The "
        "subprocesses are fresh interpreters started by the bench: one with "
        "`sys.modules[\"torch\"] = None` set before manyheads is imported, so torch cannot "
        "load; one with OPENBLAS_NUM_THREADS=1 that measures what this process measures. "
        "The last column compares manyheads' time in this process with its time in that row's "
        "(above 1: slower here).",
    ]
    lines += _layer_lines(inf)
    lines += _generation_lines(inf)
    if inf.tiny_sdpa is not None:
        t, tiny = inf.tiny_shape, inf.tiny_sdpa
        tt = tiny.torch_us
        lines += ["", f"One tiny SDPA call ({t.heads} heads × {t.queries} query × "
                  f"{t.keys} keys, D={t.D}, float32, called as inference code calls "
                  f"it): manyheads {tiny.manyheads_us:.1f} µs"
                  + (f", torch {tt:.1f} µs: torch / mh {tt / tiny.manyheads_us:.2f}×."
                     if tt else ".")]
    for mode, err in errors.items():
        lines.append(f"The {mode} subprocess failed: {err}")
    return lines


def _layer_lines(inf: InferenceResult) -> list[str]:
    layer: dict[str, LayerStep] = inf.layer_decode
    main = layer.get("main")
    s = inf.layer_shape
    lines = [
        "",
        f"Layer decode step: one fused layer (d={s.d}, {s.heads} heads, qkv bias), one new "
        f"token against a KV cache of {s.cached} tokens (rolled back with "
        f"`cache.truncate({s.cached})` after each call), µs per call. torch's layer: a qkv "
        f"`F.linear`, the new key and value written into a preallocated buffer of "
        f"{s.cached} + 1 positions, SDPA over it, an output `F.linear`; same weights.",
        "",
        "| process | manyheads µs | torch layer µs | torch / mh | mh here ÷ mh there |",
        "|:---|---:|---:|---:|---:|",
    ]
    for key, _ in PROCESS_ROWS:
        row = layer.get(key)
        if row is None:
            continue
        t, tt = row.manyheads_us, row.torch_us
        lines.append(f"| {_process_label(key, row.torch_in_process)} | {t:.0f} | "
                     f"{_fmt(tt, '.0f')} | {_ratio(tt, t)} | "
                     f"{_ratio(main.manyheads_us if main else None, t)} |")
    lines.append("")
    blocks = main.blocks if main else []
    if len(blocks) == 2:
        text = ", ".join(f"{b.manyheads_us:.0f}" + (f" (torch {b.torch_us:.0f})"
                                                     if b.torch_us is not None else "")
                         for b in blocks)
        lines.append(f"This process's row is the mean of two measurements, before and after "
                     f"the OPENBLAS_NUM_THREADS=1 subprocess: manyheads {text} µs.")
    diffs = [row.checks.max_abs_diff["torch"] for row in layer.values()
             if "torch" in row.checks.max_abs_diff]
    if diffs:
        lines.append(f"Checked before timing: largest |torch − manyheads| {max(diffs):.1e}.")
    for key, row in layer.items():
        for n, note in row.checks.notes.items():
            lines.append(f"Not timed: {n} in {dict(PROCESS_ROWS)[key]}: {note}.")
    return lines


def _generation_lines(inf: InferenceResult) -> list[str]:
    gen = inf.generation
    main = gen.get("main")
    g = inf.gpt2_shape
    lines = [
        "",
        f"GPT-2-small-shaped generation: {g.n_layer} layers, d={g.n_embd}, {g.n_head} "
        f"heads, vocab {g.vocab_size}, n_positions {g.n_positions}, random weights (a "
        f"seeded `transformers.GPT2Config` model saved as safetensors); a {g.prompt}-token "
        f"prompt, then {g.new_tokens} greedy tokens; tokens/s = {g.new_tokens} ÷ the "
        f"whole generate call, median of {inf.generation_rounds} calls after a "
        "warm-up."
        + (f" manyheads: `{main.loader}`; Hugging Face: transformers "
           f"{inf.transformers} `generate(do_sample=False)` on torch."
           if main else ""),
    ]
    if inf.generation_note:
        return lines + ["", f"Not measured: {inf.generation_note}."]
    lines += [
        "",
        "| process | manyheads tokens/s | Hugging Face tokens/s | mh / HF | "
        "mh here ÷ mh there | tokens |",
        "|:---|---:|---:|---:|---:|:---|",
    ]
    for key, _ in PROCESS_ROWS:
        row = gen.get(key)
        if row is None:
            continue
        tps, hf = row.manyheads_tokens_per_s, row.hf_tokens_per_s
        if row.hf_tokens is not None:
            same = "identical to HF's" if row.identical else "DIFFER from HF's"
        elif row.manyheads_tokens and main and main.manyheads_tokens:
            same = ("identical to this process's"
                    if row.manyheads_tokens == main.manyheads_tokens
                    else "DIFFER from this process's")
        else:
            same = "—"
        lines.append(f"| {_process_label(key, row.torch_in_process)} | {tps:.1f} | "
                     f"{_fmt(hf, '.1f')} | {_fmt(hf and tps / hf)}{'×' if hf else ''} | "
                     f"{_ratio(main.manyheads_s if main else None, row.manyheads_s)} | "
                     f"{same} |")
    return lines


def _hf_lines(hf: HFModelsResult) -> list[str]:
    lines = ["", "Whole Hugging Face models, random weights, float32, "
             f"{hf.threads} threads (transformers {hf.transformers or 'not installed'}): "
             'attn_implementation="manyheads" against transformers\' backend on the same '
             "weights; seconds per forward and inside the attention function (medians), and "
             "the ratio baseline / manyheads."]
    if hf.note:
        return lines + ["", f"Not measured: {hf.note}."]
    lines += ["", "| model | call | baseline | forward: manyheads | baseline | ratio | "
              "attention: manyheads | baseline | ratio | attention's share (baseline) | "
              "logits max abs diff |", "|:---|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in hf.rows:
        call = (f"prefill T={x.tokens}" if x.phase == "prefill"
                else f"decode step, context {x.tokens}")
        lines.append(f"| {x.model} | {call} | {x.baseline} | {x.manyheads_s:.3f} | "
                     f"{x.baseline_s:.3f} | {_ratio(x.baseline_s, x.manyheads_s)} | "
                     f"{x.manyheads_attention_s:.3f} | {x.baseline_attention_s:.3f} | "
                     f"{_ratio(x.baseline_attention_s, x.manyheads_attention_s)} | "
                     f"{100 * x.baseline_attention_s / x.baseline_s:.0f}% | "
                     f"{x.max_abs_diff:.1e} |")
    return lines


def _claim_lines(r: BenchResult) -> list[str]:
    lines = ["", "Claims a user can check on their own machine, each a ratio measured in this "
             "run (python benchmarks/run.py --section attention,inference,hf):", "",
             "| claim | measured | |", "|:---|---:|:---|"]
    for c in r.claims:
        met = {True: "met", False: "**not met**", None: "not measured"}[c.met]
        extra = ""
        if c.key == "generation" and c.identical is not None:
            extra = ", tokens identical" if c.identical else ", tokens DIFFER"
        lines.append(f"| {c.text} | {_fmt(c.ratio)}{'×' if c.ratio else ''}{extra} | {met} |")
    return lines


def plot_results(r: BenchResult, path: str) -> str | None:
    """Time against T per implementation (log-log), D=64 float32; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    assert r.prefill is not None and r.sgemm_gflops is not None
    rows = [x for x in r.prefill if x.D == 64 and x.dtype == "float32"]
    Ts = [x.T for x in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ax.plot(Ts, [x.manyheads_ms for x in rows], "o-", label="manyheads")
    torch_ms = [x.torch_ms for x in rows if x.torch_ms is not None]
    if len(torch_ms) == len(rows):
        ax.plot(Ts, torch_ms, "s-", label="PyTorch SDPA (CPU)")
    for name, marker in zip(timed_peers(r), "Dv"):
        points = [(x.T, ms) for x in rows if (ms := x.peers_ms.get(name)) is not None]
        if points:
            ax.plot([t for t, _ in points], [ms for _, ms in points], marker + "-",
                    label=LABELS[name])
    points = [(x.T, x.oracle_ms) for x in rows if x.oracle_ms is not None]
    if points:
        ax.plot([t for t, _ in points], [ms for _, ms in points], "^-", label="NumPy oracle")
    sg = r.sgemm_gflops
    ax.plot(Ts, [x.flops / (sg * 1e9) * 1e3 for x in rows], "k--", lw=1,
            label="at the SGEMM rate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time per call (ms, median)")
    ax.set_title(f"Causal attention, B=1, H=12, D=64, float32, {r.threads} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write(r: BenchResult, out_dir: str) -> dict[str, str]:
    """Write results.md, results.json and (with the attention section) attention_time.png
    into ``out_dir``; the paths written, by kind ("markdown", "json", "plot")."""
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        fh.write(to_json(r))
    written["json"] = os.path.join(out_dir, "results.json")
    with open(os.path.join(out_dir, "results.md"), "w") as fh:
        fh.write(format_markdown(r))
    written["markdown"] = os.path.join(out_dir, "results.md")
    if r.prefill is not None:
        png = plot_results(r, os.path.join(out_dir, "attention_time.png"))
        if png:
            written["plot"] = png
    return written
