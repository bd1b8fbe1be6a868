"""Decode attention against the float64 reference, on random data with poisoned outputs."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.ops.vllm
import pagedvk.testing.reference
from support import Case, check_split_and_unsplit, in_layout, poison_unread_slots, rel_error, tiered

TOL = 1e-5  # float32 storage
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)


@pytest.fixture(autouse=True)
def default_backend(backend, monkeypatch):
    """Every decode test runs on both modules, the GLSL kernel and its WGSL translation: the calls that name no
    backend take PAGEDVK_BACKEND's."""
    monkeypatch.setenv("PAGEDVK_BACKEND", backend)


def check(case, **kw):
    out = case.poisoned_out()
    result = pagedvk.paged_attention(*case.args(), out=out, **kw)
    assert result is out
    assert rel_error(out, case.reference(kw.get("scale"))) <= TOL


# Default tier: a size with a power-of-two head, one with an odd number of 16-dim chunks, each block size once.
@pytest.mark.parametrize("head_size,block_size", tiered([(h, b) for h in HEAD_SIZES for b in BLOCK_SIZES],
                                                        default=[(128, 16), (80, 8), (64, 32)]))
def test_head_and_block_sizes(rng, head_size, block_size):
    check(Case(rng, head_size=head_size, block_size=block_size, num_seqs=3, max_len=200))


@pytest.mark.parametrize("num_heads,num_kv_heads", tiered([(8, 8), (8, 4), (8, 2), (8, 1), (32, 8), (12, 3)],
                                                         default=[(8, 8), (8, 1), (12, 3)]))
def test_mha_gqa_mqa(rng, num_heads, num_kv_heads):
    check(Case(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64, num_seqs=4, max_len=150))


@pytest.mark.parametrize("num_seqs", tiered([1, 2, 7, 64], default=[1, 7]))
def test_batches(rng, num_seqs):
    check(Case(rng, num_seqs=num_seqs, num_heads=4, num_kv_heads=1, head_size=64, max_len=260))


