"""Thread pools: threadpoolctl sees and limits manyheads' OpenMP; concurrent callers share cores."""
import os
import subprocess
import sys
import textwrap
import threading
import time

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


@pytest.fixture
def cpu_load():
    """Two busy processes competing for the cores while the test runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def _decode(m, x, cache):
    outs = [m(x[:, :20], cache=cache)]
    outs += [m(x[:, t:t + 1], cache=cache) for t in range(20, x.shape[1])]
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("kind", ["fused", "stacked"])
def test_many_python_threads_calling_one_module_match_serial_calls(rng, cpu_load, kind):
    m = mh.MultiHeadAttention(32, 64, 256, 0.0, 4, seed=0)
    if kind == "stacked":
        m = m.to_stacked()
    xs = [rng.standard_normal((2, 200, 32)).astype(np.float32) for _ in range(8)]
    serial = [m(x) for x in xs]
    serial_decode = [_decode(m, x[:, :40], m.new_cache(2, 40)) for x in xs]
    for _ in range(15):
        results, decoded = [None] * 8, [None] * 8
        barrier = threading.Barrier(8)

        def work(i):
            barrier.wait()
            for _ in range(3):
                results[i] = m(xs[i])
            decoded[i] = _decode(m, xs[i][:, :40], m.new_cache(2, 40))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a, b in zip(results, serial):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(decoded, serial_decode):
            np.testing.assert_array_equal(a, b)


def test_concurrent_calls_leave_every_blas_thread_count_as_they_found_it(rng):
    before = {d["filepath"]: d["num_threads"] for d in threadpoolctl.threadpool_info()}
    m = mh.MultiHeadAttention(32, 64, 256, 0.0, 4, seed=0)
    x = rng.standard_normal((2, 200, 32)).astype(np.float32)
    threads = [threading.Thread(target=lambda: [m(x) for _ in range(5)]) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = {d["filepath"]: d["num_threads"] for d in threadpoolctl.threadpool_info()}
    assert {k: after[k] for k in before} == before


def test_a_call_that_waited_long_for_absent_threads_counts_as_contended():
    # the calling thread worked 0.1 ms, then waited 3 ms for the other threads
    assert _kernels.waited_for_absent_threads(0.0, 0.0001, 0.0031)
    # imbalance: it worked 2 ms and waited 1.5 ms for a last long item
    assert not _kernels.waited_for_absent_threads(0.0, 0.002, 0.0035)
    # short waits are the other threads waking up, not contention
    assert not _kernels.waited_for_absent_threads(0.0, 0.00001, 0.0003)


def test_only_a_second_wait_soon_after_makes_the_calls_contended():
    again = _kernels.AGAIN_SECONDS
    # a virtual machine takes a core away now and then: one wait is no contention
    assert not _kernels.waited_again(100.0)
    assert not _kernels.waited_again(100.0 + 3 * again)
    # another wait soon after: the cores are busy
    assert _kernels.waited_again(100.0 + 3.5 * again)
    assert _kernels.waited_again(100.0 + 4 * again)
    assert not _kernels.waited_again(100.0 + 6 * again)
    _kernels.clear_contended()  # forgets the last wait
    assert not _kernels.waited_again(100.0 + 6.5 * again)


def test_calls_that_wait_for_absent_threads_plan_as_contended(rng):
    """Through the real calls: while other processes keep every core busy, a small
    product's split calls wait for their threads, and once two waits come close
    together the next calls plan as contended (a product of 8M multiply-adds or fewer
    on one thread); the results do not change."""
    if mh.get_num_threads() < 2:
        pytest.skip("needs 2 threads")
    w = rng.standard_normal((576, 1536)).astype(np.float32)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    want = mh.linear(x, w, num_threads=2)
    assert _kernels.explain_linear(1, 576, 1536, 2)["threads"] == 2
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count() or 1)]
    try:
        deadline = time.monotonic() + 60
        while not _kernels.contended() and time.monotonic() < deadline:
            np.testing.assert_array_equal(mh.linear(x, w, num_threads=2), want)
        assert _kernels.contended()
        assert _kernels.explain_linear(1, 576, 1536, 2)["threads"] == 1
    finally:
        for h in hogs:
            h.kill()
            h.wait()



def test_the_projections_blas_is_scipys_and_leaves_scipy_linalg_unimported():
    """A projection of many rows runs on SciPy's BLAS; where SciPy's wheel ships its
    OpenBLAS beside the package, that library is opened directly and ``scipy.linalg``
    (some 25 MiB of modules) is not imported; the result matches NumPy's."""
    code = """
        import glob, importlib.util, os, sys
        import numpy as np
        import manyheads as mh
        from manyheads import _blas
        x = np.random.default_rng(0).standard_normal((300, 96)).astype(np.float32)
        w = np.random.default_rng(1).standard_normal((96, 200)).astype(np.float32)
        np.testing.assert_allclose(mh.linear(x, w), x @ w, rtol=0, atol=1e-4)
        assert _blas.available()
        folder = os.path.realpath(importlib.util.find_spec("scipy").submodule_search_locations[0])
        shipped = glob.glob(folder + ".libs/libscipy_openblas*") + \\
            glob.glob(folder + "/.dylibs/libscipy_openblas*")
        print(bool(shipped), "scipy.linalg" in sys.modules, _blas.describe())
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shipped, linalg, described = out.stdout.split(" ", 2)
    if shipped == "True":
        assert linalg == "False" and described.startswith("SciPy's OpenBLAS, opened directly")
    else:
        assert described.startswith("scipy.linalg.cython_blas")
