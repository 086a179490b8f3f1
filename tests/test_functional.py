"""scaled_dot_product_attention against the NumPy oracle (and PyTorch when installed)."""
import numpy as np
import pytest

import manyheads as mh
from manyheads import _kernels
from manyheads import oracle

from conftest import TWO_THREADS, atol_for, normal

DTYPES = [np.float32, np.float64]


def reference(q, k, v, **kw):
    """The oracle in float64 on the same inputs."""
    return oracle.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw)


def qkv(rng, B, H, L, S, E, Ev=None, dtype=np.float64, Hkv=None):
    Hkv = H if Hkv is None else Hkv
    return (normal(rng, (B, H, L, E), dtype), normal(rng, (B, Hkv, S, E), dtype),
            normal(rng, (B, Hkv, S, Ev or E), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 8, 64, 80, 128])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 200])
def test_causal_matches_oracle_over_shapes(rng, dtype, head_dim, T):
    q, k, v = qkv(rng, 2, 3, T, T, head_dim, dtype=dtype)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype and out.shape == (2, 3, T, head_dim)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), rtol=0,
                               atol=atol_for(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", [(1, 1), (3, 5), (16, 12)])
def test_batch_and_head_counts(rng, dtype, B, H):
    q, k, v = qkv(rng, B, H, 33, 33, 16, dtype=dtype)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), rtol=0,
                               atol=atol_for(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequence_within_documented_float32_tolerance(rng, dtype):
    q, k, v = qkv(rng, 1, 2, 1024, 1024, 64, dtype=dtype)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), rtol=0,
                               atol=atol_for(dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_rectangular_and_value_width(rng, causal):
    q, k, v = qkv(rng, 2, 2, 37, 150, 24, Ev=40)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == (2, 2, 37, 40)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=causal), rtol=0, atol=1e-10)


def test_unbatched_and_extra_batch_dims_broadcast(rng):
    q = normal(rng, (2, 3, 4, 20, 8))
    k = normal(rng, (3, 1, 20, 8))       # broadcasts over the leading 2 and the head axis
    v = normal(rng, (1, 4, 20, 8))
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 3, 4, 20, 8)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), rtol=0, atol=1e-10)
    q2 = normal(rng, (20, 8))
    np.testing.assert_allclose(mh.scaled_dot_product_attention(q2, q2, q2),
                               reference(q2, q2, q2), rtol=0, atol=1e-10)


def test_scale_argument(rng):
    q, k, v = qkv(rng, 1, 2, 30, 30, 16)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True, scale=0.7), rtol=0,
                               atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_boolean_and_additive_masks(rng, dtype):
    q, k, v = qkv(rng, 2, 3, 70, 90, 16, dtype=dtype)
    bool_mask = rng.random((2, 1, 70, 90)) > 0.3
    out = mh.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    np.testing.assert_allclose(out, reference(q, k, v, attn_mask=bool_mask), rtol=0,
                               atol=atol_for(dtype))
    add_mask = normal(rng, (70, 90), dtype)
    out = mh.scaled_dot_product_attention(q, k, v, attn_mask=add_mask)
    np.testing.assert_allclose(out, reference(q, k, v, attn_mask=add_mask), rtol=0,
                               atol=atol_for(dtype))


def test_fully_masked_rows_give_zeros_not_nan(rng):
    q, k, v = qkv(rng, 1, 2, 10, 12, 8)
    mask = np.ones((10, 12), dtype=bool)
    mask[3] = False
    out, w = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True)
    assert np.all(out[:, :, 3] == 0) and np.all(w[:, :, 3] == 0)
    assert np.isfinite(out).all()
    float_mask = np.zeros((10, 12))
    float_mask[5] = -np.inf
    out = mh.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    assert np.all(out[:, :, 5] == 0) and np.isfinite(out).all()
    np.testing.assert_allclose(out, reference(q, k, v, attn_mask=float_mask), rtol=0, atol=1e-10)


def test_empty_key_sequence_gives_zeros(rng):
    q, k, v = qkv(rng, 1, 1, 4, 0, 8)
    out = mh.scaled_dot_product_attention(q, k, v)
    assert out.shape == (1, 1, 4, 8) and np.all(out == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_weights_match_oracle_and_rows_sum_to_one(rng, dtype):
    q, k, v = qkv(rng, 2, 2, 100, 100, 32, dtype=dtype)
    out, w = mh.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    ref_out, ref_w = reference(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(w, ref_w, rtol=0, atol=atol_for(dtype))
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=atol_for(dtype))
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=atol_for(dtype))
    assert np.all(np.triu(w[0, 0], k=1) == 0)


