"""Rotary position embeddings: Hugging Face's convention, positions from the cache."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import _core, oracle

from conftest import normal


def rotate_reference(x, positions, theta):
    """Rotary embedding in float64, written out: pairs (i, i + D/2) turned by p * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    freq = theta ** (-np.arange(half) * 2.0 / D)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def test_rotation_matches_the_written_out_formula_far_past_a_thousand(rng):
    x = normal(rng, (2, 3, 40, 64))
    got = x.copy()
    _core.apply_rope(got, 10000.0, 1500)
    # cos/sin tables are float32: 2^-24 relative on each
    np.testing.assert_allclose(got, rotate_reference(x, np.arange(1500, 1540), 10000.0),
                               rtol=0, atol=4 * 2.0**-24 * np.abs(x).max())


def test_rotation_matches_hugging_face_apply_rotary_pos_emb(rng):
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cfg = pytest.importorskip("transformers").LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        max_position_embeddings=4096)
    rotary = llama.LlamaRotaryEmbedding(config=cfg)
    q = rng.standard_normal((1, 4, 30, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 30, 64)).astype(np.float32)
    pos = torch.arange(2000, 2030)[None]
    cos, sin = rotary(torch.from_numpy(q), pos)
    tq, tk = llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    ours_q, ours_k = q.copy(), k.copy()
    _core.apply_rope(ours_q, 500000.0, 2000)
    _core.apply_rope(ours_k, 500000.0, 2000)
    # Hugging Face forms the angles in float32: at position p they are off by up to
    # about p * 2^-24 radians (plus an ulp of the frequency), ours are exact
    tol = 2 * 2030 * 2.0**-24 * 2 * max(np.abs(q).max(), np.abs(k).max())
    np.testing.assert_allclose(ours_q, tq.numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(ours_k, tk.numpy(), rtol=0, atol=tol)


def fused_with_rope(dtype=np.float64, **kw):
    return mh.MultiHeadAttention(24, 32, 2048, 0.0, 4, qkv_bias=True, rope_theta=10000.0,
                                 dtype=dtype, seed=0, **kw)


def test_rope_layer_equals_the_oracle_on_rotated_queries_and_keys(rng):
    m = fused_with_rope()
    x = normal(rng, (2, 50, 24))
    q = (x @ m.W_query + m.b_query).reshape(2, 50, 4, 8).transpose(0, 2, 1, 3)
    k = (x @ m.W_key + m.b_key).reshape(2, 50, 4, 8).transpose(0, 2, 1, 3)
    v = (x @ m.W_value + m.b_value).reshape(2, 50, 4, 8).transpose(0, 2, 1, 3)
    pos = np.arange(50)
    ctx = oracle.scaled_dot_product_attention(rotate_reference(q, pos, 1e4),
                                              rotate_reference(k, pos, 1e4), v, is_causal=True)
    ref = ctx.transpose(0, 2, 1, 3).reshape(2, 50, 32) @ m.W_out + m.b_out
    np.testing.assert_allclose(m(x), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["fused", "stacked", "gqa", "window"])
def test_prefill_then_decode_with_rope_equals_one_pass(rng, kind):
    m = {"fused": lambda: fused_with_rope(),
         "stacked": lambda: fused_with_rope().to_stacked(),
         "gqa": lambda: fused_with_rope(num_kv_heads=2),
         "window": lambda: fused_with_rope(window=16)}[kind]()
    x = normal(rng, (2, 60, 24))
    cache = m.new_cache(2, 60)
    parts = [m(x[:, :45], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(45, 60)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), m(x), rtol=0, atol=1e-10)


def test_rope_survives_save_load_and_the_stacked_round_trip(rng, tmp_path):
    m = fused_with_rope()
    x = normal(rng, (1, 20, 24))
    m.save(tmp_path / "m.npz")
    back = mh.MultiHeadAttention.load(tmp_path / "m.npz")
    assert back.rope_theta == 10000.0 and "rope_theta=10000" in repr(back)
    np.testing.assert_array_equal(back(x), m(x))
    np.testing.assert_allclose(m.to_stacked().to_fused()(x), m(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), ("big", TypeError)])
def test_bad_rope_theta_is_rejected(bad, exc):
    with pytest.raises(exc, match="rope_theta"):
        mh.MultiHeadAttention(24, 32, 64, 0.0, 4, rope_theta=bad)
    with pytest.raises(ValueError, match="even head size"):
        mh.CausalAttention(8, 7, 16, rope_theta=10000.0)
