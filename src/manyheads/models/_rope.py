"""Rotary position embeddings of checkpoint configs, with every scaling transformers
applies to Llama-shaped models: ``linear``, ``dynamic`` (NTK), ``yarn`` and ``llama3``.

A :class:`Rotary` turns one kind of layer's rotary settings into inverse frequencies
(float32, as transformers keeps them), an attention factor that multiplies the cos
and sin tables (YaRN's), and the number of rotated features of each head (a partial
rotary factor rotates only the first ones).  Layers of one kind share one Rotary, so
the tables of a call are computed once for all of them.

Positions are the cache slots, as in :mod:`._decoder`.  Dynamic NTK scaling depends on
the length the call reaches (``start + T``, transformers' largest position + 1): each
call rotates its new queries and keys with the frequencies of that length, and cached
keys keep the rotation they were cached with, exactly what transformers' ``generate``
does.  (transformers' rotary module also remembers the longest length it has seen;
here each call stands alone, which is the same for one ``generate`` or ``logits``.)
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _core

__all__ = ["Rotary", "rope_parameters_of", "LAYER_TYPES"]

LAYER_TYPES = ("full_attention", "sliding_attention")
SCALINGS = ("default", "linear", "dynamic", "yarn", "llama3")


def _object(cfg: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = cfg.get(name)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"malformed config.json: {name!r} must be an object or null, "
                         f"got {value!r}")
    return value


def rope_parameters_of(cfg: dict[str, Any], layer_type: str = "full_attention", *,
                       default_theta: float = 10000.0,
                       local_theta: tuple[str, float] | None = None,
                       partial: bool = False) -> dict[str, Any]:
    """The rotary settings of one kind of layer, with transformers' precedence.

    Flat configs (every family but Gemma 3): ``rope_scaling`` (transformers 4) or
    else ``rope_parameters`` (transformers 5), the base from there or from
    ``rope_theta`` (default ``default_theta``).  With ``local_theta`` = (key,
    default), Gemma 3's layout: ``rope_parameters`` per layer type, or the legacy
    ``rope_scaling`` + ``rope_theta`` for full-attention layers and plain rotary
    embeddings of base ``cfg[key]`` for sliding ones.

    ``partial``: the family's plain rotary embeddings read ``partial_rotary_factor``
    (Phi-3's).  The others' rotate every feature whatever it says, as transformers'
    do; with their scaled rotary embeddings, which would read it in transformers and
    then not fit the heads, it is refused.
    """
    params, scaling = _object(cfg, "rope_parameters"), _object(cfg, "rope_scaling")
    nested = params is not None and any(k in LAYER_TYPES for k in params)
    if local_theta is None:
        if nested:
            raise ValueError("malformed config.json: 'rope_parameters' per layer type is "
                             f"not a {cfg.get('model_type')!r} setting")
        p = dict(scaling or params or {})
        p.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    else:
        if params and not nested:
            raise ValueError("malformed config.json: 'rope_parameters' of a Gemma 3 config "
                             f"must be given per layer type ({', '.join(LAYER_TYPES)})")
        found = (params or {}).get(layer_type)
        if found is not None and not isinstance(found, dict):
            raise ValueError(f"malformed config.json: 'rope_parameters' of {layer_type!r} "
                             f"must be an object, got {found!r}")
        p = dict(found or {"rope_type": "default"})
        if layer_type == "full_attention":
            p.update(scaling or {})
            p.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
        else:
            p.setdefault("rope_theta", cfg.get(local_theta[0], local_theta[1]))
    if "partial_rotary_factor" in cfg:
        p.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    p["rope_type"] = p.get("rope_type", p.get("type", "default"))
    if not partial and p.get("partial_rotary_factor", 1.0) != 1.0:
        if p["rope_type"] != "default":
            raise ValueError(f"partial_rotary_factor {p['partial_rotary_factor']!r} with rotary "
                             f"scaling {p['rope_type']!r} is not supported in a "
                             f"{cfg.get('model_type')!r} model: transformers' tables would not "
                             "fit its heads")
        del p["partial_rotary_factor"]  # (transformers' plain rotary of the family ignores it)
    if p["rope_type"] in ("llama3", "yarn") and "original_max_position_embeddings" in cfg:
        # as transformers: a top-level value (Phi-3 keeps one there) wins
        p["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return p


def _number(p: dict[str, Any], key: str, default: float | None = None, *,
            positive: bool = True) -> float:
    value = p.get(key, default)
    if value is None:
        raise ValueError(f"rotary scaling {p['rope_type']!r} needs {key!r} in rope_scaling")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"malformed config.json: rope_scaling {key!r} must be a "
                         f"{'positive ' if positive else ''}number, got {value!r}")
    return float(value)


class Rotary:
    """Rotary embeddings of one kind of layer (see the module docstring).

    Parameters
    ----------
    params : dict
        From :func:`rope_parameters_of`.
    head_dim : int
        Features per head; ``partial_rotary_factor`` rotates the first
        ``int(head_dim * factor)`` of them.
    max_position : int
        The config's ``max_position_embeddings``.
    """

    def __init__(self, params: dict[str, Any], head_dim: int, max_position: int) -> None:
        kind = params["rope_type"]
        if kind in ("longrope", "su"):
            raise ValueError(f"rotary scaling {kind!r} (Phi-3's long-context LongRoPE) is not "
                             "supported: transformers switches every position's frequencies "
                             "when a sequence crosses original_max_position_embeddings, which "
                             "a KV cache of rotated keys cannot follow; use a checkpoint with "
                             "plain rotary embeddings (e.g. a 4k-context Phi-3)")
        if kind not in SCALINGS:
            raise ValueError(f"rotary scaling {kind!r} is not supported; supported: "
                             f"{', '.join(SCALINGS)}")
        self.kind = str(kind)
        self.theta = _number(params, "rope_theta")
        fraction = _number(params, "partial_rotary_factor", 1.0)
        self.head_dim = head_dim
        self.dim = int(head_dim * fraction)  # rotated features of each head
        if self.dim % 2 or not 0 < self.dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {fraction:g} of head_dim {head_dim} gives "
                             f"{self.dim} rotated features: must be even and in [2, head_dim]")
        self.max_position = max_position
        self.factor = 1.0 if self.kind == "default" else _number(params, "factor")
        self.context_length = max_position
        if self.kind == "dynamic":  # NTK scaling is what lets a model run past its length
            self.context_length = int(max_position * self.factor)
        elif self.kind == "yarn":  # the pretrained context times the factor (Qwen2.5's 128k)
            old_len = _number(params, "original_max_position_embeddings", max_position)
            self.context_length = max(max_position, int(old_len * self.factor))
        self.attention_factor = 1.0
        exponents = np.arange(0, self.dim, 2, dtype=np.float64) / self.dim
        inv = self.theta ** -exponents
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = self._llama3(inv, params)
        elif self.kind == "yarn":
            inv = self._yarn(exponents, params)
        self.inv_freq = inv.astype(np.float32)
        self._memo: tuple[tuple[int, int, int], np.ndarray, np.ndarray] | None = None
        self._rows_memo: tuple[Any, list[tuple[np.ndarray, np.ndarray]]] | None = None

    def _llama3(self, inv: np.ndarray, p: dict[str, Any]) -> np.ndarray:
        """Llama 3.1: low frequencies divided by the factor, high ones kept, a smooth
        blend between the two wavelength bounds of the original context."""
        low = _number(p, "low_freq_factor")
        high = _number(p, "high_freq_factor")
        old_len = _number(p, "original_max_position_embeddings", self.max_position)
        if high <= low:
            raise ValueError(f"rope_scaling 'llama3': high_freq_factor {high:g} must exceed "
                             f"low_freq_factor {low:g}")
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / self.factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        out: np.ndarray = np.where(medium, blended, scaled)
        return out

    def _yarn(self, exponents: np.ndarray, p: dict[str, Any]) -> np.ndarray:
        """YaRN: interpolated (divided by the factor) and extrapolated frequencies mixed
        by a linear ramp over the dimensions between the beta_fast and beta_slow
        rotation counts, and an attention factor on cos and sin."""
        old_len = _number(p, "original_max_position_embeddings", self.max_position)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if p.get("attention_factor") is not None:
            self.attention_factor = _number(p, "attention_factor")
        elif p.get("mscale") and p.get("mscale_all_dim"):
            self.attention_factor = (mscale(self.factor, _number(p, "mscale"))
                                     / mscale(self.factor, _number(p, "mscale_all_dim")))
        else:
            self.attention_factor = mscale(self.factor)
        fast = _number(p, "beta_fast") if p.get("beta_fast") else 32.0
        slow = _number(p, "beta_slow") if p.get("beta_slow") else 1.0

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
            return (self.dim * math.log(old_len / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        lo, hi = dim_of(fast), dim_of(slow)
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, self.dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(self.dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
        base_freq = self.theta ** exponents
        out: np.ndarray = (1 / (self.factor * base_freq)) * (1 - keep) + (1 / base_freq) * keep
        return out

    def frequencies(self, length: int) -> np.ndarray:
        """The inverse frequencies (dim // 2,) float32 of a call reaching ``length``."""
        if self.kind != "dynamic" or length <= self.max_position:
            return self.inv_freq
        d = self.dim
        base = self.theta * (self.factor * length / self.max_position
                             - (self.factor - 1)) ** (d / (d - 2))
        inv: np.ndarray = (base ** -(np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)
        return inv

    def tables(self, start: int, T: int, length: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (T, dim // 2) float32 of positions start .. start+T-1, times the
        attention factor, at the frequencies of a call reaching ``length`` (default
        start + T); the last call's are kept for the next layer."""
        key = (start, T, start + T if length is None else length)
        if self._memo is None or self._memo[0] != key:
            inv = self.frequencies(key[2]).astype(np.float64)
            angles = np.arange(start, start + T, dtype=np.float64)[:, None] * inv[None, :]
            cos = (np.cos(angles) * self.attention_factor).astype(np.float32)
            sin = (np.sin(angles) * self.attention_factor).astype(np.float32)
            self._memo = (key, cos, sin)
        return self._memo[1], self._memo[2]

    def apply(self, x: np.ndarray, start: int, length: int | None = None) -> None:
        """Rotate x (B, H, T, D) in place, its tokens at positions start, start+1, ...
        (``length`` as in :meth:`tables`)."""
        cos, sin = self.tables(start, x.shape[-2], length)
        _core.rotate(x, cos, sin)

    def apply_rows(self, x: np.ndarray, starts: np.ndarray, length: int) -> None:
        """Rotate each row b of x (B, H, T, D) in place from position starts[b], at the
        frequencies of a call reaching ``length``; the tables are kept for the next
        layer."""
        key = (tuple(starts.tolist()), x.shape[-2], length)
        if self._rows_memo is None or self._rows_memo[0] != key:
            self._rows_memo = (key, [self.tables(s, x.shape[-2], length) for s in key[0]])
        for b, (cos, sin) in enumerate(self._rows_memo[1]):
            _core.rotate(x[b:b + 1], cos, sin)

    def __repr__(self) -> str:
        scaling = "" if self.kind == "default" else f" {self.kind} x{self.factor:g}"
        part = "" if self.dim == self.head_dim else f" on {self.dim} of {self.head_dim} features"
        return f"rotary theta {self.theta:g}{scaling}{part}"
