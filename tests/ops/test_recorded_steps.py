"""pagedvk.record(): a decode step (each layer's cache write and attention) recorded once and replayed in one
submission, with the step's inputs and the plan updated in place between replays; every replay checked against the
same ops called one by one and against float64."""

import numpy as np
import pytest

import pagedvk
import pagedvk.testing.reference as reference
from support import rel_error

LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 3, 8, 2, 64, 16, 48
TOL = 1e-5


class Step:
    """One decode step's inputs for every layer, on the device, written in place for the next step."""

    def __init__(self, num_seqs):
        self.q = [pagedvk.zeros((num_seqs, NUM_HEADS, HEAD_SIZE)) for _ in range(LAYERS)]
        self.k = [pagedvk.zeros((num_seqs, NUM_KV_HEADS, HEAD_SIZE)) for _ in range(LAYERS)]
        self.v = [pagedvk.zeros((num_seqs, NUM_KV_HEADS, HEAD_SIZE)) for _ in range(LAYERS)]
        self.out = [pagedvk.asarray(np.full((num_seqs, NUM_HEADS, HEAD_SIZE), np.nan, np.float32))
                    for _ in range(LAYERS)]
        self.slots = pagedvk.zeros((num_seqs,), np.int32)

    def fill(self, rng, slots):
        host = {}
        for name in ("q", "k", "v"):
            host[name] = []
            for a in getattr(self, name):
                x = rng.standard_normal(a.shape).astype(np.float32)
                a.write(x)
                host[name].append(x)
        for o in self.out:
            o.write(np.full(o.shape, np.nan, np.float32))
        self.slots.write(np.asarray(slots, np.int32))
        return host

    def run(self, plan, cache):
        """The step's ops, one by one (or recorded, inside pagedvk.record())."""
        for layer in range(LAYERS):
            pagedvk.reshape_and_cache(self.k[layer], self.v[layer], cache.key[layer], cache.value[layer], self.slots)
            plan.run(self.q[layer], cache.key[layer], cache.value[layer], out=self.out[layer])


def expected(host, caches, slots, tables, lens):
    """float64 outputs of every layer, the host caches updated as the step writes them."""
    outs = []
    for layer in range(LAYERS):
        caches[layer] = reference.reshape_and_cache(host["k"][layer], host["v"][layer], *caches[layer], slots)
        outs.append(reference.paged_attention(host["q"][layer], *caches[layer], tables, lens))
    return outs


