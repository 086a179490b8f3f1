"""Every bad input raises a clear ValueError/TypeError naming the argument, before any kernel."""
import numpy as np
import pytest

import manyheads as mh

sdpa = mh.scaled_dot_product_attention


def arr(*shape, dtype=np.float32):
    return np.ones(shape, dtype=dtype)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(query=arr(4), key=arr(4, 8), value=arr(4, 8)), ValueError, "query"),
    (dict(query=arr(1, 4, 8), key=arr(1, 4, 7), value=arr(1, 4, 8)), ValueError, "last dimension"),
    (dict(query=arr(1, 4, 8), key=arr(1, 5, 8), value=arr(1, 4, 8)), ValueError, "key and value"),
    (dict(query=arr(2, 4, 8), key=arr(3, 4, 8), value=arr(3, 4, 8)), ValueError, "broadcast"),
    (dict(query=arr(4, 8, dtype=np.float16), key=arr(4, 8), value=arr(4, 8)), TypeError,
     "one dtype"),
    (dict(query=arr(4, 8, dtype=np.int16), key=arr(4, 8), value=arr(4, 8)), TypeError,
     "float32, float64, float16 or ml_dtypes.bfloat16"),
    (dict(query=arr(4, 8), key=arr(4, 8, dtype=np.float64), value=arr(4, 8)), TypeError,
     "one dtype"),
    (dict(query=arr(4, 8).astype(np.complex64), key=arr(4, 8), value=arr(4, 8)), TypeError,
     "query"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), attn_mask=np.ones((4, 4), bool),
          is_causal=True), ValueError, "not both"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), attn_mask=np.ones((4, 4), np.int32)),
     TypeError, "attn_mask"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), attn_mask=np.ones((3, 4), bool)),
     ValueError, "attn_mask"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), dropout_p=-0.1), ValueError,
     "dropout_p"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), dropout_p=1.5), ValueError,
     "dropout_p"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), scale=float("nan")), ValueError,
     "scale"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), scale="big"), TypeError, "scale"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), num_threads=0), ValueError,
     "num_threads"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), num_threads=2.0), TypeError,
     "num_threads"),
    (dict(query=arr(1, 6, 4, 8), key=arr(1, 4, 4, 8), value=arr(1, 4, 4, 8), enable_gqa=True),
     ValueError, "multiple"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), enable_gqa=True), ValueError,
     "head axis"),
    (dict(query=arr(4, 0), key=arr(4, 0), value=arr(4, 8)), ValueError, "at least 1"),
    (dict(query=None, key=arr(4, 8), value=arr(4, 8)), TypeError, "query"),
    (dict(query=arr(4, 8), key=arr(4, 8), value=arr(4, 8), seed=1.5, dropout_p=0.5), TypeError,
     "seed"),
])
def test_functional_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sdpa(**kwargs)


@pytest.mark.parametrize("ctor,exc,match", [
    (lambda: mh.MultiHeadAttention(8, 10, 16, 0.0, 3), ValueError, "divisible by num_heads"),
    (lambda: mh.StackedMultiHeadAttention(8, 10, 16, 0.0, 4), ValueError, "divisible"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, -0.1, 3), ValueError, "dropout"),
    (lambda: mh.CausalAttention(8, 4, 16, dropout=2.0), ValueError, "dropout"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, 0.0, 0), ValueError, "num_heads"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, 0.0, 3.0), TypeError, "num_heads"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, 0.0, 4, num_kv_heads=3), ValueError,
     "num_kv_heads"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, 0.0, 3, dtype=np.float16), TypeError,
     "float32 or float64"),
    (lambda: mh.CausalAttention(0, 4, 16), ValueError, "d_in"),
    (lambda: mh.CausalAttention(8, 4, 0), ValueError, "context_length"),
    # a num_heads in the fifth place would have been taken as qkv_bias=True
    (lambda: mh.CausalAttention(8, 4, 16, 0.0, 4), TypeError,
     r"qkv_bias must be a bool, got 4 \(CausalAttention is one head .* no num_heads\)"),
    (lambda: mh.MultiHeadAttention(8, 12, 16, 0.0, 3, "yes"), TypeError,
     "qkv_bias must be a bool, got 'yes'$"),
])
def test_constructors_reject_bad_arguments(ctor, exc, match):
    with pytest.raises(exc, match=match):
        ctor()