@pytest.mark.parametrize("seq_len", tiered([1, 2, 7, 8, 127, 128, 129, 255, 1000, 4096], default=[1, 8, 129, 1000]))
def test_lengths(rng, seq_len):
    check(Case(rng, seq_lens=[seq_len, max(seq_len // 3, 1)], num_heads=4, num_kv_heads=2, head_size=128))


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", tiered([16384, 32768], default=[16384]))
def test_long_sequences(rng, seq_len):
    check(Case(rng, seq_lens=[seq_len], num_heads=2, num_kv_heads=1, head_size=128, block_size=32))


def test_shared_prefix_blocks(rng):
    # Sequences that share their first physical blocks (prefix caching), the rest shuffled.
    case = Case(rng, seq_lens=[100, 64, 33, 200], shared_prefix_blocks=2, block_size=16)
    assert (case.block_tables[:, :2] == case.block_tables[0, :2]).all()
    check(case)


def test_same_blocks_different_lengths(rng):
    case = Case(rng, seq_lens=[90, 90], block_size=8)
    case.block_tables[1] = case.block_tables[0]
    case.seq_lens[1] = 41
    check(case)


def test_zero_length_gives_zeros(rng):
    case = Case(rng, seq_lens=[0, 50, 0])
    out = case.poisoned_out()
    pagedvk.paged_attention(*case.args(), out=out)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert rel_error(out, case.reference()) <= TOL


def test_custom_scale(rng):
    check(Case(rng, head_size=64), scale=0.37)


def test_nan_in_unused_cache_slots_does_not_leak(rng):
    # Slots past a sequence's length (and blocks nobody uses) may hold anything.
    case = Case(rng, seq_lens=[21, 3], block_size=16, spare_blocks=2)
    poison_unread_slots(case, 16)
    check(case)


def test_numpy_in_numpy_out(rng):
    case = Case(rng)
    out = pagedvk.paged_attention(*case.args())
    assert isinstance(out, np.ndarray) and out.shape == case.query.shape and out.dtype == np.float32
    assert rel_error(out, case.reference()) <= TOL


def test_device_arrays_in_device_array_out(rng, device):
    case = Case(rng)
    dev = [pagedvk.asarray(a) for a in case.args()]
    out = pagedvk.paged_attention(*dev)
    assert isinstance(out, pagedvk.DeviceArray) and out.device is device
    assert rel_error(out.numpy(), case.reference()) <= TOL
    poisoned = pagedvk.asarray(case.poisoned_out())
    assert pagedvk.paged_attention(*dev, out=poisoned) is poisoned
    assert rel_error(poisoned.numpy(), case.reference()) <= TOL


def test_resident_cache_plan_runs_every_layer(rng):
    # One plan per step, one run per layer, caches resident on the device.
    case = Case(rng, num_seqs=5, max_len=180)
    layers = []
    for _ in range(3):
        k = rng.standard_normal(case.key_cache.shape).astype(np.float32)
        v = rng.standard_normal(case.value_cache.shape).astype(np.float32)
        layers.append((k, v, pagedvk.asarray(k), pagedvk.asarray(v)))
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=128,
                            block_size=16, num_blocks=case.key_cache.shape[0]) as plan:
        for step in range(2):
            for k, v, dk, dv in layers:
                q = rng.standard_normal(case.query.shape).astype(np.float32)
                out = pagedvk.asarray(np.full(q.shape, np.nan, np.float32))
                plan.run(pagedvk.asarray(q), dk, dv, out=out)
                ref = pagedvk.testing.reference.paged_attention(q, k, v, case.block_tables, case.seq_lens)
                assert rel_error(out.numpy(), ref) <= TOL


@pytest.mark.parametrize("query_dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_a_float32_plan_takes_16_bit_queries_converted_exactly(rng, query_dtype):
    # float16 and bfloat16 values are float32 values: a numpy query of either runs on a float32 plan, as numpy users
    # expect; the result is the plan's float32, checked against float64 on the 16-bit query's values.
    case = Case(rng, num_seqs=2, head_size=64)
    q = case.query.astype(query_dtype)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=case.key_cache.shape[0]) as plan:
        out = plan.run(q, case.key_cache, case.value_cache)
    assert out.dtype == np.float32
    ref = pagedvk.testing.reference.paged_attention(q.astype(np.float32), *case.args()[1:])
    assert rel_error(out, ref) <= TOL


def test_a_query_the_plan_cannot_hold_exactly_is_refused_naming_query_dtype(rng):
    # float32 into a float16 plan would round: refused, saying how to make a plan for such queries.
    case = Case(rng, num_seqs=2, head_size=64, dtype=np.float16)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=case.key_cache.shape[0], dtype=np.float16) as plan:
        with pytest.raises(TypeError, match=r"query must have dtype float16 \(the plan's query_dtype\), got float32: "
                                            r"make the plan with query_dtype=float32 for such queries"):
            plan.run(case.query.astype(np.float32), case.key_cache, case.value_cache)
        with pytest.raises(TypeError, match=r"query must have dtype float16 \(the plan's query_dtype\), got float64$"):
            plan.run(case.query.astype(np.float64), case.key_cache, case.value_cache)


def test_cache_updated_on_device_is_seen(rng):
    case = Case(rng)
    dk, dv = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
    with pagedvk.DecodePlan.for_caches(dk, dv, case.block_tables, case.seq_lens, num_heads=8) as plan:
        q = pagedvk.asarray(case.query)
        out = pagedvk.empty(case.query.shape)
        plan.run(q, dk, dv, out=out)
        case.value_cache[...] = rng.standard_normal(case.value_cache.shape)
        dv.write(case.value_cache)
        plan.run(q, dk, dv, out=out)   # same buffers: the recorded launch is reused
        assert rel_error(out.numpy(), case.reference()) <= TOL


def test_vllm_spelling(rng):
    case = Case(rng, num_kv_heads=2, block_size=16)
    out = case.poisoned_out()
    q, k, v, bt, sl = case.args()
    r = pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.125, bt, sl, 16, int(sl.max()))
    assert r is out
    assert rel_error(out, case.reference(0.125)) <= TOL


@pytest.mark.parametrize("partition_size,num_heads,num_kv_heads", tiered(
    [(p, h, kv) for p in (16, 64, 128, 512, None) for h, kv in ((4, 4), (12, 4), (32, 2))],
    default=[(16, 4, 4), (128, 12, 4), (None, 32, 2)]))
def test_split_contexts(rng, partition_size, num_heads, num_kv_heads):
    # Partitions merged by the reduce pass, including partitions past a short sequence's end and
    # GQA groups wider than one workgroup (16 heads per kv head: two workgroups of 8).
    case = Case(rng, seq_lens=[0, 5, 300, 1000], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_size=64, block_size=16, num_blocks=case.key_cache.shape[0],
                            partition_size=partition_size) as plan:
        out = plan.run(case.query, case.key_cache, case.value_cache, out=case.poisoned_out())
        if partition_size is not None:
            assert plan.num_partitions == -(-1000 // partition_size)
    assert rel_error(out, case.reference()) <= TOL


@pytest.mark.parametrize("backend", ["glsl", "wgsl"])
@pytest.mark.parametrize("head_size", tiered([80, 256], default=[80]))
def test_many_partitions(rng, backend, head_size):
    # More partitions than a thread of the reduce pass loads in one round (UNROLL), with every number of
    # partition lanes its threads split into (head 80: three lanes of 40 dim pairs; head 256: one).
    case = Case(rng, seq_lens=[9000, 0, 100], num_heads=4, num_kv_heads=2, head_size=head_size, block_size=16)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=4, num_kv_heads=2, head_size=head_size,
                            block_size=16, num_blocks=case.key_cache.shape[0], partition_size=16,
                            backend=backend) as plan:
        assert plan.num_partitions == 563
        out = plan.run(case.query, case.key_cache, case.value_cache, out=case.poisoned_out())
    assert rel_error(out, case.reference()) <= TOL


@pytest.mark.parametrize("backend", ["glsl", "wgsl"])
def test_reduce_ignores_stale_partitions(rng, backend):
    # The reduce loads partitions before it knows the sequence's length and drops those past its end after. The
    # split scratch is poisoned before the run (a huge max and sum, NaN outputs in every slot): nothing of it may
    # reach the result, whether the decode overwrites a slot (it writes a partition with no token as max -inf,
    # sum 0) or the reduce leaves it out.
    case = Case(rng, seq_lens=[1000, 40, 0, 333], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=case.key_cache.shape[0], partition_size=32,
                            backend=backend) as plan:
        assert plan.num_partitions == 32
        plan.partial_out.write(np.full(plan.partial_out.shape, np.nan, np.float32))
        plan.partial_stats.write(np.full(plan.partial_stats.shape, 1e30, np.float32))
        out = plan.run(case.query, case.key_cache, case.value_cache, out=case.poisoned_out())
    assert rel_error(out, case.reference()) <= TOL


# The plan's own partitioning, then 128-token partitions.
PLAN_DEFAULT_AND_128_TOKEN_PARTITIONS = ((None, None), (128, None))


# FlashInfer's HND layout and blocks of 1 to 32 tokens (under 8 in the token-major layouts only), split and not, on
# each backend's default kernel (lavapipe's GLSL: the CPU-shaped one; tests/ops/test_decode_cpu.py forces each GLSL
# kernel); the slots no sequence reads hold NaN. Default tier: HND at 16-token and at 1-token blocks.
@pytest.mark.parametrize("layout,block_size", tiered(
    [(layout, b) for layout in ("nhd", "hnd") for b in (1, 2, 4, 8, 16, 32)], default=[("hnd", 16), ("hnd", 1)]))
def test_token_major_layouts_and_block_sizes(rng, layout, block_size):
    case = Case(rng, seq_lens=[1, 6, 130, 300], num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size)
    poison_unread_slots(case, block_size)
    check_split_and_unsplit(case, tol=TOL, layout=layout, partitionings=PLAN_DEFAULT_AND_128_TOKEN_PARTITIONS)


@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_split_and_unsplit_agree(rng, layout):
    # The same inputs through one partition, through many, and through the one-shot call: the same result to
    # float32 rounding (the partitions' sums only add in another order), each also against float64.
    case = Case(rng, seq_lens=[1, 17, 700, 1500], num_heads=8, num_kv_heads=2, head_size=64, dtype=np.float16)
    k, v = in_layout(case, layout, case.key_cache.dtype)
    outs = []
    for partition_size in (2048, 128, 32):
        with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                                block_size=16, num_blocks=k.shape[0], dtype=np.float16, layout=layout,
                                partition_size=partition_size) as plan:
            outs.append(plan.run(case.query, k, v, out=np.full(case.query.shape, np.nan, np.float16)))
            assert plan.num_partitions == -(-1500 // partition_size)
    outs.append(pagedvk.paged_attention(case.query, k, v, case.block_tables, case.seq_lens, layout=layout))
    ref = case.reference()
    for out in outs:
        assert rel_error(out, ref) <= 2e-3
        np.testing.assert_allclose(out.astype(np.float32), outs[0].astype(np.float32), rtol=0, atol=2e-3)


def test_partition_size_is_checked(rng):
    case = Case(rng, head_size=64)
    with pytest.raises(ValueError, match="partition_size must be a multiple of block_size"):
        pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                           block_size=16, num_blocks=case.key_cache.shape[0], partition_size=24)


