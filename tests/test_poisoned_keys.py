"""A NaN or inf in a key or value reaches exactly the query rows that attend to it.

A key is hidden from a query row by the causal triangle, the sliding window, a
boolean mask entry False, or an additive mask entry -inf (added to a finite
score; added to a NaN or +inf score it gives NaN, as IEEE arithmetic, PyTorch
and the oracle have it).  For every such row
the result is bit for bit the result of the same call with the key made
finite; every row that does attend to the key gets what the float64 oracle
gets (non-finite where the oracle is non-finite, equal within the usual
tolerance where it is finite).  The positions below sit on both sides of the
64-row/64-key blocks, of the register tiles inside them and of the vector
widths, so a row that shares a tile with a poisoned key it cannot see is
always among them.  tests/test_isa_paths.py runs this file on every kernel
path the CPU has.
"""
import numpy as np
import pytest

import manyheads as mh
from manyheads import _core, oracle

from conftest import atol_for, normal

BAD = [np.nan, np.inf, -np.inf]
DTYPES = [np.float32, np.float64]
# around the blocks (64), the register tiles (4-8 rows or keys) and the vectors (2-16 lanes)
POSITIONS = [0, 1, 3, 5, 6, 7, 8, 12, 31, 47, 62, 63, 64, 65, 66, 70, 71, 100, 127, 128, 129,
             150, 190, 199]


