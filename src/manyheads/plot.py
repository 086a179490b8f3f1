"""Pictures of attention patterns, and scores for what each head does.

matplotlib is optional (``pip install 'manyheads[plot]'``) and imported only
when a picture is drawn; :func:`head_roles` needs NumPy alone.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["plot_attention", "head_roles", "format_roles"]

ROLES = ("previous_token", "first_token", "induction")


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
        raise ImportError("drawing attention needs matplotlib: pip install 'manyheads[plot]'"
                          ) from None
    return plt


def _has_display() -> bool:
    import os
    import sys

    return sys.platform in ("win32", "darwin") or bool(os.environ.get("DISPLAY"))


def plot_attention(weights: Any, tokens: Sequence[Any] | None = None,
                   heads: Sequence[int] | None = None, *, causal: bool = True,
                   title: str | None = None, max_labels: int = 48, cmap: str = "magma",
                   ncols: int | None = None) -> Any:
    """Draw each head's attention weights; returns a matplotlib Figure.

    Parameters
    ----------
    weights : array, shape (H, T, S), (1, H, T, S) or (T, S)
        E.g. ``mha(x, return_weights=True)[1]``.
    tokens : sequence of length S, optional
        Tick labels (keys on the x axis, queries on the y axis).
    heads : sequence of int, optional
        Which heads to draw (default: all).
    causal : bool
        Leave the future (key after query, aligned to the end) blank rather
        than dark, so masked cells are visibly empty.
    max_labels : int
        With more tokens than this, only every k-th gets a label.

    One panel per head: queries (targets) down, keys (sources) across,
    brightness = weight (each panel scaled to its own largest weight).
    """
    w = _as_heads(weights)
    H, T, S = w.shape
    sel = list(range(H)) if heads is None else [int(h) for h in heads]
    for h in sel:
        if not 0 <= h < H:
            raise ValueError(f"head {h} out of range: weights have {H} heads")
    if tokens is not None and len(tokens) != S:
        raise ValueError(f"tokens has {len(tokens)} entries, weights have {S} keys")
    plt = _require_matplotlib()
    n = len(sel)
    ncols = ncols or min(n, 4 if n > 4 else n)
    nrows = math.ceil(n / ncols)
    size = 3.2 if T <= 64 else 4.0
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols + 0.6, size * nrows + 0.6),
                             squeeze=False)
    future = np.arange(S)[None, :] > np.arange(T)[:, None] + (S - T)
    colormap = plt.get_cmap(cmap).with_extremes(bad="white")
    labels = None if tokens is None else [_label(t) for t in tokens]
    step = max(1, math.ceil(max(T, S) / max_labels))
    for ax, h in zip(axes.flat, sel):
        img = np.ma.masked_array(w[h], mask=future if causal else np.zeros_like(future))
        vmax = float(np.nanmax(w[h])) if np.isfinite(w[h]).any() else 1.0
        ax.imshow(img, cmap=colormap, vmin=0.0, vmax=vmax if vmax > 0 else 1.0,
                  interpolation="nearest", aspect="auto")
        ax.set_title(f"head {h}", fontsize=10)
        if labels is not None:
            short = all(len(lb) <= 2 for lb in labels)
            fs = 7 if max(T, S) <= 64 else 5
            ax.set_xticks(range(0, S, step))
            ax.set_xticklabels(labels[::step], rotation=0 if short else 90, fontsize=fs,
                               family="monospace")
            ystep = max(step, math.ceil(T / 24))  # rows are shorter than a line of text
            ax.set_yticks(range(0, T, ystep))
            ax.set_yticklabels(labels[S - T:][::ystep], fontsize=fs, family="monospace")
        else:
            ax.tick_params(labelsize=7)
        ax.set_xlabel("key (source)", fontsize=8)
        ax.set_ylabel("query (target)", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title or "attention weights: brightness = weight, blank = masked future",
                 fontsize=11)
    fig.tight_layout()
    return fig


def _label(t: Any) -> str:
    s = t if isinstance(t, str) else str(t)
    return {" ": "_", "\n": "\\n", "\t": "\\t"}.get(s, s)


def head_roles(weights: Any, tokens: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
    """Score every head for the roles the course names; one value in [0, 1] per head.

    * ``previous_token``: mean weight a query puts on the key just before it;
    * ``first_token``: mean weight a query puts on the first key;
    * ``induction``: on a sequence that repeats, mean weight from a repeated
      token (second occurrence) to the token that followed its first
      occurrence; NaN when ``tokens`` has no repeat to measure on.

    ``weights`` (H, T, T) are one sequence's self-attention weights.
    """
    w = _as_heads(weights)
    H, T, S = w.shape
    if T != S:
        raise ValueError(f"head_roles needs self-attention weights (T == S), got {w.shape}")
    rows = np.arange(1, T)
    prev = w[:, rows, rows - 1].mean(axis=1) if T > 1 else np.full(H, np.nan)
    first = w[:, rows, 0].mean(axis=1) if T > 1 else np.full(H, np.nan)
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
    return {"previous_token": prev, "first_token": first, "induction": induction}


def format_roles(roles: dict[str, np.ndarray]) -> str:
    """The scores of :func:`head_roles` as a text table, the strongest role of each head marked."""
    H = len(roles["previous_token"])
    lines = ["head  previous-token  first-token  induction  strongest",
             "----  --------------  -----------  ---------  ---------"]
    for h in range(H):
        vals = [roles[r][h] for r in ROLES]
        best = ROLES[int(np.nanargmax([-1 if np.isnan(v) else v for v in vals]))]
        cells = ["      -" if np.isnan(v) else f"{v:7.3f}" for v in vals]
        lines.append(f"{h:4d}  {cells[0]:>14}  {cells[1]:>11}  {cells[2]:>9}  "
                     f"{best.replace('_', '-')}")
    return "\n".join(lines)
