"""The cooperative-matrix prefill forward and backward (shaders/*_coopmat.comp; the forward's WGSL twin,
shaders/paged_prefill_coopmat.wgsl, runs each forward test for backend "wgsl" too) and the rule that picks them.

The rule and the property query are tested everywhere, with made-up property lists where the device has
none (lavapipe). The kernel itself runs only where the device lists its multiply: those tests are marked
`needs_coopmat`, skipped elsewhere with the reason (lavapipe has no cooperative matrices)."""

import dataclasses
import re
import struct

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.kernels.modules
import pagedvk.testing.reference
from pagedvk.kernels import abi, catalogue
from pagedvk.ops import prefill
from pagedvk.runtime.instance import MatrixShape
from support import VARIANTS, PrefillCase, lse_error, rel_error, variant_args

pytestmark = pytest.mark.usefixtures("poisoned_prefill_outputs")

TOL = 2e-3   # float16 storage and operands: about 4 units of float16's last place (2^-11)
BF16_TOL = 1.6e-2   # the same for bfloat16's (2^-8)
BF16 = ml_dtypes.bfloat16

F16_SHAPE = MatrixShape(16, 16, 16, "f16", "f16", "f32", "f32", "subgroup")
BF16_SHAPE = MatrixShape(16, 16, 16, "bf16", "bf16", "f32", "f32", "subgroup")
NEEDS = {"cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel"}
WGSL_NEEDS = NEEDS | {"storageBuffer16BitAccess"}   # the WGSL matrix modules' (abi.VariantKey.requires)
BF16_NEEDS = {"cooperativeMatrix", "vulkanMemoryModel", *abi.BFLOAT16_MATRIX_FEATURES}

_info = pagedvk.select()[0]
_why = prefill.matrix_unavailable(_info, pagedvk.default_device().features)   # what the device turned on
needs_coopmat = pytest.mark.skipif(bool(_why), reason=f"needs VK_KHR_cooperative_matrix: {_info.name}: {_why}")
_why_bf16 = prefill.matrix_unavailable(_info, pagedvk.default_device().features, "bf16")
needs_bf16_coopmat = pytest.mark.skipif(bool(_why_bf16), reason=f"needs bfloat16 matrices: {_info.name}: {_why_bf16}")


def with_shapes(shapes, subgroup_size=32):
    return dataclasses.replace(_info, matrix_shapes=tuple(shapes), subgroup_size=subgroup_size)


# -- the rule, on made-up devices --

def test_the_device_listing_the_multiply_gets_the_matrix_kernel():
    info = with_shapes([MatrixShape(16, 8, 16, "f16", "f16", "f16", "f16"), F16_SHAPE])
    assert prefill.matrix_unavailable(info, NEEDS) == ""
    assert prefill.matrix_kernel(info, NEEDS, "glsl", "f16", "f16", 128) == "coopmat"
    assert prefill.matrix_kernel(info, NEEDS, "glsl", "f16", "f16", 64) == "coopmat"
    for head_size in (64, 128):   # the WGSL forward (float16)
        assert prefill.matrix_kernel(info, WGSL_NEEDS, "wgsl", "f16", "f16", head_size) == "coopmat"
    assert prefill.describe_choice(info).startswith("coopmat (16x16x16 f16*f16+f32->f32 (subgroup)) for float16 caches")
    # bfloat16 caches and queries: where the device lists the bfloat16 multiply and its features are on
    assert prefill.matrix_kernel(info, NEEDS, "glsl", "bf16", "bf16", 128) == ""
    info = with_shapes([F16_SHAPE, BF16_SHAPE])
    for head_size in (64, 128):
        assert prefill.matrix_kernel(info, BF16_NEEDS, "glsl", "bf16", "bf16", head_size) == "coopmat"
        assert prefill.matrix_kernel(info, BF16_NEEDS, "wgsl", "bf16", "bf16", head_size) == ""   # WGSL: float16
    assert "for float16 or bfloat16 caches and queries" in prefill.describe_choice(info)
    with pytest.raises(ValueError, match=r"did not enable the Vulkan feature\(s\) shaderBFloat16Type, "
                                         "shaderBFloat16CooperativeMatrix"):
        prefill.matrix_kernel(info, NEEDS, "glsl", "bf16", "bf16", 128, kernel="coopmat")


