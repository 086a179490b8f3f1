"""manyheads.linear: the projections' product on manyheads' threads."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import _kernels


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64, 300, 1000])
@pytest.mark.parametrize("n", [1, 7, 64, 200, 2304])
def test_linear_matches_numpy_for_few_and_many_rows(rng, dtype, rows, n):
    k = 96
    x = rng.standard_normal((rows, k)).astype(dtype)
    w = rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    ref = x.astype(np.float64) @ w.astype(np.float64) + b
    tol = 1e-4 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(mh.linear(x, w, b), ref, rtol=0, atol=tol)
    np.testing.assert_allclose(mh.linear(x, w), ref - b, rtol=0, atol=tol)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 5, 97])
@pytest.mark.parametrize("n", [15, 1040, 4100])
def test_few_rows_take_any_depth_and_width(rng, rows, k, n):
    """The few-rows product reads w four rows of k at a time in column blocks: depths that
    are not a multiple of four, and widths across several blocks with a ragged tail."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64) + b
    np.testing.assert_allclose(mh.linear(x, w, b, num_threads=2), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("rows,k,n", [(1, 4096, 3000), (4, 2048, 2100), (513, 200, 700)])
def test_linear_is_the_same_bits_on_any_thread_count(rng, rows, k, n):
    assert _kernels.explain_linear(rows, k, n, 2)["threads"] == 2  # split across threads
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    one = mh.linear(x, w, num_threads=1)
    for nt in (2, 3, 8):
        np.testing.assert_array_equal(mh.linear(x, w, num_threads=nt), one)


def test_linear_reads_batched_and_strided_inputs(rng):
    x = rng.standard_normal((2, 3, 50, 40)).astype(np.float32)[:, :, ::2, :32]
    w = rng.standard_normal((64, 80)).astype(np.float32)[::2, 5:]
    ref = np.einsum("abtk,kn->abtn", x.astype(np.float64), w.astype(np.float64))
    out = mh.linear(x, w)
    assert out.shape == (2, 3, 25, 75)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("args,exc,match", [
    ((np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)), ValueError, "weight"),
    ((np.ones((2, 3), np.float32), np.ones((3, 5), np.float64)), TypeError, "one dtype"),
    ((np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), np.ones(4, np.float32)),
     ValueError, "bias"),
    ((np.ones((2, 3), np.int8), np.ones((3, 5), np.float32)), TypeError, "x"),
    ((np.ones((2, 3), np.float32), np.ones(3, np.float32)), ValueError, "weight"),
])
def test_linear_rejects_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        mh.linear(*args)
