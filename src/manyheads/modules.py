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
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import _blas, _config
from .cache import KVCache, in_use
from .functional import SUPPORTED_DTYPES, _attention, _check_dropout, _seed_value

__all__ = ["CausalAttention", "StackedMultiHeadAttention", "MultiHeadAttention"]


def _check_positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {int(value)}")
    return int(value)


def _check_window(window: Any) -> int | None:
    return None if window is None else _check_positive_int(window, "window")


def _check_dtype(dtype: Any) -> np.dtype:
    dt: np.dtype = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    return dt


def _linear_init(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """PyTorch nn.Linear's default: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / np.sqrt(fan_in) if fan_in > 0 else 0.0
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


class _Module:
    """Shared input handling of the attention modules."""

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    dtype: np.dtype
    window: int | None
    _rng: np.random.Generator

    def _prepare_input(self, x: Any) -> tuple[np.ndarray, bool]:
        """x as a (B, T, d_in) array of the module's dtype; flag if it was (T, d_in)."""
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; supported dtypes are float32 or float64")
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

    def _check_padding(self, key_padding_mask: Any, B: int, T: int) -> np.ndarray | None:
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

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, pad: np.ndarray | None,
                cache: KVCache | None, heads: slice, *, p: float, seed: int,
                return_weights: bool, nt: int, out: np.ndarray | None = None) -> Any:
        """Causal attention of q over k, v (and the cache): (B, H, T, D) arrays."""
        scale = getattr(self, "scale", None)
        scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        if cache is not None:
            return cache._attend(q, k, v, pad, heads, scale=scale, num_threads=nt, out=out,
                                 return_weights=return_weights, dropout_p=p, seed=seed)
        mask = None if pad is None or not pad.any() else ~pad[:, None, None, :]
        return _attention(q, k, v, mask=mask, causal_offset=0, window=self.window, scale=scale,
                          dropout_p=p, seed=seed, enable_gqa=q.shape[1] != k.shape[1],
                          return_weights=return_weights, num_threads=nt, out=out)

    def _check_cache(self, cache: Any, B: int, T: int, kv_heads: int, head_dim: int) -> None:
        if cache is None:
            return
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(), got {type(cache).__name__}")
        cache._check_compatible(B, kv_heads, head_dim, self.dtype, self.window, T)

    def _dropout_for_call(self, training: bool) -> tuple[float, int]:
        if not isinstance(training, (bool, np.bool_)):
            raise TypeError(f"training must be a bool, got {type(training).__name__}")
        if training and self.dropout > 0:
            return self.dropout, _seed_value(self._rng)
        return 0.0, 0


