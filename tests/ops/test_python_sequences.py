"""Python sequences of ints are taken wherever an op takes an int array (block tables, lengths, query_start_loc,
slots, block pairs), as numpy users pass them: each op gives what it gives for the int32 arrays, poisoned outputs
checked against float64; sequences of anything but ints are refused by the argument's name."""

import numpy as np
import pytest

import pagedvk
import pagedvk.ops.vllm
import pagedvk.testing.reference
from support import Case, PrefillCase, rel_error

TOL = 1e-5


def lists(*arrays):
    return [a.tolist() for a in arrays]


def test_decode_takes_lists(rng):
    case = Case(rng, num_seqs=3, head_size=64)
    tables, lens = lists(case.block_tables, case.seq_lens)
    out = case.poisoned_out()
    pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, tables, lens, out=out)
    assert rel_error(out, case.reference()) <= TOL
    num_blocks = case.key_cache.shape[0]
    with pagedvk.DecodePlan(tuple(map(tuple, tables)), tuple(lens), num_heads=8, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=num_blocks) as plan:
        assert rel_error(plan.run(case.query, case.key_cache, case.value_cache), case.reference()) <= TOL
        lens = [max(n - 3, 0) for n in lens]
        plan.update(tables, lens)
        ref = pagedvk.testing.reference.paged_attention(case.query, case.key_cache, case.value_cache,
                                                        case.block_tables, np.array(lens, np.int32))
        assert rel_error(plan.run(case.query, case.key_cache, case.value_cache), ref) <= TOL


def test_vllm_decode_takes_lists(rng):
    case = Case(rng, num_seqs=2, head_size=64)
    tables, lens = lists(case.block_tables, case.seq_lens)
    out = case.poisoned_out()
    pagedvk.ops.vllm.paged_attention_v1(out, case.query, case.key_cache, case.value_cache, 2, 64 ** -0.5, tables, lens,
                                        16, max(lens), None)
    assert rel_error(out, case.reference()) <= TOL


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "q_len"])
def test_prefill_and_backward_take_lists(rng, ragged):
    case = PrefillCase(rng, q_lens=[3, 1, 5]) if ragged else PrefillCase(rng, q_len=4)
    query, k, v = case.args()[:3]
    ints = lists(*case.args()[3:])
    out, lse = pagedvk.paged_attention_prefill(query, k, v, *ints, **case.options())
    ref_out, ref_lse = case.reference()
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL
    dout = rng.standard_normal(query.shape).astype(np.float32)
    loc = dict(query_start_loc=ints[2]) if ragged else {}
    grads = pagedvk.paged_attention_backward(dout, query, k, v, *ints[:2], out, lse, **loc, **case.options())
    expected = pagedvk.paged_attention_backward(dout, query, k, v, case.block_tables, case.seq_lens, out, lse,
                                                **case.loc(), **case.options())
    for got, want in zip(grads, expected):
        assert np.array_equal(got, want)


def test_unified_attention_takes_lists(rng):
    case = PrefillCase(rng, q_lens=[2, 1, 4])
    out = np.full_like(case.query, np.nan)
    lens = case.seq_lens.tolist()
    pagedvk.ops.vllm.unified_attention(
        case.query, case.key_cache, case.value_cache, out, case.query_start_loc.tolist(), 4, lens, max(lens), 0.3, True,
        (-1, -1), case.block_tables.tolist(), 0, None, None, None)
    ref, _ = case.reference(0.3)
    assert rel_error(out, ref) <= TOL


def test_cache_ops_take_lists(rng):
    num_blocks, heads, head_size, block_size = 6, 2, 32, 16
    key_cache = np.zeros((num_blocks, heads, head_size // 4, block_size, 4), np.float32)
    value_cache = np.zeros((num_blocks, heads, head_size, block_size), np.float32)
    key = rng.standard_normal((3, heads, head_size)).astype(np.float32)
    value = rng.standard_normal((3, heads, head_size)).astype(np.float32)
    slots = [5, 40, 17]
    pagedvk.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        assert np.array_equal(key_cache[block, :, :, offset, :].reshape(heads, head_size), key[t])
        assert np.array_equal(value_cache[block, :, :, offset], value[t])
    pagedvk.copy_blocks([key_cache], [value_cache], [[0, 4], (2, 5)])
    assert np.array_equal(key_cache[4], key_cache[0]) and np.array_equal(value_cache[5], value_cache[2])
    device_values = pagedvk.asarray(np.zeros_like(value_cache))
    pagedvk.swap_blocks(value_cache, device_values, [[1, 3]])
    assert np.array_equal(device_values.numpy()[3], value_cache[1])


@pytest.mark.parametrize("value, exc, match", [
    ([[0.0, 1.0], [2.0, 3.0]], TypeError,
     "block_tables must be an int32 array or a sequence of ints, got a sequence of float64 values"),
    ([[True, False], [False, True]], TypeError, "block_tables must be an int32 array or a sequence of ints, got a "
                                                "sequence of bool values"),
    ([[0, 1], [2]], TypeError, "block_tables must be an int32 array or a sequence of ints, got a sequence numpy "
                               "cannot make an array of"),
    ([[0, 1], [2, 1 << 31]], ValueError, r"block_tables holds values outside int32 \(0 to 2147483648\)"),
])
def test_sequences_of_other_values_are_refused_by_name(rng, value, exc, match):
    case = Case(rng, num_seqs=2, head_size=64)
    out = case.poisoned_out()
    with pytest.raises(exc, match=match):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, value, case.seq_lens, out=out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("value, exc, match", [
    ([0.0, 1.0], TypeError, "slot_mapping must be an int32 array or a sequence of ints, got a sequence of float64"),
    ([0, [1]], TypeError, "slot_mapping must be an int32 array or a sequence of ints, got a sequence numpy cannot"),
    ([0, -(1 << 31) - 1], ValueError, r"slot_mapping holds values outside int32"),
])
def test_slot_sequences_of_other_values_are_refused_by_name(rng, value, exc, match):
    case = Case(rng, num_seqs=2, head_size=64)
    key_cache = case.key_cache.copy()
    with pytest.raises(exc, match=match):
        pagedvk.reshape_and_cache(case.query[:, :2], case.query[:, :2], key_cache, case.value_cache, value)
    assert np.array_equal(key_cache, case.key_cache)