@pytest.mark.parametrize("shapes,subgroup,features,reason", [
    ([], 32, NEEDS, "lists no 16x16x16 f16*f16+f32->f32"),
    ([MatrixShape(16, 16, 16, "f16", "f16", "f16", "f16")], 32, NEEDS, "lists no 16x16x16 f16*f16+f32->f32"),
    ([MatrixShape(16, 8, 16, "f16", "f16", "f32", "f32")], 32, NEEDS, "lists no"),
    ([dataclasses.replace(F16_SHAPE, scope="workgroup")], 32, NEEDS, "lists no"),
    ([F16_SHAPE], 64, NEEDS, "subgroup size is 64, not 32"),
    ([F16_SHAPE], 32, NEEDS, "no subgroup shuffles in compute shaders"),
    ([F16_SHAPE], 32, NEEDS - {"vulkanMemoryModel"}, "did not enable the Vulkan feature(s) vulkanMemoryModel"),
])
def test_other_devices_keep_the_scalar_kernel(shapes, subgroup, features, reason):
    info = with_shapes(shapes, subgroup)
    if "shuffles" in reason:
        info = dataclasses.replace(info, subgroup_shuffle=False)
    assert reason in prefill.matrix_unavailable(info, features)
    for backend in ("glsl", "wgsl"):
        assert prefill.matrix_kernel(info, features, backend, "f16", "f16", 128) == ""
        with pytest.raises(ValueError, match=f"kernel=.coopmat. cannot run on .*{re.escape(reason)}"):
            prefill.matrix_kernel(info, features, backend, "f16", "f16", 128, kernel="coopmat")


def test_wgsl_forward_needs_16bit_storage_where_glsl_does_not():
    # The WGSL matrix modules require storageBuffer16BitAccess (abi.VariantKey.requires); a device without it keeps
    # the WGSL forward on the scalar kernel, saying why, while GLSL takes its matrix forward.
    info = with_shapes([F16_SHAPE])
    assert prefill.matrix_kernel(info, NEEDS, "glsl", "f16", "f16", 128) == "coopmat"
    assert prefill.matrix_kernel(info, NEEDS, "wgsl", "f16", "f16", 128) == ""
    with pytest.raises(ValueError, match=r"did not enable the Vulkan feature\(s\) storageBuffer16BitAccess"):
        prefill.matrix_kernel(info, NEEDS, "wgsl", "f16", "f16", 128, kernel="coopmat")
    assert prefill.matrix_kernel(info, WGSL_NEEDS, "wgsl", "f16", "f16", 128) == "coopmat"


@pytest.mark.parametrize("backend,kv,q,head_size", [
    ("wgsl", "f16", "f32", 128), ("wgsl", "f16", "f16", 80), ("glsl", "f32", "f16", 128), ("glsl", "f16", "f32", 128),
    ("glsl", "bf16", "f16", 128), ("glsl", "f16", "f16", 80), ("glsl", "f16", "f16", 256)])
def test_arguments_without_a_matrix_module_keep_the_scalar_kernel(backend, kv, q, head_size):
    info = with_shapes([F16_SHAPE])
    assert prefill.matrix_kernel(info, WGSL_NEEDS, backend, kv, q, head_size) == ""
    assert prefill.matrix_kernel(info, WGSL_NEEDS, backend, kv, q, head_size, kernel="scalar") == ""
    with pytest.raises(ValueError, match=r"built for float16 or bfloat16 caches and queries \(the same type; "
                                         r"backend 'wgsl': float16 only\) at head sizes 64, 128"):
        prefill.matrix_kernel(info, WGSL_NEEDS, backend, kv, q, head_size, kernel="coopmat")


