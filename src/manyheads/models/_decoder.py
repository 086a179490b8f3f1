"""What every decoder-only model here shares: checked token input, caches, logits,
generation (greedy or sampled, the choice in ``_sampling``), the attention weights of one
layer, and the repr.

An architecture (``gpt2``, or ``llama`` and the families built on it) supplies the token
embedding, its blocks and its final norm; each block owns one fused
:class:`~manyheads.MultiHeadAttention` (or a subclass of it), so
the attention, its KV cache and the grouped-query sharing are manyheads' own.  Every
matrix product of the rest of the model runs through :func:`manyheads.linear`, on the
same threads as the attention.

Padding: ``attention_mask`` follows Hugging Face, shape (B, T) with 1 for a real token and
0 for padding, and only left padding (each row's padding before its tokens); inside, it
becomes the modules' ``key_padding_mask`` (True = padding).  Absolute position embeddings
(GPT-2) count each row's real tokens only, as Hugging Face's ``generate`` does; rotary
embeddings see the padded slot positions, which shifts every position of a row by the
same amount and so leaves its attention scores as they are (rotary scores depend only on
the distance between query and key).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .. import _config, _core, _formats, _kernels
from ..cache import KVCache, hold_caches
from ..modules import MultiHeadAttention
from ..weights import gather_columns, weight_format
from ._sampling import (check_sampling, check_seed, check_stop, choose, process_logits,
                        token_ids)

__all__ = ["DecoderModel", "Block", "rms_norm", "layer_norm", "project", "prepared", "eos_of"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis (one new array)."""
    if x.dtype == np.float32 and weight.dtype == np.float32 and x.ndim >= 1 and x.size:
        # (a strided view, such as the heads of a packed projection, is copied first:
        # every float32 norm is the compiled one, whatever the layout)
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        d = x.shape[-1]
        _kernels.rms_norm_rows(x.reshape(-1, d), np.ascontiguousarray(weight), float(eps),
                               out.reshape(-1, d))
        return out
    y: np.ndarray = np.square(x)
    ms = y.mean(axis=-1, keepdims=True)
    ms += eps
    np.sqrt(ms, out=ms)
    np.divide(x, ms, out=y)
    y *= weight
    return y


