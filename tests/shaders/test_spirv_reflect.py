"""Tests for pagedvk.kernels.spirv: GLSL compiled at test time plus a hand-assembled module."""
import shutil
import subprocess

import pytest

from pagedvk.kernels.spirv import Binding, PushConstantMember, SpirvError, reflect, reflect_file


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH; install the {package} package")
    return path


@pytest.fixture
def glsl(tmp_path):
    """Compile GLSL compute source to SPIR-V bytes with glslangValidator."""
    exe = _tool("glslangValidator", "glslang-tools")

    def compile_(source: str, target: str = "vulkan1.1") -> bytes:
        src, out = tmp_path / "in.comp", tmp_path / "out.spv"
        src.write_text(source)
        r = subprocess.run([exe, "-V", "--target-env", target, "-o", str(out), str(src)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        return out.read_bytes()

    return compile_


BUFFERS = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer In { float a[]; } src;
layout(set = 0, binding = 2) buffer Out { float b[]; } dst;
layout(set = 1, binding = 1) uniform Params { uint n; float scale; } params;
layout(set = 2, binding = 0) buffer Partial { readonly uint x; readonly uint y[]; };
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < params.n) dst.b[i] = src.a[i] * params.scale + float(x + y[i]);
}
"""


# vulkan1.0 makes glslang emit SPIR-V 1.0 (Uniform + BufferBlock); vulkan1.1 emits
# SPIR-V 1.3 with the StorageBuffer storage class. Both must reflect identically.
@pytest.mark.parametrize("target,version", [("vulkan1.0", (1, 0)), ("vulkan1.1", (1, 3))])
def test_buffers(glsl, target, version):
    r = reflect(glsl(BUFFERS, target))
    assert r.version == version
    assert r.entry_points == ("main",)
    assert r.local_size == (64, 1, 1)
    assert r.local_size_spec_ids == (None, None, None)
    assert r.bindings == (
        Binding(0, 0, "storage_buffer", True, "src"),
        Binding(0, 2, "storage_buffer", False, "dst"),
        Binding(1, 1, "uniform_buffer", False, "params"),
        # Anonymous instance: glslang names the variable "", so the block name is used.
        Binding(2, 0, "storage_buffer", True, "Partial"),
    )
    assert r.push_constant_size == 0 and r.push_constant_members == ()
    assert r.spec_constants == {}
    assert "Shader" in r.capabilities


def test_texel_buffers(glsl):
    # Storage texel buffers (UniformConstant images with Dim Buffer) are bindings too, in binding order whatever the
    # order of their declarations; readonly is the variable's NonWritable.
    r = reflect(glsl("""#version 450
layout(local_size_x = 1) in;
layout(set = 0, binding = 2) buffer Out { uvec4 v[]; };
layout(set = 0, binding = 1, rgba32ui) uniform readonly uimageBuffer src;
layout(set = 0, binding = 0, r32ui) uniform uimageBuffer scratch;
void main() { v[0] = imageLoad(src, 0); imageStore(scratch, 0, uvec4(1u)); }
"""))
    assert r.bindings == (Binding(0, 0, "storage_texel_buffer", False, "scratch"),
                          Binding(0, 1, "storage_texel_buffer", True, "src"),
                          Binding(0, 2, "storage_buffer", False, "Out"))


def test_samplers_are_refused(glsl):
    with pytest.raises(SpirvError, match="only storage texel buffers are supported among images and samplers"):
        reflect(glsl("""#version 450
layout(local_size_x = 1) in;
layout(binding = 0) uniform usamplerBuffer s;
layout(binding = 1) buffer Out { uvec4 v[]; };
void main() { v[0] = texelFetch(s, 0); }
"""))


def test_partially_readonly_block_is_writable(glsl):
    r = reflect(glsl("""#version 450
layout(local_size_x = 1) in;
layout(binding = 0) buffer B { readonly uint a; uint b; };
void main() { b = a; }
"""))
    assert r.bindings == (Binding(0, 0, "storage_buffer", False, "B"),)


def test_push_constants_follow_std430(glsl):
    r = reflect(glsl("""#version 450
layout(local_size_x = 1) in;
layout(push_constant) uniform PC { uint count; vec2 offset; float alpha; } pc;
layout(binding = 0) buffer Out { float v[]; };
void main() { v[0] = float(pc.count) + pc.offset.y + pc.alpha; }
"""))
    # std430: vec2 is 8-byte aligned, so `offset` skips 4 bytes of padding.
    assert r.push_constant_members == (
        PushConstantMember("count", 0, 4),
        PushConstantMember("offset", 8, 8),
        PushConstantMember("alpha", 16, 4),
    )
    assert r.push_constant_size == 20  # not rounded up to the struct alignment


def test_push_constants_nested_struct_and_array(glsl):
    r = reflect(glsl("""#version 450
