"""Attention pictures and head-role scores."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import manyheads as mh
from manyheads.plot import ROLE_THRESHOLD, SCALES, classify_heads, format_roles, head_roles


@pytest.fixture
def mpl():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield matplotlib
    plt.close("all")


def causal_rows(T, cols_for_row):
    w = np.zeros((T, T))
    for i in range(T):
        cols = cols_for_row(i)
        w[i, cols] = 1.0 / len(cols)
    return w


def uniform_causal(T):
    return causal_rows(T, lambda i: list(range(i + 1)))


def random_head_weights(T=200, heads=4, seed=0):
    """A seeded random layer's weights over T random tokens: (heads, T, T)."""
    layer = mh.MultiHeadAttention(64, 64, 256, 0.0, heads, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((T, 64)).astype(np.float32)
    return layer(x, return_weights=True)[1]


def panels(fig):
    return [ax for ax in fig.axes if ax.images]


def mean_displayed_intensity(ax):
    """Mean colour position in [0, 1] over the drawn (not masked) cells of a panel."""
    image = ax.images[0]
    return float(np.ma.mean(image.norm(image.get_array())))


# ----------------------------------------------------------------------------- roles

def test_head_roles_score_hand_built_heads_against_truth():
    tokens = list("abcdxabcdx")  # repeats: induction is measurable
    T = len(tokens)
    prev = causal_rows(T, lambda i: [max(i - 1, 0)])
    first = causal_rows(T, lambda i: [0])

    def induction_cols(i):
        j = tokens.index(tokens[i])
        return [j + 1] if j + 1 < i else [i]

    induction = causal_rows(T, induction_cols)
    roles = head_roles(np.stack([prev, first, induction, uniform_causal(T)]), tokens)
    # at query 1 the previous token is the first token, so each head scores 1/9 on the other
    np.testing.assert_allclose(roles["previous_token"][:2], [1.0, 1 / 9])
    np.testing.assert_allclose(roles["first_token"][:2], [1 / 9, 1.0])
    assert roles["induction"][2] == 1.0
    assert roles["induction"][0] < 0.2 and roles["induction"][1] < 0.2
    assert all(roles[r][3] < 0.4 for r in ("previous_token", "first_token", "induction"))
    assert list(roles["role"]) == ["previous-token", "first-token", "induction", "mixed"]
    rows = format_roles(roles).splitlines()[2:]
    assert [row.split()[-1] for row in rows] == ["previous-token", "first-token", "induction",
                                                 "mixed"]


def test_head_roles_without_repeats_leave_induction_unmeasured():
    w = uniform_causal(5)
    assert np.isnan(head_roles(w[None], list("abcde"))["induction"][0])
    with pytest.raises(ValueError, match="tokens"):
        head_roles(w[None], list("abc"))


def test_a_role_is_named_only_when_its_score_clears_the_threshold():
    def scores(prev, first, induction=np.nan):
        return {"previous_token": np.array([prev]), "first_token": np.array([first]),
                "induction": np.array([induction])}

    assert ROLE_THRESHOLD == 0.4
    assert classify_heads(scores(0.40, 0.10)) == ["previous-token"]     # reaching it counts
    assert classify_heads(scores(0.39, 0.10)) == ["mixed"]              # just below does not
    assert classify_heads(scores(0.07, 0.02, 0.01)) == ["mixed"]        # the old "strongest"
    assert classify_heads(scores(0.10, 0.05, 0.45)) == ["induction"]
    assert classify_heads(scores(0.50, 0.45)) == ["mixed"]              # two roles at once
    assert classify_heads(scores(0.10, 0.39), threshold=0.3) == ["first-token"]
    with pytest.raises(ValueError, match="threshold"):
        classify_heads(scores(0.5, 0.1), threshold=0.0)


def test_format_roles_states_the_threshold_and_calls_weak_heads_mixed():
    roles = {"previous_token": np.array([0.07, 0.9]), "first_token": np.array([0.05, 0.01]),
             "induction": np.array([np.nan, np.nan])}
    table = format_roles(roles)
    header, _, weak, strong = table.splitlines()
    assert "0.4" in header
    assert weak.split()[-1] == "mixed" and strong.split()[-1] == "previous-token"
    assert format_roles(roles, threshold=0.95).splitlines()[3].split()[-1] == "mixed"


@pytest.mark.parametrize("T", [2, 3, 4, 10, 47, 200])
def test_a_head_that_spreads_its_weight_evenly_is_mixed_at_any_length(T):
    tokens = list("ab" * T)[:T]  # repeats, so induction is measured too
    assert head_roles(uniform_causal(T)[None], tokens)["role"][0] == "mixed"


def test_demo_layer_heads_have_the_roles_they_were_given():
    from manyheads.__main__ import show_input, show_layer

    x, tokens = show_input("the cat sat on the mat. the cat sat on the mat.")
    _, w = show_layer()(x, return_weights=True)
    roles = head_roles(w, tokens)
    assert roles["previous_token"][0] > 0.9
    assert roles["first_token"][1] > 0.9
    assert roles["induction"][2] > 0.4 and roles["induction"][2] > 5 * roles["induction"][3:].max()
    # the hand-set heads are named; the random ones (all scores below 0.12) are mixed
    assert list(roles["role"][:3]) == ["previous-token", "first-token", "induction"]
    assert set(roles["role"][3:]) == {"mixed"}


@pytest.mark.parametrize("T", [0, 1])
def test_head_roles_refuse_fewer_than_two_positions(T):
    with pytest.raises(ValueError, match="at least two positions"):
        head_roles(np.ones((3, T, T)), ["a"] * T)


# ----------------------------------------------------------------------------- pictures

def test_plot_attention_draws_one_panel_per_head_with_masked_future(mpl):
    m = mh.MultiHeadAttention(16, 48, 32, 0.0, 12, seed=0)
    x = np.random.default_rng(0).standard_normal((20, 16)).astype(np.float32)
    _, w = m(x, return_weights=True)
    tokens = list("abcdefghijklmnopqrst")
    fig = mh.plot_attention(w, tokens)
    assert len(panels(fig)) == 12
    img = panels(fig)[0].images[0].get_array()
    assert img.mask[0, 1] and not img.mask[1, 0]           # future blank, past drawn
    assert [t.get_text() for t in panels(fig)[0].get_xticklabels()][:3] == ["a", "b", "c"]
    fig2 = mh.plot_attention(w, heads=[0, 5])
    assert len(panels(fig2)) == 2
    with pytest.raises(ValueError, match="head 12"):
        mh.plot_attention(w, heads=[12])
    with pytest.raises(ValueError, match="tokens"):
        mh.plot_attention(w, tokens[:5])


@pytest.mark.parametrize("scale", SCALES)
def test_every_panel_has_a_colourbar_and_the_title_names_the_scale(mpl, scale):
    w = random_head_weights(T=30)
    fig = mh.plot_attention(w, scale=scale, title="four heads")
    assert len(panels(fig)) == 4
    for ax in panels(fig):
        bar = ax.images[0].colorbar
        assert bar is not None and bar.ax in fig.axes
        assert "weight" in bar.ax.get_ylabel()
    title = fig.get_suptitle()
    assert title.startswith("four heads") and f"scale='{scale}'" in title
    assert "masked future" in title
    no_bars = mh.plot_attention(w, scale=scale, colorbar=False)
    assert all(ax.images[0].colorbar is None for ax in panels(no_bars))


def test_default_scale_keeps_a_random_T200_head_visible(mpl):
    w = random_head_weights(T=200)
    old = mean_displayed_intensity(panels(mh.plot_attention(w, heads=[0], scale="linear"))[0])
    new = mean_displayed_intensity(panels(mh.plot_attention(w, heads=[0]))[0])
    # linear from 0 to the panel's largest weight: a softmax row over ~100 keys is ~1/100
    assert old < 0.02
    assert new > 0.25 and new > 10 * old
    for scale in ("power", "log"):
        lifted = mean_displayed_intensity(panels(mh.plot_attention(w, heads=[0],
                                                                   scale=scale))[0])
        assert lifted > 5 * old, scale


def test_row_scale_puts_each_rows_largest_weight_at_full_colour(mpl):
    w = random_head_weights(T=50)[1]
    image = panels(mh.plot_attention(w))[0].images[0]
    shown = image.norm(image.get_array())
    np.testing.assert_allclose(shown.max(axis=1), 1.0, rtol=1e-12)
    # within a row the order and ratios of the weights are kept
    i = 37
    np.testing.assert_allclose(shown[i, : i + 1], w[i, : i + 1] / w[i, : i + 1].max(),
                               rtol=1e-6)


def test_power_and_log_scales_map_weights_as_documented(mpl):
    w = random_head_weights(T=40)[0]
    top = w.max()
    power = panels(mh.plot_attention(w, scale="power", gamma=0.25))[0].images[0]
    np.testing.assert_allclose(power.norm(np.array([top / 16])), [0.5], rtol=1e-6)
    log = panels(mh.plot_attention(w, scale="log"))[0].images[0]
    assert log.norm.vmax == pytest.approx(top)
    assert log.norm.vmin == pytest.approx(top * 10.0 ** -mh.plot.LOG_DECADES)
    assert float(np.ma.min(log.norm(log.get_array()))) >= 0.0   # tiny weights: darkest, not blank


@pytest.mark.parametrize("T", [2, 47, 64])
def test_every_token_is_labelled_up_to_64_tokens(mpl, T):
    tokens = [f"t{i}" for i in range(T)]
    fig = mh.plot_attention(uniform_causal(T), tokens)
    ax = panels(fig)[0]
    expected = [f"t{i}" for i in range(T)]
    assert [t.get_text() for t in ax.get_xticklabels()] == expected
    assert [t.get_text() for t in ax.get_yticklabels()] == expected


def test_longer_sequences_label_about_64_evenly_spaced_tokens(mpl):
    T = 200
    fig = mh.plot_attention(uniform_causal(T), [f"t{i}" for i in range(T)])
    ax = panels(fig)[0]
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        assert 50 <= len(labels) <= 64
        assert [t.get_text() for t in labels][:3] == ["t0", "t4", "t8"]


@pytest.mark.parametrize("T", [47, 64])
def test_tick_labels_do_not_overlap(mpl, T):
    tokens = [chr(ord("a") + i % 26) for i in range(T)]
    fig = mh.plot_attention(np.stack([uniform_causal(T)] * 3), tokens)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = panels(fig)[0]
    ys = sorted((t.get_window_extent(renderer) for t in ax.get_yticklabels()),
                key=lambda box: box.y0)
    assert all(lower.y1 <= upper.y0 + 0.5 for lower, upper in zip(ys, ys[1:]))
    xs = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels()),
                key=lambda box: box.x0)
    assert all(left.x1 <= right.x0 + 0.5 for left, right in zip(xs, xs[1:]))


