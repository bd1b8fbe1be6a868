"""The cooperative-matrix decode (shaders/paged_decode_coopmat.comp, and its WGSL port paged_decode_coopmat.wgsl for
float16 and bfloat16 caches) and the rule that picks it: the rule and its refusals on made-up devices, everywhere;
the kernel, forced, against the float64 reference on random data with NaN-poisoned outputs and unread slots, on
devices with cooperative matrices (`needs_coopmat`, skipped elsewhere with the reason: lavapipe has none). Tests of
float16 and bfloat16 caches run both backends' modules (`backend`)."""

import dataclasses
import functools
import itertools
import re

import ml_dtypes
import numpy as np
import pytest

import pagedvk
from pagedvk import cli, config
from pagedvk.kernels import abi, catalogue
from pagedvk.ops import decode_rules
from pagedvk.testing import reference
from pagedvk.ops.decode_rules import MATRIX_PV_SHAPE
from pagedvk.kernels.matrix import MATRIX_SHAPE, matrix_unavailable, with_operands
from support import (VARIANTS, Case, check_split_and_unsplit, check_unchecked_tables, poison_unread_slots, rel_error,
                     run_decode_plan, variant_args)

TOL = 2e-3   # float16 storage, queries and weights: about 4 units of float16's last place (2^-11)
BF16_TOL = 1.6e-2   # the same for bfloat16 (2^-8), whose matrices round queries, keys, values and weights to it
F16 = ("glsl", "f16", "f16")
BF16 = ml_dtypes.bfloat16
CACHE_DTYPES = (np.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)   # the ones with float16 queries
NEEDS = {"cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel"}
BF16_NEEDS = {"cooperativeMatrix", "vulkanMemoryModel", *abi.BFLOAT16_MATRIX_FEATURES}
WGSL_NEEDS = NEEDS | {"storageBuffer16BitAccess"}   # the WGSL module binds its caches as f16 arrays
WGSL_BF16_NEEDS = BF16_NEEDS | {"storageBuffer16BitAccess"}   # its bfloat16 module, as bfloat16 arrays

_info = pagedvk.select()[0]
_why = matrix_unavailable(_info, pagedvk.default_device().features)   # what the device turned on
needs_coopmat = pytest.mark.skipif(bool(_why), reason=f"needs VK_KHR_cooperative_matrix: {_info.name}: {_why}")
_why_bf16 = matrix_unavailable(_info, pagedvk.default_device().features, "bf16")
needs_bf16_coopmat = pytest.mark.skipif(bool(_why_bf16), reason=f"needs bfloat16 matrices: {_info.name}: {_why_bf16}")
_why_wgsl = _why or ("" if "storageBuffer16BitAccess" in pagedvk.default_device().features
                     else "storageBuffer16BitAccess is off")
# The backends whose float16 matrix module runs here: a test taking `backend` skips the WGSL one where it cannot.
MATRIX_BACKENDS = [pytest.param("glsl"), pytest.param("wgsl", marks=pytest.mark.skipif(
    bool(_why_wgsl), reason=f"needs the WGSL matrix decode: {_info.name}: {_why_wgsl}"))]
# (backend, cache dtype) of the modules that take float16 queries: GLSL's for every such cache, WGSL's for float16.
F16_QUERY_MODULES = [pytest.param("glsl", d, id=f"glsl-{np.dtype(d).name}") for d in CACHE_DTYPES] + [
    pytest.param("wgsl", np.float16, id="wgsl-float16", marks=MATRIX_BACKENDS[1].marks)]
_why_wgsl_bf16 = matrix_unavailable(_info, pagedvk.default_device().features, "bf16", "wgsl")
BF16_BACKENDS = [pytest.param("glsl"), pytest.param("wgsl", marks=pytest.mark.skipif(
    bool(_why_wgsl_bf16), reason=f"needs the WGSL bfloat16 matrix decode: {_info.name}: {_why_wgsl_bf16}"))]
BF16_SHAPES = (with_operands(MATRIX_SHAPE, "bf16"),)   # its P.V multiply too (16 x 16: decode_rules.MATRIX_PV_SHAPES)
CAPABLE = dataclasses.replace(_info, subgroup_size=32, subgroup_shuffle=True, subgroup_vote=True,
                              max_shared_memory=49152,
                              matrix_shapes=(MATRIX_SHAPE, MATRIX_PV_SHAPE) + BF16_SHAPES)


# -- the rule, on made-up devices --