layout(local_size_x = 1) in;
struct Inner { uint a; vec2 b; };
layout(push_constant) uniform PC { uint n; Inner inner; float w[3]; } pc;
layout(binding = 0) buffer Out { float v[]; };
void main() { v[0] = float(pc.n + pc.inner.a) + pc.inner.b.x + pc.w[2]; }
"""))
    # Inner: a@0, b@8 -> size 16, aligned to 8 so it starts at 8; w[3] stride 4 at 24.
    assert r.push_constant_members == (
        PushConstantMember("n", 0, 4),
        PushConstantMember("inner", 8, 16),
        PushConstantMember("w", 24, 12),
    )
    assert r.push_constant_size == 36


SPEC = """#version 450
layout(local_size_x = 32, local_size_y = 2) in;
layout(local_size_x_id = 0) in;
layout(constant_id = 3) const uint X = 7;
layout(constant_id = 4) const float F = 1.5;
layout(constant_id = 5) const bool B = true;
layout(constant_id = 6) const int I = -2;
layout(binding = 0) buffer Out { float v[]; };
void main() { v[gl_LocalInvocationIndex] = B ? float(X) * F + float(I) : 0.0; }
"""


# Before SPIR-V 1.6 glslang uses a WorkgroupSize builtin spec composite; with
# vulkan1.3 (SPIR-V 1.6) it uses OpExecutionModeId LocalSizeId instead.
@pytest.mark.parametrize("target", ["vulkan1.1", "vulkan1.3"])
def test_spec_constants_and_local_size_id(glsl, target):
    r = reflect(glsl(SPEC, target))
    assert r.local_size == (32, 2, 1)
    assert r.local_size_spec_ids == (0, None, None)
    assert r.spec_constants == {0: "uint32", 3: "uint32", 4: "float32", 5: "bool", 6: "int32"}


def test_subgroup_arithmetic_capability(glsl):
    r = reflect(glsl("""#version 450
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 32) in;
layout(binding = 0) buffer Data { float v[]; };
void main() { v[gl_GlobalInvocationID.x] = subgroupAdd(v[gl_GlobalInvocationID.x]); }
"""))
    assert {"Shader", "GroupNonUniform", "GroupNonUniformArithmetic"} <= r.capabilities


def test_reflect_file(glsl, tmp_path):
    path = tmp_path / "k.spv"
    path.write_bytes(glsl(BUFFERS))
    assert reflect_file(path) == reflect(path.read_bytes())
    assert reflect_file(str(path)).local_size == (64, 1, 1)


# --- A hand-assembled SPIR-V 1.0 module ------------------------------------

def op(opcode: int, *operands) -> list[int]:
    """Encode one instruction; str operands become nul-terminated literal strings."""
    words = []
    for x in operands:
        if isinstance(x, str):
            raw = x.encode() + b"\0"
            raw += b"\0" * (-len(raw) % 4)
            words += [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
        else:
            words.append(x)
    return [(len(words) + 1) << 16 | opcode] + words


# Result ids.
MAIN, VOID, FN, UINT, RTA, BUF, PTR_BUF, SRC, DST, PARAMS, PTR_PARAMS, PARAMS_VAR = range(1, 13)
LABEL, SPEC_K, PC, PTR_PC, PC_VAR, V2 = range(13, 19)
BOUND = 19

OLD_STYLE = [0x07230203, 0x00010000, 0, BOUND, 0] + [
    w for ins in [
        op(17, 1),                                  # OpCapability Shader
        op(14, 0, 1),                               # OpMemoryModel Logical GLSL450
        op(15, 5, MAIN, "main"),                    # OpEntryPoint GLCompute %main "main"
        op(16, MAIN, 17, 8, 4, 1),                  # OpExecutionMode %main LocalSize 8 4 1
        op(5, MAIN, "main"),                        # OpName
        op(5, BUF, "Buf"),
        op(5, SRC, "src"),
        op(5, DST, "dst"),
        op(5, PARAMS, "Params"),                    # variable left unnamed on purpose
        op(6, PC, 0, "n"),                          # OpMemberName
        op(6, PC, 1, "xy"),
        op(71, RTA, 6, 4),                          # OpDecorate %rta ArrayStride 4
        op(72, BUF, 0, 35, 0),                      # OpMemberDecorate %Buf 0 Offset 0
        op(71, BUF, 3),                             # OpDecorate %Buf BufferBlock
        op(71, SRC, 34, 0), op(71, SRC, 33, 0),     # DescriptorSet 0, Binding 0
        op(71, SRC, 24),                            # NonWritable on the variable
        op(71, DST, 34, 0), op(71, DST, 33, 1),
        op(72, PARAMS, 0, 35, 0),
        op(71, PARAMS, 2),                          # OpDecorate %Params Block
        op(71, PARAMS_VAR, 34, 1), op(71, PARAMS_VAR, 33, 0),
        op(71, SPEC_K, 1, 9),                       # OpDecorate %k SpecId 9
        op(72, PC, 0, 35, 0), op(72, PC, 1, 35, 8),
        op(71, PC, 2),
        op(19, VOID),                               # OpTypeVoid
        op(33, FN, VOID),                           # OpTypeFunction
        op(21, UINT, 32, 0),                        # OpTypeInt 32 unsigned
        op(23, V2, UINT, 2),                        # OpTypeVector uvec2
        op(29, RTA, UINT),                          # OpTypeRuntimeArray
        op(30, BUF, RTA),                           # OpTypeStruct
        op(32, PTR_BUF, 2, BUF),                    # OpTypePointer Uniform %Buf
        op(30, PARAMS, UINT),
        op(32, PTR_PARAMS, 2, PARAMS),
        op(30, PC, UINT, V2),
        op(32, PTR_PC, 9, PC),                      # OpTypePointer PushConstant %PC
        op(50, UINT, SPEC_K, 5),                    # OpSpecConstant %uint 5
        op(59, PTR_BUF, SRC, 2),                    # OpVariable ... Uniform
        op(59, PTR_BUF, DST, 2),
        op(59, PTR_PARAMS, PARAMS_VAR, 2),
        op(59, PTR_PC, PC_VAR, 9),
        op(54, VOID, MAIN, 0, FN),                  # OpFunction
        op(248, LABEL),                             # OpLabel
        op(253),                                    # OpReturn
        op(56),                                     # OpFunctionEnd
    ] for w in ins
]


def _to_bytes(words) -> bytes:
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_hand_assembled_module_is_valid(tmp_path):
    exe = _tool("spirv-val", "spirv-tools")
    path = tmp_path / "old.spv"
    path.write_bytes(_to_bytes(OLD_STYLE))
    r = subprocess.run([exe, "--target-env", "vulkan1.0", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hand_assembled_spirv_1_0_buffer_block():
    r = reflect(_to_bytes(OLD_STYLE))
    assert r.version == (1, 0)
    assert r.entry_points == ("main",)
    assert r.local_size == (8, 4, 1)
    assert r.bindings == (
        Binding(0, 0, "storage_buffer", True, "src"),
        Binding(0, 1, "storage_buffer", False, "dst"),
        Binding(1, 0, "uniform_buffer", False, "Params"),
    )
    assert r.push_constant_members == (PushConstantMember("n", 0, 4),
                                       PushConstantMember("xy", 8, 8))
    assert r.push_constant_size == 16
    assert r.spec_constants == {9: "uint32"}
    assert r.capabilities == frozenset({"Shader"})


def test_big_endian_module():
    assert reflect(b"".join(w.to_bytes(4, "big") for w in OLD_STYLE)) == \
        reflect(_to_bytes(OLD_STYLE))


def test_unknown_capability_is_named_by_number():
    words = OLD_STYLE[:5] + op(17, 1) + op(17, 12345)
    assert reflect(_to_bytes(words)).capabilities == {"Shader", "Capability12345"}


def test_descriptor_array_rejected():
    arr, length, ptr, var = BOUND, BOUND + 1, BOUND + 2, BOUND + 3
    words = OLD_STYLE[:3] + [BOUND + 4, 0] + OLD_STYLE[5:] + \
        op(43, UINT, length, 4) + op(28, arr, BUF, length) + op(32, ptr, 2, arr) + \
        op(59, ptr, var, 2)
    with pytest.raises(SpirvError, match="descriptor arrays not supported"):
        reflect(_to_bytes(words))


# --- Rejection of non-SPIR-V input -----------------------------------------

@pytest.mark.parametrize("data,message", [
    (b"", "too short"),
    (b"hello world! this is not spirv", "multiple of 4"),
    (b"\x03\x02\x23\x07\x00", "multiple of 4"),
    (b"hello world!" + bytes(8), "bad magic number 0x6c6c6568"),
    (bytes(20), "bad magic"),
])
def test_rejects_garbage(data, message):
    with pytest.raises(SpirvError, match=message):
        reflect(data)


def test_rejects_truncated_instruction():
    # OpCapability needs 2 words; drop its operand.
    words = OLD_STYLE[:5] + op(17, 1)[:1]
    with pytest.raises(SpirvError, match=r"truncated instruction at word 5: opcode 17 needs 2"):
        reflect(_to_bytes(words))
    # Chopping a real module mid-instruction is caught too.
    with pytest.raises(SpirvError, match="truncated instruction"):
        reflect(_to_bytes(OLD_STYLE[:8]))


def test_rejects_zero_word_count():
    with pytest.raises(SpirvError, match="word count 0"):
        reflect(_to_bytes(OLD_STYLE[:5] + [0]))


def test_spirv_error_is_value_error():
    assert issubclass(SpirvError, ValueError)
