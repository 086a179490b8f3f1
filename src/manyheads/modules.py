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

from typing import Any

import numpy as np

from . import _config, _core, interop
from ._validate import (FLOAT_DTYPES, FLOAT_DTYPES_TEXT, check_bool, check_dropout,
                        check_float_dtype, check_int, check_optional_int, check_optional_real,
                        rng_from_seed, seed_value)
from .cache import CacheStep, KVCache
from .interop import FusedWeights

__all__ = ["CausalAttention", "StackedMultiHeadAttention", "MultiHeadAttention"]


def _linear_init(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """PyTorch nn.Linear's default: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / np.sqrt(fan_in) if fan_in > 0 else 0.0
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def _head_columns(h: int, head_dim: int) -> slice:
    """Columns of head ``h`` in a packed (.., num_heads * head_dim) matrix."""
    return slice(h * head_dim, (h + 1) * head_dim)


class _AttentionModule:
    """The constructor skeleton and the call template shared by the modules."""

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    qkv_bias: bool
    window: int | None
    dtype: np.dtype
    scale: float | None = None  # multiplies q.k; None is 1/sqrt(head_dim)
    rope_theta: float | None = None  # rotary position embeddings' base; None: none
    _rng: np.random.Generator

    def _init_common(self, d_in: Any, d_out: Any, context_length: Any, dropout: Any,
                     qkv_bias: Any, window: Any, dtype: Any, seed: Any) -> None:
        self.d_in = check_int(d_in, "d_in", 1)
        self.d_out = check_int(d_out, "d_out", 1)
        self.context_length = check_int(context_length, "context_length", 1)
        self.dropout = check_dropout(dropout, "dropout")
        self.qkv_bias = bool(qkv_bias)
        self.window = check_optional_int(window, "window", 1)
        self.dtype = check_float_dtype(dtype)
        self._rng = rng_from_seed(seed)

    def _init_heads(self, num_heads: Any) -> None:
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

    def _forward(self, xb: np.ndarray, pad: np.ndarray | None, step: CacheStep | None,
                 training: bool, return_weights: bool,
                 nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(B, T, d_out) output and the weights (or None) of checked (B, T, d_in) input."""
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

    def __call__(self, x: Any, *, cache: KVCache | None = None, key_padding_mask: Any = None,
                 return_weights: bool = False, training: bool = False,
                 num_threads: int | None = None) -> Any:
        """Context vectors of every token.

        Parameters
        ----------
        x : array, shape (B, T, d_in) or (T, d_in)
        cache : KVCache, optional
            From ``new_cache()``: x's keys and values are appended and its
            queries attend over everything cached (query at absolute position p
            sees keys 0..p).
        key_padding_mask : bool array (B, T), optional
            True marks padding tokens of x (e.g. left padding of short prompts);
            nothing attends to them.
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
        """
        xb, single = self._prepare_input(x)
        B, T, _ = xb.shape
        pad = self._check_padding(key_padding_mask, B, T)
        training = check_bool(training, "training")
        return_weights = check_bool(return_weights, "return_weights")
        nt = _config.resolve_num_threads(num_threads)
        if cache is None:
            y, w = self._forward(xb, pad, None, training, return_weights, nt)
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache from new_cache(), "
                                f"got {type(cache).__name__}")
            kv_heads, head_dim = self._cache_geometry()
            cache.check_compatible(batch=B, num_kv_heads=kv_heads, head_dim=head_dim,
                                   dtype=self.dtype, window=self.window, new_tokens=T)
            with cache.step(T, pad) as step:
                y, w = self._forward(xb, pad, step, training, return_weights, nt)
        if single:
            y = y[0]
            w = None if w is None else w[0]
        return (y, w) if return_weights else y

    forward = __call__

    def _prepare_input(self, x: Any) -> tuple[np.ndarray, bool]:
        """x as a (B, T, d_in) array of the module's dtype; flag if it was (T, d_in)."""
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; supported dtypes are {FLOAT_DTYPES_TEXT}")
        if x.ndim not in (2, 3):
            raise ValueError(
                f"x must have shape (batch, tokens, d_in) or (tokens, d_in), got {x.shape}"
            )
        if x.shape[-1] != self.d_in:
            raise ValueError(f"x must have d_in={self.d_in} features (last axis), got {x.shape}")
        T = x.shape[-2]
        if T > self.context_length:
            raise ValueError(
                f"x has {T} tokens, more than context_length={self.context_length}"
            )
        single = x.ndim == 2
        if single:
            x = x[None]
        return x.astype(self.dtype, copy=False), single

    @staticmethod
    def _check_padding(key_padding_mask: Any, B: int, T: int) -> np.ndarray | None:
        """(B, T) boolean, True = padding token (PyTorch's nn.MultiheadAttention convention)."""
        if key_padding_mask is None:
            return None
        m = np.asarray(key_padding_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_padding_mask must be boolean (True = padding), got {m.dtype}")
        if m.ndim == 1 and B == 1:
            m = m[None]
        if m.shape != (B, T):
            raise ValueError(
                f"key_padding_mask must have shape (batch, new tokens) = {(B, T)}, got {m.shape}"
            )
        return m

    def _dropout_for_call(self, training: bool) -> tuple[float, int]:
        """(p, seed) of this call's dropout stream: (0, 0) unless training with dropout."""
        if training and self.dropout > 0:
            return self.dropout, seed_value(self._rng)
        return 0.0, 0

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, pad: np.ndarray | None,
                step: CacheStep | None, *, heads: slice = slice(None), p: float, seed: int,
                return_weights: bool, nt: int, out: np.ndarray | None = None) -> Any:
        """Causal attention of q over k, v (and the cache): (B, H, T, D) arrays."""
        scale = 1.0 / np.sqrt(q.shape[-1]) if self.scale is None else self.scale
        if step is not None:
            return step.attend(q, k, v, heads, scale=scale, num_threads=nt, out=out,
                               return_weights=return_weights, dropout_p=p, seed=seed)
        mask = None if pad is None or not pad.any() else ~pad[:, None, None, :]
        return _core.attention(q, k, v, mask=mask, causal_offset=0, window=self.window,
                               scale=scale, dropout_p=p, seed=seed,
                               enable_gqa=q.shape[1] != k.shape[1],
                               return_weights=return_weights, num_threads=nt, out=out)


