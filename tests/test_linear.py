"""manyheads.linear: the projections' product on manyheads' threads."""
import re

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


def _stored(w, fmt):
    if fmt == "bfloat16":
        import ml_dtypes
        return w.astype(ml_dtypes.bfloat16)
    return w.astype(np.float16)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n", [(1, 15), (5, 1040), (97, 4100), (96, 20000)])
def test_half_weights_give_the_bits_of_their_widened_float32(rng, fmt, rows, k, n):
    """Few rows read float16 and bfloat16 weights in place, widening each vector as it
    loads: the same bits as the same product with the weight widened to float32 first
    (depths not a multiple of four, widths with a ragged tail, several blocks)."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = _stored(rng.standard_normal((k, n)).astype(np.float32), fmt)
    b = rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(mh.linear(x, w, b, num_threads=2),
                                  mh.linear(x, w.astype(np.float32), b, num_threads=2))


def _int8_passes_rounded(x, group):
    """x (rows, k) as the few-rows int8 product reads it: within each group of ``group``
    rows of k, each pass of 8 (starting at a multiple of 8 and inside the group, or
    ending k, then short) rounded to 16-bit integers times one scale, the pass's
    largest magnitude over 32767, unless a value is not finite or that magnitude is
    below 2^-100 but not 0; the other rows as they are."""
    k = x.shape[1]
    out = x.astype(np.float64)
    for g0 in range(0, k, group):
        g1 = min(g0 + group, k)
        kk = -(-g0 // 8) * 8
        while kk < g1 and (kk + 8 <= g1 or g1 == k):
            part = x[:, kk:kk + 8]
            with np.errstate(invalid="ignore", over="ignore"):
                m = np.abs(part).max(axis=1, keepdims=True)
                # a value not finite, or m tiny but not 0: the pass stays as it is
                ok = np.isfinite(part).all(axis=1, keepdims=True) & ((m == 0) | (m >= 2.0 ** -100))
                q = np.rint(part * (np.float32(32767) / np.where(ok & (m > 0), m, np.float32(1))))
                rounded = q * (m / np.float32(32767)).astype(np.float64)
            out[:, kk:kk + 8] = np.where(ok, rounded, part)
            kk += 8
    return out


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "int8", "int8/32", "int8/7"])
@pytest.mark.parametrize("rows", [1, 3, 5, 300])
def test_weights_in_their_own_precision_match_the_oracle(rng, fmt, rows):
    """Every stored format, few rows and more rows (a widened stripe per BLAS call), against
    float64 arithmetic on the values the weight stands for; int8 with few rows on x
    rounded as its integer passes round it."""
    k, n = 130, 1003  # a ragged column tail on every path
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w32 = rng.standard_normal((k, n)).astype(np.float32)
    xs = x.astype(np.float64)
    if fmt.startswith("int8"):
        w = mh.Int8Weight.quantize(w32, None if fmt == "int8" else int(fmt[5:]))
        values = w.dequantize()
        # quantisation error: half a step of max|w| / 127 per weight
        assert np.abs(values - w32).max() <= np.abs(w32).max() / 254 * 1.0001
        if rows <= _kernels.LINEAR_GROUPED_ROWS:  # the few-rows product, in groups
            xs = _int8_passes_rounded(x, w.group_size)
            # at most half a step of the pass's largest |x| / 32767 off
            assert np.abs(xs - x).max() <= np.abs(x).max() / 65534 * 1.0001
    else:
        w = _stored(w32, fmt)
        values = w.astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ref = xs @ values.astype(np.float64) + b
    got = mh.linear(x, w, b, num_threads=2)
    assert got.dtype == np.float32 and got.shape == (rows, n)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("group", [None, 7])
def test_int8_columns_past_the_last_whole_vector_get_the_vectors_bits(rng, group):
    """The first columns of an int8 weight give the same bits whatever the width (of
    those whose rows' sums the plan cuts along k alike: up to 8192 columns, 4096 with
    grouped scales), so the ragged tail (summed as the padded vector that holds it)
    agrees with whole vectors, special passes (inf, a tiny pass, zeros) included."""
    k, n = 45, 48
    full = mh.Int8Weight.quantize(rng.standard_normal((k, n)).astype(np.float32), group)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 5], x[1, 16:24], x[2, 24:32] = np.inf, np.float32(1e-33), 0
    b = rng.standard_normal(n).astype(np.float32)
    want = mh.linear(x, full, b)
    for width in range(1, n):
        part = mh.Int8Weight(full.data[:, :width], full.scales[:, :width], full.group_size)
        np.testing.assert_array_equal(mh.linear(x, part, b[:width]), want[:, :width])


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_int8_passes_the_integers_cannot_hold_are_added_in_floats(rng, rows):
    """A pass of x with a value that is not finite, or whose largest magnitude is tiny
    (its inverse could overflow), is added unrounded: infinities and NaNs come out as
    float arithmetic gives them, tiny inputs keep their precision; a pass of zeros adds
    nothing.  Such a row goes alone while the other rows of its group share the
    weights' loads: each row gets the bits it gets alone."""
    k, n = 40, 48
    w = mh.Int8Weight.quantize(rng.standard_normal((k, n)).astype(np.float32))
    values = w.dequantize().astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 8:16] = 0  # a pass of zeros
    x[0, 3] = np.inf
    if rows > 1:
        x[1, 20] = np.nan
        x[2, 24:32] *= np.float32(1e-33)  # tiny: added in floats, not rounded
    ref = _int8_passes_rounded(x, k)
    tiny = slice(24, 32)
    with np.errstate(invalid="ignore"):
        expected = ref @ values
    got = mh.linear(x, w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    assert np.isinf(got[0]).any() and (rows == 1 or np.isnan(got[1]).all())
    for r in range(rows):
        np.testing.assert_array_equal(got[r], mh.linear(x[r:r + 1], w)[0])
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=2e-4)
    if rows > 1:  # the tiny pass alone, at float precision
        only = np.zeros_like(x)
        only[2, tiny] = x[2, tiny]
        np.testing.assert_allclose(mh.linear(only, w)[2], x[2, tiny].astype(np.float64)
                                   @ values[tiny], rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("rows,k,n", [(1, 2048, 3000), (4, 300, 20000), (513, 200, 700)])
def test_stored_weights_give_the_same_bits_on_any_thread_count(rng, fmt, rows, k, n):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w32 = rng.standard_normal((k, n)).astype(np.float32)
    w = mh.Int8Weight.quantize(w32, 64) if fmt == "int8" else _stored(w32, fmt)
    one = mh.linear(x, w, num_threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(mh.linear(x, w, num_threads=nt), one)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [5, 8, 9, 16, 17, 32, 33])
def test_a_few_rows_more_than_one_pass_holds_run_in_groups_of_rows(rng, fmt, rows):
    """Up to 32 rows run the few-rows product on groups of up to eight rows (each
    weight vector loaded once for a group's rows): every row the bits it gets alone;
    more rows go through BLAS.  Both within float32 rounding of the
    oracle on the values the weight stands for."""
    k, n = 200, 1040
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w32 = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    if fmt == "int8":
        w = mh.Int8Weight.quantize(w32)
        values = w.dequantize()
    else:
        w = w32 if fmt == "float32" else _stored(w32, fmt)
        values = w.astype(np.float32)
    got = mh.linear(x, w, b, num_threads=2)
    plan = _kernels.explain_linear(rows, k, n, 2, weight_format=fmt)
    grouped = rows <= _kernels.LINEAR_GROUPED_ROWS
    assert grouped == (rows <= 32)
    if grouped:
        assert plan["path"] == "few rows" and plan["row_groups"] == -(-rows // 8)
        for r in range(rows):
            np.testing.assert_array_equal(got[r], mh.linear(x[r], w, b, num_threads=1))
        xs = _int8_passes_rounded(x, w.group_size) if fmt == "int8" else x
    else:
        assert plan["path"] != "few rows" and plan["row_groups"] == 1
        xs = x
    ref = xs.astype(np.float64) @ values.astype(np.float64) + b
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int8/32"])
def test_a_group_of_rows_wider_than_its_sums_goes_through_in_parts(rng, fmt):
    """Above FEW_ROWS rows a block's sums hold half as many columns a row: a block wider
    than that goes through a part of its columns at a time.  Every row keeps the bits
    it gets alone, and the product stays within rounding of the oracle."""
    rows, k, n = 7, 72, 5003
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w32 = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    if fmt.startswith("int8"):
        w = mh.Int8Weight.quantize(w32, None if fmt == "int8" else int(fmt[5:]))
        values, xs = w.dequantize(), _int8_passes_rounded(x, w.group_size)
    else:
        w = w32 if fmt == "float32" else _stored(w32, fmt)
        values, xs = w.astype(np.float32), x
    got = mh.linear(x, w, b, num_threads=2)
    assert _kernels.explain_linear(rows, k, n, 2, weight_format=fmt.split("/")[0],
                                   grouped=fmt == "int8/32")["path"] == "few rows"
    for r in range(rows):
        np.testing.assert_array_equal(got[r], mh.linear(x[r], w, b, num_threads=1))
    ref = xs.astype(np.float64) @ values.astype(np.float64) + b
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_stored_weights_are_read_in_place_from_strided_views(rng):
    import ml_dtypes
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w = rng.standard_normal((128, 300)).astype(np.float32).astype(ml_dtypes.bfloat16)[::2, 7:]
    np.testing.assert_array_equal(mh.linear(x, w), mh.linear(x, w.astype(np.float32)))


@pytest.mark.parametrize("make,exc,match", [
    (lambda: (np.ones((2, 3), np.float64), np.ones((3, 5), np.float16)), TypeError,
     "float16 weight needs float32 x"),
    (lambda: (np.ones((2, 3), np.float32), np.ones((3, 5), np.int8)), TypeError, "Int8Weight"),
    (lambda: (np.ones((2, 3), np.float32), mh.Int8Weight.quantize(np.ones((4, 5)))),
     ValueError, "weight must have shape"),
    (lambda: (np.ones((2, 3), np.float32), np.ones((3, 5), np.float16), np.ones(5)),
     TypeError, "float32 x and bias"),
])
def test_stored_weights_reject_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        mh.linear(*make())


def test_int8_weight_checks_its_parts():
    with pytest.raises(TypeError, match="int8"):
        mh.Int8Weight(np.ones((4, 5), np.float32), np.ones((1, 5), np.float32), 4)
    with pytest.raises(TypeError, match=r"scales must be a float32 array of shape \(2, 5\)"):
        mh.Int8Weight(np.ones((4, 5), np.int8), np.ones((1, 5), np.float32), 2)
    with pytest.raises(ValueError, match="group_size"):
        mh.Int8Weight.quantize(np.ones((4, 5)), 0)
    q = mh.Int8Weight.quantize(np.zeros((4, 5)))  # all-zero columns: scale 0, values 0
    # values held with the rows padded to a multiple of 8 and the columns to one of 16,
    # and 5 float32 scales
    assert not q.dequantize().any() and q.nbytes == 8 * 16 + 5 * 4


@pytest.mark.parametrize("k,n", [(1, 1), (7, 5), (13, 17), (16, 32), (130, 1000)])
def test_int8_weight_gives_back_its_values_and_columns(rng, k, n):
    """The values are held in the kernels' blocked order (short last passes, padded last
    column blocks): data and columns give them back in (k, n) order."""
    data = rng.integers(-127, 128, (k, n)).astype(np.int8)
    g = min(3, k)
    scales = rng.random((-(-k // g), n)).astype(np.float32)
    w = mh.Int8Weight(data, scales, g)
    np.testing.assert_array_equal(w.data, data)
    values = data * np.repeat(scales, g, axis=0)[:k]
    np.testing.assert_array_equal(w.dequantize(), values)
    ids = rng.integers(0, n, (3, 4))
    np.testing.assert_array_equal(w.columns(ids), values[:, ids])
    np.testing.assert_array_equal(w.columns(slice(n // 2, None, 3)), values[:, n // 2::3])
    np.testing.assert_array_equal(w.columns(n - 1), values[:, n - 1])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "int8", "int8 groups"])
def test_gather_columns_gives_the_embedding_rows_of_token_ids(rng, fmt):
    """gather_columns (a token's embedding row from a (d, vocab) table, each decoding
    step) gives columns ids of the weight's values as float32 rows, ids.shape + (d,),
    negative ids counted from the end, and IndexError for ids out of range."""
    from manyheads.weights import convert_weight, gather_columns
    k, n = 37, 50
    base = rng.standard_normal((k, n)).astype(np.float32)
    w = mh.Int8Weight.quantize(base, 8) if fmt == "int8 groups" else convert_weight(base, fmt)
    values = w.dequantize() if isinstance(w, mh.Int8Weight) else np.asarray(w, np.float32)
    for ids in (np.array([[5]]), np.array([3, -1, 0, n - 1]), rng.integers(-n, n, (2, 3)),
                np.array([4], np.uint32), np.zeros((2, 0), np.int64)):
        rows = gather_columns(w, ids)
        assert rows.dtype == np.float32 and rows.flags.c_contiguous
        np.testing.assert_array_equal(rows, np.moveaxis(values[:, ids], 0, -1))
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            gather_columns(w, np.array([0, bad]))
    # ids as a list are integers too; a mask or float ids are not ids (an int8 table read
    # a mask as the ids 0 and 1 and truncated floats)
    np.testing.assert_array_equal(gather_columns(w, [2, 4]), gather_columns(w, np.array([2, 4])))
    for bad_ids in (np.arange(n) % 2 == 0, np.array([2.9])):
        with pytest.raises(TypeError, match="ids must be integers"):
            gather_columns(w, bad_ids)
    if isinstance(w, mh.Int8Weight):  # the compiled gather checks its columns itself
        with pytest.raises(IndexError, match="out of range"):
            _kernels.gather_int8_columns(w._blocked, w._scales, k, w.group_size,
                                         np.array([0, n], np.intp), np.empty((2, k), np.float32))


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "int8"])
def test_a_module_runs_on_stored_projection_weights(rng, fmt):
    """MultiHeadAttention's W_qkv and W_out may be replaced by stored weights: the module
    is then the module with the values those weights stand for (40 rows: fewer rows of
    int8 weights also round x, as test_weights_in_their_own_precision_match_the_oracle
    checks)."""
    stored = mh.MultiHeadAttention(64, num_heads=4, num_kv_heads=2, seed=3)
    plain = mh.MultiHeadAttention(64, num_heads=4, num_kv_heads=2, seed=3)
    for name in ("W_qkv", "W_out"):
        w = getattr(stored, name)
        w = mh.Int8Weight.quantize(w) if fmt == "int8" else _stored(w, fmt)
        setattr(stored, name, w)
        setattr(plain, name, w.dequantize() if fmt == "int8" else w.astype(np.float32))
    x = rng.standard_normal((2, 20, 64)).astype(np.float32)
    np.testing.assert_allclose(stored(x), plain(x), rtol=0, atol=1e-5)
    caches = [m.new_cache(2, 12) for m in (stored, plain)]
    for m, c in zip((stored, plain), caches):
        m(x[:, :8], cache=c)
    np.testing.assert_allclose(stored(x[:, 8:9], cache=caches[0]),
                               plain(x[:, 8:9], cache=caches[1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 7])
def test_an_empty_depth_gives_the_bias(fmt, rows):
    x = np.ones((rows, 0), np.float32)
    w32 = np.ones((0, 5), np.float32)
    w = mh.Int8Weight.quantize(w32) if fmt == "int8" else (w32 if fmt == "float32"
                                                            else _stored(w32, fmt))
    b = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(mh.linear(x, w, b), np.broadcast_to(b, (rows, 5)))
    np.testing.assert_array_equal(mh.linear(x, w), np.zeros((rows, 5), np.float32))


def test_int8_weight_parts_cannot_be_swapped_after_construction(rng):
    """The kernels trust that an Int8Weight's values, scales and group size agree."""
    w = mh.Int8Weight.quantize(rng.standard_normal((64, 32)), 16)
    for name, value in (("group_size", 1), ("data", np.ones((64, 64), np.int8)),
                        ("scales", np.ones((1, 1), np.float32))):
        with pytest.raises(AttributeError):
            setattr(w, name, value)


def test_quantize_takes_bfloat16():
    import ml_dtypes
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    q = mh.Int8Weight.quantize(w.astype(ml_dtypes.bfloat16))
    np.testing.assert_allclose(q.dequantize(), w.astype(ml_dtypes.bfloat16).astype(np.float32),
                               rtol=0, atol=1 / 254 + 1e-6)


def test_a_weight_in_the_other_byte_order_is_refused(rng):
    x = rng.standard_normal((1, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="byte order"):
        mh.linear(x, np.ones((8, 3), ">f2"))


def test_array_like_weights_are_read_as_before():
    out = mh.linear(np.ones((1, 2)), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(out, [[4.0, 6.0]])


@pytest.mark.parametrize("rows", [2, 8])
def test_stored_weights_under_float64_inputs_are_widened(rng, rows):
    """The core (which modules call) widens a stored weight for float64 inputs."""
    from manyheads import _core
    x = rng.standard_normal((rows, 40))
    w = rng.standard_normal((40, 30)).astype(np.float16)
    got = _core.linear(x, w, None, 2)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, x @ w.astype(np.float64), rtol=0, atol=1e-12)


def test_few_rows_run_on_a_thread_with_a_small_stack():
    """A few-rows block keeps its sums on the stack (128 KiB): a thread started with
    threading.stack_size(256 KiB) runs every weight format (in a child process, so a
    crash would fail the test instead of the run).  The plain build needs less than
    144 KiB; under AddressSanitizer (tools/sanitize.sh preloads it) each inlined copy
    of the block's sums has a stack slot of its own, more than 512 KiB in all, and the
    thread gets 1 MiB."""
    import os
    import subprocess
    import sys
    kib = 1024 if "libasan" in os.environ.get("LD_PRELOAD", "") else 256
    code = """
import threading, numpy as np, manyheads as mh
def work():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = rng.standard_normal((256, 40000)).astype(np.float32)
    for weight in (w, w.astype(np.float16), mh.Int8Weight.quantize(w),
                   mh.Int8Weight.quantize(w, 32)):
        assert np.isfinite(mh.linear(x, weight)).all()
    print("ok")
threading.stack_size(%d * 1024)
t = threading.Thread(target=work)
t.start(); t.join()
"""
    res = subprocess.run([sys.executable, "-c", code % kib], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("widths", [(32, 16, 5), (5, 32), (16,)])
def test_join_columns_joins_int8_weights_in_their_order(rng, widths):
    """Joined int8 weights (q, k and v side by side) hold each part's values and scales:
    passes side by side when the parts fill whole column blocks, else through (k, n)."""
    from manyheads.weights import join_columns
    k = 21  # a short last pass
    parts = [mh.Int8Weight.quantize(rng.standard_normal((k, n)), 8) for n in widths]
    joined = join_columns(parts)
    assert joined.shape == (k, sum(widths)) and joined.group_size == 8
    np.testing.assert_array_equal(joined.data, np.concatenate([p.data for p in parts], axis=1))
    np.testing.assert_array_equal(joined.dequantize(),
                                  np.concatenate([p.dequantize() for p in parts], axis=1))
    x = rng.standard_normal((2, k)).astype(np.float32)
    np.testing.assert_array_equal(mh.linear(x, joined),
                                  np.concatenate([mh.linear(x, p) for p in parts], axis=1))


def test_join_columns_widens_mixed_float_formats_and_refuses_int8_with_floats(rng):
    from manyheads.weights import join_columns
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = rng.standard_normal((6, 3)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((6, 2)).astype(np.float16)
    joined = join_columns([a, b])
    assert joined.dtype == np.float32
    np.testing.assert_array_equal(joined, np.concatenate([a.astype(np.float32),
                                                          b.astype(np.float32)], axis=1))
    assert join_columns([a, a]).dtype == ml_dtypes.bfloat16
    assert join_columns([b, np.ones((6, 1))]).dtype == np.float64
    with pytest.raises(TypeError, match="int8"):
        join_columns([mh.Int8Weight.quantize(rng.standard_normal((6, 3))), b])
    with pytest.raises(ValueError, match="at least one weight"):
        join_columns([])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
def test_a_group_size_is_refused_for_a_float_format(rng, fmt):
    """group_size means int8 groups; a float format has no scales to group."""
    pytest.importorskip("ml_dtypes")
    from manyheads.weights import convert_weight
    with pytest.raises(ValueError, match="group_size applies to int8 weights only"):
        convert_weight(rng.standard_normal((8, 3)), fmt, group_size=2)
    assert convert_weight(np.ones((8, 3)), "int8", group_size=2).group_size == 2


@pytest.mark.parametrize("fmt", ["float32", "float64", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_plain_few_row_call_gives_the_general_paths_bits(rng, fmt, lead, with_bias):
    """A call of C-contiguous arrays of up to four rows is checked and set up in Cython
    (_kernels.linear_plain), without the Python layout work of the general path; the
    same call with x as a strided view takes the general path: both give the same bits,
    for every weight format."""
    from manyheads.weights import convert_weight
    k, n = 200, 300
    dtype = np.float64 if fmt == "float64" else np.float32
    base = rng.standard_normal((k, n))
    w = base.astype(dtype) if fmt in ("float32", "float64") else convert_weight(
        base.astype(np.float32), fmt, 64 if fmt == "int8" else None)
    x = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if with_bias else None
    wide = np.zeros(lead + (2 * k,), dtype)
    wide[..., ::2] = x
    strided = wide[..., ::2]  # the same values, not C-contiguous
    assert _kernels.linear_plain(strided, w, b, 2) is None
    plain = _kernels.linear_plain(x, w, b, 2)
    assert plain is not None and plain.shape == lead + (n,) and plain.dtype == dtype
    general = mh.linear(strided, w, b, num_threads=2)
    np.testing.assert_array_equal(plain, general)
    np.testing.assert_array_equal(mh.linear(x, w, b, num_threads=1), general)
    dense = w.astype(np.float64) if isinstance(w, np.ndarray) else w.dequantize()
    ref = x.astype(np.float64) @ np.asarray(dense, np.float64) + (0 if b is None else b)
    np.testing.assert_allclose(plain, ref, rtol=0, atol=1e-3 if dtype == np.float32 else 1e-10)


@pytest.mark.parametrize("case", ["rows", "dtype", "shape", "bias", "weight", "threads"])
def test_a_call_that_is_not_plain_goes_to_the_general_path(rng, case):
    """linear_plain declines (None) whatever it does not take, and the general path then
    answers: more than four rows, mixed dtypes, mismatched shapes, a bias of another
    shape, a weight that is not an array or Int8Weight, a bad thread count."""
    x = rng.standard_normal((1, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    args = {"rows": (np.ones((5, 8), np.float32), w, None, 2),
            "dtype": (x, w.astype(np.float64), None, 2),
            "shape": (x, np.ones((9, 3), np.float32), None, 2),
            "bias": (x, w, np.ones(4, np.float32), 2),
            "weight": (x.astype(np.float64), w.tolist(), None, 2),
            "threads": (x, w, None, 0)}[case]
    assert _kernels.linear_plain(*args) is None
    if case == "rows":
        np.testing.assert_allclose(mh.linear(*args[:3]), np.ones((5, 8)) @ w, rtol=1e-5)
    elif case == "weight":
        np.testing.assert_allclose(mh.linear(*args[:3]), x.astype(np.float64) @ w, rtol=1e-5)
    elif case == "threads":
        with pytest.raises(ValueError, match="num_threads"):
            mh.linear(*args[:3], num_threads=0)
    else:
        with pytest.raises((TypeError, ValueError)):
            mh.linear(*args[:3])


@pytest.mark.parametrize("group", [None, 8])
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_int8_weights_take_inputs_near_float32s_largest(rng, rows, group):
    """int8 weights sum x times their int8 values and apply the scales after each group:
    those sums reach 127 times the weights', so an x within a factor 128 k of float32's
    largest is scaled by a power of two first. The product of x up to 3e38 with weights
    that keep it finite is the float64 one within float32 rounding (it was inf for up
    to 16 rows) within what its rounding of x to 16-bit integers per pass of eight rows
    (half a step of the largest / 32767) and float32's rounding allow, the bias added."""
    k, n = 40, 24
    w = mh.Int8Weight.quantize((rng.standard_normal((k, n)) * 1e-3).astype(np.float32), group)
    wd = w.dequantize().astype(np.float64)
    bias = rng.standard_normal(n).astype(np.float32)
    for size in (1e36, 1e37, 3e38):
        x = (rng.uniform(-1, 1, (rows, k)) * size).astype(np.float32)
        x[:, 3] = 1e-20  # (a value that becomes subnormal when x is scaled)
        got = mh.linear(x, w, bias)
        want = x.astype(np.float64) @ wd + bias
        ax = np.abs(x).astype(np.float64)
        bound = ax.max(axis=1, keepdims=True) / 65534 * np.abs(wd).sum(axis=0) \
            + 64 * np.finfo(np.float32).eps * (ax @ np.abs(wd))
        assert np.isfinite(got).all()
        assert np.all(np.abs(got - want) <= bound + 1e-6)


def test_int8_quantize_keeps_tiny_weights_within_half_a_step():
    """A column whose largest magnitude is below about 4e-37 has a scale whose inverse is
    inf: its values are divided by the scale instead (every nonzero one came back as
    +-127 times it), and each comes back within half a stored step."""
    col = np.array([1e-38, 5e-39, -2e-39, 0.0, 3e-45], np.float32)
    w = np.stack([col, col * np.float32(1e3), col * np.float32(1e-3)], axis=1)
    q = mh.Int8Weight.quantize(w)
    back = q.dequantize().astype(np.float64)
    tiny = np.float64(np.finfo(np.float32).smallest_subnormal)
    # (within float32's rounding of w times the scale's inverse, as for ordinary weights)
    slack = 2 * np.finfo(np.float32).eps * np.abs(w) + tiny
    assert np.all(np.abs(back - w) <= q.scales.astype(np.float64) / 2 + slack)
    assert list(q.data[:, 0]) == [127, 63, -25, 0, 0]


@pytest.mark.parametrize("fmt, bad, fits", [("float16", 7e4, 65519.0),
                                            ("bfloat16", 3.3962e38, 3.3961e38),
                                            ("int8", np.nan, 3e38), ("int8", -np.inf, -3e38)])
def test_a_weight_refuses_values_its_format_would_not_stand_for(rng, fmt, bad, fits):
    """A finite value that would round to inf in float16 or bfloat16, or a NaN or inf in
    an int8 weight (its scale would make its whole column NaN): a ValueError naming the
    value, from convert_weight, Int8Weight.quantize and a checkpoint's projection (its
    tensor named), where they were stored silently. What the format holds is stored."""
    from manyheads.models._checkpoint import ArrayTensors
    from manyheads.weights import convert_weight

    w = rng.standard_normal((6, 40)).astype(np.float32)
    w[3, 17] = bad
    said = "needs finite values" if fmt == "int8" else f"has one of {abs(bad):g}, which"
    said = re.escape(said)
    with pytest.raises(ValueError, match=said):
        convert_weight(w, fmt)
    if fmt == "int8":
        with pytest.raises(ValueError, match=said):
            mh.Int8Weight.quantize(w, 2)
    with pytest.raises(ValueError, match="tensor 'p'"):
        ArrayTensors({"p": w.T.copy()}, fmt).linear("p", 6, 40)
    w[3, 17] = fits
    stored = convert_weight(w, fmt)
    back = stored.dequantize() if fmt == "int8" else np.asarray(stored, np.float32)
    assert np.isfinite(back).all()
    got = ArrayTensors({"p": w.T.copy()}, fmt).linear("p", 6, 40)
    np.testing.assert_array_equal(got.dequantize() if fmt == "int8" else got, back)


def test_an_int8_weight_refuses_float64_values_beyond_float32s_range(rng):
    # its scales are float32: a finite float64 value past float32's largest would make
    # its column's scale inf and every value of the column NaN
    from manyheads.weights import convert_weight

    w = rng.standard_normal((6, 4))
    w[2, 1] = 1e39
    with pytest.raises(ValueError, match="1e\\+39, beyond float32's range"):
        convert_weight(w, "int8")
    with pytest.raises(ValueError, match="beyond float32's range"):
        mh.Int8Weight.quantize(w, 2)
    w[2, 1] = 3.4e38  # (float32 holds it)
    back = convert_weight(w, "int8").dequantize()
    assert np.isfinite(back).all()
    np.testing.assert_allclose(back[:, 1], w[:, 1], rtol=0, atol=3.4e38 / 127 / 2 * 1.0001)


def test_int8_quantize_of_float32s_largest_reads_back_finite():
    # (its scale, max / 127, rounded up: 127 times it was inf)
    big = np.finfo(np.float32).max
    w = np.array([[big, 1.0], [0.0, 1.0]], np.float32)
    q = mh.Int8Weight.quantize(w)
    assert np.isfinite(q.dequantize()).all()
    y = mh.linear(np.array([[1.0, 0.0]], np.float32), q)
    assert np.isfinite(y).all() and y[0, 0] >= big * (1 - 2 ** -7)


@pytest.mark.parametrize("dtype", [np.dtype("float16"), np.float16, "float 16"])
def test_a_weight_dtype_is_a_string(dtype):
    with pytest.raises(ValueError, match="weight dtype must be one of .* \\(a string\\)"):
        mh.weights.convert_weight(np.ones((2, 2), np.float32), dtype)
