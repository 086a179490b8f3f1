"""Each call's plan, made once before any kernel runs: what mh.explain reports is what
the call will do (schedule, grouped heads, paths and reads, threads, scratch)."""
import inspect
import os

import numpy as np
import pytest

import manyheads as mh
from manyheads import _core, _formats, _kernels, oracle
from manyheads.cache import quantize
from conftest import TWO_THREADS, atol_for

ISA = mh.kernel_isa()
LANES_F32 = {"baseline": 4, "avx2": 8, "avx512": 16, "avx512bf16": 16}[ISA]
# the few-rows path reads cache formats in place where the ISA widens them as they load
READS_INT8_IN_PLACE = ISA in ("avx2", "avx512", "avx512bf16")


def zeros(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)  # (untouched pages: free however large)


def test_decode_against_a_long_cache_splits_the_keys():
    q, k = zeros(1, 12, 1, 64), zeros(1, 12, 16384, 64)
    plan = mh.explain(q, k, k, num_threads=2)
    assert plan.schedule == "split keys"
    assert (plan.key_ranges, plan.range_keys) == (32, 512)
    # each work item takes 8 of a head's ranges in turn: 4 items a head
    assert plan.ranges_per_item == 8 and plan.work_items == 12 * 4
    assert plan.threads == TWO_THREADS and plan.merge_threads == TWO_THREADS
    (item,) = plan.items
    assert (item.count, item.rows, item.path) == (48, 1, "few rows")
    assert (item.keys, item.values) == ("in place", "in place")
    assert plan.prefetch  # 50 MB of keys and values: rows are asked for ahead
    assert plan.partial_bytes == 12 * 32 * 1 * (64 + 2) * 4  # a partial result per range


def test_runs_of_key_ranges_leave_every_threads_enough_items():
    # (head size 128: work enough that a call just after one that found its threads
    # without a core still takes 2 threads, whatever ran before)
    q, k = zeros(1, 12, 1, 128), zeros(1, 12, 4096, 128)
    # 96 ranges: runs of 4 keep 2 threads 12 items each; one thread takes runs of 8
    plan = mh.explain(q, k, k, num_threads=2)
    assert plan.key_ranges == 8
    assert (plan.ranges_per_item, plan.work_items) == ((4, 24) if TWO_THREADS == 2 else (8, 12))
    assert (mh.explain(q, k, k, num_threads=1).ranges_per_item,
            mh.explain(q, k, k, num_threads=1).work_items) == (8, 12)
    # few heads: a range an item
    one = mh.explain(q[:, :1], k[:, :1], k[:, :1], num_threads=1)
    assert (one.key_ranges, one.ranges_per_item, one.work_items) == (8, 1, 8)


@pytest.mark.parametrize("rows", [1, 4, 16])  # the few-rows path, and the tile path
@pytest.mark.parametrize("window", [None, 1100])
def test_a_key_range_gives_the_same_bits_in_any_run(rng, rows, window):
    """One head alone (a range an item) and the same head among 12 (runs of
    ranges), with a window that leaves whole ranges of a run empty."""
    S = 5000
    q = rng.standard_normal((1, 12, rows, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 12, S, 64)).astype(np.float32) for _ in range(2))
    kw = dict(scale=0.125, causal_offset=S - rows, window=window, split=True)
    many = _core.attention(q, k, v, num_threads=2, **kw)
    assert _core.attention(q, k, v, num_threads=2, explain_only=True, **kw).ranges_per_item > 1
    for h in (0, 7):
        sl = slice(h, h + 1)
        assert _core.attention(q[:, sl], k[:, sl], v[:, sl], num_threads=1, explain_only=True,
                               **kw).ranges_per_item == 1
        alone = _core.attention(q[:, sl], k[:, sl], v[:, sl], num_threads=1, **kw)
        np.testing.assert_array_equal(many[:, sl], alone)
    ref = oracle.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=True,
        scale=0.125, causal_offset=S - rows, window=window)
    np.testing.assert_allclose(many, ref, rtol=0, atol=atol_for(np.float32))


