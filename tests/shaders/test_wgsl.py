"""The WGSL modules: sources that declare what pagedvk/kernels/abi.py declares, the naming of per-variant sources,
and backend="wgsl" running them (the numbers are checked per op in test_decode, test_prefill and
test_backward, on both backends)."""

import dataclasses
import re

import numpy as np
import pytest

import pagedvk
import pagedvk.errors
from pagedvk.kernels import abi, catalogue
from support import REPO, PrefillCase, modules_used, rel_error

SHADERS = REPO / "shaders"
WGSL_KERNELS = [k for k in catalogue.KERNELS if "wgsl" in k.backends]
# Every WGSL module: the sources and bindings differ by cache access (one binding, or segments), the storage
# files by type.
WGSL_KEYS = [(k, key) for k in WGSL_KERNELS for key in k.keys() if key.backend == "wgsl"]


def source(key):
    """The module's WGSL with what it includes (`//!include`, pasted in by build_shaders.py)."""
    return "".join(p.read_text() for p in abi.source_files(SHADERS, key))


def test_every_attention_op_has_a_wgsl_module():
    assert {k.op for k in WGSL_KERNELS} >= {"paged_decode", "paged_prefill", "paged_backward_dq",
                                            "paged_backward_dkdv", "paged_decode_reduce"}


@pytest.mark.parametrize("kernel,key", WGSL_KEYS, ids=[key.name for _, key in WGSL_KEYS])
def test_push_constant_struct_is_the_declared_one(kernel, key):
    # Reflection sees offsets only (and naga wraps the struct in another); names and types are checked here.
    text = source(key)
    body = re.search(r"struct Params \{(.*?)\}", text, re.S).group(1)
    fields = re.findall(r"(\w+)\s*:\s*(\w+)\s*,", body)
    assert fields == [(f.name, f.kind) for f in kernel.push]
    assert re.search(r"^var<immediate> pc: Params;$", text, re.M)
    # core WGSL only (no subgroups, no f16), but for the matrix modules: f16 and naga's matrices
    enables = re.findall(r"^\s*enable (\w+);", text, re.M)
    assert enables == (["f16", "wgpu_cooperative_matrix"] if key.matrix else []), enables


@pytest.mark.parametrize("kernel,key", WGSL_KEYS, ids=[key.name for _, key in WGSL_KEYS])
def test_bindings_are_the_declared_ones(kernel, key):
    # A segmented cache's extra bindings are numbered from the module's KV_SEGMENT_BINDING.
    text = source(key)
    consts = {name: int(value) for name, value in re.findall(r"^const (\w+): u32 = (\d+)u;", text, re.M)}

    def number(expr):
        first, *rest = [term.strip().rstrip("u") for term in expr.split("+")]
        return (consts[first] if first in consts else int(first)) + sum(int(t) for t in rest)

    found = re.findall(r"@group\(0\) @binding\(([^)]+)\) var<storage, (read|read_write)> (\w+):", text)
    assert sorted((number(i), access, name) for i, access, name in found) == [
        (i, "read" if b.readonly else "read_write", b.name) for i, b in enumerate(kernel.bindings_for(key))]
    assert f"@workgroup_size({', '.join(map(str, kernel.workgroup_size))})" in text


