"""Weight import from PyTorch and Hugging Face modules; save/load."""
import numpy as np
import pytest

import manyheads as mh

torch = pytest.importorskip("torch")
nn = torch.nn


# Book-style modules ("Build a Large Language Model (From Scratch)", chapter 3),
# written here in the book's structure to test the importers.
class BookCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = (q @ k.transpose(1, 2)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        w = self.dropout(torch.softmax(s / k.shape[-1] ** 0.5, dim=-1))
        return w @ v


class BookWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList([BookCausalAttention(d_in, d_out, context_length, dropout,
                                                        qkv_bias) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)


class BookMultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        w = self.dropout(torch.softmax(s / self.head_dim ** 0.5, dim=-1))
        ctx = (w @ v).transpose(1, 2).contiguous().view(B, T, self.d_out)
        return self.out_proj(ctx)


def run_torch(m, x):
    """The torch module on (B, T, d) x, causal; output (B, T, d)."""
    with torch.no_grad():
        if isinstance(m, nn.MultiheadAttention):
            T = x.shape[1]
            causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)  # True = not allowed
            tx = torch.from_numpy(x if m.batch_first else x.transpose(1, 0, 2).copy())
            y = m(tx, tx, tx, attn_mask=causal, need_weights=False)[0].numpy()
            return y if m.batch_first else y.transpose(1, 0, 2)
        return m(torch.from_numpy(x)).numpy()


def randomise(m):
    torch.manual_seed(0)
    with torch.no_grad():  # random biases too (PyTorch initialises some to zero)
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


SOURCES = {
    "mha_batch_first_bias": lambda: nn.MultiheadAttention(32, 4, batch_first=True),
    "mha_seq_first_no_bias": lambda: nn.MultiheadAttention(32, 4, bias=False),
    "book_fused": lambda: BookMultiHeadAttention(32, 32, 64, 0.0, 4, qkv_bias=True),
    "book_fused_no_bias": lambda: BookMultiHeadAttention(32, 48, 64, 0.0, 4),
    "book_wrapper": lambda: BookWrapper(32, 8, 64, 0.0, 4, qkv_bias=True),
}


@pytest.mark.parametrize("target", [mh.MultiHeadAttention, mh.StackedMultiHeadAttention])
@pytest.mark.parametrize("source", list(SOURCES))
def test_imported_module_equals_the_torch_module(rng, source, target):
    m = randomise(SOURCES[source]())
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    mha = isinstance(m, nn.MultiheadAttention)
    ours = target.from_torch(m, context_length=64, **({"causal": True} if mha else {}))
    if mha and not m.batch_first:  # the import keeps the source's (T, B, d) layout
        assert not ours.batch_first
        y = ours(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    else:
        y = ours(x)
    np.testing.assert_allclose(y, run_torch(m, x), rtol=0, atol=1e-5)


def test_nn_multihead_attention_import_asks_whether_it_is_causal():
    with pytest.raises(TypeError, match="causal=True .* or causal=False"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(64, 4, batch_first=True))


@pytest.mark.parametrize("batch_first", [True, False])
def test_an_imported_encoder_equals_torch_without_a_causal_mask(rng, batch_first):
    tm = randomise(nn.MultiheadAttention(64, 4, batch_first=batch_first))
    m = mh.MultiHeadAttention.from_torch(tm, causal=False)
    assert not m.causal and m.batch_first == batch_first
    x = rng.standard_normal((1, 10, 64) if batch_first else (10, 1, 64)).astype(np.float32)
    with torch.no_grad():
        ref = tm(*(torch.from_numpy(x),) * 3)[0].numpy()
    np.testing.assert_allclose(m(x), ref, rtol=0, atol=1e-5)


def test_masks_and_cross_attention_equal_torch(rng):
    tm = randomise(nn.MultiheadAttention(32, 4, batch_first=True))
    m = mh.MultiHeadAttention.from_torch(tm, causal=False)
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    mem = rng.standard_normal((2, 11, 32)).astype(np.float32)
    pad = np.zeros((2, 11), bool)
    pad[1, :4] = True  # the second memory is left-padded
    blocked = rng.random((7, 11)) < 0.3
    blocked[:, 8] = False  # every query keeps some key
    additive = rng.standard_normal((2 * 4, 7, 11)).astype(np.float32)
    t = torch.from_numpy
    for attn_mask in (blocked, additive):
        # torch wants both masks of one type; -inf padding is the same as True
        tpad = pad if attn_mask.dtype == bool else np.where(pad, -np.inf, 0).astype(np.float32)
        with torch.no_grad():
            ref, ref_w = tm(t(x), t(mem), t(mem), attn_mask=t(attn_mask),
                            key_padding_mask=t(tpad), average_attn_weights=False)
        y, w = m(x, mem, mem, attn_mask=attn_mask, key_padding_mask=pad, return_weights=True)
        np.testing.assert_allclose(y, ref.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(w, ref_w.numpy(), rtol=0, atol=1e-6)


def test_unsupported_modules_raise_type_error_listing_what_is_supported():
    with pytest.raises(TypeError, match="supported: torch.nn.MultiheadAttention"):
        mh.MultiHeadAttention.from_torch(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="kdim"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(TypeError, match="add_bias_kv"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


def test_save_and_load_round_trip(tmp_path, rng):
    m = mh.MultiHeadAttention(16, 32, 50, 0.1, 4, qkv_bias=True, num_kv_heads=2, window=9,
                              dtype=np.float64, seed=1)
    path = tmp_path / "layer.npz"
    m.save(path)
    m2 = mh.MultiHeadAttention.load(path)
    x = rng.standard_normal((2, 50, 16))
    np.testing.assert_array_equal(m2(x), m(x))
    assert (m2.num_kv_heads, m2.window, m2.dropout, m2.dtype) == (2, 9, 0.1, np.float64)


def test_load_rejects_wrong_version_and_shapes(tmp_path):
    m = mh.MultiHeadAttention(8, 8, 16, 0.0, 2, seed=0)
    good = tmp_path / "good.npz"
    m.save(good)
    data = dict(np.load(good))
    data["manyheads_module"] = np.array(str(data["manyheads_module"]).replace(
        '"format": 2', '"format": 99'))
    np.savez(tmp_path / "version.npz", **data)
    with pytest.raises(ValueError, match="version"):
        mh.MultiHeadAttention.load(tmp_path / "version.npz")
    data = dict(np.load(good))
    data["W_out"] = np.zeros((8, 7), np.float32)
    np.savez(tmp_path / "shape.npz", **data)
    with pytest.raises(ValueError, match="W_out"):
        mh.MultiHeadAttention.load(tmp_path / "shape.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a manyheads"):
        mh.MultiHeadAttention.load(tmp_path / "other.npz")


@pytest.mark.parametrize("bias", [False, True])
def test_the_books_single_head_imports(rng, bias):
    src = randomise(BookCausalAttention(32, 12, 48, 0.25, qkv_bias=bias))
    head = mh.CausalAttention.from_torch(src)
    assert (head.d_in, head.d_out, head.context_length, head.dropout, head.qkv_bias) == \
        (32, 12, 48, 0.25, bias)
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    np.testing.assert_allclose(head(x), run_torch(src, x), rtol=0, atol=1e-5)
    one = randomise(BookCausalAttention(32, 12, 48, 0.0))  # a bias on one layer only
    one.W_key = nn.Linear(32, 12)
    randomise(one)
    imported = mh.CausalAttention.from_torch(one, context_length=64)
    assert imported.context_length == 64 and not imported.b_query.any()
    np.testing.assert_allclose(imported(x), run_torch(one, x), rtol=0, atol=1e-5)


def test_a_head_and_a_multi_head_module_point_to_each_others_import():
    with pytest.raises(TypeError, match="one head .*CausalAttention.from_torch"):
        mh.MultiHeadAttention.from_torch(BookCausalAttention(8, 8, 16, 0.0))
    with pytest.raises(TypeError, match="expected the book's CausalAttention .* "
                                        "MultiHeadAttention.from_torch"):
        mh.CausalAttention.from_torch(BookMultiHeadAttention(8, 8, 16, 0.0, 2))


@pytest.mark.parametrize("cls", [BookWrapper, BookMultiHeadAttention])
def test_the_books_modules_give_their_context_length(cls):
    m = cls(32, 8, 48, 0.0, 4)  # (the wrapper keeps it in each head's mask)
    imported = mh.StackedMultiHeadAttention.from_torch(m)
    assert imported.context_length == 48
    assert mh.MultiHeadAttention.from_torch(m).context_length == 48