def test_blocks_under_8_tokens_keep_the_scalar_kernels():
    # The matrix kernels' window of 32 block ids (one a lane) must cover a step's keys: 1- to 4-token blocks run
    # the scalar kernels (forward and backward), saying why where "coopmat" is forced.
    info = with_shapes([F16_SHAPE])
    assert prefill.matrix_kernel(info, WGSL_NEEDS, "glsl", "f16", "f16", 128, block_size=8) == "coopmat"
    for block_size in (1, 2, 4):
        assert prefill.matrix_kernel(info, WGSL_NEEDS, "glsl", "f16", "f16", 128, block_size=block_size) == ""
        with pytest.raises(ValueError, match=f"take blocks of 8 tokens and more .*, not {block_size}"):
            prefill.matrix_kernel(info, WGSL_NEEDS, "wgsl", "f16", "f16", 128, "coopmat", block_size)


@pytest.mark.parametrize("direction", ("forward", "backward"))
def test_split_batches_bind_each_dispatch_its_own_tile_table(rng, monkeypatch, direction):
    """The mechanics of kernel="auto"'s split on any device: the matrix kernel's part of a ragged batch is
    played by the scalar module (its tiles built by the scalar rule), so both dispatches (the forward's, or the
    backward's dq), each binding its own tile table, run here and must together write every row."""
    scalar_key = prefill.PrefillProblem.key
    monkeypatch.setattr(prefill, "matrix_kernel", lambda *a: "coopmat")
    monkeypatch.setattr(prefill, "MATRIX_ROWS", lambda rows: prefill.forward_rows(64, rows))
    monkeypatch.setattr(prefill.PrefillProblem, "key", lambda self, kernel, access="", matrix=None: scalar_key(
        self, kernel, access, ""))
    launches, launch = [], prefill.Launch
    monkeypatch.setattr(prefill, "Launch", lambda device, steps, *a, **k: launches.append(steps) or launch(
        device, steps, *a, **k))
    case = PrefillCase(rng, q_lens=[1, 40, 0, 3, 17, 1], head_size=64, num_heads=4, num_kv_heads=2)
    ref = pagedvk.testing.reference.paged_attention_prefill(*case.args(), **case.options())
    if direction == "forward":
        got = pagedvk.paged_attention_prefill(*case.args(), **case.options())
    else:
        dout = rng.standard_normal(case.query.shape).astype(np.float32)
        got = pagedvk.paged_attention_backward(dout, *case.args()[:5], *(a.astype(np.float32) for a in ref),
                                               **case.loc(), **case.options())
        ref = pagedvk.testing.reference.paged_attention_backward(dout, *case.args(), **case.options())
    assert all(rel_error(g, r) <= 1e-5 for g, r in zip(got, ref))
    # rows 2 x q_len: 80 and 34 (3 tiles) on the "matrix" dispatch; 2, 6, 2 (3 tiles) on the scalar one; a
    # workgroup per (tile, kv head) each, and each dispatch binds its own table (binding 6, `tiles`); the
    # backward's delta dispatch comes before them and its dk/dv dispatch after
    (steps,) = launches
    tiled = steps[:2] if direction == "forward" else steps[1:3]
    assert [step[3] for step in tiled] == [(6, 1, 1), (6, 1, 1)]
    assert tiled[0][1][6] is not tiled[1][1][6]
    assert len(steps) == (2 if direction == "forward" else 4)


def test_kernel_argument_is_checked():
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'scalar', 'coopmat', got 'fast'"):
        prefill.matrix_kernel(_info, set(), "glsl", "f16", "f16", 128, kernel="fast")


