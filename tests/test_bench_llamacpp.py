"""The llama.cpp comparison's helpers (benchmarks/bench_llamacpp.py in the source tree), and
that it steps aside where llama.cpp or its converter is missing.

Nothing here times anything, converts a model or needs llama.cpp.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_llamacpp.py"
if not SCRIPT.is_file():
    pytest.skip("needs the source tree's benchmarks/", allow_module_level=True)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import bench_llamacpp as bl  # noqa: E402


def test_agreement_counts_equal_positions_and_finds_the_first_difference():
    assert bl.agreement([1, 2, 3], [1, 2, 3]) == (3, None)
    assert bl.agreement([1, 2, 3, 4], [1, 9, 3, 8]) == (2, 1)
    assert bl.agreement([5, 6], [5, 6, 7]) == (2, 2)  # a shorter list parts where it ends


def test_decode_bound_is_bandwidth_over_bytes_per_token():
    assert bl.decode_bound(500e6, 10.0) == pytest.approx(20.0)
    assert bl.decode_bound(1e6, 1.0) == pytest.approx(1000.0)


def test_peak_rss_is_of_this_process_and_grows_with_what_it_touches():
    before = bl.peak_rss_mib()
    block = b"\x01" * (64 * 2**20)  # 64 MiB, every page written
    assert bl.peak_rss_mib() >= max(before, 64)
    del block


def test_without_a_converter_it_says_so_and_succeeds():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stdout and "--convert" in proc.stdout


def test_without_llama_cpp_it_says_so_and_succeeds(tmp_path):
    stand_in = tmp_path / "convert_hf_to_gguf.py"
    stand_in.write_text("raise SystemExit('never run')\n")
    # an interpreter that cannot import llama_cpp: this one with the module blocked
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['llama_cpp'] = None\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--convert", str(stand_in)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stdout and "llama_cpp" in proc.stdout


def test_read_rate_beside_a_run_brackets_it_and_is_a_rate():
    calls = []

    def run():
        calls.append(1)
        return 0.25

    seconds, before, after = bl.read_beside(run, 2)
    assert calls == [1] and seconds == 0.25
    assert 0.1 < before < 1e4 and 0.1 < after < 1e4  # GB/s of a real read
    buf = bl.np.ones(1 << 20, bl.np.float32)
    assert 0.1 < bl.read_rate(buf, 1, repeats=1) < 1e4


def test_fraction_of_the_rate_beside_is_the_median_over_rounds():
    # 1e9 bytes a token, 10 tokens in 1 s: 10 GB/s read, beside rates of mean 20, 10, 40
    rounds = [{"beside": (1.0, 15.0, 25.0)}, {"beside": (1.0, 10.0, 10.0)},
              {"beside": (2.0, 40.0, 40.0)}]
    # fractions 0.5, 1.0 and 0.125 (5 GB/s over 40): the median is 0.5
    assert bl.of_rate_beside(1e9, 10, rounds) == pytest.approx(0.5)