def test_storage_files_stand_in_for_the_generic_includes():
    # WGSL has no preprocessor: a module includes generic names, the key picks the files pasted for them.
    key = catalogue.PAGED_DECODE.key("wgsl", "e4m3", "bf16", access="seg")
    names = [p.name for p in abi.source_files(SHADERS, key)]
    assert names == ["paged_decode.wgsl", "kv_e4m3.wgsl", "q_any.wgsl", "q_output.wgsl", "attention_common.wgsl",
                     "attention_variants.wgsl", "kv_chunk_segmented.wgsl", "decode_output.wgsl",
                     "decode_reduce_subgroup.wgsl"]
    # and the reduction: subgroup arithmetic, or shared memory only for devices without it
    shared = catalogue.PAGED_DECODE.key("wgsl", "e4m3", "bf16", access="seg", subgroup_arithmetic=False)
    assert [p.name for p in abi.source_files(SHADERS, shared)][-1] == "decode_reduce_shared.wgsl"
    # The decode reads 16-byte chunks; prefill keeps its quads.
    key = catalogue.PAGED_PREFILL.key("wgsl", "f16", "f16")
    assert "kv_bound.wgsl" in [p.name for p in abi.source_files(SHADERS, key)]
    decode = catalogue.PAGED_DECODE.key("wgsl", "f16", "f16")
    assert "kv_chunk_bound.wgsl" in [p.name for p in abi.source_files(SHADERS, decode)]
    for tag in abi.STORAGE_TYPES:
        text = (SHADERS / f"kv_{tag}.wgsl").read_text()
        assert re.search(r"^alias KvQuad = (vec4<u32>|vec2<u32>|u32);$", text, re.M), tag
        assert re.search(r"^const KV_CHUNK_QUADS: u32 = [124]u;$", text, re.M), tag
        assert "fn kv_quad(w: KvQuad) -> vec4<f32>" in text, tag
        assert "fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32>" in text, tag
    # Queries: the type from the push constants (q_any.wgsl), but in the matrix modules, built for one type.
    text = (SHADERS / "q_any.wgsl").read_text()
    assert "fn q_quad_of(w: vec4<u32>) -> vec4<f32>" in text and "fn q_pair_of(v: vec2<f32>) -> vec2<u32>" in text
    for tag in abi.QUERY_TYPES:
        text = (SHADERS / f"q_{tag}.wgsl").read_text()
        assert "fn q_quad(w: QQuad) -> vec4<f32>" in text and "fn out_pair(v: vec2<f32>) -> OutPair" in text, tag
    matrix = catalogue.PAGED_DECODE.key("wgsl", "f16", "f16", 128, matrix="coopmat")
    assert matrix.includes()["q_storage.wgsl"] == "q_f16.wgsl"
    assert "token_input.wgsl" not in catalogue.RESHAPE_AND_CACHE.key("wgsl", "f16", "bf16").includes()


def test_backend_argument_picks_the_wgsl_modules(rng, monkeypatch):
    used = modules_used(monkeypatch)
    case = PrefillCase(rng, q_len=3)
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    results = {}
    for backend in ("glsl", "wgsl"):
        out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend, **case.options())
        results[backend] = (out, lse) + pagedvk.paged_attention_backward(dout, *case.args(), out, lse, backend=backend,
                                                                         **case.options())
    ops = ["paged_prefill", "paged_backward_delta", "paged_backward_dq", "paged_backward_dkdv"]
    assert used == [(op, "glsl") for op in ops] + [(op, "wgsl") for op in ops]
    # The same algorithm through two compilers: equal to float32 rounding.
    for a, b in zip(results["glsl"], results["wgsl"]):
        assert rel_error(b, a) <= 1e-6


def test_prefill_workgroup_memory_is_the_declared_one():
    # The forward's one workgroup array, S_MEM vec4s, is what pagedvk.ops.prefill checks a device for.
    text = (SHADERS / "paged_prefill.wgsl").read_text()
    consts = {name: int(value) for name, value in re.findall(r"^const (\w+): u32 = (\d+)u;", text, re.M)}
    assert re.findall(r"^var<workgroup> (\w+): array<vec4<f32>, (\w+)>;", text, re.M) == [("s_mem", "S_MEM")]
    assert len(re.findall(r"^var<workgroup>", text, re.M)) == 1
    assert re.search(r"^const S_MEM: u32 = RED \+ 2u \* CHUNK_QUADS;", text, re.M)
    assert 16 * (consts["RED"] + 2 * consts["CHUNK_QUADS"]) == catalogue.PREFILL_WGSL_SHARED_BYTES


def test_prefill_refuses_a_device_with_too_little_workgroup_memory(rng, device, monkeypatch):
    monkeypatch.setattr(device, "info", dataclasses.replace(device.info, max_shared_memory=16384))
    case = PrefillCase(rng, q_len=3)
    with pytest.raises(pagedvk.errors.UnsupportedFeatureError, match="maxComputeSharedMemorySize"):
        pagedvk.paged_attention_prefill(*case.args(), backend="wgsl", **case.options())
    pagedvk.paged_attention_prefill(*case.args(), backend="glsl", **case.options())
