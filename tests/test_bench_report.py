"""The benchmark's bookkeeping: peers, checks, tables and where results go.

Nothing here times anything or needs a peer installed: the report is built
from made-up results, and the check is fed arrays directly.
"""
from pathlib import Path

import numpy as np
import pytest

from manyheads import _bench, _peers
from manyheads.__main__ import main

REPO = Path(__file__).resolve().parent.parent


def test_bench_help_lists_every_peer(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for name in ("torch", "onnxruntime", "openvino", "GroupQueryAttention",
                 "ScaledDotProductAttention", "manyheads[bench]"):
        assert name in text


def test_unknown_peer_is_refused_before_anything_runs(capsys):
    assert main(["bench", "--peers", "torch,tensorflow"]) == 2
    assert "tensorflow" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensorflow"):
        _bench.run(peers=["tensorflow"])


def test_default_results_folder_is_outside_the_source_tree(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    folder = Path(_bench.default_out_dir()).resolve()
    assert REPO not in folder.parents and folder != REPO
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "cache"))
    if not _bench.sys.platform == "darwin":
        assert Path(_bench.default_out_dir()) == tmp_path / "cache" / "manyheads" / "bench"


def test_missing_peer_gives_a_one_line_note(monkeypatch):
    def refuse(name):
        raise ImportError(name)

    monkeypatch.setattr(_peers, "_module", refuse)
    for name in _peers.PEERS:
        assert _peers.version(name) is None
        note = _peers.missing_note(name)
        assert "\n" not in note and "manyheads[bench]" in note and "skipped" in note


def test_check_accepts_a_matching_peer_and_refuses_a_wrong_one():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 2, 8, 4))
    diffs, notes = {}, {}
    assert _bench._check("onnxruntime", ref.astype(np.float32), ref, "float32", diffs, notes)
    assert diffs["onnxruntime"] < 1e-6 and not notes
    wrong_layout = ref.transpose(0, 2, 1, 3).reshape(ref.shape)  # heads and rows mixed up
    assert not _bench._check("openvino", wrong_layout, ref, "float32", diffs, notes)
    assert "not timed" in notes["openvino"]
    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    assert not _bench._check("torch", nan, ref, "float32", diffs, notes)


def test_a_peer_that_fails_to_build_is_reported_not_fatal():
    def broken():
        raise RuntimeError("no such op\nsecond line")

    fns, diffs, notes, paths = {}, {}, {}, {}
    _bench._add_peer("onnxruntime", broken, np.zeros(3), "float32", fns, diffs, notes, paths)
    assert not fns and notes["onnxruntime"] == "failed: RuntimeError: no such op"
    _bench._add_peer("openvino", broken, np.zeros(3), "float64", fns, diffs, notes, paths)
    assert notes["openvino"] == "float32 only here"


def made_up_results():
    kernel = []
    for T, dtype, ort, ov in ((512, "float32", 6.0, 9.0), (1024, "float64", None, None)):
        kernel.append(dict(
            T=T, D=64, dtype=dtype, threads=2, manyheads_ms=3.0, torch_ms=4.5, oracle_ms=None,
            flops=2.0 * 12 * T * T * 64, peers_ms={"onnxruntime": ort, "openvino": ov},
            max_abs_diff={"torch": 1e-7, "onnxruntime": 2e-7} if ov else {"torch": 1e-15},
            notes={} if ov else {"onnxruntime": "float32 only here",
                                 "openvino": "float32 only here"},
            paths={}, extra={"sgemm_gflops": 100.0}))
    decode = [{"L": 1024, "bytes_f32": 6291456, "float32_us": 100.0, "float16_us": 60.0,
               "torch_us": 120.0, "onnxruntime_us": 150.0, "openvino_us": 400.0,
               "max_abs_diff": {"onnxruntime": 3e-7, "openvino": 2e-7}, "notes": {},
               "paths": {}}]
    return {
        "config": {"version": "0.1.0", "kernel_isa": "avx2"}, "threads": 2, "cpu_count": 2,
        "load_average": {"start": 0.25, "end": 1.5},
        "torch": "2.13.0+cpu",
        "peers": {"torch": "2.13.0+cpu", "onnxruntime": "1.32.0", "openvino": "2026.4.1"},
        "sgemm_gflops": 100.0, "kernel": kernel,
        "numpy_blas": {"internal_api": "openblas", "version": "0.3.31", "architecture": "Zen"},
        "module": {"fused": 300.0, "stacked": 400.0, "oracle": 900.0},
        "bandwidth_gbs": {"max": 20.0, "sum": 10.0}, "decode": decode,
    }


