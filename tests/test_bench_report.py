"""The benchmark's bookkeeping (benchmarks/ in the source tree): peers, checks, claims,
tables, JSON, and the thin ``python -m manyheads bench`` entry.

Nothing here times anything or needs a peer installed: reports are built from
made-up results, and the check is fed arrays directly.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from manyheads.__main__ import main as manyheads_main

REPO = Path(__file__).resolve().parent.parent
if not (REPO / "benchmarks" / "run.py").is_file():
    pytest.skip("needs the source tree's benchmarks/", allow_module_level=True)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmark is imported from the source tree

from benchmarks import claims, inference, peers, report, run  # noqa: E402
from benchmarks.results import (Bandwidth, BenchResult, CacheFormatRow, Checks,  # noqa: E402
                                ChildStatus, DecodeRow, GenerationRun, GPT2Shape,
                                GroupedQueryDecode, HalfPrefill, HFModelRow, HFModelsResult,
                                InferenceResult, LayerShape,
                                LayerStep, ModuleResult, PrefillRow, TimedBlock, TinySDPA,
                                TinyShape, from_json, to_json)


# ----------------------------------------------------------------------------- command line

def help_text():
    return " ".join(run.build_parser().format_help().split())


def test_help_lists_every_peer_and_how_to_install_them():
    text = help_text()
    for name in ("torch", "onnxruntime", "openvino", "GroupQueryAttention",
                 "ScaledDotProductAttention", "pip install '.[bench]'"):
        assert name in text


def test_help_describes_the_inference_section_and_its_claims():
    text = help_text()
    for words in ("--section", "inference", "KV cache of 1024 tokens", "200-token prompt",
                  "32 greedy tokens", "generate(do_sample=False)", "never imports torch",
                  "OPENBLAS_NUM_THREADS=1", "12 heads x 1 query x 16 keys", ">= 1.5x torch",
                  ">= 1.3x Hugging Face's", ">= 1.2x torch", "within 1.2x"):
        assert words in text, words


def test_unknown_peer_is_refused_before_anything_runs(capsys):
    assert run.main(["--peers", "torch,tensorflow"]) == 2
    assert "tensorflow" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensorflow"):
        run.run(peer_names=["tensorflow"])


def test_unknown_section_is_refused_before_anything_runs(capsys):
    assert run.main(["--section", "decoding"]) == 2
    assert "decoding" in capsys.readouterr().err
    with pytest.raises(ValueError, match="decoding"):
        run.run(sections="decoding")


def test_results_go_to_the_committed_results_folder_by_default():
    args = run.build_parser().parse_args([])
    assert Path(args.out) == REPO / "benchmarks" / "results"
    assert args.peers == "torch,onnxruntime,openvino" and args.repeats == 7


def test_sections_parse_and_inference_brings_the_module_along():
    assert run.parse_sections(None) == run.SECTIONS
    assert run.parse_sections("all") == run.SECTIONS
    assert run.parse_sections("inference") == ("module", "inference")
    assert run.parse_sections(["attention"]) == ("attention",)
    assert run.parse_sections(" inference , attention ") == ("attention", "module", "inference")
    assert run.parse_sections("hf") == ("hf",)
    with pytest.raises(ValueError, match="decoding"):
        run.parse_sections("attention,decoding")


# ----------------------------------------------------------------------------- the thin entry

def test_bench_outside_a_checkout_says_where_the_benchmark_lives(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert manyheads_main(["bench", "--quick"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not part of the installed package" in err
    assert "python benchmarks/run.py" in err and "--source" in err
    assert manyheads_main(["bench", "--source", str(tmp_path / "nowhere")]) == 2


def test_bench_help_outside_a_checkout_is_the_message_not_an_error(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    assert manyheads_main(["bench", "--help"]) == 0
    assert "python benchmarks/run.py" in capsys.readouterr().out


def fake_checkout(folder, code=3):
    (folder / "benchmarks").mkdir(parents=True)
    (folder / "benchmarks" / "run.py").write_text(
        f"import sys\nprint('ran with', sys.argv[1:])\nsys.exit({code})\n")
    return folder


def test_bench_runs_the_checkouts_script_with_the_other_arguments(tmp_path, capfd):
    checkout = fake_checkout(tmp_path / "checkout")
    code = manyheads_main(["bench", "--quick", "--source", str(checkout), "--out", "x",
                           "--section", "inference"])
    assert code == 3  # the script's own exit code
    assert "ran with ['--quick', '--out', 'x', '--section', 'inference']" in capfd.readouterr().out


def test_bench_finds_the_script_in_the_current_folder(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(fake_checkout(tmp_path / "checkout", code=0))
    assert manyheads_main(["bench", "--help"]) == 0
    assert "ran with ['--help']" in capfd.readouterr().out


def test_the_installed_package_holds_no_benchmark_and_no_planning_words():
    src = REPO / "src" / "manyheads"
    names = {p.name for p in src.rglob("*.py")}
    assert not names & {"_bench.py", "_peers.py", "bench.py", "peers.py"}
    import re
    for path in [*src.rglob("*.py"), *src.rglob("*.pyx"), *(REPO / "benchmarks").glob("*.py")]:
        text = path.read_text()
        assert not re.search(r"\bissues?\b", text, flags=re.I), path
        assert not re.search(r"\bbars?\b", text, flags=re.I), path


# ----------------------------------------------------------------------------- peers

def test_missing_peer_gives_a_one_line_note(monkeypatch):
    def refuse(name):
        raise ImportError(name)

    monkeypatch.setattr(peers, "_module", refuse)
    for name in peers.PEERS:
        assert peers.version(name) is None
    for name in peers.PEER_NAMES:
        note = peers.missing_note(name)
        assert "\n" not in note and "pip install '.[bench]'" in note and "skipped" in note


def test_check_accepts_a_matching_peer_and_refuses_a_wrong_one():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 2, 8, 4))
    checks = Checks()
    assert peers.check("onnxruntime", ref.astype(np.float32), ref, "float32", checks)
    assert checks.max_abs_diff["onnxruntime"] < 1e-6 and not checks.notes
    wrong_layout = ref.transpose(0, 2, 1, 3).reshape(ref.shape)  # heads and rows mixed up
    assert not peers.check("openvino", wrong_layout, ref, "float32", checks)
    assert "not timed" in checks.notes["openvino"]
    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    assert not peers.check("torch", nan, ref, "float32", checks)


def test_a_peer_that_fails_to_build_is_reported_not_fatal():
    def broken():
        raise RuntimeError("no such op\nsecond line")

    fns, checks = {}, Checks()
    peers.add_peer("onnxruntime", broken, np.zeros(3), "float32", fns, checks)
    assert not fns and checks.notes["onnxruntime"] == "failed: RuntimeError: no such op"
    peers.add_peer("openvino", broken, np.zeros(3), "float64", fns, checks)
    assert checks.notes["openvino"] == "float32 only here"


# ----------------------------------------------------------------------------- made-up results

VERSIONS = {"torch": "2.13.0+cpu", "onnxruntime": "1.32.0", "openvino": "2026.4.1"}


def attention_results():
    """An attention (and module) section as run() records it; nothing measured."""
    prefill = []
    for T, dtype, ort, ov in ((512, "float32", 6.0, 9.0), (1024, "float64", None, None)):
        checks = (Checks({"torch": 1e-7, "onnxruntime": 2e-7}) if ov else
                  Checks({"torch": 1e-15}, {"onnxruntime": "float32 only here",
                                            "openvino": "float32 only here"}))
        prefill.append(PrefillRow(T=T, D=64, dtype=dtype, threads=2, manyheads_ms=3.0,
                                  flops=2.0 * 12 * T * T * 64, sgemm_gflops=100.0, torch_ms=4.5,
                                  peers_ms={"onnxruntime": ort, "openvino": ov}, checks=checks))
    decode = [DecodeRow(L=1024, bytes_f32=6291456, float32_us=100.0, float16_us=60.0,
                        torch_us=120.0, peers_us={"onnxruntime": 150.0, "openvino": 400.0},
                        checks=Checks({"onnxruntime": 3e-7, "openvino": 2e-7}))]
    return BenchResult(
        config={"version": "0.1.0", "kernel_isa": "avx2"}, threads=2, cpu_count=2,
        sections=["attention", "module"], peers=dict(VERSIONS),
        numpy_blas={"internal_api": "openblas", "version": "0.3.31", "architecture": "Zen"},
        load_start=0.25, load_end=1.5, sgemm_gflops=100.0, prefill=prefill,
        module=ModuleResult(fused_ms=300.0, stacked_ms=400.0, oracle_ms=900.0),
        bandwidth=Bandwidth(max_gbs=20.0, sum_gbs=10.0), decode=decode)


def made_up_inference(identical=True, ob1_us=190.0, hf_s=1.6):
    """An inference section as inference_section() records it; nothing measured."""
    def layer(mh_us, torch_us, torch_in, blocks=()):
        checks = Checks({"torch": 1.2e-7}) if torch_us is not None else Checks()
        return LayerStep(manyheads_us=mh_us, torch_us=torch_us, torch_in_process=torch_in,
                         checks=checks, blocks=list(blocks))

    toks = list(range(32))
    return InferenceResult(
        threads=2, generation_rounds=5, layer_shape=LayerShape(), gpt2_shape=GPT2Shape(),
        tiny_shape=TinyShape(), load_start=0.5, load_end=1.25,
        tiny_sdpa=TinySDPA(manyheads_us=7.0, torch_us=6.3),
        layer_decode={"main": layer(200.0, 320.0, True, [TimedBlock(190.0, 300.0),
                                                          TimedBlock(210.0, 340.0)]),
                      "openblas1": layer(ob1_us, 330.0, True),
                      "no_torch": layer(195.0, None, False)},
        generation={
            "main": GenerationRun(loader="manyheads.models.from_pretrained", rounds=5,
                                  torch_in_process=True, manyheads_s=1.0,
                                  manyheads_tokens_per_s=32.0, manyheads_tokens=toks,
                                  hf_s=hf_s, hf_tokens_per_s=32 / hf_s,
                                  hf_tokens=toks if identical else toks[:-1] + [99],
                                  identical=identical),
            "no_torch": GenerationRun(loader="manyheads.models.from_pretrained", rounds=5,
                                      torch_in_process=False, manyheads_s=0.8,
                                      manyheads_tokens_per_s=40.0, manyheads_tokens=toks)},
        transformers="5.0",
        children={"no-torch": ChildStatus(None, False),
                  "openblas1": ChildStatus(None, True, {"OPENBLAS_NUM_THREADS": "1"})})


def inference_results(**kw):
    r = BenchResult(config={"version": "0.1.0", "kernel_isa": "avx512"}, threads=2,
                    cpu_count=2, sections=["module", "inference"],
                    peers={"torch": "2.13.0+cpu", "onnxruntime": None, "openvino": None},
                    numpy_blas={}, load_start=0.4, load_end=1.9,
                    module=ModuleResult(fused_ms=200.0, stacked_ms=240.0, oracle_ms=700.0,
                                        torch_ms=290.0),
                    inference=made_up_inference(**kw))
    r.claims = claims.evaluate(r)
    return r


def full_results():
    r = attention_results()
    inf = inference_results()
    r.sections = ["attention", "module", "inference"]
    r.inference, r.claims = inf.inference, inf.claims
    r.cache_formats = [low_precision_row()]
    r.gqa = GroupedQueryDecode(L=16384, heads=32, kv_heads=8, max_abs_diff=0.0,
                               grouped_us=1000.0, repeated_us=3500.0)
    r.half_prefill = HalfPrefill(T=2048, ms={"float32": 20.0, "float16": 25.0,
                                             "bfloat16": 10.0},
                                 avx512_bf16=False, path="avx2")
    return r


def low_precision_row():
    bpt = {"float32": 6144.0, "float16": 3072.0, "bfloat16": 3072.0, "int8": 1632.0,
           "int4": 960.0}
    return CacheFormatRow(L=1000, bytes_per_token=bpt, torch_sdpa_f32_us=600.0,
                          step_us={"float32": 400.0, "float16": 300.0, "bfloat16": 300.0,
                                   "int8": 200.0, "int4": 150.0})


def rows_starting(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


# ----------------------------------------------------------------------------- report

def test_report_has_time_and_ratio_columns_for_every_peer():
    text = report.format_markdown(attention_results())
    assert "onnxruntime 1.32.0" in text and "openvino 2026.4.1" in text
    prefill_header = rows_starting(text, "| T |")[0]
    for col in ("torch SDPA ms", "torch / mh", "ONNX Runtime GQA ms", "ORT / mh",
                "OpenVINO SDPA ms", "OpenVINO / mh", "oracle / mh", "% of SGEMM rate"):
        assert col in prefill_header
    # 3 ms manyheads; torch 4.5 ms, ORT 6 ms, OpenVINO 9 ms; 2*12*512²*64 flops in 3 ms
    # at 100 GFLOP/s is 134%
    assert rows_starting(text, "| 512 |") == [
        "| 512 | 64 | float32 | 3.00 | 4.50 | 1.50× | 6.00 | 2.00× | 9.00 | 3.00× | — | — "
        "| 134% |"]
    assert "| — | — | — | — |" in rows_starting(text, "| 1024 | 64 |")[0]
    assert "Not timed: ONNX Runtime GQA at T=1024 D=64 float64: float32 only here." in text
    assert ("Checked before timing, largest |peer − manyheads| over these rows: torch SDPA "
            "1.0e-07, ONNX Runtime GQA 2.0e-07.") in text
    assert "openblas 0.3.31, Zen kernels" in text
    assert "load average 0.25 at the start, 1.50 at the end, on 2 logical CPUs" in text
    # decode: 6291456 bytes in 100 us = 62.9 GB/s, 315% of the made-up 20 GB/s
    assert rows_starting(text, "| 1024 | 100 |") == [
        "| 1024 | 100 | 60 | 120 | 1.20× | 150 | 1.50× | 400 | 4.00× | 1.67× | "
        "62.9 GB/s (315%) |"]
    assert "| manyheads StackedMultiHeadAttention | 400.0 | 1.33× |" in text
    assert "PyTorch: same projections" not in text  # torch's module was not timed
    for line in text.splitlines():  # every table row has as many cells as its header
        if line.startswith("|"):
            assert line.count("|") in {prefill_header.count("|"),
                                       rows_starting(text, "| L |")[0].count("|"), 4}


def test_low_precision_table_has_a_row_per_cache_format_with_bytes_and_ratios():
    r = full_results()
    lines = report.format_markdown(r).splitlines()
    int8 = next(x for x in lines if x.startswith("| 1000 | int8 |"))
    # 1632 bytes/token = 0.266 of float32; 300/200 = 1.50x float16, 600/200 = 3.00x torch;
    # 1632 B * 1000 tokens / 200 us = 8.2 GB/s, 41% of the made-up 20 GB/s
    assert int8 == "| 1000 | int8 | 1632 | 0.266 | 200 | 1.50× | 3.00× | 8.2 GB/s (41%) |"
    assert sum(x.startswith("| 1000 |") for x in lines) == 5
    text = "\n".join(lines)
    assert "32 query heads on 8 kv heads" in text and "3.50×" in text
    assert "bfloat16 10.00 ms (2.00× float32)" in text and "no AVX512-BF16" in text


def test_cold_cache_steps_are_reported_and_judge_the_int4_claim():
    """The cold steps at the longest L get their own line (time and read rate), and
    int8's cold time over int4's is the int4 claim's ratio (measured at L=16384 only)."""
    r = full_results()
    assert "with the cache cold" not in report.format_markdown(r)
    assert {c.key: c for c in claims.evaluate(r)}["int4_cold"].met is None
    row = low_precision_row()
    row.L = 16384
    row.cold_step_us = {"float16": 4000.0, "int8": 3000.0, "int4": 2500.0}
    r.cache_formats = [low_precision_row(), row]
    text = report.format_markdown(r)
    # 1632 B * 16384 tokens / 3000 us = 8.9 GB/s
    assert "L=16384 with the cache cold" in text and "int8 3000 (8.9 GB/s)" in text
    got = {c.key: c for c in claims.evaluate(r)}["int4_cold"]
    assert got.ratio == pytest.approx(1.2) and got.met is False
    row.cold_step_us["int4"] = 2000.0
    assert {c.key: c for c in claims.evaluate(r)}["int4_cold"].met is True


