"""Equality with PyTorch on the same inputs (runs when torch is installed: the test extra pins it)."""
import numpy as np
import pytest

import manyheads as mh

from conftest import atol_for, normal

torch = pytest.importorskip("torch")
F = torch.nn.functional


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L,S,E", [(1, 1, 8), (65, 65, 64), (100, 100, 80), (30, 77, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_torch_sdpa(rng, dtype, L, S, E, causal):
    q, k, v = (normal(rng, (2, 3, n, E), dtype) for n in (L, S, S))
    ours = mh.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol_for(dtype) * 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_equals_torch_with_masks_scale_and_gqa(rng, dtype):
    q = normal(rng, (2, 8, 40, 16), dtype)
    k, v = normal(rng, (2, 2, 50, 16), dtype), normal(rng, (2, 2, 50, 24), dtype)
    bool_mask = rng.random((2, 1, 40, 50)) > 0.4
    bool_mask[..., 0] = True  # PyTorch returns NaN for fully masked rows; keep every row live
    float_mask = normal(rng, (40, 50), dtype)
    for mask in (bool_mask, float_mask):
        ours = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                               enable_gqa=True)
        theirs = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask), scale=0.3,
                                                enable_gqa=True).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol_for(dtype) * 2)


def test_fused_module_equals_torch_projection_plus_sdpa(rng):
    m = mh.MultiHeadAttention(48, 64, 128, 0.0, 4, qkv_bias=True, seed=0)
    x = normal(rng, (2, 100, 48), np.float32)
    qkv = t(x) @ t(m.W_qkv) + t(m.b_qkv)
    q, k, v = (p.view(2, 100, 4, 16).transpose(1, 2) for p in qkv.split(64, dim=-1))
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = (ctx.transpose(1, 2).reshape(2, 100, 64) @ t(m.W_out) + t(m.b_out)).numpy()
    np.testing.assert_allclose(m(x), ref, rtol=0, atol=1e-5)
