"""KV cache for incremental (token-by-token) decoding.

A :class:`KVCache` keeps the keys and values of every token a module has seen,
per key/value head, so each new token's query attends to them without
recomputing their projections.  New queries are aligned to the end of the
keys: the query at absolute position p sees keys 0..p (and only the last
``window`` of them with a sliding window).

Layout: ``keys`` and ``values`` are (batch, kv_heads, capacity, head_dim)
arrays; the kernels read them in place.  With a sliding window the capacity is
the window and the cache is a ring buffer: position p lives in slot
p % capacity.  ``padding`` (batch, capacity) marks keys that are padding
(True), for batches of left-padded prompts.

Make one with ``module.new_cache(batch_size, max_len, dtype=None)``; pass it as
``module(x_new, cache=cache)``.  A cache is not safe to share between threads
that call a module at the same time (see the README's guarantees).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from .functional import _attention

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the tokens seen so far.

    Parameters
    ----------
    batch_size : int
    max_len : int
        Most tokens the cache accepts in total (appending past it raises).
    num_kv_heads, head_dim : int
        Must match the module the cache is used with.
    dtype : float32, float64 or float16
        Storage type; float16 halves the memory of a float32 module's cache
        (the kernels widen it to float32 as they read).
    window : int or None
        Sliding window of the module: only the last ``window`` keys are kept.
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: Any = np.float32, *, window: int | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("max_len", max_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"cache dtype must be float16, float32 or float64, got {dt}")
        self.batch_size = int(batch_size)
        self.max_len = int(max_len)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.window = None if window is None else int(window)
        self.capacity = self.max_len if self.window is None else min(self.max_len, self.window)
        shape = (self.batch_size, self.num_kv_heads, self.capacity, self.head_dim)
        self.keys: np.ndarray = np.zeros(shape, dtype=dt)
        self.values: np.ndarray = np.zeros(shape, dtype=dt)
        self.padding: np.ndarray = np.zeros((self.batch_size, self.capacity), dtype=bool)
        self._len = 0
        self._any_padding = False
        self._busy = threading.Lock()

    @property
    def dtype(self) -> np.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return int(self.keys.nbytes + self.values.nbytes)

    def __len__(self) -> int:
        """Number of tokens appended so far."""
        return self._len

    def __repr__(self) -> str:
        w = f", window={self.window}" if self.window is not None else ""
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype.name}{w}, len={self._len})")

    def reset(self) -> None:
        """Forget every token (the storage is kept)."""
        self._len = 0
        self.padding[...] = False
        self._any_padding = False

    # -- used by the modules -------------------------------------------------------------
    def _check_compatible(self, batch: int, num_kv_heads: int, head_dim: int, dtype: np.dtype,
                          window: int | None, new_tokens: int) -> None:
        if (self.num_kv_heads, self.head_dim) != (num_kv_heads, head_dim):
            raise ValueError(
                f"cache holds {self.num_kv_heads} kv heads of size {self.head_dim}; the module "
                f"needs {num_kv_heads} of size {head_dim}: make the cache with module.new_cache()"
            )
        if self.batch_size != batch:
            raise ValueError(f"cache was made for batch_size={self.batch_size}, x has batch {batch}")
        if self.window != window:
            raise ValueError(f"cache window {self.window} differs from the module's window {window}")
        if self.dtype != dtype and not (self.dtype == np.float16 and dtype == np.float32):
            raise TypeError(f"a {dtype} module cannot use a {self.dtype} cache "
                            "(float16 caches serve float32 modules)")
        if self._len + new_tokens > self.max_len:
            raise ValueError(
                f"cache is full: {self._len} tokens + {new_tokens} new > max_len={self.max_len}"
            )

    def _attend(self, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                pad_new: np.ndarray | None, heads: slice, *, scale: float, num_threads: int,
                out: np.ndarray | None, return_weights: bool, dropout_p: float = 0.0,
                seed: int = 0) -> Any:
        """Attend q (B, Hq, T, D) to the cached keys plus the T new ones of kv heads `heads`.

        Writes the new keys/values/padding into the cache but does not advance
        its length (the caller commits once every head is done).
        """
        T = k_new.shape[2]
        past, cap = self._len, self.capacity
        K, V, P = self.keys[:, heads], self.values[:, heads], self.padding
        gqa = q.shape[1] != K.shape[1]
        kw: dict[str, Any] = dict(scale=scale, num_threads=num_threads, out=out,
                                  return_weights=return_weights, dropout_p=dropout_p, seed=seed,
                                  enable_gqa=gqa)
        any_pad = self._any_padding or (pad_new is not None and bool(pad_new.any()))
        if past + T <= cap:
            # no wrap: slot == position
            K[:, :, past:past + T] = k_new
            V[:, :, past:past + T] = v_new
            if pad_new is not None:
                P[:, past:past + T] = pad_new
            n = past + T
            mask = ~P[:, None, None, :n] if any_pad else None
            return _attention(q, K[:, :, :n], V[:, :, :n], mask=mask, causal_offset=past,
                              window=self.window, **kw)
        assert self.window is not None  # only a windowed cache is smaller than max_len
        if T == 1:
            # the ring holds exactly the window of the new query: every slot is visible
            slot = past % cap
            K[:, :, slot] = k_new[:, :, 0]
            V[:, :, slot] = v_new[:, :, 0]
            P[:, slot] = False if pad_new is None else pad_new[:, 0]
            mask = ~P[:, None, None, :] if any_pad else None
            return _attention(q, K, V, mask=mask, causal_offset=None, **kw)
        # several new tokens past the window: lay the old window out in order, then attend
        n_old = min(past, cap - 1)
        pos = np.arange(past - n_old, past)
        Kc = np.concatenate([K[:, :, pos % cap], k_new.astype(K.dtype)], axis=2)
        Vc = np.concatenate([V[:, :, pos % cap], v_new.astype(V.dtype)], axis=2)
        Pc = np.concatenate([P[:, pos % cap], np.zeros((P.shape[0], T), bool)
                             if pad_new is None else pad_new], axis=1)
        res = _attention(q, Kc, Vc, mask=~Pc[:, None, None, :] if any_pad else None,
                         causal_offset=n_old, window=self.window, **kw)
        keep = min(T, cap)
        slots = np.arange(past + T - keep, past + T) % cap
        K[:, :, slots] = k_new[:, :, T - keep:]
        V[:, :, slots] = v_new[:, :, T - keep:]
        P[:, slots] = False if pad_new is None else pad_new[:, T - keep:]
        return res

    def _commit(self, new_tokens: int, pad_new: np.ndarray | None) -> None:
        self._len += new_tokens
        if pad_new is not None and pad_new.any():
            self._any_padding = True


@contextmanager
def in_use(cache: Any) -> Iterator[None]:
    """Hold ``cache`` for one module call; a second concurrent user gets RuntimeError."""
    if not isinstance(cache, KVCache):
        yield
        return
    if not cache._busy.acquire(blocking=False):
        raise RuntimeError("KVCache is in use by another call: a cache belongs to one decoding "
                           "stream (give each thread its own cache)")
    try:
        yield
    finally:
        cache._busy.release()
