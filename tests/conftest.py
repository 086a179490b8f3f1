import numpy as np
import pytest

import manyheads as mh

#: the threads a call asking for two gets: one in a build without OpenMP
#: (MANYHEADS_NO_OPENMP=1), whose calls all run on the calling thread
TWO_THREADS = 2 if mh.show_config(mode="dicts")["openmp"] else 1

# float32 results are compared with the float64 oracle; for unit-normal inputs at
# T <= 1024 the kernels stay within this absolute difference (docs/guarantees.md).
F32_ATOL = 1e-5
F64_ATOL = 1e-10


@pytest.fixture(autouse=True)
def _cores_free():
    """Each test starts on free cores: threads a test before found without a core (a
    virtual machine's cores taken away for a moment) would otherwise put the next
    quarter second's calls on one thread, which tests of the threads a call or a
    compiled step takes do not expect."""
    from manyheads import _kernels
    _kernels.clear_contended()


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def normal(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def atol_for(dtype):
    return F64_ATOL if np.dtype(dtype) == np.float64 else F32_ATOL


def pytest_runtest_setup(item):
    """A case parametrised with "bfloat16" needs ml_dtypes (NumPy has no bfloat16): where it is
    not installed (it is an optional dependency; the test extra brings it) the case is
    skipped with that reason instead of failing on the import."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "bfloat16" in [v for v in params.values() if isinstance(v, str)]:
        pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
