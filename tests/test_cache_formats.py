"""Half-precision inputs and low-precision KV caches (float16, bfloat16, int8, int4)."""
import re

import numpy as np
import pytest

import manyheads as mh
from manyheads import _core, _kernels, oracle
from manyheads.cache import dequantize, quantize

from conftest import F32_ATOL, normal

ml_dtypes = pytest.importorskip("ml_dtypes")
HALVES = [np.float16, ml_dtypes.bfloat16]
FORMATS = ["float16", "bfloat16", "int8", "int4"]
# relative RMS error of the attention output for unit-normal keys and values
# (docs/guide/low-precision.md)
RMS_BOUND = {"float16": 0.002, "bfloat16": 0.01, "int8": 0.012, "int4": 0.15}


def cache_dtype(fmt):
    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(fmt, fmt)


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def within_one_ulp(got, exact, extra=0.0):
    """got (half) is the float32 result (within F32_ATOL of exact, float64) rounded once to
    got's type: off by at most one unit in its last place plus the float32 error (plus
    ``extra``, see p_rounding)."""
    fi = ml_dtypes.finfo(got.dtype)
    ulp = float(fi.eps) * np.abs(exact)
    return bool(np.all(np.abs(got.astype(np.float64) - exact) <= 1.5 * ulp + F32_ATOL + extra))


def p_rounding(dtype, q, k, v, **kw):
    """The documented extra error of bfloat16 inputs on the avx512bf16 path
    (docs/guide/low-precision.md): the probabilities are rounded to bfloat16 (at
    most 2^-8 of each) before the value product, so an output element may move by
    up to 2^-8 * (P |v|); 0 elsewhere."""
    if mh.kernel_isa() != "avx512bf16" or np.dtype(dtype) != np.dtype(ml_dtypes.bfloat16):
        return 0.0
    wide = [a.astype(np.float64) for a in (q, k, v)]
    return 2.0**-8 * oracle.scaled_dot_product_attention(wide[0], wide[1], np.abs(wide[2]),
                                                         **kw)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("L,S,causal", [(1, 700, False), (3, 3, True), (90, 90, True),
                                        (4, 2000, False)])
def test_half_inputs_match_the_oracle_on_the_same_rounded_inputs(rng, dtype, L, S, causal):
    q = normal(rng, (2, 4, L, 64)).astype(dtype)
    k, v = (normal(rng, (2, 4, S, 64)).astype(dtype) for _ in range(2))
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.dtype == np.dtype(dtype)
    ref = oracle.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)),
                                              is_causal=causal)
    # computed in float32, then rounded once to the input type
    assert within_one_ulp(out, ref, p_rounding(dtype, q, k, v, is_causal=causal))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("L,S", [(70, 70), (1, 700)])
def test_half_results_are_the_float32_results_rounded_to_nearest_even(rng, dtype, L, S):
    # the kernels round half results as they write them (tile and split-key paths, vector
    # columns and the scalar last one); E odd keeps every path on float32 products, so the
    # float32 result is the same call's with the queries widened first
    E = 33
    q = normal(rng, (1, 3, L, E)).astype(dtype)
    k = normal(rng, (1, 3, S, E)).astype(dtype)
    v = normal(rng, (1, 3, S, E))
    tiny = 1e-39 if dtype == ml_dtypes.bfloat16 else 1e-6
    v[..., 0] *= tiny  # results in the subnormal range
    v[..., -1] *= 2.0 ** rng.integers(-30, 12, size=S)  # many magnitudes, subnormal to large
    v = v.astype(dtype)
    v[0, 1, S // 2, 3] = np.nan
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - L)
    got = _core.attention(q, k, v, **kw)
    want = _core.attention(q.astype(np.float32), k, v, **kw).astype(dtype)
    assert got.dtype == np.dtype(dtype)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    assert nan.any() and np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.mark.parametrize("dtype", HALVES)
def test_half_prefill_is_the_float32_prefill_of_the_same_values(rng, dtype):
    # each thread keeps the key and value rows it widened for a pair, for the pair's later
    # query blocks on that thread: several pairs and query blocks, a sliding window and a
    # padding mask give the bits of the float32 call on the widened arrays, rounded once
    E, T = 33, 260  # E odd: float32 products on every path (no bfloat16 pairs); the last
    # query block has 4 rows (the few-rows path inside the call)
    q, k, v = (normal(rng, (2, 3, T, E)).astype(dtype) for _ in range(3))
    pad = rng.random((2, 1, 1, T)) > 0.1
    pad[..., 0] = True
    for window in (None, 70):
        kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=0, window=window, mask=pad)
        got = _core.attention(q, k, v, **kw)
        want = _core.attention(*(a.astype(np.float32) for a in (q, k, v)), **kw).astype(dtype)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES)
