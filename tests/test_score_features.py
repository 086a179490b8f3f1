"""Soft cap, attention sinks, ALiBi and the log-sum-exp: every kernel path (tile prefill,
few-rows decode, split-key decode, grouped heads) against the float64 oracle and against
a reference written here row by row; merge_attention over disjoint keys."""
import math

import numpy as np
import pytest

import manyheads as mh
from manyheads import _core, oracle
from manyheads.cache import quantize, dequantize

from conftest import normal


def row_by_row(q, k, v, *, scale, softcap=None, sinks=None, slopes=None, visible=None):
    """Attention of one head, spelled out for each query row with Python floats:
    q (L, E), k (S, E), v (S, Ev); visible(i, j) says whether row i may see key j.
    Returns (out (L, Ev), lse (L,))."""
    L, S = q.shape[0], k.shape[0]
    out, lse = np.zeros((L, v.shape[1])), np.zeros(L)
    for i in range(L):
        logits, values = [], []
        for j in range(S):
            if visible is not None and not visible(i, j):
                continue
            s = float(np.dot(q[i].astype(np.float64), k[j].astype(np.float64))) * scale
            if softcap is not None:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s -= slopes * abs(i + S - L - j)
            logits.append(s)
            values.append(v[j].astype(np.float64))
        if sinks is not None:
            logits.append(float(sinks))
        if not logits:
            lse[i] = -math.inf
            continue
        top = max(logits)
        e = [math.exp(x - top) for x in logits]
        total = sum(e)
        lse[i] = top + math.log(total)
        for w, val in zip(e, values):
            out[i] += w / total * val
    return out, lse


# (L, S): tile prefill with a short last block, few-rows decode, split-key decode
SHAPES = [(70, 70), (3, 300), (1, 1100)]
FEATURES = [dict(softcap=4.0), dict(sinks=True), dict(alibi=True),
            dict(softcap=2.5, sinks=True, alibi=True)]


def features(rng, heads, batch, kw):
    out = {}
    if "softcap" in kw:
        out["softcap"] = kw["softcap"]
    if kw.get("sinks"):
        out["sinks"] = rng.uniform(-1, 3, heads).astype(np.float32)
    if kw.get("alibi"):
        out["alibi_slopes"] = rng.uniform(0.01, 0.3, (batch, heads)).astype(np.float32)
    return out


@pytest.mark.parametrize("L,S", SHAPES)
@pytest.mark.parametrize("kw", FEATURES, ids=lambda kw: "+".join(kw))
@pytest.mark.parametrize("gqa", [False, True])
def test_every_path_matches_the_oracle_with_each_feature(rng, L, S, kw, gqa):
    B, Hq, Hkv, E = 2, 4, 2 if gqa else 4, 32
    q = normal(rng, (B, Hq, L, E), np.float32)
    k, v = (normal(rng, (B, Hkv, S, E), np.float32) for _ in range(2))
    f = features(rng, Hq, B, kw)
    causal = np.tril(np.ones((L, S), bool), S - L)  # queries aligned to the end of the keys
    out, lse = mh.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=gqa,
                                               return_lse=True, num_threads=2, **f)
    ro, rl = oracle.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v)), attn_mask=causal, enable_gqa=gqa,
        return_lse=True, **f)
    assert out.dtype == np.float32 and lse.dtype == np.float32 and lse.shape == (B, Hq, L)
    np.testing.assert_allclose(out, ro, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-4)