@pytest.fixture(params=["fused", "stacked", "single"])
def module(request):
    if request.param == "fused":
        return mh.MultiHeadAttention(8, 12, 16, 0.0, 3, seed=0)
    if request.param == "stacked":
        return mh.StackedMultiHeadAttention(8, 12, 16, 0.0, 3, seed=0)
    return mh.CausalAttention(8, 12, 16, seed=0)


@pytest.mark.parametrize("x,exc,match", [
    (np.ones((17, 8), np.float32), ValueError, "context_length"),
    (np.ones((2, 4, 7), np.float32), ValueError, "d_in"),
    (np.ones((8,), np.float32), ValueError, "shape"),
    (np.ones((1, 1, 4, 8), np.float32), ValueError, "shape"),
    (np.ones((4, 8), np.int64), TypeError, "float32 or float64"),
    (np.ones((4, 8), np.float16), TypeError, "float32 or float64"),
])
def test_modules_reject_bad_input(module, x, exc, match):
    with pytest.raises(exc, match=match):
        module(x)


def test_modules_reject_bad_thread_count_and_training_flag(module):
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="num_threads"):
        module(x, num_threads=-1)
    with pytest.raises(TypeError, match="training"):
        module(x, training="yes")


def test_set_num_threads_rejects_bad_values():
    with pytest.raises(ValueError):
        mh.set_num_threads(0)
    with pytest.raises(TypeError):
        mh.set_num_threads("2")


def test_to_stacked_refuses_grouped_query_modules():
    m = mh.MultiHeadAttention(8, 12, 16, 0.0, 4, num_kv_heads=2, dtype=np.float64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        m.to_stacked()


def test_half_precision_array_likes_are_accepted_as_arrays_are():
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float16)
    want = mh.scaled_dot_product_attention(x, x, x)
    got = mh.scaled_dot_product_attention(list(x), list(x), x)  # lists of float16 rows
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="has dtype complex64; supported dtypes are float32"):
        mh.scaled_dot_product_attention(x.astype(np.complex64), x, x)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_arrays_in_the_other_byte_order_are_refused_not_misread(dtype):
    from manyheads.cache import FORMATS

    dt = np.dtype(FORMATS[dtype].dtype if dtype == "bfloat16" else dtype)
    swapped = dt.newbyteorder("S")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(dt)
    with pytest.raises(TypeError, match=r"key has dtype .*, not in the machine's byte order"):
        mh.scaled_dot_product_attention(x, x.astype(swapped), x)
    if dtype in ("float32", "float64"):
        with pytest.raises(TypeError, match="x has dtype .*, not in the machine's byte order"):
            mh.linear(x.astype(swapped), np.ones((8, 4), dt))
        m = mh.MultiHeadAttention(8, 8, 3, 0.0, 2, dtype=dt)
        with pytest.raises(TypeError, match="not in the machine's byte order"):
            m(x.astype(swapped))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_float_mask_in_the_other_byte_order_is_converted(dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    mask = np.where(rng.random((5, 5)) > 0.3, 0.0, -np.inf).astype(dtype)
    mask[:, 0] = 0.0
    want = mh.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    swapped = mask.astype(mask.dtype.newbyteorder("S"))
    np.testing.assert_array_equal(mh.scaled_dot_product_attention(x, x, x, attn_mask=swapped),
                                  want)


def test_a_weight_or_bias_assigned_with_another_shape_is_refused_before_any_kernel(rng):
    """nn.Linear's weight is (out, in): copied without .T into a module it had been taken,
    and the products read past the array."""
    x = rng.standard_normal((1, 4, 3)).astype(np.float32)
    m = mh.CausalAttention(3, 2, 8, 0.0, qkv_bias=True)
    m.W_query = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"a weight of shape \(2, 3\) and a bias of shape "
                                         r"\(2,\) cannot take rows of 3 features"):
        m(x)
    m = mh.MultiHeadAttention(3, 4, 8, 0.0, 2)
    m.W_out = np.zeros((4, 3), np.float32)  # (d_out, d_out) wanted
    with pytest.raises(ValueError, match=r"a weight of shape \(4, 3\).* cannot take rows of 4"):
        m(x)
    m = mh.MultiHeadAttention(3, 4, 8, 0.0, 2)
    m.b_out = np.zeros(5, np.float32)
    for rows in (x, x[:, :1]):  # (more rows than the few-rows path's, and one)
        with pytest.raises(ValueError, match=r"a bias of shape \(5,\)"):
            m(rows)


