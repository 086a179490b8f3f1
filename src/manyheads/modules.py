"""Attention modules: one head, a stack of heads, and fused multi-head attention.

Constructor arguments follow the book "Build a Large Language Model (From
Scratch)": ``(d_in, d_out, context_length, dropout, num_heads, qkv_bias)``.
Weights use NumPy's convention ``x @ W`` with ``W`` of shape (d_in, d_out);
they are plain writable arrays that can be read and assigned.

Note on ``d_out``: here ``d_out`` is always the module's total output width.
The book's ``MultiHeadAttentionWrapper(d_in, d_out, ...)`` gives each head
``d_out`` columns (total ``num_heads * d_out``) and has no output projection;
its equivalent is ``StackedMultiHeadAttention(d_in, num_heads * d_out, ...,
out_proj=False)``.

All three modules share one constructor skeleton and one call template
(:class:`_AttentionModule`); each supplies its projections in ``_forward``.
Weights move between them (and in from PyTorch) through one neutral record,
:class:`manyheads.interop.FusedWeights`.
"""
from __future__ import annotations

import json
from typing import Any, TypeVar, cast

import numpy as np

from . import _config, _core, interop
from ._validate import (FLOAT_DTYPES, FLOAT_DTYPES_TEXT, check_bool, check_byte_order,
                        check_dropout, check_factor, check_float_dtype, check_int,
                        check_optional_int, check_optional_real, rng_from_seed, seed_value)
from .cache import CacheStep, KVCache
from .interop import FusedWeights, alibi_slopes

__all__ = ["CausalAttention", "StackedMultiHeadAttention", "MultiHeadAttention"]