@pytest.mark.parametrize("L,S", [(5, 9), (1, 12), (12, 12)])
def test_the_oracle_and_a_row_by_row_reference_agree(rng, L, S):
    q = normal(rng, (1, 2, L, 8), np.float64)
    k, v = normal(rng, (1, 2, S, 8), np.float64), normal(rng, (1, 2, S, 8), np.float64)
    sinks, slopes = np.array([0.5, -1.0]), np.array([0.25, 0.05])
    out, lse = oracle.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0,
                                                   sinks=sinks, alibi_slopes=slopes,
                                                   return_lse=True)
    fast, fast_lse = mh.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0,
                                                     sinks=sinks, alibi_slopes=slopes,
                                                     return_lse=True)
    for h in range(2):
        ref, ref_lse = row_by_row(q[0, h], k[0, h], v[0, h], scale=8 ** -0.5, softcap=3.0,
                                  sinks=sinks[h], slopes=slopes[h], visible=lambda i, j: j <= i)
        np.testing.assert_allclose(out[0, h], ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[0, h], ref_lse, rtol=0, atol=1e-12)
        np.testing.assert_allclose(fast[0, h], ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(fast_lse[0, h], ref_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_take_every_feature(rng, dtype):
    from manyheads.cache import FORMATS

    dt = FORMATS[dtype].dtype
    q, k, v = (normal(rng, (1, 3, 90, 64), np.float32).astype(dt) for _ in range(3))
    f = dict(softcap=3.0, sinks=np.array([0.1, 1.0, 2.0]), alibi_slopes=np.array([0.1, 0.2, 0.3]))
    out, lse = mh.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, **f)
    ro, rl = oracle.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)),
                                                 is_causal=True, return_lse=True, **f)
    assert out.dtype == dt
    tol = 2e-2 if dtype == "bfloat16" else 2e-3  # the output rounded to its type
    np.testing.assert_allclose(out.astype(np.float64), ro, rtol=0, atol=tol)
    np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-3)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("L,S", [(1, 1500), (3, 200)])
def test_decode_through_every_cache_format_takes_every_feature(rng, fmt, L, S):
    q = normal(rng, (2, 8, L, 64), np.float32)
    k, v = (normal(rng, (2, 2, S, 64), np.float32) for _ in range(2))
    (kq, ks), (vq, vs) = quantize(k, fmt), quantize(v, fmt)
    f = dict(softcap=5.0, sinks=rng.uniform(0, 2, 8).astype(np.float32),
             alibi=rng.uniform(0, 0.1, 8).astype(np.float32))
    out, lse = _core.attention(q, kq, vq, k_scale=ks, v_scale=vs, scale=0.125, num_threads=2,
                               causal_offset=S - L, enable_gqa=True,
                               features=(5.0, f["sinks"], f["alibi"], True))
    kd, vd = (dequantize(a, s, fmt).astype(np.float64) for a, s in ((kq, ks), (vq, vs)))
    ro, rl = oracle.scaled_dot_product_attention(
        q.astype(np.float64), kd, vd, is_causal=True, causal_offset=S - L, scale=0.125,
        enable_gqa=True, return_lse=True, softcap=5.0, sinks=f["sinks"],
        alibi_slopes=f["alibi"])
    # the oracle reads the values the cache stores: only float32 rounding remains
    np.testing.assert_allclose(out, ro, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-4)


def test_features_give_the_same_bits_on_any_thread_count_and_grouped_or_repeated(rng):
    q = normal(rng, (1, 8, 2, 64), np.float32)
    k, v = (normal(rng, (1, 2, 3000, 64), np.float32) for _ in range(2))
    f = dict(softcap=4.0, sinks=rng.standard_normal(8), alibi_slopes=rng.uniform(0, 0.1, 8),
             return_lse=True)
    one = mh.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_threads=1, **f)
    two = mh.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_threads=2, **f)
    rep = mh.scaled_dot_product_attention(q, np.repeat(k, 4, 1), np.repeat(v, 4, 1),
                                          num_threads=2, **f)
    for a, b, c in zip(one, two, rep):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_row_that_sees_nothing_has_lse_minus_inf_or_its_sink(rng):
    q, k, v = (normal(rng, (1, 2, 4, 16), np.float32) for _ in range(3))
    mask = np.ones((4, 4), bool)
    mask[1] = False  # row 1 sees no key
    out, lse = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isneginf(lse[:, :, 1]))
    assert np.isfinite(lse[:, :, [0, 2, 3]]).all()
    sinks = np.array([0.5, -2.0], np.float32)
    out, lse = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, sinks=sinks,
                                               return_lse=True)
    assert np.all(out[:, :, 1] == 0)
    np.testing.assert_allclose(lse[0, :, 1], sinks, rtol=0, atol=1e-6)