class CausalAttention(_Module):
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
    dtype : float32 or float64, keyword-only
    seed : int or None, keyword-only
        Seeds the weight initialisation and the dropout stream.

    Attributes
    ----------
    W_query, W_key, W_value : ndarray, shape (d_in, d_out)
    b_query, b_key, b_value : ndarray, shape (d_out,), or None
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float = 0.0,
                 qkv_bias: bool = False, *, window: int | None = None, dtype: Any = np.float32,
                 seed: Any = None) -> None:
        self.window = _check_window(window)
        self.d_in = _check_positive_int(d_in, "d_in")
        self.d_out = _check_positive_int(d_out, "d_out")
        self.context_length = _check_positive_int(context_length, "context_length")
        self.dropout = _check_dropout(dropout, "dropout")
        self.qkv_bias = bool(qkv_bias)
        self.dtype = _check_dtype(dtype)
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self._rng = rng
        shape = (self.d_in, self.d_out)
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

    def _project(self, x: np.ndarray, W: np.ndarray, b: np.ndarray | None, nt: int,
                 split: bool) -> np.ndarray:
        y = _blas.matmul(x, W.astype(self.dtype, copy=False), nt, split)
        if b is not None:
            y += b.astype(self.dtype, copy=False)
        return y

    def new_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty KV cache for this head (dtype defaults to the module's)."""
        return KVCache(batch_size, max_len, 1, self.d_out,
                       self.dtype if dtype is None else dtype, window=self.window)

    def __call__(self, x: Any, *, cache: KVCache | None = None, key_padding_mask: Any = None,
                 return_weights: bool = False, training: bool = False,
                 num_threads: int | None = None) -> Any:
        """Context vectors of every token.

        Parameters
        ----------
        x : array, shape (B, T, d_in) or (T, d_in)
        cache : KVCache, optional
            Appends x's keys and values and attends over every cached token.
        key_padding_mask : bool array (B, T), optional
            True marks padding tokens of x (no query attends to them).

        Returns
        -------
        context : ndarray, shape (B, T, d_out) or (T, d_out)
        weights : ndarray, shape (B, T, S) or (T, S), with ``return_weights=True``
        """
        xb, single = self._prepare_input(x)
        B, T, _ = xb.shape
        pad = self._check_padding(key_padding_mask, B, T)
        with in_use(cache):
            self._check_cache(cache, B, T, 1, self.d_out)
            p, seed = self._dropout_for_call(training)
            nt = _config.resolve_num_threads(num_threads)
            res = self._run(xb, pad, cache, slice(None), p, seed, return_weights, nt)
            if cache is not None:
                cache._commit(T, pad)
        if return_weights:
            out, w = res[0][:, 0], res[1][:, 0]
            return (out[0], w[0]) if single else (out, w)
        out = res[:, 0]
        return out[0] if single else out

    def _run(self, xb: np.ndarray, pad: np.ndarray | None, cache: KVCache | None,
             heads: slice, p: float, seed: int, return_weights: bool, nt: int) -> Any:
        """(B, 1, T, d_out) context (and weights) of checked input; the cache is not committed."""
        with _blas.single_threaded_blas(xb.shape[0] * xb.shape[1]) as split:
            q = self._project(xb, self.W_query, self.b_query, nt, split)[:, None]
            k = self._project(xb, self.W_key, self.b_key, nt, split)[:, None]
            v = self._project(xb, self.W_value, self.b_value, nt, split)[:, None]
        return self._attend(q, k, v, pad, cache, heads, p=p, seed=seed,
                            return_weights=return_weights, nt=nt)

    forward = __call__


class StackedMultiHeadAttention(_Module):
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
                 window: int | None = None, dtype: Any = np.float32, seed: Any = None) -> None:
        self.window = _check_window(window)
        self.d_in = _check_positive_int(d_in, "d_in")
        self.d_out = _check_positive_int(d_out, "d_out")
        self.context_length = _check_positive_int(context_length, "context_length")
        self.dropout = _check_dropout(dropout, "dropout")
        self.num_heads = _check_positive_int(num_heads, "num_heads")
        if self.d_out % self.num_heads:
            raise ValueError(
                f"d_out ({self.d_out}) must be divisible by num_heads ({self.num_heads})"
            )
        self.head_dim = self.d_out // self.num_heads
        self.qkv_bias = bool(qkv_bias)
        self.dtype = _check_dtype(dtype)
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self._rng = rng
        self.heads = [
            CausalAttention(self.d_in, self.head_dim, self.context_length, self.dropout,
                            self.qkv_bias, window=self.window, dtype=self.dtype, seed=rng)
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

    def new_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty KV cache for every head (dtype defaults to the module's)."""
        return KVCache(batch_size, max_len, self.num_heads, self.head_dim,
                       self.dtype if dtype is None else dtype, window=self.window)

    def __call__(self, x: Any, *, cache: KVCache | None = None, key_padding_mask: Any = None,
                 return_weights: bool = False, training: bool = False,
                 num_threads: int | None = None) -> Any:
        """Concatenated head outputs Z (projected unless ``out_proj=False``).

        Parameters
        ----------
        x : array, shape (B, T, d_in) or (T, d_in)
        cache : KVCache, optional
            From :meth:`new_cache`; head h keeps its keys in the cache's head h.
        key_padding_mask : bool array (B, T), optional
            True marks padding tokens of x.

        Returns
        -------
        out : ndarray, shape (B, T, d_out) or (T, d_out)
        weights : ndarray, shape (B, num_heads, T, S) or (num_heads, T, S),
            with ``return_weights=True``
        """
        xb, single = self._prepare_input(x)
        B, T, _ = xb.shape
        pad = self._check_padding(key_padding_mask, B, T)
        with in_use(cache):
            return self._call_locked(xb, single, pad, cache, return_weights, training,
                                     num_threads)

    def _call_locked(self, xb: np.ndarray, single: bool, pad: np.ndarray | None,
                     cache: KVCache | None, return_weights: bool, training: bool,
                     num_threads: int | None) -> Any:
        B, T, _ = xb.shape
        self._check_cache(cache, B, T, self.num_heads, self.head_dim)
        nt = _config.resolve_num_threads(num_threads)
        self._dropout_for_call(training)  # checks the flag; each head draws its own stream
        with _blas.single_threaded_blas(B * T) as split:
            results = []
            for h, head in enumerate(self.heads):
                hp, seed = head._dropout_for_call(training)
                results.append(head._run(xb, pad, cache, slice(h, h + 1), hp, seed,
                                         return_weights, nt))
            if cache is not None:
                cache._commit(T, pad)
            if return_weights:
                Z = np.concatenate([r[0][:, 0] for r in results], axis=-1)
                w = np.concatenate([r[1] for r in results], axis=1)
            else:
                Z = np.concatenate([r[:, 0] for r in results], axis=-1)
            if self.W_out is not None:
                Z = _blas.matmul(Z, self.W_out, nt, split)
                if self.b_out is not None:
                    Z += self.b_out
        if single:
            Z = Z[0]
            if return_weights:
                w = w[0]
        return (Z, w) if return_weights else Z

    forward = __call__

    @classmethod
    def from_torch(cls, module: Any, *, context_length: int | None = None,
                   dtype: Any = np.float32) -> "StackedMultiHeadAttention":
        """A stack of heads with the weights of a PyTorch attention module.

        Same sources as :meth:`MultiHeadAttention.from_torch`; the book's
        wrapper becomes a stack without output projection.
        """
        from . import interop

        w = interop.fused_weights(module, dtype)
        if w["scale"] is not None and not np.isclose(w["scale"], (w["d_out"] // w["num_heads"])
                                                     ** -0.5):
            raise ValueError("a stack of heads uses the scale 1/sqrt(head_dim); import this "
                             "module with MultiHeadAttention.from_torch instead")
        ctx = context_length or interop.context_length_of(module)
        qkv_bias = w["b_q"] is not None
        st = cls(w["d_in"], w["d_out"], ctx, w["dropout"], w["num_heads"], qkv_bias,
                 out_proj=w["W_out"] is not None, dtype=dtype, seed=0)
        D = st.head_dim
        for h, head in enumerate(st.heads):
            c = slice(h * D, (h + 1) * D)
            head.W_query[...], head.W_key[...], head.W_value[...] = (
                w["W_q"][:, c], w["W_k"][:, c], w["W_v"][:, c])
            if qkv_bias:
                assert (head.b_query is not None and head.b_key is not None
                        and head.b_value is not None)  # heads of a qkv_bias stack have biases
                head.b_query[...], head.b_key[...], head.b_value[...] = (
                    w["b_q"][c], w["b_k"][c], w["b_v"][c])
        if st.W_out is not None:
            st.W_out[...] = w["W_out"]
            assert st.b_out is not None
            st.b_out[...] = 0 if w["b_out"] is None else w["b_out"]
        return st

    def to_fused(self) -> "MultiHeadAttention":
        """A :class:`MultiHeadAttention` with the same weights (copied) and outputs.

        A stack without output projection maps to a fused module whose output
        projection is the identity.
        """
        m = MultiHeadAttention(self.d_in, self.d_out, self.context_length, self.dropout,
                               self.num_heads, self.qkv_bias, window=self.window,
                               dtype=self.dtype, seed=0)
        D = self.head_dim
        for h, head in enumerate(self.heads):
            cols = slice(h * D, (h + 1) * D)
            m.W_query[:, cols] = head.W_query
            m.W_key[:, cols] = head.W_key
            m.W_value[:, cols] = head.W_value
            if self.qkv_bias:
                assert m.b_query is not None and m.b_key is not None and m.b_value is not None
                m.b_query[cols] = head.b_query
                m.b_key[cols] = head.b_key
                m.b_value[cols] = head.b_value
        if self.W_out is not None:
            m.W_out[...] = self.W_out
            m.b_out[...] = self.b_out if self.b_out is not None else 0
        else:
            m.W_out[...] = np.eye(self.d_out, dtype=self.dtype)
            m.b_out[...] = 0
        return m


class MultiHeadAttention(_Module):
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
    scale : float, optional, keyword-only
        Multiplies the query-key products; defaults to ``1 / sqrt(head_dim)``.
    dtype, seed : keyword-only

    Attributes
    ----------
    W_query : ndarray (d_in, d_out)
    W_key, W_value : ndarray (d_in, num_kv_heads * head_dim)
    b_query, b_key, b_value : ndarray or None
    W_out : ndarray (d_out, d_out)
    b_out : ndarray (d_out,)
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False, *, num_kv_heads: int | None = None,
                 window: int | None = None, scale: float | None = None, dtype: Any = np.float32,
                 seed: Any = None) -> None:
        self.window = _check_window(window)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not np.isfinite(scale)):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.d_in = _check_positive_int(d_in, "d_in")
        self.d_out = _check_positive_int(d_out, "d_out")
        self.context_length = _check_positive_int(context_length, "context_length")
        self.dropout = _check_dropout(dropout, "dropout")
        self.num_heads = _check_positive_int(num_heads, "num_heads")
        if self.d_out % self.num_heads:
            raise ValueError(
                f"d_out ({self.d_out}) must be divisible by num_heads ({self.num_heads})"
            )
        kvh = self.num_heads if num_kv_heads is None else _check_positive_int(
            num_kv_heads, "num_kv_heads")
        if self.num_heads % kvh:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kvh})"
            )
        self.num_kv_heads = kvh
        self.head_dim = self.d_out // self.num_heads
        self.kv_dim = kvh * self.head_dim
        self.qkv_bias = bool(qkv_bias)
        self.dtype = _check_dtype(dtype)
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self._rng = rng
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

    # views into the packed projection -----------------------------------------------
    def _cols(self, which: int) -> slice:
        start = (0, self.d_out, self.d_out + self.kv_dim)[which]
        stop = (self.d_out, self.d_out + self.kv_dim, self.d_out + 2 * self.kv_dim)[which]
        return slice(start, stop)

    @property
    def W_query(self) -> np.ndarray:
        return self.W_qkv[:, self._cols(0)]

    @W_query.setter
    def W_query(self, value: Any) -> None:
        self.W_qkv[:, self._cols(0)] = value

    @property
    def W_key(self) -> np.ndarray:
        return self.W_qkv[:, self._cols(1)]

    @W_key.setter
    def W_key(self, value: Any) -> None:
        self.W_qkv[:, self._cols(1)] = value

    @property
    def W_value(self) -> np.ndarray:
        return self.W_qkv[:, self._cols(2)]

    @W_value.setter
    def W_value(self, value: Any) -> None:
        self.W_qkv[:, self._cols(2)] = value

    def _bias(self, which: int) -> np.ndarray | None:
        return None if self.b_qkv is None else self.b_qkv[self._cols(which)]

    @property
    def b_query(self) -> np.ndarray | None:
        return self._bias(0)

    @property
    def b_key(self) -> np.ndarray | None:
        return self._bias(1)

    @property
    def b_value(self) -> np.ndarray | None:
        return self._bias(2)

    def __repr__(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        kv += f", window={self.window}" if self.window is not None else ""
        return (f"MultiHeadAttention(d_in={self.d_in}, d_out={self.d_out}, "
                f"context_length={self.context_length}, dropout={self.dropout}, "
                f"num_heads={self.num_heads}, qkv_bias={self.qkv_bias}{kv}, "
                f"dtype={self.dtype.name})")

    def new_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty KV cache (dtype defaults to the module's; float16 halves its memory).

        It stores only the ``num_kv_heads`` key/value heads, and with a sliding
        window only the last ``window`` tokens (a ring buffer).
        """
        return KVCache(batch_size, max_len, self.num_kv_heads, self.head_dim,
                       self.dtype if dtype is None else dtype, window=self.window)

    def __call__(self, x: Any, *, cache: KVCache | None = None, key_padding_mask: Any = None,
                 return_weights: bool = False, training: bool = False,
                 num_threads: int | None = None) -> Any:
        """Attend every head of x in one kernel call, then project.

        Parameters
        ----------
        x : array, shape (B, T, d_in) or (T, d_in)
        cache : KVCache, optional
            From :meth:`new_cache`: x's keys and values are appended and its
            queries attend over everything cached (query at absolute position p
            sees keys 0..p).
        key_padding_mask : bool array (B, T), optional
            True marks padding tokens of x (e.g. left padding of short prompts);
            nothing attends to them.

        Returns
        -------
        out : ndarray, shape (B, T, d_out) or (T, d_out)
        weights : ndarray, shape (B, num_heads, T, S) or (num_heads, T, S),
            with ``return_weights=True`` (S = keys attended)
        """
        xb, single = self._prepare_input(x)
        B, T, _ = xb.shape
        pad = self._check_padding(key_padding_mask, B, T)
        with in_use(cache):
            self._check_cache(cache, B, T, self.num_kv_heads, self.head_dim)
            p, seed = self._dropout_for_call(training)
            nt = _config.resolve_num_threads(num_threads)
            with _blas.single_threaded_blas(B * T) as split:
                y, w = self._forward(xb, pad, cache, p, seed, return_weights, nt, split)
            if cache is not None:
                cache._commit(T, pad)
        if single:
            y = y[0]
            w = None if w is None else w[0]
        return (y, w) if return_weights else y

    def _forward(self, xb: np.ndarray, pad: np.ndarray | None, cache: KVCache | None, p: float,
                 seed: int, return_weights: bool, nt: int,
                 split: bool) -> tuple[np.ndarray, np.ndarray | None]:
        B, T, _ = xb.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # one GEMM projects every head: (B, T, d_out + 2 kv_dim)
        qkv = _blas.matmul(xb, self.W_qkv, nt, split)
        if self.b_qkv is not None:
            qkv += self.b_qkv
        # strided (B, heads, T, D) views of the packed projection: no copies
        q = qkv[..., self._cols(0)].reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = qkv[..., self._cols(1)].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        v = qkv[..., self._cols(2)].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        merged = np.empty((B, T, H * D), dtype=self.dtype)  # the kernel writes heads merged
        res = self._attend(q, k, v, pad, cache, slice(None), p=p, seed=seed,
                           return_weights=return_weights, nt=nt,
                           out=merged.reshape(B, T, H, D).transpose(0, 2, 1, 3))
        y = _blas.matmul(merged, self.W_out, nt, split)
        y += self.b_out
        return y, (res[1] if return_weights else None)

    forward = __call__

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
        from . import interop

        w = interop.fused_weights(module, dtype)
        ctx = context_length or interop.context_length_of(module)
        qkv_bias = w["b_q"] is not None
        m = cls(w["d_in"], w["d_out"], ctx, w["dropout"], w["num_heads"], qkv_bias,
                scale=w["scale"], dtype=dtype, seed=0)
        m.W_query, m.W_key, m.W_value = w["W_q"], w["W_k"], w["W_v"]
        if qkv_bias:
            assert m.b_qkv is not None
            m.b_qkv[...] = np.concatenate([w["b_q"], w["b_k"], w["b_v"]])
        m.W_out[...] = np.eye(m.d_out) if w["W_out"] is None else w["W_out"]
        m.b_out[...] = 0 if w["b_out"] is None else w["b_out"]
        return m

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
            W_qkv = f["W_qkv"]
            dtype = W_qkv.dtype
            m = cls(d_in, d_out, ctx, float(f["dropout"]), H, "b_qkv" in files, num_kv_heads=Hkv,
                    window=None if window < 0 else window,
                    scale=None if np.isnan(scale) else scale, dtype=dtype, seed=0)
            for name in ("W_qkv", "W_out", "b_out") + (("b_qkv",) if "b_qkv" in files else ()):
                arr, target = f[name], getattr(m, name)
                if arr.shape != target.shape:
                    raise ValueError(f"{path}: {name} has shape {arr.shape}, expected "
                                     f"{target.shape}")
                target[...] = arr
        return m

    def to_stacked(self) -> StackedMultiHeadAttention:
        """A :class:`StackedMultiHeadAttention` with the same weights (copied) and outputs."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "to_stacked() needs num_kv_heads == num_heads; independent heads cannot "
                "share key/value weights"
            )
        if self.scale is not None and not np.isclose(self.scale, self.head_dim ** -0.5):
            raise ValueError("to_stacked() needs the default scale 1/sqrt(head_dim)")
        st = StackedMultiHeadAttention(self.d_in, self.d_out, self.context_length, self.dropout,
                                       self.num_heads, self.qkv_bias, window=self.window,
                                       dtype=self.dtype, seed=0)
        D = self.head_dim
        for h, head in enumerate(st.heads):
            cols = slice(h * D, (h + 1) * D)
            head.W_query[...] = self.W_query[:, cols]
            head.W_key[...] = self.W_key[:, cols]
            head.W_value[...] = self.W_value[:, cols]
            if self.qkv_bias:
                for name, src in (("b_query", self.b_query), ("b_key", self.b_key),
                                  ("b_value", self.b_value)):
                    assert src is not None
                    getattr(head, name)[...] = src[cols]
        assert st.W_out is not None and st.b_out is not None
        st.W_out[...] = self.W_out
        st.b_out[...] = self.b_out
        return st