def test_partitioning_rule():
    from pagedvk.ops.decode_rules import group_size, partitioning
    assert group_size(32, 8) == 4 and group_size(64, 4) == 8 and group_size(12, 1) == 6 and group_size(7, 7) == 1
    # (num_seqs, workgroups per sequence, longest context, compute units) -> (partition size, partitions)
    assert partitioning(256, 8, 2048, 132) == (2048, 1)     # a grid that fills the device is not split
    assert partitioning(8, 8, 4096, 132) == (256, 16)       # 64 workgroups become 1024
    assert partitioning(1, 8, 4096, 132) == (128, 32)       # one sequence: partitions of one tile at least
    assert partitioning(64, 8, 100, 132) == (128, 1)        # short contexts need no reduce
    assert partitioning(1, 8, 0, 132) == (128, 1)           # nothing cached
    with pytest.raises(TypeError, match="partition_size must be an int"):
        pagedvk.DecodePlan(np.zeros((1, 1), np.int32), np.zeros(1, np.int32), num_heads=8, num_kv_heads=2,
                           head_size=64, block_size=16, num_blocks=1, partition_size=1.5)


# -- the GLSL kernel's specializations (abi.DECODE_*_SPEC_ID) and its reductions without subgroup arithmetic --

@pytest.mark.parametrize("layout,num_heads,num_kv_heads,lacking", tiered(
    [(layout, h, kv, lacking) for layout in ("vllm", "nhd") for h, kv in ((8, 2), (16, 2), (8, 8))
     for lacking in ("no_arithmetic", "subgroups_of_2")],
    default=[("vllm", 16, 2, "no_arithmetic"), ("nhd", 8, 2, "subgroups_of_2")]))
