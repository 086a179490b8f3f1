"""Draw one head of a random MultiHeadAttention layer over 200 random tokens."""
import sys

import numpy as np

import manyheads as mh

out = sys.argv[1]
layer = mh.MultiHeadAttention(64, 64, 256, 0.0, 4, seed=0)
x = np.random.default_rng(1).standard_normal((200, 64)).astype(np.float32)
_, w = layer(x, return_weights=True)
fig = mh.plot_attention(w, heads=[0], title="random head, T=200")
fig.savefig(out, dpi=110)
print("wrote", out, "mean weight", w[0].mean())