@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (6, 1), (4, 4)])
def test_grouped_query_attention(rng, Hq, Hkv):
    q, k, v = qkv(rng, 2, Hq, 50, 50, 16, Hkv=Hkv)
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(
        out, reference(q, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=1e-10)
    # head h uses kv head h // (Hq // Hkv): consecutive groups
    h = Hq - 1
    kv = h // (Hq // Hkv)
    one = mh.scaled_dot_product_attention(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1],
                                          is_causal=True)
    np.testing.assert_array_equal(one[:, 0], out[:, h])


@pytest.mark.parametrize("E,Hq,L", [(40, 16, 4), (8, 16, 4), (4, 32, 1), (40, 64, 1)])
def test_grouped_decode_with_many_query_rows_and_a_ragged_head_size(rng, E, Hq, L):
    # up to 64 query rows (heads x rows) share one kv head in one work item; with E
    # not a multiple of 16 their padded rows once overran the queries' scratch
    q = normal(rng, (1, Hq, L, E), np.float32)
    k, v = (normal(rng, (1, 1, 300, E), np.float32) for _ in range(2))
    out = mh.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ref = reference(q, np.repeat(k, Hq, 1), np.repeat(v, Hq, 1))
    np.testing.assert_allclose(out, ref, rtol=0, atol=atol_for(np.float32))


def test_non_contiguous_transposed_and_read_only_inputs(rng):
    packed = normal(rng, (2, 40, 3 * 4 * 16), np.float32)   # (B, T, 3*H*D), like a QKV GEMM
    q, k, v = (packed[..., i * 64:(i + 1) * 64].reshape(2, 40, 4, 16).transpose(0, 2, 1, 3)
               for i in range(3))
    assert not q.flags.c_contiguous
    for a in (q, k, v):
        a.flags.writeable = False
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), rtol=0, atol=1e-5)
    # a view whose last axis is strided, and a reversed (negative-stride) view
    q2 = np.asfortranarray(normal(rng, (30, 8)))
    kr = normal(rng, (30, 8))[::-1]
    out = mh.scaled_dot_product_attention(q2, kr, kr, is_causal=True)
    np.testing.assert_allclose(out, reference(q2, kr, kr, is_causal=True), rtol=0, atol=1e-10)
    ro = normal(rng, (1, 2, 30, 8))
    ro.flags.writeable = False
    mh.scaled_dot_product_attention(ro, ro, ro)  # must not try to write into inputs


@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_dropout_matches_oracle_stream(rng, p):
    q, k, v = qkv(rng, 2, 3, 70, 70, 16)
    out, w = mh.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, seed=7,
                                             return_weights=True)
    ref_out, ref_w = reference(q, k, v, is_causal=True, dropout_p=p, seed=7, return_weights=True)
    np.testing.assert_allclose(w, ref_w, rtol=0, atol=1e-10)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
    kept = (ref_w > 0).sum() / np.count_nonzero(np.tril(np.ones((70, 70)))) / (2 * 3)
    assert abs(kept - (1 - p)) < 0.05


def test_dropout_is_reproducible_by_seed_and_varies_without(rng):
    q, k, v = qkv(rng, 1, 2, 40, 40, 8)
    a = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=1)
    b = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=1)
    c = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_results_for_one_and_two_threads(rng, dtype):
    q, k, v = qkv(rng, 2, 5, 300, 300, 40, dtype=dtype)
    assert mh.explain(q, k, v, is_causal=True, num_threads=2).threads == TWO_THREADS  # split
    one = mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=1)
    two = mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=2)
    again = mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(two, again)


def test_set_num_threads_round_trip():
    before = mh.get_num_threads()
    try:
        mh.set_num_threads(1)
        assert mh.get_num_threads() == 1
    finally:
        mh.set_num_threads(None)
    assert mh.get_num_threads() == before


def test_inputs_are_not_modified(rng):
    q, k, v = qkv(rng, 1, 2, 20, 20, 8)
    copies = [a.copy() for a in (q, k, v)]
    mh.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2, seed=3)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


