"""manyheads: fast multi-head causal self-attention on multicore CPUs, from NumPy.

Two ways to build multi-head attention, checked against one NumPy oracle:

* :class:`StackedMultiHeadAttention` - independent :class:`CausalAttention`
  heads run side by side, outputs concatenated (then projected);
* :class:`MultiHeadAttention` - fused: one packed projection, one kernel call
  over every head.

:func:`scaled_dot_product_attention` is the functional core with PyTorch's
semantics.  :mod:`manyheads.oracle` is the readable reference.
"""
__version__ = "0.1.0"

from . import _config, oracle
from ._config import get_num_threads, kernel_isa, set_num_threads, show_config
from .functional import scaled_dot_product_attention
from .modules import CausalAttention, MultiHeadAttention, StackedMultiHeadAttention

_config._init()

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "CausalAttention",
    "StackedMultiHeadAttention",
    "MultiHeadAttention",
    "set_num_threads",
    "get_num_threads",
    "show_config",
    "kernel_isa",
    "oracle",
]