def test_weights_leave_the_sinks_share_out(rng):
    q, k, v = (normal(rng, (1, 2, 6, 16), np.float32) for _ in range(3))
    sinks = np.array([1.0, 3.0])
    out, w, lse = mh.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                                  return_weights=True, return_lse=True)
    _, rw = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                                v.astype(np.float64), is_causal=True,
                                                sinks=sinks, return_weights=True)
    np.testing.assert_allclose(w, rw, rtol=0, atol=1e-6)
    # each row's weights sum to 1 minus the sink's share, exp(sink - lse)
    np.testing.assert_allclose(w.sum(-1), 1 - np.exp(sinks[None, :, None] - lse), atol=1e-6)


def test_nan_in_a_sink_reaches_only_its_head(rng):
    q, k, v = (normal(rng, (1, 2, 5, 16), np.float32) for _ in range(3))
    out, lse = mh.scaled_dot_product_attention(q, k, v, sinks=np.array([np.nan, 0.0]),
                                               return_lse=True)
    assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]).all()
    assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1]).all()


@pytest.mark.parametrize("cuts", [(0, 700, 1500), (0, 1, 1500), (0, 1500, 1500)])
def test_merge_attention_over_disjoint_keys_is_attention_over_their_union(rng, cuts):
    q = normal(rng, (2, 4, 3, 64), np.float32)
    k, v = (normal(rng, (2, 4, 1500, 64), np.float32) for _ in range(2))
    whole, whole_lse = mh.scaled_dot_product_attention(q, k, v, softcap=6.0, return_lse=True)
    parts = [mh.scaled_dot_product_attention(q, k[:, :, a:b], v[:, :, a:b], softcap=6.0,
                                             return_lse=True)
             for a, b in zip(cuts[:-1], cuts[1:])]
    out, lse = mh.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, whole, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, whole_lse, rtol=0, atol=1e-5)
    ro, rl = oracle.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, ro, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-6)


def test_merge_attention_skips_parts_that_saw_nothing(rng):
    a = normal(rng, (2, 3, 8), np.float32)
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    out, merged = mh.merge_attention([a, np.zeros_like(a)], [lse, np.full_like(lse, -np.inf)])
    np.testing.assert_array_equal(out, a)
    np.testing.assert_array_equal(merged, lse)
    out, merged = mh.merge_attention([a], [np.full_like(lse, -np.inf)])
    assert np.all(out == 0) and np.all(np.isneginf(merged))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(softcap=0.0), ValueError, "softcap must be positive"),
    (dict(softcap="3"), TypeError, "softcap must be a real number"),
    (dict(sinks=np.zeros(3)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks="a"), TypeError, "sinks"),
    (dict(alibi_slopes=np.zeros((3, 4))), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
])
def test_feature_arguments_are_checked(rng, kwargs, exc, match):
    q = normal(rng, (2, 4, 3, 8), np.float32)
    with pytest.raises(exc, match=match):
        mh.scaled_dot_product_attention(q, q, q, **kwargs)


