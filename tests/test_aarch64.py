"""aarch64 only: there the baseline path is NEON code (csrc/mh_baseline.c), with its own
vector exp and its own float16 and int4 cache readers.  tools/check_aarch64.sh runs these
under emulation; elsewhere they skip."""
import platform
import sys

import numpy as np
import pytest

import manyheads as mh
from manyheads import _kernels, oracle
from manyheads.cache import dequantize, quantize

from conftest import normal

AARCH64 = platform.machine().lower() in ("aarch64", "arm64") and sys.platform != "win32"
pytestmark = pytest.mark.skipif(not AARCH64, reason="aarch64 only (the NEON baseline path)")

# mh_exp.h's stated errors with FMA, which the NEON exp has
STATED_ULP = {np.float32: 1.05, np.float64: 0.87}


def exp_points(dtype):
    """mh_exp.h's measurement points: 2^20 evenly spaced, 2^18 softmax-like negative ones."""
    lo, hi = (-87.0, 88.0) if dtype == np.float32 else (-700.0, 700.0)
    soft = -np.random.default_rng(0).exponential(5, 2**18)
    return np.concatenate([np.linspace(lo, hi, 2**20), soft]).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_neon_exp_has_the_stated_error(dtype):
    if dtype == np.float64 and np.finfo(np.longdouble).nmant < 63:
        pytest.skip("needs a long double wider than float64 for the reference")
    x = exp_points(dtype)
    y = _kernels.vector_exp(x)
    exact = np.exp(x.astype(np.longdouble))
    ulp = np.spacing(exact.astype(dtype)).astype(np.longdouble)
    err = float((np.abs(y.astype(np.longdouble) - exact) / ulp).max())
    assert err <= STATED_ULP[dtype], err


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_neon_exp_at_the_edges(dtype):
    big, above, below = (88.0, 89.0, -87.5) if dtype == np.float32 else (709.0, 710.0, -709.0)
    x = np.array([-np.inf, -1e30, below, np.nan, 0.0, -0.0, 1.0, big, above, 1e30, np.inf,
                  2.0], dtype=dtype)
    y = _kernels.vector_exp(x)
    # below ln(smallest normal) the result is 0 (no subnormals); NaN stays NaN lane by lane
    assert list(y[:3]) == [0, 0, 0] and np.isnan(y[3])
    assert y[4] == 1 and y[5] == 1
    ref = np.exp(np.array([1.0, float(big), 2.0], np.longdouble))
    got = y[[6, 7, 11]].astype(np.longdouble)
    assert np.all(np.abs(got - ref) <= 2 * np.spacing(ref.astype(dtype)))
    assert np.all(np.isposinf(y[8:11]))


def fmt_dtype(fmt):
    return np.float16 if fmt == "float16" else fmt


@pytest.mark.parametrize("fmt,D", [("float16", 8), ("float16", 6), ("float16", 64),
                                   ("int4", 32), ("int4", 64)])
def test_neon_cache_readers_read_the_stored_values(rng, fmt, D):
    """A prefill (tile path: keys and values widened into the pack) then decode steps of
    1 and 3 rows (few-rows path: float16 rows of whole vectors read in place, others
    widened) over the dequantised keys and values."""
    n0, S = 90, 94
    cache = mh.KVCache(1, 128, 2, D, fmt_dtype(fmt))
    q = normal(rng, (1, 4, S, D), np.float32)
    k, v = (normal(rng, (1, 2, S, D), np.float32) for _ in range(2))
    kd, vd = (np.repeat(dequantize(*quantize(a, fmt), fmt).astype(np.float64), 2, 1)
              for a in (k, v))
    got = [cache.attend(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0]),
           cache.attend(q[:, :, n0:n0 + 1], k[:, :, n0:n0 + 1], v[:, :, n0:n0 + 1]),
           cache.attend(q[:, :, n0 + 1:], k[:, :, n0 + 1:], v[:, :, n0 + 1:])]
    for out, (a, b) in zip(got, [(0, n0), (n0, n0 + 1), (n0 + 1, S)]):
        hidden = oracle.causal_mask(b - a, b, a)  # new queries aligned to the end of the keys
        ref = oracle.scaled_dot_product_attention(q[:, :, a:b].astype(np.float64), kd[:, :, :b],
                                                  vd[:, :, :b], attn_mask=~hidden)
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
