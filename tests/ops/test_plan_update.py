"""DecodePlan.update: one plan kept across decode steps (FlashInfer's plan() after the first step), its tables
written in place, its split chosen again as sequences grow; checked against float64 at every step."""

import numpy as np
import pytest

import pagedvk
import pagedvk.testing.reference
from support import rel_error

TOL = 1e-5
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16
NUM_BLOCKS = 64


def caches(rng):
    x = 4   # float32: vLLM's x
    k = rng.standard_normal((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x)).astype(np.float32)
    v = rng.standard_normal((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE)).astype(np.float32)
    return k, v


def step_tables(rng, seq_lens, max_blocks):
    """Block tables for these lengths: each sequence's blocks drawn afresh from the cache (the entries past a
    sequence's last block are -1, which the kernel must not read)."""
    tables = np.full((len(seq_lens), max_blocks), -1, np.int32)
    ids = rng.permutation(NUM_BLOCKS).astype(np.int32)
    start = 0
    for s, n in enumerate(seq_lens):
        used = -(-int(n) // BLOCK_SIZE)
        tables[s, :used] = ids[start:start + used]
        start += used
    return tables


def plan_for(tables, lens, **kw):
    return pagedvk.DecodePlan(tables, lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                              block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **kw)


def check_step(plan, rng, k, v, dk, dv, tables, lens):
    q = rng.standard_normal((len(lens), NUM_HEADS, HEAD_SIZE)).astype(np.float32)
    out = pagedvk.asarray(np.full(q.shape, np.nan, np.float32))
    plan.run(pagedvk.asarray(q), dk, dv, out=out)
    ref = pagedvk.testing.reference.paged_attention(q, k, v, tables, lens)
    assert rel_error(out.numpy(), ref) <= TOL


def test_one_plan_follows_a_decode_as_its_sequences_grow(rng):
    # Lengths grow every step and the tables change; with 64-token partitions the split grows from one partition
    # to five, so the plan chooses again and makes its scratch anew, and every step still matches float64.
    k, v = caches(rng)
    dk, dv = pagedvk.asarray(k), pagedvk.asarray(v)
    max_blocks = 20
    lens = np.array([5, 40, 17], np.int32)
    tables = step_tables(rng, lens, max_blocks)
    partitions = []
    with plan_for(tables, lens, partition_size=64) as plan:
        for step in range(5):
            if step:
                lens = (lens + rng.integers(20, 80, size=lens.shape)).astype(np.int32)
                tables = step_tables(rng, lens, max_blocks)
                plan.update(tables, lens)
            partitions.append(plan.num_partitions)
            check_step(plan, rng, k, v, dk, dv, tables, lens)
    assert partitions[0] == 1 and partitions[-1] == -(-int(lens.max()) // 64) > 1, partitions


def test_a_steady_update_allocates_nothing_and_keeps_its_recorded_launches(rng):
    # The same choice as before (no split at these lengths): the tables are written into the plan's own arrays, no
    # Vulkan object is made or freed, and the launch recorded for a layer's buffers is the one its next run submits.
    k, v = caches(rng)
    dk, dv, device = pagedvk.asarray(k), pagedvk.asarray(v), pagedvk.default_device()
    q = pagedvk.asarray(np.zeros((3, NUM_HEADS, HEAD_SIZE), np.float32))
    out = pagedvk.empty((3, NUM_HEADS, HEAD_SIZE))
    lens = np.array([30, 41, 12], np.int32)
    with plan_for(step_tables(rng, lens, 8), lens) as plan:
        plan.run(q, dk, dv, out=out)
        (launch,), tables_array = plan.recorded_launches, plan.block_tables
        for step in range(3):
            lens = (lens + 1).astype(np.int32)
            tables = step_tables(rng, lens, 8)
            objects = device.live_objects()
            plan.update(tables, lens)
            assert device.live_objects() == objects, step
            assert plan.block_tables is tables_array and plan.recorded_launches == (launch,)
            query = rng.standard_normal(q.shape).astype(np.float32)
            q.write(query)
            out.write(np.full(out.shape, np.nan, np.float32))
            plan.run(q, dk, dv, out=out)   # the launch recorded before the updates
            assert plan.recorded_launches == (launch,)
            ref = pagedvk.testing.reference.paged_attention(query, k, v, tables, lens)
            assert rel_error(out.numpy(), ref) <= TOL, step


def test_update_takes_device_tables_and_python_lists(rng):
    k, v = caches(rng)
    dk, dv = pagedvk.asarray(k), pagedvk.asarray(v)
    lens = np.array([33, 7], np.int32)
    with plan_for(step_tables(rng, lens, 6), lens) as plan:
        # device tables become the plan's; the same arrays updated in place by the caller are read as they are now
        lens = np.array([50, 19], np.int32)
        tables = step_tables(rng, lens, 6)
        d_tables, d_lens = pagedvk.asarray(tables), pagedvk.asarray(lens)
        plan.update(d_tables, d_lens, max_seq_len=50)
        assert plan.block_tables is d_tables and plan.seq_lens is d_lens
        check_step(plan, rng, k, v, dk, dv, tables, lens)
        lens = np.array([51, 20], np.int32)
        tables = step_tables(rng, lens, 6)
        d_tables.write(tables)
        d_lens.write(lens)
        plan.update(d_tables, d_lens)
        check_step(plan, rng, k, v, dk, dv, tables, lens)
        # then numpy again: the plan takes arrays of its own, and the caller's stay as they were
        lens = np.array([64, 1], np.int32)
        tables = step_tables(rng, lens, 6)
        plan.update(tables.tolist(), lens.tolist())
        assert plan.block_tables is not d_tables and not d_tables.closed
        check_step(plan, rng, k, v, dk, dv, tables, lens)
        assert np.array_equal(d_lens.numpy(), [51, 20])


@pytest.mark.parametrize("change, exc, match", [
    (dict(block_tables=np.zeros((3, 8), np.int32), seq_lens=np.zeros(3, np.int32)), ValueError,
     r"block_tables has shape \(3, 8\), the plan's is \(2, 8\): a batch of another shape needs a plan of its own"),
    (dict(block_tables=np.zeros((2, 9), np.int32)), ValueError, r"block_tables has shape \(2, 9\), the plan's is \(2, 8\)"),
    (dict(seq_lens=np.zeros(3, np.int32)), ValueError, r"seq_lens.shape\[0\] \(num_seqs, from block_tables\) must be 2"),
    (dict(block_tables=np.zeros((2, 8), np.int64)), TypeError, "block_tables"),
    (dict(seq_lens=np.array([200, 1], np.int32)), ValueError, r"seq_lens\[0\] = 200 is outside \[0, 128\]"),
    (dict(block_tables=np.full((2, 8), NUM_BLOCKS, np.int32)), ValueError, "block_tables"),
    (dict(max_seq_len=129), ValueError, r"max_seq_len must be in \[0, 128\]"),
    (dict(max_seq_len=2.5), TypeError, "max_seq_len must be an int"),
])
def test_a_refused_update_names_its_argument_and_changes_nothing(rng, change, exc, match):
    k, v = caches(rng)
    dk, dv = pagedvk.asarray(k), pagedvk.asarray(v)
    lens = np.array([30, 60], np.int32)
    tables = step_tables(rng, lens, 8)
    with plan_for(tables, lens, partition_size=16) as plan:
        before = plan.choice
        arguments = dict(block_tables=step_tables(rng, [100, 100], 8), seq_lens=np.array([100, 100], np.int32))
        with pytest.raises(exc, match=match):
            plan.update(**{**arguments, **change})
        assert plan.choice == before
        check_step(plan, rng, k, v, dk, dv, tables, lens)   # still the tables it had


def test_update_of_a_closed_plan_raises():
    lens = np.array([3], np.int32)
    plan = plan_for(np.zeros((1, 2), np.int32), lens)
    plan.close()
    with pytest.raises(pagedvk.ClosedError):
        plan.update(np.zeros((1, 2), np.int32), lens)
