"""The build's SPIR-V passes (pagedvk.kernels.spirv_passes), each on its own, and the toolkit they share (pagedvk.kernels.spirv).

Each pass runs on naga's own output of a small WGSL module written to contain what the pass targets (or on a
glslang module for the bfloat16 pass): the test checks the instructions it targets changed as its docstring says,
nothing else did, and spirv-val takes the result."""
from __future__ import annotations

import collections
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedvk.kernels import catalogue, modules, spirv
from pagedvk.kernels import spirv_passes as passes
from pagedvk.kernels.spirv import instructions
from support import REPO


# A workgroup array (naga zeroes it and lays it out), a loop (naga bounds it) and a float `!=` (naga makes it
# ordered).
PLAIN_WGSL = """
var<workgroup> sums: array<f32, 64>;
@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) l: u32) {
  sums[l] = data[l];
  workgroupBarrier();
  var total = 0.0;
  for (var i = 0u; i < 64u; i++) { total += sums[i]; }
  if (total != data[0]) { total = 1.0; }
  data[l] = total;
}
"""
# Cooperative matrices: a zero accumulator, a matrix array indexed in a loop, a subgroup barrier over workgroup
# memory.
MATRIX_WGSL = """
enable f16;
enable wgpu_cooperative_matrix;
var<workgroup> mh: array<f16, 256>;
var<workgroup> mf: array<f32, 256>;
@group(0) @binding(0) var<storage, read_write> o: array<f32>;
@compute @workgroup_size(32) fn main(@builtin(local_invocation_index) l: u32) {
  mf[l] = o[l]; subgroupBarrier(); o[l] = mf[l ^ 1u]; workgroupBarrier();
  var acc: array<coop_mat16x16<f32, C>, 2>;
  for (var j = 0u; j < 2u; j++) {
    acc[j] = coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&mh[0], 16u),
                             coopLoad<coop_mat16x16<f16, B>>(&mh[0], 16u), acc[j]);
  }
  coopStore(acc[1], &mf[0], 16u);
}
"""
# Its accumulator loaded from memory rather than a zero one: naga then declares neither the Vulkan memory model nor
# SPV_KHR_cooperative_matrix.
LOADED_MATRIX_WGSL = """
enable f16;
enable wgpu_cooperative_matrix;
var<workgroup> mh: array<f16, 256>;
var<workgroup> mf: array<f32, 256>;
@compute @workgroup_size(32) fn main() {
  coopStore(coopMultiplyAdd(coopLoadT<coop_mat16x16<f16, A>>(&mh[0], 16u), coopLoad<coop_mat16x16<f16, B>>(&mh[0], 16u),
                            coopLoad<coop_mat16x16<f32, C>>(&mf[0], 16u)), &mf[0], 16u);
}
"""