def test_long_partitions_of_float16_and_fp8_vllm_caches_get_the_matrix_kernel(monkeypatch):
    monkeypatch.delenv("PAGEDVK_DECODE_KERNEL", raising=False)
    tokens = decode_rules.MATRIX_MIN_TOKENS
    for kv in ("f16", "e4m3", "e5m2"):
        for head_size in (64, 128):
            assert decode_rules.decode_matrix(CAPABLE, NEEDS, "glsl", kv, "f16", head_size, "vllm", 16, tokens) == "coopmat"
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, *F16, 128, "vllm", 16, tokens - 1) == ""   # short: the scalar kernel
    for head_size in (64, 128):   # WGSL: float16 caches and queries, with 16-bit storage on
        assert decode_rules.decode_matrix(CAPABLE, WGSL_NEEDS, "wgsl", "f16", "f16", head_size, "vllm", 16, tokens) == "coopmat"
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, "wgsl", "f16", "f16", 128, "vllm", 16, tokens) == ""
    for kv, q in (("e4m3", "f16"), ("e5m2", "f16"), ("bf16", "f16"), ("f32", "f32")):
        assert decode_rules.decode_matrix(CAPABLE, WGSL_NEEDS | BF16_NEEDS, "wgsl", kv, q, 128, "vllm", 16, tokens) == ""
    # WGSL bfloat16 (spirv_passes.bfloat16_matrices): where GLSL's runs, with 16-bit storage on, and not otherwise
    for head_size in (64, 128):
        assert decode_rules.decode_matrix(CAPABLE, WGSL_BF16_NEEDS, "wgsl", "bf16", "bf16", head_size, "vllm", 16,
                                    tokens) == "coopmat"
    assert decode_rules.decode_matrix(CAPABLE, WGSL_BF16_NEEDS, "wgsl", "bf16", "bf16", 128, "vllm", 16, tokens - 1) == ""
    assert decode_rules.decode_matrix(CAPABLE, BF16_NEEDS, "wgsl", "bf16", "bf16", 128, "vllm", 16, tokens) == ""
    assert decode_rules.decode_matrix(CAPABLE, WGSL_NEEDS, "wgsl", "bf16", "bf16", 128, "vllm", 16, tokens) == ""
    others = [("wgsl", "f16", "f16", 96, "vllm", 16), ("glsl", "bf16", "f16", 128, "vllm", 16),
              ("glsl", "f16", "f32", 128, "vllm", 16), ("glsl", "f16", "f16", 96, "vllm", 16),
              ("glsl", "e5m2", "bf16", 128, "vllm", 16), ("glsl", "f32", "f32", 128, "vllm", 16),
              ("glsl", "f16", "f16", 128, "nhd", 16), ("glsl", "f16", "f16", 128, "vllm", 32)]
    for args in others:
        assert decode_rules.decode_matrix(CAPABLE, NEEDS, *args, 1 << 20) == ""
    for kernel in ("gpu", "CPU"):   # the scalar kernels, forced
        assert decode_rules.decode_matrix(CAPABLE, NEEDS, *F16, 128, "vllm", 16, 1 << 20, kernel) == ""
    # bfloat16 caches and queries: with bfloat16 matrices listed and their features on
    for head_size in (64, 128):
        assert decode_rules.decode_matrix(CAPABLE, BF16_NEEDS, "glsl", "bf16", "bf16", head_size, "vllm", 16, tokens) == "coopmat"
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, "glsl", "bf16", "bf16", 128, "vllm", 16, tokens) == ""
    f16_only = dataclasses.replace(CAPABLE, matrix_shapes=(MATRIX_SHAPE, MATRIX_PV_SHAPE))
    for backend in ("glsl", "wgsl"):
        assert decode_rules.decode_matrix(f16_only, WGSL_BF16_NEEDS | NEEDS, backend, "bf16", "bf16", 128, "vllm", 16,
                                    tokens) == ""
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, *F16, 128, "vllm", 16, 16, "coopmat") == "coopmat"
    monkeypatch.setenv("PAGEDVK_DECODE_KERNEL", "coopmat")
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, *F16, 128, "vllm", 16, 16) == "coopmat"
    monkeypatch.setenv("PAGEDVK_DECODE_KERNEL", "gpu")
    assert decode_rules.decode_matrix(CAPABLE, NEEDS, *F16, 128, "vllm", 16, 1 << 20) == ""


def test_pagedvk_devices_names_every_cache_type_the_matrix_decode_takes(monkeypatch):
    monkeypatch.delenv("PAGEDVK_DECODE_KERNEL", raising=False)
    line = cli.describe_decode_kernel(dataclasses.replace(CAPABLE, type="discrete"))
    assert line.startswith("coopmat (shaders/paged_decode_coopmat.comp) for float16, float8_e4m3fn, float8_e5m2 "
                           "caches with float16 queries; bfloat16 caches with bfloat16 queries in vLLM's"), line
    assert "at head sizes 64 and 128" in line
    f16_only = dataclasses.replace(CAPABLE, type="discrete", matrix_shapes=(MATRIX_SHAPE, MATRIX_PV_SHAPE))
    assert "bfloat16" not in cli.describe_decode_kernel(f16_only)
    wgsl = cli.describe_decode_kernel(dataclasses.replace(CAPABLE, type="discrete", storage16=True))
    assert wgsl.endswith("; WGSL plans: coopmat (shaders/paged_decode_coopmat.wgsl) for float16 caches with float16 "
                         "queries; bfloat16 caches with bfloat16 queries likewise, gpu (shaders/paged_decode.wgsl) "
                         "otherwise"), wgsl
    wgsl_f16 = cli.describe_decode_kernel(dataclasses.replace(f16_only, storage16=True))
    assert wgsl_f16.endswith("; WGSL plans: coopmat (shaders/paged_decode_coopmat.wgsl) for float16 caches with "
                             "float16 queries likewise, gpu (shaders/paged_decode.wgsl) otherwise"), wgsl_f16
    no_16bit = cli.describe_decode_kernel(dataclasses.replace(CAPABLE, type="discrete", storage16=False))
    assert no_16bit.endswith("; WGSL plans: gpu (shaders/paged_decode.wgsl; the WGSL matrix decode needs 16-bit "
                             "storage)"), no_16bit


