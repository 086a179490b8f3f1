"""Choosing the next token: the logits processors of ``generate`` and the draw.

The processors are those of Hugging Face transformers' ``generate``, in its order, with
its meanings (written here in NumPy, float32 like the logits):

1. repetition penalty, on the raw logits of every token already seen (the prompt's real
   tokens and the generated ones): a positive logit is divided by the penalty, a
   negative one multiplied by it.  It applies to greedy decoding too;
2. (sampling only) temperature: the logits divided by it.  A temperature so small that
   the quotients would overflow float32 divides each row's logits less the row's
   largest instead (the same softmax): the best token keeps logit 0 and the others
   fall towards -inf, so sampling approaches greedy decoding (ties shared) as the
   temperature approaches 0, rather than turning the logits into inf and NaN;
3. top-k: the logits below the k-th largest are filtered out (ties with it are kept);
   top_k 0, as in transformers, means no filter;
4. top-p: counting up from the least probable token, the tokens whose cumulative
   probability stays at or below ``1 - top_p`` are filtered out (what remains is the
   smallest set of most probable tokens whose probabilities add up to ``top_p`` or
   more);
5. min-p: the tokens whose probability is below ``min_p`` times the largest one are
   filtered out.

A filtered token's logit becomes -inf; at least one token (the most probable) always
stays.  Ties are kept together: top-k keeps every token equal to the k-th (as
transformers does); top-p keeps or drops a group of equal logits as a whole (kept if
any of them would be kept), where transformers keeps whichever of them PyTorch's
unstable sort happens to put last; min-p compares each token with a threshold, so ties
share their fate.

The draw takes one uniform number per row from a :class:`numpy.random.Generator` and
inverts the cumulative distribution of the softmax of the processed logits (float64),
so a seed fixes every token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Sampling", "check_sampling", "check_seed", "process_logits", "choose", "softmax"]

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


@dataclass(frozen=True)
class Sampling:
    """Checked settings of the next-token choice (see :func:`check_sampling`)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def check_sampling(do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repetition_penalty: float = 1.0) -> Sampling:
    """The settings as a :class:`Sampling`, or a ValueError that names the bad argument.

    Every argument is checked, whether or not ``do_sample`` uses it.
    """
    if not isinstance(do_sample, (bool, np.bool_)):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    t = _number("temperature", temperature)
    if t <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r} (for greedy decoding "
                         "use do_sample=False)")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 or None (0 or None: no top-k "
                             f"filter), got {top_k!r}")
        top_k = int(top_k) or None  # 0 turns the filter off, as in transformers
    if top_p is not None:
        top_p = _number("top_p", top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if min_p is not None:
        min_p = _number("min_p", min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    r = _number("repetition_penalty", repetition_penalty)
    if r <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    return Sampling(bool(do_sample), t, top_k, top_p, min_p, r)


def check_seed(seed: Any) -> None:
    """Refuse a ``seed`` that is none of None, an int >= 0 (or a sequence of them, as
    ``numpy.random.default_rng`` takes), or a NumPy ``Generator`` (or
    ``BitGenerator``, ``SeedSequence``): TypeError or ValueError naming it."""
    if seed is None or isinstance(seed, (np.random.Generator, np.random.BitGenerator,
                                         np.random.SeedSequence)):
        return
    ints = list(seed) if isinstance(seed, (list, tuple)) and seed else [seed]
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in ints):
        raise TypeError(f"seed must be an int >= 0, a numpy.random.Generator or None, "
                        f"got {seed!r}")
    if any(s < 0 for s in ints):
        raise ValueError(f"seed must be an int >= 0, a numpy.random.Generator or None, "
                         f"got {seed!r}")


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in the dtype of ``x`` (-inf gives 0)."""
    e: np.ndarray = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _top_p_drop(x: np.ndarray, top_p: float) -> np.ndarray:
    """True where top-p filters a token out of the rows of ``x`` (B, V)."""
    order = np.argsort(x, axis=-1, kind="stable")  # ascending
    s = np.take_along_axis(x, order, axis=-1)
    # the cumulative probability from the least probable token (accumulated in float64,
    # as PyTorch's cumsum of float32 does)
    cum = np.cumsum(softmax(s), axis=-1, dtype=np.float64).astype(np.float32)
    drop = cum <= np.float32(1.0 - top_p)
    drop[:, -1] = False  # the most probable token stays
    # a group of equal logits takes the decision of its last (most probable) member
    V = x.shape[-1]
    last = np.ones(s.shape, dtype=bool)
    last[:, :-1] = s[:, 1:] != s[:, :-1]
    end = np.where(last, np.arange(V), V)
    end = np.minimum.accumulate(end[:, ::-1], axis=-1)[:, ::-1]
    drop = np.take_along_axis(drop, end, axis=-1)
    out = np.empty_like(drop)
    np.put_along_axis(out, order, drop, axis=-1)
    return out


def process_logits(logits: np.ndarray, settings: Sampling,
                   seen: np.ndarray | None = None) -> np.ndarray:
    """The processed next-token logits, a new float32 (B, V) array, -inf where filtered.

    Parameters
    ----------
    logits : array (B, V)
        Raw next-token logits.
    settings : Sampling
    seen : bool array (B, V), optional
        The tokens each row has seen (for the repetition penalty).
    """
    x = np.array(logits, dtype=np.float32)  # a copy
    if x.ndim != 2:
        raise ValueError(f"logits must have shape (batch, vocab), got {x.shape}")
    if settings.penalises and seen is not None:
        p = np.float32(settings.repetition_penalty)
        x = np.where(seen, np.where(x < 0, x * p, x / p), x)
    if not settings.do_sample:
        return x
    t = settings.temperature
    if t > 1.0:
        x /= np.float32(t)  # as transformers divides
    elif t < 1.0:
        q = None
        if t >= _FLOAT32_TINY:
            with np.errstate(over="ignore"):
                q = x / np.float32(t)
        if q is not None and not (np.isinf(q) & np.isfinite(x)).any():
            x = q
        else:
            # the quotients overflow float32 (or t is no normal float32): each row less
            # its largest logit, divided in float64, the same softmax; the best token
            # gets 0, what overflows is -inf (probability 0 either way)
            with np.errstate(over="ignore", invalid="ignore"):
                shifted = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
                x = (shifted / t).astype(np.float32)
    neg_inf = np.float32(-np.inf)
    V = x.shape[-1]
    if settings.top_k is not None and settings.top_k < V:
        kth = np.partition(x, V - settings.top_k, axis=-1)[:, V - settings.top_k, None]
        x[x < kth] = neg_inf
    if settings.top_p is not None and settings.top_p < 1.0:
        x[_top_p_drop(x, settings.top_p)] = neg_inf
    if settings.min_p is not None:
        probs = softmax(x)
        drop = probs < np.float32(settings.min_p) * probs.max(axis=-1, keepdims=True)
        drop[np.arange(len(x)), probs.argmax(axis=-1)] = False
        x[drop] = neg_inf
    return x


def choose(processed: np.ndarray, settings: Sampling,
           rng: np.random.Generator | None) -> np.ndarray:
    """The next token of each row (B,) int64: the argmax of the processed logits, or with
    ``do_sample`` one draw from their softmax."""
    tok: np.ndarray
    if not settings.do_sample:
        tok = np.argmax(processed, axis=-1).astype(np.int64)
        return tok
    assert rng is not None
    probs = softmax(processed.astype(np.float64))
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs)) * cdf[:, -1]
    # the first token whose cumulative probability passes u: never one of probability 0
    # (its cumulative probability is its predecessor's), nor past the last one that has
    # some, even when rounding makes u the total
    last = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    tok = np.minimum((cdf <= u[:, None]).sum(axis=-1), last).astype(np.int64)
    return tok


def token_ids(name: str, value: Any, vocab_size: int) -> list[int]:
    """``value`` (None, one token id or a sequence of them) as a list of ids in the
    vocabulary; ValueError naming ``name`` otherwise."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray)):  # (bytes would iterate as ids)
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
    items = [value] if isinstance(value, (int, np.integer)) else value
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}") from None
    for t in items:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, "
                             f"{vocab_size - 1}]")
    return [int(t) for t in items]