def test_an_additive_mask_may_be_half_precision(rng, dtype):
    q, k, v = (normal(rng, (1, 2, 5, 16), np.float32) for _ in range(3))
    mask = np.where(rng.random((5, 5)) > 0.3, normal(rng, (5, 5), np.float32), -np.inf)
    half = mask.astype(dtype)
    got = mh.scaled_dot_product_attention(q, k, v, attn_mask=half)
    want = mh.scaled_dot_product_attention(q, k, v, attn_mask=half.astype(np.float32))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", HALVES)
def test_half_inputs_with_masks_gqa_weights_and_dropout(rng, dtype):
    q = normal(rng, (1, 6, 20, 32)).astype(dtype)
    k, v = (normal(rng, (1, 2, 20, 32)).astype(dtype) for _ in range(2))
    mask = rng.random((20, 20)) < 0.7
    mask[:, 0] = True
    out, w = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                             return_weights=True)
    assert out.dtype == w.dtype == np.dtype(dtype)
    wide = [a.astype(np.float64) for a in (q, np.repeat(k, 3, 1), np.repeat(v, 3, 1))]
    ref_out, ref_w = oracle.scaled_dot_product_attention(*wide, attn_mask=mask,
                                                         return_weights=True)
    # (a boolean mask hides entries: every key goes one at a time, in float32)
    assert within_one_ulp(out, ref_out) and within_one_ulp(w, ref_w)
    dropped = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                              dropout_p=0.3, seed=5)
    ref_drop = oracle.scaled_dot_product_attention(*wide, attn_mask=mask, dropout_p=0.3, seed=5)
    assert within_one_ulp(dropped, ref_drop)


def test_other_dtypes_are_rejected_naming_the_supported_ones():
    x = np.ones((1, 2, 3, 8), np.int16)
    with pytest.raises(TypeError, match="float16 or ml_dtypes.bfloat16"):
        mh.scaled_dot_product_attention(x, x, x)
    with pytest.raises(TypeError, match="one dtype"):
        mh.scaled_dot_product_attention(x.astype(np.float16), x.astype(np.float16),
                                        x.astype(np.float32))