def test_steps_of_layers_in_turn_are_reported_and_judge_their_own_int4_claim():
    """The deep-model steps (layers stepped in turn, each cache cold) get their own line,
    and int8's time over int4's there is a claim apart from the flushed one."""
    r = full_results()
    assert "in a stack of such layers" not in report.format_markdown(r)
    assert {c.key: c for c in claims.evaluate(r)}["int4_deep"].met is None
    row = low_precision_row()
    row.L = 16384
    row.cold_step_us = {"int8": 3000.0, "int4": 2500.0}
    row.deep_step_us = {"float16": 2600.0, "int8": 1800.0, "int4": 1500.0}
    r.cache_formats = [low_precision_row(), row]
    text = report.format_markdown(r)
    # 1632 B * 16384 tokens / 1800 us = 14.9 GB/s
    assert "L=16384 in a stack of such layers stepped in turn" in text
    assert "int8 1800 (14.9 GB/s)" in text
    got = {c.key: c for c in claims.evaluate(r)}
    assert got["int4_deep"].ratio == pytest.approx(1.2) and got["int4_deep"].met is False
    assert got["int4_cold"].ratio == pytest.approx(1.2)
    row.deep_step_us["int4"] = 1200.0
    got = {c.key: c for c in claims.evaluate(r)}
    assert got["int4_deep"].met is True and got["int4_cold"].met is False