class StopStrings:
    """Whether a row's text ends, in its newest tokens, with an occurrence of one of
    ``texts``, as ``tokenizer.decode`` gives the text with its special tokens (so that
    ``<|im_end|>`` is one); an occurrence may begin in the prompt, as transformers'
    stop strings may."""

    def __init__(self, texts: list[str], tokenizer: Any) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        # an occurrence that ends in the newest token spans at most 4 tokens per
        # character (byte-level pieces); a few more leave the window's start, which a
        # tokenizer may decode differently, out of it
        self.window = 4 * max(len(t) for t in texts) + 4
        # tokenizers' decode skips special tokens unless told not to; a decode(ids) of
        # another kind keeps its own way
        try:
            tokenizer.decode([], skip_special_tokens=False)
            self.keep: dict[str, Any] = {"skip_special_tokens": False}
        except TypeError:
            self.keep = {}

    def _text(self, ids: np.ndarray) -> str:
        text: str = self.tokenizer.decode([int(t) for t in ids], **self.keep)
        return text

    def hit(self, before: np.ndarray, new: np.ndarray) -> bool:
        """``before``: the row's prompt tokens (real ones); ``new``: its tokens generated so
        far (the newest last)."""
        new = new[-self.window:]
        before = before[max(0, len(before) - (self.window - len(new))):]
        text = self._text(np.concatenate([before, new]))
        start = len(self._text(before)) if len(before) else 0
        for t in self.texts:  # an occurrence that ends past the prompt's text
            at = text.find(t, max(0, start - len(t) + 1))
            if at >= 0:
                return True
        return False


def check_stop(stop: Any, tokenizer: Any, vocab_size: int) -> tuple[list[int], StopStrings | None]:
    """``stop`` (None, or a list of strings and token ids) split into the ids and the
    strings; strings need a ``tokenizer`` (with ``decode(ids)``)."""
    if stop is None:
        return [], None
    if isinstance(stop, (bytes, bytearray)):  # (would iterate as token ids)
        raise ValueError(f"stop must be a list of strings and token ids, got {stop!r} "
                         "(bytes: decode them to a string)")
    items = [stop] if isinstance(stop, (str, int, np.integer)) else stop
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"stop must be a list of strings and token ids, got {stop!r}") from None
    texts = [s for s in items if isinstance(s, str)]
    if any(not s for s in texts):
        raise ValueError("stop: an empty string would stop at once")
    ids = token_ids("stop", [s for s in items if not isinstance(s, str)], vocab_size)
    if not texts:
        return ids, None
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"stop strings ({texts!r}) need tokenizer= (an object with "
                         "decode(ids) -> str, e.g. a tokenizers.Tokenizer)")
    return ids, StopStrings(texts, tokenizer)
