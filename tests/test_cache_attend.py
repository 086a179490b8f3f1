"""KVCache.attend: the cache from the functional side, with one's own projections."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import oracle

from conftest import normal


def test_own_projections_through_the_cache_equal_one_causal_pass(rng):
    B, Hq, Hkv, T, D = 2, 6, 2, 40, 16
    q, k, v = normal(rng, (B, Hq, T, D)), normal(rng, (B, Hkv, T, D)), normal(rng, (B, Hkv, T, D))
    cache = mh.KVCache(B, 64, Hkv, D, np.float64)
    outs = [cache.attend(q[:, :, :30], k[:, :, :30], v[:, :, :30])]
    for t in range(30, T):
        outs.append(cache.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]))
    assert len(cache) == T
    full = oracle.scaled_dot_product_attention(q, np.repeat(k, 3, axis=1),
                                               np.repeat(v, 3, axis=1), is_causal=True)
    np.testing.assert_allclose(np.concatenate(outs, axis=2), full, rtol=0, atol=1e-10)


def test_cache_attend_returns_weights_over_every_cached_key(rng):
    cache = mh.KVCache(1, 16, 1, 8, np.float64)
    x = normal(rng, (1, 1, 10, 8))
    cache.attend(x, x, x)
    out, w = cache.attend(x[:, :, :1], x[:, :, :1], x[:, :, :1], return_weights=True)
    assert w.shape == (1, 1, 1, 11)
    np.testing.assert_allclose(w.sum(-1), 1.0)


@pytest.mark.parametrize("q,k,match", [
    ((1, 2, 3, 8), (1, 3, 3, 8), "key must have shape"),
    ((1, 3, 3, 8), (1, 2, 3, 8), "query must have shape"),
    ((1, 2, 2, 8), (1, 2, 3, 8), "query must have shape"),
    ((1, 0, 3, 8), (1, 2, 3, 8), "query must have shape"),  # no query head: nothing to do
])
def test_cache_attend_rejects_shapes_that_do_not_fit(q, k, match):
    cache = mh.KVCache(1, 16, 2, 8, np.float64)
    with pytest.raises(ValueError, match=match):
        cache.attend(np.ones(q), np.ones(k), np.ones(k))
    assert len(cache) == 0


def test_cache_attend_refuses_to_overflow_and_to_mix_dtypes():
    cache = mh.KVCache(1, 4, 1, 8, np.float32)
    x = np.ones((1, 1, 5, 8), np.float32)
    with pytest.raises(ValueError, match="max_len"):
        cache.attend(x, x, x)
    with pytest.raises(TypeError, match="float32"):
        cache.attend(x[:, :, :2].astype(np.float64), x[:, :, :2].astype(np.float64),
                     x[:, :, :2].astype(np.float64))
    assert len(cache) == 0


@pytest.mark.parametrize("fmt, window", [(np.float32, None), (np.float32, 6), (np.float64, None),
                                         (np.float16, None), ("int8", 6), ("int4", None)])
def test_one_token_steps_take_the_lean_path_with_the_general_paths_bits(rng, monkeypatch,
                                                                       fmt, window):
    """A one-token step without padding, weights or features other than a soft cap goes
    through the modules' lean decoding step: the same bits as the general step (reached
    here with an all-False padding mask), grouped heads and a wrapped ring included."""
    taken = []
    lean_step = mh.KVCache._decode_into

    def spy(self, *args, **kw):
        taken.append(True)
        return lean_step(self, *args, **kw)

    monkeypatch.setattr(mh.KVCache, "_decode_into", spy)
    dt = np.float64 if fmt is np.float64 else np.float32
    lean = mh.KVCache(2, 24, 2, 32, fmt, window=window)
    x = normal(rng, (2, 2, 5, 32), dt)
    lean.attend(x, x, x)
    general = lean.copy()
    for step in range(8):
        q = normal(rng, (2, 6, 1, 32), dt)
        k, v = (normal(rng, (2, 2, 1, 32), dt) for _ in range(2))
        cap = dict(softcap=3.0) if step % 2 else {}
        got = lean.attend(q, k, v, **cap)
        want = general.attend(q, k, v, key_padding_mask=np.zeros((2, 1), bool), **cap)
        assert got.dtype == dt and got.shape == (2, 6, 1, 32)
        np.testing.assert_array_equal(got, want)
        assert len(lean) == len(general) == 6 + step
    np.testing.assert_array_equal(lean.keys, general.keys)
    assert taken == [True] * 8


@pytest.mark.parametrize("stacked, fmt, window, kv_heads, softcap",
                         [(False, np.float32, None, 6, None), (False, np.float32, 6, 2, 5.0),
                          (False, np.float16, None, 2, None), (False, "int8", 6, 6, None),
                          (False, "int4", None, 2, 5.0), (True, np.float32, 6, 6, 5.0),
                          (True, "int4", None, 6, None)])
def test_a_modules_one_token_steps_take_the_lean_path_with_the_general_bits(
        rng, monkeypatch, stacked, fmt, window, kv_heads, softcap):
    """A module's one-token step with a cache, without padding, weights or dropout,
    stores and attends through the cache's lean decoding step (a stack of heads: head
    by head): the same bits as the general step (reached with an all-False padding
    mask), grouped heads, a soft cap and a wrapped ring included."""
    taken = []
    into = mh.KVCache._decode_into

    def spy(self, *args, **kw):
        taken.append(len(self))
        return into(self, *args, **kw)

    monkeypatch.setattr(mh.KVCache, "_decode_into", spy)
    if stacked:
        m = mh.StackedMultiHeadAttention(16, 6 * 32, 24, 0.0, 6, window=window,
                                         softcap=softcap, seed=3)
    else:
        m = mh.MultiHeadAttention(16, 6 * 32, 24, 0.0, 6, num_kv_heads=kv_heads,
                                  window=window, softcap=softcap, seed=3)
    lean = m.new_cache(2, 24, dtype=fmt)
    x = normal(rng, (2, 5, 16), np.float32)
    m(x, cache=lean)
    general = lean.copy()
    for step in range(8):
        x1 = normal(rng, (2, 1, 16), np.float32)
        got = m(x1, cache=lean)
        want = m(x1, cache=general, key_padding_mask=np.zeros((2, 1), bool))
        np.testing.assert_array_equal(got, want)
        assert len(lean) == len(general) == 6 + step
    np.testing.assert_array_equal(lean.keys, general.keys)
    # each one-token step (a stack's once a head), none of the others
    assert taken == [n for n in range(5, 13) for _ in range(6 if stacked else 1)]


def test_a_decoding_call_set_again_lets_the_last_arrays_go(rng):
    """A cache keeps its last step's attention call for the next token, giving it that
    token's queries and output: the call holds only the arrays it was given last."""
    import gc
    import weakref

    from manyheads import _core
    cache = mh.KVCache(1, 64, 2, 32)
    x = normal(rng, (1, 2, 8, 32), np.float32)
    cache.attend(x, x, x)
    st = cache._stored(slice(None), slice(0, 8))
    q, out = normal(rng, (1, 4, 1, 32), np.float32), np.empty((1, 4, 1, 32), np.float32)
    call = _core.decode_call(q, st.k, st.v, None, None, scale=0.5, causal_offset=7,
                             window=None, softcap=None, num_threads=1, out=out)
    seen = []
    for n in range(9, 40):
        q, out = normal(rng, (1, 4, 1, 32), np.float32), np.empty((1, 4, 1, 32), np.float32)
        seen += [weakref.ref(q), weakref.ref(out)]
        assert call.retarget(n, n - 1, 0)
        _core.decode_rebind(call, q, out)
    del q, out
    gc.collect()
    assert sum(r() is not None for r in seen) == 2  # the last query and output


