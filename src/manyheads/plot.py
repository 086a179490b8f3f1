"""Pictures of attention patterns, and scores for what each head does.

matplotlib is optional (``pip install 'manyheads[plot]'``) and imported only
when a picture is drawn; :func:`head_roles` and :func:`format_roles` need
NumPy alone.

How a picture maps weight to colour is chosen by ``scale``:

``"row"`` (the default)
    Each query's row is divided by its own largest weight, so every row's
    favourite key is at full brightness and the rest are shown relative to
    it.  A softmax row over T keys sums to 1, so at large T every single
    weight is small; dividing by the row's maximum keeps the structure
    visible at any T.  The absolute size of the weights is not shown.
``"power"``
    The weights themselves, through a power law ``(w / w_max) ** gamma``
    (``gamma=0.5`` by default) with ``w_max`` the panel's largest weight:
    small weights are lifted, large ones stay in order.
``"log"``
    The weights on a logarithmic scale covering :data:`LOG_DECADES` decades
    below the panel's largest weight; smaller weights get the darkest colour.
``"linear"``
    The weights themselves, from 0 to the panel's largest weight.  Faithful,
    but at large T most cells are close to black.

Each panel has a colourbar, and the figure title names the scale.
"""
from __future__ import annotations

import math
import textwrap
from typing import Any, Sequence

import numpy as np

__all__ = ["plot_attention", "head_roles", "format_roles", "classify_heads",
           "ROLE_THRESHOLD", "SCALES", "LOG_DECADES"]

ROLES = ("previous_token", "first_token", "induction")

#: A head is named after a role when its score for that role is at least this
#: and no other role's score is: on average at least 40% of a query's weight
#: lands on the one key that the role names.  Otherwise the head is "mixed".
#: A head that spreads its weight evenly scores below it on sequences of four or
#: more tokens (and on three tokens it clears it for two roles at once, so it
#: is still "mixed").
ROLE_THRESHOLD = 0.4

#: The colour scales :func:`plot_attention` accepts.
SCALES = ("row", "power", "log", "linear")

#: How many decades below a panel's largest weight the ``"log"`` scale shows.
LOG_DECADES = 3

# the tick label font: sizes in points, and the height of one label row
_LABEL_FONT_LARGE = 7.0
_LABEL_FONT_SMALL = 6.0
_LINE_SPACING = 1.35
_TITLE_FONT = 11.0
_POINTS_PER_INCH = 72.0


def _as_heads(weights: Any) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim == 4:
        if w.shape[0] != 1:
            raise ValueError(f"weights of shape {w.shape}: pass one batch element, (H, T, S)")
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must have shape (heads, queries, keys) or (queries, keys), "
                         f"got {np.shape(weights)}")
    return w


def _require_matplotlib() -> Any:
    try:
        import matplotlib

        if matplotlib.get_backend().lower() not in ("agg",) and not _has_display():
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("drawing attention needs matplotlib: pip install 'manyheads[plot]' "
                          "(in a source checkout: pip install '.[plot]')") from None
    return plt


def _has_display() -> bool:
    import os
    import sys

    return sys.platform in ("win32", "darwin") or bool(os.environ.get("DISPLAY"))


def _scale_names(scale: str, gamma: float) -> tuple[str, str]:
    """(sentence for the figure title, label for the colourbar) of a scale."""
    if scale == "row":
        return ("colour = weight / largest weight in its row (scale='row')",
                "weight / row's largest")
    if scale == "power":
        return (f"colour = (weight / panel's largest) ** {gamma:g} (scale='power')",
                f"weight (power scale, gamma={gamma:g})")
    if scale == "log":
        return (f"colour = weight on a log scale, {LOG_DECADES} decades (scale='log')",
                "weight (log scale)")
    return "colour = weight, 0 to panel's largest (scale='linear')", "weight"


