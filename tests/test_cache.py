"""KV cache, decode schedule, grouped-query heads, padding, sliding windows, float16 cache."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import oracle
from manyheads import _core

from conftest import atol_for, normal


def make(kind, dtype=np.float64, window=None, num_kv_heads=None, seed=0):
    if kind == "fused":
        return mh.MultiHeadAttention(24, 32, 4096, 0.0, 4, qkv_bias=True, window=window,
                                     num_kv_heads=num_kv_heads, dtype=dtype, seed=seed)
    if kind == "stacked":
        return mh.StackedMultiHeadAttention(24, 32, 4096, 0.0, 4, qkv_bias=True, window=window,
                                            dtype=dtype, seed=seed)
    return mh.CausalAttention(24, 8, 4096, qkv_bias=True, window=window, dtype=dtype, seed=seed)


def incremental(m, x, chunks, cache):
    outs, t = [], 0
    for n in chunks:
        outs.append(m(x[:, t:t + n], cache=cache))
        t += n
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("kind", ["fused", "stacked", "single"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_prefill_then_decode_equals_one_forward(rng, kind, dtype):
    m = make(kind, dtype)
    x = normal(rng, (2, 90, 24), dtype)
    cache = m.new_cache(2, 128)
    inc = incremental(m, x, [70] + [1] * 20, cache)
    assert len(cache) == 90
    np.testing.assert_allclose(inc, m(x), rtol=0, atol=atol_for(dtype))


def test_long_cache_decode_uses_split_keys_and_matches(rng):
    m = make("fused", np.float64)
    x = normal(rng, (1, 1500, 24))
    cache = m.new_cache(1, 1600)
    inc = incremental(m, x, [1490] + [1] * 6 + [4], cache)
    np.testing.assert_allclose(inc, m(x), rtol=0, atol=1e-10)


def test_uneven_chunks_and_reset(rng):
    m = make("fused")
    x = normal(rng, (3, 50, 24))
    cache = m.new_cache(3, 50)
    np.testing.assert_allclose(incremental(m, x, [7, 1, 13, 29], cache), m(x), rtol=0, atol=1e-10)
    cache.reset()
    assert len(cache) == 0
    np.testing.assert_allclose(incremental(m, x, [50], cache), m(x), rtol=0, atol=1e-10)


def test_appending_past_max_len_raises_and_leaves_the_cache_unchanged(rng):
    m = make("fused")
    cache = m.new_cache(1, 10)
    m(normal(rng, (1, 8, 24)), cache=cache)
    keys = cache.keys.copy()
    with pytest.raises(ValueError, match="max_len"):
        m(normal(rng, (1, 3, 24)), cache=cache)
    assert len(cache) == 8
    np.testing.assert_array_equal(cache.keys, keys)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: mh.MultiHeadAttention(24, 48, 64, 0.0, 4, dtype=np.float64).new_cache(1, 10),
     ValueError, "kv heads"),
    (lambda: make("fused").new_cache(2, 10), ValueError, "batch_size"),
    (lambda: make("fused", window=4).new_cache(1, 10), ValueError, "window"),
    (lambda: make("fused", np.float32).new_cache(1, 10), TypeError, "cache"),
    (lambda: make("fused").new_cache(1, 10, dtype=np.float16), TypeError, "float16"),
    (lambda: "not a cache", TypeError, "KVCache"),
])
def test_cache_of_another_module_is_rejected(rng, bad, exc, match):
    m = make("fused")
    with pytest.raises(exc, match=match):
        m(normal(rng, (1, 3, 24)), cache=bad())


def test_cache_constructor_checks_arguments():
    with pytest.raises(ValueError, match="max_len"):
        mh.KVCache(1, 0, 1, 8)
    with pytest.raises(TypeError, match="dtype"):
        mh.KVCache(1, 4, 1, 8, dtype=np.int32)


@pytest.mark.parametrize("L", [1, 2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_schedule_matches_oracle_and_is_thread_invariant(rng, L, dtype):
    S = 5000
    q, k, v = (normal(rng, (2, 3, n, 64), dtype) for n in (L, S, S))
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                              v.astype(np.float64), is_causal=True,
                                              causal_offset=S - L)
    outs = [_core.attention(q, k, v, causal_offset=S - L, scale=0.125, num_threads=n, split=True)
            for n in (1, 2)]
    np.testing.assert_allclose(outs[0], ref, rtol=0, atol=atol_for(dtype))
    np.testing.assert_array_equal(outs[0], outs[1])
    whole = _core.attention(q, k, v, causal_offset=S - L, scale=0.125, num_threads=2, split=False)
    np.testing.assert_allclose(outs[0], whole, rtol=0, atol=atol_for(dtype))
    public = mh.scaled_dot_product_attention(q, k, v)  # non-causal, also split
    np.testing.assert_allclose(public, oracle.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), rtol=0,
        atol=atol_for(dtype))


def test_grouped_query_cache_stores_only_kv_heads(rng):
    m = make("fused", num_kv_heads=2)
    cache = m.new_cache(2, 64)
    assert cache.keys.shape == (2, 2, 64, 8)
    x = normal(rng, (2, 40, 24))
    np.testing.assert_allclose(incremental(m, x, [30] + [1] * 10, cache), m(x), rtol=0,
                               atol=1e-10)
    mq = make("fused", num_kv_heads=1)
    cache = mq.new_cache(2, 64)
    np.testing.assert_allclose(incremental(mq, x, [1] * 40, cache), mq(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["fused", "stacked"])
def test_left_padded_batch_equals_each_prompt_alone(rng, kind):
    m = make(kind)
    lengths = [12, 5, 9]
    T = max(lengths)
    prompts = [normal(rng, (n, 24)) for n in lengths]
    x = np.zeros((3, T, 24))
    pad = np.zeros((3, T), bool)
    for b, p in enumerate(prompts):
        x[b, T - len(p):] = p
        pad[b, :T - len(p)] = True
    out = m(x, key_padding_mask=pad)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(out[b, T - len(p):], m(p), rtol=0, atol=1e-10)
    assert np.isfinite(out).all()
    # and decoding together after the padded prefill
    steps = normal(rng, (3, 4, 24))
    cache = m.new_cache(3, T + 4)
    m(x, cache=cache, key_padding_mask=pad)
    dec = np.concatenate([m(steps[:, t:t + 1], cache=cache) for t in range(4)], axis=1)
    for b, p in enumerate(prompts):
        alone = m(np.concatenate([p, steps[b]]))
        np.testing.assert_allclose(dec[b], alone[-4:], rtol=0, atol=1e-10)


def test_a_step_that_fails_after_writing_padding_leaves_none_behind(rng):
    """A step whose padding was written before it failed: the cache goes on as if it had
    never been (the padding of the slots it wrote is not taken for the next tokens'), on
    the general path while the cache is marked and on the decoding path after
    truncate() has looked again."""
    m = make("fused")
    x = normal(rng, (2, 8, 24))
    cache = m.new_cache(2, 16)
    pad = np.zeros((2, 6), bool)
    pad[0, :3] = True
    q, k, v = (normal(rng, (2, 4, 6, 8)) for _ in range(3))
    with pytest.raises(RuntimeError, match="failed"):
        with cache.step(6, key_padding_mask=pad) as st:
            st.attend(q, k, v, scale=0.5, num_threads=1)
            raise RuntimeError("failed")
    assert len(cache) == 0
    out = incremental(m, x, [4, 1, 1], cache)
    assert not cache.padding.any()
    cache.truncate(len(cache))
    out = np.concatenate([out, incremental(m, x[:, 6:], [1, 1], cache)], axis=1)
    np.testing.assert_allclose(out, m(x), rtol=0, atol=1e-10)


def test_padding_mask_is_checked(rng):
    m = make("fused")
    x = normal(rng, (2, 5, 24))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, key_padding_mask=np.zeros((2, 4), bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        m(x, key_padding_mask=np.zeros((2, 5), int))


@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_matches_oracle(rng, window):
    m = make("fused", window=window)
    x = normal(rng, (2, 150, 24))
    y, w = m(x, return_weights=True)
    assert np.all(np.tril(w[0, 0], -window) == 0) and np.all(np.triu(w[0, 0], 1) == 0)
    plain = make("fused")
    plain.W_qkv[...] = m.W_qkv
    plain.b_qkv[...] = m.b_qkv
    plain.W_out[...] = m.W_out
    plain.b_out[...] = m.b_out
    D = m.head_dim
    qkv = x @ m.W_qkv + m.b_qkv
    q, k, v = (qkv[..., i * 32:(i + 1) * 32].reshape(2, 150, 4, D).transpose(0, 2, 1, 3)
               for i in range(3))
    ctx = oracle.scaled_dot_product_attention(q, k, v, is_causal=True, window=window)
    ref = ctx.transpose(0, 2, 1, 3).reshape(2, 150, 32) @ m.W_out + m.b_out
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-10)
    if window >= 150:
        np.testing.assert_allclose(y, plain(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["fused", "stacked"])
def test_ring_buffer_cache_keeps_only_the_window_and_equals_full(rng, kind):
    window = 16
    m = make(kind, window=window)
    x = normal(rng, (2, 70, 24))
    cache = m.new_cache(2, 100)
    assert cache.capacity == window and cache.keys.shape[2] == window
    inc = incremental(m, x, [10, 1, 1, 20, 3, 1, 1, 33], cache)
    np.testing.assert_allclose(inc, m(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["fused", "stacked"])
@pytest.mark.parametrize("where", ["prompt", "chunk"])
def test_padding_in_a_ring_that_several_tokens_wrap_equals_full(rng, kind, where):
    # (a stack's heads attend one at a time within a step: the first one's new tokens
    # had overwritten the padding of ring slots the next heads still read)
    m = make(kind, window=16)
    x = normal(rng, (2, 60, 24))
    pad = np.zeros((2, 60), bool)
    if where == "prompt":
        pad[1, :5] = True      # a left-padded prompt, then chunks past the window
    else:
        pad[0, 30:34] = True   # padding inside a chunk that wraps the ring
    cache, outs, t = m.new_cache(2, 100), [], 0
    for n in (10, 17, 1, 20, 12):
        outs.append(m(x[:, t:t + n], key_padding_mask=pad[:, t:t + n], cache=cache))
        t += n
    np.testing.assert_allclose(np.concatenate(outs, axis=1), m(x, key_padding_mask=pad),
                               rtol=0, atol=1e-10)


def test_float16_cache_halves_memory_and_matches_rounded_oracle(rng):
    m = make("fused", np.float32)
    x = normal(rng, (1, 1200, 24), np.float32)
    c32, c16 = m.new_cache(1, 1300), m.new_cache(1, 1300, dtype=np.float16)
    assert c16.nbytes * 2 == c32.nbytes
    a = incremental(m, x, [1100] + [1] * 100, c32)
    b = incremental(m, x, [1100] + [1] * 100, c16)
    assert np.abs(a - b).max() < 2e-3  # keys/values rounded to float16
    # exact check of one decode step against the oracle on the float16-rounded keys/values
    q = normal(rng, (1, 4, 1, 8), np.float32)
    k = c16.keys[:, :, :1200].astype(np.float64)
    v = c16.values[:, :, :1200].astype(np.float64)
    ours = _core.attention(q, c16.keys[:, :, :1200], c16.values[:, :, :1200], causal_offset=1199,
                      scale=0.3, num_threads=2)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k, v, is_causal=True,
                                              causal_offset=1199, scale=0.3)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


def test_return_weights_with_cache_cover_all_keys(rng):
    m = make("fused")
    x = normal(rng, (1, 20, 24))
    cache = m.new_cache(1, 20)
    m(x[:, :15], cache=cache)
    y, w = m(x[:, 15:], cache=cache, return_weights=True)
    _, full_w = m(x, return_weights=True)
    assert w.shape == (1, 4, 5, 20)
    np.testing.assert_allclose(w, full_w[:, :, 15:], rtol=0, atol=1e-12)


def test_reset_works_on_a_wrapped_sliding_window_cache(rng):
    m = mh.MultiHeadAttention(16, 16, 64, 0.0, 2, window=4, seed=0)
    x = normal(rng, (1, 12, 16), np.float32)
    cache = m.new_cache(1, 64)
    for t in range(10):  # 10 tokens through a ring of 4: it has wrapped around
        m(x[:, t:t + 1], cache=cache)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.truncate(5)
    cache.reset()
    assert len(cache) == 0 and not cache.padding.any()
    # after the reset the cache serves a new sequence as a fresh one does
    fresh = m.new_cache(1, 64)
    for t in range(6):
        a = m(x[:, t:t + 1], cache=cache)
        b = m(x[:, t:t + 1], cache=fresh)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", ["float32", "float16"])
def test_weights_of_a_wrapped_window_come_in_position_order(rng, fmt):
    # one-token steps of a full ring attend its slots in place; the weights they return
    # are still over the window's keys oldest first, as a several-token step's are
    window, steps = 4, 10
    q, k, v = (normal(rng, (1, 2, 6 + steps, 8), np.float32) for _ in range(3))
    c = mh.KVCache(1, 40, 2, 8, window=window, dtype=fmt)
    c.attend(q[:, :, :6], k[:, :, :6], v[:, :, :6])
    for t in range(6, 6 + steps):
        sl = slice(t, t + 1)
        out, w = c.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], return_weights=True)
        keys = slice(t + 1 - window, t + 1)
        kd, vd = (a.astype(fmt) for a in (k, v))  # (as the cache holds them)
        ro, rw = oracle.scaled_dot_product_attention(
            q[:, :, sl].astype(np.float64), kd[:, :, keys].astype(np.float64),
            vd[:, :, keys].astype(np.float64), return_weights=True)
        assert w.shape == (1, 2, 1, window)
        np.testing.assert_allclose(w, rw, rtol=0, atol=1e-6, err_msg=f"step {t}")
        np.testing.assert_allclose(out, ro, rtol=0, atol=1e-5, err_msg=f"step {t}")
