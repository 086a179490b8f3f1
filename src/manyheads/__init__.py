"""manyheads: fast multi-head causal self-attention on multicore CPUs, from NumPy.

Two ways to build multi-head attention, checked against one NumPy oracle:

* :class:`StackedMultiHeadAttention` - independent :class:`CausalAttention`
  heads run side by side, outputs concatenated (then projected);
* :class:`MultiHeadAttention` - fused: one packed projection, one kernel call
  over every head.

:func:`scaled_dot_product_attention` is the functional core with PyTorch's
semantics.  :mod:`manyheads.oracle` is the readable reference.

Layout (who owns what):

* ``functional``, ``modules``, ``cache`` - the public API; they check every
  argument with the rules of ``_validate`` (TypeError for a wrong type,
  ValueError for a wrong value) before anything runs;
* ``_core`` - the checked-input core: folds broadcasting, grouped-query
  sharing and strides into per-(batch, head) offset tables and fills one
  ``_kernels.AttentionCall``;
* ``_kernels`` (Cython) - the call object and the OpenMP schedule, GIL
  released, no validation;
* ``csrc/`` (C) - the arithmetic: one kernel source instantiated per ISA,
  the run-time dispatcher, the scratch plan and the exp constants;
* ``_config`` - kernel path and threads; ``weights`` - projection weights in
  float16, bfloat16 and int8; ``interop`` - weights from PyTorch modules;
  ``models`` - whole models on top of the modules;
* ``torch`` - the kernels on torch tensors, a ``torch.library`` operator;
  ``transformers`` - ``attn_implementation="manyheads"``.  Both import
  torch when they are imported; ``import manyheads`` never does.
"""
import os as _os

from ._version import __version__


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
from .functional import (explain, linear, merge_attention,  # noqa: E402
                         scaled_dot_product_attention)
from .modules import CausalAttention, MultiHeadAttention, StackedMultiHeadAttention  # noqa: E402
from .plot import head_roles, plot_attention  # noqa: E402
from .weights import Int8Weight  # noqa: E402

_config._init()

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "merge_attention",
    "explain",
    "linear",
    "Int8Weight",
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