def test_report_has_time_and_ratio_columns_for_every_peer():
    text = _bench.format_markdown(made_up_results())
    assert "onnxruntime 1.32.0" in text and "openvino 2026.4.1" in text
    prefill_header = next(line for line in text.splitlines() if line.startswith("| T |"))
    for col in ("torch SDPA ms", "torch / mh", "ONNX Runtime GQA ms", "ORT / mh",
                "OpenVINO SDPA ms", "OpenVINO / mh", "oracle / mh"):
        assert col in prefill_header
    row = next(line for line in text.splitlines() if line.startswith("| 512 |"))
    assert "| 6.00 | 2.00× | 9.00 | 3.00× |" in row
    row64 = next(line for line in text.splitlines() if line.startswith("| 1024 | 64 |"))
    assert "| — | — | — | — |" in row64
    assert "Not timed: ONNX Runtime GQA at T=1024 D=64 float64: float32 only here." in text
    assert "largest |peer − manyheads|" in text
    assert "openblas 0.3.31, Zen kernels" in text
    assert "load average 0.25 at the start, 1.50 at the end, on 2 logical CPUs" in text
    decode_row = next(line for line in text.splitlines() if line.startswith("| 1024 | 100 |"))
    assert "| 150 | 1.50× | 400 | 4.00× |" in decode_row
    for line in text.splitlines():  # every table row has as many cells as its header
        if line.startswith("|"):
            assert line.count("|") in {prefill_header.count("|"),
                                       next(x for x in text.splitlines()
                                            if x.startswith("| L |")).count("|"),
                                       4}


def test_low_precision_table_has_a_row_per_cache_format_with_bytes_and_ratios():
    r = made_up_results()
    bpt = {"float32": 6144.0, "float16": 3072.0, "bfloat16": 3072.0, "int8": 1632.0,
           "int4": 960.0}
    row = {"L": 1000, "bytes_per_token": bpt, "skipped": [], "torch_sdpa_f32_us": 600.0,
           "float32_us": 400.0, "float16_us": 300.0, "bfloat16_us": 300.0, "int8_us": 200.0,
           "int4_us": 150.0}
    r["cache_formats"] = [row]
    r["gqa"] = {"L": 16384, "heads": 32, "kv_heads": 8, "max_abs_diff": 0.0,
                "grouped_us": 1000.0, "repeated_us": 3500.0}
    r["half_prefill"] = {"T": 2048, "float32_ms": 20.0, "float16_ms": 25.0,
                         "bfloat16_ms": 10.0, "avx512_bf16": False}
    lines = _bench.format_markdown(r).splitlines()
    int8 = next(x for x in lines if x.startswith("| 1000 | int8 |"))
    # 1632 bytes/token = 0.266 of float32; 300/200 = 1.50x float16, 600/200 = 3.00x torch;
    # 1632 B * 1000 tokens / 200 us = 8.2 GB/s, 41% of the made-up 20 GB/s
    assert int8 == "| 1000 | int8 | 1632 | 0.266 | 200 | 1.50× | 3.00× | 8.2 GB/s (41%) |"
    assert sum(x.startswith("| 1000 |") for x in lines) == 5
    text = "\n".join(lines)
    assert "32 query heads on 8 kv heads" in text and "3.50×" in text
    assert "bfloat16 10.00 ms (2.00× float32)" in text and "no AVX512-BF16" in text


def test_report_leaves_out_peers_that_are_not_installed():
    r = made_up_results()
    r["peers"] = {"torch": "2.13.0+cpu", "onnxruntime": None, "openvino": None}
    text = _bench.format_markdown(r)
    assert "ONNX Runtime" not in text and "OpenVINO" not in text
    assert "onnxruntime, openvino not installed" in text


# ----------------------------------------------------------------------------- inference section