def test_merge_attention_checks_its_arguments(rng):
    a = normal(rng, (2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="one lse per output"):
        mh.merge_attention([a, a], [np.zeros((2, 3))])
    with pytest.raises(ValueError, match=r"lses\[0\] must have shape \(2, 3\)"):
        mh.merge_attention([a], [np.zeros((2, 4))])


def test_alibi_slopes_follow_the_papers_sequence():
    from manyheads.modules import alibi_slopes

    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_array_equal(alibi_slopes(4), 2.0 ** -np.arange(2, 9, 2))
    # 6 heads: the sequence for 4, then every other slope of the sequence for 8
    np.testing.assert_array_equal(alibi_slopes(6), 2.0 ** -np.array([2, 4, 6, 8, 1, 3]))


def module_reference(m, x):
    """The fused module's output from its weights and the oracle, step by step."""
    H, D = m.num_heads, m.head_dim
    B, T, _ = x.shape
    heads = lambda a: a.reshape(B, T, -1, D).transpose(0, 2, 1, 3).astype(np.float64)
    q, k, v = (heads(x @ W) for W in (m.W_query, m.W_key, m.W_value))
    ctx = oracle.scaled_dot_product_attention(
        q, k, v, is_causal=True, window=m.window, enable_gqa=m.num_kv_heads != H,
        softcap=m.softcap, sinks=m.sinks, alibi_slopes=m.alibi_slopes)
    return ctx.transpose(0, 2, 1, 3).reshape(B, T, H * D) @ m.W_out + m.b_out


@pytest.mark.parametrize("window", [None, 6])
def test_modules_carry_softcap_sinks_and_alibi_through_caches_and_files(rng, tmp_path, window):
    m = mh.MultiHeadAttention(32, 32, 64, 0.0, 4, num_kv_heads=2, window=window, softcap=4.0,
                              sinks=True, alibi=True, seed=0)
    m.sinks[...] = rng.uniform(-1, 2, 4)
    x = normal(rng, (2, 20, 32), np.float32)
    y = m(x)
    np.testing.assert_allclose(y, module_reference(m, x), rtol=0, atol=2e-5)
    # decode through a cache (a ring of `window` slots that wraps): every position's
    # ALiBi distance and the sinks as in the whole forward
    cache = m.new_cache(2, 40)
    steps = [m(x[:, :9], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(9, 17)]
    steps.append(m(x[:, 17:], cache=cache))  # three at once past the window
    np.testing.assert_allclose(np.concatenate(steps, axis=1), y, rtol=0, atol=2e-6)
    m.save(tmp_path / "m.npz")
    back = mh.MultiHeadAttention.load(tmp_path / "m.npz")
    np.testing.assert_array_equal(back.sinks, m.sinks)
    np.testing.assert_array_equal(back(x), y)


def test_stacked_heads_hold_their_own_sink_and_slope(rng, tmp_path):
    m = mh.MultiHeadAttention(24, 24, 64, 0.0, 3, softcap=3.0, sinks=True, alibi=True, seed=1)
    m.sinks[...] = [0.5, -1.0, 2.0]
    st = m.to_stacked()
    assert [h.sinks.tolist() for h in st.heads] == [[0.5], [-1.0], [2.0]]
    np.testing.assert_array_equal(st.alibi_slopes, m.alibi_slopes)
    x = normal(rng, (1, 15, 24), np.float32)
    np.testing.assert_allclose(st(x), m(x), rtol=0, atol=2e-6)
    np.testing.assert_allclose(st.to_fused()(x), m(x), rtol=0, atol=2e-6)
    st.save(tmp_path / "st.npz")
    back = mh.StackedMultiHeadAttention.load(tmp_path / "st.npz")
    np.testing.assert_array_equal(back.sinks, st.sinks)
    with pytest.raises(ValueError, match="make it with sinks=True"):
        mh.StackedMultiHeadAttention(24, 24, 64, 0.0, 3).sinks = [1.0, 2.0, 3.0]


def test_a_caches_attend_takes_every_feature(rng):
    cache = mh.KVCache(1, 50, 2, 16)
    q, k, v = (normal(rng, (1, h, 30, 16), np.float32) for h in (4, 2, 2))
    f = dict(softcap=5.0, sinks=np.array([0.1, 0.2, 0.3, 0.4]),
             alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]))
    out, lse = cache.attend(q[:, :, :20], k[:, :, :20], v[:, :, :20], return_lse=True, **f)
    out2, lse2 = cache.attend(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], return_lse=True, **f)
    ro, rl = oracle.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v)), is_causal=True, enable_gqa=True,
        return_lse=True, **f)
    np.testing.assert_allclose(np.concatenate([out, out2], 2), ro, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.concatenate([lse, lse2], 2), rl, rtol=0, atol=1e-4)


