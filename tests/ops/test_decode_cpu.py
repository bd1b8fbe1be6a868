"""The two decode kernels side by side: the one for CPU devices (shaders/paged_decode_cpu.comp, what lavapipe runs
by default) and the one for GPUs (shaders/paged_decode.comp), each forced on whatever device runs the tests,
against the float64 reference on random data with NaN-poisoned outputs."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.ops.decode_rules
import pagedvk.ops.decode
import pagedvk.ops.layouts
from pagedvk.kernels import catalogue
from pagedvk.testing import reference
from pagedvk.ops.decode_rules import decode_target
from support import (Case, check_split_and_unsplit, check_unchecked_tables, poison_unread_slots, rel_error,
                     run_decode_plan, tiered)

CACHE_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


@pytest.fixture(params=("cpu", "gpu"))
def kernel(request):
    return request.param


def query_and_tolerance(case, dtype):
    """float32 queries with float32 caches (1e-5); float16 with the others (2e-3), fp8 caches serving 16-bit models."""
    if np.dtype(dtype) == np.float32:
        return case.query.astype(np.float32), 1e-5
    return case.query.astype(np.float16), 2e-3


def on_the_kernel(kernel):
    """check_split_and_unsplit's check_run: the plan took `kernel` ("cpu": the CPU-shaped one, "gpu": the other), its
    first run unsplit and its second split."""
    def check(index, run):
        assert run.key.target == ("cpu" if kernel == "cpu" else "")
        assert (run.num_partitions > 1) == (index == 1)
    return check


GROUPS = {"g1": (8, 8), "g4": (8, 2), "g8": (16, 2), "g6": (12, 2)}
DTYPE_NAMES = {np.dtype(d).name: d for d in CACHE_DTYPES}


# Default tier: every cache type in both layouts on the GPU kernel, the group width turning; on the CPU kernel every
# type once in groups of 4 (tests/ops/test_dtypes.py runs it in both layouts, as lavapipe's default kernel).
@pytest.mark.parametrize("kernel,dtype,layout,group", tiered(
    [(k, d, layout, g) for k in ("cpu", "gpu") for d in DTYPE_NAMES for layout in ("vllm", "nhd") for g in GROUPS],
    default=[("gpu", d, layout, list(GROUPS)[(i + j) % 4]) for i, d in enumerate(DTYPE_NAMES)
             for j, layout in enumerate(("vllm", "nhd"))]
    + [("cpu", d, ("vllm", "nhd")[i % 2], "g4") for i, d in enumerate(DTYPE_NAMES)]))
def test_every_dtype_layout_and_group(rng, kernel, dtype, layout, group):
    (num_heads, num_kv_heads), dtype = GROUPS[group], DTYPE_NAMES[dtype]
    one_dtype_layout_and_group(rng, kernel, dtype, layout, num_heads, num_kv_heads)


def one_dtype_layout_and_group(rng, kernel, dtype, layout, num_heads, num_kv_heads):
    # Lengths that end mid-quad, mid-block and at a partition's edge; unread slots hold NaN.
    case = Case(rng, seq_lens=[1, 6, 130, 300], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64,
                dtype=dtype)
    poison_unread_slots(case, 16)
    query, tol = query_and_tolerance(case, dtype)
    check_split_and_unsplit(case, query, tol=tol, layout=layout, check_run=on_the_kernel(kernel), kernel=kernel,
                            backend="glsl")


# 48: a head size none of vLLM's kernels has. Every layout that takes the block size (under 8: nhd and hnd, the CPU
# kernel's quads of tokens then spanning blocks of 1 and 2). Default tier: head 48 with 8-token blocks and with 1-token
# ones (16 and 32 run in test_values_loaded_with_the_keys): each pipeline costs lavapipe 10-35 s to compile cold, and
# CI's default tier has 10 minutes on two cores.
@pytest.mark.parametrize("dtype,head_size,block_size", tiered(
    [(d, h, b) for d in ("float32", "float8_e4m3fn") for h in (32, 48, 80, 256) for b in (1, 2, 4, 8, 16, 32)],
    default=[("float32", 48, 8), ("float8_e4m3fn", 48, 1)]))
def test_head_and_block_sizes(rng, kernel, dtype, head_size, block_size):
    dtype = DTYPE_NAMES[dtype]
    case = Case(rng, seq_lens=[3, 77, 200], num_heads=8, num_kv_heads=2, head_size=head_size, block_size=block_size,
                dtype=dtype)
    poison_unread_slots(case, block_size)
    query, tol = query_and_tolerance(case, dtype)
    for layout in [layout for layout in pagedvk.ops.layouts.LAYOUTS if block_size in pagedvk.ops.layouts.block_sizes(layout)]:
        run = run_decode_plan(case, query, layout=layout, kernel=kernel, backend="glsl")
        assert run.key.target == ("cpu" if kernel == "cpu" else "")
        assert rel_error(run.out, reference.paged_attention(query, *case.args()[1:])) <= tol


@pytest.mark.parametrize("variant,layout", tiered(
    [(v, layout) for v in ("alibi_slopes", "logits_soft_cap", "sinks", "window_left", "all") for layout in ("vllm", "nhd")],
    default=[("alibi_slopes", "vllm"), ("logits_soft_cap", "nhd"), ("sinks", "vllm"), ("window_left", "nhd"),
             ("all", "vllm"), ("all", "nhd")]))
def test_attention_variants(rng, kernel, layout, variant):
    case = Case(rng, seq_lens=[300, 45, 1, 129], num_heads=12, num_kv_heads=2, head_size=64)
    poison_unread_slots(case, 16)
    every = dict(alibi_slopes=rng.uniform(-0.2, 0.2, 12).astype(np.float32), logits_soft_cap=1.5,
                 sinks=rng.standard_normal(12).astype(np.float32), window_left=40)
    variants = every if variant == "all" else {variant: every[variant]}
    check_split_and_unsplit(case, tol=1e-5, layout=layout, check_run=on_the_kernel(kernel), variants=variants,
                            kernel=kernel, backend="glsl")


@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", tiered(
    [(h, *g) for h in (80, 128) for g in ((4, 4), (8, 2), (16, 2))], default=[(128, 16, 2)]))
def test_a_split_merged_in_the_decode_leaves_its_counters_at_zero(rng, kernel, num_heads, num_kv_heads, head_size):
    # The GPU kernel merges a split of at most catalogue.DECODE_MERGE_PARTITIONS partitions in its own dispatch (the last
    # workgroup of each (sequence, head group) to finish), a longer one in the reduce dispatch; the CPU kernel leaves
    # every split to the reduce. Many counters, sequences shorter than the split (empty, one partition, two), the
    # split scratch poisoned before the first run (a huge max and sum, NaN outputs): run after run on one plan, with
    # new queries each time, the result matches float64 and every counter is back at zero. Head 80 with one head a
    # group has more threads than items: the merge's lanes meet in shared memory.
    lens = [0, 1, 16, 100, 257, 511, 512, 513, 700, 1024] * 2
    case = Case(rng, seq_lens=lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=16)
    for partition_size, parts in ((512, 2), (256, catalogue.DECODE_MERGE_PARTITIONS), (208, catalogue.DECODE_MERGE_PARTITIONS + 1), (16, 64)):
        with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_size=head_size, block_size=16, num_blocks=case.key_cache.shape[0],
                                partition_size=partition_size, kernel=kernel, backend="glsl") as plan:
            assert plan.num_partitions == parts
            assert plan.merge_in_decode == (kernel == "gpu" and parts <= catalogue.DECODE_MERGE_PARTITIONS)
            plan.partial_out.write(np.full(plan.partial_out.shape, np.nan, np.float32))
            plan.partial_stats.write(np.full(plan.partial_stats.shape, 1e30, np.float32))
            for _ in range(2):
                query = rng.standard_normal(case.query.shape).astype(np.float32)
                out = plan.run(query, case.key_cache, case.value_cache, out=np.full(query.shape, np.nan, np.float32))
                assert rel_error(out, reference.paged_attention(query, *case.args()[1:])) <= 1e-5
                if plan.merge_in_decode:
                    assert plan.merge_counters.shape == (len(lens) * num_heads // (num_heads // num_kv_heads), 2)
                    assert not plan.merge_counters.numpy().any()


def test_merge_counters_after_an_odd_number_of_stats(rng):
    # One sequence, one head group of 3 heads, 3 partitions: 9 stats pairs, then 1 counter. The counters' view of the
    # plan's scratch is 16-byte rounded and ended past the buffer: the plan could not be made (found on an H100 by
    # test_properties' decode search, 2026-12-06).
    case = Case(rng, seq_lens=[40], num_heads=3, num_kv_heads=1, head_size=32, block_size=16)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=3, num_kv_heads=1, head_size=32,
                            block_size=16, num_blocks=case.key_cache.shape[0], partition_size=16, kernel="gpu",
                            backend="glsl") as plan:
        assert plan.num_partitions == 3 and plan.merge_in_decode
        assert plan.merge_counters.shape == (1, 2)
        out = plan.run(case.query, case.key_cache, case.value_cache)
        assert rel_error(out, case.reference()) <= 1e-5
        assert not plan.merge_counters.numpy().any()


# Default tier: a 16-bit type and an fp8 one (the rule's own and a forced one), each head and block size among them;
# the other types in the full tier (a pipeline compile costs lavapipe 10-35 s cold).
@pytest.mark.parametrize("dtype,head_size,block_size", tiered(
    [(d, h, b) for d in DTYPE_NAMES for h in (80, 128, 256) for b in (8, 16, 32)],
    default=[("float16", 256, 8), ("bfloat16", 80, 32), ("float8_e5m2", 128, 16)]))
def test_values_loaded_with_the_keys(rng, monkeypatch, dtype, head_size, block_size):
    dtype = DTYPE_NAMES[dtype]
    # The GPU kernel with every tile's first batch of values loaded beside its keys (catalogue.DecodeSpec.VALUES),
    # forced on for every plan, not only where a workgroup takes one tile as the rule says: tiles after the first,
    # lengths ending mid-chunk, a head dim's second slot (256), fp8 rows shorter than a chunk (8-token blocks), both
    # layouts (nhd's V stage leaves the constant unused); NaN in unread cache slots and in the outputs beforehand.
    monkeypatch.setattr(pagedvk.ops.decode_rules, "values_with_keys", lambda storage, tokens: True)
    case = Case(rng, seq_lens=[1, 13, 128, 130, 300], num_heads=8, num_kv_heads=2, head_size=head_size,
                block_size=block_size, dtype=dtype)
    poison_unread_slots(case, block_size)
    query, tol = query_and_tolerance(case, dtype)
    for layout in ("vllm", "nhd"):
        check_split_and_unsplit(case, query, tol=tol, layout=layout, check_run=on_the_kernel("gpu"), kernel="gpu",
                                backend="glsl")


def test_the_values_rule_and_the_plans_that_take_it(rng):
    rule = pagedvk.ops.decode_rules.values_with_keys
    assert [rule("f16", n) for n in (1, 127, 128, 129, 4096)] == [True, True, True, False, False]
    assert [rule(tag, 128) for tag in ("bf16", "f32", "e4m3", "e5m2")] == [True, False, False, False]
    for dtype in (np.float16, np.float32):
        case = Case(rng, seq_lens=[100, 300], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
        for partition_size in (128, 256, 64):
            with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                                    block_size=16, num_blocks=case.key_cache.shape[0], dtype=dtype,
                                    partition_size=partition_size, kernel="gpu", backend="glsl") as plan:
                taken = 1 if dtype == np.float16 and partition_size <= 128 else None
                assert plan.constants.get(catalogue.DecodeSpec.VALUES) == taken


def test_zero_lengths_and_blocks_out_of_range_stay_inside_their_buffers(rng, device, kernel):
    # Unchecked tables: ids at and past num_blocks, negative ids, lengths past the row and negative, with
    # sequences of length 0 between valid ones. The sentinels around the caches must keep their pattern; a
    # sequence with no key in range gives zeros, the valid ones their attention.
    case = Case(rng, seq_lens=[0, 50, 0, 70, 33, 9, 100], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    check_unchecked_tables(device, case, kernel, 1e-5)


def test_the_device_type_picks_the_kernel(device, monkeypatch):
    info = device.info
    cpu_ready = dataclasses.replace(info, subgroup_arithmetic=True, subgroup_size=max(info.subgroup_size, 4),
                                    subgroup_shuffle=True)
    monkeypatch.delenv("PAGEDVK_DECODE_KERNEL", raising=False)
    assert decode_target(dataclasses.replace(cpu_ready, type="cpu"), "glsl") == "cpu"
    assert decode_target(dataclasses.replace(cpu_ready, type="discrete"), "glsl") == ""
    assert decode_target(dataclasses.replace(cpu_ready, type="cpu"), "glsl", "gpu") == ""
    assert decode_target(dataclasses.replace(cpu_ready, type="discrete"), "glsl", "CPU") == "cpu"
    assert decode_target(dataclasses.replace(cpu_ready, type="cpu"), "wgsl") == ""   # WGSL: the GPU kernel only
    for lacking in (dict(subgroup_arithmetic=False), dict(subgroup_size=2), dict(subgroup_shuffle=False)):
        assert decode_target(dataclasses.replace(cpu_ready, type="cpu", **lacking), "glsl") == ""
    monkeypatch.setenv("PAGEDVK_DECODE_KERNEL", "cpu")
    assert decode_target(dataclasses.replace(cpu_ready, type="discrete"), "glsl") == "cpu"
    assert decode_target(dataclasses.replace(cpu_ready, type="cpu"), "glsl", "gpu") == ""   # the argument wins
    monkeypatch.setenv("PAGEDVK_DECODE_KERNEL", "fast")
    with pytest.raises(ValueError, match="PAGEDVK_DECODE_KERNEL must be one of cpu, gpu"):
        decode_target(info, "glsl")
    with pytest.raises(ValueError, match="kernel must be one of cpu, gpu"):
        decode_target(info, "glsl", "tpu")


def test_the_one_call_op_follows_the_environment(rng, device, monkeypatch):
    # paged_attention keeps a plan per call signature: PAGEDVK_DECODE_KERNEL is part of it.
    case = Case(rng, num_heads=8, num_kv_heads=2, head_size=64)
    ref = case.reference()
    pagedvk.ops.decode.release_cached_plans(device)
    for kernel in ("gpu", "cpu", "gpu"):
        monkeypatch.setenv("PAGEDVK_DECODE_KERNEL", kernel)
        assert rel_error(pagedvk.paged_attention(*case.args(), backend="glsl"), ref) <= 1e-5
    targets = sorted(plan.key.target for plan in pagedvk.ops.decode.oneshot_plans(device).plans())
    assert targets == ["", "cpu"]
    pagedvk.ops.decode.release_cached_plans(device)


def test_cpu_modules_are_chosen_where_built():
    from pagedvk.kernels.catalogue import PAGED_DECODE
    assert PAGED_DECODE.key("glsl", "f16", "f16", 128, target="cpu").name == "paged_decode.cpu.kv_f16.glsl"
    assert PAGED_DECODE.key("glsl", "f16", "f16", 128, target="cpu").source == "paged_decode_cpu.comp"
    assert PAGED_DECODE.key("glsl", "e4m3", "bf16", 100, target="cpu").head_size == 0   # specialized, not built
    assert PAGED_DECODE.key("glsl", "f32", "f32", 128, "seg", target="cpu").name == "paged_decode.cpu.kv_f32.seg.glsl"
    assert PAGED_DECODE.key("wgsl", "f16", "f16", 128, target="cpu").target == ""        # no WGSL twin
    with pytest.raises(ValueError, match="has no 'tpu' kernel"):
        PAGED_DECODE.key("glsl", "f16", "f16", 128, target="tpu")