def test_report_leaves_out_peers_that_are_not_installed():
    r = attention_results()
    r.peers = {"torch": "2.13.0+cpu", "onnxruntime": None, "openvino": None}
    text = report.format_markdown(r)
    assert "ONNX Runtime" not in text and "OpenVINO" not in text
    assert "onnxruntime, openvino not installed" in text


def test_inference_report_tables():
    text = report.format_markdown(inference_results(identical=False))
    lines = text.splitlines()
    assert "kernel path avx512" in text
    assert "load average 0.40 at the start, 1.90 at the end" in text
    assert "load average 0.50 when this section started, 1.25 when it ended" in text
    assert "SGEMM" not in text and "| T |" not in text  # the attention section did not run
    assert rows_starting(text, "| this process (torch imported and used) | 200 |") == [
        "| this process (torch imported and used) | 200 | 320 | 1.60× | 1.00× |"]
    assert ("| subprocess, OPENBLAS_NUM_THREADS=1 (torch imported and used) | 190 | 330 "
            "| 1.74× | 1.05× |") in lines
    assert "| subprocess, torch never imported | 195 | — | — | 1.03× |" in lines
    assert ("mean of two measurements, before and after the OPENBLAS_NUM_THREADS=1 "
            "subprocess: manyheads 190 (torch 300), 210 (torch 340) µs") in text
    assert ("| this process (torch imported and used) | 32.0 | 20.0 | 1.60× | 1.00× "
            "| DIFFER from HF's |") in lines
    assert ("| subprocess, torch never imported | 40.0 | — | — | 1.25× "
            "| identical to this process's |") in lines
    assert "manyheads 7.0 µs, torch 6.3 µs: torch / mh 0.90×" in text
    claim_rows = lines[lines.index("| claim | measured | |") + 2:]
    assert any("1.5× torch's layer" in x and "| 1.60× | met |" in x for x in claim_rows)
    assert any("1.3× Hugging Face" in x and "1.60×, tokens DIFFER | **not met** |" in x
               for x in claim_rows)
    assert any("16 keys) ≥ 1.5× torch" in x and "| 0.90× | **not met** |" in x
               for x in claim_rows)
    for line in lines:  # every table row has as many cells as its header
        if line.startswith("|"):
            assert line.count("|") in {4, 6, 7}, line