@pytest.mark.parametrize("L,S", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_cap_of_any_size_keeps_the_scores_precision(rng, L, S, dtype):
    # c tanh(s / c) tends to s as the cap grows: a cap far above the scores must give
    # the uncapped result, not lose the scores' relative precision (a cap of 1e8 had
    # made every float32 score 0)
    q = normal(rng, (1, 2, L, 32), dtype) * 2
    k, v = (normal(rng, (1, 2, S, 32), dtype) for _ in range(2))
    causal = np.tril(np.ones((L, S), bool), S - L)
    tol = 2e-5 if dtype == np.float32 else 1e-10
    for cap in [0.5, 4.0, 50.0, 1e3, 1e6, 1e8, 1e30, 2.35e38]:
        out = mh.scaled_dot_product_attention(q, k, v, attn_mask=causal, softcap=cap)
        ref = oracle.scaled_dot_product_attention(
            *(a.astype(np.float64) for a in (q, k, v)), attn_mask=causal, softcap=cap)
        np.testing.assert_allclose(out, ref, rtol=0, atol=tol, err_msg=f"softcap={cap}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_factors_float32_scores_cannot_take_are_refused(rng, dtype):
    """The kernels take a scale, soft cap or ALiBi slope times log2(e) in the scores'
    float32: past about 2.36e38 that is inf, and every output had been NaN."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q = normal(rng, (1, 2, 4, 8), np.float32).astype(dtype)
    big = dict(scale=1e39, softcap=3.4e38, alibi_slopes=np.array([0.5, 3e38], np.float32))
    for name, value in big.items():
        with pytest.raises(ValueError, match=f"{name} must be at most 2.359e[+]38 in magnitude "
                                             "for float32 attention"):
            mh.scaled_dot_product_attention(q, q, q, **{name: value})
    cache = mh.KVCache(1, 8, 2, 8, dtype)  # (it attends float32 queries, keys and values)
    q32 = q.astype(np.float32)
    with pytest.raises(ValueError, match="softcap must be at most"):
        cache.attend(q32, q32, q32, softcap=1e39)
    with pytest.raises(ValueError, match="scale must be at most"):
        cache.attend(q32, q32, q32, scale=-1e39)
    assert len(cache) == 0
    for make in (lambda: mh.MultiHeadAttention(8, 8, 16, 0.0, 2, scale=1e39),
                 lambda: mh.MultiHeadAttention(8, 8, 16, 0.0, 2, softcap=1e39)):
        with pytest.raises(ValueError, match="must be at most 2.359e[+]38"):
            make()


def test_float64_takes_factors_past_float32s_range(rng):
    q, k, v = (normal(rng, (1, 2, 4, 8), np.float64) for _ in range(3))
    out = mh.scaled_dot_product_attention(q, k, v, softcap=1e300, scale=1e-300)
    ref = oracle.scaled_dot_product_attention(q, k, v, softcap=1e300, scale=1e-300)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="scale must be at most 1.246e[+]308 in magnitude for "
                                         "float64 attention"):
        mh.scaled_dot_product_attention(q, k, v, scale=1.5e308)


def test_two_dimensional_slopes_need_a_batch_axis(rng):
    q = normal(rng, (4, 3, 8), np.float32)  # (heads, L, E): no batch
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\): one slope"):
        mh.scaled_dot_product_attention(q, q, q, alibi_slopes=np.ones((1, 4), np.float32))


def test_a_query_without_a_head_axis_takes_one_heads_sink_and_slope(rng):
    # ((L, E) is one head: its (1,) sinks and slopes had failed inside with NumPy's error)
    q, k, v = (normal(rng, (7, 8), np.float64) for _ in range(3))
    kw = dict(sinks=np.array([0.3]), alibi_slopes=np.array([0.25]), is_causal=True)
    out = mh.scaled_dot_product_attention(q, k, v, **kw)
    np.testing.assert_array_equal(out, mh.scaled_dot_product_attention(q[None], k[None],
                                                                       v[None], **kw)[0])
    np.testing.assert_allclose(out, oracle.scaled_dot_product_attention(q, k, v, **kw),
                               rtol=0, atol=1e-12)
    ref, _ = row_by_row(q, k, v, scale=8 ** -0.5, sinks=0.3, slopes=0.25,
                        visible=lambda i, j: j <= i)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)


def test_a_modules_factors_changed_after_construction_are_checked_at_the_call(rng):
    """The kernels refuse what the arguments' checks would have: a scale, soft cap or
    slope set on a module later must not reach them as inf."""
    x = normal(rng, (1, 5, 8), np.float32)
    for name, value in (("scale", 1e39), ("softcap", -3e38)):
        m = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, seed=0)
        setattr(m, name, value)
        with pytest.raises(ValueError, match=f"{name} must be at most 2.359e[+]38"):
            m(x)
        cache = m.new_cache(1, 8)
        with pytest.raises(ValueError, match=f"{name} must be at most 2.359e[+]38"):
            m(x[:, :1], cache=cache)
        assert len(cache) == 0
    m = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, alibi=True, seed=0)
    m.alibi_slopes = np.array([0.5, 1e39])
    with pytest.raises(ValueError, match="alibi_slopes must be at most 2.359e[+]38"):
        m(x)