def test_long_float16_and_bfloat16_partitions_take_two_blocks_a_step():
    # catalogue.DecodeSpec.STEP: two blocks a subgroup step where a workgroup takes 2048 tokens or more (faster on the
    # H200 there, slower at 1024); fp8 modules take one whatever it says.
    assert decode_rules.MATRIX_STEP2_MIN_TOKENS == 2048
    for kv in ("f16", "bf16"):
        assert [decode_rules.matrix_step(kv, n) for n in (512, 1024, 2047, 2048, 8192)] == [1, 1, 1, 2, 2]
    for kv in ("e4m3", "e5m2"):
        assert decode_rules.matrix_step(kv, 8192) == 1


def test_the_matrix_split_fills_one_wave_of_its_workgroups():
    # H200-like: 132 units, two matrix workgroups each (264 slots); 8 workgroups a sequence (32 heads, GQA 4).
    assert decode_rules.matrix_partitioning(64, 8, 4096, 132) == (4096, 1)       # 512 workgroups: not split
    assert decode_rules.matrix_partitioning(32, 8, 16384, 132) == (16384, 1)     # 256 fill the wave
    assert decode_rules.matrix_partitioning(8, 8, 32768, 132) == (8192, 4)       # 64 x 4 = 256, not 64 x 5 = 320
    assert decode_rules.matrix_partitioning(1, 8, 32768, 132) == (1024, 32)
    assert decode_rules.matrix_partitioning(1, 8, 4096, 132) == (128, 32)        # one tile at least
    assert decode_rules.matrix_partitioning(8, 8, 0, 132) == (128, 1)


@pytest.mark.parametrize("info,features,args,reason", [
    (dataclasses.replace(CAPABLE, matrix_shapes=()), NEEDS, F16 + (128, "vllm", 16), "lists no 16x16x16"),
    (dataclasses.replace(CAPABLE, max_shared_memory=32768), NEEDS, F16 + (128, "vllm", 16),
     "offers 32768 bytes of workgroup memory"),
    (dataclasses.replace(CAPABLE, subgroup_size=64), NEEDS, F16 + (128, "vllm", 16), "subgroup size is 64"),
    (CAPABLE, {"shaderFloat16"}, F16 + (128, "vllm", 16), "did not enable the Vulkan feature(s) cooperativeMatrix"),
    (dataclasses.replace(CAPABLE, subgroup_vote=False), NEEDS, F16 + (128, "vllm", 16), "no subgroup vote"),
    (dataclasses.replace(CAPABLE, matrix_shapes=(MATRIX_SHAPE,)), NEEDS, F16 + (128, "vllm", 16), "lists no 16x8x16"),
    (CAPABLE, NEEDS, ("glsl", "bf16", "f16", 128, "vllm", 16), "backend 'glsl' with", ),
    (CAPABLE, NEEDS, ("glsl", "bf16", "bf16", 128, "vllm", 16), "did not enable the Vulkan feature(s) shaderBFloat16Type"),
    (dataclasses.replace(CAPABLE, matrix_shapes=(MATRIX_SHAPE, MATRIX_PV_SHAPE)), BF16_NEEDS,
     ("glsl", "bf16", "bf16", 128, "vllm", 16), "lists no 16x16x16 bf16*bf16+f32->f32"),
    (dataclasses.replace(CAPABLE, matrix_shapes=(MATRIX_SHAPE, with_operands(MATRIX_PV_SHAPE, "bf16"))),
     BF16_NEEDS, ("glsl", "bf16", "bf16", 128, "vllm", 16), "lists no 16x16x16 bf16*bf16+f32->f32"),
    (CAPABLE, WGSL_NEEDS, ("wgsl", "e4m3", "f16", 128, "vllm", 16), "backend 'wgsl' with bf16 caches with bf16 "
     "queries; f16 caches with f16 queries, head sizes 64/128, vLLM's layout and 16-token blocks, not cache e4m3"),
    (CAPABLE, NEEDS, ("wgsl", "f16", "f16", 128, "vllm", 16), "feature(s) storageBuffer16BitAccess"),
    (CAPABLE, BF16_NEEDS, ("wgsl", "bf16", "bf16", 128, "vllm", 16), "feature(s) storageBuffer16BitAccess"),
    (CAPABLE, WGSL_NEEDS, ("wgsl", "bf16", "bf16", 128, "vllm", 16), "feature(s) shaderBFloat16Type"),
    (dataclasses.replace(CAPABLE, matrix_shapes=(MATRIX_SHAPE, MATRIX_PV_SHAPE)), WGSL_BF16_NEEDS,
     ("wgsl", "bf16", "bf16", 128, "vllm", 16), "lists no 16x16x16 bf16*bf16+f32->f32"),
    (CAPABLE, WGSL_BF16_NEEDS, ("wgsl", "f16", "f16", 128, "vllm", 16), "feature(s) shaderFloat16"),
    (CAPABLE, NEEDS, F16 + (128, "nhd", 16), "layout 'nhd'"),
    (CAPABLE, NEEDS, F16 + (128, "vllm", 8), "block size 8"),
    (CAPABLE, NEEDS, F16 + (256, "vllm", 16), "head size 256"),
], ids=["no-shape", "shared-32k", "subgroup-64", "features", "vote", "no-16x8", "bf16", "bf16-features",
        "bf16-no-shape", "bf16-16x8-only", "wgsl-fp8", "wgsl-16bit", "wgsl-bf16-16bit", "wgsl-bf16-features", "wgsl-bf16-no-shape",
        "wgsl-f16-with-bf16-features", "nhd", "block-8", "head-256"])
