"""manyheads.torch: the kernels on torch tensors, read and written in place, as a torch.library
operator that torch.compile traces (runs when torch is installed: the test extra pins it)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
mht = pytest.importorskip("manyheads.torch")
import manyheads as mh  # noqa: E402
import manyheads._core as core  # noqa: E402
from manyheads import _kernels  # noqa: E402

F = torch.nn.functional
OPS = torch.ops.manyheads

# half precision computes in float32 and rounds the output once; torch's reference is
# computed in float32 from the same half inputs, then rounded the same way; float32
# results are held to torch's float64 result (reference)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3,
             torch.bfloat16: 1.6e-2}


def tensors(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def reference(q, k, v, **kw):
    """torch's own SDPA on the same values, rounded to the input dtype: in float64 for
    float32 (and float64) inputs, in float32 for half ones.  (Two float32 computations
    differ by up to the sum of their errors: against torch's float32 result, 3000 random
    calls of test_random_calls_equal_torch_sdpa reached 1.13e-5, with manyheads 4.8e-6
    and torch 6.4e-6 from the exact result; against float64 the worst was 7.0e-6.)"""
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else torch.float64
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw = {**kw, "attn_mask": mask.to(wide)}
    out = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide), **kw)
    return out.to(q.dtype)


def assert_close(ours, theirs):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    diff = (ours.double() - theirs.double()).abs().max().item()
    assert diff <= TOLERANCE[ours.dtype], diff


def _spy_direct(monkeypatch, record):
    """Wrap the direct path (``_kernels.attend_heads``): ``record(q, k, v, out)`` for each
    call it takes, with the arrays as handed to the kernels."""
    original = _kernels.attend_heads

    def spy(q, k, v, out, *args):
        done = original(q, k, v, out, *args)
        if done:
            record(q, k, v, out)
        return done

    monkeypatch.setattr(_kernels, "attend_heads", spy)


@pytest.fixture
def direct_calls(monkeypatch):
    """The calls the direct path took: (query, key, value, out) as handed to the kernels."""
    taken = []
    _spy_direct(monkeypatch, lambda *arrays: taken.append(arrays))
    return taken


@pytest.fixture
def kernel_reads(monkeypatch):
    """Every operand handed to the kernels, as (address given, address kept): a copy
    would keep a different address (the direct path hands the tensors' own views)."""
    seen = []
    original = core.kernel_ready

    def spy(arr, contiguous_rows=True):
        kept = original(arr, contiguous_rows)
        seen.append((arr.ctypes.data, kept.ctypes.data))
        return kept

    monkeypatch.setattr(core, "kernel_ready", spy)
    _spy_direct(monkeypatch, lambda *arrays: seen.extend(
        (a.ctypes.data, a.ctypes.data) for a in arrays[:3]))
    return seen


@pytest.fixture
def kernel_outputs(monkeypatch):
    """The output array of every call: the core's result, or the direct path's out."""
    outs = []
    original = core.attention

    def spy(*args, **kw):
        res = original(*args, **kw)
        outs.append(res[0] if isinstance(res, tuple) else res)
        return res

    monkeypatch.setattr(core, "attention", spy)
    _spy_direct(monkeypatch, lambda *arrays: outs.append(arrays[3]))
    return outs


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3, "enable_gqa": True}],
                         ids=["plain", "causal", "scale-gqa"])
