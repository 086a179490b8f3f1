"""Nothing crashes, nothing leaks, nothing is silently wrong: fuzzing, threads, numerics."""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import manyheads as mh
from manyheads import oracle

CRASH_CASES = r'''
import sys
import numpy as np
import manyheads as mh
f32 = np.float32
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 3, 40, 16)).astype(f32)
sdpa = mh.scaled_dot_product_attention

def misaligned(shape):
    n = int(np.prod(shape))
    buf = bytearray(n * 4 + 1)
    a = np.frombuffer(buf, dtype=f32, count=n, offset=1).reshape(shape)
    return a

cases = {
    "negative strides": lambda: sdpa(q[:, ::-1, ::-1], q[..., ::-1], q[::-1], is_causal=True),
    "zero-stride rows": lambda: sdpa(q, np.broadcast_to(q[:, :, :1], q.shape), q),
    "broadcast batch": lambda: sdpa(np.broadcast_to(q[:1], (5,) + q.shape[1:]), q[:1], q[:1]),
    "misaligned buffers": lambda: sdpa(misaligned((2, 3, 40, 16)), misaligned((2, 3, 40, 16)),
                                      misaligned((2, 3, 40, 16)), is_causal=True),
    "huge broadcast output": lambda: sdpa(np.broadcast_to(q[:1, :1], (2**24, 2**10, 40, 16)),
                                         q[:1, :1], q[:1, :1]),
    "huge weights": lambda: sdpa(np.broadcast_to(q[:1, :1, :1], (1, 1, 2**22, 16)),
                                np.broadcast_to(q[:1, :1, :1], (1, 1, 2**22, 16)),
                                np.broadcast_to(q[:1, :1, :1], (1, 1, 2**22, 16)),
                                return_weights=True),
    "huge head dim": lambda: sdpa(np.broadcast_to(np.ones(1, f32), (1, 1, 2, 2**40)),
                                 np.broadcast_to(np.ones(1, f32), (1, 1, 2, 2**40)),
                                 np.broadcast_to(np.ones(1, f32), (1, 1, 2, 2**40))),
    "threads 0": lambda: sdpa(q, q, q, num_threads=0),
    "threads -1": lambda: sdpa(q, q, q, num_threads=-1),
    "threads 10000": lambda: sdpa(np.repeat(q, 40, axis=0), np.repeat(q, 40, axis=0),
                                 np.repeat(q, 40, axis=0), num_threads=10000),
    "set_num_threads 10000": lambda: (mh.set_num_threads(10000), sdpa(q, q, q),
                                     mh.set_num_threads(None)),
    "list input": lambda: sdpa([[1.0, 2.0]], [[1.0, 2.0]], [[3.0, 4.0]]),
    "string input": lambda: sdpa("abc", q, q),
    "None input": lambda: sdpa(None, q, q),
    "object array": lambda: sdpa(np.array([[object()]]), q, q),
    "empty everything": lambda: sdpa(q[:0], q[:0], q[:0], is_causal=True),
    "empty keys": lambda: sdpa(q, q[:, :, :0], q[:, :, :0]),
    "wrong cache shape": lambda: mh.MultiHeadAttention(16, 16, 8, 0.0, 2)(
        np.ones((1, 2, 16), f32), cache=mh.KVCache(1, 8, 3, 5)),
    "cache of junk": lambda: mh.MultiHeadAttention(16, 16, 8, 0.0, 2)(
        np.ones((1, 2, 16), f32), cache=object()),
    "huge cache": lambda: mh.KVCache(1, 2**40, 4, 64),
    "mask of wrong type": lambda: sdpa(q, q, q, attn_mask=np.ones((40, 40), np.int8)),
    "float16 keys": lambda: sdpa(q, q.astype(np.float16), q.astype(np.float16)),
}
for name, fn in cases.items():
    print("case:", name, flush=True)
    try:
        fn()
        print("  ok", flush=True)
    except (ValueError, TypeError, MemoryError) as exc:
        assert str(exc), name
        print("  raised", type(exc).__name__, str(exc)[:80], flush=True)
print("all cases survived")
'''


def test_crash_fuzzing_in_a_subprocess():
    res = subprocess.run([sys.executable, "-c", CRASH_CASES], capture_output=True, text=True,
                         timeout=600)
    last = [ln for ln in res.stdout.splitlines() if ln.startswith("case:")][-1:]
    assert res.returncode == 0, f"crashed (signal {-res.returncode}) in {last}:\n" \
                                f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert "all cases survived" in res.stdout


