"""Property tests: random shapes, dtypes, strides, masks and values, against the oracle.

Every call either matches the oracle or raises ValueError/TypeError.  "Matches"
with non-finite values means: a row the oracle finds non-finite is non-finite
here too (a NaN or inf never vanishes), and every finite row here equals the
oracle's (nothing is silently wrong).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import manyheads as mh
from manyheads import oracle

SPECIALS = [np.nan, np.inf, -np.inf, 1e30, -1e30, 1e-40, -1e-310, 0.0]


@st.composite
def arrays(draw, shape, dtype):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1.0, 1.0, 1e-3, 30.0]))
    a = rng.standard_normal(shape) * scale
    if a.size and draw(st.booleans()):
        n = draw(st.integers(1, 3))
        for _ in range(n):
            a.flat[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from(SPECIALS))
    a = a.astype(dtype)
    view = draw(st.sampled_from(["plain", "fortran", "reversed", "strided"]))
    if view == "fortran":
        a = np.asfortranarray(a)
    elif view == "reversed" and a.ndim and a.shape[0] > 1:
        a = np.ascontiguousarray(a[::-1])[::-1]
    elif view == "strided":
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), dtype=dtype)
        big[..., 1::2] = a
        a = big[..., 1::2]
    return a


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B, H = draw(st.integers(0, 2)), draw(st.integers(1, 3))
    L, S = draw(st.integers(0, 70)), draw(st.integers(0, 70))
    E, Ev = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    q = draw(arrays((B, H, L, E), dtype))
    k = draw(arrays((B, H, S, E), dtype))
    v = draw(arrays((B, H, S, Ev), dtype))
    causal = draw(st.booleans())
    mask = None
    if not causal and draw(st.booleans()):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if draw(st.booleans()):
            mask = rng.random((L, S)) > 0.3
        else:
            mask = np.where(rng.random((L, S)) > 0.2, rng.standard_normal((L, S)), -np.inf)
            mask = mask.astype(dtype)
    return q, k, v, causal, mask


def score_rounding_bound(q, k, v):
    """Per query row: what rounding its scores in q's dtype does to its output, at the least.

    A score is a sum of E products; computed in precision u it carries an
    error of the order of u * sum_d |q_d k_d| (times the scale 1/sqrt(E)),
    whatever the summation order, and a softmax-weighted mean moves by up to
    2 max|v| per unit of score error.  For unit-normal inputs this is about 1%
    of the base tolerance; when q and k are both large (scores in the
    thousands) it is the whole error of any float32 implementation.  Shape
    (..., L, 1), broadcasting against the output.
    """
    u = float(np.finfo(q.dtype).eps) / 2
    aq = np.where(np.isfinite(q), np.abs(q), 0).astype(np.float64)
    ak = np.where(np.isfinite(k), np.abs(k), 0).astype(np.float64)
    worst = np.max(aq @ np.swapaxes(ak, -1, -2), axis=-1, keepdims=True, initial=0.0)
    vmax = float(np.max(np.abs(v[np.isfinite(v)]), initial=1.0))
    return 2 * vmax * u * worst / np.sqrt(q.shape[-1])


def check_against_oracle(out, ref, q, k, v):
    bad_ref = ~np.isfinite(ref)
    assert np.all(~np.isfinite(out)[bad_ref]), "a non-finite result vanished"
    fin = np.isfinite(out)
    vmax = float(np.max(np.abs(v[np.isfinite(v)]), initial=1.0))
    tol = (1e-4 if out.dtype == np.float32 else 1e-9) * max(vmax, 1.0)
    tol = tol + np.broadcast_to(score_rounding_bound(q, k, v), out.shape)
    both = fin & np.isfinite(ref)
    err = np.abs(out[both].astype(np.float64) - ref[both])
    limit = tol[both] + 1e-4 * np.abs(ref[both])
    assert np.all(err <= limit), (
        f"{int(np.sum(err > limit))} of {err.size} outputs off the oracle; worst excess "
        f"{float(np.max(err - limit)):.3g} (error {float(err[np.argmax(err - limit)]):.3g})")
    # a finite answer where the oracle has none would be silently wrong
    assert not np.any(fin & bad_ref)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_random_calls_match_the_oracle_or_raise(problem):
    q, k, v, causal, mask = problem
    try:
        out = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    except (ValueError, TypeError) as exc:  # pragma: no cover - nothing here is invalid
        pytest.fail(f"valid input rejected: {exc}")
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    with np.errstate(all="ignore"):
        ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                                  v.astype(np.float64), attn_mask=mask,
                                                  is_causal=causal)
    check_against_oracle(out, ref, q, k, v)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.tuples(st.just("ndim"), st.integers(0, 1)),
    st.tuples(st.just("dtype"), st.sampled_from(["int32", "float16", "complex64", "bool",
                                                 "object", "U3"])),
    st.tuples(st.just("shape"), st.integers(1, 5)),
    st.tuples(st.just("dropout"), st.floats(allow_nan=True, allow_infinity=True)
              .filter(lambda p: not (0 <= p <= 1))),
    st.tuples(st.just("scale"), st.sampled_from([float("nan"), float("inf"), "x", None])),
    st.tuples(st.just("threads"), st.sampled_from([0, -1, 2.5, "2", True])),
))
def test_bad_input_raises_a_clear_error(case):
    kind, arg = case
    q = np.ones((1, 2, 4, 8), np.float32)
    kw = {}
    if kind == "ndim":
        q = np.ones((8,) * arg, np.float32)
    elif kind == "dtype":
        q = np.ones((1, 2, 4, 8)).astype(arg)
    elif kind == "shape":
        q = np.ones((1, 2, 4, 8 + arg), np.float32)
    elif kind == "dropout":
        kw["dropout_p"] = arg
    elif kind == "scale":
        if arg is None:
            return
        kw["scale"] = arg
    else:
        kw["num_threads"] = arg
    k = np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises((ValueError, TypeError)) as info:
        mh.scaled_dot_product_attention(q, k, k, **kw)
    assert str(info.value)