def test_equals_torch_sdpa_in_every_dtype(dtype, kw):
    q, k, v = tensors((2, 4, 17, 16), (2, 2 if kw.get("enable_gqa") else 4, 17, 16),
                      (2, 2 if kw.get("enable_gqa") else 4, 17, 24), dtype=dtype)
    out = mht.scaled_dot_product_attention(q, k, v, **kw)
    assert_close(out, reference(q, k, v, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_boolean_and_additive_masks_follow_torch(dtype):
    q, k, v = tensors((2, 4, 9, 16), (2, 4, 13, 16), (2, 4, 13, 16), dtype=dtype)
    allowed = torch.rand(2, 1, 9, 13, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True  # torch gives NaN for a row that sees no key
    additive = tensors((9, 13), dtype=dtype, seed=2)[0]
    for mask in (allowed, additive):
        out = mht.scaled_dot_product_attention(q, k, v, mask)
        assert_close(out, reference(q, k, v, attn_mask=mask.to(torch.float32)
                                    if mask.is_floating_point() else mask))


def test_a_row_that_sees_no_key_is_zero_not_nan():
    q, k, v = tensors((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out = mht.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_strided_views_of_a_packed_projection_are_read_in_place(dtype, kernel_reads):
    B, T, H, Hkv, D = 2, 11, 4, 2, 16
    packed = tensors((B, T, (H + 2 * Hkv) * D), dtype=dtype)[0]
    q, k, v = packed.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = (x.unflatten(-1, (-1, D)).transpose(1, 2) for x in (q, k, v))
    assert not q.is_contiguous() and not k.is_contiguous()
    out = mht.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = reference(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True,
                         enable_gqa=True)
    assert_close(out, expected)
    given = {a for a, _ in kernel_reads}
    assert all(a == kept for a, kept in kernel_reads), "an operand was copied"
    assert {q.data_ptr(), k.data_ptr(), v.data_ptr()} <= given


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_is_the_memory_the_kernels_wrote(dtype, kernel_outputs):
    q, k, v = tensors((1, 3, 5, 8), (1, 3, 5, 8), (1, 3, 5, 8), dtype=dtype)
    out = mht.scaled_dot_product_attention(q, k, v)
    assert out.dtype == dtype
    assert out.data_ptr() == kernel_outputs[-1].ctypes.data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transpose_out_is_written_in_the_token_major_layout(dtype, kernel_outputs):
    q, k, v = tensors((2, 6, 7, 16), (2, 3, 7, 16), (2, 3, 7, 16), dtype=dtype)
    out = mht.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                           transpose_out=True)
    assert out.shape == (2, 7, 6, 16) and out.is_contiguous()
    assert out.data_ptr() == kernel_outputs[-1].ctypes.data  # written there, not moved
    assert_close(out.transpose(1, 2),
                 reference(q, k, v, is_causal=True, enable_gqa=True))
    assert out.flatten(-2).data_ptr() == out.data_ptr()


def test_an_expanded_mask_is_read_through_its_zero_strides(kernel_reads):
    q, k, v = tensors((3, 2, 4, 8), (3, 2, 6, 8), (3, 2, 6, 8))
    row = torch.tensor([True, True, False, True, True, False])
    mask = row.expand(3, 1, 4, 6)
    out = mht.scaled_dot_product_attention(q, k, v, mask)
    assert_close(out, reference(q, k, v, attn_mask=mask))
    assert mask.data_ptr() in {a for a, _ in kernel_reads}
    assert all(a == kept for a, kept in kernel_reads)


def test_runs_under_inference_mode():
    with torch.inference_mode():
        q, k, v = tensors((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
        out = mht.scaled_dot_product_attention(q, k, v, is_causal=True)
        by_op = OPS.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.is_inference() and torch.equal(out, by_op)
    assert_close(out, reference(q, k, v, is_causal=True))


def test_a_call_that_needs_a_gradient_raises():
    q, k, v = tensors((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    q.requires_grad_(True)
    for call in (mht.scaled_dot_product_attention, OPS.scaled_dot_product_attention):
        with pytest.raises(NotImplementedError, match="no backward pass.*torch.no_grad"):
            call(q, k, v)
    with torch.no_grad():  # parameters and other leaves that require grad are fine here
        out = mht.scaled_dot_product_attention(q, k, v)
    assert not out.requires_grad
    assert_close(out, reference(q.detach(), k, v))


@pytest.mark.parametrize("sinks", [False, True])
def test_a_compiled_call_that_needs_a_gradient_raises_not_drops_it(sinks):
    # a traced call skips the eager check: the operators' registered backward raises when
    # the graph needs a gradient, where the inputs' gradients were silently left empty
    q, k, v = tensors((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    s = torch.zeros(2, requires_grad=sinks)
    q.requires_grad_(not sinks)

    def f(q, k, v, s):
        return mht.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=s)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="no backward pass"):
        compiled(q, k, v, s).sum().backward()
    with torch.no_grad():  # without a gradient the compiled call runs
        assert_close(compiled(q, k, v, s), f(q.detach(), k, v, s.detach()))


def test_sinks_that_require_grad_count_as_needing_a_gradient():
    q, k, v = tensors((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    sinks = torch.zeros(2, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward pass"):
        mht.scaled_dot_product_attention(q, k, v, sinks=sinks)


def test_bad_inputs_get_clear_errors():
    q, k, v = tensors((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    with pytest.raises(TypeError, match="torch.float32, torch.float64"):
        mht.scaled_dot_product_attention(q.int(), k.int(), v.int())
    with pytest.raises(TypeError, match="share one dtype"):
        mht.scaled_dot_product_attention(q, k.double(), v)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        mht.scaled_dot_product_attention(q, k.numpy(), v)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        mht.scaled_dot_product_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool),
                                         is_causal=True)
    with pytest.raises(ValueError, match="same last dimension"):
        mht.scaled_dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="transpose_out=True needs a head axis"):
        mht.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0], transpose_out=True)
    with pytest.raises(ValueError, match="on meta"):
        mht._forward(q.to("meta"), k, v, None, 0.0, False, None, False, None, None, None,
                     False, False, None, None)
    with pytest.raises(ValueError, match="window needs is_causal=True"):
        mht.scaled_dot_product_attention(q, k, v, window=3)
    with pytest.raises(ValueError, match="window must be"):
        mht.scaled_dot_product_attention(q, k, v, is_causal=True, window=0)


def test_meta_tensors_get_shapes_from_the_fake_implementation():
    q, k, v = (torch.empty(2, 8, 5, 16, device="meta"), torch.empty(2, 2, 9, 16, device="meta"),
               torch.empty(2, 2, 9, 32, device="meta"))
    out = mht.scaled_dot_product_attention(q, k, v, enable_gqa=True, transpose_out=True)
    assert out.device.type == "meta" and out.shape == (2, 5, 8, 32)
    out, lse = mht.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert out.shape == (2, 8, 5, 32) and lse.shape == (2, 8, 5) and lse.dtype == torch.float32


def test_dropout_is_seeded_by_torch_generator():
    q, k, v = tensors((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    torch.manual_seed(7)
    first = mht.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    again = mht.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, again)
    assert not torch.allclose(first, mht.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("kw", [{"enable_gqa": True},
                                {"enable_gqa": True, "transpose_out": True},
                                {"attn_mask": "bool"}, {"is_causal": True, "scale": 0.5}],
                         ids=["gqa", "transposed", "mask", "causal"])
def test_the_operator_passes_torch_library_checks(kw):
    q, k, v = tensors((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8))
    if not kw.get("enable_gqa"):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    if kw.get("attn_mask") == "bool":
        kw = {"attn_mask": torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.2}
    torch.library.opcheck(OPS.scaled_dot_product_attention.default, (q, k, v), kw)


def test_torch_compile_traces_the_operator_in_a_full_graph():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=capture, fullgraph=True, dynamic=False)
    def layer(x, w):
        q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return mht.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                transpose_out=True).flatten(-2)

    x, w = tensors((2, 10, 16), (16, 48))
    with torch.no_grad():
        out = layer(x, w)
        q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
    assert_close(out, reference(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))
    called = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert OPS.scaled_dot_product_attention in called


def test_softcap_sinks_alibi_and_lse_match_a_torch_reference():
    """Waits for the kernels' score features (softcap, sinks, alibi_slopes, return_lse)."""
    B, H, L, S, D = 2, 4, 5, 9, 8
    q, k, v = tensors((B, H, L, D), (B, 2, S, D), (B, 2, S, D))
    sinks, slopes = tensors((H,), (H,), seed=4)
    slopes = slopes.abs()
    cap, scale = 0.8, D ** -0.5
    out, lse = mht.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=cap,
                                                sinks=sinks, alibi_slopes=slopes,
                                                return_lse=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = cap * torch.tanh(q @ kk.transpose(-1, -2) * scale / cap)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    scores = scores - slopes[:, None, None] * (i + S - L - j).abs()
    logits = torch.cat([scores, sinks[:, None, None].expand(B, H, L, 1)], dim=-1)
    expected_lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1)[..., :-1]
    assert_close(out, weights @ vv)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, L)
    assert (lse - expected_lse).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_equals_torch_with_the_window_mask(dtype, kernel_outputs):
    """window=W with is_causal: query i sees keys i-W+1..i; torch gets that as a mask.
    With transpose_out and the score features too (one path for all of them)."""
    L, W = 40, 7
    q, k, v = tensors((2, 4, L, 16), (2, 2, L, 16), (2, 2, L, 16), dtype=dtype)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    band = (j <= i) & (j > i - W)
    out = mht.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                           window=W)
    assert_close(out, reference(q, k, v, attn_mask=band, enable_gqa=True))
    sinks = tensors((4,), seed=5)[0]
    out, lse = mht.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                window=W, sinks=sinks, return_lse=True,
                                                transpose_out=True)
    assert out.shape == (2, L, 4, 16) and out.data_ptr() == kernel_outputs[-1].ctypes.data
    kk, vv = (x.float().repeat_interleave(2, dim=1) for x in (k, v))
    scores = (q.float() @ kk.transpose(-1, -2) * 16 ** -0.5).masked_fill(~band, -torch.inf)
    logits = torch.cat([scores, sinks[:, None, None].expand(2, 4, L, 1)], dim=-1)
    expected = (torch.softmax(logits, dim=-1)[..., :-1] @ vv).to(dtype)
    assert_close(out.transpose(1, 2), expected)
    assert (lse - torch.logsumexp(logits, dim=-1)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L, kw", [(1, {}), (1, {"scale": 0.2}), (2, {"is_causal": True}),
                                   (2, {"is_causal": True, "window": 3})],
                         ids=["decode", "decode-scale", "causal", "window"])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_decoding_calls_take_the_direct_path_with_the_general_paths_bits(
        dtype, L, kw, transpose_out, direct_calls, monkeypatch):
    """A transformers decoding step's call (the query a transposed projection, the keys and
    values the filled part of a preallocated cache, grouped heads; one or two new tokens)
    goes straight to the kernels on views of the tensors, and gives the bits the general
    path gives."""
    B, Hq, Hkv, S, D = 2, 6, 2, 19, 16
    proj, cache_k, cache_v = tensors((B, L, Hq * D), (B, Hkv, 32, D), (B, Hkv, 32, D),
                                     dtype=dtype)
    q = proj.unflatten(-1, (Hq, D)).transpose(1, 2)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    args = dict(kw, enable_gqa=True, transpose_out=transpose_out)
    out = mht.scaled_dot_product_attention(q, k, v, **args)
    assert len(direct_calls) == 1
    q_seen, k_seen, v_seen, out_seen = direct_calls[0]
    assert (q_seen.ctypes.data, k_seen.ctypes.data, v_seen.ctypes.data, out_seen.ctypes.data) \
        == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())  # nothing copied
    monkeypatch.setattr(_kernels, "attend_heads", lambda *a: False)  # the general path
    general = mht.scaled_dot_product_attention(q, k, v, **args)
    assert len(direct_calls) == 1 and out.dtype == dtype and out.shape == general.shape
    assert torch.equal(out, general)
    if not transpose_out and "window" not in kw:
        assert_close(out, reference(q, k, v, **kw, enable_gqa=True))


def test_calls_the_direct_path_does_not_take_go_the_general_way(direct_calls):
    """A mask, float64, a broadcast batch, score features, a tensor that requires grad
    (under no_grad) or a plan that does not serve each kv head's query heads together
    (a prefill's tiles) leave the direct path to the general one, which checks and runs
    them."""
    q, k, v = tensors((2, 4, 3, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    long_q = tensors((2, 4, 40, 8))[0]
    assert_close(mht.scaled_dot_product_attention(long_q, k, v, enable_gqa=True),
                 reference(long_q, k, v, enable_gqa=True))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mht.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    mht.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    mht.scaled_dot_product_attention(q, k[:1], v[:1], enable_gqa=True)
    mht.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=5.0)
    with torch.no_grad():
        mht.scaled_dot_product_attention(q.requires_grad_(), k, v, enable_gqa=True)
    assert direct_calls == []
    with pytest.raises(ValueError, match="enable_gqa"):  # still the general path's error
        mht.scaled_dot_product_attention(q.detach(), k, v)


def _view(t, how):
    """t as the same values in another memory layout: token-major heads (a packed
    projection's view), every other element of a wider tensor, or contiguous."""
    if how == "heads":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "strided":
        wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
        wide[..., 1::2] = t
        return wide[..., 1::2]
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       st.integers(0, 2**32 - 1))
def test_random_calls_equal_torch_sdpa(dtype, seed):
    """Random shapes, grouped heads, layouts, causal or boolean/additive masks of every
    broadcast shape, and scales, against torch's SDPA on the same tensors."""
    rng = np.random.default_rng(seed)
    B, Hkv, G = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    L, S = int(rng.choice([1, 2, 5, 17, 65, 130])), int(rng.choice([1, 7, 64, 65, 129]))
    E, Ev = int(rng.choice([8, 64, 80])), int(rng.choice([8, 64]))
    q, k, v = tensors((B, Hkv * G, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev), dtype=dtype,
                      seed=seed % 2**31)
    q, k, v = (_view(t, rng.choice(["heads", "strided", "plain"])) for t in (q, k, v))
    kw = {"is_causal": bool(rng.integers(2)), "enable_gqa": G > 1}
    if rng.integers(2):
        kw["scale"] = float(rng.choice([0.1, 0.5]))
    if not kw["is_causal"] and rng.integers(2):
        shape = [(L, S), (B, 1, L, S), (1, Hkv * G, L, S), (B, Hkv * G, L, S)][rng.integers(4)]
        g = torch.Generator().manual_seed(seed % 2**31)
        if rng.integers(2):
            kw["attn_mask"] = torch.rand(shape, generator=g) > 0.3
            # every row sees a key (where none does torch gives NaN and manyheads zeros:
            # test_a_row_that_sees_no_key_is_zero_not_nan)
            kw["attn_mask"][..., 0] = True
        else:
            kw["attn_mask"] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    with torch.inference_mode():
        ours = mht.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():  # (the same values, in float32)
        kw["attn_mask"] = mask.float()
    assert_close(ours, reference(q, k, v, **kw))
