"""What a PyTorch or NumPy user expects: masks and encoders in the modules, cross-attention,
caches that behave like values, context_length through a cache, defaults, saving."""
import copy
import pickle

import numpy as np
import pytest

import manyheads as mh
from manyheads import oracle

from conftest import normal

KINDS = ["fused", "stacked", "single"]


def make(kind, **kw):
    kw = dict(dict(qkv_bias=True, dtype=np.float64, seed=0), **kw)
    if kind == "fused":
        return mh.MultiHeadAttention(16, 24, 64, 0.0, 3, **kw)
    if kind == "stacked":
        return mh.StackedMultiHeadAttention(16, 24, 64, 0.0, 3, **kw)
    return mh.CausalAttention(16, 8, 64, **kw)


def reference(m, x, mem=None, allowed=None, causal=True):
    """The oracle: per head softmax(q k^T / sqrt(d) + mask) v, heads concatenated, projected."""
    mem = x if mem is None else mem
    if isinstance(m, mh.CausalAttention):
        heads = [m]
    elif isinstance(m, mh.StackedMultiHeadAttention):
        heads = m.heads
    else:
        heads = m.to_stacked().heads
    outs = []
    for h, head in enumerate(heads):
        q = x @ head.W_query + head.b_query
        k = mem @ head.W_key + head.b_key
        v = mem @ head.W_value + head.b_value
        mask = None if allowed is None else allowed[:, min(h, allowed.shape[1] - 1)]
        outs.append(oracle.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                        is_causal=causal and mask is None))
    Z = np.concatenate(outs, axis=-1)
    W_out = getattr(m, "W_out", None)
    return Z if W_out is None else Z @ W_out + m.b_out


@pytest.mark.parametrize("kind", KINDS)
def test_an_encoder_layer_lets_every_query_see_every_key(rng, kind):
    m = make(kind, causal=False)
    x = normal(rng, (2, 9, 16))
    np.testing.assert_allclose(m(x), reference(m, x, causal=False), rtol=0, atol=1e-10)
    # the last token changes every output (nothing is causal)
    x2 = x.copy()
    x2[:, -1] += 1
    assert np.all(np.abs(m(x2) - m(x))[:, 0] > 0)


@pytest.mark.parametrize("kind", KINDS)
def test_attn_mask_and_key_padding_follow_nn_multihead_attention(rng, kind):
    m = make(kind, causal=False)
    B, T = 2, 8
    x = normal(rng, (B, T, 16))
    blocked = rng.random((T, T)) < 0.4  # True = may NOT attend, as in nn.MultiheadAttention
    blocked[:, 2] = False
    pad = np.zeros((B, T), bool)
    pad[1, :2] = True
    allowed = (~blocked)[None, None] & ~pad[:, None, None, :]
    np.testing.assert_allclose(m(x, attn_mask=blocked, key_padding_mask=pad),
                               reference(m, x, allowed=allowed, causal=False), rtol=0,
                               atol=1e-10)


def test_a_causal_module_combines_its_triangle_with_the_mask(rng):
    m = make("fused")
    x = normal(rng, (1, 6, 16))
    blocked = np.zeros((6, 6), bool)
    blocked[:, 0] = True
    blocked[0, 0] = False
    allowed = (~blocked & np.tril(np.ones((6, 6), bool)))[None, None]
    np.testing.assert_allclose(m(x, attn_mask=blocked), reference(m, x, allowed=allowed),
                               rtol=0, atol=1e-10)