def test_devices_without_subgroup_arithmetic_run_the_shared_memory_reduction(rng, device, monkeypatch, backend,
                                                                             layout, num_heads, num_kv_heads, lacking):
    lacking = {"no_arithmetic": dict(subgroup_arithmetic=False), "subgroups_of_2": dict(subgroup_size=2)}[lacking]
    monkeypatch.setattr(device, "info", dataclasses.replace(device.info, **lacking))
    case = Case(rng, seq_lens=[1, 130, 700], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128)

    def reduces_in_shared_memory(_, run):   # GLSL: SHARED_REDUCE; WGSL: decode_reduce_shared.wgsl
        assert run.key.reduce == "shared"
    check_split_and_unsplit(case, tol=TOL, layout=layout, partitionings=PLAN_DEFAULT_AND_128_TOKEN_PARTITIONS,
                            check_run=reduces_in_shared_memory, device=device)


@pytest.mark.parametrize("wrong", ["group", "layout"])
def test_a_pipeline_specialized_for_other_arguments_writes_nothing(rng, backend, wrong):
    specialized_wrongly_writes_nothing(rng, backend, wrong)


def test_a_pipeline_specialized_for_another_head_size_writes_nothing(rng):
    specialized_wrongly_writes_nothing(rng, "glsl", "head_size")   # WGSL's head size is in the module's name