def test_matrix_modules_are_named_built_and_required():
    key = catalogue.PAGED_PREFILL.key("glsl", "f16", "f16", 128, matrix="coopmat")
    assert key.name == "paged_prefill.coopmat.kv_f16.q_f16.h128.glsl"
    assert key.source == "paged_prefill_coopmat.comp" and key.target_env == "vulkan1.2"
    assert key.defines() == {"KV_F16": 1, "Q_F16": 1, "HEAD_SIZE": 128}
    assert set(key.requires()) == NEEDS
    assert catalogue.PAGED_PREFILL.key("glsl", "f16", "f16", 128, "seg", "coopmat").defines()["KV_SEGMENTED"] == 1
    built = {k for k in catalogue.PAGED_PREFILL.keys() if k.matrix}
    glsl = {k for k in built if k.backend == "glsl"}
    assert key in glsl and len(glsl) == 4 * len(abi.CACHE_ACCESS)   # float16 and bfloat16, head sizes 64 and 128
    with pytest.raises(ValueError, match="no 'coopmat' module for glsl, cache storage 'f16', query storage 'f16', "
                                         "head size 96"):
        catalogue.PAGED_PREFILL.key("glsl", "f16", "f16", 96, matrix="coopmat")
    # WGSL: float16 at both head sizes, caches in one binding or in segments (no buffer device addresses in WGSL)
    wgsl = catalogue.PAGED_PREFILL.key("wgsl", "f16", "f16", 128, matrix="coopmat")
    assert wgsl.name == "paged_prefill.coopmat.kv_f16.q_f16.h128.wgsl"
    assert wgsl.source == "paged_prefill_coopmat.wgsl" and wgsl.target_env == "vulkan1.2"
    assert wgsl.constants() == {"HEAD_SIZE": 128} and set(wgsl.requires()) == WGSL_NEEDS
    assert wgsl.includes()["kv_chunk_access.wgsl"] == "kv_chunk_bound.wgsl"
    assert catalogue.PAGED_PREFILL.key("wgsl", "f16", "f16", 64, "seg", "coopmat").includes()["kv_chunk_access.wgsl"] \
        == "kv_chunk_segmented.wgsl"
    assert built - glsl == {catalogue.PAGED_PREFILL.key("wgsl", "f16", "f16", h, access, "coopmat")
                            for h in (64, 128) for access in ("", "seg")}
    for args in (("wgsl", "bf16", "bf16", 128), ("wgsl", "f16", "f16", 128, "bda")):
        with pytest.raises(ValueError, match="no 'coopmat' module"):
            catalogue.PAGED_PREFILL.key(*args, matrix="coopmat")
    # the backward has no WGSL matrix modules: a WGSL plan's backward runs the scalar ones
    assert not any(k.matrix and k.backend == "wgsl" for k in catalogue.PAGED_BACKWARD_DQ.keys())


# -- the device's own properties --

def test_property_query_matches_the_extension():
    for info in pagedvk.devices():
        if "VK_KHR_cooperative_matrix" not in info.extensions:
            assert info.matrix_shapes == ()
        assert all(isinstance(s, MatrixShape) and s.m > 0 for s in info.matrix_shapes)


def test_matrix_feature_is_enabled_only_with_the_extension(rng):
    from pagedvk.runtime.instance import layer_knows_cooperative_matrix
    device = pagedvk.default_device()
    # off under a validation layer too old to know the extension's structures (Debian 12's 1.3.239)
    layer_allows = not device.instance.validation or layer_knows_cooperative_matrix(device.instance.layer_version)
    assert ("cooperativeMatrix" in device.features) == (bool(device.info.matrix_shapes) and layer_allows)
    # the memory model comes only with the matrices: with it on, the cache writers' Device-scope atomics would
    # need vulkanMemoryModelDeviceScope too (the validation layer says so)
    assert ("vulkanMemoryModel" in device.features) == ("cooperativeMatrix" in device.features)
    # bfloat16 matrices: only with the matrices and VK_KHR_shader_bfloat16, both features together
    bf16_on = {f for f in abi.BFLOAT16_MATRIX_FEATURES if f in device.features}
    assert bf16_on in (set(), set(abi.BFLOAT16_MATRIX_FEATURES))
    if bf16_on:
        assert "cooperativeMatrix" in device.features and "VK_KHR_shader_bfloat16" in device.info.extensions
    if _why:   # the automatic choice runs the scalar kernel, and asking for the matrix one says why not
        case = PrefillCase(rng, q_len=3, head_size=128)
        assert max(run_f16(case, "auto")) <= TOL
        with pytest.raises(ValueError, match="kernel='coopmat' cannot run"):
            run_f16(case, "coopmat")