@pytest.fixture(scope="module")
def build():
    """build_shaders.py as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("build_shaders_for_passes", REPO / "build_shaders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.naga_tool() is None:
        pytest.fail("naga is needed: put the naga CLI on PATH or run `npm ci` for naga-wasm")
    yield module
    module.close_naga_servers()


def naga_words(build, tmp_path_factory, source: str) -> list:
    folder = tmp_path_factory.mktemp("naga")
    (folder / "m.wgsl").write_text(source)
    build.translate_wgsl(folder / "m.wgsl", folder / "m.spv")
    return spirv.module_words((folder / "m.spv").read_bytes())


@pytest.fixture(scope="module")
def plain(build, tmp_path_factory):
    return naga_words(build, tmp_path_factory, PLAIN_WGSL)


@pytest.fixture(scope="module")
def matrix(build, tmp_path_factory):
    return naga_words(build, tmp_path_factory, MATRIX_WGSL)


@pytest.fixture(scope="module")
def loaded(build, tmp_path_factory):
    return naga_words(build, tmp_path_factory, LOADED_MATRIX_WGSL)


def through_all(words) -> list:
    for rewrite in passes.WGSL_PASSES:
        words = rewrite(words)
    return words


def validate(words, tmp_path, tool=None, env=None, target="vulkan1.1"):
    path = tmp_path / "checked.spv"
    path.write_bytes(spirv.module_bytes(words))
    result = subprocess.run([tool or shutil.which("spirv-val"), "--target-env", target, str(path)],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def validate_pass(words, tmp_path):
    """spirv-val on one pass's output, with naga's layouts on workgroup arrays taken off first
    (drop_unlaid_layouts, tested on its own below): a spirv-val of 2025 refuses them
    (VUID-StandaloneSpirv-None-10684) whatever the pass under test did."""
    validate(passes.drop_unlaid_layouts(words), tmp_path)


def ops(words) -> collections.Counter:
    return collections.Counter(op for _, op, _ in instructions(words))


def changed(before, after) -> collections.Counter:
    """Opcode counts gained (positive) and lost (negative) from before to after."""
    diff = collections.Counter(ops(after))
    diff.subtract(ops(before))
    return collections.Counter({op: n for op, n in diff.items() if n})


def built_module(backend: str) -> Path:
    """The float32 decode module of a backend, as built."""
    return modules.module_path(catalogue.PAGED_DECODE.key(backend, "f32", "f32").name)


def constants(words) -> dict:
    return {a[1]: a[2] for _, op, a in instructions(words) if op == spirv.OP_CONSTANT and len(a) == 3}


# --- the toolkit ------------------------------------------------------------------------------------------------

def test_instructions_match_spirv_dis_on_a_built_module():
    # The iterator walks as spirv-dis does (one instruction a line), and each opcode the table names is the one
    # spirv-dis names there: OP_FUNORD_NOT_EQUAL <-> OpFUnordNotEqual.
    path = built_module("glsl")
    dis = subprocess.run(["spirv-dis", "--raw-id", "--no-header", "--no-color", str(path)], capture_output=True,
                         text=True, check=True).stdout
    names = [re.search(r"\b(Op\w+)", line)[1] for line in dis.splitlines() if line.strip()]
    walked = [op for _, op, _ in instructions(spirv.module_words(path.read_bytes()))]
    assert len(walked) == len(names) > 100
    table = {value: name for name, value in vars(spirv).items() if name.startswith("OP_")}
    named = [(table[op], name) for op, name in zip(walked, names) if op in table]
    assert len({n for n, _ in named}) > 15
    assert all(ours.replace("_", "").lower() == theirs.lower() for ours, theirs in named), \
        {ours: theirs for ours, theirs in named if ours.replace("_", "").lower() != theirs.lower()}


def test_toolkit_refuses_broken_words_and_round_trips():
    module = spirv.module_words(built_module("glsl").read_bytes())
    assert spirv.rewrite(module, lambda at, op, a: None) == module
    assert spirv.module_words(spirv.module_bytes(module)) == module
    assert spirv.literal_string(spirv.string_words("SPV_KHR_bfloat16")) == "SPV_KHR_bfloat16"
    with pytest.raises(spirv.SpirvError, match="word count 0"):
        list(instructions(module[:5] + [0]))
    with pytest.raises(spirv.SpirvError, match="truncated"):
        list(instructions(module[:5] + spirv.instruction(spirv.OP_CAPABILITY, 1)[:1]))


# --- the passes on naga's plain output ------------------------------------------------------------------------

def test_unordered_not_equal(plain, tmp_path):
    out = passes.unordered_not_equal(plain)
    assert ops(plain)[spirv.OP_FORD_NOT_EQUAL] >= 1
    assert changed(plain, out) == {spirv.OP_FORD_NOT_EQUAL: -ops(plain)[spirv.OP_FORD_NOT_EQUAL],
                                   spirv.OP_FUNORD_NOT_EQUAL: ops(plain)[spirv.OP_FORD_NOT_EQUAL]}
    validate_pass(out, tmp_path)


def test_drop_workgroup_zero_init(plain, tmp_path):
    # naga's store of a null constant to `sums` goes; the kernel's own store to it (sums[l] = ...) stays.
    out = passes.drop_workgroup_zero_init(plain)
    nulls = {a[1] for _, op, a in instructions(plain) if op == spirv.OP_CONSTANT_NULL}
    null_stores = [a for _, op, a in instructions(plain) if op == spirv.OP_STORE and a[1] in nulls]
    assert len(null_stores) == 1
    assert changed(plain, out) == {spirv.OP_STORE: -1}
    assert not [a for _, op, a in instructions(out) if op == spirv.OP_STORE and a[1] in nulls]
    validate_pass(out, tmp_path)


def test_drop_loop_bounding(plain, tmp_path):
    # The counter's test (OpSelectionMerge + OpBranchConditional) becomes one OpBranch into the body.
    out = passes.drop_loop_bounding(plain)
    assert 0xFFFFFFFF in constants(plain).values()
    assert changed(plain, out) == {spirv.OP_SELECTION_MERGE: -1, spirv.OP_BRANCH_CONDITIONAL: -1, spirv.OP_BRANCH: 1}
    validate_pass(out, tmp_path)


def test_drop_unlaid_layouts(plain, tmp_path):
    # `sums` (workgroup) loses its ArrayStride; `data` (storage buffer) keeps its own.
    def strides(words):
        return [a[0] for _, op, a in instructions(words) if op == spirv.OP_DECORATE and a[1] == spirv.DEC_ARRAY_STRIDE]
    out = passes.drop_unlaid_layouts(plain)
    assert len(strides(plain)) == 2 and len(strides(out)) == 1
    assert changed(plain, out) == {spirv.OP_DECORATE: -1}
    validate(out, tmp_path)


def test_matrix_passes_leave_plain_modules_alone(plain):
    for rewrite in (passes.declare_cooperative_matrix, passes.naga_matrix_fixes, passes.workgroup_accesses_nonprivate):
        assert rewrite(plain) == plain


# --- the passes on naga's matrix output -----------------------------------------------------------------------

def test_declare_cooperative_matrix(loaded, matrix):
    assert not passes.declared_extensions(loaded) & {"SPV_KHR_vulkan_memory_model", "SPV_KHR_cooperative_matrix"}
    assert spirv.CAP_VULKAN_MEMORY_MODEL not in passes.declared_capabilities(loaded)
    out = passes.declare_cooperative_matrix(loaded)
    assert passes.declared_extensions(out) >= {"SPV_KHR_vulkan_memory_model", "SPV_KHR_cooperative_matrix"}
    assert spirv.CAP_VULKAN_MEMORY_MODEL in passes.declared_capabilities(out)
    assert [a[1] for _, op, a in instructions(out) if op == spirv.OP_MEMORY_MODEL] == [spirv.MEMORY_MODEL_VULKAN]
    assert out[1] >= spirv.VERSION_1_3
    # A module that has them is left as it is (but its version).
    assert passes.declare_cooperative_matrix(matrix)[2:] == matrix[2:]


def test_naga_matrix_fixes(matrix):
    out = passes.naga_matrix_fixes(matrix)
    matrix_types = {a[0] for _, op, a in instructions(matrix) if op == spirv.OP_TYPE_COOPERATIVE_MATRIX_KHR}
    matrix_types |= {a[0] for _, op, a in instructions(matrix) if op == spirv.OP_TYPE_ARRAY and a[1] in matrix_types}
    # Zero matrices: no OpConstantNull of a matrix type is left; new ids raised the bound.
    assert [a for _, op, a in instructions(matrix) if op == spirv.OP_CONSTANT_NULL and a[0] in matrix_types]
    assert not [a for _, op, a in instructions(out) if op == spirv.OP_CONSTANT_NULL and a[0] in matrix_types]
    assert out[spirv.BOUND] > matrix[spirv.BOUND]
    # 16-bit storage: only what a 16-bit type in a storage class needs (here none: mh is workgroup memory).
    assert spirv.CAP_STORAGE_INPUT_OUTPUT16 in passes.declared_capabilities(matrix)
    assert not passes.declared_capabilities(out) & set(passes.STORAGE_16BIT.values())
    # The loop indexing `acc` is unrolled; the subgroup barrier orders workgroup memory.
    assert [a[2] for _, op, a in instructions(out) if op == spirv.OP_LOOP_MERGE].count(spirv.LOOP_CONTROL_UNROLL) >= 1
    value = constants(out)
    barriers = [(value[a[0]], value[a[2]]) for _, op, a in instructions(out) if op == spirv.OP_CONTROL_BARRIER]
    assert (spirv.SCOPE_SUBGROUP, 0x88) not in barriers and (spirv.SCOPE_SUBGROUP, 0x108) in barriers


def test_workgroup_accesses_nonprivate(loaded, matrix, build, tmp_path):
    # Only under the Vulkan memory model (declare_cooperative_matrix sets it): each workgroup load and store
    # gains the NonPrivatePointer operand; then the whole chain passes the matrix modules' spirv-val.
    assert passes.workgroup_accesses_nonprivate(loaded) == loaded
    before = passes.declare_cooperative_matrix(loaded)
    out = passes.workgroup_accesses_nonprivate(before)
    marked = [a for _, op, a in instructions(out) if op in passes.WORKGROUP_ACCESSES
              and len(a) == passes.WORKGROUP_ACCESSES[op][1] + 1]
    assert len(marked) >= 3 and all(a[-1] == spirv.MEMORY_ACCESS_NON_PRIVATE_POINTER for a in marked)
    assert ops(out) == ops(before)
    for module in (loaded, matrix):
        validate(through_all(module), tmp_path, *build.matrix_tools()[1:], target="vulkan1.2")


def test_bfloat16_matrices(build, tmp_path):
    # glslang's float16 module: its float16 type gets the bfloat16 encoding, its capabilities and extension.
    glslang, spirv_val, env = build.matrix_tools()
    src = tmp_path / "k.comp"
    src.write_text("#version 450\n#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require\n"
                   "layout(local_size_x = 1) in;\nlayout(std430, binding = 0) buffer B { float x[]; };\n"
                   "shared float16_t s;\nvoid main() { s = float16_t(1.5); barrier(); x[0] = float(s); }\n")
    build.run([glslang, "-V", "--target-env", "vulkan1.2", "-o", str(tmp_path / "k.spv"), str(src)], "glslang", env)
    words = spirv.module_words((tmp_path / "k.spv").read_bytes())
    out = passes.bfloat16_matrices(words)
    assert "SPV_KHR_bfloat16" in passes.declared_extensions(out)
    assert {spirv.CAP_BFLOAT16_TYPE_KHR, spirv.CAP_BFLOAT16_COOPERATIVE_MATRIX_KHR} <= passes.declared_capabilities(out)
    assert spirv.CAP_FLOAT16 not in passes.declared_capabilities(out)
    assert [a[1:] for _, op, a in instructions(out) if op == spirv.OP_TYPE_FLOAT and a[1] == 16] == [[16, 0]]
    assert 0x3FC0 in constants(out).values()   # 1.5 in bfloat16
    validate(out, tmp_path, spirv_val, env, target="vulkan1.2")
    with pytest.raises(passes.PassError, match="must declare"):   # a module without float16
        passes.bfloat16_matrices(spirv.module_words(built_module("glsl").read_bytes()))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