def reference_quantize(x, fmt):
    """The int8 / int4 storage formats in NumPy (the C quantiser must store these bits)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if fmt == "int8":
            scale = np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)
            # (a scale that would widen 127 to inf: the float below it)
            scale = np.where(np.isinf(scale * np.float32(127)),
                             np.nextafter(scale, np.float32(0)), scale)
            safe = np.where(scale > 0, scale, np.float32(1))
            q = np.clip(np.rint(x / safe), -127, 127)
            q = np.where(np.isfinite(q), q, 0).astype(np.int8)
            return q, np.where(np.isfinite(scale), scale, np.float32(np.nan)).astype(np.float32)
        # per group of 32: the minimum rounded down to float16 (-0 as +0), the step
        # (max - that minimum) / 15 rounded up to float16, the codes from that pair
        groups = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
        lo, hi = (a + np.float32(0) for a in (groups.min(axis=-1), groups.max(axis=-1)))
        bad = ~np.isfinite(lo) | ~np.isfinite(hi)   # (NaN or inf in the group)
        lo16 = half_rounded(lo, down=True)
        step16 = half_rounded((hi - lo16.astype(np.float32)) / np.float32(15), down=False)
        lo16, step16 = (np.where(bad, np.float16(np.nan), a) for a in (lo16, step16))
        lo_f, step_f = lo16.astype(np.float32), step16.astype(np.float32)
        safe = np.where(step_f > 0, step_f, np.float32(1))
        q = np.clip(np.rint((groups - lo_f[..., None]) / safe[..., None]), 0, 15)
        q = np.where(np.isfinite(q), q, 0).astype(np.uint8).reshape(x.shape)
        scales = np.stack([step16, lo16], axis=-1)
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), \
            scales.reshape(x.shape[:-1] + (-1,))


def half_rounded(x, down):
    """float32 x as the float16 nearest from below (``down``) or above (beyond float16's
    range: -inf below -65504, 65504 above it going down, inf above it going up)."""
    h = x.astype(np.float16)
    toward = np.float16(-np.inf if down else np.inf)
    past = h.astype(np.float32) > x if down else h.astype(np.float32) < x
    return np.where(past, np.nextafter(h, toward), h)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_quantiser_stores_the_reference_bits(rng, fmt):
    x = normal(rng, (3, 5, 7, 64)) * 2.0 ** rng.integers(-20, 20, size=(3, 5, 7, 1))
    x[0, 0, 0] = 0                                   # zero scale
    x[0, 0, 1, :32] = 1.5                            # zero step (int4), one value
    x[0, 0, 2] = np.round(x[0, 0, 2] * 4) / 4        # ties in rint
    x[1, 1, 0] = np.r_[127.0, np.arange(63) - 31.5]  # int8: scale 1, halves of both signs
    x[1, 1, 1] = np.tile(np.r_[0.0, 15.0, np.arange(30) % 15 + 0.5], 2)  # int4: step 1
    x[0, 1, 0, 5] = np.nan
    x[0, 1, 1, 40] = np.inf
    x[0, 1, 2, 7] = -np.inf
    x[1, 0, 0] = 6e4 * np.sign(x[1, 0, 0])           # a float16 step past its range
    x[2, 0, 0] *= 1e-7                               # int4: a subnormal float16 step
    x[2, 0, 1] = 1000 + x[2, 0, 1] * 1e-3            # far from 0 for its range
    x[2, 0, 2] = 1e5 + x[2, 0, 2] * 1e3              # a minimum past 65504 ...
    x[2, 0, 3] = -7e4 + x[2, 0, 3]                   # ... and below -65504 (inf)
    x[2, 0, 4, :32] = 0.0                            # zeros of both signs
    x[2, 0, 4, 0] = -0.0
    x[2, 0, 5] *= 1e-40                              # float32 subnormals
    top = np.finfo(np.float32).max                   # int8: scales whose 127 would be inf
    x[2, 1, :, 0] = np.nextafter(top, 0) ** np.linspace(1, 0.999, 7, dtype=np.float32)
    x[2, 1, 0, 0] = top
    got, want = quantize(x, fmt), reference_quantize(x, fmt)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    np.testing.assert_array_equal(got[0], want[0])
    bits = "u4" if fmt == "int8" else "u2"
    np.testing.assert_array_equal(got[1].view(bits), want[1].view(bits))


def test_int8_rows_up_to_float32s_largest_come_back_finite_within_half_a_step():
    """A row whose largest magnitude is near float32's largest: its scale, rounded, would
    widen 127 to inf; the float below it is stored, and every value comes back finite,
    within half a stored step."""
    top = np.float32(np.finfo(np.float32).max)
    peaks = (top.view(np.uint32) - np.arange(4096, dtype=np.uint32)).view(np.float32)
    x = np.zeros((peaks.size, 64), np.float32)
    x[:, 0], x[:, 1], x[:, 2] = peaks, -peaks, peaks * np.float32(0.37)
    q, s = quantize(x, "int8")
    back = dequantize(q, s, "int8").astype(np.float64)
    assert np.isfinite(back).all() and np.all(s[:, 0] * np.float64(127) <= top)
    assert np.all(np.abs(back - x) <= s.astype(np.float64) / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(q, reference_quantize(x, "int8")[0])


def test_the_quantiser_rejects_what_its_formats_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 32 values, not 48"):
        quantize(np.ones((2, 48), np.float32), "int4")
    with pytest.raises(ValueError, match="not 'int2'"):
        quantize(np.ones((2, 64), np.float32), "int2")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_no_rows_quantise_and_come_back(fmt):
    x = np.zeros((2, 3, 0, 32), np.float32)
    q, scales = quantize(x, fmt)
    assert dequantize(q, scales, fmt).shape == x.shape


def test_a_cache_past_any_address_space_is_refused_naming_its_sizes():
    with pytest.raises(ValueError, match=r"a cache of batch_size=1073741824, max_len=1073741824"
                                         r", num_kv_heads=1024 and head_dim=1024 would take"):
        mh.KVCache(2**30, 2**30, 2**10, 2**10, dtype="int4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_within_the_format_resolution(rng, fmt):
    x = normal(rng, (3, 2, 50, 64), np.float32)
    back = dequantize(*quantize(x, fmt), fmt)
    step = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "int8": 1 / 127, "int4": 1 / 15}[fmt]
    span = {"int8": np.abs(x).max(-1, keepdims=True), "int4": 2 * np.abs(x).max()}.get(fmt, np.abs(x))
    assert np.all(np.abs(back - x) <= step * span + 1e-7)


def make(window=None, kv=2):
    return mh.MultiHeadAttention(32, 128, 4096, 0.0, 4, qkv_bias=True, num_kv_heads=kv,
                                 window=window, seed=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window,kv", [(None, 4), (None, 2), (24, 2)])
def test_every_cache_format_decodes_like_a_float32_cache(rng, fmt, window, kv):
    m = make(window, kv)
    x = normal(rng, (2, 60, 32), np.float32)
    pad = np.zeros((2, 40), bool)
    pad[1, :7] = True  # left padding in the prompt

    def decode(dtype):
        cache = m.new_cache(2, 60, dtype=dtype)
        outs = [m(x[:, :40], cache=cache, key_padding_mask=pad)]
        outs += [m(x[:, t:t + 1], cache=cache) for t in range(40, 60)]
        return np.concatenate(outs, axis=1), cache

    ref, ref_cache = decode(None)
    got, cache = decode(cache_dtype(fmt))
    assert rel_rms(got[1, 7:], ref[1, 7:]) < RMS_BOUND[fmt]
    assert rel_rms(got[0], ref[0]) < RMS_BOUND[fmt]
    per_f32 = {"float16": 0.5, "bfloat16": 0.5, "int8": 0.30, "int4": 0.18}[fmt]
    assert cache.nbytes <= per_f32 * ref_cache.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_attend_reads_the_stored_values_exactly(rng, fmt):
    """What the kernels compute from a quantised cache is the attention over the
    dequantised keys and values (no other error enters)."""
    cache = mh.KVCache(1, 3000, 2, 64, cache_dtype(fmt))
    q = normal(rng, (1, 4, 2900, 64), np.float32)
    k, v = (normal(rng, (1, 2, 2900, 64), np.float32) for _ in range(2))
    cache.attend(q[:, :, :2899], k[:, :, :2899], v[:, :, :2899])
    out = cache.attend(q[:, :, 2899:], k[:, :, 2899:], v[:, :, 2899:])  # split-key decode
    kd = dequantize(*quantize(k, fmt), fmt).astype(np.float64)
    vd = dequantize(*quantize(v, fmt), fmt).astype(np.float64)
    ref = oracle.scaled_dot_product_attention(q[:, :, 2899:].astype(np.float64),
                                              np.repeat(kd, 2, 1), np.repeat(vd, 2, 1))
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_unknown_cache_dtypes_list_the_accepted_ones():
    m = make()
    with pytest.raises(TypeError, match="'int8' or 'int4'"):
        m.new_cache(1, 8, dtype="int2")
    with pytest.raises(ValueError, match="multiple of 32"):
        mh.KVCache(1, 8, 1, 48, "int4")
    m64 = mh.MultiHeadAttention(32, 64, 64, 0.0, 4, dtype=np.float64)
    with pytest.raises(TypeError, match="float32 modules"):
        m64(np.ones((1, 2, 32)), cache=m64.new_cache(1, 8, dtype="int8"))


@pytest.mark.parametrize("fmt", ["float32"] + FORMATS)
@pytest.mark.parametrize("L,S", [(1, 3000), (4, 300)])
def test_grouped_decode_reads_each_kv_head_once_and_equals_repeated_heads(rng, fmt, L, S):
    """Decode with grouped queries serves the query heads that share a kv head in one
    work item; the result is the bits of the same attention with the kv heads repeated."""
    from manyheads import _core

    q = normal(rng, (2, 8, L, 64), np.float32)
    k, v = (normal(rng, (2, 2, S, 64), np.float32) for _ in range(2))
    kq, ks = quantize(k, fmt)
    vq, vs = quantize(v, fmt)
    pad = np.ones((2, 1, 1, S), bool)
    pad[1, ..., :5] = False
    kw = dict(scale=0.125, num_threads=2, causal_offset=S - L, mask=pad)
    grouped = _core.attention(q, kq, vq, k_scale=ks, v_scale=vs, enable_gqa=True, **kw)
    rep = (lambda a: None if a is None else np.repeat(a, 4, axis=1))
    repeated = _core.attention(q, rep(kq), rep(vq), k_scale=rep(ks), v_scale=rep(vs), **kw)
    np.testing.assert_array_equal(grouped, repeated)
    plan = _core.explain(q, kq, vq, k_scale=ks, v_scale=vs, enable_gqa=True, mask=pad,
                         num_threads=2)
    assert plan.group == 4 and plan.pairs == 4 and plan.items[0].rows == 4 * L
    assert plan.items[0].path == "few rows"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("E", [32, 96, 128, 256])
def test_quantised_decode_head_sizes(rng, fmt, E):
    """int8 / int4 decode at head sizes that are not 64 (one group, an odd number of
    groups, a row the int4 path unrolls, the most groups its integer keys take): the
    attention over the dequantised keys and values, and grouped heads give the bits of
    repeated heads, with a padding mask that hides keys in the middle of a block."""
    S, G, L = 700, 3, 2
    q = normal(rng, (1, 2 * G, L, E), np.float32)
    k, v = (normal(rng, (1, 2, S, E), np.float32) for _ in range(2))
    kq, ks = quantize(k, fmt)
    vq, vs = quantize(v, fmt)
    pad = np.ones((1, 1, 1, S), bool)
    pad[..., 100:107] = False
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - L, mask=pad)
    grouped = _core.attention(q, kq, vq, k_scale=ks, v_scale=vs, enable_gqa=True, **kw)
    rep = (lambda a: np.repeat(a, G, axis=1))
    repeated = _core.attention(q, rep(kq), rep(vq), k_scale=rep(ks), v_scale=rep(vs), **kw)
    np.testing.assert_array_equal(grouped, repeated)
    visible = pad & (np.arange(S) <= np.arange(L)[:, None] + S - L)
    kd = dequantize(kq, ks, fmt).astype(np.float64)
    vd = dequantize(vq, vs, fmt).astype(np.float64)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), rep(kd), rep(vd),
                                              attn_mask=visible, scale=E ** -0.5)
    np.testing.assert_allclose(grouped, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("E", [64, 128])
def test_int4_decode_of_queries_far_from_unit_size(rng, E):
    """int4 keys are read by integer dot products where the CPU has them, each query row
    written as integers on its own scale (its largest channel): a row spanning six
    decades, a row of 1e-32 values, rows holding inf or NaN, and scales whose rows are
    not adjacent all give the attention over the dequantised keys and values (a row
    holding inf or NaN: NaN, in that row only), grouped heads the bits of repeated ones."""
    S, G = 300, 3
    q = normal(rng, (1, 2 * G, 1, E), np.float32)
    q[0, 1, 0, ::7] *= 1e6
    q[0, 2] *= np.float32(1e-32)
    q[0, 4, 0, 5] = np.inf
    q[0, 5, 0, 9] = np.nan
    k, v = (normal(rng, (1, 2, S, E), np.float32) for _ in range(2))
    (kq, ks), (vq, vs) = quantize(k, "int4"), quantize(v, "int4")
    spread = np.zeros(ks.shape[:-1] + (2 * ks.shape[-1],), ks.dtype)
    spread[..., :ks.shape[-1]] = ks
    ks_apart = spread[..., :ks.shape[-1]]  # the same values, rows twice as far apart
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - 1)
    grouped = _core.attention(q, kq, vq, k_scale=ks_apart, v_scale=vs, enable_gqa=True, **kw)
    rep = (lambda a: np.repeat(a, G, axis=1))
    repeated = _core.attention(q, rep(kq), rep(vq), k_scale=rep(ks), v_scale=rep(vs), **kw)
    np.testing.assert_array_equal(grouped, repeated)
    kd = dequantize(kq, ks, "int4").astype(np.float64)
    vd = dequantize(vq, vs, "int4").astype(np.float64)
    ref = oracle.scaled_dot_product_attention(q[:, :4].astype(np.float64), rep(kd)[:, :4],
                                              rep(vd)[:, :4], scale=E ** -0.5)
    assert np.isnan(grouped[0, 4:]).all() and np.isfinite(grouped[0, :4]).all()
    np.testing.assert_allclose(grouped[0, :4], ref[0, :4], rtol=0, atol=2e-6)


@pytest.fixture(params=[True, False], ids=["permutes", "shuffles"])
def byte_permutes(request):
    """The int4 value mix with AVX512-VBMI byte permutes allowed (used where the CPU has
    them) or forbidden (the shuffles every AVX512-VNNI CPU runs); True if they are used."""
    yield _kernels.set_byte_permutes(request.param)
    _kernels.set_byte_permutes(True)


@pytest.mark.parametrize("E", [64, 128])
def test_int4_decode_of_values_whose_groups_differ_by_decades(rng, E, byte_permutes):
    """int4 values are mixed by integer dot products where the CPU has them, each group's
    weights written as integers on that group's own scale: channel groups whose values
    are 1e-6 and 1e3 in size each keep their own precision; a value group holding NaN
    gives NaN in its own channels only, in the rows whose weights reach it; and
    grouped heads give the bits of repeated ones, whatever the number of rows or the
    rows' place in memory."""
    S, G, L = 1000, 3, 1
    q = normal(rng, (1, 2 * G, L, E), np.float32)
    k, v = (normal(rng, (1, 2, S, E), np.float32) for _ in range(2))
    size = np.array([1e-6, 1e3, 1.0, 1e-3][:E // 32], np.float32).repeat(32)
    v *= size
    v[0, 1, 500, 40] = np.nan  # head 1's group 1 of row 500
    (kq, ks), (vq, vs) = quantize(k, "int4"), quantize(v, "int4")
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - L)
    grouped = _core.attention(q, kq, vq, k_scale=ks, v_scale=vs, enable_gqa=True, **kw)
    rep = (lambda a: np.repeat(a, G, axis=1))
    repeated = _core.attention(q, rep(kq), rep(vq), k_scale=rep(ks), v_scale=rep(vs), **kw)
    np.testing.assert_array_equal(grouped, repeated)
    one = _core.attention(q[:, :1], kq[:, :1], vq[:, :1], k_scale=ks[:, :1], v_scale=vs[:, :1],
                          **kw)
    np.testing.assert_array_equal(one, grouped[:, :1])
    # rows apart in memory (stored token by token, the heads side by side): rows of 64
    # channels are then not read two at a time, and the bits are the same
    by_token = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3))
    apart = _core.attention(q, by_token(kq), by_token(vq), k_scale=by_token(ks),
                            v_scale=by_token(vs), enable_gqa=True, **kw)
    np.testing.assert_array_equal(apart, grouped)
    kd = dequantize(kq, ks, "int4").astype(np.float64)
    vd = dequantize(vq, vs, "int4").astype(np.float64)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), rep(kd), rep(vd),
                                              scale=E ** -0.5)
    nan = np.zeros(grouped.shape, bool)
    nan[0, G:, :, 32:64] = True
    assert np.isnan(grouped[nan]).all() and np.isfinite(grouped[~nan]).all()
    ok = np.where(nan, 0, grouped) / size, np.where(nan, 0, ref) / size
    np.testing.assert_allclose(*ok, rtol=0, atol=2e-6)