def test_bfloat16_feature_struct_is_laid_out_as_vulkan_declares_it():
    # VkPhysicalDeviceShaderBfloat16FeaturesKHR by hand (the `vulkan` package predates it): sType, pNext at 8,
    # then shaderBFloat16Type, shaderBFloat16DotProduct, shaderBFloat16CooperativeMatrix at 16, 20, 24.
    import vulkan as vk
    from pagedvk.runtime.instance import Bfloat16Features
    tail = Bfloat16Features()
    head = Bfloat16Features(p_next=tail.pointer, type_=True, matrix=True)
    raw = bytes(vk.ffi.buffer(head.words))
    assert struct.unpack_from("<I", raw, 0)[0] == 1000141000
    assert struct.unpack_from("<Q", raw, 8)[0] == int(vk.ffi.cast("uintptr_t", tail.pointer))
    assert struct.unpack_from("<3I", raw, 16) == (1, 0, 1) and head.type and head.matrix
    assert not tail.type and not tail.matrix and struct.unpack_from("<Q", bytes(vk.ffi.buffer(tail.words)), 8)[0] == 0


# -- the kernel, where it runs --

def f16_caches(case, dtype=np.float16):
    """The case's caches in float16 (or bfloat16), in its layout (vLLM's packs x = 8 16-bit key elements, not 4)."""
    k, v = (a.astype(dtype) for a in pagedvk.testing.reference.caches_as_nhd(case.key_cache, case.value_cache, case.layout))
    num_blocks, block_size, num_kv_heads, head_size = k.shape
    key_shape = (num_blocks, num_kv_heads, head_size // 8, block_size, 8)
    return tuple(np.ascontiguousarray(a) for a in pagedvk.testing.reference.nhd_as_cache(k, v, case.layout, key_shape))


def run_f16(case, kernel, caches=None, dtype=np.float16, backend="glsl", **variants):
    """(out's, lse's) relative error against float64 on the same float16 (or `dtype`: bfloat16) inputs (the
    case's caches, or `caches` in its layout), with the attention variants given; rows that see no key must give
    lse -inf (and zeros), as the reference."""
    args = (case.query.astype(dtype), *(caches or f16_caches(case, dtype)), *case.args()[3:])
    out, lse = pagedvk.paged_attention_prefill(*args, kernel=kernel, backend=backend, **case.options(**variants))
    ref_out, ref_lse = pagedvk.testing.reference.paged_attention_prefill(*args, **case.options(**variants))
    assert out.dtype == dtype and lse.dtype == np.float32
    return rel_error(out, ref_out), lse_error(lse, ref_lse)


# The backends of the forward's matrix modules (the backward's are GLSL's only).
FORWARD_BACKENDS = pytest.mark.parametrize("backend", catalogue.PAGED_PREFILL.matrix_backends)


@needs_coopmat
@pytest.mark.parametrize("direction,backend", (("forward", "glsl"), ("forward", "wgsl"), ("backward", "glsl")))
@pytest.mark.parametrize("layout", ("nhd", "vllm", "hnd"))
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("q_len", (1, 7, 100))
def test_matrix_kernels_match_reference(rng, direction, backend, layout, causal, head_size, q_len):
    # shared prefix blocks: in the backward their dK and dV add up over the sequences reading them
    case = PrefillCase(rng, q_len=q_len, layout=layout, causal=causal, head_size=head_size, num_heads=8,
                       num_kv_heads=2, shared_prefix_blocks=2)
    errors = (run_f16(case, "coopmat", backend=backend) if direction == "forward"
              else run_f16_backward(case, "coopmat", rng))
    assert max(errors) <= TOL


@needs_bf16_coopmat
@pytest.mark.parametrize("direction", ("forward", "backward"))
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("q_len", (1, 100))
def test_bfloat16_matrix_kernels_match_reference(rng, direction, layout, head_size, q_len, monkeypatch):
    # The bfloat16 modules (spirv_passes.bfloat16_matrices), forward, dq and dk/dv, on bfloat16 caches and queries.
    modules, pipeline = [], pagedvk.kernels.modules.pipeline
    monkeypatch.setattr(pagedvk.kernels.modules, "pipeline",
                        lambda device, kernel, key, *a: modules.append(key.name) or pipeline(device, kernel, key, *a))
    case = PrefillCase(rng, q_len=q_len, layout=layout, head_size=head_size, num_heads=8, num_kv_heads=2,
                       shared_prefix_blocks=2, seq_lens=[q_len, 0, q_len + 300])
    errors = (run_f16(case, "coopmat", dtype=BF16) if direction == "forward"
              else run_f16_backward(case, "coopmat", rng, BF16))
    assert max(errors) <= BF16_TOL
    # every attention module on its bfloat16 matrix module (the backward's first dispatch, D = rowsum(dout * out),
    # has no matrix module: paged_backward_delta)
    attention = [name for name in modules if not name.startswith("paged_backward_delta.")]
    assert attention and all(".coopmat.kv_bf16." in name for name in attention)
    assert (direction == "backward") == any(name.startswith("paged_backward_delta.") for name in modules)


@needs_bf16_coopmat
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
def test_bfloat16_matrix_kernels_ragged_batch_with_every_variant(rng, layout):
    case = ragged_case(rng, layout)
    out_err, lse_err = run_f16(case, "auto", dtype=BF16, **variant_args(rng, 12, VARIANTS["all"]))
    assert out_err <= BF16_TOL and lse_err <= 1e-4
    assert max(run_f16_backward(case, "auto", rng, BF16)) <= BF16_TOL


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("block_size", (8, 16, 32))
def test_matrix_kernel_many_tiles_and_block_sizes(rng, block_size, backend):
    # rows over several 64-row tiles, contexts over several 64-key steps, an empty sequence, MQA
    case = PrefillCase(rng, q_len=70, head_size=128, num_heads=4, num_kv_heads=1, block_size=block_size,
                       seq_lens=[70, 0, 333, 129])
    out_err, lse_err = run_f16(case, "coopmat", backend=backend)
    assert out_err <= TOL and lse_err <= TOL


def ragged_case(rng, layout):
    """Prompts, chunks, decode tokens and empty sequences in one batch; GQA groups across 64-row tiles."""
    return PrefillCase(rng, q_lens=[0, 1, 70, 5, 130, 1, 0, 33], layout=layout, head_size=128, num_heads=12,
                       num_kv_heads=4)


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("variants", ("none", "all"))
@pytest.mark.parametrize("layout", ("nhd", "vllm", "hnd"))
def test_matrix_kernel_ragged_batch(rng, layout, variants, backend):
    # prompts, chunks, decode tokens and empty sequences in one batch; GQA groups across 64-row tiles; with
    # every variant at once (sinks on rows that see keys and on none) or none
    case = ragged_case(rng, layout)
    kw = variant_args(rng, 12, VARIANTS["all"]) if variants == "all" else {}
    out_err, lse_err = run_f16(case, "coopmat", backend=backend, **kw)
    assert out_err <= TOL and lse_err <= TOL


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
def test_matrix_kernel_rescales_where_maxima_grow(rng, layout, backend):
    # logits of spread 30: a row's max grows past the one its weights are taken against by more than the WGSL
    # kernel's RESCALE_ABOVE (8) at later steps, so its accumulators are rescaled (through shared memory there),
    # rows of one subgroup at different steps; the weights stay within float16
    case = PrefillCase(rng, q_len=100, layout=layout, head_size=128, num_heads=8, num_kv_heads=2,
                       seq_lens=[100, 700, 300])
    case.query *= 30
    out_err, lse_err = run_f16(case, "coopmat", backend=backend)
    assert out_err <= TOL and lse_err <= TOL


@needs_coopmat
@FORWARD_BACKENDS
def test_auto_picks_the_matrix_kernel(rng, backend):
    device = pagedvk.default_device()
    assert prefill.matrix_kernel(device.info, device.features, backend, "f16", "f16", 128) == "coopmat"
    case = PrefillCase(rng, q_len=33, head_size=128)
    assert run_f16(case, "auto", backend=backend)[0] <= TOL


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
def test_auto_runs_short_sequences_on_the_scalar_kernel_in_the_same_launch(rng, layout, backend, monkeypatch):
    # prompts on the matrix kernel; decode tokens and a short chunk (fewer than MATRIX_MIN_ROWS rows) on the
    # scalar kernel's tiles, each half of the batch's rows written by one dispatch of the same submission
    modules, pipeline = [], pagedvk.kernels.modules.pipeline
    monkeypatch.setattr(pagedvk.kernels.modules, "pipeline",
                        lambda device, kernel, key, *a: modules.append(key.name) or pipeline(device, kernel, key, *a))
    case = PrefillCase(rng, q_lens=[1, 70, 0, 1, 3, 130, 1], layout=layout, head_size=128, num_heads=8, num_kv_heads=2)
    out_err, lse_err = run_f16(case, "auto", backend=backend)
    assert out_err <= TOL and lse_err <= TOL
    assert modules == [f"paged_prefill.coopmat.kv_f16.q_f16.h128.{backend}", f"paged_prefill.kv_f16.{backend}"]
    modules.clear()
    run_f16(PrefillCase(rng, q_lens=[1, 2, 1], layout=layout, head_size=128, num_heads=8, num_kv_heads=2), "auto",
            backend=backend)
    assert modules == [f"paged_prefill.kv_f16.{backend}"]   # only short sequences: the matrix dispatch is empty
    modules.clear()
    run_f16(case, "coopmat", backend=backend)                    # forced: every row on the matrix kernel
    assert modules == [f"paged_prefill.coopmat.kv_f16.q_f16.h128.{backend}"]


# -- the attention variants (issue 11) in the matrix kernel, where it runs --

@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_size", (64, 128))
def test_matrix_kernel_each_variant_and_all(rng, layout, variant, head_size, backend):
    # GQA, a query tile over several 64-key steps; all variants also without causal masking
    case = PrefillCase(rng, q_len=40, layout=layout, head_size=head_size, num_heads=8, num_kv_heads=2,
                       seq_lens=[40, 230, 75])
    kw = variant_args(rng, 8, VARIANTS[variant])
    for causal in (True, False) if variant == "all" else (True,):
        case.causal = causal
        out_err, lse_err = run_f16(case, "coopmat", backend=backend, **kw)
        assert out_err <= TOL and lse_err <= TOL


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("window_left", [0, 1, 15, 63, 64, 100, 5000])
def test_matrix_kernel_window_edges(rng, window_left, backend):
    # windows within one block, one 64-key step, across steps and longer than every context; MQA tiles of
    # 64 rows whose first and last rows' windows differ
    case = PrefillCase(rng, q_len=70, head_size=128, num_heads=4, num_kv_heads=1, block_size=8,
                       seq_lens=[70, 333, 129])
    out_err, lse_err = run_f16(case, "coopmat", backend=backend, window_left=window_left)
    assert out_err <= TOL and lse_err <= TOL


@needs_coopmat
@FORWARD_BACKENDS
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
def test_matrix_kernel_window_does_not_read_blocks_before_it(rng, layout, backend):
    # NaN in every block wholly before the window of each sequence's first query: the matrix kernel's
    # steps start at the tile's first window block, so none of them is read (NaN would reach out)
    q_len, window_left, bs = 20, 30, 16
    case = PrefillCase(rng, q_len=q_len, layout=layout, head_size=64, num_heads=8, num_kv_heads=2,
                       block_size=bs, seq_lens=[600, 300, 100])
    k, v = f16_caches(case)
    args = (case.query.astype(np.float16), k, v, *case.args()[3:])
    ref_out, ref_lse = pagedvk.testing.reference.paged_attention_prefill(*args, **case.options(window_left=window_left))
    for s, n in enumerate(case.seq_lens):
        for b in case.block_tables[s, :(n - q_len - window_left) // bs]:
            k[b] = v[b] = np.nan
    out, lse = pagedvk.paged_attention_prefill(*args, kernel="coopmat", backend=backend,
                                               **case.options(window_left=window_left))
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


# -- the backward's matrix kernels (dq, dk/dv), where they run --

def run_f16_backward(case, kernel, rng, dtype=np.float16):
    """(dq's, dk's, dv's) relative error against float64 on the same float16 (or `dtype`: bfloat16) inputs, with
    the forward's out (rounded to that type) and lse from the reference, and a dout of that type."""
    args = (case.query.astype(dtype), *f16_caches(case, dtype), *case.args()[3:5])
    ref_out, ref_lse = pagedvk.testing.reference.paged_attention_prefill(*args, *case.args()[5:], **case.options())
    dout = rng.standard_normal(case.query.shape).astype(dtype)
    grads = pagedvk.paged_attention_backward(dout, *args, ref_out.astype(dtype), ref_lse.astype(np.float32),
                                             kernel=kernel, **case.loc(), **case.options())
    refs = pagedvk.testing.reference.paged_attention_backward(dout, *args, *case.args()[5:], **case.options())
    for g, like in zip(grads, args):
        assert g.shape == like.shape and g.dtype == np.float32
    return tuple(rel_error(g, ref) for g, ref in zip(grads, refs))


@needs_coopmat
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
@pytest.mark.parametrize("block_size", (8, 16, 32))
def test_matrix_backward_many_tiles_and_block_sizes(rng, layout, block_size):
    # rows over several 64-row tiles and steps, contexts over several 32-key steps, an empty sequence, MQA;
    # 8-token blocks fill half of the dk/dv kernel's 16 keys, 32-token blocks take two workgroups each
    case = PrefillCase(rng, q_len=70, layout=layout, head_size=128, num_heads=4, num_kv_heads=1,
                       block_size=block_size, seq_lens=[70, 0, 333, 129])
    assert max(run_f16_backward(case, "coopmat", rng)) <= TOL


@needs_coopmat
@pytest.mark.parametrize("kernel", ("coopmat", "auto"))
@pytest.mark.parametrize("layout", ("nhd", "vllm"))
def test_matrix_backward_ragged_batch(rng, layout, kernel):
    # prompts, chunks, decode tokens and empty sequences in one batch, GQA groups across 64-row tiles; "auto"
    # runs the short sequences' dq on the scalar kernel in the same launch
    case = ragged_case(rng, layout)
    assert max(run_f16_backward(case, kernel, rng)) <= TOL


@needs_coopmat
def test_auto_picks_the_matrix_backward(rng, monkeypatch):
    modules, pipeline = [], pagedvk.kernels.modules.pipeline
    monkeypatch.setattr(pagedvk.kernels.modules, "pipeline",
                        lambda device, kernel, key, *a: modules.append(key.name) or pipeline(device, kernel, key, *a))
    case = PrefillCase(rng, q_lens=[70, 1, 33], head_size=128, num_heads=8, num_kv_heads=2)
    assert max(run_f16_backward(case, "auto", rng)) <= TOL
    assert modules == ["paged_backward_delta.glsl", "paged_backward_dq.coopmat.kv_f16.q_f16.h128.glsl",
                       "paged_backward_dq.kv_f16.glsl", "paged_backward_dkdv.coopmat.kv_f16.q_f16.h128.glsl"]


def test_backward_matrix_modules_are_named_and_built():
    for abi_ in (catalogue.PAGED_BACKWARD_DQ, catalogue.PAGED_BACKWARD_DKDV):
        key = abi_.key("glsl", "f16", "f16", 64, matrix="coopmat")
        assert key.source == f"{abi_.op}_coopmat.comp" and set(key.requires()) == NEEDS
        assert set(abi_.key("glsl", "bf16", "bf16", 64, matrix="coopmat").requires()) == BF16_NEEDS
        assert {k for k in abi_.keys() if k.matrix} == {
            abi_.key("glsl", t, t, h, access, "coopmat") for t in ("f16", "bf16") for h in (64, 128)
            for access in abi.CACHE_ACCESS}


def test_backward_kernel_argument(rng):
    """On any device: the backward takes the forward's kernel names. "auto" and "scalar" run (the scalar kernels
    where the device has no matrices); an unknown name, float32 caches forced onto the matrix kernels and, on a
    device without them, the matrix kernels forced are refused with the argument named."""
    case = PrefillCase(rng, q_len=5, head_size=64)
    for kernel in ("auto", "scalar"):
        assert max(run_f16_backward(case, kernel, rng)) <= TOL
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'scalar', 'coopmat', got 'fast'"):
        run_f16_backward(case, "fast", rng)
    out, lse = case.reference()
    with pytest.raises(ValueError, match="kernel='coopmat' cannot run on"):   # float32: no matrix module
        pagedvk.paged_attention_backward(case.query, *case.args()[:5], out.astype(np.float32),
                                         lse.astype(np.float32), kernel="coopmat", **case.options())
    if _why:
        with pytest.raises(ValueError, match=f"kernel='coopmat' cannot run on .*{re.escape(_why)}"):
            run_f16_backward(case, "coopmat", rng)