def test_inference_report_without_transformers_or_a_child():
    r = inference_results()
    inf = r.inference
    inf.generation = {}
    inf.generation_note = "torch and transformers are needed"
    del inf.layer_decode["openblas1"]
    inf.children["openblas1"] = ChildStatus(error="ImportError: boom")
    r.claims = claims.evaluate(r)
    text = report.format_markdown(r)
    assert "Not measured: torch and transformers are needed." in text
    assert "The openblas1 subprocess failed: ImportError: boom" in text
    assert "| — | not measured |" in text
    assert "OPENBLAS_NUM_THREADS=1 (torch" not in text  # no row for the failed child


def hf_results():
    r = inference_results()
    r.sections.append("hf")
    row = dict(baseline_attention_s=1.0, max_abs_diff=1e-6)
    r.hf_models = HFModelsResult(threads=2, transformers="5.24.0", rows=[
        HFModelRow(model="SmolLM2-135M", phase="prefill", tokens=2048, baseline="sdpa",
                   manyheads_s=1.0, baseline_s=9.0, manyheads_attention_s=0.1, **row),
        HFModelRow(model="SmolLM2-135M", phase="prefill", tokens=4096, baseline="sdpa",
                   manyheads_s=2.0, baseline_s=2.4, manyheads_attention_s=0.5, **row),
        HFModelRow(model="SmolLM2-135M", phase="decode", tokens=4096, baseline="sdpa",
                   manyheads_s=0.05, baseline_s=0.049, manyheads_attention_s=0.01, **row),
        HFModelRow(model="Gemma-2-2B, 4 of 26 layers", phase="prefill", tokens=4096,
                   baseline="eager", manyheads_s=8.0, baseline_s=10.0,
                   manyheads_attention_s=0.25, **row)])
    r.claims = claims.evaluate(r)
    return r