def test_decode_against_a_short_cache_runs_one_block_per_head_without_prefetch():
    # 12 heads of 600 float32 keys and values: 3.7 MB, under the 4 MiB from which a
    # float32 call asks for its rows ahead
    plan = mh.explain(zeros(1, 12, 1, 64), zeros(1, 12, 600, 64), zeros(1, 12, 600, 64))
    assert plan.schedule == "query blocks" and plan.key_ranges == 0
    assert plan.work_items == 12 and plan.items[0].path == "few rows"
    assert not plan.prefetch and plan.partial_bytes == 0
    over = zeros(1, 12, 700, 64)  # 4.3 MB
    assert mh.explain(zeros(1, 12, 1, 64), over, over).prefetch


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int8", "int4"])
def test_decode_over_a_narrow_cache_asks_for_its_rows_ahead_however_short(fmt):
    """Keys and values stored narrower than float32 are asked for ahead at any length:
    their widening leaves time for the requests, which pay off as soon as a deep model
    has pushed them out of the caches."""
    q, k = zeros(1, 12, 1, 64), zeros(1, 12, 64, 64)
    kq, ks = quantize(k, fmt)
    plan = _core.explain(q, kq, kq, k_scale=ks, v_scale=ks, num_threads=2)
    assert plan.kv_format == fmt and plan.prefetch
    assert not mh.explain(q, k, k).prefetch  # the same in float32: 393 KB


def test_causal_prefill_runs_query_blocks_on_the_tile_path_in_place():
    q = zeros(1, 12, 2048, 64)
    plan = mh.explain(q, q, q, is_causal=True, num_threads=2)
    assert plan.schedule == "query blocks" and plan.query_blocks == 32
    assert plan.work_items == 384 and plan.threads == TWO_THREADS
    (item,) = plan.items
    assert (item.rows, item.path, item.keys, item.values) == (64, "tile", "in place", "in place")
    assert plan.multiply_adds == 12 * 2048 * 2048 * 128


def test_a_short_last_query_block_takes_the_few_rows_path():
    q = zeros(1, 3, 66, 64)
    plan = mh.explain(q, q, q, is_causal=True)
    full, last = plan.items
    assert (full.count, full.rows, full.path) == (3, 64, "tile")
    assert (last.count, last.rows, last.path) == (3, 2, "few rows")


def test_grouped_decode_serves_the_query_heads_of_a_kv_head_in_one_item():
    q, k = zeros(2, 32, 1, 64), zeros(2, 8, 16384, 64)
    plan = mh.explain(q, k, k, enable_gqa=True, num_threads=2)
    assert plan.group == 4 and plan.pairs == 16  # (batch, kv head) pairs
    assert plan.items[0].rows == 4 and plan.key_ranges == 32
    # a mask that differs between query heads, weights or dropout: no grouping
    per_head = np.ones((1, 32, 1, 16384), bool)
    assert mh.explain(q, k, k, attn_mask=per_head, enable_gqa=True).group == 1
    assert mh.explain(q, k, k, enable_gqa=True, return_weights=True).group == 1
    assert mh.explain(q, k, k, enable_gqa=True, dropout_p=0.1).group == 1
    shared = np.ones((2, 1, 1, 16384), bool)
    assert mh.explain(q, k, k, attn_mask=shared, enable_gqa=True).group == 4


def test_weights_and_dropout_keep_the_block_schedule_and_the_tile_path():
    q, k = zeros(1, 2, 1, 64), zeros(1, 2, 4096, 64)
    for plan in (mh.explain(q, k, k, return_weights=True), mh.explain(q, k, k, dropout_p=0.2)):
        assert plan.key_ranges == 0
    assert mh.explain(q, k, k, return_weights=True).items[0].path == "tile"
    assert mh.explain(q, k, k, dropout_p=0.2).items[0].path == "few rows"