def test_forcing_the_matrix_kernel_where_it_cannot_run_is_refused(info, features, args, reason):
    with pytest.raises(ValueError, match=r"kernel \(or PAGEDVK_DECODE_KERNEL\) 'coopmat' cannot run on .*"
                                         + re.escape(reason)):
        decode_rules.decode_matrix(info, features, *args, 1 << 20, "coopmat")


def test_a_plan_forced_onto_the_matrix_kernel_it_cannot_run_is_refused(rng):
    case = Case(rng, seq_lens=[40], dtype=np.float16)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=16, num_blocks=case.key_cache.shape[0],
              dtype=np.float16, kernel="coopmat", backend="glsl")
    with pytest.raises(ValueError, match="kernel .or PAGEDVK_DECODE_KERNEL. 'coopmat' cannot run"):
        pagedvk.DecodePlan(case.block_tables, case.seq_lens, **{**kw, **({} if _why else {"layout": "nhd"})})
    with pytest.raises(ValueError, match="kernel must be one of cpu, gpu, coopmat"):
        config.decode_kernel("tensor")


def test_the_matrix_module_is_declared_for_binding_access_with_the_decode_constants():
    key = catalogue.PAGED_DECODE.key("glsl", "f16", "f16", 128, matrix="coopmat")
    assert key.name == "paged_decode.coopmat.kv_f16.q_f16.h128.glsl"
    assert key.source == "paged_decode_coopmat.comp" and key.target_env == "vulkan1.2"
    assert catalogue.PAGED_DECODE.specialization_constants(key) == {
        catalogue.DecodeSpec.VARIANTS: "bool", catalogue.DecodeSpec.VALUE_ORDER: "uint32", catalogue.DecodeSpec.GROUP: "uint32",
        catalogue.DecodeSpec.MERGE: "uint32", catalogue.DecodeSpec.FP8_BUILD: "uint32", catalogue.DecodeSpec.STEP: "uint32"}
    with pytest.raises(ValueError, match="paged_decode has no 'coopmat' module reading caches by 'seg'"):
        catalogue.PAGED_DECODE.key("glsl", "f16", "f16", 128, "seg", "coopmat")
    built = [k for k in catalogue.PAGED_DECODE.keys() if k.matrix and k.backend == "glsl"]
    assert sorted(k.name for k in built) == sorted(
        [f"paged_decode.coopmat.kv_{kv}.q_f16.h{h}.glsl" for kv in ("e4m3", "e5m2", "f16") for h in (128, 64)]
        + [f"paged_decode.coopmat.kv_bf16.q_bf16.h{h}.glsl" for h in (128, 64)])
    bf16 = catalogue.PAGED_DECODE.key("glsl", "bf16", "bf16", 128, matrix="coopmat")
    assert set(bf16.requires()) == BF16_NEEDS and "shaderFloat16" not in bf16.requires()
    # WGSL: float16 caches and queries, and bfloat16 ones, the same interface, no specialization constants
    wgsl = [k for k in catalogue.PAGED_DECODE.keys() if k.matrix and k.backend == "wgsl"]
    assert sorted(k.name for k in wgsl) == [f"paged_decode.coopmat.kv_{t}.q_{t}.h{h}.wgsl"
                                            for t in ("bf16", "f16") for h in (128, 64)]
    wgsl_bf16 = catalogue.PAGED_DECODE.key("wgsl", "bf16", "bf16", 128, matrix="coopmat")
    assert wgsl_bf16.source == "paged_decode_coopmat.wgsl" and set(wgsl_bf16.requires()) == WGSL_BF16_NEEDS
    assert wgsl_bf16.includes()["q_storage.wgsl"] == "q_bf16.wgsl"   # its query conversion: bfloat16 bits
    key = catalogue.PAGED_DECODE.key("wgsl", "f16", "f16", 64, matrix="coopmat")
    assert key.source == "paged_decode_coopmat.wgsl" and key.target_env == "vulkan1.2"
    assert key.constants() == {"HEAD_SIZE": 64} and catalogue.PAGED_DECODE.specialization_constants(key) == {}
    assert set(key.requires()) == WGSL_NEEDS
    with pytest.raises(ValueError, match="paged_decode has no 'coopmat' module for wgsl, cache storage 'e4m3'"):
        catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f16", 128, matrix="coopmat")


# -- the kernel, on devices that have cooperative matrices --

def matrix_case(rng, dtype=np.float16, **kw) -> Case:
    """A Case with caches of `dtype` and the matrix kernel's queries: bfloat16 with bfloat16 caches, else float16."""
    case = Case(rng, dtype=dtype, **kw)
    case.query = case.query.astype(BF16 if np.dtype(dtype) == BF16 else np.float16)
    return case


# The matrix kernel, on GLSL unless a test names another backend (or kernel=None: the plan's choice).
run_coopmat = functools.partial(run_decode_plan, kernel="coopmat", backend="glsl")