def _linear_init(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """PyTorch nn.Linear's default: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / np.sqrt(fan_in) if fan_in > 0 else 0.0
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def _head_columns(h: int, head_dim: int) -> slice:
    """Columns of head ``h`` in a packed (.., num_heads * head_dim) matrix."""
    return slice(h * head_dim, (h + 1) * head_dim)


_SHARED_PARAMETERS = """
    context_length : int
        Longest sequence the module accepts (default 1024), and the highest
        position a cache may reach.
    dropout : float
        Dropout on the attention weights when called with ``training=True``.
    qkv_bias : bool
        Whether the query, key and value projections have biases.
    causal : bool, keyword-only
        True (the default, as in the book): query i sees keys 0..i.  False: an
        encoder layer, every query sees every key (masks still apply).
    window : int, optional, keyword-only
        Sliding window (causal only): each query sees its ``window`` most recent keys.
    rope_theta : float, optional, keyword-only
        Rotary position embeddings on queries and keys with this base
        (Hugging Face's ``rotate_half`` convention, as in Llama and Qwen2);
        positions continue from the cache's length, and keys are cached
        rotated.  None (the default): no rotary embeddings.
    batch_first : bool, keyword-only
        True (the default): inputs and outputs are (B, T, d).  False: (T, B, d),
        like ``torch.nn.MultiheadAttention(batch_first=False)``.
    softcap : float, optional, keyword-only
        Soft cap of the scaled scores, ``c * tanh(s / c)`` (Gemma 2).
    sinks : bool, keyword-only
        Attention sinks (gpt-oss): the module holds ``sinks``, one learned
        logit per head (zeros until set), that joins each row's softmax
        denominator with no value.
    alibi : bool, keyword-only
        ALiBi (BLOOM, MPT): the module holds ``alibi_slopes``, one slope per
        head (the paper's geometric sequence until set), and each score gets
        ``-slope * distance`` between the query's and the key's positions.
    dtype : float32 or float64, keyword-only
    seed : int, numpy Generator or None, keyword-only
        Seeds the weight initialisation and the dropout stream."""


_REPR_ALWAYS = ("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias")
# keyword options, shown by repr only when they differ from these
_REPR_DEFAULTS: dict[str, Any] = {"causal": True, "window": None, "rope_theta": None,
                                  "batch_first": True, "out_proj": True, "scale": None,
                                  "softcap": None, "sinks": False, "alibi": False}


class _AttentionModule:
    """The constructor skeleton, the call template and save/load shared by the modules."""

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    qkv_bias: bool
    causal: bool
    window: int | None
    batch_first: bool
    dtype: np.dtype
    num_heads: int = 1
    scale: float | None = None  # multiplies q.k; None is 1/sqrt(head_dim)
    rope_theta: float | None = None  # rotary position embeddings' base; None: none
    softcap: float | None = None  # c of the scores' soft cap c tanh(s / c); None: none
    sinks: np.ndarray | None = None  # (num_heads,) learned sink logits, or None
    alibi_slopes: np.ndarray | None = None  # (num_heads,) ALiBi slopes, or None
    _rng: np.random.Generator

    def _init_common(self, d_in: Any, d_out: Any, context_length: Any, dropout: Any,
                     qkv_bias: Any, *, causal: Any, window: Any, batch_first: Any, dtype: Any,
                     seed: Any, rope_theta: Any, num_heads: Any = 1, softcap: Any = None,
                     sinks: Any = False, alibi: Any = False) -> None:
        """The settings every module shares; ``num_heads`` None means it was not given."""
        self.d_in = check_int(d_in, "d_in", 1)
        self.d_out = self.d_in if d_out is None else check_int(d_out, "d_out", 1)
        self.context_length = check_int(context_length, "context_length", 1)
        self.dropout = check_dropout(dropout, "dropout")
        if not isinstance(qkv_bias, (bool, np.bool_)):
            one_head = isinstance(self, CausalAttention)
            raise TypeError(f"qkv_bias must be a bool, got {qkv_bias!r}" + (
                " (CausalAttention is one head and takes the book's (d_in, d_out, "
                "context_length, dropout, qkv_bias): no num_heads)" if one_head else ""))
        self.qkv_bias = bool(qkv_bias)
        self.causal = check_bool(causal, "causal")
        self.window = check_optional_int(window, "window", 1)
        if self.window is not None and not self.causal:
            raise ValueError("window needs a causal module (causal=True)")
        self.batch_first = check_bool(batch_first, "batch_first")
        self.dtype = check_float_dtype(dtype)
        self._rng = rng_from_seed(seed)
        self._init_heads(num_heads)
        self._init_rope(rope_theta, self.head_dim)
        self.softcap = check_factor(check_optional_real(softcap, "softcap"), "softcap",
                                    self.dtype)
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be positive, got {self.softcap}")
        self.sinks = np.zeros(self.num_heads, self.dtype) if check_bool(sinks, "sinks") else None
        self.alibi_slopes = alibi_slopes(self.num_heads).astype(self.dtype) \
            if check_bool(alibi, "alibi") else None

    def _init_heads(self, num_heads: Any) -> None:
        if num_heads is None:
            raise TypeError("num_heads is required, e.g. MultiHeadAttention(768, num_heads=12)")
        self.num_heads = check_int(num_heads, "num_heads", 1)
        if self.d_out % self.num_heads:
            raise ValueError(
                f"d_out ({self.d_out}) must be divisible by num_heads ({self.num_heads})"
            )
        self.head_dim = self.d_out // self.num_heads

    def _init_rope(self, rope_theta: Any, head_dim: int) -> None:
        theta = check_optional_real(rope_theta, "rope_theta")
        if theta is not None and theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {theta}")
        if theta is not None and head_dim % 2:
            raise ValueError(f"rotary position embeddings need an even head size, got {head_dim}")
        self.rope_theta = theta

    def __repr__(self) -> str:
        """The book's positional arguments, then every keyword option not at its default."""
        settings = self._settings()
        shown = [f"{k}={settings[k]}" for k in _REPR_ALWAYS if k in settings]
        shown += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                  for k, v in settings.items()
                  if k not in _REPR_ALWAYS + ("dtype",)
                  and (k not in _REPR_DEFAULTS or v != _REPR_DEFAULTS[k])
                  and not (k == "num_kv_heads" and v == settings.get("num_heads"))]
        return f"{type(self).__name__}({', '.join(shown)}, dtype={self.dtype.name})"

    def _rotate(self, q: np.ndarray, k: np.ndarray, step: CacheStep | None) -> None:
        """Rotary position embeddings on q and k (B, H, T, D) in place; positions start
        at the cache's length (0 without a cache), so keys are cached rotated."""
        if self.rope_theta is not None:
            start = 0 if step is None else step.start
            _core.apply_rope(q, self.rope_theta, start)
            _core.apply_rope(k, self.rope_theta, start)

    # -- subclasses ---------------------------------------------------------------------
    def _cache_geometry(self) -> tuple[int, int]:
        """(kv heads, head size) of this module's cache."""
        raise NotImplementedError

    def _forward(self, xq: np.ndarray, kv_in: tuple[np.ndarray, np.ndarray] | None,
                 mask: np.ndarray | None, step: CacheStep | None, training: bool,
                 return_weights: bool, nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(B, T, d_out) output and the weights (or None) of checked (B, T, d_in) queries;
        ``kv_in`` holds separate key and value inputs (B, S, d_in), None for
        self-attention; ``mask`` is in the kernels' convention (see _call_mask)."""
        raise NotImplementedError

    # -- the call template ----------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty KV cache for this module (dtype defaults to the module's).

        It stores only the module's key/value heads, and with a sliding window
        only the last ``window`` tokens (a ring buffer); float16 halves the
        memory of a float32 module's cache.
        """
        kv_heads, head_dim = self._cache_geometry()
        return KVCache(batch_size, max_len, kv_heads, head_dim,
                       self.dtype if dtype is None else dtype, window=self.window)

    def __call__(self, x: Any, key: Any = None, value: Any = None, *, attn_mask: Any = None,
                 key_padding_mask: Any = None, cache: KVCache | None = None,
                 return_weights: bool = False, training: bool = False,
                 num_threads: int | None = None) -> Any:
        """Context vectors of every token.

        Parameters
        ----------
        x : array, shape (B, T, d_in) or (T, d_in)
            The tokens whose queries attend ((T, B, d_in) with ``batch_first=False``).
        key, value : array, shape (B, S, d_in), optional
            Separate inputs for keys and values (cross-attention); by default
            both come from ``x`` (self-attention).
        attn_mask : array, optional
            ``torch.nn.MultiheadAttention``'s convention: boolean True means the
            query may **not** attend the key; a float mask is added to the
            scores.  Shape (T, S), (B * num_heads, T, S) or broadcastable to
            (B, num_heads, T, S).  Combined with the causal mask of a causal
            module.
        key_padding_mask : bool array (B, S), optional
            True marks padding keys (e.g. left padding of short prompts);
            nothing attends to them.
        cache : KVCache, optional
            From ``new_cache()`` (causal self-attention only): x's keys and
            values are appended and its queries attend over everything cached
            (query at absolute position p sees keys 0..p).
        return_weights : bool
            Also return the attention weights.
        training : bool
            Apply dropout to the attention weights (scaled by 1/(1-p)).
        num_threads : int, optional
            Threads for this call; defaults to :func:`manyheads.get_num_threads`.

        Returns
        -------
        out : ndarray, shape (B, T, d_out) or (T, d_out)
        weights : ndarray, with ``return_weights=True``
            (B, num_heads, T, S) or (num_heads, T, S) for the multi-head
            modules, (B, T, S) or (T, S) for one head (S = keys attended).

        A query whose every key is masked gets zeros (PyTorch gives NaN).
        """
        xq, single = self._prepare_input(x, "x")
        B, T, _ = xq.shape
        kv_in = None
        if key is not None or value is not None:
            if key is None or value is None:
                raise ValueError("give both key and value (cross-attention), or neither")
            if cache is not None:
                raise ValueError("a cache serves self-attention: do not give key and value "
                                 "with a cache")
            kb, _ = self._prepare_input(key, "key", single)
            vb, _ = self._prepare_input(value, "value", single)
            if kb.shape[0] != B or vb.shape[:2] != kb.shape[:2]:
                raise ValueError(f"key and value must have the batch of x ({B}) and one length; "
                                 f"got key {kb.shape} and value {vb.shape}")
            kv_in = (kb, vb)
        S = T if kv_in is None else kv_in[0].shape[1]
        pad = self._check_padding(key_padding_mask, B, S)
        training = check_bool(training, "training")
        return_weights = check_bool(return_weights, "return_weights")
        nt = _config.resolve_num_threads(num_threads)
        if cache is None:
            mask = self._call_mask(attn_mask, pad, B, T, S)
            y, w = self._forward(xq, kv_in, mask, None, training, return_weights, nt)
        else:
            self._check_cache_call(cache, attn_mask, B, T)
            with cache.step(T, pad) as step:
                y, w = self._forward(xq, None, None, step, training, return_weights, nt)
        if not self.batch_first:
            y = y.swapaxes(0, 1)
        if single:
            y = y[0] if self.batch_first else y[:, 0]
            w = None if w is None else w[0]
        return (y, w) if return_weights else y

    forward = __call__

    def _prepare_input(self, x: Any, name: str, single: bool | None = None
                       ) -> tuple[np.ndarray, bool]:
        """x as a (B, T, d_in) array of the module's dtype; flag if it was (T, d_in).

        ``single``, if given, is the query input's flag: keys and values must match it.
        """
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
            if x.dtype.kind in "iu":  # lists of numbers, as the functional API takes them
                x = x.astype(self.dtype)
        if x.dtype not in FLOAT_DTYPES:
            check_byte_order(x.dtype, name)
            raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are "
                            f"{FLOAT_DTYPES_TEXT}")
        layout = "(batch, tokens, d_in)" if self.batch_first else "(tokens, batch, d_in)"
        if x.ndim not in (2, 3) or (single is not None and (x.ndim == 2) != single):
            raise ValueError(f"{name} must have shape {layout} or (tokens, d_in)"
                             + ("" if single is None else " like x") + f", got {x.shape}")
        if x.shape[-1] != self.d_in:
            raise ValueError(f"{name} must have d_in={self.d_in} features (last axis), "
                             f"got {x.shape}")
        is_single = x.ndim == 2
        x = x[None] if is_single else (x if self.batch_first else x.swapaxes(0, 1))
        T = x.shape[1]
        if T > self.context_length:
            raise ValueError(self._context_message(f"{name} has {T} tokens"))
        return x.astype(self.dtype, copy=False), is_single

    def _context_message(self, what: str) -> str:
        return (f"{what}, more than context_length={self.context_length}; make the module "
                f"with a larger one: {type(self).__name__}(..., context_length=N) or "
                f"from_torch(module, context_length=N)")

    @staticmethod
    def _check_padding(key_padding_mask: Any, B: int, S: int) -> np.ndarray | None:
        """(B, S) boolean, True = padding key (PyTorch's nn.MultiheadAttention convention)."""
        if key_padding_mask is None:
            return None
        m = np.asarray(key_padding_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_padding_mask must be boolean (True = padding), got {m.dtype}")
        if m.ndim == 1 and B == 1:
            m = m[None]
        if m.shape != (B, S):
            raise ValueError(
                f"key_padding_mask must have shape (batch, keys) = {(B, S)}, got {m.shape}"
            )
        return m

    def _call_mask(self, attn_mask: Any, pad: np.ndarray | None, B: int, T: int, S: int
                   ) -> np.ndarray | None:
        """attn_mask (nn.MultiheadAttention's convention) and key padding as one mask in the
        kernels' convention (bool True = may attend, or float added), (B|1, H|1, T, S)."""
        H = self.num_heads
        m: np.ndarray | None = None
        if attn_mask is not None:
            a = np.asarray(attn_mask)
            if a.dtype != np.bool_ and a.dtype.kind != "f":
                raise TypeError(f"attn_mask must be boolean (True = may not attend) or float "
                                f"(added to the scores), got {a.dtype}")
            if a.ndim == 3 and a.shape[0] == B * H and a.shape[1:] == (T, S):
                a = a.reshape(B, H, T, S)  # torch's (batch * heads, T, S)
            elif a.ndim < 2 or a.ndim > 4 or a.shape[-2:] != (T, S) or \
                    (a.ndim == 4 and a.shape[0] not in (1, B)) or \
                    (a.ndim >= 3 and a.shape[-3] not in (1, H)):
                raise ValueError(f"attn_mask must have shape (T, S) = {(T, S)}, "
                                 f"(B * num_heads, T, S) = {(B * H, T, S)} or broadcast to "
                                 f"(B, num_heads, T, S) = {(B, H, T, S)}; got {a.shape}")
            m = ~a if a.dtype == np.bool_ else a.astype(self.dtype)
            m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        if pad is not None and pad.any():
            keep = ~pad[:, None, None, :]
            if m is None:
                m = keep
            elif m.dtype == np.bool_:
                m = m & keep
            else:
                m = m + np.where(keep, 0, -np.inf).astype(self.dtype)
        return m

    def _check_cache_call(self, cache: Any, attn_mask: Any, B: int, T: int) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(), got {type(cache).__name__}")
        if not self.causal:
            raise ValueError("a KV cache serves causal modules; this one has causal=False")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with a cache (use key_padding_mask "
                             "for padding)")
        kv_heads, head_dim = self._cache_geometry()
        cache.check_compatible(batch=B, num_kv_heads=kv_heads, head_dim=head_dim,
                               dtype=self.dtype, window=self.window, new_tokens=T)
        if len(cache) + T > self.context_length:
            raise ValueError(self._context_message(
                f"the cache holds {len(cache)} tokens and x adds {T}"))

    def _dropout_for_call(self, training: bool) -> tuple[float, int]:
        """(p, seed) of this call's dropout stream: (0, 0) unless training with dropout."""
        if training and self.dropout > 0:
            return self.dropout, seed_value(self._rng)
        return 0.0, 0

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                step: CacheStep | None, *, heads: slice = slice(None), p: float, seed: int,
                return_weights: bool, nt: int, out: np.ndarray | None = None) -> Any:
        """Attention of q over k, v (and the cache): (B, H, T, D) arrays."""
        scale = 1.0 / np.sqrt(q.shape[-1]) if self.scale is None else self.scale
        features = None
        if self.softcap is not None or self.sinks is not None or self.alibi_slopes is not None:
            features = (self.softcap, self.sinks, self.alibi_slopes, False)
        if step is not None:
            return step.attend(q, k, v, heads, scale=scale, num_threads=nt, out=out,
                               return_weights=return_weights, dropout_p=p, seed=seed,
                               features=features)
        # (without a cache the queries and keys are the same positions: aligned causally)
        return _core.attention(q, k, v, mask=mask, causal_offset=0 if self.causal else None,
                               window=self.window, scale=scale, dropout_p=p, seed=seed,
                               enable_gqa=q.shape[1] != k.shape[1],
                               return_weights=return_weights, num_threads=nt, out=out,
                               features=features)

    # -- save and load ------------------------------------------------------------------------
    FORMAT_VERSION = 2

    def _settings(self) -> dict[str, Any]:
        """Constructor keywords that rebuild this module (weights aside)."""
        return dict(d_in=self.d_in, d_out=self.d_out, context_length=self.context_length,
                    dropout=self.dropout, qkv_bias=self.qkv_bias, causal=self.causal,
                    window=self.window, rope_theta=self.rope_theta,
                    batch_first=self.batch_first, softcap=self.softcap,
                    sinks=self.sinks is not None, alibi=self.alibi_slopes is not None,
                    dtype=self.dtype.name)

    def _score_weights(self) -> dict[str, np.ndarray]:
        """The sinks and ALiBi slopes, when the module has them (saved with the weights)."""
        arrays = {}
        if self.sinks is not None:
            arrays["sinks"] = self.sinks
        if self.alibi_slopes is not None:
            arrays["alibi_slopes"] = self.alibi_slopes
        return arrays

    def _weights(self) -> dict[str, np.ndarray]:
        """Every weight array by a stable name."""
        raise NotImplementedError

    def save(self, path: Any) -> None:
        """Write the module to an ``.npz`` file: its weights and settings (JSON), no pickle."""
        meta = {"format": self.FORMAT_VERSION, "module": type(self).__name__,
                "settings": self._settings()}
        # values typed Any: np.savez's stub would match a str-keyed **dict against its
        # `allow_pickle: bool` parameter as well as against the arrays (**kwds)
        arrays: dict[str, Any] = dict(self._weights())
        for name, a in arrays.items():  # (np.savez would pickle the others, or write bytes
            # that load cannot read back)
            if not isinstance(a, np.ndarray) or a.dtype.name not in ("float16", "float32",
                                                                     "float64"):
                what = a.dtype.name if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"save() writes float16, float32 or float64 arrays; {name} is "
                                 f"{what}: widen it first (.astype(np.float32), or "
                                 ".dequantize() for an Int8Weight)")
        arrays["manyheads_module"] = np.array(json.dumps(meta))
        np.savez(path, **arrays)

    @classmethod
    def load(cls: type[_M], path: Any) -> _M:
        """Read a module written by :meth:`save`; a wrong module, version or shape raises ValueError."""
        with np.load(path, allow_pickle=False) as f:
            if "manyheads_module" not in f.files:
                if cls is MultiHeadAttention and "meta" in f.files:
                    return cast(_M, MultiHeadAttention._load_v1(path, f))
                raise ValueError(f"{path}: not a manyheads module file")
            meta = json.loads(str(f["manyheads_module"]))
            if meta.get("format") != cls.FORMAT_VERSION:
                raise ValueError(f"{path}: format version {meta.get('format')} is not "
                                 f"{cls.FORMAT_VERSION}")
            if meta.get("module") != cls.__name__:
                raise ValueError(f"{path} holds a {meta.get('module')}, not a {cls.__name__}: "
                                 f"load it with {meta.get('module')}.load")
            m = cast(_M, cast(Any, cls)(**meta["settings"], seed=0))
            for name, target in m._weights().items():
                if name not in f.files or f[name].shape != target.shape:
                    raise ValueError(f"{path}: {name} is missing or has the wrong shape "
                                     f"(expected {target.shape})")
                target[...] = f[name]
        return m


_M = TypeVar("_M", bound=_AttentionModule)


class _HeadBias:
    """``b_query``/``b_key``/``b_value`` of a single head: an array with ``qkv_bias=True``,
    else None.  Assigning one to a head made without biases is a ValueError (the
    forward pass would have used it and :meth:`save` dropped it), as is removing one."""

    def __set_name__(self, owner: Any, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, objtype: Any = None) -> np.ndarray | None:
        if obj is None:
            return self  # type: ignore[return-value]
        value: np.ndarray | None = obj.__dict__.get(self.slot)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        if (value is None) == bool(obj.qkv_bias):
            raise ValueError(
                f"this head has no query, key and value biases (qkv_bias=False): {self.name} "
                "cannot be set; make it with qkv_bias=True" if value is not None else
                f"{self.name} cannot be removed: make the head with qkv_bias=False")
        obj.__dict__[self.slot] = value


class CausalAttention(_AttentionModule):
    __doc__ = """One head of (by default causal) self-attention: the book's ``CausalAttention``.

    Parameters
    ----------
    d_in : int
        Input features per token.
    d_out : int, optional
        Width of this head's queries, keys, values and output (default: d_in).""" + \
        _SHARED_PARAMETERS + """

    Attributes
    ----------
    W_query, W_key, W_value : ndarray, shape (d_in, d_out)
    b_query, b_key, b_value : ndarray, shape (d_out,), or None
    """

    def __init__(self, d_in: int, d_out: int | None = None, context_length: int = 1024,
                 dropout: float = 0.0, qkv_bias: bool = False, *, causal: bool = True,
                 window: int | None = None, rope_theta: float | None = None,
                 batch_first: bool = True, softcap: float | None = None, sinks: bool = False,
                 alibi: bool = False, dtype: Any = np.float32, seed: Any = None) -> None:
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, causal=causal,
                          window=window, batch_first=batch_first, dtype=dtype, seed=seed,
                          rope_theta=rope_theta, softcap=softcap, sinks=sinks, alibi=alibi)
        rng, shape = self._rng, (self.d_in, self.d_out)
        self.W_query = _linear_init(rng, self.d_in, shape, self.dtype)
        self.W_key = _linear_init(rng, self.d_in, shape, self.dtype)
        self.W_value = _linear_init(rng, self.d_in, shape, self.dtype)
        if self.qkv_bias:
            self.b_query = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)
            self.b_key = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)
            self.b_value = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)

    b_query = _HeadBias()
    b_key = _HeadBias()
    b_value = _HeadBias()

    @classmethod
    def from_torch(cls, module: Any, *, causal: bool = True, context_length: int | None = None,
                   dtype: Any = np.float32) -> "CausalAttention":
        """A head with the weights of the book's single-head ``CausalAttention`` (PyTorch).

        Parameters
        ----------
        module : torch module
            With ``W_query``, ``W_key`` and ``W_value`` ``nn.Linear`` layers (biases on
            some of them: the others' are zero) and no heads or output projection.
            Anything else raises TypeError; multi-head modules import with
            :meth:`MultiHeadAttention.from_torch`.
        causal : bool
            The book's head is causal (default True).
        context_length : int, optional
            Defaults to the size of the source's ``mask`` buffer, else 1024.
        dtype : float32 or float64

        Its dropout probability comes along; its output equals the source's.
        """
        parts, dropout = interop.book_head(module, dtype)
        check_bool(causal, "causal")
        (W_q, b_q), (W_k, b_k), (W_v, b_v) = parts
        biased = any(b is not None for _, b in parts)
        m = cls(W_q.shape[0], W_q.shape[1], context_length or interop.context_length_of(module),
                dropout, biased, causal=bool(causal), dtype=dtype, seed=0)
        for name, (W, b) in zip(("query", "key", "value"), parts):
            getattr(m, "W_" + name)[...] = W
            if biased:
                getattr(m, "b_" + name)[...] = 0.0 if b is None else b
        return m

    def _cache_geometry(self) -> tuple[int, int]:
        return 1, self.d_out

    def _weights(self) -> dict[str, np.ndarray]:
        names = ("W_query", "W_key", "W_value") + (("b_query", "b_key", "b_value")
                                                   if self.qkv_bias else ())
        return dict({n: getattr(self, n) for n in names}, **self._score_weights())

    def _project(self, x: np.ndarray, W: np.ndarray, b: np.ndarray | None, nt: int
                 ) -> np.ndarray:
        return _core.linear(x, W.astype(self.dtype, copy=False),
                            None if b is None else b.astype(self.dtype, copy=False), nt)[:, None]

    def _head_forward(self, xq: np.ndarray, kv_in: tuple[np.ndarray, np.ndarray] | None,
                      mask: np.ndarray | None, step: CacheStep | None, heads: slice,
                      training: bool, return_weights: bool, nt: int) -> Any:
        """(B, 1, T, d_out) context (and (B, 1, T, S) weights) of this head."""
        p, seed = self._dropout_for_call(training)
        kb, vb = (xq, xq) if kv_in is None else kv_in
        q = self._project(xq, self.W_query, self.b_query, nt)
        k = self._project(kb, self.W_key, self.b_key, nt)
        v = self._project(vb, self.W_value, self.b_value, nt)
        self._rotate(q, k, step)
        return self._attend(q, k, v, mask, step, heads=heads, p=p, seed=seed,
                            return_weights=return_weights, nt=nt)

    def _forward(self, xq: np.ndarray, kv_in: tuple[np.ndarray, np.ndarray] | None,
                 mask: np.ndarray | None, step: CacheStep | None, training: bool,
                 return_weights: bool, nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        res = self._head_forward(xq, kv_in, mask, step, slice(None), training, return_weights,
                                 nt)
        if return_weights:
            return res[0][:, 0], res[1][:, 0]
        return res[:, 0], None


class StackedMultiHeadAttention(_AttentionModule):
    __doc__ = """Multi-head attention as independent single-head modules run side by side.

    Each of the ``num_heads`` heads is a :class:`CausalAttention` with its own
    query, key and value weights and ``head_dim = d_out // num_heads`` columns.
    Their context vectors Z_1, ..., Z_h are concatenated into one matrix Z of
    width ``d_out``, followed by the output projection ``Z @ W_out + b_out``
    unless ``out_proj=False`` (which gives the book's ``MultiHeadAttentionWrapper``
    with per-head width ``d_out // num_heads``).

    Parameters
    ----------
    d_in : int
        Input features per token.
    d_out : int, optional
        Total width, every head's columns side by side (default: d_in).
    num_heads : int
        Required; ``d_out`` must be a multiple.""" + _SHARED_PARAMETERS + """
    out_proj : bool, keyword-only
        Whether Z passes through the output projection (default True).

    Attributes
    ----------
    heads : list of CausalAttention
    W_out : ndarray (d_out, d_out) or None
    b_out : ndarray (d_out,) or None
    """

    def __init__(self, d_in: int, d_out: int | None = None, context_length: int = 1024,
                 dropout: float = 0.0, num_heads: int | None = None, qkv_bias: bool = False, *,
                 out_proj: bool = True, causal: bool = True, window: int | None = None,
                 rope_theta: float | None = None, batch_first: bool = True,
                 softcap: float | None = None, sinks: bool = False, alibi: bool = False,
                 dtype: Any = np.float32, seed: Any = None) -> None:
        # (each head holds its own sink and ALiBi slope)
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, causal=causal,
                          window=window, batch_first=batch_first, dtype=dtype, seed=seed,
                          rope_theta=rope_theta, num_heads=num_heads, softcap=softcap)
        rng = self._rng
        with_sinks, with_alibi = check_bool(sinks, "sinks"), check_bool(alibi, "alibi")
        self.heads = [
            CausalAttention(self.d_in, self.head_dim, self.context_length, self.dropout,
                            self.qkv_bias, causal=self.causal, window=self.window,
                            rope_theta=self.rope_theta, softcap=self.softcap, sinks=with_sinks,
                            alibi=with_alibi, dtype=self.dtype, seed=rng)
            for _ in range(self.num_heads)
        ]
        if with_alibi:  # head h takes the h-th slope of the whole module's sequence
            self.alibi_slopes = alibi_slopes(self.num_heads)
        self.W_out: np.ndarray | None = None
        self.b_out: np.ndarray | None = None
        if out_proj:
            self.W_out = _linear_init(rng, self.d_out, (self.d_out, self.d_out), self.dtype)
            self.b_out = _linear_init(rng, self.d_out, (self.d_out,), self.dtype)

    def _cache_geometry(self) -> tuple[int, int]:
        return self.num_heads, self.head_dim

    def _per_head(self, name: str) -> np.ndarray | None:
        heads = getattr(self, "heads", None)
        if not heads or getattr(heads[0], name) is None:
            return None
        return np.concatenate([getattr(h, name) for h in heads])

    def _set_per_head(self, name: str, value: Any) -> None:
        if value is None:  # (the shared constructor's default, before the heads exist)
            if self._per_head(name) is not None:
                raise ValueError(f"{name} cannot be removed: make the module with "
                                 f"{name.split('_')[0]}=False")
            return
        if self._per_head(name) is None:
            raise ValueError(f"this module has no {name}: make it with "
                             f"{name.split('_')[0]}=True")
        for h, head in enumerate(self.heads):
            getattr(head, name)[...] = np.asarray(value)[h]

    @property
    def sinks(self) -> np.ndarray | None:
        """The heads' sink logits side by side (a copy; assign to set them), or None."""
        return self._per_head("sinks")

    @sinks.setter
    def sinks(self, value: Any) -> None:
        self._set_per_head("sinks", value)

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        """The heads' ALiBi slopes side by side (a copy; assign to set them), or None."""
        return self._per_head("alibi_slopes")

    @alibi_slopes.setter
    def alibi_slopes(self, value: Any) -> None:
        self._set_per_head("alibi_slopes", value)

    def _settings(self) -> dict[str, Any]:
        return dict(super()._settings(), num_heads=self.num_heads,
                    out_proj=self.W_out is not None)

    def _weights(self) -> dict[str, np.ndarray]:
        arrays = {f"heads.{h}.{n}": a for h, head in enumerate(self.heads)
                  for n, a in head._weights().items()}
        if self.W_out is not None and self.b_out is not None:
            arrays.update(W_out=self.W_out, b_out=self.b_out)
        return arrays

    def _forward(self, xq: np.ndarray, kv_in: tuple[np.ndarray, np.ndarray] | None,
                 mask: np.ndarray | None, step: CacheStep | None, training: bool,
                 return_weights: bool, nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        def head_mask(h: int) -> np.ndarray | None:
            return mask if mask is None or mask.shape[1] == 1 else mask[:, h:h + 1]

        # each head draws its own dropout stream, as independent modules would
        results = [head._head_forward(xq, kv_in, head_mask(h), step, slice(h, h + 1), training,
                                      return_weights, nt) for h, head in enumerate(self.heads)]
        w = None
        if return_weights:
            Z = np.concatenate([r[0][:, 0] for r in results], axis=-1)
            w = np.concatenate([r[1] for r in results], axis=1)
        else:
            Z = np.concatenate([r[:, 0] for r in results], axis=-1)
        if self.W_out is not None:
            Z = _core.linear(Z, self.W_out, self.b_out, nt)
        return Z, w

    # -- weights in and out ----------------------------------------------------------------
    def to_weights(self) -> FusedWeights:
        """Every head's weights packed side by side (copies), plus the output projection."""
        def packed(name: str, axis: int) -> Any:
            parts = [getattr(h, name) for h in self.heads]
            return None if parts[0] is None else np.concatenate(parts, axis=axis)

        return FusedWeights(
            d_in=self.d_in, d_out=self.d_out, num_heads=self.num_heads,
            W_q=packed("W_query", 1), W_k=packed("W_key", 1), W_v=packed("W_value", 1),
            b_q=packed("b_query", 0), b_k=packed("b_key", 0), b_v=packed("b_value", 0),
            W_out=None if self.W_out is None else self.W_out.copy(),
            b_out=None if self.b_out is None else self.b_out.copy(),
            scale=None, dropout=self.dropout, rope_theta=self.rope_theta, causal=self.causal,
            softcap=self.softcap, sinks=self.sinks, alibi_slopes=self.alibi_slopes)

    @classmethod
    def from_weights(cls, w: FusedWeights, context_length: int = 1024, *,
                     window: int | None = None, batch_first: bool = True,
                     dtype: Any = np.float32) -> "StackedMultiHeadAttention":
        """A stack whose head h gets columns h*D..(h+1)*D of the packed weights (copied)."""
        if w.scale is not None and not np.isclose(w.scale, (w.d_out // w.num_heads) ** -0.5):
            raise ValueError("a stack of heads uses the scale 1/sqrt(head_dim); use a fused "
                             "MultiHeadAttention for this module")
        if w.W_k.shape[1] != w.d_out or (w.W_out is not None and w.W_out.shape[1] != w.d_out):
            raise ValueError("a stack of independent heads needs a key and value head per "
                             "query head and an output as wide as d_out; use a fused "
                             "MultiHeadAttention for this module")
        window = w.window if window is None else window
        st = cls(w.d_in, w.d_out, context_length, w.dropout, w.num_heads, w.b_q is not None,
                 out_proj=w.W_out is not None, causal=w.causal, window=window,
                 rope_theta=w.rope_theta, batch_first=batch_first, softcap=w.softcap,
                 sinks=w.sinks is not None, alibi=w.alibi_slopes is not None, dtype=dtype,
                 seed=0)
        if w.sinks is not None:
            st.sinks = w.sinks
        if w.alibi_slopes is not None:
            st.alibi_slopes = w.alibi_slopes
        for h, head in enumerate(st.heads):
            c = _head_columns(h, st.head_dim)
            head.W_query[...], head.W_key[...], head.W_value[...] = w.W_q[:, c], w.W_k[:, c], w.W_v[:, c]
            if w.b_q is not None:
                assert w.b_k is not None and w.b_v is not None
                head.b_query, head.b_key, head.b_value = (
                    b[c].astype(st.dtype) for b in (w.b_q, w.b_k, w.b_v))
        if st.W_out is not None:
            st.W_out[...] = w.W_out
            st.b_out = np.zeros(st.d_out, st.dtype) if w.b_out is None else w.b_out.astype(st.dtype)
        return st

    @classmethod
    def from_torch(cls, module: Any, *, causal: bool | None = None,
                   context_length: int | None = None,
                   dtype: Any = np.float32) -> "StackedMultiHeadAttention":
        """A stack of heads with the weights of a PyTorch attention module.

        Same sources and arguments as :meth:`MultiHeadAttention.from_torch`;
        the book's wrapper becomes a stack without output projection.
        """
        w, ctx, batch_first = interop.import_module(module, causal=causal, dtype=dtype)
        return cls.from_weights(w, context_length or ctx, batch_first=batch_first, dtype=dtype)

    def to_fused(self) -> "MultiHeadAttention":
        """A :class:`MultiHeadAttention` with the same weights (copied) and outputs.

        A stack without output projection maps to a fused module whose output
        projection is the identity.
        """
        return MultiHeadAttention.from_weights(self.to_weights(), self.context_length,
                                               window=self.window, batch_first=self.batch_first,
                                               dtype=self.dtype)


class _PackedWeight:
    """``W_query``/``W_key``/``W_value`` of a fused module: a view of its columns of
    ``W_qkv``; assigning to the attribute writes into the packed buffer."""

    def __init__(self, part: int) -> None:
        self.part = part

    def __get__(self, obj: Any, objtype: Any = None) -> np.ndarray:
        view: np.ndarray = obj._qkv_columns(self.part)
        return view

    def __set__(self, obj: Any, value: Any) -> None:
        obj._qkv_columns(self.part)[...] = value


class _PackedBias:
    """``b_query``/``b_key``/``b_value`` of a fused module: a view into ``b_qkv`` or None;
    assigning to the attribute writes into ``b_qkv``, as the weights' views do (it had
    made an attribute of its own, which the module never read)."""

    NAMES = ("b_query", "b_key", "b_value")

    def __init__(self, part: int) -> None:
        self.part = part

    def __get__(self, obj: Any, objtype: Any = None) -> np.ndarray | None:
        return None if obj.b_qkv is None else obj.b_qkv[obj._cols(self.part)]

    def __set__(self, obj: Any, value: Any) -> None:
        if obj.b_qkv is None:
            raise ValueError(f"this module has no query, key and value biases (qkv_bias=False): "
                             f"{self.NAMES[self.part]} cannot be set; make one with "
                             "qkv_bias=True")
        obj.b_qkv[obj._cols(self.part)] = value


class MultiHeadAttention(_AttentionModule):
    __doc__ = """Fused multi-head attention (the book's ``MultiHeadAttention``), causal by default.

    All heads' query, key and value weights live in one packed buffer
    ``W_qkv`` of shape (d_in, d_out + 2 * kv_dim); ``W_query``, ``W_key`` and
    ``W_value`` are views into it, so writing into them updates the module.
    One matrix product projects every head, one kernel call attends every
    head (reading Q, K, V as strided views of the projection and writing the
    merged-heads layout), and the output projection follows.  With separate
    key and value inputs (cross-attention) the three projections run apart.

    Parameters
    ----------
    d_in : int
        Input features per token.
    d_out : int, optional
        Total width (default: d_in); ``head_dim = d_out // num_heads``.
    num_heads : int
        Required; ``d_out`` must be a multiple.""" + _SHARED_PARAMETERS + """
    num_kv_heads : int, optional, keyword-only
        Grouped-query attention: ``num_heads`` must be a multiple; query head
        ``h`` uses key/value head ``h // (num_heads // num_kv_heads)``.
        Defaults to ``num_heads``.
    scale : float, optional, keyword-only
        Multiplies the query-key products; defaults to ``1 / sqrt(head_dim)``.
    out_features : int, optional, keyword-only
        Width of the output projection's result (default: d_out).  Layers whose
        heads are together wider or narrower than the model (Gemma 2, gpt-oss)
        project back to the model's width.

    Attributes
    ----------
    W_query : ndarray (d_in, d_out)
    W_key, W_value : ndarray (d_in, num_kv_heads * head_dim)
    b_query, b_key, b_value : ndarray or None
    W_out : ndarray (d_out, out_features)
    b_out : ndarray (out_features,)
    """

    W_query = _PackedWeight(0)
    W_key = _PackedWeight(1)
    W_value = _PackedWeight(2)
    b_query = _PackedBias(0)
    b_key = _PackedBias(1)
    b_value = _PackedBias(2)

    def __init__(self, d_in: int, d_out: int | None = None, context_length: int = 1024,
                 dropout: float = 0.0, num_heads: int | None = None, qkv_bias: bool = False, *,
                 num_kv_heads: int | None = None, causal: bool = True,
                 window: int | None = None, scale: float | None = None,
                 rope_theta: float | None = None, batch_first: bool = True,
                 softcap: float | None = None, sinks: bool = False, alibi: bool = False,
                 out_features: int | None = None, dtype: Any = np.float32,
                 seed: Any = None) -> None:
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, causal=causal,
                          window=window, batch_first=batch_first, dtype=dtype, seed=seed,
                          rope_theta=rope_theta, num_heads=num_heads, softcap=softcap,
                          sinks=sinks, alibi=alibi)
        self.scale = check_factor(check_optional_real(scale, "scale"), "scale", self.dtype)
        self.out_features = check_optional_int(out_features, "out_features", 1) or self.d_out
        kvh = check_optional_int(num_kv_heads, "num_kv_heads", 1) or self.num_heads
        if self.num_heads % kvh:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kvh})"
            )
        self.num_kv_heads = kvh
        self.kv_dim = kvh * self.head_dim
        rng = self._rng
        width = self.d_out + 2 * self.kv_dim
        self.W_qkv = np.empty((self.d_in, width), dtype=self.dtype)
        self.W_qkv[:, : self.d_out] = _linear_init(rng, self.d_in, (self.d_in, self.d_out),
                                                   self.dtype)
        self.W_qkv[:, self.d_out:] = _linear_init(rng, self.d_in, (self.d_in, 2 * self.kv_dim),
                                                  self.dtype)
        self.b_qkv: np.ndarray | None = None
        if self.qkv_bias:
            self.b_qkv = _linear_init(rng, self.d_in, (width,), self.dtype)
        self.W_out = _linear_init(rng, self.d_out, (self.d_out, self.out_features), self.dtype)
        self.b_out = _linear_init(rng, self.d_out, (self.out_features,), self.dtype)

    def _qkv_columns(self, part: int) -> np.ndarray:
        """The columns of W_qkv of the queries (0), keys (1) or values (2): a view."""
        if not isinstance(self.W_qkv, np.ndarray):
            raise TypeError(f"{('W_query', 'W_key', 'W_value')[part]} and cross-attention "
                            f"take columns of W_qkv, of type {type(self.W_qkv).__name__} "
                            "here; read them from W_qkv.dequantize()")
        view: np.ndarray = self.W_qkv[:, self._cols(part)]
        return view

    def _cols(self, part: int) -> slice:
        """Columns of part 0 (queries), 1 (keys) or 2 (values) in the packed projection."""
        starts = (0, self.d_out, self.d_out + self.kv_dim, self.d_out + 2 * self.kv_dim)
        return slice(starts[part], starts[part + 1])

    def _cache_geometry(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    def _settings(self) -> dict[str, Any]:
        extra = {} if self.out_features == self.d_out else {"out_features": self.out_features}
        return dict(super()._settings(), num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, scale=self.scale, **extra)

    def _weights(self) -> dict[str, np.ndarray]:
        arrays = {"W_qkv": self.W_qkv, "W_out": self.W_out, "b_out": self.b_out}
        if self.b_qkv is not None:
            arrays["b_qkv"] = self.b_qkv
        return dict(arrays, **self._score_weights())

    def _forward(self, xq: np.ndarray, kv_in: tuple[np.ndarray, np.ndarray] | None,
                 mask: np.ndarray | None, step: CacheStep | None, training: bool,
                 return_weights: bool, nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        B, T, _ = xq.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        p, seed = self._dropout_for_call(training)
        if kv_in is None:
            # one GEMM projects every head: (B, T, d_out + 2 kv_dim)
            qkv = _core.linear(xq, self.W_qkv, self.b_qkv, nt)
            kv0, kv1 = self.d_out, self.d_out + self.kv_dim
            q_all, k_all, v_all = qkv[..., :kv0], qkv[..., kv0:kv1], qkv[..., kv1:]
        else:  # cross-attention: queries from x, keys and values from their own inputs
            q_all, k_all, v_all = (_core.linear(inp, self._qkv_columns(i),
                                                None if self.b_qkv is None
                                                else self.b_qkv[self._cols(i)], nt)
                                   for i, inp in enumerate((xq,) + kv_in))
        S = k_all.shape[1]
        # strided (B, heads, T, D) views of the packed projection: no copies
        q = q_all.reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = k_all.reshape(B, S, Hkv, D).transpose(0, 2, 1, 3)
        v = v_all.reshape(B, S, Hkv, D).transpose(0, 2, 1, 3)
        self._rotate(q, k, step)
        merged = np.empty((B, T, H * D), dtype=self.dtype)  # the kernel writes heads merged
        res = self._attend(q, k, v, mask, step, p=p, seed=seed, return_weights=return_weights,
                           nt=nt, out=merged.reshape(B, T, H, D).transpose(0, 2, 1, 3))
        y = _core.linear(merged, self.W_out, self.b_out, nt)
        return y, (res[1] if return_weights else None)

    # -- weights in and out ----------------------------------------------------------------
    def to_weights(self) -> FusedWeights:
        """The module's weights (copies) as a :class:`~manyheads.interop.FusedWeights`."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError("to_weights() needs num_kv_heads == num_heads; independent "
                             "heads cannot share key/value weights")
        bias = [None if b is None else b.copy() for b in (self.b_query, self.b_key, self.b_value)]
        return FusedWeights(d_in=self.d_in, d_out=self.d_out, num_heads=self.num_heads,
                            W_q=self.W_query.copy(), W_k=self.W_key.copy(),
                            W_v=self.W_value.copy(), b_q=bias[0], b_k=bias[1], b_v=bias[2],
                            W_out=self.W_out.copy(), b_out=self.b_out.copy(), scale=self.scale,
                            dropout=self.dropout, rope_theta=self.rope_theta, causal=self.causal,
                            softcap=self.softcap,
                            sinks=None if self.sinks is None else self.sinks.copy(),
                            alibi_slopes=None if self.alibi_slopes is None
                            else self.alibi_slopes.copy(), window=self.window)

    @classmethod
    def from_weights(cls, w: FusedWeights, context_length: int = 1024, *,
                     window: int | None = None, batch_first: bool = True,
                     dtype: Any = np.float32) -> "MultiHeadAttention":
        """A fused module with these weights (copied); no output projection becomes the
        identity.  Grouped key/value heads and the output width follow the weights'
        shapes; ``window`` defaults to the weights' own."""
        head_dim = w.d_out // w.num_heads
        m = cls(w.d_in, w.d_out, context_length, w.dropout, w.num_heads, w.b_q is not None,
                num_kv_heads=w.W_k.shape[1] // head_dim, causal=w.causal,
                window=w.window if window is None else window, scale=w.scale,
                rope_theta=w.rope_theta, batch_first=batch_first, softcap=w.softcap,
                sinks=w.sinks is not None, alibi=w.alibi_slopes is not None,
                out_features=None if w.W_out is None else w.W_out.shape[1], dtype=dtype,
                seed=0)
        for name in ("sinks", "alibi_slopes"):
            if getattr(w, name) is not None:
                getattr(m, name)[...] = getattr(w, name)
        m.W_query, m.W_key, m.W_value = w.W_q, w.W_k, w.W_v
        if m.b_qkv is not None:
            assert w.b_q is not None and w.b_k is not None and w.b_v is not None
            m.b_qkv[...] = np.concatenate([w.b_q, w.b_k, w.b_v])
        m.W_out[...] = np.eye(m.d_out) if w.W_out is None else w.W_out
        m.b_out[...] = 0 if w.b_out is None else w.b_out
        return m

    @classmethod
    def from_torch(cls, module: Any, *, causal: bool | None = None,
                   context_length: int | None = None,
                   dtype: Any = np.float32) -> "MultiHeadAttention":
        """A fused module with the weights of a PyTorch attention module.

        Parameters
        ----------
        module : torch module
            ``torch.nn.MultiheadAttention``, the book's fused ``MultiHeadAttention``,
            the book's ``MultiHeadAttentionWrapper`` (its heads become the fused
            heads; the output projection is the identity), Hugging Face GPT-2
            attention, or a Hugging Face decoder attention layer with
            ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (Llama, Mistral, Qwen2,
            Gemma 2, gpt-oss and the like: grouped heads, biases, the layer's
            scaling, sliding window, soft cap and sinks, plain rotary embeddings
            and the output width come along; per-head q/k norms and scaled
            rotary embeddings are refused), or BLOOM, Falcon or MPT attention
            (their ALiBi slopes come along).  Anything else raises TypeError.
        causal : bool
            Required for ``nn.MultiheadAttention``, which does not record it
            (its mask comes at call time): True for a decoder, False for an
            encoder.  The book's modules and GPT-2 are causal by construction.
        context_length : int, optional
            Defaults to the source's (the book's mask buffer, GPT-2's
            ``n_positions``), else 1024.
        dtype : float32 or float64

        A ``batch_first=False`` source gives a module that also takes and
        returns (T, B, d).  The imported module's output equals the source's.
        """
        w, ctx, batch_first = interop.import_module(module, causal=causal, dtype=dtype)
        return cls.from_weights(w, context_length or ctx, batch_first=batch_first, dtype=dtype)

    def to_stacked(self) -> StackedMultiHeadAttention:
        """A :class:`StackedMultiHeadAttention` with the same weights (copied) and outputs."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "to_stacked() needs num_kv_heads == num_heads; independent heads cannot "
                "share key/value weights"
            )
        if self.scale is not None and not np.isclose(self.scale, self.head_dim ** -0.5):
            raise ValueError("to_stacked() needs the default scale 1/sqrt(head_dim)")
        if self.out_features != self.d_out:
            raise ValueError("to_stacked() needs out_features == d_out (a stack's output "
                             "projection keeps the width)")
        w = self.to_weights()
        w.scale = None
        return StackedMultiHeadAttention.from_weights(w, self.context_length, window=self.window,
                                                      batch_first=self.batch_first,
                                                      dtype=self.dtype)

    @staticmethod
    def _load_v1(path: Any, f: Any) -> "MultiHeadAttention":
        """A fused module from the first file format (an int64 meta array)."""
        meta = f["meta"]
        if meta.shape != (7,) or int(meta[0]) != 1:
            raise ValueError(f"{path}: format version {meta[:1].tolist()} is not understood")
        _, d_in, d_out, ctx, H, Hkv, window = (int(x) for x in meta)
        scale = float(f["scale"])
        m = MultiHeadAttention(d_in, d_out, ctx, float(f["dropout"]), H, "b_qkv" in f.files,
                               num_kv_heads=Hkv, window=None if window < 0 else window,
                               scale=None if np.isnan(scale) else scale,
                               dtype=f["W_qkv"].dtype, seed=0)
        for name, target in m._weights().items():
            if f[name].shape != target.shape:
                raise ValueError(f"{path}: {name} has shape {f[name].shape}, expected "
                                 f"{target.shape}")
            target[...] = f[name]
        return m