def test_hugging_face_claims_read_the_rows_at_4096_tokens():
    got = {c.key: c for c in hf_results().claims}
    assert got["smollm2_attention"].ratio == pytest.approx(2.0) and got["smollm2_attention"].met
    assert got["smollm2_model"].ratio == pytest.approx(1.2) and got["smollm2_model"].met
    assert got["smollm2_decode"].ratio == pytest.approx(0.98) and not got["smollm2_decode"].met
    assert got["gemma2_attention"].ratio == pytest.approx(4.0) and got["gemma2_attention"].met
    assert got["gemma2_model"].ratio == pytest.approx(1.25) and got["gemma2_model"].met


def test_hugging_face_report_rows_and_note():
    r = hf_results()
    text = report.format_markdown(r)
    table = rows_starting(text, "| SmolLM2-135M |") + rows_starting(text, "| Gemma-2-2B")
    assert len(table) == 4
    assert table[1].startswith("| SmolLM2-135M | prefill T=4096 | sdpa | 2.000 | 2.400 | "
                               "1.20× | 0.500 | 1.000 | 2.00× | 42% |")
    assert "decode step, context 4096" in table[2]
    again = report.format_markdown(from_json(to_json(r)))
    assert again == text
    r.hf_models = HFModelsResult(threads=2, note="needs torch and transformers")
    assert "Not measured: needs torch and transformers." in report.format_markdown(r)