@pytest.mark.parametrize("how", ["copy", "pickle"])
def test_a_copied_cache_decodes_over_its_own_rows(rng, how):
    """A cache copied (or pickled) after decoding steps decodes the next tokens over its
    own rows: the same results as the original while both hold the same tokens, its
    own once they differ, and neither changes the other."""
    import pickle
    cache = mh.KVCache(1, 32, 2, 32, "int8")
    x = normal(rng, (1, 2, 6, 32), np.float32)
    cache.attend(x, x, x)
    for _ in range(3):
        t = normal(rng, (1, 2, 1, 32), np.float32)
        cache.attend(t, t, t)
    twin = cache.copy() if how == "copy" else pickle.loads(pickle.dumps(cache))
    t = normal(rng, (1, 2, 1, 32), np.float32)
    np.testing.assert_array_equal(twin.attend(t, t, t), cache.attend(t, t, t))
    a, b = (normal(rng, (1, 2, 1, 32), np.float32) for _ in range(2))
    got_twin, got = twin.attend(a, a, a), cache.attend(b, b, b)
    fresh = twin.copy()
    fresh.truncate(len(twin) - 1)
    np.testing.assert_array_equal(got_twin, fresh.attend(a, a, a))
    assert not np.array_equal(got_twin, got)
    assert not np.array_equal(twin.keys[:, :, 10], cache.keys[:, :, 10])
