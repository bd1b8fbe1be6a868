"""Eight Python threads on one device at once. Queue submission is serialized by device.lock; the
command pool and descriptor pools are only touched under it too; each paged_attention call records its
own command buffer and descriptor set, and a shared DecodePlan's cached launch is submitted by one thread
at a time (its submit holds the lock through the fence wait)."""

import numpy as np
import pytest
import vulkan as vk

import pagedvk
import pagedvk.testing.reference
from support import THREADS, Case, run_threads


def close(a, b):
    # Each head's result to 1e-5 of the float64 reference.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_eight_threads_each_with_their_own_problems(device):
    # Different shapes per thread, new data every call: one thread's arrays, plans or command buffers
    # leaking into another's would show as a wrong result.
    cases = [[Case(np.random.default_rng(100 * i + j), num_seqs=1 + i % 3, num_heads=4 * (1 + i % 2),
                   num_kv_heads=(1, 2, 4)[i % 3], head_size=(32, 64, 128)[i % 3], block_size=(8, 16, 32)[j % 3],
                   max_len=200) for j in range(3)] for i in range(THREADS)]
    refs = [[c.reference() for c in row] for row in cases]

    def body(i):
        for n in range(15):
            case = cases[i][n % 3]
            if n % 2:   # numpy in and out: temporaries made and freed by the call
                out = pagedvk.paged_attention(*case.args())
            else:       # device caches, numpy tables
                q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
                out = pagedvk.paged_attention(q, k, v, case.block_tables, case.seq_lens).numpy()
                for a in (q, k, v):
                    a.close()
            close(out, refs[i][n % 3])

    run_threads(body)


def test_threads_share_one_plan(rng, device):
    # One plan (one step's tables) over shared device caches, as an engine's layers would be run from
    # several threads: each thread its own query and output (its own cached launch) ...
    case = Case(rng, num_seqs=4, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, max_len=300)
    k, v = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
    queries = [np.random.default_rng(i).standard_normal(case.query.shape).astype(np.float32) for i in range(THREADS)]
    refs = [pagedvk.testing.reference.paged_attention(q, *case.args()[1:]) for q in queries]
    with pagedvk.DecodePlan.for_caches(k, v, case.block_tables, case.seq_lens, num_heads=8) as plan:

        def body(i):
            q, out = pagedvk.asarray(queries[i]), pagedvk.empty(case.query.shape)
            for _ in range(20):
                out.write(np.full(case.query.shape, np.nan, np.float32))
                close(plan.run(q, k, v, out).numpy(), refs[i])

        run_threads(body)
    k.close()
    v.close()


def test_threads_submit_one_cached_launch(rng, device, monkeypatch):
    # ... and all threads on the same query and output: the plan's one cached launch (one command buffer,
    # one fence) submitted by eight threads at once. Its submit must hold the device lock through the
    # fence wait, or a second submission could reach the queue while the first still runs (checked
    # here on every wait, and by the validation layer in the validation pass).
    case = Case(rng, num_seqs=3, num_heads=4, num_kv_heads=4, head_size=32, block_size=8, max_len=100)
    q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
    out = pagedvk.empty(case.query.shape)
    ref = case.reference()
    real_wait = vk.vkWaitForFences

    def wait_holding_the_lock(*args):
        assert device.lock._is_owned(), "a fence was waited on without the device lock"
        return real_wait(*args)

    monkeypatch.setattr(vk, "vkWaitForFences", wait_holding_the_lock)
    with pagedvk.DecodePlan.for_caches(k, v, case.block_tables, case.seq_lens, num_heads=4) as plan:

        def body(i):
            for _ in range(30):
                plan.run(q, k, v, out)
                # every run writes the same values, and a download never overlaps a run (the lock)
                close(out.numpy(), ref)

        run_threads(body)
        assert len(plan.recorded_launches) == 1, "the threads did not share one cached launch"
    for a in (q, k, v, out):
        a.close()


def test_threads_make_and_free_objects(device):
    # Arrays and command buffers made and dropped in every thread: the finalizers that free them run in
    # whichever thread the garbage collector happens to be in, and must take the device lock.
    import gc
    gc.collect()
    live = device.live_objects()

    def body(i):
        for n in range(200):
            a = pagedvk.zeros(64 + i) if n % 2 else pagedvk.asarray(np.full(64, i, np.int32))
            if n % 3 == 0:
                a.close()
            elif n % 2 == 0:
                assert (a.numpy() == i).all()

    run_threads(body)
    gc.collect()
    assert device.live_objects() == live


@pytest.mark.parametrize("n", [2, THREADS])
def test_thread_results_do_not_depend_on_the_thread_count(rng, device, n):
    # The same 16 calls split over 2 or 8 threads give bit-identical results: nothing is shared between
    # concurrent calls that could change their arithmetic.
    cases = [Case(np.random.default_rng(i), num_seqs=2, head_size=64, max_len=120) for i in range(16)]
    serial = [pagedvk.paged_attention(*c.args()) for c in cases]
    results = [None] * 16

    def body(i):
        for j in range(i, 16, n):
            results[j] = pagedvk.paged_attention(*cases[j].args())

    run_threads(body, n)
    for a, b in zip(results, serial):
        np.testing.assert_array_equal(a, b)


def test_threads_sharing_a_plan_with_many_arrays(rng):
    # More distinct (query, out) pairs than a plan keeps recorded launches (32): eviction under load
    # must never close a launch another thread is about to submit.
    from pagedvk.ops.decode_plan import RECORDED_LAUNCHES
    case = Case(rng, num_seqs=2, num_heads=4, num_kv_heads=2, head_size=32, block_size=8, max_len=40)
    k, v = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
    plan = pagedvk.DecodePlan.for_caches(k, v, case.block_tables, case.seq_lens, num_heads=4)
    queries = [rng.standard_normal(case.query.shape).astype(np.float32) for _ in range(RECORDED_LAUNCHES + 8)]
    refs = [pagedvk.testing.reference.paged_attention(q, case.key_cache, case.value_cache, case.block_tables,
                                              case.seq_lens) for q in queries]
    pairs = [(pagedvk.asarray(q), pagedvk.empty(q.shape)) for q in queries]
    errors = []

    def work(t):
        for i in range(len(pairs)):
            j = (i + 5 * t) % len(pairs)
            out = plan.run(pairs[j][0], k, v, out=pairs[j][1]).numpy()
            if not np.allclose(out, refs[j], rtol=1e-5, atol=1e-5):
                errors.append(j)

    run_threads(work, 8)
    plan.close()
    assert not errors