def test_the_fused_modules_biases_are_written_into_the_packed_buffer(rng):
    m = mh.MultiHeadAttention(3, 4, 8, 0.0, 2, qkv_bias=True)
    m.b_query = np.arange(4, dtype=np.float32)
    assert np.array_equal(m.b_qkv[:4], np.arange(4)) and "b_query" not in vars(m)
    bare = mh.MultiHeadAttention(3, 4, 8, 0.0, 2)
    with pytest.raises(ValueError, match="no query, key and value biases .* b_value cannot "
                                         "be set"):
        bare.b_value = np.zeros(4, np.float32)


def test_a_heads_biases_follow_qkv_bias(rng, tmp_path):
    # (a bias set on a head made without them was used by the forward pass and dropped
    # by save: the saved module then gave other outputs)
    bare = mh.CausalAttention(3, 4, 8)
    with pytest.raises(ValueError, match="no query, key and value biases .* b_value cannot "
                                         "be set"):
        bare.b_value = np.ones(4, np.float32)
    assert bare.b_value is None
    head = mh.CausalAttention(3, 4, 8, 0.0, True, seed=1)
    with pytest.raises(ValueError, match="b_key cannot be removed"):
        head.b_key = None
    head.b_value = np.full(4, 0.5, np.float32)
    x = rng.standard_normal((1, 5, 3)).astype(np.float32)
    head.save(tmp_path / "head.npz")
    np.testing.assert_array_equal(mh.CausalAttention.load(tmp_path / "head.npz")(x), head(x))


@pytest.mark.parametrize("name, bad", [
    ("W_qkv", lambda w: w.astype(np.float64)),     # read as float32: past its end
    ("W_qkv", lambda w: (w * 10).astype(np.int8)),
    ("W_out", lambda w: w.tolist()),
    ("b_qkv", lambda b: b.astype(np.float16)),
    ("b_out", lambda b: b.astype(np.float64)),
])
def test_a_module_weight_of_another_type_is_refused_before_the_kernels(rng, name, bad):
    m = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True, seed=0)
    setattr(m, name, bad(getattr(m, name)))
    x = rng.standard_normal((1, 5, 8)).astype(np.float32)
    for rows in (x, x[:, :1]):
        with pytest.raises(TypeError, match=r"(a weight|a bias) of .* cannot (take|be added "
                                            r"to) float32 rows|weight must be an ndarray of "
                                            r"float32, float64, float16 or ml_dtypes.bfloat16, "
                                            r"or an Int8Weight; got (ndarray of dtype int8|list)"):
            m(rows)


def test_a_module_holding_stored_weights_says_what_it_cannot_do(rng, tmp_path):
    m = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, seed=0)
    x = rng.standard_normal((1, 5, 8)).astype(np.float32)
    m.W_qkv = mh.Int8Weight.quantize(m.W_qkv)
    assert m(x).shape == (1, 5, 8)  # (the products read it)
    with pytest.raises(TypeError, match="take columns of W_qkv, of type Int8Weight"):
        m.W_query
    with pytest.raises(TypeError, match="take columns of W_qkv"):
        m(x, x, x)  # cross-attention
    with pytest.raises(ValueError, match=r"save\(\) writes float16, float32 or float64 "
                                         "arrays; W_qkv is Int8Weight"):
        m.save(tmp_path / "m.npz")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    h = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, seed=0)
    h.W_out = h.W_out.astype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="W_out is bfloat16: widen it first"):
        h.save(tmp_path / "h.npz")