LEAK_SCRIPT = textwrap.dedent(r'''
    import numpy as np, manyheads as mh
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 70, 16)).astype(np.float32)
    m = mh.MultiHeadAttention(16, 16, 128, 0.0, 2, seed=0)
    x = rng.standard_normal((1, 20, 16)).astype(np.float32)
    def round_():
        mh.scaled_dot_product_attention(q, q, q, is_causal=True)
        mh.scaled_dot_product_attention(q, q, q, return_weights=True, dropout_p=0.1, seed=1)
        c = m.new_cache(1, 21)
        m(x, cache=c); m(x[:, :1], cache=c)
        for bad in (lambda: mh.scaled_dot_product_attention(q, q[..., :3], q),
                    lambda: m(x, cache=c),
                    lambda: mh.scaled_dot_product_attention(q, q, q, num_threads=0)):
            try:
                bad()
            except (ValueError, TypeError):
                pass
    for _ in range(1000):
        round_()
    start = rss_mib()
    for _ in range(10000):
        round_()
    print(rss_mib() - start)
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ten_thousand_calls_keep_memory_flat():
    res = subprocess.run([sys.executable, "-c", LEAK_SCRIPT], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr
    growth = float(res.stdout.strip().splitlines()[-1])
    assert growth < 4.0, f"resident memory grew by {growth:.1f} MiB over 10,000 rounds"


def test_two_threads_sharing_one_cache_get_a_clear_error():
    m = mh.MultiHeadAttention(16, 16, 64, 0.0, 2, seed=0)
    cache = m.new_cache(1, 64)
    x = np.ones((1, 1, 16), np.float32)
    with cache.step(0):  # as if another thread were mid-call
        with pytest.raises(RuntimeError, match="in use by another call"):
            m(x, cache=cache)
    assert len(cache) == 0
    m(x, cache=cache)
    assert len(cache) == 1


def test_threads_racing_on_one_cache_never_corrupt_it():
    m = mh.MultiHeadAttention(16, 16, 512, 0.0, 2, seed=0)
    cache = m.new_cache(1, 512)
    x = np.random.default_rng(0).standard_normal((1, 1, 16)).astype(np.float32)
    errors, ok = [], []

    def work():
        for _ in range(160):  # (past max_len: the last calls find it full)
            try:
                m(x, cache=cache)
                ok.append(1)
            except RuntimeError as exc:
                errors.append(str(exc))
            except ValueError as exc:
                assert "cache is full" in str(exc)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(cache) == len(ok)  # every call that went through appended exactly one token
    assert all("in use by another call" in e for e in errors)


def test_a_step_into_a_full_cache_is_refused_under_its_lock():
    # (a module checks the room before it takes the cache; a call from another thread
    # could fill it in between, and the step then wrote past max_len)
    m = mh.MultiHeadAttention(16, 16, 8, 0.0, 2, seed=0)
    cache = m.new_cache(1, 4)
    m(np.ones((1, 4, 16), np.float32), cache=cache)
    with pytest.raises(ValueError, match="cache is full: 4 tokens"):
        with cache.step(1):
            pass
    cache.truncate(3)
    with cache.step(1):  # (the lock was given back)
        pass
    assert len(cache) == 4


@pytest.fixture
def fast_switches():
    """Python threads switching every microsecond: races show within a few calls."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("threads", [None, 3])  # 3: more than the cores, the lean path
def test_threads_stepping_one_model_over_shared_caches_never_corrupt_them(tmp_path, threads,
                                                                          fast_switches):
    # (a model call read the caches' length before holding them and, when another
    # thread's call held one, took back tokens that call had appended)
    pytest.importorskip("safetensors")
    from manyheads.models import from_pretrained
    from manyheads.models.random import save_random_checkpoint
    save_random_checkpoint(tmp_path, "llama", seed=7)
    model = from_pretrained(tmp_path)
    if threads is not None:
        mh.set_num_threads(threads)
    try:
        for _ in range(20):
            caches, ok, other = model.new_caches(1, 24), [], []

            def work():
                for _ in range(24):
                    try:
                        model.logits(np.array([[5]]), caches=caches, last_only=True)
                        ok.append(1)
                    except RuntimeError as exc:
                        if "in use by another call" not in str(exc):
                            other.append(repr(exc))
                    except ValueError as exc:
                        if "exceed the model's context" not in str(exc) and \
                                "cache is full" not in str(exc):
                            other.append(repr(exc))

            ts = [threading.Thread(target=work) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not other
            assert [len(c) for c in caches] == [len(ok)] * len(caches)
            # every slot below the length holds a token's keys
            assert caches[0].keys[0, 0, :len(ok)].any(axis=1).all()
    finally:
        mh.set_num_threads(None)


def test_large_float32_scores_stay_finite(rng):
    q = (rng.standard_normal((1, 2, 100, 16)) * 25).astype(np.float32)  # scores up to ~1e4
    out = mh.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert np.isfinite(out).all()
    ref = oracle.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, q, q)),
                                              is_causal=True)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)


def test_nan_in_a_query_row_stays_in_that_row(rng):
    q = rng.standard_normal((1, 2, 130, 16)).astype(np.float32)
    q[0, 1, 70, 3] = np.nan
    out = mh.scaled_dot_product_attention(q, q[:, :, :], q, is_causal=False)
    bad = ~np.isfinite(out)
    assert bad[0, 1, 70].all()
    bad[0, 1, 70] = False
    # the NaN query is also a key here: rows that attend to it become NaN, as in the oracle
    ref = oracle.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, q, q)))
    np.testing.assert_array_equal(~np.isfinite(out), ~np.isfinite(ref))
    k = rng.standard_normal((1, 2, 130, 16)).astype(np.float32)
    out = mh.scaled_dot_product_attention(q, k, k, is_causal=True)
    rows = np.isnan(out).any(axis=-1)
    assert rows[0, 1, 70] and rows.sum() == 1


def test_float32_at_8192_tokens_against_the_float64_oracle(rng):
    q, k, v = (rng.standard_normal((1, 1, 8192, 64)).astype(np.float32) for _ in range(3))
    out = mh.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = oracle.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                              v.astype(np.float64), is_causal=True)
    assert np.abs(out - ref).max() < 2e-6  # the bound docs/guarantees.md states