def project(x: np.ndarray, weight: Any, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight + bias`` on manyheads' threads: :func:`manyheads.linear` without its
    argument checks (a model's weights were checked as they loaded)."""
    return _core.linear(x, weight, bias, _config.resolve_num_threads(None))


def prepared(owner: Any, name: str) -> _core.WeightParts:
    """The kernel layout (:func:`manyheads._core.weight_parts`) of weight ``name`` of
    ``owner``, worked out on first use and again only when the attribute is replaced."""
    w = getattr(owner, name)
    memo = owner.__dict__.setdefault("_prepared", {})
    hit = memo.get(name)
    if hit is None or hit[0] is not w:
        _core._check_weight_types(np.dtype(np.float32), w, None)  # (a weight replaced since)
        hit = memo[name] = (w, _core.weight_parts(w))
    parts: _core.WeightParts = hit[1]
    return parts


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    mu = x.mean(axis=-1, keepdims=True)
    y: np.ndarray = x - mu
    var = np.square(y).mean(axis=-1, keepdims=True)
    var += eps
    np.sqrt(var, out=var)
    y /= var
    y *= weight
    y += bias
    return y


def eos_of(cfg: dict[str, Any]) -> int | list[int] | None:
    """The config's end-of-sequence id, or its list of them (Llama 3 Instruct, Qwen2.5 and
    others list several: each ends generation), or None."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        ids = [t for t in eos if isinstance(t, int) and not isinstance(t, bool)]
        return ids or None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


class Block(Protocol):
    """One transformer block: ``attn`` plus whatever surrounds it."""

    @property
    def attn(self) -> MultiHeadAttention:
        """The block's attention (a subclass of the fused module for some families)."""
        ...

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        """What the attention of this block reads (the normed residual stream)."""
        ...

    def __call__(self, x: np.ndarray, cache: KVCache | None,
                 pad: np.ndarray | None) -> np.ndarray:
        """The residual stream after this block (x may be updated in place)."""
        ...


class DecoderModel:
    """A decoder-only language model run in NumPy with manyheads attention.

    Made by :func:`manyheads.models.from_pretrained`.  Token ids are integer arrays of
    shape (B, T) (or (T,), a batch of one); results are always batched.

    Attributes
    ----------
    model_type : str
        The checkpoint's ``model_type`` (``"gpt2"``, ``"llama"``, ``"gemma2"``, ...).
    vocab_size, context_length, d_model, num_layers, num_heads, num_kv_heads, head_dim : int
    blocks : list
        One block per layer; ``blocks[i].attn`` is its
        :class:`~manyheads.MultiHeadAttention`.
    eos_token_id : int, list of int or None
        ``config.json``'s end-of-sequence id, or its list of them as the config
        gives it (pass it to :meth:`generate`'s ``eos_token_id`` to stop at any of
        them); ``generate`` itself stops only at the ids it is given.
    """

    model_type: str
    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    tied_embeddings: bool
    blocks: Sequence[Block]
    head: Any  # (d_model, vocab): the LM head in x @ W form, in the weights' format
    eos_token_id: int | list[int] | None = None
    learned_positions = False  # True: _embed reads the tokens' absolute positions
    final_softcap: float | None = None  # c of the logits' soft cap c tanh(z / c) (Gemma)

    def _token_rows(self, table: Any, ids: np.ndarray) -> np.ndarray:
        """Tokens ``ids`` of the token embedding ``table``, held as (d_model, vocab)
        columns in any weight format, or with tied embeddings (None) the LM head's
        columns: a new (B, T, d_model) float32 array."""
        return gather_columns(self.head if table is None else table, ids)

    # -- supplied by each architecture -------------------------------------------------
    def _embed(self, ids: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        """(B, T, d_model) float32 input of the first block, a new array (the blocks
        update it in place); ``positions`` only with ``learned_positions``."""
        raise NotImplementedError

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _describe(self) -> str:
        """Architecture-specific part of the repr (norm, MLP, positions)."""
        return ""

    def _decode_step(self, caches: list[KVCache], rows: int) -> Any:
        """A compiled decoding step for these caches (see ``_step``), or None."""
        return None

    # -- shared -------------------------------------------------------------------------
    def __repr__(self) -> str:
        n_params = sum(int(np.prod(p.shape)) for p in self.parameters())
        kv = f"{self.num_kv_heads} kv heads, " if self.num_kv_heads != self.num_heads else ""
        tied = ", tied embeddings" if self.tied_embeddings else ""
        extra = self._describe()
        return (f"{type(self).__name__}(model_type={self.model_type!r}: {self.num_layers} layers, "
                f"d_model={self.d_model}, {self.num_heads} heads of {self.head_dim}, {kv}"
                f"MLP {self.d_ff}, vocab {self.vocab_size}, context {self.context_length}"
                f"{tied}{', ' + extra if extra else ''}; {n_params / 1e6:.2f}M parameters, "
                f"{self._weights_text()})")

    def _weights_text(self) -> str:
        kind = self.weight_dtype
        return kind if kind == "float32" else f"{kind} weights"

    @property
    def weight_dtype(self) -> str:
        """How the projections and embeddings are stored (the LM head's format):
        float32, bfloat16, float16 or int8 (``from_pretrained(..., weight_dtype=...)``)."""
        return weight_format(self.head)

    @property
    def nbytes(self) -> int:
        """Bytes of every weight of the model as stored."""
        return sum(int(p.nbytes) for p in self.parameters())

    def parameters(self) -> list[np.ndarray]:
        """Every weight array of the model (each stored once)."""
        raise NotImplementedError

    def new_caches(self, batch_size: int, max_len: int, dtype: Any = None) -> list[KVCache]:
        """One empty :class:`~manyheads.KVCache` per layer (``dtype`` is passed through)."""
        return [b.attn.new_cache(batch_size, max_len, dtype) for b in self.blocks]

    def _check_ids(self, ids: Any) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"ids must have shape (batch, tokens) or (tokens,), got {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"ids must be integer token ids, got dtype {arr.dtype}")
        if arr.shape[1] == 0 or arr.shape[0] == 0:
            raise ValueError(f"ids must hold at least one token per row, got shape {arr.shape}")
        if arr.size == 1:  # (a decoding step's one id, without NumPy's reductions)
            lo = hi = int(arr.item())
        else:
            lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary: ids must be in "
                             f"[0, {self.vocab_size - 1}] (vocab_size={self.vocab_size})")
        return arr.astype(np.intp, copy=False)

    def _check_mask(self, attention_mask: Any, shape: tuple[int, int],
                    past: int) -> np.ndarray | None:
        """The padding (True = pad) of an HF-style mask, or None when nothing is padded."""
        if attention_mask is None:
            return None
        m = np.asarray(attention_mask)
        if m.ndim == 1 and shape[0] == 1:
            m = m[None]
        if m.shape != shape:
            raise ValueError(f"attention_mask must have the shape of ids {shape}, got {m.shape}")
        if not (m.dtype == np.bool_ or np.issubdtype(m.dtype, np.integer)) or \
                not np.isin(m, (0, 1)).all():
            raise ValueError("attention_mask must hold 1 (token) and 0 (padding) only")
        real = m.astype(bool)
        if real.all():
            return None
        if past:
            raise ValueError("attention_mask may mark padding only in the first call on a "
                             "cache (left padding of the prompts)")
        empty = ~real.any(axis=1)
        if empty.any():
            raise ValueError(f"attention_mask leaves rows {np.flatnonzero(empty).tolist()} "
                             "without any token")
        if (np.diff(real.astype(np.int8), axis=1) < 0).any():
            raise ValueError("attention_mask must be left padding: each row's zeros come "
                             "before its tokens")
        return ~real

    def _check_room(self, past: int, new: int) -> None:
        if past + new > self.context_length:
            raise ValueError(
                f"{past + new} tokens ({past} already cached + {new} new) exceed the "
                f"model's context length {self.context_length}")

    def _positions(self, caches: list[KVCache] | None, pad: np.ndarray | None,
                   shape: tuple[int, int]) -> np.ndarray:
        """(B, T) absolute positions of the new tokens, counting each row's real tokens."""
        B, T = shape
        if caches is None or not len(caches[0]):
            start = np.zeros((B, 1), dtype=np.intp)
        else:
            c = caches[0]
            start = (len(c) - c._padded)[:, None]
        if pad is None:
            return start + np.arange(T, dtype=np.intp)[None, :]
        counted = np.cumsum(~pad, axis=1, dtype=np.intp) - 1
        return start + np.maximum(counted, 0)

    def hidden_states(self, ids: Any, *, attention_mask: Any = None,
                      caches: list[KVCache] | None = None, stop_at: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray | None]:
        """The residual stream (B, T, d_model) after the blocks before ``stop_at`` (all by
        default), and the padding mask (True = pad) or None."""
        arr = self._check_ids(ids)
        if caches is None:
            self._check_room(0, arr.shape[1])
            return self._hidden(arr, self._check_mask(attention_mask, arr.shape, 0), None,
                                stop_at)
        if not isinstance(caches, (list, tuple)) or \
                not all(isinstance(c, KVCache) for c in caches):
            self._check_caches(caches, arr.shape[0])  # (raises, naming what was expected)
        with hold_caches(caches):
            return self._hidden_held(arr, attention_mask, caches, stop_at)

    def _hidden_held(self, arr: np.ndarray, attention_mask: Any, caches: list[KVCache],
                     stop_at: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`hidden_states` with caches, every one held by this call."""
        past = self._check_caches(caches, arr.shape[0])
        self._check_room(past, arr.shape[1])
        pad = self._check_mask(attention_mask, arr.shape, past)
        try:
            return self._hidden(arr, pad, caches, stop_at)
        except BaseException:
            # a step that fails part-way (a value a float16 cache cannot hold, Ctrl-C)
            # has stored its tokens in the layers before: take them back, so that every
            # layer holds the same tokens; unless a wrapped sliding-window cache cannot
            # (then as they are: the check above refuses them if they differ)
            ahead = [c for c in caches if len(c) > past]
            if all(len(c) <= c.capacity for c in ahead):
                for c in ahead:
                    c.truncate(past)
            raise

    def _hidden(self, arr: np.ndarray, pad: np.ndarray | None, caches: list[KVCache] | None,
                stop_at: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`hidden_states` of checked ids, padding and caches."""
        x = self._embed(arr, self._positions(caches, pad, arr.shape)
                        if self.learned_positions else None)
        if caches is not None and arr.shape[1] == 1 and pad is None:
            # a decoding step: compiled where the family can, else the blocks' lean path
            step = self._decode_step(caches, arr.shape[0]) if stop_at is None else None
            y = None if step is None else step(x, caches)
            if y is not None:
                return y, pad
            for block, cache in zip(self.blocks[:stop_at], caches):
                decode = getattr(block, "decode", None)
                x = block(x, cache, None) if decode is None else decode(x, cache)
            return x, pad
        for i, block in enumerate(self.blocks[:stop_at]):
            x = block(x, None if caches is None else caches[i], pad)
        return x, pad

    def logits(self, ids: Any, *, attention_mask: Any = None,
               caches: list[KVCache] | None = None, last_only: bool = False) -> np.ndarray:
        """Next-token logits, float32 (B, T, vocab) (or (B, 1, vocab) with ``last_only``).

        Parameters
        ----------
        ids : int array (B, T) or (T,)
            Token ids in ``[0, vocab_size)``.
        attention_mask : array (B, T) of 0/1, optional
            Hugging Face's convention: 1 = token, 0 = padding (left padding only).
        caches : list of KVCache, optional
            From :meth:`new_caches`: the ids continue the tokens already cached
            (their keys and values are appended).
        last_only : bool
            Compute the logits of the last position only (what generation needs).
        """
        x, _ = self.hidden_states(ids, attention_mask=attention_mask, caches=caches)
        if last_only:
            x = x[:, -1:]
        z = project(self._final_norm(x), self.head)
        if self.final_softcap is not None:
            z /= np.float32(self.final_softcap)
            np.tanh(z, out=z)
            z *= np.float32(self.final_softcap)
        return z

    def generate(self, ids: Any, max_new_tokens: int, *, cache_dtype: Any = None,
                 attention_mask: Any = None, eos_token_id: int | Sequence[int] | None = None,
                 callback: Callable[[int, np.ndarray], None] | None = None,
                 caches: list[KVCache] | None = None, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repetition_penalty: float = 1.0,
                 seed: int | np.random.Generator | None = None,
                 stop: Sequence[str | int] | None = None, tokenizer: Any = None,
                 pad_token_id: int | None = None) -> np.ndarray:
        """Greedy decoding or sampling with a KV cache; returns only the new ids,
        (B, max_new_tokens) int64.

        The next-token choice follows Hugging Face transformers' ``generate``: the
        repetition penalty, then (with ``do_sample``) temperature, top-k, top-p and
        min-p, in that order, then the argmax or a draw (the models guide's
        *Sampling* section has the details, ties included).  Every argument is
        checked before anything runs.

        Parameters
        ----------
        ids : int array (B, T) or (T,)
            The prompts; a batch of different lengths is left-padded and
            described by ``attention_mask`` (each row then generates exactly what
            it would alone, when greedy, with float32 caches; with narrower ones
            within their rounding, see the guide's Padding section).
        max_new_tokens : int
            Tokens to generate per row; prompt plus new tokens must fit the
            context length.
        cache_dtype : optional
            Storage type of the KV caches, passed to :meth:`manyheads.KVCache`
            (default: float32).  Beside ``caches``, it must be their format.
        attention_mask : array (B, T) of 0/1, optional
            1 = token, 0 = left padding (Hugging Face's convention).
        eos_token_id : int or list of int, optional
            A row ends when it produces one of them; a finished row is filled
            with ``pad_token_id`` from there on, and generation stops when every
            row has ended.  None (default): always ``max_new_tokens`` steps.
        callback : callable(step, tokens), optional
            Called with each step's new tokens (B,) as soon as they are chosen.
        caches : list of KVCache, optional
            Empty caches from :meth:`new_caches` to use (and inspect afterwards,
            e.g. their ``nbytes``), made for batch size B and a ``max_len`` of at
            least T + ``max_new_tokens``; by default fresh ones are made.
        do_sample : bool
            False (default): the most probable token (greedy).  True: a draw
            from the processed distribution.
        temperature : float > 0
            With ``do_sample``: the logits are divided by it (default 1.0).  Any
            positive finite temperature works: one so small that the quotients
            would overflow float32 divides each row's logits less its largest
            (the same distribution), so sampling approaches greedy decoding as
            the temperature approaches 0.
        top_k : int >= 0, optional
            With ``do_sample``: keep the ``top_k`` largest logits (and ties with
            the last of them).  None (default) or 0, as in transformers: no
            top-k filter (transformers' ``generate`` uses 50 unless told
            otherwise).
        top_p : float in (0, 1], optional
            With ``do_sample``: keep the smallest set of most probable tokens
            whose probabilities add up to ``top_p``; 1.0 or None: no filter.
        min_p : float in [0, 1], optional
            With ``do_sample``: drop the tokens whose probability is below
            ``min_p`` times the largest.
        repetition_penalty : float > 0
            Applied to the logits of every token seen so far (the prompt's and
            the generated ones), greedy or not: a positive logit is divided by
            it, a negative one multiplied (1.0, the default: none).
        seed : int >= 0 or numpy.random.Generator, optional
            With ``do_sample``: the source of the draws
            (``numpy.random.default_rng(seed)``); the same seed gives the same
            tokens.  None: fresh entropy.  Checked whether or not it is used.
        stop : list of str and int, optional
            A row also ends when it produces one of these token ids, or when
            its text (``tokenizer.decode``, special tokens included, so that
            ``"<|im_end|>"`` is one) has an occurrence of one of these strings
            that ends in its new tokens (it may begin in the prompt, as
            transformers' ``stop_strings``); the tokens up to and including the
            one that ends it are kept.  Strings need ``tokenizer`` and a filler
            (``pad_token_id`` or ``eos_token_id``).
        tokenizer : object with ``decode(ids) -> str``, optional
            For the stop strings, e.g. a ``tokenizers.Tokenizer``.
        pad_token_id : int, optional
            What fills a row after it ends (default: the first of
            ``eos_token_id``, else the first stop id).
        """
        arr = self._check_ids(ids)
        if isinstance(max_new_tokens, bool) or \
                not isinstance(max_new_tokens, (int, np.integer, float, np.floating)):
            raise TypeError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if not (float(max_new_tokens).is_integer() and max_new_tokens >= 0):
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        n = int(max_new_tokens)
        B, T = arr.shape
        self._check_room(0, T + n)
        pad = self._check_mask(attention_mask, arr.shape, 0)
        settings = check_sampling(do_sample, temperature, top_k, top_p, min_p,
                                  repetition_penalty)
        ends = token_ids("eos_token_id", eos_token_id, self.vocab_size)
        stop_ids, stop_texts = check_stop(stop, tokenizer, self.vocab_size)
        ends += stop_ids
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or
                                         not isinstance(pad_token_id, (int, np.integer))):
            raise ValueError(f"pad_token_id must be one token id, got {pad_token_id!r}")
        fill = token_ids("pad_token_id", pad_token_id, self.vocab_size)[:1] or ends[:1]
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable as callback(step, tokens), got "
                            f"{callback!r}")
        if stop_texts is not None and not fill:
            raise ValueError("stop strings need pad_token_id (or eos_token_id): the id that "
                             "fills a row after it ends")
        check_seed(seed)
        fmt = None if cache_dtype is None else _formats.cache_format(cache_dtype)
        if caches is not None:
            self._check_generate_caches(caches, B, T, n)
            other = next((c.format for c in caches if fmt is not None and c.format != fmt.name),
                         None)
            if fmt is not None and other is not None:
                raise ValueError(f"cache_dtype={fmt.name} does not match the caches given "
                                 f"({other}): pass cache_dtype or caches, not both")
        rng = np.random.default_rng(seed) if settings.do_sample else None
        out = np.empty((B, n), dtype=np.int64)
        if n == 0:
            return out
        if caches is None:
            caches = self.new_caches(B, T + n, cache_dtype)
        seen = None
        if settings.penalises:  # the prompts' real tokens
            seen = np.zeros((B, self.vocab_size), dtype=bool)
            rows = np.broadcast_to(np.arange(B)[:, None], arr.shape)
            real = np.ones(arr.shape, dtype=bool) if pad is None else ~pad
            seen[rows[real], arr[real]] = True
        logits = self.logits(arr, attention_mask=attention_mask, caches=caches,
                             last_only=True)
        done = np.zeros(B, dtype=bool)
        for step in range(n):
            tok = choose(process_logits(logits[:, -1], settings, seen), settings, rng)
            if fill:
                tok[done] = fill[0]
                done |= np.isin(tok, ends)
            if stop_texts is not None:
                for r in np.flatnonzero(~done):
                    prompt = arr[r] if pad is None else arr[r][~pad[r]]
                    done[r] = stop_texts.hit(prompt, np.append(out[r, :step], tok[r]))
            out[:, step] = tok
            if seen is not None:
                seen[np.arange(B), tok] = True
            if callback is not None:
                callback(step, tok)
            if fill and done.all():
                out[:, step + 1:] = fill[0]
                break
            if step + 1 < n:
                logits = self.logits(tok[:, None], caches=caches, last_only=True)
        return out

    def _check_caches(self, caches: Any, batch: int) -> int:
        """The tokens every layer's cache holds; ValueError for caches that are not
        ``num_layers`` KVCaches made for ``batch`` rows and holding the same tokens."""
        if not isinstance(caches, (list, tuple)) or len(caches) != self.num_layers or \
                not all(isinstance(c, KVCache) for c in caches):
            raise ValueError(f"caches must be a list of {self.num_layers} KVCache "
                             f"(model.new_caches())")
        other = [c.batch_size for c in caches if c.batch_size != batch]
        if other:
            raise ValueError(f"caches were made for batch_size={other[0]}, but ids have "
                             f"batch size {batch}")
        past = len(caches[0])
        if any(len(c) != past for c in caches):
            raise ValueError(f"caches must hold the same tokens in every layer, but they "
                             f"hold {sorted({len(c) for c in caches})} (as a call with stop_at "
                             f"leaves them, or a step that failed part-way where a "
                             f"sliding-window cache could not take its token back): reset them")
        return past

    def _check_generate_caches(self, caches: Any, batch: int, prompt: int, new: int) -> None:
        """Refuse caches that ``generate`` could not fill (:meth:`_check_caches`, not
        empty, or too short for the prompt and the new tokens)."""
        if self._check_caches(caches, batch):
            raise ValueError(f"caches must be {self.num_layers} empty caches from new_caches()")
        room = min(c.max_len for c in caches)
        if room < prompt + new:
            raise ValueError(f"caches hold {room} tokens (max_len={room}), fewer than the "
                             f"prompt's {prompt} plus max_new_tokens={new} ({prompt + new})")

    def attention_weights(self, ids: Any, layer: int) -> np.ndarray:
        """Every head's attention weights of layer ``layer`` for one sequence: (H, T, T)."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int (a layer index), got {layer!r}")
        arr = self._check_ids(ids)
        if arr.shape[0] != 1:
            raise ValueError(f"attention_weights takes one sequence, got a batch of {arr.shape[0]}")
        if not -self.num_layers <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers - 1}], got {layer}")
        layer %= self.num_layers
        x, _ = self.hidden_states(arr, stop_at=layer)
        block = self.blocks[layer]
        _, w = block.attn(block.attention_input(x), return_weights=True)
        weights: np.ndarray = w[0]
        return weights
