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


def test_report_leaves_out_peers_that_are_not_installed():
    r = made_up_results()
    r["peers"] = {"torch": "2.13.0+cpu", "onnxruntime": None, "openvino": None}
    text = _bench.format_markdown(r)
    assert "ONNX Runtime" not in text and "OpenVINO" not in text
    assert "onnxruntime, openvino not installed" in text