def test_per_head_float_masks_in_torch_layout(rng):
    m = make("fused", causal=False)
    x = normal(rng, (2, 5, 16))
    add = normal(rng, (2 * 3, 5, 5))  # (B * heads, T, S)
    got = m(x, attn_mask=add)
    heads = m.to_stacked().heads
    outs = []
    for h, head in enumerate(heads):
        q, k, v = (x @ W + b for W, b in ((head.W_query, head.b_query),
                                          (head.W_key, head.b_key),
                                          (head.W_value, head.b_value)))
        outs.append(oracle.scaled_dot_product_attention(q, k, v,
                                                        attn_mask=add.reshape(2, 3, 5, 5)[:, h]))
    np.testing.assert_allclose(got, np.concatenate(outs, -1) @ m.W_out + m.b_out, rtol=0,
                               atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_cross_attention_takes_keys_and_values_from_another_sequence(rng, kind):
    m = make(kind, causal=False)
    x, mem = normal(rng, (2, 4, 16)), normal(rng, (2, 11, 16))
    y, w = m(x, mem, mem, return_weights=True)
    np.testing.assert_allclose(y, reference(m, x, mem, causal=False), rtol=0, atol=1e-10)
    assert w.shape[-2:] == (4, 11)


@pytest.mark.parametrize("bad,match", [
    (dict(attn_mask=np.zeros((3, 3), np.int32)), "attn_mask must be boolean"),
    (dict(attn_mask=np.zeros((5, 5), bool)), "attn_mask must have shape"),
    (dict(key_padding_mask=np.zeros((2, 3), bool)), "key_padding_mask"),
])
def test_bad_masks_are_rejected_before_any_work(rng, bad, match):
    m = make("fused")
    with pytest.raises((ValueError, TypeError), match=match):
        m(normal(rng, (2, 4, 16)), **bad)


def test_batch_first_false_takes_and_returns_sequence_first(rng):
    m = make("fused")
    seq_first = mh.MultiHeadAttention.from_weights(m.to_weights(), 64, batch_first=False,
                                                   dtype=np.float64)
    x = normal(rng, (2, 7, 16))
    np.testing.assert_array_equal(seq_first(x.transpose(1, 0, 2)), m(x).transpose(1, 0, 2))
    with pytest.raises(ValueError, match=r"\(tokens, batch, d_in\)"):
        seq_first(np.ones((2, 3, 4, 16)))


def greedy_branch(m, cache, x, steps):
    """Feed each output back as the next input (a toy greedy decoder), `steps` times."""
    outs, cur = [], x
    for _ in range(steps):
        cur = m(cur, cache=cache)[:, -1:]
        outs.append(cur)
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("cache_dtype", [None, np.float16])
def test_caches_copy_pickle_and_truncate_to_branch_from_one_prompt(rng, cache_dtype):
    m = mh.MultiHeadAttention(16, 16, 64, 0.0, 4, num_kv_heads=1, seed=0)  # d_out = d_in
    prompt = normal(rng, (2, 12, 16), np.float32)
    base = m.new_cache(2, 40, dtype=cache_dtype)
    m(prompt, cache=base)
    want = greedy_branch(m, copy.deepcopy(base), prompt[:, -1:], 6)
    for twin in (base.copy(), copy.deepcopy(base), pickle.loads(pickle.dumps(base))):
        assert len(twin) == 12 and twin.dtype == base.dtype
        np.testing.assert_array_equal(greedy_branch(m, twin, prompt[:, -1:], 6), want)
    assert len(base) == 12  # the branches never touched it
    # roll back: decode 6, truncate to the prompt, decode again: same tokens
    greedy_branch(m, base, prompt[:, -1:], 6)
    base.truncate(12)
    np.testing.assert_array_equal(greedy_branch(m, base, prompt[:, -1:], 6), want)
    with pytest.raises(ValueError, match="cannot truncate"):
        base.truncate(19)


def test_a_wrapped_sliding_window_cache_refuses_to_roll_back(rng):
    m = make("fused", window=4)
    cache = m.new_cache(1, 20)
    m(normal(rng, (1, 6, 16)), cache=cache)
    with pytest.raises(ValueError, match="wrapped"):
        cache.truncate(3)


def test_context_length_holds_through_the_cache(rng):
    m = mh.MultiHeadAttention(16, 16, 128, 0.0, 2, seed=0)
    cache = m.new_cache(1, 1000)
    m(normal(rng, (1, 100, 16), np.float32), cache=cache)
    with pytest.raises(ValueError, match=r"context_length=128.*context_length=N"):
        m(normal(rng, (1, 100, 16), np.float32), cache=cache)
    assert len(cache) == 100


def test_defaults_after_d_in_and_the_books_positional_order(rng):
    m = mh.MultiHeadAttention(64, num_heads=4)
    assert (m.d_out, m.context_length, m.dropout, m.head_dim) == (64, 1024, 0.0, 16)
    book = mh.MultiHeadAttention(64, 32, 128, 0.1, 4, True)
    assert (book.d_out, book.context_length, book.dropout, book.qkv_bias) == (32, 128, 0.1, True)
    with pytest.raises(TypeError, match="num_heads is required"):
        mh.MultiHeadAttention(64)
    assert mh.CausalAttention(8).d_out == 8


@pytest.mark.parametrize("kind", KINDS)
def test_every_module_saves_and_loads(rng, tmp_path, kind):
    m = make(kind, rope_theta=500.0) if kind != "single" else make(kind, causal=False)
    path = tmp_path / "m.npz"
    m.save(path)
    back = type(m).load(path)
    x = normal(rng, (2, 10, 16))
    np.testing.assert_array_equal(back(x), m(x))
    assert repr(back) == repr(m)
    other = mh.MultiHeadAttention if kind != "fused" else mh.CausalAttention
    with pytest.raises(ValueError, match="load it with"):
        other.load(path)


def test_modules_take_array_likes_as_the_functional_api_does():
    m = make("single", dtype=np.float32)
    x = [[1, 2] * 8, [0, 1] * 8]
    np.testing.assert_array_equal(m(x), m(np.array(x, np.float32)))


def test_two_kv_heads_without_enable_gqa_get_a_hint():
    q = np.ones((1, 4, 3, 8), np.float32)
    k = np.ones((1, 2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        mh.scaled_dot_product_attention(q, k, k)
