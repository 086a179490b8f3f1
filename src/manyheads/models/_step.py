"""A decoding step of a Llama-shaped model compiled into one parallel region.

Between the products of a decoding step there is little work (norms, the rotation,
the cache's new slot, residual adds), but done from Python it costs more than the
products of a small model, and each product starts and ends a parallel region. A
:class:`CompiledStep` lays one token's whole pass through the blocks out once per
(model, caches, rows) as :class:`manyheads._kernels.DecodeProgram` phases: each
product's work items on every thread, each small step on the first thread, the team
meeting at a spinning barrier between phases. The kernels, plans and formulas are
those of :meth:`~manyheads.models.llama.DecoderAttention.decode` and
:meth:`~manyheads.models.llama.LlamaBlock.decode`, so the logits are the same bits
(a test compares them for every family and cache format).

What it covers: float32 activations, up to FEW_ROWS rows, any weight format,
SwiGLU and GeGLU (GELU's tanh form) blocks (optionally with post-norms and per-head
query/key norms), caches in float32, float16, bfloat16, int8 or int4 without padding.
Anything else takes the blocks' own decode (so does a step whose new key or value a
float16, bfloat16 or int4 cache cannot hold: the blocks' decode then raises its
ValueError; and a step in which an int8 product's input is so large, above about
float32's largest over 128 times its rows, that the compiled product cannot sum it:
the blocks' decode takes its products, which scale such an input first).
"""
from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from .. import _config, _core, _kernels
from .._formats import FORMATS
from ..cache import KVCache, take
from ._decoder import prepared
from .gpt2 import gelu_tanh

__all__ = ["CompiledStep", "COMPILED_CACHE_FORMATS", "Watched"]

#: cache storage formats the compiled step writes itself
COMPILED_CACHE_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")


#: assignments so far of an attribute named in some Watched class's WATCHED
_assigned = [0]


class Watched:
    """Mixin of the blocks and attention modules whose arrays a compiled step reads:
    assigning an attribute named in ``WATCHED`` is counted, and a step built before the
    count moved no longer matches.  One comparison a token instead of one per array (13
    a layer, 28 µs a token over 30 layers, about 100 µs with the caches cold)."""

    WATCHED: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.WATCHED:
            _assigned[0] += 1
        super().__setattr__(name, value)


def _blocks_compile(blocks: Sequence[Any], silu: Any) -> bool:
    """Whether every block is one the compiled step reproduces (SwiGLU or GeGLU with
    GELU's tanh form, Watched blocks and attention)."""
    if not all(isinstance(m, Watched) for b in blocks for m in (b, b.attn)):
        return False  # (matches would not see their arrays replaced)
    for b in blocks:
        a = b.attn
        if b.act is not silu and b.act is not gelu_tanh:
            return False
        if a.sinks is not None or a.alibi_slopes is not None:
            return False
        if a.qk_norm is not None and a.eps != b.eps:
            return False
    return True


