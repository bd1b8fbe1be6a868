"""The SPIR-V modules: present, valid, built from the current sources, and matching their declared ABI."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import pagedvk
from pagedvk import abi, kernels, spirv

REPO = Path(__file__).resolve().parent.parent
MODULES = [(k, name, backend, variant) for k in abi.KERNELS for name, backend, variant in k.modules()]
IDS = [m[1] for m in MODULES]


def spirv_val():
    tool = shutil.which("spirv-val")
    if tool is None:
        pytest.fail("spirv-val not found: install spirv-tools")
    return tool


@pytest.mark.parametrize("kernel,name,backend,variant", MODULES, ids=IDS)
def test_module_installed_and_valid(kernel, name, backend, variant):
    path = kernels.module_path(name)
    assert path.is_file(), f"{path} missing"
    result = subprocess.run([spirv_val(), "--target-env", "vulkan1.1", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kernel,name,backend,variant", MODULES, ids=IDS)
def test_module_matches_declared_abi(kernel, name, backend, variant):
    r = spirv.reflect_file(kernels.module_path(name))
    assert "main" in r.entry_points
    assert r.local_size == kernel.workgroup_size
    assert [(b.set, b.binding) for b in r.bindings] == [(0, i) for i in range(len(kernel.bindings))]
    assert all(b.kind == "storage_buffer" for b in r.bindings)
    assert [b.readonly for b in r.bindings] == [b.readonly for b in kernel.bindings], \
        f"read-only flags differ from {[b.name for b in kernel.bindings]}"
    assert r.push_constant_size == kernel.push_size
    assert [m.offset for m in r.push_constant_members] == list(kernel.push_offsets().values())
    assert all(m.size == 4 for m in r.push_constant_members)
    assert set(r.spec_constants) == {i for i, _ in kernel.spec_constants}


def test_modules_are_current():
    """The modules pagedvk loads were built from this checkout's shaders as they are now."""
    manifest = kernels.manifest()
    for kernel, name, backend, variant in MODULES:
        assert manifest[name]["digest"] == abi.source_digest(REPO / "shaders", kernel, backend, variant), \
            f"{name} was built from other sources than {REPO / 'shaders'}"
        kernels.load_spirv(kernel, variant.name, backend)


@pytest.fixture
def spv_copy(tmp_path, monkeypatch):
    """A private copy of the module folder, with the repo's shader sources for the staleness check."""
    copy = tmp_path / "spv"
    shutil.copytree(kernels.SPV_DIR, copy)
    monkeypatch.setattr(kernels, "SPV_DIR", copy)
    monkeypatch.setattr(kernels, "SOURCE_SHADER_DIR", REPO / "shaders")
    monkeypatch.setattr(kernels, "_manifest", None)
    yield copy
    kernels._manifest = None


def test_stale_module_is_refused(spv_copy):
    manifest = json.loads((spv_copy / "manifest.json").read_text())
    manifest["paged_decode.f32.glsl"]["digest"] = "0" * 64
    (spv_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pagedvk.ShaderModuleError, match=r"paged_decode\.f32\.glsl is stale"):
        kernels.load_spirv(abi.PAGED_DECODE, "f32", "glsl")


def test_missing_module_is_named(spv_copy):
    (spv_copy / "paged_decode.f32.glsl.spv").unlink()
    with pytest.raises(pagedvk.ShaderModuleError, match=r"paged_decode\.f32\.glsl is missing"):
        kernels.load_spirv(abi.PAGED_DECODE, "f32", "glsl")


def test_missing_manifest_is_reported(spv_copy):
    (spv_copy / "manifest.json").unlink()
    with pytest.raises(pagedvk.ShaderModuleError, match="manifest.json missing"):
        kernels.load_spirv(abi.PAGED_DECODE, "f32", "glsl")


def test_unknown_variant_is_named():
    with pytest.raises(pagedvk.ShaderModuleError, match="no 'bf16' variant"):
        kernels.load_spirv(abi.PAGED_DECODE, "bf16", "glsl")


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


def test_build_reports_compile_errors(tmp_path, monkeypatch):
    # A broken shader fails the build with the compiler's message and leaves no module behind.
    sys.path.insert(0, str(REPO))
    try:
        import build_shaders
    finally:
        sys.path.pop(0)
    bad = tmp_path / "broken.comp"
    bad.write_text("#version 450\nvoid main() { undefined_name = 1; }\n")
    with pytest.raises(build_shaders.BuildError, match="undefined_name"):
        build_shaders.compile_glsl(bad, tmp_path / "broken.spv", {})
    assert not (tmp_path / "broken.spv").exists()


def test_push_constant_packing():
    packed = abi.PAGED_DECODE.pack_push(num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                                         max_blocks_per_seq=4, num_blocks=10, scale=0.5, group_size=4,
                                         partition_size=512, num_partitions=1)
    assert len(packed) == abi.PAGED_DECODE.push_size == 40
    assert packed[24:28] == struct.pack("<f", 0.5)
    with pytest.raises(KeyError, match="missing"):
        abi.PAGED_DECODE.pack_push(num_heads=8)


def test_wgsl_includes_are_pasted_and_tracked(tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        import build_shaders
    finally:
        sys.path.pop(0)
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
    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    null, workgroup, stores, i = set(), set(), 0, 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 46:
            null.add(words[i + 2])
        elif op == 59 and words[i + 3] == 4:
            workgroup.add(words[i + 2])
        elif op == 62 and words[i + 1] in workgroup and words[i + 2] in null:
            stores += 1
        i += count
    return stores


def test_wgsl_build_drops_workgroup_zeroing_only(tmp_path):
    # naga zeroes workgroup memory at entry, which lavapipe took a minute to compile for paged_decode;
    # the build drops that, and keeps a zeroing the source writes itself (after a barrier).
    sys.path.insert(0, str(REPO))
    try:
        import build_shaders
    finally:
        sys.path.pop(0)
    src = tmp_path / "zero.wgsl"
    src.write_text("var<workgroup> a: array<f32, 64>;\nvar<workgroup> b: array<f32, 64>;\n"
                   "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
                   "@compute @workgroup_size(64) fn main(@builtin(local_invocation_id) l: vec3<u32>) {\n"
                   "  a[l.x] = o[l.x]; workgroupBarrier(); b = array<f32, 64>(); workgroupBarrier();\n"
                   "  o[l.x] = a[63u - l.x] + b[l.x];\n}\n")
    raw = tmp_path / "raw.spv"
    build_shaders.run(build_shaders.naga_command(src, raw), "naga")
    assert workgroup_null_stores(raw.read_bytes()) == 3   # a and b zeroed at entry, b by the source
    build_shaders.compile_wgsl(src, tmp_path / "zero.spv", {})
    build_shaders.validate(tmp_path / "zero.spv")
    assert workgroup_null_stores((tmp_path / "zero.spv").read_bytes()) == 1
    for name in IDS:
        if name.endswith(".wgsl"):
            assert workgroup_null_stores(kernels.module_path(name).read_bytes()) == 0, name
