"""A small SPIR-V toolkit, and reflection for Vulkan compute shaders built on it.

The toolkit: the opcode table (one, here), the instruction iterator (`instructions`), literal strings
(`literal_string`, `string_words`) and rewriting a module (`rewrite`, `instruction`). The build's passes
(pagedvk.spirv_passes) and the reflection below share it.

Reflection reads just enough of a SPIR-V binary to build a pipeline layout: descriptor bindings, the
push-constant block, workgroup size, specialization constants and capabilities.

Pure stdlib (build_shaders.py loads it without the package's run-time dependencies); enum values follow
the SPIR-V 1.6 spec / spirv.core.grammar.json.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike

MAGIC = 0x07230203

# The opcode table: every opcode the reflection and the build's passes (pagedvk.spirv_passes) read or write,
# named as the specification spells them (OpFUnordNotEqual -> OP_FUNORD_NOT_EQUAL; tests check the names
# against spirv-dis).
OP_NAME, OP_MEMBER_NAME, OP_EXTENSION = 5, 6, 10
OP_MEMORY_MODEL, OP_ENTRY_POINT, OP_EXECUTION_MODE, OP_CAPABILITY = 14, 15, 16, 17
OP_TYPE_BOOL, OP_TYPE_INT, OP_TYPE_FLOAT, OP_TYPE_VECTOR, OP_TYPE_IMAGE = 20, 21, 22, 23, 25
OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_STRUCT, OP_TYPE_POINTER = 28, 29, 30, 32
OP_CONSTANT, OP_CONSTANT_COMPOSITE, OP_CONSTANT_NULL = 43, 44, 46
OP_SPEC_CONSTANT_TRUE, OP_SPEC_CONSTANT_FALSE, OP_SPEC_CONSTANT, OP_SPEC_CONSTANT_COMPOSITE = 48, 49, 50, 51
OP_FUNCTION, OP_VARIABLE, OP_LOAD, OP_STORE = 54, 59, 61, 62
OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN, OP_PTR_ACCESS_CHAIN = 65, 66, 67
OP_DECORATE, OP_MEMBER_DECORATE = 71, 72
OP_ALL, OP_IEQUAL, OP_ULESS_THAN, OP_SLESS_THAN, OP_FORD_NOT_EQUAL, OP_FUNORD_NOT_EQUAL = 155, 170, 176, 177, 182, 183
OP_CONTROL_BARRIER = 224
OP_LOOP_MERGE, OP_SELECTION_MERGE, OP_LABEL, OP_BRANCH, OP_BRANCH_CONDITIONAL = 246, 247, 248, 249, 250
OP_EXECUTION_MODE_ID = 331
OP_TYPE_COOPERATIVE_MATRIX_KHR, OP_COOPERATIVE_MATRIX_LOAD_KHR, OP_COOPERATIVE_MATRIX_STORE_KHR = 4456, 4457, 4458
_TYPE_OPS = {OP_TYPE_BOOL, OP_TYPE_INT, OP_TYPE_FLOAT, OP_TYPE_VECTOR, OP_TYPE_IMAGE, OP_TYPE_ARRAY,
             OP_TYPE_RUNTIME_ARRAY, OP_TYPE_STRUCT, OP_TYPE_POINTER}

# Decorations, builtins, storage classes, memory models, execution model / modes, loop controls, scopes.
DEC_SPEC_ID, DEC_BLOCK, DEC_BUFFER_BLOCK, DEC_ARRAY_STRIDE, DEC_BUILTIN = 1, 2, 3, 6, 11
DEC_VOLATILE, DEC_COHERENT = 21, 23
DEC_NON_WRITABLE, DEC_BINDING, DEC_DESCRIPTOR_SET, DEC_OFFSET = 24, 33, 34, 35
BUILTIN_WORKGROUP_SIZE = 25
SC_UNIFORM_CONSTANT, SC_INPUT, SC_UNIFORM, SC_OUTPUT, SC_WORKGROUP, SC_PRIVATE, SC_FUNCTION = 0, 1, 2, 3, 4, 6, 7
DIM_BUFFER, IMAGE_STORAGE = 5, 2   # OpTypeImage's Dim Buffer, and its Sampled operand for an image read without a sampler
SC_PUSH_CONSTANT, SC_STORAGE_BUFFER = 9, 12
MEMORY_MODEL_GLSL450, MEMORY_MODEL_VULKAN = 1, 3
MODEL_GLCOMPUTE = 5
MODE_LOCAL_SIZE, MODE_LOCAL_SIZE_ID = 17, 38
LOOP_CONTROL_NONE, LOOP_CONTROL_UNROLL = 0, 1
SCOPE_SUBGROUP = 3
SEMANTICS_ACQUIRE_RELEASE, SEMANTICS_WORKGROUP_MEMORY = 0x8, 0x100
MEMORY_ACCESS_NON_PRIVATE_POINTER = 0x20
FP_ENCODING_BFLOAT16_KHR = 0
CAP_FLOAT16, CAP_STORAGE_BUFFER_16BIT_ACCESS, CAP_UNIFORM_AND_STORAGE_BUFFER_16BIT_ACCESS = 9, 4433, 4434
CAP_STORAGE_PUSH_CONSTANT16, CAP_STORAGE_INPUT_OUTPUT16 = 4435, 4436
CAP_VULKAN_MEMORY_MODEL, CAP_BFLOAT16_TYPE_KHR, CAP_BFLOAT16_COOPERATIVE_MATRIX_KHR = 5345, 5116, 5118
CAP_COOPERATIVE_MATRIX_KHR = 6022
VERSION_1_3 = 0x00010300

# Capability names: core 0..71 in order ("-" = unassigned), then extensions.
_CORE_CAPS = """Matrix Shader Geometry Tessellation Addresses Linkage Kernel Vector16
Float16Buffer Float16 Float64 Int64 Int64Atomics ImageBasic ImageReadWrite ImageMipmap -
Pipes Groups DeviceEnqueue LiteralSampler AtomicStorage Int16 TessellationPointSize
GeometryPointSize ImageGatherExtended - StorageImageMultisample
UniformBufferArrayDynamicIndexing SampledImageArrayDynamicIndexing
StorageBufferArrayDynamicIndexing StorageImageArrayDynamicIndexing ClipDistance
CullDistance ImageCubeArray SampleRateShading ImageRect SampledRect GenericPointer Int8
InputAttachment SparseResidency MinLod Sampled1D Image1D SampledCubeArray SampledBuffer
ImageBuffer ImageMSArray StorageImageExtendedFormats ImageQuery DerivativeControl
InterpolationFunction TransformFeedback GeometryStreams StorageImageReadWithoutFormat
StorageImageWriteWithoutFormat MultiViewport SubgroupDispatch NamedBarrier PipeStorage
GroupNonUniform GroupNonUniformVote GroupNonUniformArithmetic GroupNonUniformBallot
GroupNonUniformShuffle GroupNonUniformShuffleRelative GroupNonUniformClustered
GroupNonUniformQuad ShaderLayer ShaderViewportIndex UniformDecoration""".split()
_EXT_CAPS = """4423 SubgroupBallotKHR 4427 DrawParameters 4431 SubgroupVoteKHR
4433 StorageBuffer16BitAccess 4434 UniformAndStorageBuffer16BitAccess
4435 StoragePushConstant16 4436 StorageInputOutput16 4437 DeviceGroup 4439 MultiView
4441 VariablePointersStorageBuffer 4442 VariablePointers 4445 AtomicStorageOps
4448 StorageBuffer8BitAccess 4449 UniformAndStorageBuffer8BitAccess
4450 StoragePushConstant8 4464 DenormPreserve 4465 DenormFlushToZero
4466 SignedZeroInfNanPreserve 4467 RoundingModeRTE 4468 RoundingModeRTZ
5016 Int64ImageEXT 5055 ShaderClockKHR 5301 ShaderNonUniform 5302 RuntimeDescriptorArray
5306 UniformBufferArrayNonUniformIndexing 5308 StorageBufferArrayNonUniformIndexing
5345 VulkanMemoryModel 5346 VulkanMemoryModelDeviceScope
5347 PhysicalStorageBufferAddresses 5357 CooperativeMatrixNV
5612 AtomicFloat32MinMaxEXT 5613 AtomicFloat64MinMaxEXT 6016 DotProductInputAll
6017 DotProductInput4x8Bit 6018 DotProductInput4x8BitPacked 6019 DotProduct
6022 CooperativeMatrixKHR 6026 GroupNonUniformRotateKHR 6033 AtomicFloat32AddEXT
6034 AtomicFloat64AddEXT 6095 AtomicFloat16AddEXT""".split()
CAPABILITY_NAMES = {i: n for i, n in enumerate(_CORE_CAPS) if n != "-"}
CAPABILITY_NAMES.update({int(n): s for n, s in zip(_EXT_CAPS[::2], _EXT_CAPS[1::2])})


class SpirvError(ValueError):
    """The input is not a SPIR-V module this reflector can read."""


@dataclass(frozen=True)
class Binding:
    set: int
    binding: int
    kind: str  # "storage_buffer" | "uniform_buffer" | "storage_texel_buffer"
    readonly: bool
    name: str


@dataclass(frozen=True)
class PushConstantMember:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Reflection:
    entry_points: tuple[str, ...]
    local_size: tuple[int, int, int] | None
    local_size_spec_ids: tuple[int | None, int | None, int | None]
    bindings: tuple[Binding, ...]
    push_constant_size: int
    push_constant_members: tuple[PushConstantMember, ...]
    spec_constants: dict[int, str]
    capabilities: frozenset[str]
    version: tuple[int, int]


HEADER = 5   # words before the first instruction: magic, version, generator, bound, schema
BOUND = 3    # the header word one above every id the module uses


def module_words(spirv: bytes) -> list[int]:
    """A module's words, in either byte order (the magic number tells which: spec section 2.3)."""
    if len(spirv) % 4:
        raise SpirvError(f"not SPIR-V: size {len(spirv)} bytes is not a multiple of 4")
    if len(spirv) < 4 * HEADER:
        raise SpirvError(f"not SPIR-V: {len(spirv)} bytes is too short for the 5-word header")
    magic = int.from_bytes(spirv[:4], "little")
    if magic == MAGIC:
        order = "<"
    elif magic == int.from_bytes(MAGIC.to_bytes(4, "little"), "big"):
        order = ">"
    else:
        raise SpirvError(f"not SPIR-V: bad magic number 0x{magic:08x} (expected 0x{MAGIC:08x})")
    return list(struct.unpack(f"{order}{len(spirv) // 4}I", spirv))


