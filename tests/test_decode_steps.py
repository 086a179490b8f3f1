"""The small per-token steps of the model runner, compiled: RMSNorm and the rotary
rotation against their NumPy definitions."""
import numpy as np
import pytest

from manyheads import _core, _kernels
from manyheads.models._decoder import rms_norm


def numpy_rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 64), (3, 1)])
def test_rms_norm_matches_its_definition(rng, shape):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, numpy_rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    # a strided view takes NumPy's path: the same values
    np.testing.assert_allclose(rms_norm(x[..., ::1][..., :], w, 1e-5), got, rtol=0, atol=0)


@pytest.mark.parametrize("partial", [False, True])
def test_rotation_of_strided_heads_is_the_rotate_half_formula(rng, partial):
    """Queries as the model holds them: a (B, H, T, D) strided view of a packed projection."""
    B, H, T, D = 2, 3, 5, 16
    packed = rng.standard_normal((B, T, 2 * H * D)).astype(np.float32)
    q = packed[..., :H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
    n = D // 4 if partial else D // 2
    angles = rng.uniform(-3, 3, (T, n))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    before = q.copy()
    untouched = packed[..., H * D:].copy()
    _core.rotate(q, cos, sin)
    a, b = before[..., :n], before[..., n:2 * n]
    # (within rounding: a compiler may fuse a multiply and an add, as on aarch64)
    np.testing.assert_allclose(q[..., :n], a * cos - b * sin, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(q[..., n:2 * n], b * cos + a * sin, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(q[..., 2 * n:], before[..., 2 * n:])
    np.testing.assert_array_equal(packed[..., H * D:], untouched)


def test_silu_times_up_matches_its_definition(rng):
    """SwiGLU's act(gate) * up in one compiled pass, against float64, including where
    exp(-g) overflows (silu(g) is then -0.0, or NaN at -inf, as in float32 NumPy)."""
    F = 37
    gu = (rng.standard_normal((3, 2 * F)) * 6).astype(np.float32)
    gu[0, :8] = [-1000, -100, -88.9, -87.5, 0, 87.5, np.inf, 100]
    with np.errstate(over="ignore"):
        g = gu[:, :F].astype(np.float64)
        want = g / (1 + np.exp(-g)) * gu[:, F:]
    out = np.empty((3, F), np.float32)
    _kernels.gated_mul(gu, out)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-30)
    assert np.signbit(out[0, :3] * np.sign(gu[0, F:F + 3])).all()  # -0.0 times up
    edge = np.array([[-np.inf, np.nan, 1.0, 1.0]], np.float32)
    got = np.empty((1, 2), np.float32)
    _kernels.gated_mul(edge, got)
    assert np.isnan(got).all()  # -inf * sigmoid(-inf) and NaN: NaN, as NumPy gives


def test_gelu_tanh_times_up_matches_its_definition(rng):
    """GeGLU's gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh) in the same pass, as g *
    sigmoid(a), a = 2 sqrt(2/pi) (g + 0.044715 g^3), against the same in float64 (equal
    to the tanh form, checked where that form is accurate: below about -3 it cancels,
    and below -9 it is 0, in float64 itself).  The float32 argument is within a few ulp
    of |a| <= 88, so the result within 4 |a| 2^-24 (relative) of it, plus the vector
    exp's own error; where exp(-a) would overflow the result is -0.0 (times up), at
    -inf NaN."""
    F = 41
    gu = (rng.standard_normal((3, 2 * F)) * 3).astype(np.float32)
    gu[0, :8] = [-1e30, -10, -6.2, -5.9, 0, 5.9, np.inf, 1e30]
    g, u = gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)
        want = g / (1 + np.exp(-2 * t)) * u
        tanh_form = 0.5 * g * (1 + np.tanh(t)) * u
    mid = np.abs(g) < 3
    np.testing.assert_allclose(want[mid], tanh_form[mid], rtol=1e-12, atol=1e-300)
    out = np.empty((3, F), np.float32)
    _kernels.gated_mul(gu, out, gelu=True)
    finite = np.isfinite(want)
    a = np.minimum(np.abs(2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)), 88)
    tol = 4 * a * 2.0 ** -24 + 1e-6
    assert (np.abs(out[finite] - want[finite]) <= tol[finite] * np.abs(want[finite])
            + 1e-30).all()
    assert out[0, 0] == 0 and np.signbit(out[0, 0] * np.sign(gu[0, F]))  # -1e30: -0.0 * up
    assert out[0, 6] == np.inf * gu[0, F + 6] and out[0, 7] == np.float32(1e30) * gu[0, F + 7]
    edge = np.array([[-np.inf, np.nan, 1.0, 1.0]], np.float32)
    got = np.empty((1, 2), np.float32)
    _kernels.gated_mul(edge, got, gelu=True)
    assert np.isnan(got).all()