def test_misaligned_buffers_are_copied_before_the_kernels_read_them(rng):
    from manyheads._core import kernel_ready

    buf = bytearray(4 * 2 * 40 * 16 + 1)
    q = np.frombuffer(buf, dtype=np.float32, count=2 * 40 * 16, offset=1).reshape(2, 40, 16)
    q[...] = rng.standard_normal(q.shape)
    assert not q.flags.aligned
    ready = kernel_ready(q)
    assert ready.flags.aligned and ready.flags.c_contiguous
    out = mh.scaled_dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(out, reference(q, q, q, is_causal=True), rtol=0, atol=1e-5)


def _general(q, k, v, *, causal=False, scale=None, num_threads=TWO_THREADS):
    """The general path's result for a plain call (the Python layout work included)."""
    from manyheads import _core
    s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return _core.attention(q, k, v, scale=float(s), causal_offset=0 if causal else None,
                           num_threads=num_threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 12, 1, 16, 64), (2, 3, 5, 40, 24), (1, 2, 70, 30, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_calls_take_the_cython_path_with_the_general_paths_bits(rng, dtype, shape,
                                                                       causal):
    """A plain call (contiguous arrays of one float type and batch shape, no mask, weights,
    dropout or features) is planned and run by _kernels.attend_plain: the same plan and
    bits as the general path, the oracle's result, for batched, 3-D and 2-D arrays."""
    B, H, L, S, E = shape
    q, k, v = (normal(rng, (B, H, n, E), dtype) for n in (L, S, S))
    v = np.ascontiguousarray(v[..., : E - 2]) if E > 8 else v   # a narrower value width
    for lead in ((), (0,), (0, 0)):
        qq, kk, vv = q[lead], k[lead], v[lead]
        direct = _kernels.attend_plain(qq, kk, vv, None, causal, TWO_THREADS, False)
        assert direct is not None and direct.dtype == dtype
        out = mh.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                              num_threads=TWO_THREADS)
        np.testing.assert_array_equal(out, direct)
        np.testing.assert_array_equal(out, _general(qq, kk, vv, causal=causal))
        np.testing.assert_allclose(out, reference(qq, kk, vv, is_causal=causal), rtol=0,
                                   atol=atol_for(dtype))
    scaled = mh.scaled_dot_product_attention(q, k, v, scale=0.3, is_causal=causal)
    np.testing.assert_array_equal(scaled, _general(q, k, v, causal=causal, scale=0.3))


def test_calls_that_are_not_plain_take_the_general_path_and_its_checks(rng):
    """attend_plain declines (None) what it does not take, and those calls still give the
    oracle's result or the general path's error."""
    q, k, v = qkv(rng, 2, 3, 4, 9, 16, dtype=np.float32)
    t = np.ascontiguousarray(k.transpose(0, 1, 3, 2))
    declined = [
        (q, k.astype(np.float64), v, None),            # mixed types
        (q, t.transpose(0, 1, 3, 2), v, None),         # a strided view
        (q[:1], k, v, None),                           # broadcast batch
        (q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), None),
        (q, k, v, np.float32(0.5)),                    # a scale that is not a float
        (q, k, v, float("nan")),
        (q, k[..., :0, :], v[..., :0, :], None),       # no keys
        (q.tolist(), k, v, None),
    ]
    for a, b, c, s in declined:
        assert _kernels.attend_plain(a, b, c, s, False, 1, False) is None
    for threads in (0, -1, 2.0, True, np.int64(2), "2"):  # the general path explains these
        assert _kernels.attend_plain(q, k, v, None, False, threads, False) is None
    out = mh.scaled_dot_product_attention(q[:1], k, v)
    np.testing.assert_allclose(out, reference(np.broadcast_to(q[:1], q.shape), k, v),
                               rtol=0, atol=atol_for(np.float32))
    out = mh.scaled_dot_product_attention(q, t.transpose(0, 1, 3, 2), v, scale=np.float32(0.5))
    np.testing.assert_allclose(out, reference(q, k, v, scale=0.5), rtol=0,
                               atol=atol_for(np.float32))
    with pytest.raises(TypeError, match="share one dtype"):
        mh.scaled_dot_product_attention(q, k.astype(np.float64), v)
    with pytest.raises(ValueError, match="scale must be finite"):
        mh.scaled_dot_product_attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="same last dimension"):
        mh.scaled_dot_product_attention(q, k[..., :8], v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        mh.scaled_dot_product_attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="num_threads"):
        mh.scaled_dot_product_attention(q, k, v, num_threads=1.5)