def check_nan_heads(case, ref, ref_lse, **run):
    """The matrix decode on a case whose caches hold NaNs, against float64's out and lse (ref, ref_lse): the same NaN
    pattern and the finite outputs within TOL, unsplit, split through the reduce dispatch (32-token partitions) and
    in four partitions merged in the decode (80 tokens, sequences of at most 300). `run`: run_coopmat's arguments."""
    for partition_size in (4096, 32, 80):
        out, lse, key, _, _ = run_coopmat(case, case.query, partition_size, **run)
        assert key.matrix == "coopmat"
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        finite = ~np.isnan(ref)
        assert rel_error(out[finite], ref[finite]) <= TOL


def check_matrix_decode(case, tol=TOL, constants=None, backend="glsl", **variants):
    """check_split_and_unsplit on the matrix kernel: one partition; 32-token partitions (two blocks: two of the four
    subgroups idle), merged by the reduce dispatch where there are more than four; and at most four partitions (of the
    longest sequence; a sliding window may leave one), merged in the decode dispatch (GLSL; WGSL's go to the reduce
    dispatch); on GLSL each with one and with two blocks a subgroup step. `constants`: set on every run's plan."""
    longest = int(case.seq_lens.max())
    few = -(-longest // (16 * catalogue.DECODE_MERGE_PARTITIONS)) * 16   # tokens a partition: at most four of them
    sizes = ((4096, 1), (32, None), (few, catalogue.DECODE_MERGE_PARTITIONS))   # (partition size, most partitions or None)
    # GLSL: each with one block a subgroup step and with two (catalogue.DecodeSpec.STEP; fp8 modules take one anyway)
    steps = (1, 2) if backend == "glsl" else (None,)
    runs = list(itertools.product(sizes, steps))

    def check_run(index, run):
        (_, most), _ = runs[index]
        parts = run.num_partitions
        assert run.key.matrix == "coopmat" and run.key.backend == backend and (parts > 1 if most is None else parts <= most)
        assert run.merge_in_decode == (backend == "glsl" and 1 < parts <= catalogue.DECODE_MERGE_PARTITIONS)
    partitionings = [(size, {**(constants or {}), **({} if step is None else {catalogue.DecodeSpec.STEP: step})})
                     for (size, _), step in runs]
    check_split_and_unsplit(case, tol=tol, lse_tol=1e-5 if tol == TOL else 1e-4, partitionings=partitionings,
                            check_run=check_run, variants=variants, kernel="coopmat", backend=backend)


@needs_coopmat
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (16, 2), (12, 2), (6, 2)],
                         ids=["g1", "g4", "g8", "g6", "g3"])
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("backend,cache_dtype", F16_QUERY_MODULES)
def test_matches_float64_for_every_group_and_head_size(rng, backend, cache_dtype, head_size, num_heads, num_kv_heads):
    # Empty sequences, lengths that end mid-block and at a partition's edge, a long one; unread slots hold NaN.
    case = matrix_case(rng, cache_dtype, seq_lens=[1, 0, 6, 130, 300, 1100], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_size=head_size)
    poison_unread_slots(case, 16)
    check_matrix_decode(case, backend=backend)


@needs_bf16_coopmat
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (16, 2), (6, 2)], ids=["g1", "g4", "g8", "g3"])
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bfloat16_matches_float64_for_every_group_and_head_size(rng, backend, head_size, num_heads, num_kv_heads):
    # The bfloat16 modules (spirv_passes.bfloat16_matrices, GLSL and WGSL): bfloat16 caches and queries, matrices
    # of bfloat16.
    case = matrix_case(rng, BF16, seq_lens=[1, 0, 6, 130, 300, 1100], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_size=head_size)
    poison_unread_slots(case, 16)
    assert run_coopmat(case, case.query, 4096, backend=backend)[2].kv == "bf16"
    check_matrix_decode(case, tol=BF16_TOL, backend=backend)


@needs_bf16_coopmat
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bfloat16_keeps_values_float16_cannot_hold(rng, backend):
    # Values near 3e5 and 1e-6 (float16 tops out at 65504, and is subnormal below 6e-5) and keys of 1e3 in a few
    # dims: read as bfloat16 (or as float16 by mistake) they would give inf, zeros or wrong weights.
    case = matrix_case(rng, BF16, seq_lens=[40, 333], num_heads=8, num_kv_heads=2, head_size=128)
    scale = np.where(rng.random(case.value_cache.shape) < 0.5, 3e5, 1e-6)
    case.value_cache[:] = (case.value_cache.astype(np.float32) * scale).astype(BF16)
    case.key_cache[:] = (case.key_cache.astype(np.float32) * 1e-3).astype(BF16)
    case.query[:] = (case.query.astype(np.float32) * 1e3).astype(BF16)
    out, _, key, _, _ = run_coopmat(case, case.query, 4096, backend=backend)
    assert key.kv == "bf16" and key.backend == backend and np.abs(out.astype(np.float32)).max() > 65504
    assert rel_error(out, reference.paged_attention(case.query, *case.args()[1:])) <= BF16_TOL


# The fp8 matrices' builds (shaders/paged_decode_coopmat.comp, FP8): in registers (FP8_BUILD 2: a subgroup that finds
# its device's element layout unknown makes the outputs NaN, so this fails unless the register path ran; the layouts
# known are NVIDIA's, measured on the H200), and through shared memory (1: every other device's path, forced).
FP8_BUILDS = {"registers": {catalogue.DecodeSpec.FP8_BUILD: 2},
              "staged": {catalogue.DecodeSpec.FP8_BUILD: 1}}


