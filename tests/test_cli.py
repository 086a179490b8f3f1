"""``python -m manyheads``: its help, and what the demo says it showed."""
import argparse
import subprocess
import sys

from manyheads.__main__ import build_parser


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