@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (1.0, 0.5)])
def test_clamped_swiglu_matches_transformers_gpt_oss_gate(rng, alpha, limit):
    """gpt-oss's (clip(up, -l, l) + 1) * g sigmoid(alpha g), g = min(gate, l), in one
    compiled pass, against transformers' own module in float64 where it has one (and
    the formula in float64 otherwise), including the clamps, where exp(-alpha g)
    overflows (-0.0 times up + 1) and NaN."""
    F = 43
    gu = (rng.standard_normal((3, 2 * F)) * 6).astype(np.float32)
    gu[0, :8] = [-1e30, -100, -51.8, -51.6, 0, 6.9, 7.1, np.inf]
    gu[1, F:F + 4] = [-np.inf, -7.5, 7.5, np.inf]
    g = np.minimum(gu[:, :F].astype(np.float64), limit)
    u = np.clip(gu[:, F:].astype(np.float64), -limit, limit) + 1
    with np.errstate(over="ignore"):
        want = g / (1 + np.exp(-alpha * g)) * u
    try:
        import torch
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # (the formula alone, without the test extra)
        GptOssExperts = None
    if GptOssExperts is not None:
        from types import SimpleNamespace
        cfg = SimpleNamespace(intermediate_size=F, num_local_experts=1, hidden_size=1,
                              swiglu_alpha=alpha, swiglu_limit=limit)
        inter = np.empty((3, 2 * F))  # transformers' interleaved gate, up columns
        inter[:, ::2], inter[:, 1::2] = gu[:, :F], gu[:, F:]
        ref = GptOssExperts(cfg)._apply_gate(torch.from_numpy(inter)).numpy()
        np.testing.assert_allclose(ref, want, rtol=1e-12, atol=1e-300)
    out = np.empty((3, F), np.float32)
    _kernels.clamped_gated_mul(gu, out, alpha, limit)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)
    assert out[0, 0] == 0 and np.signbit(out[0, 0])  # -1e30: -0.0 times a positive up + 1
    edge = np.array([[np.nan, 1.0, 1.0, np.nan]], np.float32)
    got = np.empty((1, 2), np.float32)
    _kernels.clamped_gated_mul(edge, got, alpha, limit)
    assert np.isnan(got).all()  # NaN gate, NaN up: NaN, as transformers' clamps keep it
    with pytest.raises(ValueError, match="clamped_gated_mul"):
        _kernels.clamped_gated_mul(np.ones((2, 6), np.float32), np.empty((2, 2), np.float32),
                                   alpha, limit)


def test_the_compiled_steps_check_their_arguments():
    with pytest.raises(ValueError, match="shapes"):
        _kernels.rms_norm_rows(np.ones((2, 3), np.float32), np.ones(4, np.float32), 1e-5,
                               np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="rotate_heads"):
        _kernels.rotate_heads(np.ones((1, 1, 2, 4), np.float32), np.ones((2, 3), np.float32),
                              np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="gated_mul"):
        _kernels.gated_mul(np.ones((2, 6), np.float32), np.empty((2, 2), np.float32))