def test_smallest_pictures_draw_without_any_warning(mpl, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for w, tokens in ((uniform_causal(2), ["a", "b"]),          # two tokens
                          (np.array([[[0.25, 0.75]]]), ["x", "y"])):  # one query, two keys
            for scale in SCALES:
                mh.plot_attention(w, tokens, scale=scale).savefig(tmp_path / "p.png")


@pytest.mark.parametrize("shape", [(2, 0, 0), (2, 1, 1), (2, 3, 1), (0, 0)])
def test_plot_attention_refuses_empty_and_one_key_weights(mpl, shape):
    with pytest.raises(ValueError, match="at least one query and two keys"):
        mh.plot_attention(np.ones(shape))


@pytest.mark.parametrize("kwargs, match", [
    ({"scale": "sqrt"}, "scale must be one of"),
    ({"scale": "power", "gamma": 0.0}, "gamma"),
    ({"gamma": 2}, "gamma"),
    ({"max_labels": 0}, "max_labels"),
    ({"heads": []}, "heads is empty"),
])
def test_plot_attention_rejects_bad_options(mpl, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mh.plot_attention(uniform_causal(5), **kwargs)


# ----------------------------------------------------------------------------- show command

def run_show(*args, env=None):
    return subprocess.run([sys.executable, "-m", "manyheads", "show", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_show_command_writes_a_png_and_prints_roles(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    res = run_show("--text", "abcabcabc", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "previous-token" in res.stdout and "mixed" in res.stdout
    assert "Warning" not in res.stderr
    saved = tmp_path / "layer.npz"
    mh.MultiHeadAttention(32, 32, 64, 0.0, 4, seed=0).save(saved)
    res = run_show("--weights", str(saved), "--out", str(out), "--scale", "log")
    assert res.returncode == 0, res.stderr
    assert "colour scale: log" in res.stdout


@pytest.mark.parametrize("text", ["", "a"])
def test_show_refuses_empty_and_one_token_text(tmp_path, text):
    out = tmp_path / "p.png"
    res = run_show("--text", text, "--out", str(out))
    assert res.returncode == 2
    assert "at least two byte tokens" in res.stderr
    assert "Warning" not in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_show_without_matplotlib_says_how_to_install(tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    res = run_show("--out", str(tmp_path / "p.png"), env=env)
    assert res.returncode == 2
    assert "pip install 'manyheads[plot]'" in res.stderr
