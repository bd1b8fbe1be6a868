"""What makes repeated launches cheap, and what it must not cost: one-shot calls served by cached plans,
recorded launches and their descriptor sets reused, and the checks and ClosedError still in force."""

import numpy as np
import pytest

import pagedvk
from support import Case, rel_error, run_threads
from pagedvk.ops import decode
from pagedvk.ops.decode import release_cached_plans


@pytest.fixture
def fresh_cache(device):
    release_cached_plans(device)
    yield decode.oneshot_plans(device)
    release_cached_plans(device)


def reshuffled(rng, case, seq_lens):
    """New block tables (other physical blocks, in another order), lengths, query and cache contents of the
    same shapes: what a repeat call with the same key may bring."""
    num_blocks, max_blocks = case.key_cache.shape[0], case.block_tables.shape[1]
    ids = rng.permutation(num_blocks).astype(np.int32)
    case.block_tables = np.full_like(case.block_tables, -1)
    used = 0
    for s, n in enumerate(seq_lens):
        b = -(-n // case.block_size)
        case.block_tables[s, :b] = ids[used:used + b]
        used += b
    assert used <= num_blocks and case.block_tables.shape[1] == max_blocks
    case.seq_lens = np.asarray(seq_lens, np.int32)
    case.query = rng.standard_normal(case.query.shape).astype(case.query.dtype)
    case.key_cache = rng.standard_normal(case.key_cache.shape).astype(case.key_cache.dtype)
    case.value_cache = rng.standard_normal(case.value_cache.shape).astype(case.value_cache.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("max_len", [50, 700])   # 700: split into partitions, with the reduce pass
def test_cached_one_shot_takes_each_calls_tables(rng, fresh_cache, dtype, max_len):
    case = Case(rng, seq_lens=[max_len] * 3, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    tolerance = 1e-5 if dtype == np.float32 else 2e-3
    plans = set()
    for lens in ([max_len] * 3, [max_len, 17, 1], [3, max_len, max_len - 20], [0, 5, max_len]):
        reshuffled(rng, case, lens)
        out = case.poisoned_out()
        assert pagedvk.paged_attention(*case.args(), out=out) is out
        assert rel_error(out, case.reference()) <= tolerance, lens
        fresh = pagedvk.paged_attention(*case.args())      # no out: a new array
        assert fresh is not out and rel_error(fresh, case.reference()) <= tolerance
        plans.update(map(id, fresh_cache.plans()))
    assert len(plans) == len(fresh_cache.entries) == 2   # one plan per signature (out given or not)


def test_one_shot_equals_plan_run(rng, fresh_cache):
    # The same plan choices (split-K partitions included) give bit-identical outputs, first call and cached.
    case = Case(rng, seq_lens=[900, 33, 400], num_heads=8, num_kv_heads=2, head_size=64, dtype=np.float16)
    with pagedvk.DecodePlan.for_caches(case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                       num_heads=8, query_dtype=np.float16) as plan:
        assert plan.num_partitions > 1
        expected = plan.run(case.query, case.key_cache, case.value_cache)
    for _ in range(3):
        np.testing.assert_array_equal(pagedvk.paged_attention(*case.args()), expected)


def test_cached_one_shot_with_device_arrays(rng, fresh_cache):
    # Device caches with a numpy query (a numpy result), and with a device query and output.
    case = Case(rng, seq_lens=[60, 60], num_heads=4, num_kv_heads=2, head_size=32)
    k, v = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
    q, out = pagedvk.asarray(case.query), pagedvk.empty(case.query.shape)
    try:
        for lens in ([60, 60], [7, 60], [60, 31]):
            reshuffled(rng, case, lens)
            k.write(case.key_cache)
            v.write(case.value_cache)
            q.write(case.query)
            ref = case.reference()
            assert rel_error(pagedvk.paged_attention(case.query, k, v, case.block_tables, case.seq_lens), ref) <= 1e-5
            out.write(case.poisoned_out())
            got = pagedvk.paged_attention(q, k, v, case.block_tables, case.seq_lens, out=out)
            assert got is out and rel_error(out.numpy(), ref) <= 1e-5
        assert len(fresh_cache.entries) == 2
    finally:
        for a in (k, v, q, out):
            a.close()


def test_threads_share_a_cached_plan(fresh_cache):
    # One key, one staging buffer: calls from several threads with their own tables must not mix.
    def body(i):
        rng = np.random.default_rng(100 + i)
        case = Case(rng, seq_lens=[80, 80], num_heads=4, num_kv_heads=2, head_size=32)
        for _ in range(5):
            reshuffled(rng, case, [80, int(rng.integers(0, 81))])
            assert rel_error(pagedvk.paged_attention(*case.args()), case.reference()) <= 1e-5

    run_threads(body)
    assert len(fresh_cache.entries) == 1


def test_evicted_plans_are_closed(rng, fresh_cache):
    first = Case(rng, seq_lens=[20], num_heads=4, num_kv_heads=2, head_size=32)
    pagedvk.paged_attention(*first.args())
    (plan,) = fresh_cache.plans()
    for n in range(decode.ONESHOT_PLANS):   # other shapes push it out
        pagedvk.paged_attention(*Case(rng, seq_lens=[30 + 16 * n], num_heads=4, num_kv_heads=2, head_size=32).args())
    assert plan.closed and plan not in fresh_cache.plans()
    assert len(fresh_cache.plans()) == decode.ONESHOT_PLANS
    assert rel_error(pagedvk.paged_attention(*first.args()), first.reference()) <= 1e-5   # made again


def test_errors_still_name_the_argument_on_a_cache_hit(rng, fresh_cache):
    case = Case(rng, seq_lens=[40, 40], num_heads=4, num_kv_heads=2, head_size=32)
    pagedvk.paged_attention(*case.args(), scale=1)
    bad = case.block_tables.copy()
    bad[1, 0] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = .* is outside"):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, bad, case.seq_lens, scale=1)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9999 is outside"):
        pagedvk.paged_attention(*case.args()[:4], np.array([9999, 40], np.int32), scale=1)
    with pytest.raises(TypeError, match="scale must be a real number"):   # True == 1, but is refused
        pagedvk.paged_attention(*case.args(), scale=True)
    with pytest.raises(TypeError, match="out must have dtype float32"):
        pagedvk.paged_attention(*case.args(), scale=1, out=np.zeros(case.query.shape, np.float16))


def test_run_checks_cached_but_still_refuse(rng, device):
    case = Case(rng, seq_lens=[40, 40], num_heads=4, num_kv_heads=2, head_size=32)
    q, k, v, bt, sl = (pagedvk.asarray(a) for a in case.args())
    out = pagedvk.empty(case.query.shape)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=4) as plan:
        plan.run(q, k, v, out)
        with pytest.raises(ValueError, match=r"out must have the query's shape \(2, 4, 32\)"):
            plan.run(q, k, v, pagedvk.empty((2, 4, 16)))
        with pytest.raises(ValueError, match=r"query.shape\[1\] \(num_heads\) must be 4"):
            plan.run(np.zeros((2, 8, 32), np.float32), k, v, out)
        with pytest.raises(TypeError, match="query must have dtype float32"):
            plan.run(np.zeros((2, 4, 32), np.float64), k, v, out)
        plan.run(q, k, v, out)
    for a in (q, k, v, bt, sl, out):
        a.close()


def test_recorded_launch_and_descriptor_sets_reused(rng, device):
    case = Case(rng, seq_lens=[700, 40], num_heads=4, num_kv_heads=2, head_size=32)
    q, k, v, bt, sl = (pagedvk.asarray(a) for a in case.args())
    out, other = pagedvk.empty(case.query.shape), pagedvk.empty(case.query.shape)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=4, partition_size=128) as plan:
        assert plan.num_partitions > 1   # decode and reduce: two descriptor sets
        plan.run(q, k, v, out)
        (launch,) = plan.recorded_launches
        sets = [d.handle for d in launch.descriptor_sets]
        live = device.live_objects()
        for _ in range(5):
            out.write(case.poisoned_out())
            plan.run(q, k, v, out)
            assert rel_error(out.numpy(), case.reference()) <= 1e-5
        assert list(plan.recorded_launches) == [launch] and [d.handle for d in launch.descriptor_sets] == sets
        assert device.live_objects() == live   # nothing made per call
        plan.run(q, k, v, other)                # another output buffer: another recording
        assert len(plan.recorded_launches) == 2
    for a in (q, k, v, bt, sl, out, other):
        a.close()


def test_closed_buffer_in_a_cached_launch_is_refused(rng, device):
    # The plan's tables are the caller's device arrays, bound in every recorded launch: once closed, the
    # cached launch must not be submitted (nor a new one recorded).
    case = Case(rng, seq_lens=[40, 40], num_heads=4, num_kv_heads=2, head_size=32)
    q, k, v, bt, sl = (pagedvk.asarray(a) for a in case.args())
    out = pagedvk.empty(case.query.shape)
    plan = pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=4)
    plan.run(q, k, v, out)
    (launch,) = plan.recorded_launches
    bt.close()
    assert launch.stale
    with pytest.raises(pagedvk.ClosedError, match="closed"):
        plan.run(q, k, v, out)
    assert launch.closed and not plan.recorded_launches   # the stale recording is freed
    v.close()
    with pytest.raises(pagedvk.ClosedError):
        plan.run(q, k, v, out)
    plan.close()
    with pytest.raises(pagedvk.ClosedError, match="DecodePlan.*closed"):
        plan.run(q, k, v, out)
    for a in (q, k, sl, out):
        a.close()