def module_bytes(words) -> bytes:
    """A module's words as the little-endian bytes a driver or a file takes."""
    return struct.pack(f"<{len(words)}I", *words)


def instructions(words, start: int = HEADER):
    """Each instruction from word `start` on: (its offset, its opcode, its operands: the words after the first).
    A word count of zero, or one running past the end, is refused (SpirvError)."""
    i, end = start, len(words)
    while i < end:
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise SpirvError(f"invalid instruction at word {i}: word count 0 (opcode {op})")
        if i + count > end:
            raise SpirvError(f"truncated instruction at word {i}: opcode {op} needs "
                             f"{count} words, only {end - i} left")
        yield i, op, words[i + 1:i + count]
        i += count


def instruction(op: int, *operands: int) -> list[int]:
    """An instruction's words: the word count and opcode, then the operands."""
    return [(1 + len(operands)) << 16 | op, *operands]


def rewrite(words, edit) -> list[int]:
    """A module's words with each instruction replaced as `edit(offset, opcode, operands)` says: None keeps it,
    a list of words replaces it (several instructions' words, or [] to drop it). The header is kept; a pass
    that adds ids sets words[BOUND] of the result."""
    out = list(words[:HEADER])
    for at, op, operands in instructions(words):
        new = edit(at, op, operands)
        out += instruction(op, *operands) if new is None else new
    return out