def specialized_wrongly_writes_nothing(rng, backend, wrong):
    # The plan keeps its specialization and push constants equal; were they not, the kernel must leave the
    # output alone rather than run one layout's, group width's or head size's code on another's data. GLSL:
    # specialization constants; WGSL: a module built with them fixed (abi.DECODE_FIXED), for head sizes 64 and 128.
    from pagedvk.kernels.catalogue import DecodeSpec
    case = Case(rng, num_heads=16, num_kv_heads=2, head_size=64)   # groups of 8 heads, vLLM's layout
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=16, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=case.key_cache.shape[0], partition_size=4096,
                            backend=backend) as plan:
        # one partition: the decode kernel writes `out` itself (a split's reduce would merge unwritten partials)
        assert plan.num_partitions == 1
        assert plan.constants == {DecodeSpec.VALUE_ORDER: 1, DecodeSpec.GROUP: 8, DecodeSpec.HEAD_SIZE: 64,
                                  DecodeSpec.Q_TYPE: 1}   # float32 queries
        assert plan.key.fixed == ("vllm_g8" if backend == "wgsl" else "")
        wrong_constants = {**plan.constants, **{"group": {DecodeSpec.GROUP: 4},
                                                "layout": {DecodeSpec.VALUE_ORDER: 2},
                                                "head_size": {DecodeSpec.HEAD_SIZE: 32}}[wrong]}
        plan.choice = dataclasses.replace(plan.choice, constants=tuple(sorted(wrong_constants.items())))
        assert plan.key.fixed == ({"group": "vllm_g4", "layout": "nhd_g8"}[wrong] if backend == "wgsl" else "")
        out = pagedvk.asarray(case.poisoned_out())   # on the device: what the kernel leaves stays NaN
        out = plan.run(case.query, case.key_cache, case.value_cache, out=out).numpy()
    assert np.isnan(out).all()


@pytest.mark.parametrize("layout,num_heads,num_kv_heads", tiered(
    [(layout, h, kv) for layout in ("vllm", "nhd", "hnd") for h, kv in ((8, 2), (16, 2), (24, 8))],
    default=[("vllm", 8, 2), ("vllm", 16, 2), ("nhd", 8, 2), ("nhd", 24, 8)]))   # each of the four modules
def test_wgsl_modules_with_layout_and_group_fixed(rng, layout, num_heads, num_kv_heads):
    # Each of the four fixed WGSL modules of a head size, split and not: the same result as float64. HND caches run
    # the "nhd" modules: they fix only that a token's value dims are contiguous.
    case = Case(rng, seq_lens=[1, 130, 700], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128)
    width = 4 if num_heads // num_kv_heads <= 4 else 8

    def fixed_for_the_plan(_, run):
        assert run.key.fixed == f"{'vllm' if layout == 'vllm' else 'nhd'}_g{width}"
    check_split_and_unsplit(case, tol=TOL, layout=layout, partitionings=PLAN_DEFAULT_AND_128_TOKEN_PARTITIONS,
                            check_run=fixed_for_the_plan, backend="wgsl")


def test_fixed_wgsl_modules_are_chosen_where_built():
    from pagedvk.kernels.catalogue import PAGED_DECODE
    assert PAGED_DECODE.key("wgsl", "f16", "f16", 128, fixed="nhd_g4").name == "paged_decode.kv_f16.q_f16.h128.nhd_g4.wgsl"
    assert PAGED_DECODE.key("wgsl", "e5m2", "f16", 64, fixed="vllm_g8").constants()["Q_TYPE_FIXED"] == 1
    # the query type is fixed too, the cache type's usual one (abi.FIXED_QUERY): others read the push constants
    assert PAGED_DECODE.key("wgsl", "e5m2", "bf16", 64, fixed="vllm_g8").fixed == ""
    assert PAGED_DECODE.key("wgsl", "f16", "f32", 128, fixed="nhd_g4").fixed == ""
    assert PAGED_DECODE.key("wgsl", "f16", "f16", 96, fixed="nhd_g4").fixed == ""      # none built for head 96
    assert PAGED_DECODE.key("wgsl", "f16", "f16", 128, "seg", fixed="nhd_g4").fixed == ""   # segmented caches
    assert PAGED_DECODE.key("glsl", "f16", "f16", 128, fixed="nhd_g4").fixed == ""      # GLSL specializes
    assert PAGED_DECODE.key("wgsl", "f16", "f16", 128, fixed="nhd_g4", subgroup_arithmetic=False).fixed == ""
    for other in (dict(), dict(subgroup_arithmetic=False), dict(backend="glsl")):   # refused on every path
        with pytest.raises(ValueError, match="fixed must be one of"):
            PAGED_DECODE.key(other.pop("backend", "wgsl"), "f16", "f16", 128, fixed="nhd_g16", **other)


