"""manyheads inside real processes: forked workers, Ctrl-C, a dask cluster."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import manyheads as mh

POSIX = hasattr(os, "fork")


def run_script(code, timeout):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


FORK_SCRIPT = """
import multiprocessing as mp
import numpy as np
import manyheads as mh

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 300, 32)).astype(np.float32) for _ in range(3))
x = rng.standard_normal((2, 150, 48)).astype(np.float32)
layer = mh.MultiHeadAttention(48, 48, 256, 0.0, 4, seed=0)


def work(i):
    return (mh.get_num_threads(), mh.scaled_dot_product_attention(q, k, v, is_causal=True),
            layer(x), layer(x[:, :1]))


# the parent uses its thread pool first ({parent_call}), then forks workers
{parent_call}
ref = (mh.scaled_dot_product_attention(q, k, v, is_causal=True), layer(x), layer(x[:, :1]))
with mp.get_context("fork").Pool(2) as pool:
    results = pool.map_async(work, range(4)).get(timeout=120)
for threads, *outs in results:
    assert threads == 1, threads
    for got, want in zip(outs, ref):
        assert np.array_equal(got, want)
print("forked workers ok")
"""


@pytest.mark.skipif(not POSIX, reason="fork is POSIX-only")
@pytest.mark.parametrize("parent_call", [
    "mh.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=2)",
    "layer(x, num_threads=2); layer(x[:, :1], num_threads=2)",
])
def test_forked_workers_compute_the_parents_results_and_never_hang(parent_call):
    res = run_script(FORK_SCRIPT.replace("{parent_call}", parent_call), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "forked workers ok" in res.stdout


SIGINT_SCRIPT = """
import sys, time
import numpy as np
import manyheads as mh

threads = int(sys.argv[1])
rng = np.random.default_rng(0)
# far more work than the test waits for: minutes on any machine
q = rng.standard_normal((1, 4, 160_000, 64)).astype(np.float32)
print("started", flush=True)
try:
    mh.scaled_dot_product_attention(q, q, q, is_causal=True, num_threads=threads)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    small = rng.standard_normal((1, 2, 70, 16)).astype(np.float32)
    out = mh.scaled_dot_product_attention(small, small, small, is_causal=True)
    ref = mh.oracle.scaled_dot_product_attention(small, small, small, is_causal=True)
    assert np.allclose(out, ref, atol=1e-5)
    print("still works", flush=True)
    sys.exit(0)
print("finished without interruption", flush=True)
sys.exit(3)
"""


@pytest.mark.skipif(not POSIX, reason="sends a real SIGINT")
@pytest.mark.parametrize("threads", [1, 2])
def test_ctrl_c_stops_a_long_call_with_keyboard_interrupt(threads):
    # the child takes SIGINT's default disposition, whatever this process inherited: a
    # run started in the background by a shell without job control ignores SIGINT, its
    # children too, and Python then installs no KeyboardInterrupt handler at all
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, str(threads)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "started"
        # the call has begun (inputs are built before "started"); let it run a moment
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert "interrupted" in out and "still works" in out


FORK_FROM_A_THREAD = """
import os, threading
from manyheads import _kernels

def fork():
    pid = os.fork()
    if pid == 0:  # the forking thread is the child's only one, and gets its signals
        os._exit(0 if _kernels.on_main_thread() else 7)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))

t = threading.Thread(target=fork)
t.start()
t.join()
"""


@pytest.mark.skipif(not POSIX, reason="forks")
def test_a_child_forked_from_a_thread_looks_for_ctrl_c():
    # (the main thread's id was read once at import: a child forked from another thread
    # never looked for pending signals in its long calls)
    res = run_script(FORK_FROM_A_THREAD, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "child 0"


def _layer_in_worker(layer, x):
    import manyheads

    return manyheads.get_num_threads(), layer(x)


def test_modules_run_in_a_dask_cluster_of_worker_processes():
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(0)
    layer = mh.MultiHeadAttention(32, 32, 128, 0.0, 4, num_kv_heads=2, seed=0)
    xs = [rng.standard_normal((2, 100, 32)).astype(np.float32) for _ in range(4)]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=40) as cluster, \
            distributed.Client(cluster) as client:
        # workers x threads <= cores: each worker process gets its share of the cores
        share = max(1, (os.cpu_count() or 1) // 2)
        client.run(mh.set_num_threads, share)
        futures = client.map(_layer_in_worker, [layer] * len(xs), xs)
        results = client.gather(futures)
    for (threads, got), x in zip(results, xs):
        assert threads == share
        np.testing.assert_array_equal(got, layer(x))