def literal_string(words, start: int = 0) -> str:
    """Decode a literal string: UTF-8, nul-terminated, first byte in the low bits."""
    out = bytearray()
    for w in words[start:]:
        chunk = w.to_bytes(4, "little")
        if 0 in chunk:
            return (out + chunk[:chunk.index(0)]).decode("utf-8", "replace")
        out += chunk
    raise SpirvError("unterminated string literal")


def string_words(text: str) -> list[int]:
    """A literal string's words: UTF-8, nul-terminated, padded with nuls to a whole word."""
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 4)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


class _Module:
    """Tables of the instructions reflection cares about; everything else is skipped."""

    def __init__(self, words: list[int]):
        self.version = ((words[1] >> 16) & 0xFF, (words[1] >> 8) & 0xFF)
        self.names, self.member_names = {}, {}
        self.decos, self.member_decos = {}, {}
        self.types, self.consts, self.composites = {}, {}, {}
        self.entries, self.modes, self.variables, self.caps = [], [], [], set()
        for _, op, operands in instructions(words):
            self._record(op, operands)

    def _record(self, op: int, a: list[int]) -> None:
        if op == OP_NAME:
            self.names[a[0]] = literal_string(a, 1)
        elif op == OP_MEMBER_NAME:
            self.member_names[(a[0], a[1])] = literal_string(a, 2)
        elif op == OP_ENTRY_POINT and a[0] == MODEL_GLCOMPUTE:
            self.entries.append((a[1], literal_string(a, 2)))
        elif op in (OP_EXECUTION_MODE, OP_EXECUTION_MODE_ID):
            self.modes.append((a[0], a[1], a[2:]))
        elif op == OP_CAPABILITY:
            self.caps.add(CAPABILITY_NAMES.get(a[0], f"Capability{a[0]}"))
        elif op == OP_DECORATE:
            self.decos.setdefault(a[0], {})[a[1]] = a[2:]
        elif op == OP_MEMBER_DECORATE:
            self.member_decos.setdefault((a[0], a[1]), {})[a[2]] = a[3:]
        elif op in _TYPE_OPS:
            self.types[a[0]] = (op, a[1:])
        elif op in (OP_CONSTANT, OP_SPEC_CONSTANT):
            self.consts[a[1]] = (a[0], a[2:], op == OP_SPEC_CONSTANT)
        elif op in (OP_SPEC_CONSTANT_TRUE, OP_SPEC_CONSTANT_FALSE):
            self.consts[a[1]] = (a[0], [int(op == OP_SPEC_CONSTANT_TRUE)], True)
        elif op in (OP_CONSTANT_COMPOSITE, OP_SPEC_CONSTANT_COMPOSITE):
            self.composites[a[1]] = a[2:]
        elif op == OP_VARIABLE:
            self.variables.append((a[0], a[1], a[2]))

    def type(self, tid: int):
        if tid not in self.types:
            raise SpirvError(f"id %{tid} is not a (supported) type")
        return self.types[tid]

    def int_value(self, cid: int) -> int:
        """Default value of an integer/bool (spec) constant; low word first for 64-bit."""
        if cid not in self.consts:
            raise SpirvError(f"id %{cid} is not a scalar constant")
        words = self.consts[cid][1]
        return words[0] | (words[1] << 32 if len(words) > 1 else 0)

    def spec_id(self, cid: int) -> int | None:
        if cid in self.consts and self.consts[cid][2]:
            return self.decos.get(cid, {}).get(DEC_SPEC_ID, [None])[0]
        return None

    def type_name(self, tid: int) -> str:
        op, a = self.type(tid)
        if op == OP_TYPE_BOOL:
            return "bool"
        if op == OP_TYPE_INT:
            return f"{'' if a[1] else 'u'}int{a[0]}"
        if op == OP_TYPE_FLOAT:
            return f"float{a[0]}"
        raise SpirvError(f"spec constant of non-scalar type (opcode {op})")

    def members(self, sid: int):
        """(name, offset, type id) of each struct member, in declaration order."""
        out = []
        for i, mtype in enumerate(self.type(sid)[1]):
            offset = self.member_decos.get((sid, i), {}).get(DEC_OFFSET)
            if offset is None:
                raise SpirvError(f"member {i} of struct %{sid} has no Offset decoration")
            out.append((self.member_names.get((sid, i), ""), offset[0], mtype))
        return out

    def size(self, tid: int) -> int:
        """Byte size of a type as laid out by its explicit Offset/ArrayStride decorations."""
        op, a = self.type(tid)
        if op in (OP_TYPE_INT, OP_TYPE_FLOAT):
            return a[0] // 8
        if op == OP_TYPE_BOOL:
            return 4
        if op == OP_TYPE_VECTOR:
            return a[1] * self.size(a[0])
        if op == OP_TYPE_ARRAY:
            stride = self.decos.get(tid, {}).get(DEC_ARRAY_STRIDE)
            return self.int_value(a[1]) * (stride[0] if stride else self.size(a[0]))
        if op == OP_TYPE_STRUCT:
            return max((off + self.size(t) for _, off, t in self.members(tid)), default=0)
        raise SpirvError(f"cannot size type %{tid} (opcode {op}) in a push-constant block")

    def local_size(self, entry_fn: int | None):
        # A WorkgroupSize builtin overrides the LocalSize mode (spec, BuiltIn 25); glslang
        # emits it for local_size_*_id before SPIR-V 1.6, and LocalSizeId from 1.6 on.
        for cid, deco in self.decos.items():
            if deco.get(DEC_BUILTIN) == [BUILTIN_WORKGROUP_SIZE] and cid in self.composites:
                return self._resolve(self.composites[cid])
        for fn, mode, args in self.modes:
            if entry_fn is not None and fn != entry_fn:
                continue
            if mode == MODE_LOCAL_SIZE:
                return tuple(args[:3]), (None, None, None)
            if mode == MODE_LOCAL_SIZE_ID:
                return self._resolve(args[:3])
        return None, (None, None, None)

    def _resolve(self, ids):
        return tuple(self.int_value(c) for c in ids), tuple(self.spec_id(c) for c in ids)


