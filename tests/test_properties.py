"""Property tests: random shapes, dtypes, strides, masks, score features, grouped heads and
cache sequences, against the oracle.

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
from manyheads.cache import dequantize, quantize

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


def score_rounding_error(q, k):
    """Per query row: the error rounding puts into its scores in q's dtype, at the least.

    A score is a sum of E products; computed in precision u it carries an
    error of the order of u * sum_d |q_d k_d| (times the scale 1/sqrt(E)),
    whatever the summation order (the oracle's float64 product has its own,
    with FMA or without).  The log-sum-exp of the scores moves by no more than
    its largest score does.  Shape (..., L, 1).
    """
    u = float(np.finfo(q.dtype).eps) / 2
    aq = np.where(np.isfinite(q), np.abs(q), 0).astype(np.float64)
    ak = np.where(np.isfinite(k), np.abs(k), 0).astype(np.float64)
    worst = np.max(aq @ np.swapaxes(ak, -1, -2), axis=-1, keepdims=True, initial=0.0)
    return u * worst / np.sqrt(q.shape[-1])


def score_rounding_bound(q, k, v):
    """Per query row: what rounding its scores does to its output, at the least.

    A softmax-weighted mean moves by up to 2 max|v| per unit of score error.
    For unit-normal inputs this is about 1% of the base tolerance; when q and
    k are both large (scores in the thousands) it is the whole error of any
    float32 implementation.  Shape (..., L, 1), broadcasting against the output.
    """
    vmax = float(np.max(np.abs(v[np.isfinite(v)]), initial=1.0))
    return 2 * vmax * score_rounding_error(q, k)


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


@st.composite
def feature_problems(draw):
    """Grouped query heads, the score features, log-sum-exp and masks together."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    L, S = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    E, Ev = draw(st.sampled_from([1, 8, 17, 64])), draw(st.sampled_from([1, 5, 64]))
    q = draw(arrays((B, Hkv * G, L, E), dtype))
    k = draw(arrays((B, Hkv, S, E), dtype))
    v = draw(arrays((B, Hkv, S, Ev), dtype))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw = {}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([5.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(Hkv * G).astype(np.float32)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(Hkv * G,), (B, Hkv * G)]))
        kw["alibi_slopes"] = rng.random(shape).astype(np.float32)
    causal = draw(st.booleans())
    if not causal and draw(st.booleans()):
        shape = draw(st.sampled_from([(L, S), (B, 1, L, S), (1, Hkv * G, L, S)]))
        kw["attn_mask"] = rng.random(shape) > 0.3
    return q, k, v, causal, G > 1, kw


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(feature_problems())
def test_random_feature_calls_match_the_oracle(problem):
    """Soft cap, sinks, ALiBi, boolean masks, grouped heads, odd strides and lse at once:
    the output as in the test above, lse within 1e-4 (relative above 1) plus what rounding
    its scores allows, -inf where the oracle's is."""
    q, k, v, causal, gqa, kw = problem
    out, lse = mh.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                               return_lse=True, **kw)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert lse.shape == q.shape[:-1]
    with np.errstate(all="ignore"):
        ref, ref_lse = oracle.scaled_dot_product_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
            is_causal=causal, enable_gqa=gqa, return_lse=True, **kw)
    kv = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    check_against_oracle(out, ref, q, kv, v)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(lse[~fin], ref_lse[~fin], equal_nan=True)
    # scores of huge q and k carry a huge rounding error, in the oracle's too
    slack = score_rounding_error(q, kv)[..., 0]
    # a finite lse beyond float32's range, or within rounding of it, may be its
    # infinity; and, as for the output, scores beyond the input type's range may
    # leave a row non-finite where the oracle's is finite: then its output row is too
    lost = fin & ~np.isfinite(lse)
    with np.errstate(over="ignore"):
        rounded = ref_lse.astype(np.float32)
    beyond = np.abs(ref_lse) + slack >= np.finfo(np.float32).max
    assert np.all(((lse == rounded) | beyond | ~np.all(np.isfinite(out), axis=-1))[lost])
    both = fin & ~lost
    err = np.abs(lse[both].astype(np.float64) - ref_lse[both])
    assert np.all(err <= 1e-4 * np.maximum(1, np.abs(ref_lse[both])) + slack[both])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["float32", "float16", "bfloat16", "int8", "int4"]),
       st.integers(0, 2**32 - 1))
def test_random_cache_sequences_match_the_oracle_on_the_stored_values(fmt, seed):
    """A cache in any format, with or without a window, filled by a prompt and then a few
    steps of 1 to 3 tokens, some with padding, through every score feature: each step's
    output and lse against the oracle over the values the cache holds (quantize then
    dequantize), the queries aligned to the end of the keys."""
    rng = np.random.default_rng(seed)
    B, Hkv, G = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    D = int(rng.choice([32, 64])) if fmt == "int4" else int(rng.choice([1, 5, 16, 64]))
    window = None if rng.integers(2) else int(rng.integers(1, 40))
    cache = mh.KVCache(B, 128, Hkv, D, fmt, window=window)
    kw = {}
    if rng.integers(2):
        kw["softcap"] = 30.0
    if rng.integers(2):
        kw["sinks"] = rng.standard_normal(Hkv * G).astype(np.float32)
    if rng.integers(2):
        kw["alibi_slopes"] = rng.random((B, Hkv * G) if rng.integers(2) else Hkv * G
                                        ).astype(np.float32)
    keys = np.zeros((B, Hkv, 0, D))
    values = np.zeros((B, Hkv, 0, D))
    padded = np.zeros((B, 0), bool)
    for T in [int(rng.integers(1, 70))] + [int(rng.integers(1, 4)) for _ in range(4)]:
        q, k, v = (rng.standard_normal((B, h, T, D)).astype(np.float32)
                   for h in (Hkv * G, Hkv, Hkv))
        pad = rng.random((B, T)) < 0.3 if rng.integers(3) == 0 else None
        out, lse = cache.attend(q, k, v, key_padding_mask=pad, return_lse=True, **kw)
        keys = np.concatenate([keys, dequantize(*quantize(k, fmt), fmt)], axis=2)
        values = np.concatenate([values, dequantize(*quantize(v, fmt), fmt)], axis=2)
        padded = np.concatenate([padded, np.zeros((B, T), bool) if pad is None else pad], 1)
        S = keys.shape[2]
        i, j = np.arange(T)[:, None] + S - T, np.arange(S)[None]
        seen = (j <= i) & (j > i - window if window else True)
        mask = seen[None, None] & ~padded[:, None, None, :]
        ref, ref_lse = oracle.scaled_dot_product_attention(
            q.astype(np.float64), keys, values, attn_mask=mask, enable_gqa=G > 1,
            return_lse=True, **kw)
        # a row that sees nothing: zeros and lse -inf (or its sink)
        assert np.all(np.abs(out - ref) <= 2e-5 * max(1.0, float(np.abs(values).max())))
        assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
        fin = np.isfinite(ref_lse)
        assert np.all(lse[~fin] == ref_lse[~fin])
        err = np.abs(lse[fin] - ref_lse[fin])
        assert np.all(err <= 1e-4 * np.maximum(1, np.abs(ref_lse[fin])))


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
