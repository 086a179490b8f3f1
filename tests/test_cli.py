"""``python -m manyheads``: its help, and what the demo says it showed."""
import argparse
import subprocess
import sys

import pytest

import manyheads as mh
from manyheads.__main__ import _time, build_parser


def subcommands():
    action = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_of_every_command_has_help_text():
    for name, parser in subcommands().items():
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help and action.help.strip(), (name, action.option_strings)


def test_show_help_explains_text_and_dpi():
    help_text = " ".join(subcommands()["show"].format_help().split())
    assert "--text TEXT the text whose tokens are drawn" in help_text
    assert "--dpi DPI resolution of the PNG, dots per inch (default: 110)" in help_text


def test_every_command_is_listed_with_a_line_of_help():
    listed = " ".join(build_parser().format_help().split())
    for name in ("demo", "info", "bench", "show", "generate"):
        assert f" {name} " in listed
    assert "benchmarks/run.py" in listed


def test_the_demo_ends_by_saying_what_its_weights_show():
    res = subprocess.run([sys.executable, "-m", "manyheads"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    *_, weights, caveat = res.stdout.strip().splitlines()
    # 12 heads over the 498 byte tokens of the built-in text
    assert weights.startswith("attention weights (12 heads, 498x498): largest weight on a "
                              "later token 0 (the causal mask); each row sums to 1 within ")
    assert "random (seed 42)" in caveat and "python -m manyheads show" in caveat


def run_info(*args):
    return subprocess.run([sys.executable, "-m", "manyheads", "info", *args],
                          capture_output=True, text=True, timeout=600)


def test_info_explain_prints_the_plan_of_a_decode_step_through_an_int8_cache():
    res = run_info("--explain", "1x12x1x64", "1x12x16384x64", "--cache-dtype", "int8",
                   "--threads", "2")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "1 query row against 16384 keys" in out and "keys and values int8" in out
    assert ("12 (batch, head) pairs x 32 key ranges of 512, 8 in turn a work item = "
            "48 work items") in out
    assert "48 items of 1 row: few rows path" in out


def test_info_explain_shows_grouped_heads_and_prefill_blocks():
    res = run_info("--explain", "2x32x1x128", "2x8x4096x128", "--gqa")
    assert res.returncode == 0, res.stderr
    assert "each work item serves the 4 query heads that share its kv head" in res.stdout
    res = run_info("--explain", "1x12x2048x64", "1x12x2048x64", "--causal", "--threads", "2")
    assert "query blocks: 12 (batch, head) pairs x 32 blocks = 384 work items" in res.stdout
    assert "384 items of 64 rows: tile path" in res.stdout


def test_info_explain_reports_bad_shapes_in_one_line():
    res = run_info("--explain", "1x12", "1x2x3")
    assert res.returncode == 2 and res.stdout == ""
    assert "same last dimension" in res.stderr and "Traceback" not in res.stderr
    res = run_info("--explain", "1xtwelve", "1x2")
    assert res.returncode != 0 and "sizes joined by 'x'" in res.stderr


def test_the_demo_times_calls_after_the_blas_threads_have_settled():
    """The demo's timings start after calls for a settling time (at most ten of them): a
    BLAS library's threads spin for about 0.1 s after it loads and had doubled the first
    calls' time.  The result is the first call's."""
    calls = []

    def fn():
        calls.append(1)
        return len(calls)

    seconds, first = _time(fn, repeats=5, settle=0.0)
    assert first == 1 and len(calls) == 1 + 5 and seconds >= 0
    calls.clear()
    _time(fn, repeats=5, settle=3600.0)  # never settles: ten calls before the five
    assert len(calls) == 10 + 5


@pytest.mark.parametrize("args, message", [
    (["--dpi", "0"], "--dpi must be a positive number"),
    (["--out", "no-such-folder/x.png"], "there is no folder"),
    (["--weights", "no-such-module.npz"], "no-such-module"),
])
def test_show_errors_are_one_line(tmp_path, args, message):
    res = subprocess.run([sys.executable, "-m", "manyheads", "show", *args],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


def test_version():
    res = subprocess.run([sys.executable, "-m", "manyheads", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == f"manyheads {mh.__version__}\n"


def test_info_refuses_the_flags_of_explain_without_it():
    res = subprocess.run([sys.executable, "-m", "manyheads", "info", "--threads", "1",
                          "--causal"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert "--causal, --threads describe the call of --explain QUERY KEY" in res.stderr