def reflect(spirv: bytes) -> Reflection:
    m = _Module(module_words(bytes(spirv)))
    bindings, push = [], []
    for ptr, var, storage in m.variables:
        if storage not in (SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_STORAGE_BUFFER, SC_PUSH_CONSTANT):
            continue
        block = m.type(ptr)[1][1]  # OpTypePointer operands: storage class, pointee
        if storage == SC_UNIFORM_CONSTANT:
            # a storage texel buffer (GLSL's imageBuffer): OpTypeImage with Dim Buffer, read without a sampler
            op, operands = m.types.get(block, (None, ()))   # sampled type, dim, depth, arrayed, MS, sampled, format
            if op != OP_TYPE_IMAGE or operands[1] != DIM_BUFFER or operands[5] != IMAGE_STORAGE:
                raise SpirvError(f"variable %{var}: only storage texel buffers are supported among images and "
                                 "samplers")
            var_deco = m.decos.get(var, {})
            bindings.append(Binding(set=var_deco.get(DEC_DESCRIPTOR_SET, [0])[0],
                                    binding=var_deco.get(DEC_BINDING, [0])[0], kind="storage_texel_buffer",
                                    readonly=DEC_NON_WRITABLE in var_deco, name=m.names.get(var) or ""))
            continue
        op = m.type(block)[0]
        if op in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY):
            raise SpirvError("descriptor arrays not supported")
        if op != OP_TYPE_STRUCT:
            raise SpirvError(f"variable %{var}: buffer type is not a struct (opcode {op})")
        if storage == SC_PUSH_CONSTANT:
            # Vulkan allows one push block per entry point; several entry points' blocks
            # are merged, which is the range a shared pipeline layout needs anyway.
            members = m.members(block)
            # naga wraps the WGSL struct in a one-member Block struct: report the inner struct's fields.
            if len(members) == 1 and m.type(members[0][2])[0] == OP_TYPE_STRUCT:
                base = members[0][1]
                members = [(n, base + off, t) for n, off, t in m.members(members[0][2])]
            push += [PushConstantMember(n, off, m.size(t)) for n, off, t in members]
            continue
        deco, var_deco = m.decos.get(block, {}), m.decos.get(var, {})
        # SPIR-V 1.0 has no StorageBuffer class: SSBOs are Uniform + BufferBlock there.
        if storage == SC_STORAGE_BUFFER or DEC_BUFFER_BLOCK in deco:
            kind = "storage_buffer"
        elif DEC_BLOCK in deco:
            kind = "uniform_buffer"
        else:
            raise SpirvError(f"variable %{var}: Uniform struct without Block/BufferBlock")
        # glslang marks `readonly` on every member; naga / hand-written SPIR-V on the variable.
        n = len(m.type(block)[1])
        readonly = DEC_NON_WRITABLE in var_deco or (n > 0 and all(
            DEC_NON_WRITABLE in m.member_decos.get((block, i), {}) for i in range(n)))
        bindings.append(Binding(
            # Missing decorations default to 0, as Vulkan reflection tools conventionally do.
            set=var_deco.get(DEC_DESCRIPTOR_SET, [0])[0],
            binding=var_deco.get(DEC_BINDING, [0])[0],
            kind=kind, readonly=readonly,
            name=m.names.get(var) or m.names.get(block) or ""))
    push.sort(key=lambda p: p.offset)
    bindings.sort(key=lambda b: (b.set, b.binding))   # images and blocks are declared apart
    local_size, spec_ids = m.local_size(m.entries[0][0] if m.entries else None)
    spec_constants = {m.spec_id(c): m.type_name(t) for c, (t, _, spec) in m.consts.items()
                      if spec and m.spec_id(c) is not None}
    return Reflection(
        entry_points=tuple(name for _, name in m.entries),
        local_size=local_size,
        local_size_spec_ids=spec_ids,
        bindings=tuple(sorted(bindings, key=lambda b: (b.set, b.binding))),
        push_constant_size=push[-1].offset + push[-1].size if push else 0,
        push_constant_members=tuple(push),
        spec_constants=dict(sorted(spec_constants.items())),
        capabilities=frozenset(m.caps),
        version=m.version,
    )


def reflect_file(path: str | PathLike) -> Reflection:
    with open(path, "rb") as f:
        return reflect(f.read())
