"""Thread pools: threadpoolctl sees and limits manyheads' OpenMP; concurrent callers share cores."""
import threading

import numpy as np
import pytest

import manyheads as mh
from manyheads import _config, _kernels

threadpoolctl = pytest.importorskip("threadpoolctl")


@pytest.mark.skipif(not _kernels.openmp_enabled(), reason="build without OpenMP")
def test_threadpoolctl_lists_and_limits_the_openmp_runtime(rng):
    info = threadpoolctl.threadpool_info()
    assert any(d["user_api"] == "openmp" for d in info), info
    q = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    before = mh.scaled_dot_product_attention(q, q, q, is_causal=True)
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert mh.get_num_threads() == 1
        limited = mh.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert mh.get_num_threads() == _kernels.omp_max_threads()
    np.testing.assert_array_equal(limited, before)


def test_concurrent_callers_split_the_threads_instead_of_multiplying_them():
    assert _config.threads_for_call(8, active_calls=1) == 8
    assert _config.threads_for_call(8, active_calls=4) == 2
    assert _config.threads_for_call(2, active_calls=8) == 1


def test_many_python_threads_calling_one_module_match_serial_calls(rng):
    m = mh.MultiHeadAttention(32, 64, 256, 0.0, 4, seed=0)
    xs = [rng.standard_normal((2, 200, 32)).astype(np.float32) for _ in range(8)]
    serial = [m(x) for x in xs]
    results = [None] * 8
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        for _ in range(3):
            results[i] = m(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results, serial):
        np.testing.assert_array_equal(a, b)