def made_up_inference(identical=True, ob1_us=190.0, hf_s=1.6):
    """Results of an inference section as run() records them (nothing measured)."""
    def layer(mh_us, torch_us, torch_in):
        row = {"manyheads_us": mh_us, "max_abs_diff": {}, "notes": {},
               "torch_in_process": torch_in}
        if torch_us is not None:
            row["torch_us"] = torch_us
            row["max_abs_diff"]["torch"] = 1.2e-7
        return row

    toks = list(range(32))
    return {
        "threads": 2, "generation_rounds": 5, "load_average": {"start": 0.5, "end": 1.25},
        "layer_shape": dict(_bench.LAYER_SHAPE), "gpt2_shape": dict(_bench.GPT2_SHAPE),
        "tiny_shape": dict(_bench.TINY_SHAPE),
        "tiny_sdpa": {"manyheads_us": 7.0, "torch_us": 6.3, "max_abs_diff": {}, "notes": {}},
        "layer_decode": {"main": dict(layer(200.0, 320.0, True),
                                      blocks=[{"manyheads_us": 190.0, "torch_us": 300.0},
                                              {"manyheads_us": 210.0, "torch_us": 340.0}]),
                         "openblas1": layer(ob1_us, 330.0, True),
                         "no_torch": layer(195.0, None, False)},
        "generation": {
            "transformers": "5.0",
            "main": {"loader": "manyheads.models.gpt2.GPT2", "torch_in_process": True,
                     "manyheads_s": 1.0, "manyheads_tokens_per_s": 32.0, "hf_s": hf_s,
                     "hf_tokens_per_s": 32 / hf_s, "identical": identical,
                     "tokens": {"manyheads": toks,
                                "hf": toks if identical else toks[:-1] + [99]}},
            "no_torch": {"loader": "manyheads.models.gpt2.GPT2", "torch_in_process": False,
                         "manyheads_s": 0.8, "manyheads_tokens_per_s": 40.0,
                         "tokens": {"manyheads": toks}},
        },
        "children": {"no-torch": {"error": None, "torch_in_process": False},
                     "openblas1": {"error": None, "torch_in_process": True,
                                   "env": {"OPENBLAS_NUM_THREADS": "1"}}},
    }


def inference_only_results(**kw):
    r = {"config": {"version": "0.1.0", "kernel_isa": "avx512"}, "threads": 2, "cpu_count": 2,
         "load_average": {"start": 0.4, "end": 1.9}, "torch": "2.13.0+cpu",
         "peers": {"torch": "2.13.0+cpu", "onnxruntime": None, "openvino": None},
         "sections": ["module", "inference"],
         "module": {"fused": 200.0, "stacked": 240.0, "torch": 290.0, "oracle": 700.0},
         "inference": made_up_inference(**kw)}
    r["bars"] = _bench.bars(r)
    return r


def test_sections_parse_and_inference_brings_the_module_along():
    assert _bench.parse_sections(None) == _bench.SECTIONS
    assert _bench.parse_sections("all") == _bench.SECTIONS
    assert _bench.parse_sections("inference") == ("module", "inference")
    assert _bench.parse_sections(["attention"]) == ("attention",)
    assert _bench.parse_sections(" inference , attention ") == _bench.SECTIONS
    with pytest.raises(ValueError, match="decoding"):
        _bench.parse_sections("attention,decoding")


def test_unknown_section_is_refused_before_anything_runs(capsys):
    assert main(["bench", "--section", "decoding"]) == 2
    assert "decoding" in capsys.readouterr().err
    with pytest.raises(ValueError, match="decoding"):
        _bench.run(sections="decoding")


def test_bench_help_describes_the_inference_section(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--section", "inference", "KV cache of 1024 tokens", "200-token prompt",
                  "32 greedy tokens", "generate(do_sample=False)", "never imports torch",
                  "OPENBLAS_NUM_THREADS=1", "12 heads x 1 query x 16 keys", ">= 1.5x torch",
                  ">= 1.3x Hugging Face's", ">= 1.2x torch", "within 1.2x"):
        assert words in text, words


def test_bars_are_the_measured_ratios_against_their_thresholds():
    r = inference_only_results()
    got = {b["key"]: b for b in r["bars"]}
    assert set(got) == set(_bench.BARS)
    assert got["layer_decode"]["ratio"] == pytest.approx(1.6) and got["layer_decode"]["met"]
    assert got["generation"]["ratio"] == pytest.approx(1.6) and got["generation"]["met"]
    assert got["module_prefill"]["ratio"] == pytest.approx(1.45) and got["module_prefill"]["met"]
    assert got["tiny_sdpa"]["ratio"] == pytest.approx(0.9) and got["tiny_sdpa"]["met"] is False
    # a ceiling: this process's layer time over the OPENBLAS_NUM_THREADS=1 run's
    assert got["openblas"]["ratio"] == pytest.approx(200 / 190) and got["openblas"]["met"]
    slow = {b["key"]: b for b in inference_only_results(ob1_us=150.0)["bars"]}
    assert slow["openblas"]["met"] is False
    # fast enough but different tokens: not met
    wrong = {b["key"]: b for b in inference_only_results(identical=False)["bars"]}
    assert wrong["generation"]["ratio"] == pytest.approx(1.6)
    assert wrong["generation"]["met"] is False


def test_layer_bar_needs_torch_in_the_process():
    r = inference_only_results()
    r["inference"]["layer_decode"]["main"]["torch_in_process"] = False
    r["inference"]["tiny_sdpa"].pop("torch_us")
    del r["module"]["torch"]
    got = {b["key"]: b for b in _bench.bars(r)}
    for key in ("layer_decode", "module_prefill", "tiny_sdpa"):
        assert got[key]["ratio"] is None and got[key]["met"] is None


