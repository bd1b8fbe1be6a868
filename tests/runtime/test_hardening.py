"""Hardening: bad tables that skip the Python checks, allocation failures, lost devices, timeouts, leaks
over long runs, and closed objects. docs/RELIABILITY.md lists each case with the test that shows it."""

import gc
import os

import numpy as np
import pytest
import vulkan as vk

import pagedvk
import pagedvk.config
import pagedvk.testing.reference
from support import Case, PrefillCase, assert_untouched, fenced, rel_error
from pagedvk.ops.decode import release_cached_plans
from pagedvk.errors import GPUTimeoutError
from pagedvk.runtime import commands

def rss_mib() -> float:
    """Resident host memory of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def close_all(*arrays):
    for a in arrays:
        a.close()


def lasting(device) -> int:
    """Live Vulkan objects other than pipelines. A pipeline is made at its kernel's first use and lives as long
    as its device, so what a test leaves behind is counted the same whether or not an earlier test made them."""
    return device.live_objects() - len(device.pipelines)


@pytest.fixture
def warm(device):
    """The device after a decode: the one-shot machinery's first-use objects made, so live-object counts
    (lasting()) compare like with like."""
    case = Case(np.random.default_rng(0), num_seqs=1, head_size=32, max_len=20)
    pagedvk.paged_attention(*case.args())
    release_cached_plans(device)   # the pipeline stays; the one-shot plan kept for that shape goes
    gc.collect()
    return device


# -- 2. kernels that cannot stray --------------------------------------------------------------------


def bad_tables(case, num_blocks):
    """Block tables and lengths where every other sequence is out of bounds in another way: ids at
    num_blocks, huge, negative, lengths past the table and far past it, a negative length. Sequences
    0, 2, 4, ... keep their valid rows."""
    bt, sl = case.block_tables.copy(), case.seq_lens.copy()
    capacity = bt.shape[1] * case.block_size
    bt[1, 0] = num_blocks
    bt[3, :] = 2**31 - 1
    bt[5, 0], bt[5, 1] = -1, -2**31
    sl[7] = capacity + 1
    sl[9] = 2**31 - 1
    sl[11] = -5
    return bt, sl


def test_unchecked_device_tables_stay_inside_their_buffers(rng, warm):
    # An engine that trusts its tables runs with validate=False and updates them on the device in place:
    # no Python check ever sees the values, so the kernel's own bounds are all that keep it inside the
    # caches. Sentinels right before and after the caches and the output, in the same buffer, must keep
    # their pattern (a stray read or write past a binding lands in its neighbours).
    device = warm
    live = lasting(device)
    case = Case(rng, num_seqs=12, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, max_len=100)
    num_blocks = case.key_cache.shape[0]
    poison = np.full(case.query.shape, np.nan, np.float32)
    (k, v, out), guards = fenced(device, case.key_cache, case.value_cache, poison)
    q = pagedvk.asarray(case.query)
    bt, sl = pagedvk.asarray(case.block_tables), pagedvk.asarray(case.seq_lens)
    ref = case.reference()
    valid = list(range(0, 12, 2))

    plan = pagedvk.DecodePlan(bt, sl, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                              num_blocks=num_blocks, validate=False)
    plan.run(q, k, v, out)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)

    bad_bt, bad_sl = bad_tables(case, num_blocks)
    bt.write(bad_bt)   # the plan's tables, now bad: the plan reads them on the device at each run
    sl.write(bad_sl)
    for _ in range(3):
        result = plan.run(q, k, v, out).numpy()
        assert np.isfinite(result).all()
        np.testing.assert_allclose(result[valid], ref[valid], rtol=1e-5, atol=1e-5)
    # The one-call op, with the bad tables given directly.
    result = pagedvk.paged_attention(q, k, v, bt, sl, validate=False).numpy()
    assert np.isfinite(result).all()
    np.testing.assert_allclose(result[valid], ref[valid], rtol=1e-5, atol=1e-5)

    np.testing.assert_array_equal(k.numpy(), case.key_cache)
    np.testing.assert_array_equal(v.numpy(), case.value_cache)
    assert_untouched(*guards)
    plan.close()
    # The device lives on: not lost, and a valid run is right.
    assert device.lost is None
    assert np.allclose(pagedvk.paged_attention(*case.args()), ref, rtol=1e-5, atol=1e-5)
    close_all(k, v, q, out, bt, sl, *guards)
    release_cached_plans()   # one-shot calls keep their plans: a bounded cache, not a leak
    gc.collect()
    assert lasting(device) == live   # nothing the runs made is left behind


def test_every_id_and_length_bad(rng, device):
    # No sequence valid at all: every used id out of range or a length far past the table. The kernel
    # must give zeros (no key in range), not NaN from an empty softmax, nor hang on a 2**31 - 1 length.
    case = Case(rng, num_seqs=4, num_heads=2, num_kv_heads=1, head_size=32, block_size=8, max_len=40)
    bt = np.where(np.arange(case.block_tables.size).reshape(case.block_tables.shape) % 2,
                  -7, 10**6).astype(np.int32)
    sl = np.array([2**31 - 1, 1, 8, case.block_tables.shape[1] * 8], np.int32)
    (k, v), guards = fenced(device, case.key_cache, case.value_cache)
    out = pagedvk.paged_attention(case.query, k, v, pagedvk.asarray(bt), pagedvk.asarray(sl), validate=False)
    assert (out == 0).all()
    assert_untouched(*guards)


# -- 3. device errors: out of memory -------------------------------------------------------------------


def test_allocation_larger_than_the_heap_is_out_of_memory(device):
    # Asking Vulkan for more than a heap is invalid usage, so the library refuses it itself, naming the
    # size and the heap (its size, or the driver's budget with VK_EXT_memory_budget).
    budget = device.memory_budget()
    live = lasting(device)
    nbytes = budget.size + (1 << 20)
    with pytest.raises(pagedvk.OutOfMemoryError) as e:
        device.buffer(nbytes)
    assert isinstance(e.value, MemoryError)
    assert str(nbytes) in str(e.value) and f"heap {budget.heap}" in str(e.value)
    assert e.value.nbytes == nbytes and e.value.budget.source in ("heap size", "VK_EXT_memory_budget")
    assert lasting(device) == live


def test_driver_out_of_memory_is_out_of_memory(device):
    # 1 TiB: lavapipe's vkCreateBuffer itself returns VK_ERROR_OUT_OF_DEVICE_MEMORY (a real driver
    # failure, no memory touched); a driver that makes the buffer hits the heap check instead.
    live = lasting(device)
    with pytest.raises(pagedvk.OutOfMemoryError, match=str(2**40)) as e:
        device.buffer(2**40)
    assert "heap" in str(e.value)
    assert lasting(device) == live
    a = pagedvk.asarray(np.arange(8, dtype=np.int32))
    assert (a.numpy() == np.arange(8)).all()
    a.close()


def test_allocate_until_it_fails_then_recover(device, monkeypatch):
    # Chunks of a quarter of the budget until the first failure. lavapipe over-commits (its memory is the
    # host's, untouched until used) and would never fail, so the driver's allocations are capped at three
    # chunks more than now: the failure path, its message and the recovery run on every device.
    budget = device.memory_budget()
    chunk = max(budget.budget // 4, 1 << 20)
    allocate, allocated = vk.vkAllocateMemory, [0]

    def capped(d, info, allocator):
        if allocated[0] + info.allocationSize > 3 * chunk + (1 << 20):   # room for alignment
            raise vk.VkErrorOutOfDeviceMemory()
        memory = allocate(d, info, allocator)
        allocated[0] += info.allocationSize
        return memory

    monkeypatch.setattr(vk, "vkAllocateMemory", capped)
    live = lasting(device)
    held, failure = [], None
    for _ in range(8):
        try:
            held.append(device.buffer(chunk))
        except pagedvk.OutOfMemoryError as e:
            failure = e
            break
    assert failure is not None and len(held) == 3
    assert str(chunk) in str(failure) and f"heap {budget.heap}" in str(failure) and "out of device memory" in str(failure)
    assert lasting(device) == live + len(held)   # the failed one left nothing behind
    for b in held:
        b.close()
    assert lasting(device) == live
    allocated[0] = 0   # the closed buffers gave their memory back: the cap starts again
    again = device.buffer(chunk)
    again.close()


@pytest.mark.parametrize("error", [vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory])
def test_simulated_out_of_memory(device, monkeypatch, error):
    # A driver that does run out: vkAllocateMemory fails. The half-made buffer is destroyed and the
    # error names the size and the budget.
    def fail(*args, **kw):
        raise error()

    live = lasting(device)
    monkeypatch.setattr(vk, "vkAllocateMemory", fail)
    with pytest.raises(pagedvk.OutOfMemoryError) as e:
        pagedvk.empty((1000, 1000))
    kind = "device" if error is vk.VkErrorOutOfDeviceMemory else "host"
    assert f"out of {kind} memory" in str(e.value) and "4000000 bytes" in str(e.value)
    assert f"heap {device.memory_budget().heap}" in str(e.value) and e.value.budget is not None
    assert lasting(device) == live
    monkeypatch.undo()
    a = pagedvk.asarray(np.ones(1000, np.float32))
    assert a.numpy().sum() == 1000
    a.close()


# -- 3. device errors: lost device ---------------------------------------------------------------------


@pytest.mark.parametrize("call", ["queue_submit", "wait_for_fences"])
def test_device_lost(rng, monkeypatch, call):
    # Simulated on a device of its own (a real loss ends the device for good). The call raises
    # DeviceLostError saying so, every later use does too, close() still frees everything, and a new
    # device works. (Submissions call the driver through pagedvk.runtime.commands' raw entry points.)
    dev = pagedvk.Device(pagedvk.devices()[0])
    case = Case(rng, num_seqs=2, head_size=32, max_len=40)
    k, v = pagedvk.asarray(case.key_cache, device=dev), pagedvk.asarray(case.value_cache, device=dev)

    def lost(*args):
        return vk.VK_ERROR_DEVICE_LOST

    monkeypatch.setattr(commands, call, lost)
    with pytest.raises(pagedvk.DeviceLostError, match="VK_ERROR_DEVICE_LOST.*open a new one"):
        pagedvk.paged_attention(case.query, k, v, case.block_tables, case.seq_lens)
    monkeypatch.undo()
    assert dev.lost is not None
    with pytest.raises(pagedvk.DeviceLostError, match="was lost earlier"):
        pagedvk.empty(4, device=dev)
    with pytest.raises(pagedvk.DeviceLostError):
        k.numpy()
    dev.close()
    dev.close()
    assert dev.live_objects() == 0 and k.closed
    with pagedvk.Device(pagedvk.devices()[0]) as fresh:
        out = pagedvk.paged_attention(case.query, pagedvk.asarray(case.key_cache, device=fresh),
                                      pagedvk.asarray(case.value_cache, device=fresh), case.block_tables,
                                      case.seq_lens)
        np.testing.assert_allclose(out, case.reference(), rtol=1e-5, atol=1e-5)


# -- 3. device errors: timeouts ------------------------------------------------------------------------


def long_case(rng, device):
    # Still running a nanosecond after its submission: tens of milliseconds on lavapipe (2048 tokens a sequence,
    # a few milliseconds, ended before the wait once in a cold CI run on 2 busy cores, 2026-12-07); on a GPU, half a
    # GiB of cache per launch (a fraction of a millisecond, far longer than the few microseconds of Python between the
    # submission and the wait).
    if device.info.type == "cpu":
        return Case(rng, num_seqs=4, num_heads=8, num_kv_heads=2, head_size=128, block_size=32, seq_lens=[8192] * 4)
    return Case(rng, num_seqs=64, num_heads=8, num_kv_heads=1, head_size=128, block_size=32, seq_lens=[8192] * 64)


@pytest.mark.parametrize("spin_us", ["0", "100000"])   # a PAGEDVK_TIMEOUT shorter than the fence polling too
def test_timeout_then_the_device_goes_on(rng, warm, monkeypatch, spin_us):
    monkeypatch.setenv("PAGEDVK_SPIN_US", spin_us)
    # PAGEDVK_TIMEOUT=1e-9: the run is queued, and the wait that follows gives up at once with the TimeoutError
    # subclass, naming the op, while the kernel still runs. The recorded launch is then still pending: the next run
    # must wait for it before submitting it again, and nothing it uses may be freed under it (validation checks
    # both).
    device = warm
    live = lasting(device)
    case = long_case(rng, device)
    q, k, v, bt, sl = (pagedvk.asarray(a) for a in case.args())
    out = pagedvk.empty(case.query.shape)
    with pagedvk.DecodePlan.for_caches(k, v, bt, sl, num_heads=8, validate=False) as plan:
        expected = plan.run(q, k, v, out).numpy()
        monkeypatch.setenv("PAGEDVK_TIMEOUT", "1e-9")
        assert plan.run(q, k, v, out) is out   # queued: no wait yet
        # The wait names the op it gave up on: the decode, or, where the decode ended before the read came (a fast
        # GPU under a busy host), the read's own copy.
        with pytest.raises(GPUTimeoutError, match="did not finish (paged_decode|download).* within "
                                                  "PAGEDVK_TIMEOUT=1e-09") as e:
            out.numpy()
        assert isinstance(e.value, TimeoutError)
        # A call made meanwhile times out too (waiting for the first, or for its own kernel); it frees its
        # output and launch at once, but Vulkan destroys them only once nothing runs any more.
        with pytest.raises(TimeoutError):
            pagedvk.paged_attention(q, k, v, bt, sl, validate=False).numpy()
        monkeypatch.delenv("PAGEDVK_TIMEOUT")
        out.write(np.zeros(case.query.shape, np.float32))
        np.testing.assert_array_equal(plan.run(q, k, v, out).numpy(), expected)
    if device.info.type == "cpu":   # (the GPU-sized case is too big for a quick float64 reference)
        np.testing.assert_allclose(expected, case.reference(), rtol=1e-5, atol=1e-5)
    close_all(q, k, v, bt, sl, out)
    release_cached_plans()   # one-shot calls keep their plans: a bounded cache, not a leak
    gc.collect()
    assert lasting(device) == live


def test_simulated_timeout(rng, warm, monkeypatch):
    # A driver whose fence wait returns VK_TIMEOUT, once.
    real = commands.wait_for_fences
    calls = []

    def times_out_once(*args):
        calls.append(args)
        if len(calls) == 1:
            return vk.VK_TIMEOUT
        return real(*args)

    case = Case(rng, num_seqs=2, head_size=32, max_len=40)
    live = lasting(warm)
    monkeypatch.setattr(commands, "wait_for_fences", times_out_once)
    with pytest.raises(GPUTimeoutError):
        pagedvk.paged_attention(*case.args())
    out = pagedvk.paged_attention(*case.args())
    np.testing.assert_allclose(out, case.reference(), rtol=1e-5, atol=1e-5)
    release_cached_plans()   # one-shot calls keep their plans: a bounded cache, not a leak
    gc.collect()
    assert lasting(warm) == live


# -- 4. no leaks ---------------------------------------------------------------------------------------

SOAK_LAUNCHES = 100_000
# Host memory may grow this much after the warm-up. The validation layer keeps records of its own per
# object made (31 MiB over the 10,000 arrays on NVIDIA's driver; none on lavapipe): more room under it.
RSS_BOUND_MIB = 64 if pagedvk.config.validation() else 20


@pytest.mark.slow
def test_soak_launches_hold_memory_flat(rng, device):
    # 100,000 decode launches through one plan (about 13 s on lavapipe): host memory and the number of
    # live Vulkan objects must not grow, measured after a warm-up.
    case = Case(rng, num_seqs=1, num_heads=1, num_kv_heads=1, head_size=32, block_size=8, seq_lens=[9])
    q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
    bt, sl = pagedvk.asarray(case.block_tables), pagedvk.asarray(case.seq_lens)
    out = pagedvk.empty(case.query.shape)
    plan = pagedvk.DecodePlan(bt, sl, num_heads=1, num_kv_heads=1, head_size=32, block_size=8,
                              num_blocks=case.key_cache.shape[0], validate=False)
    for _ in range(1000):
        plan.run(q, k, v, out)
    gc.collect()
    rss, live = rss_mib(), lasting(device)
    for _ in range(SOAK_LAUNCHES):
        plan.run(q, k, v, out)
    gc.collect()
    assert lasting(device) == live
    assert rss_mib() - rss < RSS_BOUND_MIB, f"host memory grew {rss_mib() - rss:.1f} MiB over {SOAK_LAUNCHES} launches"
    np.testing.assert_allclose(out.numpy(), case.reference(), rtol=1e-5, atol=1e-5)
    plan.close()
    close_all(q, k, v, bt, sl, out)


@pytest.mark.slow
def test_array_cycles_hold_memory_flat(device):
    # 10,000 arrays made and freed, half by close() and half by dropping them (the garbage collector's
    # finalizer), zeros() also recording and freeing a command buffer each time.
    host = np.arange(256, dtype=np.float32)

    def cycle(i):
        a = pagedvk.asarray(host) if i % 2 else pagedvk.zeros(256)
        if i % 4 < 2:
            a.close()

    for i in range(500):
        cycle(i)
    gc.collect()
    rss, live = rss_mib(), lasting(device)
    for i in range(10_000):
        cycle(i)
    gc.collect()
    assert lasting(device) == live
    assert rss_mib() - rss < RSS_BOUND_MIB, f"host memory grew {rss_mib() - rss:.1f} MiB over 10,000 arrays"


# -- 4. closed objects ---------------------------------------------------------------------------------


def test_closed_array_is_refused_by_the_ops(rng, device):
    # A closed cache bound to a kernel would reach the GPU as a null descriptor: ClosedError instead.
    case = Case(rng, num_seqs=2, head_size=32, max_len=40)
    k = pagedvk.asarray(case.key_cache)
    k.close()
    with pytest.raises(pagedvk.ClosedError, match="closed"):
        pagedvk.paged_attention(case.query, k, case.value_cache, case.block_tables, case.seq_lens)
    bt = pagedvk.asarray(case.block_tables)
    plan = pagedvk.DecodePlan(bt, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                              num_blocks=case.key_cache.shape[0])
    bt.close()   # the plan's own tables, closed under it
    with pytest.raises(pagedvk.ClosedError):
        plan.run(case.query, case.key_cache, case.value_cache)
    with pytest.raises(pagedvk.ClosedError):
        k.write(case.key_cache)
    plan.close()
    plan.close()   # idempotent


def test_closed_device_is_refused_everywhere(rng):
    dev = pagedvk.Device(pagedvk.devices()[0])
    case = Case(rng, num_seqs=2, head_size=32, max_len=40)
    k = pagedvk.asarray(case.key_cache, device=dev)
    buf = dev.buffer(64)
    cmd = dev.command_buffer()
    dev.close()
    for use in (lambda: dev.buffer(16), dev.command_buffer, lambda: dev.upload(buf, np.zeros(4, np.int32)),
                lambda: dev.download(buf), lambda: pagedvk.zeros(4, device=dev), k.numpy,
                cmd.submit, lambda: pagedvk.paged_attention(case.query, k, case.value_cache, case.block_tables,
                                                           case.seq_lens)):
        with pytest.raises(pagedvk.ClosedError):
            use()
    assert k.closed and buf.closed and dev.live_objects() == 0
    k.close()   # closing what the device already freed is fine
    cmd.close()


@pytest.mark.parametrize("backend", ["glsl", "wgsl"])
@pytest.mark.parametrize("ragged", [False, True], ids=["fixed_q_len", "ragged"])
def test_unchecked_tables_stay_inside_buffers_in_prefill_and_backward(rng, device, backend, ragged):
    # The same bad device-resident tables (validate=False) through the prefill forward and backward: the
    # kernels treat bad blocks as empty and clamp lengths, so valid sequences stay right, the caches and
    # the neighbouring sentinels are untouched, and nothing is written outside the gradient caches. The
    # ragged batch gives the bad sequences 1, 5 and 4 queries (sequence 5's 4 past its clamped length).
    shape = dict(q_lens=[3, 1, 0, 5, 2, 4]) if ragged else dict(q_len=3)
    case = PrefillCase(rng, **shape, layout="vllm", seq_lens=[40, 17, 64, 33, 20, 50], num_heads=4,
                       num_kv_heads=2, head_size=32)
    num_blocks = case.key_cache.shape[0]
    (k, v), guards = fenced(device, case.key_cache, case.value_cache)
    q = pagedvk.asarray(case.query)
    bad_bt, bad_sl = case.block_tables.copy(), case.seq_lens.copy()
    bad_bt[1, 0], bad_bt[3, :], bad_sl[5] = num_blocks, -(2**31), 2**31 - 1
    bt, sl = pagedvk.asarray(bad_bt), pagedvk.asarray(bad_sl)
    opts = dict(layout="vllm", backend=backend, validate=False)
    loc = [pagedvk.asarray(case.query_start_loc)] if ragged else []
    out, lse = pagedvk.paged_attention_prefill(q, k, v, bt, sl, *loc, **opts)
    ref_out, ref_lse = case.reference()
    valid = (np.concatenate([np.arange(*case.query_start_loc[s:s + 2]) for s in (0, 2, 4)]) if ragged
             else [0, 2, 4])
    got = out.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[valid], ref_out[valid], rtol=1e-5, atol=1e-5)
    dout = pagedvk.asarray(rng.standard_normal(case.query.shape).astype(np.float32))
    dq, dk, dv = pagedvk.paged_attention_backward(dout, q, k, v, bt, sl, out, lse, *loc, **opts)
    assert np.isfinite(dq.numpy()).all() and np.isfinite(dk.numpy()).all() and np.isfinite(dv.numpy()).all()
    ref_dq = pagedvk.testing.reference.paged_attention_backward(dout.numpy(), *case.args(), **case.options())[0]
    np.testing.assert_allclose(dq.numpy()[valid], ref_dq[valid], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(k.numpy(), case.key_cache)
    np.testing.assert_array_equal(v.numpy(), case.value_cache)
    assert_untouched(*guards)
    assert device.lost is None
    close_all(k, v, q, bt, sl, out, lse, dout, dq, dk, dv, *loc, *guards)


# -- issue 7 points 3 and 4: grids past the device's limits, lengths that outgrow a plan -----------------------

def test_grid_folded_past_the_device_limits(rng, device, monkeypatch):
    # More workgroups than the (here lowered) per-dimension limit allows: the launch folds them over the grid's
    # dimensions and each kernel numbers its workgroups linearly. Decode and prefill go through one rule.
    import dataclasses
    monkeypatch.setattr(device, "info", dataclasses.replace(device.info, max_workgroup_count=(7, 5, 64)))
    case = Case(rng, num_seqs=40, num_heads=8, num_kv_heads=2, head_size=32, max_len=300)
    with pagedvk.DecodePlan.for_caches(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 8,
                                       partition_size=128) as plan:
        assert plan.num_partitions > 1 and max(plan.grid) <= 64 and plan.grid[0] <= 7 and plan.grid[1] <= 5
        out = plan.run(case.query, case.key_cache, case.value_cache)
    assert rel_error(out, case.reference()) <= 1e-5
    q = rng.standard_normal((40, 8, 3, 32)).astype(np.float32)
    lens = np.maximum(case.seq_lens, 3)
    out, lse = pagedvk.paged_attention_prefill(q, case.key_cache, case.value_cache, case.block_tables, lens,
                                               layout="vllm")
    ref, ref_lse = pagedvk.testing.reference.paged_attention_prefill(q, case.key_cache, case.value_cache, case.block_tables,
                                                             lens, layout="vllm")
    assert rel_error(out, ref) <= 1e-5 and rel_error(lse, ref_lse) <= 1e-5


@pytest.mark.slow
def test_seventy_thousand_sequences(rng):
    # One decode step over more sequences than any grid dimension holds on lavapipe (65535): under
    # PAGEDVK_VALIDATION=1 a dispatch past the limit is VUID-vkCmdDispatch-groupCountY-00387.
    n = 70_000
    key_cache = rng.standard_normal((64, 1, 8, 8, 4)).astype(np.float32)
    value_cache = rng.standard_normal((64, 1, 32, 8)).astype(np.float32)
    block_tables = rng.integers(0, 64, (n, 1)).astype(np.int32)
    seq_lens = rng.integers(1, 9, n).astype(np.int32)
    query = rng.standard_normal((n, 1, 32)).astype(np.float32)
    out = pagedvk.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    check = rng.choice(n, 200, replace=False)
    ref = pagedvk.testing.reference.paged_attention(query[check], key_cache, value_cache, block_tables[check], seq_lens[check])
    assert rel_error(out[check], ref) <= 1e-5 and np.isfinite(out).all()


def test_lengths_that_outgrow_the_plan_are_covered(rng, device):
    # A plan made from device-resident lengths of 20 partitions for 20 tokens; the lengths are then rewritten to
    # up to 5000 (the block tables hold them). The last partition takes every token past its start, so the result
    # covers all of them (it was attention over the first 2048 tokens, relative error 0.7-1.5).
    case = Case(rng, seq_lens=[5000, 4000], num_heads=4, num_kv_heads=1, head_size=64, block_size=16)
    lens = pagedvk.asarray(np.array([20, 20], np.int32))
    with pagedvk.DecodePlan.for_caches(case.key_cache, case.value_cache, case.block_tables, lens, 4,
                                       validate=False) as plan:
        lens.write(case.seq_lens)
        out = plan.run(case.query, case.key_cache, case.value_cache)
    assert rel_error(out, case.reference()) <= 1e-5
    # The same with a split plan: partitions of 128 tokens planned for 300, lengths grown to 5000.
    lens.write(np.array([300, 300], np.int32))
    with pagedvk.DecodePlan.for_caches(case.key_cache, case.value_cache, case.block_tables, lens, 4,
                                       validate=False, partition_size=128) as plan:
        assert plan.num_partitions == 3
        lens.write(case.seq_lens)
        out = plan.run(case.query, case.key_cache, case.value_cache)
    assert rel_error(out, case.reference()) <= 1e-5


def test_spinning_wait_polls_and_sees_the_result(rng, warm, monkeypatch):
    # PAGEDVK_SPIN_US: waits poll the fence first. The result is the same and the polling really runs (a
    # PAGEDVK_TIMEOUT shorter than the spin: test_timeout_then_the_device_goes_on).
    real, polls = commands.get_fence_status, []

    def counting(*args):
        polls.append(args)
        return real(*args)

    monkeypatch.setattr(commands, "get_fence_status", counting)
    monkeypatch.setenv("PAGEDVK_SPIN_US", "100000")
    case = Case(rng, num_seqs=2, head_size=32, max_len=40)
    out = pagedvk.paged_attention(*case.args())
    np.testing.assert_allclose(out, case.reference(), rtol=1e-5, atol=1e-5)
    assert polls


def test_extension_error_codes_raise_their_errors():
    """The binding's table has VK_ERROR_OUT_OF_POOL_MEMORY and a few other extension errors at positive values;
    pagedvk adds the codes drivers return, so that a full descriptor pool raises VkErrorOutOfPoolMemory (and the
    next pool opens) instead of a KeyError from the binding."""
    import vulkan as vk
    from pagedvk.runtime import commands
    assert vk.exception_codes[-1000069000] is vk.VkErrorOutOfPoolMemory
    assert isinstance(commands.vk_error(-1000069000), vk.VkErrorOutOfPoolMemory)