def test_small_calls_run_on_the_calling_thread():
    q = zeros(1, 12, 1, 64)
    assert mh.explain(q, zeros(1, 12, 16, 64), zeros(1, 12, 16, 64), num_threads=8).threads == 1
    # never more threads than work items
    q = zeros(1, 1, 64, 64)
    assert mh.explain(q, zeros(1, 1, 4096, 64), zeros(1, 1, 4096, 64), num_threads=8).threads == 1


def test_keys_far_apart_are_copied_by_the_tile_path():
    # the key columns of a packed (B, T, 3 * H * D) projection: rows 4.6 KB apart
    qkv = zeros(1, 300, 3 * 6 * 64)
    q, k, v = (qkv[:, :, i * 384:(i + 1) * 384].reshape(1, 300, 6, 64).transpose(0, 2, 1, 3)
               for i in range(3))
    plan = mh.explain(q, k, v, is_causal=True)
    assert plan.items[0].path == "tile"
    assert (plan.items[0].keys, plan.items[0].values) == ("copied", "copied")
    dense = np.ascontiguousarray(k)
    assert mh.explain(q, dense, dense, is_causal=True).items[0].keys == "in place"


def test_rows_that_are_not_whole_vectors_are_copied_by_the_few_rows_path():
    E = LANES_F32 + 1
    plan = mh.explain(zeros(1, 2, 1, E), zeros(1, 2, 100, E), zeros(1, 2, 100, E))
    assert plan.items[0].path == "few rows" and plan.items[0].keys == "copied"


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "int8", "int4"])
def test_cache_formats_are_read_in_place_where_the_path_widens_them(fmt):
    q, k = zeros(1, 4, 1, 64), zeros(1, 4, 2048, 64)
    kq, ks = quantize(k, fmt)
    plan = _core.explain(q, kq, kq, k_scale=ks, v_scale=ks, num_threads=2)
    assert plan.kv_format == fmt and plan.query_format == "float32"
    caps = {"float16": ISA != "baseline", "bfloat16": ISA != "baseline",
            "int8": READS_INT8_IN_PLACE, "int4": READS_INT8_IN_PLACE}
    want = "in place" if caps[fmt] else "copied"
    assert (plan.items[0].keys, plan.items[0].values) == (want, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_prefill_widens_each_row_once_per_thread_or_takes_pair_products(dtype):
    dt = _formats.FORMATS[dtype].dtype
    q = zeros(1, 2, 1024, 64, dtype=dt)
    plan = mh.explain(q, q, q, is_causal=True, num_threads=2)
    item = plan.items[0]
    if dtype == "bfloat16" and ISA == "avx512bf16":
        assert item.path == "tile, bfloat16 pair products"
        assert (item.keys, item.values) == ("in place", "copied") and plan.widened_rows == 0
    else:
        assert item.path == "tile"
        assert (item.keys, item.values) == ("widened once per thread",) * 2
        assert plan.widened_rows == 1024
        assert plan.scratch_bytes > 1024 * (64 + 64) * 4  # the widened rows live there


def test_explain_checks_its_arguments_as_the_call_does():
    q = zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="last dimension"):
        mh.explain(q, zeros(1, 2, 4, 9), zeros(1, 2, 4, 9))
    with pytest.raises(ValueError, match="not both"):
        mh.explain(q, q, q, attn_mask=np.ones((4, 4), bool), is_causal=True)
    with pytest.raises(TypeError, match="num_threads"):
        mh.explain(q, q, q, num_threads=1.5)
    with pytest.raises(ValueError, match="softcap"):
        mh.explain(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        mh.explain(q, q, q, sinks=np.zeros(3, np.float32))


def test_explain_takes_every_argument_of_the_call():
    """A Gemma 2 or gpt-oss call is explained as written: the score features and the
    seed change each score's arithmetic, not the plan."""
    sig = inspect.signature(mh.scaled_dot_product_attention).parameters
    assert list(inspect.signature(mh.explain).parameters) == list(sig)
    q, k = zeros(1, 4, 1, 64), zeros(1, 4, 4096, 64)
    plain = mh.explain(q, k, k, num_threads=2)
    featured = mh.explain(q, k, k, softcap=30.0, sinks=np.zeros(4, np.float32),
                          alibi_slopes=np.full(4, 0.5, np.float32), return_lse=True, seed=3,
                          num_threads=2)
    assert featured == plain


def test_the_plan_reads_in_words():
    q, k = zeros(1, 12, 1, 64), zeros(1, 12, 16384, 64)
    text = str(mh.explain(q, k, k, num_threads=2))
    threads = "2 threads" if TWO_THREADS == 2 else "1 thread"
    assert f"float32 attention on the {ISA} kernels, {threads}" in text
    assert "32 key ranges of 512, 8 in turn a work item = 48 work items" in text
    assert "48 items of 1 row: few rows path, keys in place, values in place" in text


def test_the_plan_gives_the_threads_a_call_uses_however_the_budget_is_set():
    q = zeros(2, 5, 300, 40)
    assert mh.explain(q, q, q, is_causal=True, num_threads=2).threads == TWO_THREADS
    assert mh.explain(q, q, q, is_causal=True, num_threads=1).threads == 1


def test_linear_plans_column_blocks_for_a_few_rows_and_blas_tiles_for_more():
    # (12.6 M multiply-adds: split even while threads were recently found without a core,
    # when calls below 8.4 M run on the calling thread alone)
    few = _kernels.explain_linear(1, 4096, 3072, 2)
    # a row's sums fit in 32 KiB (8192 float32 columns): chunks of k, one per core of the
    # machine (2 to 8) whatever the call's threads and the weights' format (the sums'
    # order never depends on them), one block of every column, each item a contiguous
    # run of w
    assert _kernels.LINEAR_BLOCK_BYTES == 32768
    chunks = _kernels.LINEAR_K_CHUNKS
    assert chunks == min(8, max(2, os.cpu_count() or 1))
    assert few["path"] == "few rows" and few["tile"] == (1, 3072) and few["threads"] == 2
    for fmt in ("float32", "bfloat16", "float16", "int8"):
        for nt in (1, 2, 4):
            plan = _kernels.explain_linear(1, 4096, 3072, nt, weight_format=fmt)
            assert plan["work_items"] == chunks
            assert plan["k_chunk"] % 8 == 0  # whole passes
            assert plan["k_chunk"] * (chunks - 1) < 4096 <= plan["k_chunk"] * chunks
    assert _kernels.explain_linear(1, 100, 576, 2)["work_items"] <= 3  # chunks of 32 rows or more
    assert _kernels.explain_linear(1, 40, 576, 2)["k_chunk"] == 40  # too shallow to cut
    # wider: blocks of at most 32 KiB of sums a row, as many per thread, all of k
    wide = _kernels.explain_linear(4, 576, 49152, 2)
    assert wide["tile"] == (4, 8192) and wide["k_chunk"] == 576
    assert _kernels.explain_linear(1, 576, 49152, 2, itemsize=8)["tile"] == (1, 4096)
    # int8 scales in groups keep sums of their own: half the columns
    assert _kernels.explain_linear(1, 576, 6000, 2, grouped=True)["tile"][1] < 6000
    many = _kernels.explain_linear(513, 200, 700, 2)
    assert many["path"] == "BLAS tiles" and many["tile"][0] == 256
    # few tiles come in an even count (an odd one leaves a thread idle at the end) ...
    few_tiles = _kernels.explain_linear(128, 576, 576, 2)
    assert few_tiles["work_items"] == 4 and few_tiles["tile"] == (128, 144)
    # ... and widened weights in equal stripes, an even number, where n has one
    for fmt in ("bfloat16", "int8"):
        st = _kernels.explain_linear(128, 576, 576, 2, weight_format=fmt)
        assert st["path"] == "widened stripes" and st["tile"] == (128, 96)
        assert st["work_items"] == 6