def test_markdown_of_a_full_run_keeps_every_section():
    text = report.format_markdown(full_results())
    for part in ("| T |", "| implementation |", "| L |", "| L | cache |", "| process |",
                 "| claim |", "Grouped-query decode", "Half-precision prefill"):
        assert part in text


# ----------------------------------------------------------------------------- claims

SPEC = {c.key: c for c in claims.CLAIMS}


def test_the_claims_and_their_thresholds():
    assert [(c.key, c.threshold, c.ceiling) for c in claims.CLAIMS] == [
        ("layer_decode", 1.5, False), ("generation", 1.3, False),
        ("module_prefill", 1.2, False), ("tiny_sdpa", 1.5, False), ("int4_cold", 1.5, False),
        ("int4_deep", 1.5, False), ("openblas", 1.2, True),
        ("smollm2_attention", 1.4, False), ("smollm2_model", 1.1, False),
        ("smollm2_decode", 1.0, False), ("gemma2_attention", 3.0, False),
        ("gemma2_model", 1.25, False)]
    for c in claims.CLAIMS:
        assert f"{c.threshold:g}×" in c.text or "no slower" in c.text, c.text


@pytest.mark.parametrize("key, ratio, met", [
    ("layer_decode", 1.5, True), ("layer_decode", 1.4999, False),
    ("generation", 1.3, True), ("generation", 1.2999, False),
    ("module_prefill", 1.2, True), ("module_prefill", 1.1999, False),
    ("tiny_sdpa", 1.5, True), ("tiny_sdpa", 1.4999, False),
    # a ceiling: the default run's layer time over the OPENBLAS_NUM_THREADS=1 run's
    ("openblas", 1.2, True), ("openblas", 0.5, True), ("openblas", 1.2001, False),
    ("layer_decode", None, None), ("openblas", None, None),
])
def test_a_claim_is_met_at_its_threshold_and_missed_just_past_it(key, ratio, met):
    assert claims.judge(SPEC[key], ratio) is met