def cpu_has_vbmi():
    """Whether /proc/cpuinfo lists AVX512-VBMI (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return "avx512vbmi" in flags


@pytest.mark.parametrize("E", [64, 128, 256])
def test_int4_value_mix_by_byte_permutes_gives_the_bits_of_the_shuffles(rng, E):
    """The int4 value mix interleaves four value rows by byte permutes on CPUs with
    AVX512-VBMI, by shuffles elsewhere: the same integer sums, so the same bits, for rows
    side by side or apart, whole runs of 16 rows and the rest, one to four query rows and
    grouped heads; and the attention over the dequantised keys and values."""
    if mh.kernel_isa() == "avx512bf16" and cpu_has_vbmi() is not None:
        assert _kernels.set_byte_permutes(True) == cpu_has_vbmi()
    by_token = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3))
    rep = (lambda a: np.repeat(a, 3, axis=1))
    for S, L, G in [(16, 1, 1), (63, 1, 3), (65, 2, 1), (200, 1, 1), (1000, 4, 1),
                    (1000, 1, 3)]:
        q = normal(rng, (1, 2 * G, L, E), np.float32)
        k, v = (normal(rng, (1, 2, S, E), np.float32) for _ in range(2))
        v[:, 1] *= np.float32(1e-3) * rng.uniform(0.5, 50, E).astype(np.float32)
        (kq, ks), (vq, vs) = quantize(k, "int4"), quantize(v, "int4")
        kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - L, enable_gqa=G > 1)
        kd = dequantize(kq, ks, "int4").astype(np.float64)
        vd = dequantize(vq, vs, "int4").astype(np.float64)
        visible = np.arange(S) <= np.arange(L)[:, None] + S - L
        ref = oracle.scaled_dot_product_attention(
            q.astype(np.float64), rep(kd) if G > 1 else kd, rep(vd) if G > 1 else vd,
            attn_mask=visible, scale=E ** -0.5)
        for layout in (lambda a: a, by_token):
            got = []
            try:
                for allow in (True, False):
                    _kernels.set_byte_permutes(allow)
                    got.append(_core.attention(q, *(layout(a) for a in (kq, vq)),
                                               k_scale=layout(ks), v_scale=layout(vs), **kw))
            finally:
                _kernels.set_byte_permutes(True)
            np.testing.assert_array_equal(got[0], got[1])
            # (relative to each row's largest: head 1's values are 5e-4 to 5e-2 in size)
            size = np.abs(ref).max(axis=-1, keepdims=True)
            np.testing.assert_allclose(got[0] / size, ref / size, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize("fmt", ["float32"] + FORMATS)
def test_decode_over_a_large_cache_reads_ahead_correctly(rng, fmt):
    """A decode call whose keys and values take 8 MB or more asks the memory for rows
    ahead of the ones it reads: over such a cache (float32 and float16 keys and values
    interleaved by head, so a row's stride is longer than its data) the result is the
    attention over the stored values."""
    H, S, E = 16, 8200, 64  # int4: 8.4 MB of keys and values, float32 67 MB
    q = normal(rng, (1, H, 1, E), np.float32)
    by_token = [normal(rng, (1, S, H, E), np.float32) for _ in range(2)]
    if fmt in ("float32", "float16"):
        k, v = (a.astype(cache_dtype(fmt)).transpose(0, 2, 1, 3) for a in by_token)
        ks = vs = None
        kd, vd = (a.astype(np.float64) for a in (k, v))
    else:
        (k, ks), (v, vs) = (quantize(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), fmt)
                            for a in by_token)
        kd, vd = (dequantize(a, s, fmt).astype(np.float64) for a, s in ((k, ks), (v, vs)))
    got = _core.attention(q, k, v, k_scale=ks, v_scale=vs, scale=0.125, num_threads=2,
                          causal_offset=S - 1)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), kd, vd, scale=0.125)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int8", "int4"])
def test_a_cache_allocates_what_the_storage_table_says(name):
    from manyheads.cache import FORMATS

    fmt = FORMATS[name]
    m = mh.MultiHeadAttention(64, 64, 32, 0.0, 2, seed=0)  # heads of 32
    cache = m.new_cache(3, 10, dtype=name)
    assert cache.keys.dtype == fmt.dtype and cache.keys.shape == (3, 2, 10, fmt.stored_columns(32))
    assert cache.nbytes == 2 * 3 * 2 * 10 * fmt.row_bytes(32)
    if fmt.quantized:
        assert cache.key_scales.dtype == fmt.scale_dtype
        assert cache.key_scales.shape[-1] == fmt.scale_columns(32)
    else:
        assert cache.key_scales is None
    # the arrays (one buffer among them) are zeros, each on a cache line of its own
    # bytes and apart from the others
    # (a copy's too, and none with the original's)
    twin = cache.copy()
    arrays = [a for c in (cache, twin)
              for a in (c.keys, c.values, c.key_scales, c.value_scales) if a is not None]
    assert len(arrays) == (8 if fmt.quantized else 4)
    for i, a in enumerate(arrays):
        assert a.flags.c_contiguous and a.ctypes.data % 64 == 0 and not a.view(np.uint8).any()
        assert not any(np.shares_memory(a, b) for b in arrays[i + 1:])
    # a row of 32 channels: the elements, and for int8 one float32 scale, for int4 one
    # (scale, min) pair of float16 per 32 channels
    assert fmt.row_bytes(32) == {"float32": 128, "float16": 64, "bfloat16": 64, "int8": 36,
                                 "int4": 20}[name]


def test_int4_values_come_back_within_half_a_stored_step(rng):
    """Each int4 code is worked out from the group's (step, minimum) pair as stored in
    float16, so every finite value comes back within half that step (and float32's
    rounding), whatever the group's magnitude: a step that float16 holds only as a
    subnormal, a group far from 0 for its range, a minimum past 65504."""
    base = normal(rng, (40, 6, 64))
    for scale in (1e-9, 1e-7, 1e-5, 1.0, 1e3):
        for x in (base * scale, 10 * scale + base * scale * 1e-3, 7e4 + base * 100):
            x = x.astype(np.float32)
            q, pairs = quantize(x, "int4")
            back = dequantize(q, pairs, "int4").astype(np.float64)
            step = np.repeat(pairs[..., 0::2].astype(np.float64), 32, axis=-1)
            slack = 4 * np.finfo(np.float32).eps * np.abs(x).max()
            assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-6) + slack)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int4"])
@pytest.mark.parametrize("window", [None, 4])
def test_a_half_or_int4_cache_refuses_finite_values_beyond_its_range(rng, window, fmt):
    """A finite key or value past float16's 65504 (bfloat16: one that rounds to its inf,
    from about 3.396e38; int4: a group whose float16 minimum or step would be past 65504)
    would be stored as inf and turn every score (or the output) into NaN: a ValueError
    naming it, before anything is stored; inf given as such is stored as it is, as the
    other formats take it."""
    cache = mh.KVCache(1, 16, 2, 32, cache_dtype(fmt), window=window)
    x = normal(rng, (1, 2, 6, 32), np.float32)
    cache.attend(x, x, x)                          # (past the window: the ring's path)
    before = cache.keys.copy()
    # (int4: a minimum below -65504, or a step (max - min) / 15 above it with the
    # minimum held at 65504 at most: a group all 1.1e6 too; 7e4 alone fits)
    bigs = {"float16": (("key", 7e4), ("value", -1e6)),
            # (3.39615e38 and up; beside an inf, which hides the finite extremes)
            "bfloat16": (("key", 3.3962e38), ("value", -3.4e38), ("key", "beside inf")),
            "int4": (("key", -7e4), ("value", 1e6), ("key", 9.9e5), ("value", "all 1.1e6"))
            }[fmt]
    for name, big in bigs:
        k, v = (normal(rng, (1, 2, 3, 32), np.float32) for _ in range(2))
        if big == "all 1.1e6":
            (k if name == "key" else v)[0, 1, 2] = 1.1e6
            said = f"new {name} has a group from 1.1e+06 to 1.1e+06"
        elif big == "beside inf":
            k[0, 0, 1, 3], k[0, 0, 2, 4], k[0, 1, 0, 9] = np.inf, -np.inf, -3.3962e38
            said = f"new {name} has magnitude 3.3962e+38"
        else:
            (k if name == "key" else v)[0, 1, 2, 5] = big
            said = f"new {name} has magnitude {abs(big):g}" if fmt != "int4" else \
                f"new {name} has a group from {big:g} to" if big < 0 else f" to {big:g}; "
        with pytest.raises(ValueError, match=re.escape(said)):
            cache.attend(k, k, v)
        assert len(cache) == 6 and np.array_equal(cache.keys, before)
    k = normal(rng, (1, 2, 1, 32), np.float32)
    # (the largest values each holds: bfloat16's largest finite, and what rounds to it)
    k[0, 0, 0, 7] = {"float16": 6e4, "bfloat16": 3.3961e38, "int4": 7e4}[fmt]
    k[0, 0, 0, 8] = 3.3895e38 if fmt == "bfloat16" else 0.0
    v = k.copy()
    v[0, 0, 0, 3] = np.inf
    out = cache.attend(k, k, v)
    # (int4: the group holding inf comes back as NaN)
    assert len(cache) == 7 and not np.isfinite(out[0, 0, 0, 3]) and np.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("fmt", ["float32"] + FORMATS)
@pytest.mark.parametrize("window", [None, 3])
def test_a_one_token_step_stores_the_bits_quantize_gives(rng, fmt, window):
    """A decoding step stores its token's keys and values in C, without the general
    store's temporaries: the bits quantize() gives the same rows, in every slot of a
    ring too, from keys and values laid out as a module's projection lays them out."""
    B, H, D = 2, 3, 64
    cache = mh.KVCache(B, 8, H, D, cache_dtype(fmt), window=window)
    for t, size in enumerate([1.0, 1e-6, 300.0, 1.0, 0.05, 7.0]):
        qkv = normal(rng, (B, 1, 3 * H * D), np.float32) * np.float32(size)
        q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, 1, H, D).transpose(0, 2, 1, 3)
                   for i in range(3))
        cache.attend(q, k, v)
        slot = t % cache.capacity
        for stored, scales, x in ((cache.keys, cache.key_scales, k),
                                  (cache.values, cache.value_scales, v)):
            want, want_scales = quantize(x[:, :, 0], fmt)
            assert np.array_equal(stored[:, :, slot].view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8))
            if want_scales is not None:
                assert np.array_equal(scales[:, :, slot].view(np.uint8),
                                      np.ascontiguousarray(want_scales).view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stacked_step_stores_each_head_where_the_fused_step_does(rng, fmt):
    """Each head of a stack stores its own kv head of the shared cache in a decoding
    step: the cache ends as the fused module's, bit for bit."""
    fused = mh.MultiHeadAttention(32, 128, 16, 0.0, 2, seed=3)
    stacked = fused.to_stacked()
    caches = [m.new_cache(1, 16, dtype=cache_dtype(fmt)) for m in (fused, stacked)]
    for t in range(4):
        x = normal(rng, (1, 1 if t else 3, 32), np.float32)
        for m, c in zip((fused, stacked), caches):
            m(x, cache=c)
    for a, b in zip(*((c.keys, c.values, c.key_scales, c.value_scales) for c in caches)):
        assert (a is None) == (b is None)
        if a is not None:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int4"])
def test_a_one_token_step_refuses_values_past_the_format_before_storing(rng, fmt):
    """The refusal of test_a_half_or_int4_cache_refuses_finite_values_beyond_its_range
    for a decoding step of one token (stored in C): the same ValueError, the cache as it
    was, its length too."""
    cache = mh.KVCache(1, 8, 2, 32, cache_dtype(fmt))
    x = normal(rng, (1, 2, 2, 32), np.float32)
    cache.attend(x, x, x)
    before = [a.copy() for a in (cache.keys, cache.values, cache.key_scales,
                                 cache.value_scales) if a is not None]
    k = normal(rng, (1, 2, 1, 32), np.float32)
    v = k.copy()
    v[0, 1, 0, 4] = {"float16": 7e4, "bfloat16": -3.4e38, "int4": 1e6}[fmt]
    with pytest.raises(ValueError, match="new value has"):
        cache.attend(k, k, v)
    after = [a for a in (cache.keys, cache.values, cache.key_scales, cache.value_scales)
             if a is not None]
    assert len(cache) == 2
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(before, after))
    cache.attend(k, k, k)  # (the values it holds: stored)
    assert len(cache) == 3


def test_a_one_token_step_may_take_its_keys_from_the_cache_itself(rng):
    """New keys and values that are views of the cache's own rows (a copy of earlier
    tokens) are stored as they were before the step."""
    cache = mh.KVCache(1, 8, 2, 32)
    x = normal(rng, (1, 2, 3, 32), np.float32)
    cache.attend(x, x, normal(rng, (1, 2, 3, 32), np.float32))
    want_k, want_v = cache.keys[:, :, 0].copy(), cache.values[:, :, 1].copy()
    out = cache.attend(x[:, :, :1], cache.keys[:, :, 0:1], cache.values[:, :, 1:2])
    assert len(cache) == 4 and np.isfinite(out).all()
    assert np.array_equal(cache.keys[:, :, 3], want_k)
    assert np.array_equal(cache.values[:, :, 3], want_v)
