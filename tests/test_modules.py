"""The attention modules against the oracle, and the course's structural facts."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import oracle

from conftest import atol_for, normal

DTYPES = [np.float32, np.float64]


def head_weights(head):
    return (head.W_query, head.W_key, head.W_value, head.b_query, head.b_key, head.b_value)


def stacked_reference(st, x):
    return oracle.stacked_multi_head_attention(
        x.astype(np.float64), [head_weights(h) for h in st.heads], st.W_out, st.b_out,
        dtype=np.float64)


def fused_reference(m, x):
    D = m.head_dim
    heads = []
    for h in range(m.num_heads):
        c = slice(h * D, (h + 1) * D)
        bias = (None, None, None) if m.b_qkv is None else (m.b_query[c], m.b_key[c], m.b_value[c])
        heads.append((m.W_query[:, c], m.W_key[:, c], m.W_value[:, c]) + bias)
    return oracle.stacked_multi_head_attention(x.astype(np.float64), heads, m.W_out, m.b_out,
                                               dtype=np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_causal_attention_head_matches_oracle(rng, dtype, qkv_bias):
    head = mh.CausalAttention(24, 16, 100, 0.0, qkv_bias, dtype=dtype, seed=1)
    x = normal(rng, (3, 70, 24), dtype)
    ref = oracle.causal_attention_head(x, *head_weights(head), dtype=np.float64)
    np.testing.assert_allclose(head(x), ref, rtol=0, atol=atol_for(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_matches_oracle(rng, dtype, qkv_bias):
    m = mh.MultiHeadAttention(32, 48, 200, 0.0, 6, qkv_bias, dtype=dtype, seed=2)
    x = normal(rng, (2, 130, 32), dtype)
    out = m(x)
    assert out.shape == (2, 130, 48) and out.dtype == dtype
    np.testing.assert_allclose(out, fused_reference(m, x), rtol=0, atol=atol_for(dtype) * 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_matches_oracle(rng, dtype):
    st = mh.StackedMultiHeadAttention(32, 48, 200, 0.0, 3, dtype=dtype, seed=3)
    x = normal(rng, (2, 90, 32), dtype)
    np.testing.assert_allclose(st(x), stacked_reference(st, x), rtol=0,
                               atol=atol_for(dtype) * 10)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_stacked_equals_fused_with_mapped_weights(rng, qkv_bias):
    st = mh.StackedMultiHeadAttention(20, 24, 64, 0.0, 4, qkv_bias, dtype=np.float64, seed=4)
    x = normal(rng, (3, 50, 20))
    fused = st.to_fused()
    np.testing.assert_allclose(fused(x), st(x), rtol=0, atol=1e-12)
    back = fused.to_stacked()
    np.testing.assert_allclose(back(x), st(x), rtol=0, atol=1e-12)
    for a, b in zip(back.heads, st.heads):
        np.testing.assert_array_equal(a.W_query, b.W_query)
        np.testing.assert_array_equal(a.W_value, b.W_value)


def test_fused_to_stacked_and_back(rng):
    m = mh.MultiHeadAttention(16, 32, 40, 0.0, 4, dtype=np.float64, seed=5)
    x = normal(rng, (2, 40, 16))
    st = m.to_stacked()
    np.testing.assert_allclose(st(x), m(x), rtol=0, atol=1e-12)
    np.testing.assert_allclose(st.to_fused()(x), m(x), rtol=0, atol=1e-12)


def test_stack_without_output_projection_is_the_books_wrapper(rng):
    # book: MultiHeadAttentionWrapper(d_in, d_out=per head, ..., num_heads) -> width H*d_out
    st = mh.StackedMultiHeadAttention(12, 2 * 5, 30, 0.0, 2, out_proj=False, dtype=np.float64,
                                      seed=6)
    x = normal(rng, (1, 30, 12))
    Z = st(x)
    parts = [h(x) for h in st.heads]
    np.testing.assert_array_equal(Z, np.concatenate(parts, axis=-1))
    np.testing.assert_allclose(st.to_fused()(x), Z, rtol=0, atol=1e-12)


def test_two_head_module_has_two_of_each_matrix_and_shares_none():
    st = mh.StackedMultiHeadAttention(8, 6, 10, 0.0, 2, seed=0)
    assert len(st.heads) == 2
    mats = [getattr(h, n) for h in st.heads for n in ("W_query", "W_key", "W_value")]
    assert len(mats) == 6 and all(m.shape == (8, 3) for m in mats)
    for i in range(len(mats)):
        for j in range(i + 1, len(mats)):
            assert not np.shares_memory(mats[i], mats[j])
    # changing one head's weights changes only that head's columns of Z
    x = np.random.default_rng(0).standard_normal((1, 10, 8)).astype(np.float32)
    st_noproj = mh.StackedMultiHeadAttention(8, 6, 10, 0.0, 2, out_proj=False, seed=0)
    before = st_noproj(x)
    st_noproj.heads[1].W_value *= 2
    after = st_noproj(x)
    np.testing.assert_array_equal(before[..., :3], after[..., :3])
    assert not np.allclose(before[..., 3:], after[..., 3:])


def test_module_returns_one_matrix_Z():
    st = mh.StackedMultiHeadAttention(8, 6, 10, 0.0, 2, seed=0)
    out = st(np.zeros((10, 8), np.float32))
    assert isinstance(out, np.ndarray) and out.shape == (10, 6)


@pytest.mark.parametrize("make", [
    lambda: mh.MultiHeadAttention(16, 24, 80, 0.0, 3, dtype=np.float64, seed=7),
    lambda: mh.StackedMultiHeadAttention(16, 24, 80, 0.0, 3, dtype=np.float64, seed=7),
    lambda: mh.CausalAttention(16, 8, 80, dtype=np.float64, seed=7),
], ids=["fused", "stacked", "single"])
def test_every_head_blocks_future_positions(rng, make):
    m = make()
    x = normal(rng, (2, 80, 16))
    base, w = m(x, return_weights=True)
    for j in (1, 40, 64, 79):
        x2 = x.copy()
        x2[:, j] = normal(rng, (2, 16)) * 5
        changed = m(x2)
        np.testing.assert_array_equal(changed[:, :j], base[:, :j])
        assert not np.allclose(changed[:, j:], base[:, j:])
    w = w if w.ndim == 4 else w[:, None]
    for h in range(w.shape[1]):
        assert np.all(np.triu(w[:, h], k=1) == 0)


def test_weights_are_views_into_the_packed_buffer():
    m = mh.MultiHeadAttention(8, 12, 16, 0.0, 3, qkv_bias=True, dtype=np.float64, seed=8)
    assert np.shares_memory(m.W_query, m.W_qkv) and np.shares_memory(m.W_value, m.W_qkv)
    x = np.random.default_rng(1).standard_normal((16, 8))
    before = m(x)
    m.W_key[...] = 0         # every score becomes equal: outputs change
    m.b_key[...] = 0
    assert np.allclose(m.W_qkv[:, 12:24], 0)
    assert not np.allclose(m(x), before)
    m.W_query = np.ones((8, 12))
    np.testing.assert_array_equal(m.W_qkv[:, :12], 1)


def test_return_weights_shapes_and_values(rng):
    m = mh.MultiHeadAttention(16, 32, 50, 0.0, 4, dtype=np.float64, seed=9)
    x = normal(rng, (2, 50, 16))
    y, w = m(x, return_weights=True)
    assert w.shape == (2, 4, 50, 50)
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-12)
    y1, w1 = m(x[0], return_weights=True)
    assert y1.shape == (50, 32) and w1.shape == (4, 50, 50)
    np.testing.assert_allclose(y1, y[0], rtol=0, atol=1e-12)
    st = m.to_stacked()
    _, ws = st(x, return_weights=True)
    np.testing.assert_allclose(ws, w, rtol=0, atol=1e-12)


def test_unbatched_input_equals_batch_of_one(rng):
    m = mh.MultiHeadAttention(16, 32, 50, 0.0, 4, seed=10)
    x = normal(rng, (50, 16), np.float32)
    np.testing.assert_array_equal(m(x), m(x[None])[0])


def test_training_dropout_on_attention_weights(rng):
    m = mh.MultiHeadAttention(16, 32, 64, 0.5, 4, dtype=np.float64, seed=11)
    x = normal(rng, (1, 64, 16))
    plain = m(x)
    np.testing.assert_array_equal(m(x, training=False), plain)   # off by default
    y, w = m(x, training=True, return_weights=True)
    assert not np.allclose(y, plain)
    kept = w[w > 0]
    assert 0.3 < kept.size / np.count_nonzero(np.tril(np.ones((64, 64)))) / 4 < 0.7
    # the surviving weights are the dropout-free weights scaled by 1 / (1 - p)
    _, w0 = m(x, return_weights=True)
    np.testing.assert_allclose(w[w > 0], (w0 * 2)[w > 0], rtol=1e-12)


def test_float64_module_keeps_float64_and_converts_input(rng):
    m = mh.MultiHeadAttention(8, 8, 8, 0.0, 2, dtype=np.float64, seed=0)
    assert m(normal(rng, (8, 8), np.float32)).dtype == np.float64


@pytest.mark.parametrize("head_dim", [1, 8, 64, 80, 128])
def test_fused_head_sizes(rng, head_dim):
    m = mh.MultiHeadAttention(32, 2 * head_dim, 70, 0.0, 2, dtype=np.float64, seed=head_dim)
    x = normal(rng, (1, 70, 32))
    np.testing.assert_allclose(m(x), fused_reference(m, x), rtol=0, atol=1e-10)


def test_grouped_query_module_matches_repeated_kv_heads(rng):
    m = mh.MultiHeadAttention(16, 32, 40, 0.0, 8, num_kv_heads=2, dtype=np.float64, seed=12)
    assert m.W_key.shape == (16, 8) and m.W_query.shape == (16, 32)
    x = normal(rng, (2, 40, 16))
    D, g = m.head_dim, 4
    heads = []
    for h in range(8):
        qc, kc = slice(h * D, (h + 1) * D), slice((h // g) * D, (h // g + 1) * D)
        heads.append((m.W_query[:, qc], m.W_key[:, kc], m.W_value[:, kc]))
    ref = oracle.stacked_multi_head_attention(x, heads, m.W_out, m.b_out)
    np.testing.assert_allclose(m(x), ref, rtol=0, atol=1e-10)


def test_out_features_sets_the_output_projections_width(rng, tmp_path):
    """An output projection back to another width (Gemma 2, gpt-oss): the output is
    merged heads @ W_out (d_out, out_features) + b_out, carried by save/load and repr."""
    m = mh.MultiHeadAttention(48, 64, 32, num_heads=4, num_kv_heads=2, out_features=40, seed=1)
    assert m.W_out.shape == (64, 40) and m.b_out.shape == (40,)
    x = rng.standard_normal((2, 9, 48)).astype(np.float32)
    q = (x @ m.W_query).reshape(2, 9, 4, 16).transpose(0, 2, 1, 3)
    k, v = ((x @ w).reshape(2, 9, 2, 16).transpose(0, 2, 1, 3) for w in (m.W_key, m.W_value))
    heads = oracle.scaled_dot_product_attention(q.astype(np.float64), k, v, is_causal=True,
                                                enable_gqa=True)
    want = heads.transpose(0, 2, 1, 3).reshape(2, 9, 64) @ m.W_out + m.b_out
    got = m(x)
    assert got.shape == (2, 9, 40)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert "out_features=40" in repr(m) and "out_features" not in repr(
        mh.MultiHeadAttention(48, 64, num_heads=4))
    m.save(tmp_path / "m.npz")
    np.testing.assert_array_equal(mh.MultiHeadAttention.load(tmp_path / "m.npz")(x), got)
    with pytest.raises(ValueError, match="out_features"):
        mh.MultiHeadAttention(48, 64, num_heads=4, out_features=40).to_stacked()
    with pytest.raises(ValueError, match="out_features"):
        mh.MultiHeadAttention(48, 64, num_heads=4, out_features=0)