def test_inference_report_tables():
    text = _bench.format_markdown(inference_only_results(identical=False))
    lines = text.splitlines()
    assert "kernel path avx512" in text
    assert "load average 0.40 at the start, 1.90 at the end" in text
    assert "load average 0.50 when this section started, 1.25 when it ended" in text
    assert "SGEMM" not in text and "| T |" not in text  # the attention section did not run
    layer_rows = [x for x in lines if x.startswith("| this process (torch imported and used) | 200 |")
                  or x.startswith("| subprocess")]
    assert "| 200 | 320 | 1.60× | 1.00× |" in layer_rows[0]
    assert any("OPENBLAS_NUM_THREADS=1 (torch imported and used) | 190 | 330 | 1.74× | 1.05× |"
               in x for x in layer_rows)
    assert any("torch never imported | 195 | — | — | 1.03× |" in x for x in layer_rows)
    assert ("mean of two measurements, before and after the OPENBLAS_NUM_THREADS=1 "
            "subprocess: manyheads 190 (torch 300), 210 (torch 340) µs") in text
    gen_main = next(x for x in lines if x.startswith("| this process") and "32.0" in x)
    assert "| 32.0 | 20.0 | 1.60× | 1.00× | DIFFER from HF's |" in gen_main
    gen_child = next(x for x in lines if "torch never imported | 40.0" in x)
    assert "| 40.0 | — | — | 1.25× | identical to this process's |" in gen_child
    assert "manyheads 7.0 µs, torch 6.3 µs: torch / mh 0.90×" in text
    bar_rows = lines[lines.index("| bar | measured | |") + 2:]
    assert any("1.5× torch's layer" in x and "| 1.60× | met |" in x for x in bar_rows)
    assert any("1.3× Hugging Face" in x and "1.60×, tokens DIFFER | **not met** |" in x
               for x in bar_rows)
    assert any("no slower than torch" in x and "| 0.90× | **not met** |" in x for x in bar_rows)
    for line in lines:  # every table row has as many cells as its header
        if line.startswith("|"):
            assert line.count("|") in {4, 6, 7}, line


def test_inference_report_without_transformers_or_a_child():
    r = inference_only_results()
    inf = r["inference"]
    inf["generation"] = {"note": "torch and transformers are needed", "no_torch": None}
    inf["layer_decode"]["openblas1"] = None
    inf["children"]["openblas1"] = {"error": "ImportError: boom"}
    r["bars"] = _bench.bars(r)
    text = _bench.format_markdown(r)
    assert "Not measured: torch and transformers are needed." in text
    assert "The openblas1 subprocess failed: ImportError: boom" in text
    assert "| — | not measured |" in text


def test_blocks_measured_apart_are_averaged():
    a = {"manyheads_us": 100.0, "torch_us": 300.0, "max_abs_diff": {"torch": 1e-7},
         "notes": {}, "torch_in_process": True}
    b = {"manyheads_us": 140.0, "torch_us": 200.0, "max_abs_diff": {"torch": 3e-7},
         "notes": {}, "torch_in_process": True}
    row = _bench._merge_blocks([a, b])
    assert row["manyheads_us"] == 120.0 and row["torch_us"] == 250.0
    assert row["max_abs_diff"]["torch"] == 3e-7 and row["torch_in_process"]
    assert row["blocks"] == [{"manyheads_us": 100.0, "torch_us": 300.0},
                             {"manyheads_us": 140.0, "torch_us": 200.0}]


def test_markdown_of_a_full_run_keeps_every_section():
    r = made_up_results()
    r.update(inference_only_results())
    text = _bench.format_markdown(r)
    for part in ("| T |", "| implementation |", "| L |", "| process |", "| bar |"):
        assert part in text


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
    generate, loader = _bench.gpt2_runner(folder)
    assert loader.startswith("manyheads.models")
    prompt = [5, 17, 42, 8, 3, 91, 60]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(prompt, 12) == [int(t) for t in ref[0, len(prompt):]]


def test_the_torch_free_subprocess_loads_the_model_without_torch(tiny_checkpoint):
    """What the inference section's no-torch subprocess does, minus the timing."""
    import subprocess
    import sys

    model, folder = tiny_checkpoint
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from manyheads import _bench\n"
        "generate, _ = _bench.gpt2_runner(sys.argv[1])\n"
        "print(generate([5, 17, 42], 6))\n"
        "assert not _bench._torch_loaded() and _bench._torch() is None\n"
    )
    res = subprocess.run([sys.executable, "-c", script, folder], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    generate, _ = _bench.gpt2_runner(folder)
    assert res.stdout.strip() == str(generate([5, 17, 42], 6))