class CausalAttention(_AttentionModule):
    """One head of causal self-attention (the book's ``CausalAttention``).

    Parameters
    ----------
    d_in : int
        Input features per token.
    d_out : int
        Width of this head's queries, keys, values and output.
    context_length : int
        Longest sequence the module accepts.
    dropout : float
        Dropout on the attention weights when called with ``training=True``.
    qkv_bias : bool
        Whether the query, key and value projections have biases.
    window : int, optional, keyword-only
        Sliding window: each query sees its ``window`` most recent keys.
    rope_theta : float, optional, keyword-only
        Rotary position embeddings on queries and keys with this base
        (Hugging Face's ``rotate_half`` convention); positions continue from
        the cache's length.  None (the default): no rotary embeddings.
    dtype : float32 or float64, keyword-only
    seed : int, numpy Generator or None, keyword-only
        Seeds the weight initialisation and the dropout stream.

    Attributes
    ----------
    W_query, W_key, W_value : ndarray, shape (d_in, d_out)
    b_query, b_key, b_value : ndarray, shape (d_out,), or None
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float = 0.0,
                 qkv_bias: bool = False, *, window: int | None = None,
                 rope_theta: float | None = None, dtype: Any = np.float32,
                 seed: Any = None) -> None:
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, window, dtype, seed)
        self._init_rope(rope_theta, self.d_out)
        rng, shape = self._rng, (self.d_in, self.d_out)
        self.W_query = _linear_init(rng, self.d_in, shape, self.dtype)
        self.W_key = _linear_init(rng, self.d_in, shape, self.dtype)
        self.W_value = _linear_init(rng, self.d_in, shape, self.dtype)
        self.b_query: np.ndarray | None = None
        self.b_key: np.ndarray | None = None
        self.b_value: np.ndarray | None = None
        if self.qkv_bias:
            self.b_query = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)
            self.b_key = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)
            self.b_value = _linear_init(rng, self.d_in, (self.d_out,), self.dtype)

    def __repr__(self) -> str:
        return (f"CausalAttention(d_in={self.d_in}, d_out={self.d_out}, "
                f"context_length={self.context_length}, dropout={self.dropout}, "
                f"qkv_bias={self.qkv_bias}, dtype={self.dtype.name})")

    def _cache_geometry(self) -> tuple[int, int]:
        return 1, self.d_out

    def _project(self, x: np.ndarray, W: np.ndarray, b: np.ndarray | None, nt: int
                 ) -> np.ndarray:
        return _core.linear(x, W.astype(self.dtype, copy=False),
                            None if b is None else b.astype(self.dtype, copy=False), nt)

    def _head_forward(self, xb: np.ndarray, pad: np.ndarray | None, step: CacheStep | None,
                      heads: slice, training: bool, return_weights: bool, nt: int) -> Any:
        """(B, 1, T, d_out) context (and (B, 1, T, S) weights) of this head."""
        p, seed = self._dropout_for_call(training)
        q = self._project(xb, self.W_query, self.b_query, nt)[:, None]
        k = self._project(xb, self.W_key, self.b_key, nt)[:, None]
        v = self._project(xb, self.W_value, self.b_value, nt)[:, None]
        self._rotate(q, k, step)
        return self._attend(q, k, v, pad, step, heads=heads, p=p, seed=seed,
                            return_weights=return_weights, nt=nt)

    def _forward(self, xb: np.ndarray, pad: np.ndarray | None, step: CacheStep | None,
                 training: bool, return_weights: bool,
                 nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        res = self._head_forward(xb, pad, step, slice(None), training, return_weights, nt)
        if return_weights:
            return res[0][:, 0], res[1][:, 0]
        return res[:, 0], None


class StackedMultiHeadAttention(_AttentionModule):
    """Multi-head attention as independent single-head modules run side by side.

    Each of the ``num_heads`` heads is a :class:`CausalAttention` with its own
    query, key and value weights and ``head_dim = d_out // num_heads`` columns.
    Their context vectors Z_1, ..., Z_h are concatenated into one matrix Z of
    width ``d_out``, followed by the output projection ``Z @ W_out + b_out``
    unless ``out_proj=False`` (which gives the book's ``MultiHeadAttentionWrapper``
    with per-head width ``d_out // num_heads``).

    Attributes
    ----------
    heads : list of CausalAttention
    W_out : ndarray (d_out, d_out) or None
    b_out : ndarray (d_out,) or None
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False, *, out_proj: bool = True,
                 window: int | None = None, rope_theta: float | None = None,
                 dtype: Any = np.float32, seed: Any = None) -> None:
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, window, dtype, seed)
        self._init_heads(num_heads)
        self._init_rope(rope_theta, self.head_dim)
        rng = self._rng
        self.heads = [
            CausalAttention(self.d_in, self.head_dim, self.context_length, self.dropout,
                            self.qkv_bias, window=self.window, rope_theta=self.rope_theta,
                            dtype=self.dtype, seed=rng)
            for _ in range(self.num_heads)
        ]
        self.W_out: np.ndarray | None = None
        self.b_out: np.ndarray | None = None
        if out_proj:
            self.W_out = _linear_init(rng, self.d_out, (self.d_out, self.d_out), self.dtype)
            self.b_out = _linear_init(rng, self.d_out, (self.d_out,), self.dtype)

    def __repr__(self) -> str:
        return (f"StackedMultiHeadAttention(d_in={self.d_in}, d_out={self.d_out}, "
                f"context_length={self.context_length}, dropout={self.dropout}, "
                f"num_heads={self.num_heads}, qkv_bias={self.qkv_bias}, "
                f"out_proj={self.W_out is not None}, dtype={self.dtype.name})")

    def _cache_geometry(self) -> tuple[int, int]:
        return self.num_heads, self.head_dim

    def _forward(self, xb: np.ndarray, pad: np.ndarray | None, step: CacheStep | None,
                 training: bool, return_weights: bool,
                 nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        # each head draws its own dropout stream, as independent modules would
        results = [head._head_forward(xb, pad, step, slice(h, h + 1), training, return_weights,
                                      nt) for h, head in enumerate(self.heads)]
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
            scale=None, dropout=self.dropout, rope_theta=self.rope_theta)

    @classmethod
    def from_weights(cls, w: FusedWeights, context_length: int, *, window: int | None = None,
                     dtype: Any = np.float32) -> "StackedMultiHeadAttention":
        """A stack whose head h gets columns h*D..(h+1)*D of the packed weights (copied)."""
        if w.scale is not None and not np.isclose(w.scale, (w.d_out // w.num_heads) ** -0.5):
            raise ValueError("a stack of heads uses the scale 1/sqrt(head_dim); use a fused "
                             "MultiHeadAttention for this module")
        st = cls(w.d_in, w.d_out, context_length, w.dropout, w.num_heads, w.b_q is not None,
                 out_proj=w.W_out is not None, window=window, rope_theta=w.rope_theta,
                 dtype=dtype, seed=0)
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
    def from_torch(cls, module: Any, *, context_length: int | None = None,
                   dtype: Any = np.float32) -> "StackedMultiHeadAttention":
        """A stack of heads with the weights of a PyTorch attention module.

        Same sources as :meth:`MultiHeadAttention.from_torch`; the book's
        wrapper becomes a stack without output projection.
        """
        w = interop.fused_weights(module, dtype)
        return cls.from_weights(w, context_length or interop.context_length_of(module),
                                dtype=dtype)

    def to_fused(self) -> "MultiHeadAttention":
        """A :class:`MultiHeadAttention` with the same weights (copied) and outputs.

        A stack without output projection maps to a fused module whose output
        projection is the identity.
        """
        return MultiHeadAttention.from_weights(self.to_weights(), self.context_length,
                                               window=self.window, dtype=self.dtype)


class _PackedWeight:
    """``W_query``/``W_key``/``W_value`` of a fused module: a view of its columns of
    ``W_qkv``; assigning to the attribute writes into the packed buffer."""

    def __init__(self, part: int) -> None:
        self.part = part

    def __get__(self, obj: Any, objtype: Any = None) -> np.ndarray:
        view: np.ndarray = obj.W_qkv[:, obj._cols(self.part)]
        return view

    def __set__(self, obj: Any, value: Any) -> None:
        obj.W_qkv[:, obj._cols(self.part)] = value


class _PackedBias:
    """``b_query``/``b_key``/``b_value`` of a fused module: a view into ``b_qkv`` or None."""

    def __init__(self, part: int) -> None:
        self.part = part

    def __get__(self, obj: Any, objtype: Any = None) -> np.ndarray | None:
        return None if obj.b_qkv is None else obj.b_qkv[obj._cols(self.part)]


class MultiHeadAttention(_AttentionModule):
    """Fused multi-head causal self-attention (the book's ``MultiHeadAttention``).

    All heads' query, key and value weights live in one packed buffer
    ``W_qkv`` of shape (d_in, d_out + 2 * kv_dim); ``W_query``, ``W_key`` and
    ``W_value`` are views into it, so writing into them updates the module.
    One matrix product projects every head, one kernel call attends every
    head (reading Q, K, V as strided views of the projection and writing the
    merged-heads layout), and the output projection follows.

    Parameters
    ----------
    d_in, d_out, context_length, dropout, num_heads, qkv_bias
        As in the book; ``d_out`` is the total width, ``head_dim = d_out // num_heads``.
    num_kv_heads : int, optional, keyword-only
        Grouped-query attention: ``num_heads`` must be a multiple; query head
        ``h`` uses key/value head ``h // (num_heads // num_kv_heads)``.
        Defaults to ``num_heads``.
    window : int, optional, keyword-only
        Sliding window: each query sees its ``window`` most recent keys.
    scale : float, optional, keyword-only
        Multiplies the query-key products; defaults to ``1 / sqrt(head_dim)``.
    rope_theta : float, optional, keyword-only
        Rotary position embeddings on queries and keys with this base
        (Hugging Face's ``rotate_half`` convention, as in Llama and Qwen2);
        positions continue from the cache's length, and keys are cached
        rotated.  None (the default): no rotary embeddings.
    dtype, seed : keyword-only

    Attributes
    ----------
    W_query : ndarray (d_in, d_out)
    W_key, W_value : ndarray (d_in, num_kv_heads * head_dim)
    b_query, b_key, b_value : ndarray or None
    W_out : ndarray (d_out, d_out)
    b_out : ndarray (d_out,)
    """

    W_query = _PackedWeight(0)
    W_key = _PackedWeight(1)
    W_value = _PackedWeight(2)
    b_query = _PackedBias(0)
    b_key = _PackedBias(1)
    b_value = _PackedBias(2)

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False, *, num_kv_heads: int | None = None,
                 window: int | None = None, scale: float | None = None,
                 rope_theta: float | None = None, dtype: Any = np.float32,
                 seed: Any = None) -> None:
        self._init_common(d_in, d_out, context_length, dropout, qkv_bias, window, dtype, seed)
        self._init_heads(num_heads)
        self._init_rope(rope_theta, self.head_dim)
        self.scale = check_optional_real(scale, "scale")
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
        self.W_out = _linear_init(rng, self.d_out, (self.d_out, self.d_out), self.dtype)
        self.b_out = _linear_init(rng, self.d_out, (self.d_out,), self.dtype)

    def _cols(self, part: int) -> slice:
        """Columns of part 0 (queries), 1 (keys) or 2 (values) in the packed projection."""
        starts = (0, self.d_out, self.d_out + self.kv_dim, self.d_out + 2 * self.kv_dim)
        return slice(starts[part], starts[part + 1])

    def __repr__(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        kv += f", window={self.window}" if self.window is not None else ""
        kv += f", rope_theta={self.rope_theta:g}" if self.rope_theta is not None else ""
        return (f"MultiHeadAttention(d_in={self.d_in}, d_out={self.d_out}, "
                f"context_length={self.context_length}, dropout={self.dropout}, "
                f"num_heads={self.num_heads}, qkv_bias={self.qkv_bias}{kv}, "
                f"dtype={self.dtype.name})")

    def _cache_geometry(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    def _forward(self, xb: np.ndarray, pad: np.ndarray | None, step: CacheStep | None,
                 training: bool, return_weights: bool,
                 nt: int) -> tuple[np.ndarray, np.ndarray | None]:
        B, T, _ = xb.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        p, seed = self._dropout_for_call(training)
        # one GEMM projects every head: (B, T, d_out + 2 kv_dim)
        qkv = _core.linear(xb, self.W_qkv, self.b_qkv, nt)
        # strided (B, heads, T, D) views of the packed projection: no copies
        q = qkv[..., self._cols(0)].reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = qkv[..., self._cols(1)].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        v = qkv[..., self._cols(2)].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        self._rotate(q, k, step)
        merged = np.empty((B, T, H * D), dtype=self.dtype)  # the kernel writes heads merged
        res = self._attend(q, k, v, pad, step, p=p, seed=seed, return_weights=return_weights,
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
                            dropout=self.dropout, rope_theta=self.rope_theta)

    @classmethod
    def from_weights(cls, w: FusedWeights, context_length: int, *, window: int | None = None,
                     dtype: Any = np.float32) -> "MultiHeadAttention":
        """A fused module with these weights (copied); no output projection becomes the identity."""
        m = cls(w.d_in, w.d_out, context_length, w.dropout, w.num_heads, w.b_q is not None,
                window=window, scale=w.scale, rope_theta=w.rope_theta, dtype=dtype, seed=0)
        m.W_query, m.W_key, m.W_value = w.W_q, w.W_k, w.W_v
        if m.b_qkv is not None:
            assert w.b_q is not None and w.b_k is not None and w.b_v is not None
            m.b_qkv[...] = np.concatenate([w.b_q, w.b_k, w.b_v])
        m.W_out[...] = np.eye(m.d_out) if w.W_out is None else w.W_out
        m.b_out[...] = 0 if w.b_out is None else w.b_out
        return m

    @classmethod
    def from_torch(cls, module: Any, *, context_length: int | None = None,
                   dtype: Any = np.float32) -> "MultiHeadAttention":
        """A fused module with the weights of a PyTorch attention module.

        Accepts ``torch.nn.MultiheadAttention``, the book's fused
        ``MultiHeadAttention``, the book's ``MultiHeadAttentionWrapper`` (its
        heads become the fused heads; the output projection is the identity)
        and Hugging Face GPT-2 attention.  Anything else raises TypeError.
        Its causal output equals the source module's.
        """
        w = interop.fused_weights(module, dtype)
        return cls.from_weights(w, context_length or interop.context_length_of(module),
                                dtype=dtype)

    def to_stacked(self) -> StackedMultiHeadAttention:
        """A :class:`StackedMultiHeadAttention` with the same weights (copied) and outputs."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "to_stacked() needs num_kv_heads == num_heads; independent heads cannot "
                "share key/value weights"
            )
        if self.scale is not None and not np.isclose(self.scale, self.head_dim ** -0.5):
            raise ValueError("to_stacked() needs the default scale 1/sqrt(head_dim)")
        w = self.to_weights()
        w.scale = None
        return StackedMultiHeadAttention.from_weights(w, self.context_length,
                                                      window=self.window, dtype=self.dtype)

    FORMAT_VERSION = 1

    def save(self, path: Any) -> None:
        """Write the module to an ``.npz`` file (arrays and a format version; no pickle)."""
        meta = np.array([self.FORMAT_VERSION, self.d_in, self.d_out, self.context_length,
                         self.num_heads, self.num_kv_heads, -1 if self.window is None
                         else self.window], dtype=np.int64)
        # values typed Any: np.savez's stub would match a str-keyed **dict against its
        # `allow_pickle: bool` parameter as well as against the arrays (**kwds)
        arrays: dict[str, Any] = {
            "meta": meta, "dropout": np.array(self.dropout),
            "scale": np.array(np.nan if self.scale is None else self.scale),
            "rope_theta": np.array(np.nan if self.rope_theta is None else self.rope_theta),
            "W_qkv": self.W_qkv, "W_out": self.W_out, "b_out": self.b_out}
        if self.b_qkv is not None:
            arrays["b_qkv"] = self.b_qkv
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: Any) -> "MultiHeadAttention":
        """Read a module written by :meth:`save`; a wrong version or shape raises ValueError."""
        with np.load(path, allow_pickle=False) as f:
            files = set(f.files)
            for name in ("meta", "dropout", "scale", "W_qkv", "W_out", "b_out"):
                if name not in files:
                    raise ValueError(f"{path}: not a manyheads module file (no {name!r})")
            meta = f["meta"]
            if meta.shape != (7,) or int(meta[0]) != cls.FORMAT_VERSION:
                raise ValueError(f"{path}: format version {meta[:1].tolist()} is not "
                                 f"{cls.FORMAT_VERSION}")
            _, d_in, d_out, ctx, H, Hkv, window = (int(x) for x in meta)
            scale = float(f["scale"])
            theta = float(f["rope_theta"]) if "rope_theta" in files else np.nan
            W_qkv = f["W_qkv"]
            m = cls(d_in, d_out, ctx, float(f["dropout"]), H, "b_qkv" in files, num_kv_heads=Hkv,
                    window=None if window < 0 else window,
                    scale=None if np.isnan(scale) else scale,
                    rope_theta=None if np.isnan(theta) else theta, dtype=W_qkv.dtype, seed=0)
            for name in ("W_qkv", "W_out", "b_out") + (("b_qkv",) if "b_qkv" in files else ()):
                arr, target = f[name], getattr(m, name)
                if arr.shape != target.shape:
                    raise ValueError(f"{path}: {name} has shape {arr.shape}, expected "
                                     f"{target.shape}")
                target[...] = arr
        return m