@pytest.mark.parametrize("partition_size,kernel", tiered([(p, k) for p in (None, 64, 16) for k in ("gpu", "cpu")],
                                                        default=[(None, "cpu"), (64, "gpu"), (16, "cpu")]))
def test_a_nan_key_inside_a_sequence_makes_its_heads_nan(rng, partition_size, kernel, backend):
    # A NaN in a key the query sees makes that logit NaN, so float64 gives NaN outputs and lse for every head of
    # its kv head in that sequence, and leaves the other heads and sequences alone. A split must not take a
    # partition whose weights sum to NaN for an empty one (the merge once kept only sums above zero): unsplit,
    # split in a few partitions (merged in the decode on some kernels) and in many (the reduce dispatch). (WGSL's
    # reduce once skipped such a partition too: naga writes `!=` as an ordered comparison, false for NaN.)
    # WGSL has no CPU kernel: asked for it, WGSL plans run the generic one (decode_rules.decode_target), checked here too.
    case = Case(rng, seq_lens=[300, 200, 130], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    poison_unread_slots(case, 16)
    x = case.key_cache.shape[-1]
    for seq, token, kv_head, dim in ((0, 150, 1, 7), (2, 3, 0, 63)):
        block, slot = case.block_tables[seq, token // 16], token % 16
        case.key_cache[block, kv_head, dim // x, slot, dim % x] = np.nan
    ref, ref_lse = pagedvk.testing.reference.paged_attention(*case.args(), return_lse=True)
    assert 0 < np.isnan(ref).sum() < ref.size and np.isnan(ref_lse).sum() == 8
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                            block_size=16, num_blocks=case.key_cache.shape[0], partition_size=partition_size,
                            kernel=kernel) as plan:
        lse = np.full(ref_lse.shape, np.nan, np.float32)
        out, lse = plan.run(case.query, case.key_cache, case.value_cache, out=case.poisoned_out(), lse=lse)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert rel_error(np.nan_to_num(out), np.nan_to_num(ref)) <= TOL
    np.testing.assert_allclose(lse[~np.isnan(lse)], ref_lse[~np.isnan(ref_lse)], rtol=1e-5, atol=1e-5)


def test_the_rules_answer_without_a_plan(rng, device):
    # decode_choice is what a plan runs: asked with the plan's dims, it gives the plan's own choice, and nothing is
    # made on the device to answer.
    from pagedvk.ops.decode_rules import decode_choice
    case = Case(rng, seq_lens=[5, 300, 1000], num_heads=16, num_kv_heads=2, head_size=64)
    for partition_size in (None, 128):
        with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=16, num_kv_heads=2, head_size=64,
                                block_size=16, num_blocks=case.key_cache.shape[0], partition_size=partition_size,
                                device=device) as plan:
            choice = decode_choice(device.info, device.features, plan.backend, storage="f32", query="f32",
                                   num_seqs=3, num_heads=16, num_kv_heads=2, head_size=64, layout="vllm",
                                   block_size=16, max_seq_len=1000, partition_size=partition_size)
            assert choice == plan.choice
            assert plan.key == choice.module() and plan.num_partitions == choice.num_partitions
    assert decode_choice(device.info, device.features, "glsl", storage="f32", query="f32", num_seqs=1, num_heads=4,
                         num_kv_heads=4, head_size=64, layout="vllm", block_size=16, max_seq_len=1000,
                         partition_size=128).num_partitions == 8