def test_generation_with_different_tokens_misses_however_fast():
    assert claims.judge(SPEC["generation"], 5.0, identical=False) is False
    assert claims.judge(SPEC["generation"], 5.0, identical=True) is True


def test_claims_are_the_measured_ratios_against_their_thresholds():
    got = {c.key: c for c in inference_results().claims}
    assert list(got) == [c.key for c in claims.CLAIMS]
    assert got["layer_decode"].ratio == pytest.approx(1.6) and got["layer_decode"].met
    assert got["generation"].ratio == pytest.approx(1.6) and got["generation"].met
    assert got["generation"].identical is True
    assert got["module_prefill"].ratio == pytest.approx(1.45) and got["module_prefill"].met
    assert got["tiny_sdpa"].ratio == pytest.approx(0.9) and got["tiny_sdpa"].met is False
    assert got["openblas"].ratio == pytest.approx(200 / 190) and got["openblas"].met
    assert all(got[k].met is None for k in got if k.startswith(("smollm2", "gemma2")))
    slow = {c.key: c for c in inference_results(ob1_us=150.0).claims}
    assert slow["openblas"].met is False
    wrong = {c.key: c for c in inference_results(identical=False).claims}
    assert wrong["generation"].ratio == pytest.approx(1.6) and wrong["generation"].met is False


def test_torch_claims_need_torch_in_the_process():
    r = inference_results()
    r.inference.layer_decode["main"].torch_in_process = False
    r.inference.tiny_sdpa.torch_us = None
    r.module.torch_ms = None
    got = {c.key: c for c in claims.evaluate(r)}
    for key in ("layer_decode", "module_prefill", "tiny_sdpa"):
        assert got[key].ratio is None and got[key].met is None


