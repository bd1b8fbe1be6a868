"""Asynchronous ops: work queued on streams returns at once, runs in order per stream, is waited for by host reads,
streams and events, and keeps what it binds alive until it has run; faults and timeouts name the op."""

import gc

import numpy as np
import pytest
import vulkan as vk

import pagedvk
import pagedvk.testing.reference as reference
from pagedvk.runtime import commands
from pagedvk.runtime.stream import check_stream, current_stream, default_stream
from support import Case, rel_error

NUM_HEADS = 8


def long_case(rng):
    """A decode long enough on lavapipe (tens of ms) that the host sees it still queued."""
    return Case(rng, num_seqs=4, num_heads=NUM_HEADS, num_kv_heads=2, head_size=64, block_size=16, max_len=2000)


def on_device(case):
    return [pagedvk.asarray(a) for a in case.args()]


def live_after_warming(device, case):
    """The device's live object count once the case's pipelines exist (they stay cached on the device)."""
    q, k, v, bt, sl = on_device(case)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        plan.run(q, k, v).numpy()
    for a in (q, k, v, bt, sl):
        a.close()
    from pagedvk.ops.decode import release_cached_plans
    release_cached_plans()
    return device.live_objects()


def test_an_op_over_device_arrays_returns_before_its_work_is_done(rng, device, monkeypatch):
    # While run() is called the driver's fence calls say "not ready" and a wait fails the test: run() queues its
    # work and returns without waiting; numpy() then waits for it (with the real calls).
    case = long_case(rng)
    q, k, v, bt, sl = on_device(case)
    out = pagedvk.asarray(np.full(case.query.shape, np.nan, np.float32))
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        plan.run(q, k, v, out)   # recorded here: its first launch records and compiles
        out.write(np.full(case.query.shape, np.nan, np.float32))   # waits for it, and poisons the output again

        def no_wait(*args):
            raise AssertionError("run() waited for a fence")

        with monkeypatch.context() as m:
            m.setattr(commands, "get_fence_status", lambda *a: vk.VK_NOT_READY)
            m.setattr(commands, "wait_for_fences", no_wait)
            assert plan.run(q, k, v, out) is out
            stream = default_stream(device)
            assert not stream.query()
            event = stream.record_event()
        np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)   # numpy() waits
        assert event.query() and stream.query()


def test_closing_what_queued_work_binds_waits_for_the_work(rng, device):
    # Everything the run binds is closed (or dropped) straight after it is queued; the run still reads them, and they
    # are destroyed only once it has finished (validation would report a use of a destroyed buffer).
    case = long_case(rng)
    live = live_after_warming(device, case)
    q, k, v, bt, sl = on_device(case)
    out = pagedvk.asarray(np.full(case.query.shape, np.nan, np.float32))
    plan = pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS)
    plan.run(q, k, v, out)
    for a in (plan, q, k, v, bt, sl):
        a.close()
    del plan, q, k, v, bt, sl
    gc.collect()
    np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)
    out.close()
    pagedvk.synchronize()
    gc.collect()
    from pagedvk.ops.decode import release_cached_plans
    release_cached_plans()
    assert device.live_objects() <= live


