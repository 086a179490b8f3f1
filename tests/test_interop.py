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
    with torch.no_grad():
        if isinstance(m, nn.MultiheadAttention):
            T = x.shape[1]
            causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)  # True = not allowed
            tx = torch.from_numpy(x if m.batch_first else x.transpose(1, 0, 2).copy())
            y = m(tx, tx, tx, attn_mask=causal, need_weights=False)[0].numpy()
            return y if m.batch_first else y.transpose(1, 0, 2)
        return m(torch.from_numpy(x)).numpy()


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
    torch.manual_seed(0)
    m = SOURCES[source]().eval()
    with torch.no_grad():  # random biases too (PyTorch initialises some to zero)
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = rng.standard_normal((2, 40, 32)).astype(np.float32)
    ours = target.from_torch(m, context_length=64)
    np.testing.assert_allclose(ours(x), run_torch(m, x), rtol=0, atol=1e-5)


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
    data["meta"] = data["meta"].copy()
    data["meta"][0] = 99
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
