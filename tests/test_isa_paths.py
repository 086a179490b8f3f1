"""Every kernel path this CPU can run passes the oracle tests; forcing paths is safe."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import manyheads as mh
from manyheads import _config

HERE = Path(__file__).parent
RUNNABLE = _config.runnable_isas()
# the path a run takes unforced: the rest of the suite has run the oracle tests on it
DEFAULT = None if os.environ.get("MANYHEADS_ISA") else mh.kernel_isa()


def run_python(code, isa):
    env = dict(os.environ, MANYHEADS_ISA=isa)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("isa", [isa for isa in RUNNABLE if isa != DEFAULT])
def test_forced_path_passes_the_oracle_tests(isa):
    """The oracle tests' files on each path this CPU can run but the run's own (which
    the suite itself tests; test_show_config_names_the_forced_path forces every one)."""
    env = dict(os.environ, MANYHEADS_ISA=isa)
    files = [str(HERE / f) for f in ("test_functional.py", "test_modules.py",
                                     "test_block_boundaries.py", "test_cache.py",
                                     "test_cache_formats.py", "test_poisoned_keys.py",
                                     "test_plan.py", "test_score_features.py",
                                     "test_linear.py")]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                         env=env, capture_output=True, text=True, timeout=1200, cwd=HERE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout


@pytest.mark.parametrize("isa", RUNNABLE)
def test_show_config_names_the_forced_path(isa):
    res = run_python("import manyheads as mh; mh.show_config(); print(mh.kernel_isa())", isa)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == isa
    assert f"kernel path      : {isa} (forced by MANYHEADS_ISA)" in res.stdout


def test_unknown_or_unsupported_path_is_a_clear_error():
    res = run_python("import manyheads", "sse9")
    assert res.returncode != 0 and "MANYHEADS_ISA='sse9'" in res.stderr
    assert "Segmentation" not in res.stderr
    for isa in _config.isa_names():
        if isa not in RUNNABLE:
            res = run_python("import manyheads", isa)
            assert res.returncode != 0 and ("does not support" in res.stderr or "has no" in res.stderr)


def test_default_path_is_the_best_runnable_one():
    best = next(n for n in ("avx512bf16", "avx512", "avx2", "baseline") if n in RUNNABLE)
    assert _config.isa_names() == ("avx512bf16", "avx512", "avx2", "baseline")
    if not os.environ.get("MANYHEADS_ISA"):
        assert mh.kernel_isa() == best