def test_a_stream_runs_its_ops_in_order(rng, device):
    # A cache write and the attention that reads it, queued back to back: the attention sees the write. Each step
    # writes a new token into every sequence and attends; all queued without a wait until the end.
    case = Case(rng, num_heads=NUM_HEADS, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[5, 20, 40])
    k_host, v_host = case.key_cache.copy(), case.value_cache.copy()
    k, v = pagedvk.asarray(k_host), pagedvk.asarray(v_host)
    lens = case.seq_lens.copy()
    outs, refs = [], []
    with pagedvk.Stream(device) as stream:
        assert current_stream(device) is stream
        for step in range(3):
            lens = lens + 1
            slots = np.array([case.block_tables[s, (n - 1) // 16] * 16 + (n - 1) % 16 for s, n in enumerate(lens)],
                             np.int32)
            new_k = rng.standard_normal((3, 2, 64)).astype(np.float32)
            new_v = rng.standard_normal((3, 2, 64)).astype(np.float32)
            k_host, v_host = reference.reshape_and_cache(new_k, new_v, k_host, v_host, slots)
            q = rng.standard_normal((3, NUM_HEADS, 64)).astype(np.float32)
            arrays = [pagedvk.asarray(a) for a in (new_k, new_v, slots, q, case.block_tables, lens)]
            pagedvk.reshape_and_cache(*arrays[:2], k, v, arrays[2])
            with pagedvk.DecodePlan.for_caches(k, v, arrays[4], arrays[5], num_heads=NUM_HEADS) as plan:
                outs.append(plan.run(arrays[3], k, v))
            refs.append(reference.paged_attention(q, k_host, v_host, case.block_tables, lens))
        stream.synchronize()
        assert stream.query()
    assert current_stream(device) is default_stream(device)
    for out, ref in zip(outs, refs):
        assert rel_error(out.numpy(), ref) <= 1e-5


def test_two_streams_and_events(rng, device):
    # The same decode queued on a stream of its own and on the default stream: both right. An event recorded on
    # the side stream orders the default stream's later work after it (wait_event).
    case = long_case(rng)
    q, k, v, bt, sl = on_device(case)
    side = pagedvk.Stream(device)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan_a, \
            pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan_b:
        with side:
            out_side = plan_a.run(q, k, v)
        done = side.record_event()
        default_stream(device).wait_event(done)
        out_main = plan_b.run(q, k, v)
        done.synchronize()
        assert done.query()
        for out in (out_side, out_main):
            np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)
    side.synchronize()


def test_stream_arguments_are_checked(device):
    side = pagedvk.Stream(device)
    with pytest.raises(TypeError, match="event must be a pagedvk Event, got int"):
        side.wait_event(3)
    with pytest.raises(TypeError, match="stream must be a pagedvk Stream, got str"):
        check_stream("default", device)


def test_a_fault_found_by_a_later_wait_names_the_op(rng, device, monkeypatch):
    # A driver that reports the device lost when the queued run's fence is polled: the wait that finds it raises
    # DeviceLostError naming the op that was running. (Simulated: the device itself stays usable.)
    case = Case(rng, num_seqs=2, num_heads=NUM_HEADS, num_kv_heads=2, head_size=32, block_size=16, max_len=40)
    q, k, v, bt, sl = on_device(case)
    out = pagedvk.empty(case.query.shape)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        real_status = commands.get_fence_status
        # Not ready while it is queued (a small run may finish before the queuing call looks), then lost.
        monkeypatch.setattr(commands, "get_fence_status", lambda *a: vk.VK_NOT_READY)
        plan.run(q, k, v, out)
        monkeypatch.setattr(commands, "get_fence_status", lambda *a: vk.VK_ERROR_DEVICE_LOST)
        try:
            with pytest.raises(pagedvk.DeviceLostError, match="running paged_decode"):
                default_stream(device).retire()
        finally:
            monkeypatch.setattr(commands, "get_fence_status", real_status)
            device.lost = None   # simulated
        np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)


class BusyGPU:
    """Fences that say "not ready" (the GPU still runs the two submissions ahead), and a count of the command buffers
    in each vkQueueSubmit."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.counts = monkeypatch, []
        real_submit = commands.queue_submit

        def counting_submit(queue, n, info, fence):
            self.counts.append(info.commandBufferCount)
            return real_submit(queue, n, info, fence)

        monkeypatch.setattr(commands, "queue_submit", counting_submit)
        self.real_status = commands.get_fence_status
        monkeypatch.setattr(commands, "get_fence_status", lambda *a: vk.VK_NOT_READY)

    def catch_up(self):
        """The GPU's fences tell the truth again."""
        self.monkeypatch.setattr(commands, "get_fence_status", self.real_status)


def decodes_into(plan, case, q, k, v, n):
    """n outputs of one plan, each its own launch (command buffer), recorded and run once before the test counts."""
    outs = [pagedvk.asarray(np.full(case.query.shape, np.nan, np.float32)) for _ in range(n)]
    for out in outs:
        plan.run(q, k, v, out)
    pagedvk.synchronize()
    for out in outs:
        out.write(np.full(case.query.shape, np.nan, np.float32))   # poisoned again
    return outs


