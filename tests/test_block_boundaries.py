"""Shapes around the kernels' block and vector sizes, against the oracle."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import _kernels, oracle

from conftest import atol_for, normal

BQ, BK = _kernels.BLOCK_Q, _kernels.BLOCK_K


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", sorted({BQ - 1, BQ, BQ + 1, BK - 1, BK + 1, 2 * BK - 1, 2 * BK + 1,
                                      3 * BQ}))
@pytest.mark.parametrize("D", [3, 15, 17, 33])
def test_block_edges_and_ragged_head_dims(rng, dtype, T, D):
    q, k, v = (normal(rng, (1, 2, T, D), dtype) for _ in range(3))
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                              v.astype(np.float64), is_causal=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=atol_for(dtype))


@pytest.mark.parametrize("L,S", [(1, 200), (BQ + 1, 3 * BK + 5), (3 * BQ, BK - 1)])
def test_queries_and_keys_of_different_lengths(rng, L, S):
    q, k, v = normal(rng, (2, 2, L, 24)), normal(rng, (2, 2, S, 24)), normal(rng, (2, 2, S, 24))
    for causal in (False, True):
        out = mh.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref = oracle.scaled_dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype,max_ulp", [(np.float32, 4), (np.float64, 4)])
def test_vector_exp_is_accurate_to_a_few_ulp(dtype, max_ulp):
    lo = -87.0 if dtype == np.float32 else -700.0
    x = np.concatenate([np.linspace(lo, 0, 400_003), np.linspace(0, 10, 1001),
                        -np.random.default_rng(0).exponential(5, 100_000)]).astype(dtype)
    x = x[x >= lo]
    y = _kernels.vector_exp(x)
    exact = np.exp(x.astype(np.longdouble))
    ulp = np.spacing(exact.astype(dtype)).astype(np.longdouble)
    err = np.abs(y.astype(np.longdouble) - exact) / ulp
    assert float(err.max()) <= max_ulp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vector_exp_special_values(dtype):
    x = np.array([-np.inf, -1e30, -1000.0, np.nan, 0.0, -0.0], dtype=dtype)
    y = _kernels.vector_exp(x)
    assert y[0] == 0 and y[1] == 0 and y[2] == 0
    assert np.isnan(y[3]) and y[4] == 1 and y[5] == 1