class CompiledStep:
    """One model's decoding step over one list of caches, for ``rows`` rows.  It refers
    to the caches weakly and hands their arrays to each run only, so it never keeps a
    cache alive; the layers share their work buffers (they run in turn)."""

    def __init__(self, blocks: Sequence[Any], caches: Sequence[KVCache], rows: int,
                 num_threads: int) -> None:
        self.blocks = list(blocks)
        self.cache_refs = [weakref.ref(c) for c in caches]
        self.rows = rows
        self.num_threads = num_threads
        self.assigned = _assigned[0]  # (the blocks' arrays are replaced when it moves)
        # per layer, once a token has run: its attention call (retargeted to each next
        # token), the cache arrays it reads and the module settings it was built with;
        # dropped with the first cache to go, so that no cache's arrays outlive it here
        self._calls: list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]] | None = None
        me = weakref.ref(self)
        # (detached when this step goes: a model that alternates between lists of caches
        # replaces its step, and each one's finalizers would stay with live caches)
        self._finalizers = [weakref.finalize(c, CompiledStep._forget_calls, me)
                            for c in caches]
        B = rows
        d = self.blocks[0].norm_attn.shape[0]
        self.x = np.empty((B, d), np.float32)
        self.program = _kernels.DecodeProgram(len(self.blocks), num_threads)
        self.layers: list[tuple[Any, np.ndarray, np.ndarray]] = []
        shared: dict[tuple[str, int], np.ndarray] = {}

        def buffer(name: str, n: int) -> np.ndarray:
            if (name, n) not in shared:
                shared[name, n] = np.empty((B, n), np.float32)
            return shared[name, n]

        for i, b in enumerate(self.blocks):
            a = b.attn
            H, Hkv, D, F = a.num_heads, a.num_kv_heads, a.head_dim, b.d_ff
            bufs = (self.x, buffer("h", d), buffer("qkv", (H + 2 * Hkv) * D),
                    buffer("att", H * D), buffer("o", d), buffer("gu", 2 * F),
                    buffer("act", F), buffer("dn", d), buffer("tmp", d))
            qn, kn = a.qk_norm if a.qk_norm is not None else (None, None)
            norms = (b.norm_attn, b.norm_mlp, b.post_attn, b.post_mlp, qn, kn)
            sources = ((a, "W_qkv", a.b_qkv, (d, (H + 2 * Hkv) * D)),
                       (a, "W_out", a.b_out, (H * D, d)),
                       (b, "w_gate_up", b.b_gate_up, (d, 2 * F)), (b, "w_down", b.b_down, (F, d)))
            for owner, name, bias, shape in sources:  # (a weight replaced with another shape
                # would be read past its end)
                w = getattr(owner, name)
                if tuple(w.shape) != shape or (bias is not None and bias.shape != shape[1:]):
                    raise ValueError(
                        f"{name} of layer {i} has shape {tuple(w.shape)}" + (
                            "" if bias is None else f" and its bias {bias.shape}") +
                        f": the model needs {shape}" + ("" if bias is None else
                                                       f" and ({shape[1]},)"))
            products = tuple(prepared(owner, name) + (bias,)
                             for owner, name, bias, _ in sources)
            self.program.set_layer(i, (B, d, H, Hkv, D, F), b.eps, bufs, norms, products,
                                   b.act is gelu_tanh)
            self.layers.append((a, bufs[2][:, :H * D].reshape(B, H, 1, D),
                                bufs[3].reshape(B, H, 1, D)))

    def __del__(self) -> None:
        for f in getattr(self, "_finalizers", ()):
            f.detach()

    @staticmethod
    def _forget_calls(step: weakref.ref[CompiledStep]) -> None:
        alive = step()
        if alive is not None:
            alive._calls = None

    @classmethod
    def serves(cls, blocks: Sequence[Any], caches: Sequence[KVCache], rows: int,
               silu: Any, num_threads: int) -> bool:
        """Whether a compiled step can run this decoding step: its threads spin, so
        not with more threads than the process has cores."""
        return (rows <= _kernels.FEW_ROWS and num_threads <= _config.cores()
                and _blocks_compile(blocks, silu)
                and all(c.format in COMPILED_CACHE_FORMATS and not c._any_padding
                        for c in caches))

    def matches(self, blocks: Sequence[Any], caches: Sequence[KVCache], rows: int,
                num_threads: int) -> bool:
        """Whether this step was built for these blocks (weights unchanged), caches,
        rows and number of threads."""
        return (rows == self.rows and num_threads == self.num_threads
                and len(caches) == len(self.cache_refs)
                and len(blocks) == len(self.blocks)
                and all(r() is c for r, c in zip(self.cache_refs, caches))
                and all(map(operator.is_, blocks, self.blocks))
                and _assigned[0] == self.assigned)

    def __call__(self, x: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray | None:
        """The residual stream after every block for one token a row, x (B, 1, d), through
        ``caches`` (those it was built for): a new array; the caches advance by one
        token.  None, and the caches not advanced, when a cache holds padding, some
        layer's attention is planned in a layout the step does not lay out, or a new key
        or value rounds to infinity in a float16 or bfloat16 cache, or in an int4
        cache's pairs, or an int8 product's input is too large for the compiled product
        (the slots past the caches' ends may then have been written: the blocks' decode
        writes them again)."""
        B = self.rows
        if any(c._any_padding for c in caches):
            return None
        calls, angles, slots, arrays = [], [], [], []
        built = self._calls
        kept = []
        for i, ((a, q, out), c) in enumerate(zip(self.layers, caches)):
            stored = (c.keys, c.values, c.key_scales, c.value_scales)
            settings = (a.scale, a.softcap, a.window, a.causal)
            # the last token's call over the same arrays with the same settings is planned
            # again for one key more: the layout work of a new call and the cache's checks
            # were most of a step's Python time
            last = built[i] if built is not None else None
            same = last is not None and all(map(operator.is_, stored, last[1])) and \
                settings == last[2]
            if not same or len(c) + 1 > min(a.context_length, c.max_len):
                a._check_cache_call(c, None, B, 1)  # (a full cache raises here)
            slot, n, offset, window = c._decode_slot()
            call = None
            if same and last is not None and last[0].retarget(n, offset, window or 0):
                call = last[0]
            if call is None:
                st = c._stored(slice(None), slice(0, n))
                scale = 1.0 / np.sqrt(a.head_dim) if a.scale is None else a.scale
                call = _core.decode_call(q, st.k, st.v, st.k_scale, st.v_scale, scale=scale,
                                         causal_offset=offset, window=window,
                                         softcap=a.softcap, num_threads=self.num_threads,
                                         out=out)
                if call is None:
                    self._calls = None
                    return None
            kept.append((call, stored, settings))
            calls.append(call)
            angles.append(a.rotary.tables(len(c), 1))
            slots.append(slot)
            arrays.append((FORMATS[c.format].code,) + stored)
        self._calls = kept
        held: list[KVCache] = []
        try:
            me = threading.get_ident()
            for c in caches:  # (held already by the model's call: hold_caches)
                if c._holder != me and take(c):
                    held.append(c)
            self.x[...] = x.reshape(B, -1)
            self.program.run(calls, angles, slots, arrays)
            if self.program.overflowed:  # void: the blocks' decode says why
                return None
            # (no slot of these caches is padding, the new ones included: see
            # KVCache._any_padding)
            for c in caches:
                c._len += 1
        finally:
            for c in held:
                c._busy.release()
        y: np.ndarray = self.x.reshape(x.shape).copy()
        return y