def tables_for(lens, max_blocks):
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    for s, n in enumerate(lens):
        used = -(-int(n) // BLOCK_SIZE)
        tables[s, :used] = np.arange(used) + s * max_blocks
    return tables


def new_slots(tables, lens):
    return [int(tables[s, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for s, n in enumerate(lens)]


def test_a_replayed_step_matches_the_ops_one_by_one_as_the_batch_grows(rng):
    max_blocks = NUM_BLOCKS // 3
    cache = pagedvk.KVCache(num_layers=LAYERS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                            dtype=np.float32, num_blocks=NUM_BLOCKS)
    twin = pagedvk.KVCache(num_layers=LAYERS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                           dtype=np.float32, num_blocks=NUM_BLOCKS)
    start = [rng.standard_normal(cache.spec.key_shape).astype(np.float32) for _ in range(LAYERS)], \
        [rng.standard_normal(cache.spec.value_shape).astype(np.float32) for _ in range(LAYERS)]
    host = []
    for layer in range(LAYERS):
        for c in (cache, twin):
            c.key[layer].write(start[0][layer])
            c.value[layer].write(start[1][layer])
        host.append((start[0][layer], start[1][layer]))
    lens = np.array([3, 60, 17], np.int32)
    tables = tables_for(lens, max_blocks)
    replayed, by_one = Step(3), Step(3)
    # 32-token partitions: the split changes as the sequences grow, and the step is recorded again then.
    with cache.decode_plan(tables, lens, num_heads=NUM_HEADS, partition_size=32) as plan, \
            twin.decode_plan(tables, lens, num_heads=NUM_HEADS, partition_size=32) as twin_plan:
        with pagedvk.record() as step:
            replayed.run(plan, cache)
        assert step.ops == ["reshape_and_cache", "DecodePlan.run"] * LAYERS
        generations = []
        for n in range(4):
            if n:
                lens = lens + 14
                tables = tables_for(lens, max_blocks)
                plan.update(tables, lens)
                twin_plan.update(tables, lens)
            slots = new_slots(tables, lens)
            seed = int(rng.integers(1 << 30))
            inputs = replayed.fill(np.random.default_rng(seed), slots)
            by_one.fill(np.random.default_rng(seed), slots)
            step.replay()
            by_one.run(twin_plan, twin)
            refs = expected(inputs, host, slots, tables, lens)
            for layer in range(LAYERS):
                got = replayed.out[layer].numpy()
                np.testing.assert_array_equal(got, by_one.out[layer].numpy())
                assert rel_error(got, refs[layer]) <= TOL
                np.testing.assert_array_equal(cache.key[layer].numpy(), twin.key[layer].numpy())
            generations.append((plan.generation, plan.num_partitions))
        assert len({g for g, _ in generations}) > 1, "the split never changed: the re-recording went untested"
    step.close()
    cache.close()
    twin.close()


def test_a_recorded_merge(rng):
    a, b = (rng.standard_normal((4, 8, 64)).astype(np.float32) for _ in range(2))
    la, lb = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    arrays = [pagedvk.asarray(x) for x in (a, la, b, lb)]
    with pagedvk.record() as step:
        out, lse = pagedvk.merge_attention_states(*arrays)
    step.replay()
    ref_out, ref_lse = reference.merge_attention_states(a, la, b, lb)
    assert rel_error(out.numpy(), ref_out) <= TOL
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.fixture
def small(rng):
    cache = pagedvk.KVCache(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                            dtype=np.float32, num_blocks=8)
    cache.key[0].write(np.ones(cache.spec.key_shape, np.float32))
    cache.value[0].write(np.ones(cache.spec.value_shape, np.float32))
    plan = cache.decode_plan([[0, 1]], [20], num_heads=NUM_HEADS)
    q = pagedvk.zeros((1, NUM_HEADS, HEAD_SIZE))
    yield cache, plan, q
    plan.close()
    cache.close()


def test_host_arrays_are_refused_inside_a_recording_by_name(small):
    cache, plan, q = small
    with pagedvk.record() as step:
        with pytest.raises(TypeError, match=r"DecodePlan.run inside pagedvk.record\(\): query must be a DeviceArray"):
            plan.run(np.zeros(q.shape, np.float32), cache.key[0], cache.value[0])
        with pytest.raises(TypeError, match=r"reshape_and_cache inside pagedvk.record\(\): slot_mapping must be a "
                                            "DeviceArray"):
            pagedvk.reshape_and_cache(pagedvk.zeros((1, 2, 64)), pagedvk.zeros((1, 2, 64)), cache.key[0],
                                      cache.value[0], np.zeros(1, np.int32))
    assert step.ops == []


def test_ops_that_cannot_be_recorded_say_so(small):
    cache, plan, q = small
    with pagedvk.record():
        with pytest.raises(pagedvk.PagedVKError, match="paged_attention_prefill and paged_attention_backward "
                                                       "cannot be recorded"):
            pagedvk.paged_attention_prefill(q, cache.key[0], cache.value[0], np.array([[0, 1]], np.int32),
                                            np.array([20], np.int32), np.array([0, 1], np.int32))
        with pytest.raises(pagedvk.PagedVKError, match="copy_blocks cannot be recorded"):
            cache.copy_blocks([[0, 1]])
        with pytest.raises(pagedvk.PagedVKError, match="paged_attention .record a DecodePlan's run instead. cannot"):
            pagedvk.paged_attention(q, cache.key[0], cache.value[0], np.array([[0, 1]], np.int32),
                                    np.array([20], np.int32))


def test_replay_outside_the_block_and_after_close(small):
    cache, plan, q = small
    with pagedvk.record() as step:
        out = plan.run(q, cache.key[0], cache.value[0])
        with pytest.raises(pagedvk.PagedVKError, match="replay.. runs after"):
            step.replay()
    with pytest.raises(pagedvk.PagedVKError, match="recording has ended"):
        step.add("DecodePlan.run", lambda: [])
    step.replay()
    np.testing.assert_allclose(out.numpy(), 1.0, rtol=1e-6)   # every value 1
    plan.close()
    with pytest.raises(pagedvk.ClosedError):
        step.replay()   # the plan it ran is closed
    step.close()
    with pytest.raises(pagedvk.ClosedError, match="the recorded step is closed"):
        step.replay()


def test_append_and_run_writes_and_attends_in_one_submission(rng, monkeypatch):
    # Three steps of one layer: each writes a new token per sequence and attends over it, fused; the first call
    # records the pair, the later ones resubmit it (one submission each), every step against float64.
    from pagedvk.runtime.stream import Stream
    cache = pagedvk.KVCache(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                            dtype=np.float32, num_blocks=NUM_BLOCKS)
    host = (rng.standard_normal(cache.spec.key_shape).astype(np.float32),
            rng.standard_normal(cache.spec.value_shape).astype(np.float32))
    cache.key[0].write(host[0])
    cache.value[0].write(host[1])
    lens = np.array([7, 30], np.int32)
    tables = tables_for(lens + 3, 4)
    q, k, v = pagedvk.zeros((2, NUM_HEADS, HEAD_SIZE)), pagedvk.zeros((2, 2, HEAD_SIZE)), pagedvk.zeros((2, 2, HEAD_SIZE))
    slots, out = pagedvk.zeros((2,), np.int32), pagedvk.zeros((2, NUM_HEADS, HEAD_SIZE))
    enqueued = []
    real = Stream.enqueue
    monkeypatch.setattr(Stream, "enqueue", lambda self, cb: enqueued.append(cb.name) or real(self, cb))
    with cache.decode_plan(tables, lens + 1, num_heads=NUM_HEADS) as plan:
        for step in range(3):
            lens = lens + 1
            if step:
                plan.update(tables, lens)
            new = [rng.standard_normal(a.shape).astype(np.float32) for a in (q, k, v)]
            for a, x in zip((q, k, v), new):
                a.write(x)
            slot_values = new_slots(tables, lens)
            slots.write(np.array(slot_values, np.int32))
            out.write(np.full(out.shape, np.nan, np.float32))
            enqueued.clear()
            assert plan.append_and_run(k, v, slots, q, cache.key[0], cache.value[0], out=out) is out
            assert len(enqueued) == 1 and "reshape_and_cache" in enqueued[0] and "paged_decode" in enqueued[0]
            host = reference.reshape_and_cache(new[1], new[2], *host, slot_values)
            ref = reference.paged_attention(new[0], *host, tables, lens)
            assert rel_error(out.numpy(), ref) <= TOL
        with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 100000 is outside the caches"):
            plan.append_and_run(k, v, pagedvk.asarray(np.array([0, 100000], np.int32)), q, cache.key[0],
                                cache.value[0], out=out)
        with pytest.raises(TypeError, match="DecodePlan.append_and_run: key must be a DeviceArray, got ndarray"):
            plan.append_and_run(new[1], v, slots, q, cache.key[0], cache.value[0], out=out)
    cache.close()