@needs_coopmat
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 2), (6, 2)], ids=["g1", "g8", "g3"])
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("build", FP8_BUILDS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=lambda d: np.dtype(d).name)
def test_fp8_matrices_built_in_registers_and_staged(rng, cache_dtype, build, head_size, num_heads, num_kv_heads):
    if build != "staged" and _info.vendor != "NVIDIA":
        pytest.skip(f"the register build's element layouts are NVIDIA's; {_info.name} may take the staged one")
    case = matrix_case(rng, cache_dtype, seq_lens=[1, 0, 6, 130, 300, 1100], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_size=head_size)
    poison_unread_slots(case, 16)
    check_matrix_decode(case, constants=FP8_BUILDS[build])


@needs_coopmat
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("build", FP8_BUILDS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=lambda d: np.dtype(d).name)
def test_fp8_nan_bytes_read_make_the_outputs_nan_as_float64_does(rng, cache_dtype, build, head_size):
    # e4m3 blocks take a conversion that reads NaN bytes as 480 unless a NaN is in the block (shaders/
    # paged_decode_coopmat.comp, FP8): a NaN value byte makes its dim of its kv head's heads NaN, wherever in a block
    # it lies and of either sign; a NaN key byte inside a sequence makes its logit NaN, so every head of its kv head
    # is NaN there (out and lse), split or not (a split's merge once took a partition whose sums are NaN for an
    # empty one); the rest stays as float64 has it, and NaN key bytes past a sequence's end change nothing.
    if build != "staged" and _info.vendor != "NVIDIA":
        pytest.skip(f"the register build's element layouts are NVIDIA's; {_info.name} may take the staged one")
    case = matrix_case(rng, cache_dtype, seq_lens=[300, 300, 40, 300, 130], num_heads=8, num_kv_heads=2,
                       head_size=head_size)
    poison_unread_slots(case, 16)
    nan = np.array([0x7f, 0xff], np.uint8).view(cache_dtype)
    x = case.key_cache.shape[-1]
    for seq, token, kv_head, dim, sign in ((2, 45, 0, head_size - 1, 1), (4, 140, 1, 17, 1)):   # past the end
        block, slot = case.block_tables[seq, token // 16], token % 16
        case.key_cache[block, kv_head, dim // x, slot, dim % x] = nan[sign]
    for seq, token, kv_head, dim, sign in ((1, 201, 0, 33, 1), (3, 0, 0, 2, 0), (4, 129, 1, head_size - 2, 0)):
        block, slot = case.block_tables[seq, token // 16], token % 16
        case.value_cache[block, kv_head, dim, slot] = nan[sign]
    for seq, token, kv_head, dim, sign in ((0, 77, 1, 5, 0), (3, 299, 0, head_size - 1, 1)):   # inside
        block, slot = case.block_tables[seq, token // 16], token % 16
        case.key_cache[block, kv_head, dim // x, slot, dim % x] = nan[sign]
    ref, ref_lse = reference.paged_attention(case.query, *case.args()[1:], return_lse=True)
    assert 0 < np.isnan(ref).sum() < ref.size / 2 and np.isnan(ref_lse).sum() == 8   # two sequences' kv heads
    check_nan_heads(case, ref, ref_lse, constants=FP8_BUILDS[build])


@needs_coopmat
@pytest.mark.parametrize("backend", ["glsl", "wgsl"])
def test_a_nan_key_inside_a_sequence_makes_its_heads_nan(rng, backend):
    # float16 caches: a NaN key element inside a sequence makes that logit NaN, and float64 every head of its kv
    # head there (out and lse), unsplit, split through the reduce dispatch, and merged in the decode (GLSL).
    case = matrix_case(rng, np.float16, seq_lens=[300, 260, 40, 300], num_heads=8, num_kv_heads=2, head_size=128)
    poison_unread_slots(case, 16)
    x = case.key_cache.shape[-1]
    for seq, token, kv_head, dim in ((0, 77, 1, 5), (3, 299, 0, 127), (2, 0, 0, 64)):
        block, slot = case.block_tables[seq, token // 16], token % 16
        case.key_cache[block, kv_head, dim // x, slot, dim % x] = np.nan
    ref, ref_lse = reference.paged_attention(case.query, *case.args()[1:], return_lse=True)
    assert np.isnan(ref_lse).sum() == 12
    check_nan_heads(case, ref, ref_lse, backend=backend)


@needs_coopmat
@pytest.mark.parametrize("head_size", (64, 128))
def test_a_split_merged_in_the_decode_leaves_its_counters_at_zero(rng, head_size):
    # Many (sequence, head group) counters, every count of partitions the merge in the decode takes, and sequences
    # shorter than the split (empty, one partition, two): run after run on one plan, with new queries each time, the
    # result matches float64 and every counter is back at zero. Five partitions go to the reduce dispatch.
    lens = [0, 1, 16, 100, 257, 511, 512, 513, 700, 1024] * 4
    case = matrix_case(rng, seq_lens=lens, num_heads=16, num_kv_heads=4, head_size=head_size)
    kw = dict(num_heads=16, num_kv_heads=4, head_size=head_size, block_size=16, num_blocks=case.key_cache.shape[0],
              dtype=np.float16, query_dtype=np.float16, kernel="coopmat", backend="glsl")
    for parts in range(2, catalogue.DECODE_MERGE_PARTITIONS + 2):
        with pagedvk.DecodePlan(case.block_tables, case.seq_lens, partition_size=-(-1024 // parts // 16) * 16,
                                **kw) as plan:
            assert plan.num_partitions == parts
            assert plan.merge_in_decode == (parts <= catalogue.DECODE_MERGE_PARTITIONS)
            for _ in range(3):
                query = rng.standard_normal(case.query.shape).astype(np.float16)
                out = plan.run(query, case.key_cache, case.value_cache, out=np.full(query.shape, np.nan, np.float16))
                expect = reference.paged_attention(query, *case.args()[1:])
                assert rel_error(out, expect) <= TOL
                if plan.merge_in_decode:
                    assert plan.merge_counters.shape == (len(lens) * 4, 2)
                    assert not plan.merge_counters.numpy().any()


@needs_coopmat
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("backend", MATRIX_BACKENDS)
def test_attention_variants(rng, backend, name):
    case = Case(rng, seq_lens=[5, 77, 200, 513], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    poison_unread_slots(case, 16)
    check_matrix_decode(case, backend=backend, **variant_args(rng, 8, VARIANTS[name]))


@needs_coopmat
@pytest.mark.parametrize("backend", MATRIX_BACKENDS)
def test_a_max_that_keeps_rising_rescales_the_sums(rng, backend):
    # Each block's keys point further along head 0's query and away from head 1's (of each kv head's group) than
    # the last block's: head 0's max rises past the kernel's margin every few blocks, so the sums are rescaled
    # many times, while head 1's max stays at the first keys (its rescale factor 1 in the same rescales).
    case = Case(rng, seq_lens=[1000, 333], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    q = case.query.astype(np.float32)
    direction = q[:, 0::4] - q[:, 1::4]   # [seq, kv head, dim]
    for s, n in enumerate(case.seq_lens):
        for t in range(n):
            block, slot = case.block_tables[s, t // 16], t % 16
            k = direction[s] * (t / 8.0) + 0.3 * rng.standard_normal((2, 128))
            case.key_cache[block, :, :, slot, :] = k.reshape(2, 16, 8).astype(np.float16)
    check_matrix_decode(case, backend=backend)


@needs_coopmat
@pytest.mark.parametrize("backend,cache_dtype", F16_QUERY_MODULES)
def test_bad_tables_read_nothing_outside_the_caches(device, rng, backend, cache_dtype):
    # Unchecked tables (support.check_unchecked_tables): nothing read or written outside the buffers.
    case = matrix_case(rng, cache_dtype, seq_lens=[0, 50, 0, 70, 33, 9, 100], num_heads=8, num_kv_heads=2,
                       head_size=64)
    keys = check_unchecked_tables(device, case, "coopmat", TOL, backend)
    assert all(key.matrix == "coopmat" and key.backend == backend for key in keys)


@needs_coopmat
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=lambda d: np.dtype(d).name)
def test_every_fp8_byte_is_read_exactly(rng, cache_dtype):
    # One-token sequences put their value rows in the output as they are: the 256 bytes of the type (NaNs,
    # subnormals, zeros of both signs, the largest finite values; all of them float16 values) come out as
    # ml_dtypes decodes them.
    case = matrix_case(rng, cache_dtype, seq_lens=[1, 1], num_heads=4, num_kv_heads=2, head_size=128)
    every_byte = np.arange(256, dtype=np.uint8).reshape(2, 128)
    for seq in range(2):
        case.value_cache[case.block_tables[seq, 0], :, :, 0] = every_byte[seq].view(cache_dtype)
    out, lse, key, _, _ = run_coopmat(case, case.query, 4096)
    assert key.matrix == "coopmat"
    expected = np.repeat(every_byte.view(cache_dtype).astype(np.float16)[:, None, :], 4, axis=1)
    np.testing.assert_array_equal(out, expected)
    # Keys: 256 one-token sequences, sequence i's key holding byte i in dim 0 and zeros elsewhere, queries (1, 0, ...)
    # and scale 1: each lse is its one logit, the byte's value, exactly. Every finite byte; NaN and e5m2's
    # infinities are left out (zeros there): a softmax over them is NaN, however a kernel orders its maxima.
    values = np.arange(256, dtype=np.uint8).view(cache_dtype)
    case = matrix_case(rng, cache_dtype, seq_lens=[1] * 256, num_heads=2, num_kv_heads=2, head_size=64)
    case.key_cache[:] = 0
    case.query[:] = 0
    case.query[:, :, 0] = 1
    wanted = np.where(np.isfinite(values.astype(np.float32)), values.astype(np.float32), 0)
    case.key_cache[case.block_tables[:, 0], :, 0, 0, 0] = wanted.astype(cache_dtype)[:, None]
    _, lse, _, _, _ = run_coopmat(case, case.query, 4096, scale=1.0)
    np.testing.assert_array_equal(lse, np.repeat(wanted[:, None], 2, axis=1))


@needs_coopmat
@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8_e4m3", ml_dtypes.float8_e4m3fn),
                                                  ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_vllm_fp8_caches_as_uint8_with_scales(rng, kv_cache_dtype, dtype):
    # vLLM's fp8 caches: uint8 holding k / k_scale and v / v_scale, read as the plan's type; it multiplies back.
    case = matrix_case(rng, dtype, seq_lens=[700, 33], num_heads=8, num_kv_heads=2, head_size=128)
    k_scale, v_scale = 0.37, 2.5
    out, _, key, _, _ = run_coopmat(case, case.query, 4096, key_cache=case.key_cache.view(np.uint8),
                                 value_cache=case.value_cache.view(np.uint8), k_scale=k_scale, v_scale=v_scale)
    assert key.matrix == "coopmat" and key.kv == kv_cache_dtype[4:]
    ref = reference.paged_attention(case.query, case.key_cache.astype(np.float64) * k_scale,
                                    case.value_cache.astype(np.float64) * v_scale, case.block_tables, case.seq_lens)
    assert rel_error(out, ref) <= TOL


@needs_coopmat
@pytest.mark.parametrize("backend", MATRIX_BACKENDS)
def test_plans_pick_it_by_their_partitions_tokens(rng, monkeypatch, backend):
    monkeypatch.delenv("PAGEDVK_DECODE_KERNEL", raising=False)
    case = Case(rng, seq_lens=[2048, 1500], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    expect = case.reference()
    for partition_size, matrix in ((decode_rules.MATRIX_MIN_TOKENS, "coopmat"), (decode_rules.MATRIX_MIN_TOKENS // 2, "")):
        out, _, key, _, _ = run_coopmat(case, case.query, partition_size, kernel=None, backend=backend)
        assert key.matrix == matrix and key.backend == backend
        assert rel_error(out, expect) <= TOL
    # Unforced and unsplit by hand: the matrix kernel's own split (one wave of its workgroups), or the scalar's
    # where that leaves partitions too short.
    units = decode_rules.compute_units(pagedvk.default_device().info)
    size, parts = decode_rules.matrix_partitioning(2, 4, 2048, units)
    matrix = "coopmat" if (size if parts > 1 else 2048) >= decode_rules.MATRIX_MIN_TOKENS else ""
    out, _, key, got_parts, _ = run_coopmat(case, case.query, None, kernel=None, backend=backend)
    assert key.matrix == matrix
    assert got_parts == (parts if matrix else decode_rules.partitioning(2, 4, 2048, units)[1])
    assert rel_error(out, expect) <= TOL


@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("operand", ("f16", "bf16"))
def test_the_wgsl_module_declares_what_pagedvk_enables_and_unrolls_its_matrix_loops(operand, head_size):
    # spirv_passes.naga_matrix_fixes: of naga's 16-bit storage capabilities only the one the f16 caches need, subgroup
    # barriers that order workgroup memory, Unroll on the loops over the matrix arrays (kt, vt, o: ten of them) and on
    # the four over a step's blocks around them (not on the loop over the blocks, whose bound is the sequence's), and
    # zero matrices as glslang makes them (OpConstantComposite of one zero, not OpConstantNull).
    from pagedvk.kernels import spirv
    from pagedvk.kernels.modules import load_spirv
    words = spirv.module_words(load_spirv(catalogue.PAGED_DECODE, catalogue.PAGED_DECODE.key("wgsl", operand, operand, head_size,
                                                                                 matrix="coopmat")))
    constants, capabilities, barriers, loop_controls = {}, set(), [], []
    matrices, null_types, splats = set(), [], []   # matrix type ids (arrays of them too), OpConstantNull's types
    for _, op, operands in spirv.instructions(words):
        if op == spirv.OP_TYPE_COOPERATIVE_MATRIX_KHR:
            matrices.add(operands[0])
        elif op == spirv.OP_TYPE_ARRAY and operands[1] in matrices:
            matrices.add(operands[0])
        elif op == spirv.OP_CONSTANT_NULL:
            null_types.append(operands[0])
        elif op == spirv.OP_CONSTANT_COMPOSITE and operands[0] in matrices:
            splats.append(operands[0])
        elif op == spirv.OP_CONSTANT and len(operands) == 3:   # a 32-bit one: its type, id, value
            constants[operands[1]] = operands[2]
        elif op == spirv.OP_CAPABILITY:
            capabilities.add(operands[0])
        elif op == spirv.OP_CONTROL_BARRIER:   # (execution scope, semantics): the ids' constant values
            barriers.append((constants[operands[0]], constants[operands[2]]))
        elif op == spirv.OP_LOOP_MERGE:
            loop_controls.append(operands[2])
    assert spirv.CAP_STORAGE_BUFFER_16BIT_ACCESS in capabilities and not capabilities & {
        spirv.CAP_UNIFORM_AND_STORAGE_BUFFER_16BIT_ACCESS, spirv.CAP_STORAGE_PUSH_CONSTANT16,
        spirv.CAP_STORAGE_INPUT_OUTPUT16}
    assert {semantics for scope, semantics in barriers if scope == spirv.SCOPE_SUBGROUP} == {
        spirv.SEMANTICS_ACQUIRE_RELEASE | spirv.SEMANTICS_WORKGROUP_MEMORY}
    assert loop_controls.count(spirv.LOOP_CONTROL_UNROLL) == 14
    assert splats and not matrices & set(null_types)