def _panel_image(w: np.ndarray, hidden: np.ndarray, scale: str, gamma: float,
                 colors: Any) -> tuple[np.ndarray, Any]:
    """The array to draw for one head (T, S) and the matplotlib norm that colours it."""
    shown = np.where(hidden, np.nan, w)
    finite = np.isfinite(shown)
    top = float(shown[finite].max()) if finite.any() else 0.0
    top = top if top > 0 else 1.0
    if scale == "row":
        # largest visible weight of each row, NaN ignored (fmax skips NaN without a warning)
        row_top = np.fmax.reduce(np.where(finite, shown, -np.inf), axis=1, keepdims=True)
        safe = np.where(row_top > 0, row_top, 1.0)
        return w / safe, colors.Normalize(vmin=0.0, vmax=1.0)
    if scale == "power":
        return w, colors.PowerNorm(gamma=gamma, vmin=0.0, vmax=top)
    if scale == "log":
        floor = top * 10.0 ** -LOG_DECADES
        return np.maximum(w, floor), colors.LogNorm(vmin=floor, vmax=top)
    return w, colors.Normalize(vmin=0.0, vmax=top)


def _label_step(n: int, max_labels: int) -> int:
    """Label every position up to ``max_labels`` of them, else every k-th."""
    return 1 if n <= max_labels else math.ceil(n / max_labels)


