"""Attention pictures and head-role scores."""
import os
import subprocess
import sys

import numpy as np
import pytest

import manyheads as mh
from manyheads.plot import format_roles, head_roles


def causal_rows(T, cols_for_row):
    w = np.zeros((T, T))
    for i in range(T):
        cols = cols_for_row(i)
        w[i, cols] = 1.0 / len(cols)
    return w


def test_head_roles_score_hand_built_heads_against_truth():
    tokens = list("abcdxabcdx")  # repeats: induction is measurable
    T = len(tokens)
    prev = causal_rows(T, lambda i: [max(i - 1, 0)])
    first = causal_rows(T, lambda i: [0])
    uniform = causal_rows(T, lambda i: list(range(i + 1)))

    def induction_cols(i):
        j = tokens.index(tokens[i])
        return [j + 1] if j + 1 < i else [i]

    induction = causal_rows(T, induction_cols)
    roles = head_roles(np.stack([prev, first, induction, uniform]), tokens)
    # at query 1 the previous token is the first token, so each head scores 1/9 on the other
    np.testing.assert_allclose(roles["previous_token"][:2], [1.0, 1 / 9])
    np.testing.assert_allclose(roles["first_token"][:2], [1 / 9, 1.0])
    assert roles["induction"][2] == 1.0
    assert roles["induction"][0] < 0.2 and roles["induction"][1] < 0.2
    assert all(roles[r][3] < 0.4 for r in roles)
    table = format_roles(roles)
    assert "previous-token" in table.splitlines()[2] and "induction" in table.splitlines()[4]


def test_head_roles_without_repeats_leave_induction_unmeasured():
    w = np.tril(np.ones((5, 5)))
    w /= w.sum(1, keepdims=True)
    assert np.isnan(head_roles(w[None], list("abcde"))["induction"][0])
    with pytest.raises(ValueError, match="tokens"):
        head_roles(w[None], list("abc"))


def test_demo_layer_heads_have_the_roles_they_were_given():
    from manyheads.__main__ import show_input, show_layer

    x, tokens = show_input("the cat sat on the mat. the cat sat on the mat.")
    _, w = show_layer()(x, return_weights=True)
    roles = head_roles(w, tokens)
    assert roles["previous_token"][0] > 0.9
    assert roles["first_token"][1] > 0.9
    assert roles["induction"][2] > 0.4 and roles["induction"][2] > 5 * roles["induction"][3:].max()


def test_plot_attention_draws_one_panel_per_head_with_masked_future():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    m = mh.MultiHeadAttention(16, 48, 32, 0.0, 12, seed=0)
    x = np.random.default_rng(0).standard_normal((20, 16)).astype(np.float32)
    _, w = m(x, return_weights=True)
    tokens = list("abcdefghijklmnopqrst")
    fig = mh.plot_attention(w, tokens)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 12
    img = panels[0].images[0].get_array()
    assert img.mask[0, 1] and not img.mask[1, 0]           # future blank, past drawn
    assert [t.get_text() for t in panels[0].get_xticklabels()][:3] == ["a", "b", "c"]
    fig2 = mh.plot_attention(w, heads=[0, 5])
    assert len([ax for ax in fig2.axes if ax.images]) == 2
    with pytest.raises(ValueError, match="head 12"):
        mh.plot_attention(w, heads=[12])
    with pytest.raises(ValueError, match="tokens"):
        mh.plot_attention(w, tokens[:5])


def test_show_command_writes_a_png_and_prints_roles(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    res = subprocess.run([sys.executable, "-m", "manyheads", "show", "--text", "abcabcabc",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "previous-token" in res.stdout
    saved = tmp_path / "layer.npz"
    mh.MultiHeadAttention(32, 32, 64, 0.0, 4, seed=0).save(saved)
    res = subprocess.run([sys.executable, "-m", "manyheads", "show", "--weights", str(saved),
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_show_without_matplotlib_says_how_to_install(tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    res = subprocess.run([sys.executable, "-m", "manyheads", "show", "--out",
                          str(tmp_path / "p.png")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 2
    assert "pip install 'manyheads[plot]'" in res.stderr