@pytest.mark.parametrize("batch, submissions", [(None, [1, 1, 4]), ("3", [1, 1, 3, 1]), ("1", [1] * 6)])
def test_ops_queued_behind_two_running_submissions_go_together(rng, device, monkeypatch, batch, submissions):
    # Six decodes queued while the GPU is busy: the first two are submitted at once, the others wait in the stream's
    # batch and go in one vkQueueSubmit (PAGEDVK_BATCH at most) when the stream is asked about its work; each result
    # is right.
    case = Case(rng, num_seqs=3, num_heads=NUM_HEADS, num_kv_heads=2, head_size=32, block_size=16, max_len=60)
    q, k, v, bt, sl = on_device(case)
    if batch is None:
        monkeypatch.delenv("PAGEDVK_BATCH", raising=False)
    else:
        monkeypatch.setenv("PAGEDVK_BATCH", batch)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        outs = decodes_into(plan, case, q, k, v, 6)
        gpu = BusyGPU(monkeypatch)
        for out in outs:
            plan.run(q, k, v, out)
        stream = default_stream(device)
        before_flush = list(gpu.counts)
        assert not stream.query()   # asking sends the batch
        assert gpu.counts == submissions
        assert before_flush == submissions[:-1] or batch == "1"
        gpu.catch_up()
        for out in outs:
            assert rel_error(out.numpy(), case.reference()) <= 1e-5


def test_an_op_queued_again_while_it_waits_in_a_batch(rng, device, monkeypatch):
    # A, B, C, then A again while C waits in the batch and A may still run: A's command buffer runs once at a time,
    # so the second A waits for the first; C and the second A then go together. Results stay right, and waiting on
    # a command buffer that went with others waits on the last one's fence.
    case = Case(rng, num_seqs=3, num_heads=NUM_HEADS, num_kv_heads=2, head_size=32, block_size=16, max_len=60)
    q, k, v, bt, sl = on_device(case)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        a, b, c = decodes_into(plan, case, q, k, v, 3)
        gpu = BusyGPU(monkeypatch)
        for out in (a, b, c):
            plan.run(q, k, v, out)
        assert gpu.counts == [1, 1]
        # A host write waits for everything: the batch goes. Where the array's memory is not mapped (a discrete
        # GPU's), the write is a staging copy of its own, one more submission.
        upload = [1] if a.buffer.mapped is None else []
        a.write(np.full(case.query.shape, np.nan, np.float32))
        assert gpu.counts == [1, 1, 1] + upload
        plan.run(q, k, v, c)
        plan.run(q, k, v, a)
        assert gpu.counts == [1, 1, 1] + upload + [1, 1]   # after the wait, nothing is seen running: each goes at once
        gpu.catch_up()
        for out in (a, b, c):
            assert rel_error(out.numpy(), case.reference()) <= 1e-5


def test_riders_wait_on_their_batch(rng, device, monkeypatch):
    # Four ops, the last two submitted together: the first of those two waits on the second's fence.
    case = Case(rng, num_seqs=2, num_heads=NUM_HEADS, num_kv_heads=2, head_size=32, block_size=16, max_len=40)
    q, k, v, bt, sl = on_device(case)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS) as plan:
        outs = decodes_into(plan, case, q, k, v, 4)
        gpu = BusyGPU(monkeypatch)
        for out in outs:
            plan.run(q, k, v, out)
        stream = default_stream(device)
        stream.flush()
        assert gpu.counts == [1, 1, 2]
        gpu.catch_up()
        stream.synchronize()
        assert stream.query()
        for out in outs:
            assert rel_error(out.numpy(), case.reference()) <= 1e-5


def test_closing_what_a_batched_op_binds_waits_for_the_op(rng, device, monkeypatch):
    # Ops still in the stream's batch (not submitted) when everything they bind is closed and collected: they run
    # at the next wait, on live buffers, and the objects are destroyed after.
    case = long_case(rng)
    live = live_after_warming(device, case)
    q, k, v, bt, sl = on_device(case)
    plan = pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=NUM_HEADS)
    outs = decodes_into(plan, case, q, k, v, 4)
    gpu = BusyGPU(monkeypatch)
    for out in outs:
        plan.run(q, k, v, out)
    assert gpu.counts == [1, 1]
    for x in (plan, q, k, v, bt, sl):
        x.close()
    del plan, q, k, v, bt, sl
    gc.collect()
    gpu.catch_up()
    for out in outs:
        np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)
    # The batch went at the first wait; each read of memory that is not mapped (a discrete GPU's) is a staging copy.
    downloads = [1] * len(outs) if outs[0].buffer.mapped is None else []
    assert gpu.counts == [1, 1, 2] + downloads
    for out in outs:
        out.close()
    pagedvk.synchronize()
    gc.collect()
    from pagedvk.ops.decode import release_cached_plans
    release_cached_plans()
    assert device.live_objects() <= live