def plot_attention(weights: Any, tokens: Sequence[Any] | None = None,
                   heads: Sequence[int] | None = None, *, causal: bool = True,
                   title: str | None = None, scale: str = "row", gamma: float = 0.5,
                   max_labels: int = 64, cmap: str = "magma", ncols: int | None = None,
                   colorbar: bool = True) -> Any:
    """Draw each head's attention weights as a heat map, one panel per head.

    Queries (targets) run down, keys (sources) across; the colour of a cell
    is the weight that query gives that key, mapped by ``scale``.  Each
    panel has a colourbar, and the figure title says which scale is used.

    Parameters
    ----------
    weights : array_like, shape (H, T, S), (1, H, T, S) or (T, S)
        Attention weights, e.g. ``mha(x, return_weights=True)[1]``.  There
        must be at least one query and two keys.
    tokens : sequence of length S, optional
        Tick labels: keys on the x axis, the last T of them (the queries) on
        the y axis.
    heads : sequence of int, optional
        Which heads to draw (default: all).
    causal : bool, default True
        Leave the future (a key after its query, the queries aligned to the
        last keys) blank rather than dark, so masked cells are visibly empty.
    title : str, optional
        First line of the figure title; the second line always names the
        colour scale.
    scale : {"row", "power", "log", "linear"}, default "row"
        How weight maps to colour (see :mod:`manyheads.plot`): ``"row"``
        divides each row by its largest weight, ``"power"`` applies
        ``(w / w_max) ** gamma``, ``"log"`` shows :data:`LOG_DECADES`
        decades below the panel's largest weight, ``"linear"`` shows 0 to the
        panel's largest weight.
    gamma : float, default 0.5
        Exponent of the ``"power"`` scale, in (0, 1] to lift small weights.
    max_labels : int, default 64
        Every token is labelled when there are at most this many; with
        more, every k-th is, so that about ``max_labels`` remain.  Panels grow
        with the number of labels so that the labels do not overlap.
    cmap : str, default "magma"
        A matplotlib colormap name.
    ncols : int, optional
        Panels per row of the figure (default: up to 4).
    colorbar : bool, default True
        Give every panel a colourbar.

    Returns
    -------
    matplotlib.figure.Figure
        The figure; save it with ``fig.savefig("patterns.png")``.

    Raises
    ------
    ValueError
        If ``weights`` has the wrong number of dimensions, no query or fewer
        than two keys, if ``tokens`` does not have one entry per key, if a
        head is out of range, or if ``scale``, ``gamma`` or ``max_labels`` is
        not valid.
    ImportError
        If matplotlib is not installed.
    """
    w = _as_heads(weights)
    H, T, S = w.shape
    if T < 1 or S < 2:
        raise ValueError(f"weights of shape {w.shape} have {T} queries and {S} keys: a picture "
                         "needs at least one query and two keys (with a single key every "
                         "weight is 1)")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}")
    if not (isinstance(gamma, (int, float)) and 0 < gamma <= 1):
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")
    if int(max_labels) < 1:
        raise ValueError(f"max_labels must be at least 1, got {max_labels!r}")
    sel = list(range(H)) if heads is None else [int(h) for h in heads]
    if not sel:
        raise ValueError("heads is empty: name at least one head to draw")
    for h in sel:
        if not 0 <= h < H:
            raise ValueError(f"head {h} out of range: weights have {H} heads")
    if tokens is not None and len(tokens) != S:
        raise ValueError(f"tokens has {len(tokens)} entries, weights have {S} keys")
    plt = _require_matplotlib()
    from matplotlib import colors

    n = len(sel)
    ncols = max(1, min(n, int(ncols) if ncols else 4))
    nrows = math.ceil(n / ncols)
    labels = None if tokens is None else [_label(t) for t in tokens]
    step = _label_step(S, int(max_labels))
    ystep = _label_step(T, int(max_labels))
    shown_labels = max(math.ceil(S / step), math.ceil(T / ystep)) if labels else 0
    font = _LABEL_FONT_LARGE if shown_labels <= 32 else _LABEL_FONT_SMALL
    # a panel tall enough that one label row per labelled position fits
    side = max(3.2 if max(T, S) <= 64 else 4.0,
               shown_labels * font * _LINE_SPACING / _POINTS_PER_INCH)
    short = labels is not None and all(len(lb) <= 2 for lb in labels)
    xlabel_room = 0.0 if labels is None or short else 0.08 * max(len(lb) for lb in labels)
    width = ncols * (side + (1.6 if colorbar else 0.9))
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                             figsize=(width, nrows * (side + 1.0 + xlabel_room) + 0.9))
    future = np.arange(S)[None, :] > np.arange(T)[:, None] + (S - T)
    hidden = future if causal else np.zeros_like(future)
    colormap = plt.get_cmap(cmap).with_extremes(bad="white")
    sentence, bar_label = _scale_names(scale, float(gamma))
    for ax, h in zip(axes.flat, sel):
        data, norm = _panel_image(w[h], hidden, scale, float(gamma), colors)
        img = np.ma.masked_array(data, mask=hidden)
        im = ax.imshow(img, cmap=colormap, norm=norm, interpolation="nearest", aspect="auto")
        ax.set_title(f"head {h}", fontsize=10)
        if colorbar:
            cbar = fig.colorbar(im, ax=ax, fraction=0.06, pad=0.02)
            cbar.set_label(bar_label, fontsize=7)
            cbar.ax.tick_params(labelsize=6)
        if labels is not None:
            ax.set_xticks(range(0, S, step))
            ax.set_xticklabels(labels[::step], rotation=0 if short else 90, fontsize=font,
                               family="monospace")
            ax.set_yticks(range(0, T, ystep))
            ax.set_yticklabels(labels[S - T:][::ystep], fontsize=font, family="monospace")
        else:
            ax.tick_params(labelsize=7)
        ax.set_xlabel("key (source)", fontsize=8)
        ax.set_ylabel("query (target)", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    blank = "; blank = masked future" if causal else ""
    # wrap the title to the figure's width (a character is about 0.6 of the font size)
    chars = max(20, int(width * _POINTS_PER_INCH / (_TITLE_FONT * 0.6)))
    lines = [textwrap.fill(part, chars) for part in (title or "attention weights",
                                                     sentence + blank)]
    fig.suptitle("\n".join(lines), fontsize=_TITLE_FONT)
    return fig


def _label(t: Any) -> str:
    s = t if isinstance(t, str) else str(t)
    return {" ": "_", "\n": "\\n", "\t": "\\t"}.get(s, s)


def classify_heads(roles: dict[str, np.ndarray],
                   threshold: float = ROLE_THRESHOLD) -> list[str]:
    """Name each head's role from its scores, or call it ``"mixed"``.

    Parameters
    ----------
    roles : dict of str to ndarray
        Scores as returned by :func:`head_roles`.
    threshold : float, default :data:`ROLE_THRESHOLD` (0.4)
        A head gets a role's name (``"previous-token"``, ``"first-token"``
        or ``"induction"``) when that role's score is at least
        ``threshold`` and no other role's score is.  Otherwise (no score
        clears it, or several do) the head is ``"mixed"``.  NaN scores
        (induction without a repeat) never clear it.

    Returns
    -------
    list of str
        One name per head.

    Raises
    ------
    ValueError
        If ``threshold`` is not in (0, 1].
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    num_heads = len(roles["previous_token"])
    names = []
    for h in range(num_heads):
        cleared = [r for r in ROLES if r in roles and roles[r][h] >= threshold]
        names.append(cleared[0].replace("_", "-") if len(cleared) == 1 else "mixed")
    return names


def head_roles(weights: Any, tokens: Sequence[Any] | None = None, *,
               threshold: float = ROLE_THRESHOLD) -> dict[str, np.ndarray]:
    """Score every head for the roles the course names, and name its role.

    Parameters
    ----------
    weights : array_like, shape (H, T, T), (1, H, T, T) or (T, T)
        One sequence's self-attention weights, T >= 2.
    tokens : sequence of length T, optional
        The tokens; needed for the induction score.
    threshold : float, default :data:`ROLE_THRESHOLD` (0.4)
        The score a role must reach to name a head (see
        :func:`classify_heads`).

    Returns
    -------
    dict of str to ndarray
        Scores in [0, 1], one per head, averaged over the queries 1 .. T-1:

        * ``"previous_token"``: mean weight a query puts on the key just
          before it;
        * ``"first_token"``: mean weight a query puts on the first key;
        * ``"induction"``: on a sequence that repeats, mean weight from a
          repeated token (second occurrence) to the token that followed its
          first occurrence; NaN when ``tokens`` has no repeat to measure on;

        and ``"role"``, an array of str: each head's role by
        :func:`classify_heads`, or ``"mixed"``.

    Raises
    ------
    ValueError
        If the weights are not square (self-attention), cover fewer than two
        positions (the roles need a previous token), or ``tokens`` does not
        have one entry per position.
    """
    w = _as_heads(weights)
    H, T, S = w.shape
    if T != S:
        raise ValueError(f"head_roles needs self-attention weights (T == S), got {w.shape}")
    if T < 2:
        raise ValueError(f"head_roles needs at least two positions, got {T}: with one token "
                         "there is no previous token to score")
    rows = np.arange(1, T)
    prev = w[:, rows, rows - 1].mean(axis=1)
    first = w[:, rows, 0].mean(axis=1)
    induction = np.full(H, np.nan)
    if tokens is not None:
        if len(tokens) != T:
            raise ValueError(f"tokens has {len(tokens)} entries, weights have {T} positions")
        first_seen: dict[Any, int] = {}
        pairs = []
        for i, t in enumerate(tokens):
            j = first_seen.get(t)
            if j is None:
                first_seen[t] = i
            elif j + 1 < i:  # the follower of the first occurrence lies in the past
                pairs.append((i, j + 1))
        if pairs:
            qi, kj = np.array(pairs).T
            induction = w[:, qi, kj].mean(axis=1)
    scores = {"previous_token": prev, "first_token": first, "induction": induction}
    scores["role"] = np.array(classify_heads(scores, threshold), dtype=str)
    return scores


def format_roles(roles: dict[str, np.ndarray], threshold: float = ROLE_THRESHOLD) -> str:
    """The scores of :func:`head_roles` as a text table with each head's role.

    Parameters
    ----------
    roles : dict of str to ndarray
        Scores as returned by :func:`head_roles`.
    threshold : float, default :data:`ROLE_THRESHOLD` (0.4)
        The score a role must reach to name a head; the role column says
        ``mixed`` when no score, or more than one, reaches it (see
        :func:`classify_heads`).

    Returns
    -------
    str
        One line per head, after a header that states the threshold.
    """
    names = classify_heads(roles, threshold)
    lines = [f"head  previous-token  first-token  induction  role (a score >= {threshold:g})",
             "----  --------------  -----------  ---------  ----"]
    for h, name in enumerate(names):
        vals = [roles[r][h] for r in ROLES]
        cells = ["      -" if np.isnan(v) else f"{v:7.3f}" for v in vals]
        lines.append(f"{h:4d}  {cells[0]:>14}  {cells[1]:>11}  {cells[2]:>9}  {name}")
    return "\n".join(lines)