def bits(a):
    """The array's bytes as unsigned integers, so that -0.0 != 0.0 and NaN == NaN."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def assert_bit_identical(got, want, what):
    same = np.array_equal(bits(got), bits(want))
    assert same, f"{what}: {np.count_nonzero(bits(got) != bits(want))} elements differ"


def poisoned(a, j, col, value):
    b = a.copy()
    b[..., j, col] = value
    return b


def check_attending_rows(out, q, k, v, rows, what, **oracle_kw):
    """Rows `rows` (boolean over L) against the float64 oracle on the same (poisoned) inputs."""
    with np.errstate(all="ignore"):
        ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                                  v.astype(np.float64), **oracle_kw)
    got, want = out[..., rows, :], ref[..., rows, :]
    np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want), err_msg=what)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=atol_for(out.dtype),
                               err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("operand", ["key", "value"])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_causal_rows_before_a_poisoned_key_are_bit_identical(rng, dtype, operand, head_dim):
    T = 200
    q, k, v = (normal(rng, (1, 2, T, head_dim), dtype) for _ in range(3))
    clean = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    for j in POSITIONS:
        for bad in BAD:
            col = j % head_dim
            k2 = poisoned(k, j, col, bad) if operand == "key" else k
            v2 = poisoned(v, j, col, bad) if operand == "value" else v
            out = mh.scaled_dot_product_attention(q, k2, v2, is_causal=True)
            what = f"{operand}[{j}, {col}] = {bad}"
            # rows 0 .. j-1 cannot see key j
            assert_bit_identical(out[..., :j, :], clean[..., :j, :], what)
            # rows j .. T-1 attend to it
            rows = np.arange(T) >= j
            check_attending_rows(out, q, k2, v2, rows, what, is_causal=True)
            if operand == "value" and not np.isnan(bad):
                assert not np.isfinite(out[..., j:, col]).any(), what


@pytest.mark.parametrize("operand", ["key", "value"])
@pytest.mark.parametrize("window", [None, 70])
def test_bfloat16_rows_that_cannot_see_a_poisoned_key_are_bit_identical(rng, operand, window):
    # bfloat16 inputs: on a CPU with AVX512-BF16 the pair-dot path, which multiplies two
    # keys (and two values) at once
    ml_dtypes = pytest.importorskip("ml_dtypes")
    T, E = 200, 64
    q, k, v = (normal(rng, (1, 2, T, E), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=0, window=window)
    clean = _core.attention(q, k, v, **kw)
    i = np.arange(T)
    for j in POSITIONS:
        for bad in BAD:
            k2 = poisoned(k, j, j % E, bad) if operand == "key" else k
            v2 = poisoned(v, j, j % E, bad) if operand == "value" else v
            out = _core.attention(q, k2, v2, **kw)
            what = f"{operand}[{j}] = {bad}, window {window}"
            sees = (i >= j) & (i < j + (window or T))
            assert_bit_identical(out[..., ~sees, :], clean[..., ~sees, :], what)
            with np.errstate(all="ignore"):
                ref = oracle.scaled_dot_product_attention(
                    *(a.astype(np.float64) for a in (q, k2, v2)), is_causal=True, window=window)
            np.testing.assert_array_equal(~np.isfinite(out[..., sees, :].astype(np.float32)),
                                          ~np.isfinite(ref[..., sees, :]), err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [5, 64, 70])
def test_rows_whose_window_has_passed_a_poisoned_key_are_bit_identical(rng, dtype, window):
    T, E = 190, 24
    q, k, v = (normal(rng, (1, 2, T, E), dtype) for _ in range(3))
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=0, window=window)
    clean = _core.attention(q, k, v, **kw)
    for j in [0, 3, 8, 60, 63, 64, 65, 100, 128, 129]:
        for operand in ("key", "value"):
            k2 = poisoned(k, j, 5, np.nan) if operand == "key" else k
            v2 = poisoned(v, j, 5, np.inf) if operand == "value" else v
            out = _core.attention(q, k2, v2, **kw)
            what = f"{operand}[{j}] poisoned, window {window}"
            i = np.arange(T)
            sees = (i >= j) & (i < j + window)
            assert_bit_identical(out[..., ~sees, :], clean[..., ~sees, :], what)
            check_attending_rows(out, q, k2, v2, sees, what, is_causal=True, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 3, 4, 5, 150])
def test_a_padding_key_contributes_nothing_even_when_poisoned(rng, dtype, L):
    S, E = 150, 16
    q = normal(rng, (2, 2, L, E), dtype)
    k, v = normal(rng, (2, 2, S, E), dtype), normal(rng, (2, 2, S, E), dtype)
    pad = [0, 5, 63, 64, 100, 149]
    mask = np.ones((L, S), dtype=bool)
    mask[:, pad] = False  # padding: no row may attend to these keys
    clean = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for bad in BAD:
        k2, v2 = k.copy(), v.copy()
        k2[..., pad, :] = bad
        v2[..., pad, 1] = bad
        out = mh.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
        assert np.isfinite(out).all(), f"padding holding {bad} leaked"
        assert_bit_identical(out, clean, f"padding holding {bad}")


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("L", [1, 4])
def test_a_poisoned_padding_key_in_a_quantised_cache_contributes_nothing(rng, fmt, L):
    # a stored row holding NaN or inf widens to NaN (int8: its scale is NaN); the
    # kernels' skip of hidden entries must not depend on that scale
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    from manyheads.cache import quantize
    S, E = 150, 64
    q = normal(rng, (1, 2, L, E), np.float32)
    k, v = normal(rng, (1, 2, S, E), np.float32), normal(rng, (1, 2, S, E), np.float32)
    pad = [0, 37, 64, 149]
    mask = np.ones((1, 1, L, S), dtype=bool)
    mask[..., pad] = False

    def run(kk, vv):
        (kq, ks), (vq, vs) = quantize(kk, fmt), quantize(vv, fmt)
        return _core.attention(q, kq, vq, k_scale=ks, v_scale=vs, mask=mask, scale=0.125,
                               num_threads=1)

    clean = run(k, v)
    for bad in BAD:
        k2, v2 = k.copy(), v.copy()
        k2[..., pad, 3] = bad
        v2[..., pad, 5] = bad
        out = run(k2, v2)
        assert np.isfinite(out).all(), f"{fmt} padding holding {bad} leaked"
        assert_bit_identical(out, clean, f"{fmt} padding holding {bad}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [2, 4, 70])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_poisoned_key_reaches_only_the_rows_its_mask_entry_lets_through(rng, dtype, L, kind):
    S, E = 130, 12
    q = normal(rng, (1, 2, L, E), dtype)
    k, v = normal(rng, (1, 2, S, E), dtype), normal(rng, (1, 2, S, E), dtype)
    allowed = rng.random((L, S)) > 0.4
    allowed[:, 0] = True  # every row sees some key
    mask = allowed if kind == "bool" else np.where(allowed, 0.25, -np.inf).astype(dtype)
    clean = mh.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for j in [1, 7, 63, 64, 65, 129]:
        for operand in ("key", "value"):
            for bad in BAD:
                k2 = poisoned(k, j, 2, bad) if operand == "key" else k
                v2 = poisoned(v, j, 2, bad) if operand == "value" else v
                out = mh.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
                what = f"{kind} mask, {operand}[{j}] = {bad}"
                sees = allowed[:, j].copy()
                if kind == "additive" and operand == "key":
                    # an added -inf meets the NaN or infinite score by IEEE
                    # arithmetic (NaN, or +inf - inf = NaN), as in PyTorch and the
                    # oracle: only a score that stays finite is hidden by it
                    sees[:] = True
                assert_bit_identical(out[..., ~sees, :], clean[..., ~sees, :], what)
                check_attending_rows(out, q, k2, v2, sees, what, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_decode_rows_do_not_see_poisoned_keys_past_their_position(rng, dtype, split):
    # a few query rows aligned to the end of the keys (a KV cache): the last
    # keys are each hidden from the rows before them
    L, S, E = 4, 1100, 32
    q = normal(rng, (1, 3, L, E), dtype)
    k, v = normal(rng, (1, 3, S, E), dtype), normal(rng, (1, 3, S, E), dtype)
    kw = dict(scale=E ** -0.5, num_threads=2, causal_offset=S - L, split=split)
    clean = _core.attention(q, k, v, **kw)
    for j in range(S - L + 1, S):
        for operand in ("key", "value"):
            k2 = poisoned(k, j, 0, np.nan) if operand == "key" else k
            v2 = poisoned(v, j, 0, np.inf) if operand == "value" else v
            out = _core.attention(q, k2, v2, **kw)
            first = j - (S - L)  # first row that sees key j
            what = f"{operand}[{j}] poisoned, split={split}"
            assert_bit_identical(out[..., :first, :], clean[..., :first, :], what)
            rows = np.arange(L) >= first
            check_attending_rows(out, q, k2, v2, rows, what, is_causal=True,
                                 causal_offset=S - L)


def test_weights_of_rows_that_cannot_see_a_poisoned_key_are_bit_identical(rng):
    T, E = 140, 16
    q, k, v = (normal(rng, (1, 2, T, E), np.float32) for _ in range(3))
    out0, w0 = mh.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    for j in (5, 64, 66):
        k2, v2 = poisoned(k, j, 3, np.nan), poisoned(v, j, 3, np.inf)
        out, w = mh.scaled_dot_product_attention(q, k2, v2, is_causal=True, return_weights=True)
        assert_bit_identical(out[..., :j, :], out0[..., :j, :], f"output, key {j}")
        assert_bit_identical(w[..., :j, :], w0[..., :j, :], f"weights, key {j}")
        # a NaN score poisons every weight of the rows that see it
        i, key = np.arange(T)[:, None], np.arange(T)[None, :]
        assert np.isnan(w[..., (i >= j) & (key <= i)]).all()


def test_padding_tokens_holding_nan_do_not_reach_the_real_tokens(rng):
    B, T, d = 2, 70, 32
    mha = mh.MultiHeadAttention(d, d, T, 0.0, 4, dtype=np.float32, seed=0)
    x = rng.standard_normal((B, T, d)).astype(np.float32)
    pad = np.zeros((B, T), dtype=bool)
    pad[0, :5] = True      # left padding of the first prompt
    pad[1, 66:] = True     # right padding of the second
    x_nan = x.copy()
    x_nan[pad] = np.nan
    y = mha(x, key_padding_mask=pad)
    y_nan = mha(x_nan, key_padding_mask=pad)
    real = ~pad
    assert np.isfinite(y_nan[real]).all()
    assert_bit_identical(y_nan[real], y[real], "real tokens")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [3, 70])
@pytest.mark.parametrize("kind", ["causal", "bool"])
def test_dropout_keeps_a_hidden_poisoned_value_away(rng, dtype, L, kind):
    # a dropped weight of a key the row cannot see must still skip that key's value:
    # 0 times an infinite value is NaN
    S, E = L if kind == "causal" else 130, 12
    q = normal(rng, (1, 2, L, E), dtype)
    k, v = normal(rng, (1, 2, S, E), dtype), normal(rng, (1, 2, S, E), dtype)
    keys = sorted({1, L // 2, S - 1})
    if kind == "causal":
        kw, allowed = {"is_causal": True}, np.tri(L, S, dtype=bool)
    else:
        allowed = rng.random((L, S)) > 0.4
        allowed[:, 0] = True
        allowed[0, keys] = False  # (each poisoned key hidden from row 0 at least)
        kw = {"attn_mask": allowed}
    for seed in range(4):
        clean = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=seed, **kw)
        for j in keys:
            for bad in BAD:
                out = mh.scaled_dot_product_attention(q, k, poisoned(v, j, 2, bad),
                                                      dropout_p=0.5, seed=seed, **kw)
                hidden = ~allowed[:, j]
                assert hidden.any()
                assert_bit_identical(out[..., hidden, :], clean[..., hidden, :],
                                     f"{kind}, seed {seed}, value[{j}] = {bad}")