def test_claims_are_not_measured_without_the_inference_section():
    got = claims.evaluate(attention_results())
    assert all(c.ratio is None and c.met is None for c in got if c.key != "module_prefill")


def test_blocks_measured_apart_are_averaged():
    a = LayerStep(manyheads_us=100.0, torch_us=300.0, torch_in_process=True,
                  checks=Checks({"torch": 1e-7}))
    b = LayerStep(manyheads_us=140.0, torch_us=200.0, torch_in_process=True,
                  checks=Checks({"torch": 3e-7}, {"x": "note"}))
    row = inference.merge_blocks([a, b])
    assert row.manyheads_us == 120.0 and row.torch_us == 250.0
    assert row.checks.max_abs_diff["torch"] == 3e-7 and row.checks.notes == {"x": "note"}
    assert row.torch_in_process
    assert row.blocks == [TimedBlock(100.0, 300.0), TimedBlock(140.0, 200.0)]
    b.torch_us = None  # torch timed in one block only: no torch figure
    assert inference.merge_blocks([a, b]).torch_us is None


# ----------------------------------------------------------------------------- JSON

def test_json_round_trip_gives_back_equal_results_and_the_same_report():
    r = full_results()
    back = from_json(to_json(r))
    assert back == r
    assert isinstance(back.prefill[0], PrefillRow) and isinstance(back.prefill[0].checks, Checks)
    assert isinstance(back.inference.generation["main"], GenerationRun)
    assert report.format_markdown(back) == report.format_markdown(r)


def test_json_holds_the_dataclass_fields_and_plain_numbers():
    import json

    r = attention_results()
    r.prefill[0].manyheads_ms = np.float64(3.0)  # a NumPy scalar that slipped through
    data = json.loads(to_json(r))
    assert data["prefill"][0]["manyheads_ms"] == 3.0
    assert data["inference"] is None and data["claims"] == []
    assert set(data) == {f.name for f in dataclasses.fields(BenchResult)}


def test_write_puts_report_and_json_side_by_side(tmp_path):
    r = inference_results()
    written = report.write(r, str(tmp_path / "out"))
    assert set(written) == {"markdown", "json"}  # no plot without the attention section
    assert (tmp_path / "out" / "results.md").read_text() == report.format_markdown(r)
    assert from_json((tmp_path / "out" / "results.json").read_text()) == r


def test_with_the_attention_section_a_plot_is_written_too(tmp_path):
    pytest.importorskip("matplotlib")
    written = report.write(full_results(), str(tmp_path))
    assert Path(written["plot"]).name == "attention_time.png"
    assert Path(written["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- GPT-2 runner

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A small random GPT-2 saved as the inference section saves its model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=97,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return model, str(folder)


def test_the_benchs_gpt2_runner_makes_hugging_faces_tokens(tiny_checkpoint):
    torch = pytest.importorskip("torch")
    model, folder = tiny_checkpoint
    generate, loader = inference.gpt2_runner(folder)
    assert loader.startswith("manyheads.models")
    prompt = [5, 17, 42, 8, 3, 91, 60]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(prompt, 12) == [int(t) for t in ref[0, len(prompt):]]


def test_the_torch_free_subprocess_loads_the_model_without_torch(tiny_checkpoint):
    """What the inference section's no-torch subprocess does, minus the timing."""
    model, folder = tiny_checkpoint
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from benchmarks import inference, peers\n"
        "generate, _ = inference.gpt2_runner(sys.argv[1])\n"
        "print(generate([5, 17, 42], 6))\n"
        "assert not peers.torch_loaded() and peers.torch_module() is None\n"
    )
    res = subprocess.run([sys.executable, "-c", script, folder, str(REPO)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    generate, _ = inference.gpt2_runner(folder)
    assert res.stdout.strip() == str(generate([5, 17, 42], 6))
