"""manyheads: fast multi-head causal self-attention on multicore CPUs, from NumPy.

Two ways to build multi-head attention, checked against one NumPy oracle:

* :class:`StackedMultiHeadAttention` - independent :class:`CausalAttention`
  heads run side by side, outputs concatenated (then projected);
* :class:`MultiHeadAttention` - fused: one packed projection, one kernel call
  over every head.

:func:`scaled_dot_product_attention` is the functional core with PyTorch's
semantics.  :mod:`manyheads.oracle` is the readable reference.
"""
#: The version of this manyheads release, e.g. "0.1.0".
__version__ = "0.1.0"

import os as _os


def _load_kernels() -> None:
    """Import the extension so that its OpenMP threads sleep soon after each call.

    By default GNU OpenMP spins its idle threads for a long while after a
    parallel region; on a small machine they then steal the cores from NumPy's
    BLAS threads that run the projections next (and vice versa).  Unless the
    user chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT), a short spin is
    set for the moment the runtime initialises, then the environment is
    restored so other libraries are unaffected.
    """
    chosen = "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ
    if not chosen:
        _os.environ["GOMP_SPINCOUNT"] = "10000"
    try:
        from . import _kernels  # noqa: F401
    finally:
        if not chosen:
            del _os.environ["GOMP_SPINCOUNT"]


_load_kernels()

from . import _config, oracle  # noqa: E402
from ._config import get_num_threads, kernel_isa, set_num_threads, show_config  # noqa: E402
from .cache import KVCache  # noqa: E402
from .functional import scaled_dot_product_attention  # noqa: E402
from .modules import CausalAttention, MultiHeadAttention, StackedMultiHeadAttention  # noqa: E402
from .plot import head_roles, plot_attention  # noqa: E402

_config._init()

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "CausalAttention",
    "StackedMultiHeadAttention",
    "MultiHeadAttention",
    "KVCache",
    "plot_attention",
    "head_roles",
    "set_num_threads",
    "get_num_threads",
    "show_config",
    "kernel_isa",
    "oracle",
]
