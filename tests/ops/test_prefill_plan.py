"""PrefillPlan: one plan per prefill step reused by every layer (FlashInfer's plan/run), its launches recorded once
per layer's buffers; checked against float64 and against paged_attention_prefill, on device and host arrays."""

import numpy as np
import pytest

import pagedvk
from support import PrefillCase, lse_error, rel_error

TOL = 1e-5


def layers(rng, case, n):
    """n layers of caches and queries like the case's (the first is the case's own), on the device."""
    out = []
    for i in range(n):
        k = case.key_cache if i == 0 else rng.standard_normal(case.key_cache.shape).astype(np.float32)
        v = case.value_cache if i == 0 else rng.standard_normal(case.value_cache.shape).astype(np.float32)
        q = case.query if i == 0 else rng.standard_normal(case.query.shape).astype(np.float32)
        out.append((q, k, v))
    return out


@pytest.mark.parametrize("ragged", [True, False])
def test_one_plan_serves_every_layer(rng, ragged):
    # Ragged: prompts, a chunk and decode tokens (which the forward hands to the decode kernel) in one batch.
    case = (PrefillCase(rng, q_lens=[40, 1, 17, 1], layout="vllm") if ragged
            else PrefillCase(rng, q_len=9, layout="vllm"))
    loc = case.query_start_loc if ragged else None
    host = layers(rng, case, 3)
    dev = [[pagedvk.asarray(a) for a in layer] for layer in host]
    outs = [pagedvk.asarray(np.full(case.query.shape, np.nan, np.float32)) for _ in host]
    lses = [pagedvk.asarray(np.full(case.query.shape[:-1], np.nan, np.float32)) for _ in host]
    with pagedvk.PrefillPlan(case.block_tables, case.seq_lens, loc, layout="vllm") as plan:
        for repeat in range(2):
            for (q, k, v), out, lse in zip(dev, outs, lses):
                assert plan.run(q, k, v, out=out, lse=lse) == (out, lse)
            assert len(plan._launches) == len(host), "a layer's launch was recorded again"
        for (q, k, v), out, lse in zip(host, outs, lses):
            ref_out, ref_lse = pagedvk.testing.reference.paged_attention_prefill(
                q, k, v, case.block_tables, case.seq_lens, *(() if loc is None else (loc,)), layout="vllm")
            assert rel_error(out.numpy(), ref_out) <= TOL
            assert lse_error(lse.numpy(), ref_lse) <= TOL
            one_call, _ = pagedvk.paged_attention_prefill(q, k, v, case.block_tables, case.seq_lens, loc)
            np.testing.assert_array_equal(out.numpy(), one_call)


def test_host_arrays_update_and_the_cache_form(rng):
    case = PrefillCase(rng, q_lens=[5, 12], layout="vllm")
    cache = pagedvk.KVCache(num_layers=1, num_kv_heads=2, head_size=64, dtype=np.float32,
                            num_blocks=case.key_cache.shape[0])
    cache.key[0].write(case.key_cache)
    cache.value[0].write(case.value_cache)
    with cache.prefill_plan(case.block_tables, case.seq_lens, case.query_start_loc) as plan:
        out, lse = plan.run(case.query, case.key_cache, case.value_cache, return_lse=True)   # numpy in, numpy out
        ref_out, ref_lse = case.reference()
        assert isinstance(out, np.ndarray) and rel_error(out, ref_out) <= TOL and lse_error(lse, ref_lse) <= TOL
        # The next step: the second sequence's chunk is shorter and later; the tables are the same shape.
        lens = case.seq_lens.copy()
        lens[1] -= 3
        loc = np.array([0, 5, 14], np.int32)
        plan.update(case.block_tables, lens, loc)
        q = rng.standard_normal((14, case.query.shape[1], 64)).astype(np.float32)
        got = plan.run(pagedvk.asarray(q), cache.key[0], cache.value[0])
        ref, _ = pagedvk.testing.reference.paged_attention_prefill(q, case.key_cache, case.value_cache,
                                                                    case.block_tables, lens, loc, layout="vllm")
        assert isinstance(got, pagedvk.DeviceArray) and rel_error(got.numpy(), ref) <= TOL
        with pytest.raises(ValueError, match=r"block_tables has shape \(2, 1\), the plan's is"):
            plan.update(case.block_tables[:, :1], lens, loc)
        with pytest.raises(ValueError, match="query_start_loc must be given exactly when"):
            plan.update(case.block_tables, lens)
    with pytest.raises(pagedvk.ClosedError, match="PrefillPlan.*is closed"):
        plan.run(case.query, case.key_cache, case.value_cache)
    cache.close()


def test_unknown_options_are_refused_by_name(rng):
    case = PrefillCase(rng, q_lens=[3], layout="vllm")
    with pytest.raises(TypeError, match="unexpected argument.s. partition_size"):
        pagedvk.PrefillPlan(case.block_tables, case.seq_lens, case.query_start_loc, partition_size=16)
    with pytest.raises(ValueError, match="block_tables"):
        pagedvk.PrefillPlan(case.block_tables[0], case.seq_lens, case.query_start_loc)


def test_a_steady_update_keeps_the_schedule_and_the_launches(rng):
    # The next step has the same query lengths (a steady batch of chunks and decode tokens), new lengths: the plan's
    # tables are written in place, its launches and schedule stay (nothing recorded or allocated again), and the
    # results follow the new lengths.
    case = PrefillCase(rng, q_lens=[24, 9, 1, 1], layout="vllm", seq_lens=[60, 50, 30, 20])
    q, k, v = (pagedvk.asarray(a) for a in (case.query, case.key_cache, case.value_cache))
    out = pagedvk.empty(case.query.shape)
    with pagedvk.PrefillPlan(case.block_tables, case.seq_lens, case.query_start_loc) as plan:
        plan.run(q, k, v, out=out)
        (problem, _, _), = plan._shapes.values()
        assert problem.decode_part is not None   # the two decode tokens go to the decode kernel
        launches = [kept[0] for kept in plan._launches.values()]
        owned = list(plan._owned)
        for step in range(1, 3):
            lens = case.seq_lens - 3 * step
            plan.update(case.block_tables, lens, case.query_start_loc)
            out.write(np.full(case.query.shape, np.nan, np.float32))
            plan.run(q, k, v, out=out)
            assert [kept[0] for kept in plan._launches.values()] == launches and plan._owned == owned
            ref, _ = pagedvk.testing.reference.paged_attention_prefill(case.query, case.key_cache, case.value_cache,
                                                                        case.block_tables, lens, case.query_start_loc,
                                                                        layout="vllm")
            assert rel_error(out.numpy(), ref) <= TOL
        with pytest.raises(ValueError, match=r"seq_lens\[1\] = 5 is less than q_len_s"):
            plan.update(case.block_tables, np.array([60, 5, 30, 20], np.int32), case.query_start_loc)
