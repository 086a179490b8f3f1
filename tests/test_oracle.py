"""The oracle itself: textbook facts on tiny hand-checkable inputs."""
import numpy as np

from manyheads import oracle


def test_softmax_rows_sum_to_one_and_masked_rows_are_zero():
    s = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    w = oracle.softmax(s)
    np.testing.assert_allclose(w[0], np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum())
    np.testing.assert_array_equal(w[1], 0)
    np.testing.assert_allclose(w[2], [0.5, 0, 0.5])


def test_first_token_attends_only_to_itself_and_last_sees_all():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4))
    Wq, Wk, Wv = (rng.standard_normal((4, 3)) for _ in range(3))
    ctx, w = oracle.causal_attention_head(x, Wq, Wk, Wv, return_weights=True)
    np.testing.assert_allclose(ctx[0], x[0] @ Wv)          # weight 1 on itself
    assert np.all(np.triu(w, 1) == 0) and np.all(w[-1] > 0)
    # the hand-written formula for the last token
    q, k, v = x[-1] @ Wq, x @ Wk, x @ Wv
    s = k @ q / np.sqrt(3)
    e = np.exp(s - s.max())
    np.testing.assert_allclose(ctx[-1], (e / e.sum()) @ v)


def test_sdpa_reference_agrees_with_head_by_head_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 4))
    heads = [tuple(rng.standard_normal((4, 2)) for _ in range(3)) for _ in range(3)]
    Z = oracle.stacked_multi_head_attention(x, heads)
    q = np.stack([x @ h[0] for h in heads], axis=1)
    k = np.stack([x @ h[1] for h in heads], axis=1)
    v = np.stack([x @ h[2] for h in heads], axis=1)
    out = oracle.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3).reshape(2, 6, 6), Z)


def test_dropout_keep_mask_rate_and_determinism():
    a = oracle.dropout_keep_mask(5, (4, 50, 50), 0.25)
    b = oracle.dropout_keep_mask(5, (4, 50, 50), 0.25)
    np.testing.assert_array_equal(a, b)
    assert abs(a.mean() - 0.75) < 0.02
