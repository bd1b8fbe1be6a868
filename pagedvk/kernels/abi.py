"""Kernel interfaces and module variants, declared once.

Every op's interface to the GPU lives here as data: its descriptor bindings in order, its push-constant
block, its workgroup size, and the axes its modules vary along (cache storage type, cache access, kernels for
a kind of device or matrix unit). The query type is not an axis: kernels read it from the push constants
(``q_type``), except the cooperative-matrix modules, which are built for one. A module is named by a ``VariantKey``, built by
``KernelABI.key`` and nowhere else. The launcher reads these declarations to build pipeline layouts and pack
push constants; ``build_shaders.py`` reads them (by file path, so this module must stay stdlib-only) to know
what to compile; a test reflects every compiled module and compares it with what is declared here.

Where a new thing goes (docs/ARCHITECTURE.md says more):
- a cache storage type: its tag in STORAGE_TYPES, its load function in shaders/kv_storage.glsl and a
  shaders/kv_<tag>.wgsl, its store function (reshape_and_cache) in shaders/kv_encode.glsl and a
  shaders/kv_write_<tag>.wgsl, and its numpy dtype in pagedvk/dtypes.py;
- a head size: nothing (GLSL specializes the head size; WGSL fixes FIXED_WGSL_HEAD_SIZES' at translation);
- a kernel: its KernelABI below, one .comp and one .wgsl source, its op module in pagedvk/ops/;
- a cooperative-matrix module of an op: an entry in its KernelABI's matrix_variants and a
  shaders/<op>_<kind>.comp with the op's bindings and push constants (and, with "wgsl" in its matrix_backends,
  a shaders/<op>_<kind>.wgsl);
- a kernel shaped for a kind of device (decode on CPUs): a tag in its KernelABI's targets and a
  shaders/<op>_<target>.comp with the op's bindings, push constants and specialization constants.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from ..config import BACKENDS   # stdlib-only too, as build_shaders.py needs
SOURCE_SUFFIX = {"glsl": ".comp", "wgsl": ".wgsl"}
# Files that GLSL sources may #include: what a module was built from where its manifest entry lists no includes
# (build_shaders.py records the ones glslang reports, so an edit rebuilds only the modules that include the file).
GLSL_INCLUDE_SUFFIX = ".glsl"

# Element storage of caches (tags name modules, defines and WGSL includes). Every type is read through
# 32-bit words and converted in the kernel, so none needs a 16-bit or 8-bit storage feature.
STORAGE_TYPES = ("f32", "f16", "bf16", "e4m3", "e5m2")
# Queries and outputs: the float types a model computes in.
QUERY_TYPES = ("f32", "f16", "bf16")


def q_type_code(tag: str) -> int:
    """The push constant (q_type, token_type) that tells a kernel its query storage type."""
    return QUERY_TYPES.index(tag)


def q_type_constant(tag: str) -> dict:
    """The specialization that fixes the query storage type in an attention kernel's GLSL pipeline
    (Q_TYPE_SPEC_ID; its value is the code plus one, 0 reading the push constant)."""
    return {Q_TYPE_SPEC_ID: q_type_code(tag) + 1}


# Backward caches: fp8 caches are for inference.
GRADIENT_CACHE_TYPES = ("f32", "f16", "bf16")
# How kernels reach a cache larger than one binding (pagedvk.runtime.array.DeviceArray splits it into segments of whole
# blocks): "seg" binds up to KV_SEGMENTS segments per cache, "bda" (GLSL only) reads them through buffer device
# addresses, any number of them. "" is the one-binding cache.
CACHE_ACCESS = ("", "seg", "bda")
KV_SEGMENTS = 4
# Ops that write caches: their WGSL includes name write-side storage files (kv_write_<type>.wgsl, token_<type>.wgsl).
WRITE_INCLUDES_OPS = ("reshape_and_cache",)
# Ops that read their caches as 16-byte chunks (kv_chunk_access.wgsl; GLSL: KV_CHUNKS in kv_storage.glsl); so do
# the WGSL matrix modules.
CHUNK_READ_OPS = ("paged_decode",)
# Ops whose modules reduce over the workgroup with subgroup arithmetic (GLSL: GL_KHR_shader_subgroup_arithmetic;
# WGSL: naga's subgroup built-ins, through shaders/decode_reduce_subgroup.wgsl), which Vulkan leaves optional.
# Each also has modules reducing in shared memory only, reduce="shared" (GLSL: SHARED_REDUCE; WGSL:
# decode_reduce_shared.wgsl), for devices without it: the generic head size, every cache storage and access
# (KernelABI.key picks them).
SUBGROUP_REDUCE_OPS = ("paged_decode",)
# The Vulkan features (VK_KHR_shader_bfloat16) a bfloat16 cooperative-matrix module needs: build_shaders.py makes it
# from the float16 source by giving float16 the bfloat16 encoding (bfloat16_matrices).
BFLOAT16_MATRIX_FEATURES = ("shaderBFloat16Type", "shaderBFloat16CooperativeMatrix")

# Cooperative-matrix modules (VK_KHR_cooperative_matrix) are named by their source's suffix,
# shaders/<op>_<matrix>.comp or .wgsl ("coopmat"). GLSL's need glslang 13 or newer and SPIR-V 1.5 (Vulkan 1.2: the
# Vulkan memory model that GL_KHR_cooperative_matrix brings); build_shaders.py finds such a glslang. WGSL's use
# naga 30's `enable wgpu_cooperative_matrix;` (spirv_passes.declare_cooperative_matrix adds what naga leaves out),
# for the ops whose KernelABI.matrix_backends list "wgsl", and only for the cache and query types in their
# KernelABI.wgsl_matrix_types (by default WGSL_MATRIX_TYPES): fp8 caches need matrix element access, which naga has
# not. WGSL has no bfloat16 either: an op whose WGSL source does nothing in f16 but loads, stores, conversions from
# f32 and matrix products (the decode) lists "bf16" too, and build_shaders.py gives its bfloat16 module's f16 the
# bfloat16 encoding (bfloat16_matrices), as it does the GLSL bfloat16 modules.
MATRIX_TARGET_ENV = "vulkan1.2"
WGSL_MATRIX_TYPES = ("f16",)
TARGET_ENV = "vulkan1.1"   # every other module
# The decode's WGSL modules with the head size, the layout and the head-group width fixed at translation (naga emits
# no specialization constants; VariantKey.fixed names the last two): vLLM's most common head sizes only, four modules
# each. Every other head size runs the module that reads them from the push constants. GLSL modules take all three as
# specialization constants (DECODE_HEAD_SIZE_SPEC_ID, DECODE_VALUE_ORDER_SPEC_ID, DECODE_GROUP_SPEC_ID): one module
# serves every head size, and the driver still compiles its loops with the head size as a constant.
FIXED_WGSL_HEAD_SIZES = (64, 128)
# ... and the query type fixed too: each cache type's usual one (DecodePlan's default query dtype; vLLM's fp8 caches
# serve float16 and bfloat16 models). Read from the push constant, WGSL's fp8 decode was 2.0-2.2% slower on the H200
# than with the type in the module (2026-12-03). Other query types run the module that reads the layout too.
FIXED_QUERY = {"f32": "f32", "f16": "f16", "bf16": "bf16", "e4m3": "f16", "e5m2": "f16"}
# (VALUE_ORDER, GROUP_LIMIT). VALUE_ORDER 2 fixes only that a token's value dims are contiguous (v_dim_stride 1), the
# rest being strides: the "nhd" modules serve "hnd" caches too.
DECODE_FIXED = {"vllm_g4": (1, 4), "vllm_g8": (1, 8), "nhd_g4": (2, 4), "nhd_g8": (2, 8)}
# Kernels of an op shaped for a kind of device, named by their source's suffix, shaders/<op>_<target>.comp (GLSL
# only): "cpu", paged_decode for devices that run a subgroup as one SIMD register's lanes (lavapipe), with no
# shared memory and no barrier. Built for every storage, head size and cache access the op's generic module
# takes; they reduce with subgroup arithmetic and shuffle.
TARGETS = ("cpu",)


@dataclass(frozen=True)
class Binding:
    name: str
    readonly: bool


@dataclass(frozen=True)
class PushField:
    name: str
    kind: str  # "u32" | "i32" | "f32": every field is one 4-byte scalar, so offsets are 4 * index

    @property
    def format(self) -> str:
        return {"u32": "I", "i32": "i", "f32": "f"}[self.kind]


@dataclass(frozen=True)
class VariantKey:
    """Names one SPIR-V module: the op, the backend and the values of the op's variant axes ("" or 0 where
    the op has no such axis). GLSL takes the axes as defines, WGSL as pasted storage includes and fixed
    constants, both from one source per op and language."""

    op: str
    backend: str
    kv: str = ""          # cache storage tag
    q: str = ""           # query and output storage tag
    head_size: int = 0    # 0: any head size, read from the push constants
    access: str = ""      # how caches larger than one binding are read (CACHE_ACCESS)
    matrix: str = ""      # "" or a matrix kind ("coopmat"): the op's cooperative-matrix source
    reduce: str = ""      # "" or "shared": workgroup reductions without subgroup arithmetic (SUBGROUP_REDUCE_OPS)
    fixed: str = ""       # WGSL decode: "" or a DECODE_FIXED name, the layout and head-group width fixed
    target: str = ""      # "" or a TARGETS tag: the op's source shaped for that kind of device

    @property
    def name(self) -> str:
        axes = [self.matrix, self.target, f"kv_{self.kv}" if self.kv else "", self.access,
                f"q_{self.q}" if self.q else "", f"h{self.head_size}" if self.head_size else "",
                f"{self.reduce}_reduce" if self.reduce else "", self.fixed]
        return ".".join([self.op, *filter(None, axes), self.backend])

    @property
    def source(self) -> str:
        """The source file's name: shaders/<op>[_<matrix>|_<target>].comp or .wgsl."""
        suffix = self.matrix or self.target
        return self.op + (f"_{suffix}" if suffix else "") + SOURCE_SUFFIX[self.backend]

    @property
    def target_env(self) -> str:
        """The SPIR-V environment the module is built and validated for."""
        return MATRIX_TARGET_ENV if self.matrix else TARGET_ENV

    def defines(self) -> dict:
        """GLSL: one define per storage axis (KV_F16, and Q_BF16 for a matrix module; the others read the query
        type from the push constants) and HEAD_SIZE when fixed."""
        d = {f"KV_{self.kv.upper()}": 1} if self.kv else {}
        d.update({f"Q_{self.q.upper()}": 1} if self.q else {})
        d.update({"HEAD_SIZE": self.head_size} if self.head_size else {})
        d.update({{"seg": "KV_SEGMENTED", "bda": "KV_ADDRESSED"}[self.access]: 1} if self.access else {})
        d.update({"SHARED_REDUCE": 1} if self.reduce else {})
        return d

    def includes(self) -> dict:
        """WGSL: which storage file stands in for each generic `//!include` name."""
        inc = {"kv_storage.wgsl": f"kv_{self.kv}.wgsl",
               "kv_access.wgsl": "kv_segmented.wgsl" if self.access else "kv_bound.wgsl"} if self.kv else {}
        if (self.op in CHUNK_READ_OPS or self.matrix and self.backend == "wgsl") and self.kv:
            inc["kv_chunk_access.wgsl"] = "kv_chunk_segmented.wgsl" if self.access else "kv_chunk_bound.wgsl"
        # a fixed decode module's query type is q_any.wgsl's, fixed by constants()
        inc["q_storage.wgsl"] = f"q_{self.q}.wgsl" if self.q and not self.fixed else "q_any.wgsl"
        if self.op in SUBGROUP_REDUCE_OPS:
            inc["decode_reduce.wgsl"] = f"decode_reduce_{self.reduce or 'subgroup'}.wgsl"
        if self.op in WRITE_INCLUDES_OPS:   # the cache writers' own files
            inc.update({"kv_write.wgsl": f"kv_write_{self.kv}.wgsl",
                        "kv_write_access.wgsl": "kv_write_segmented.wgsl" if self.access else "kv_write_bound.wgsl"})
        return inc

    def requires(self) -> tuple:
        """The device features (Vulkan feature names) the module needs enabled. Storage types need none: the
        kernels read every type through 32-bit words."""
        need = ("bufferDeviceAddress", "shaderInt64") if self.access == "bda" else ()
        if self.matrix:   # float16 or bfloat16 matrices; GL_KHR_cooperative_matrix brings the Vulkan memory model
            need += ("cooperativeMatrix", "vulkanMemoryModel")
            need += BFLOAT16_MATRIX_FEATURES if self.kv == "bf16" else ("shaderFloat16",)
            if self.backend == "wgsl":   # naga's matrices load from arrays of their element type: f16 buffers
                need += ("storageBuffer16BitAccess",)
        return need

    def constants(self) -> dict:
        """WGSL `override`s fixed at translation (naga emits no specialization constants)."""
        fixed = dict(zip(("VALUE_ORDER", "GROUP_LIMIT"), DECODE_FIXED[self.fixed])) if self.fixed else {}
        if self.fixed and self.q:
            fixed["Q_TYPE_FIXED"] = q_type_code(self.q)
        return {**({"HEAD_SIZE": self.head_size} if self.head_size else {}), **fixed}


@dataclass(frozen=True)
class KernelABI:
    op: str  # shader source base name in shaders/, and module name prefix
    bindings: tuple
    push: tuple
    workgroup_size: tuple
    backends: tuple = BACKENDS
    kv_types: tuple = ()          # cache storage tags the op is built for; () if it reads no cache
    q_types: tuple = ()           # query/output storage tags it takes (push constant q_type); () if it has none
    writes_cache: bool = False    # the caches' bindings (segments included) are written, not read
    # (matrix kind, cache tag, query tag, head size): cooperative-matrix modules, GLSL, head size fixed, one per
    # cache access in matrix_accesses; each has the op's bindings and push constants (its grid may differ: the op
    # says)
    matrix_variants: tuple = ()
    matrix_accesses: tuple = CACHE_ACCESS
    # the backends with matrix modules (shaders/<op>_coopmat.comp, .wgsl): WGSL's are built for the
    # matrix_variants whose cache and query types are in wgsl_matrix_types (matrix_variants_for) and the cache
    # accesses WGSL has
    matrix_backends: tuple = ("glsl",)
    wgsl_matrix_types: tuple = WGSL_MATRIX_TYPES
    # ((constant_id, SPIR-V type), ...): the op's own specialization constants, in its GLSL modules only (not its
    # matrix modules, whose head size is fixed at build time, unless it lists them in matrix_spec_constants)
    spec_constants: tuple = ()
    matrix_spec_constants: tuple = ()
    target_spec_constants: tuple = ()   # ((TARGETS tag, its source's), ...) where they differ
    # head sizes whose WGSL modules are also built with the layout and group width fixed (DECODE_FIXED)
    fixed_head_sizes: tuple = ()
    # TARGETS tags of the op's device-shaped GLSL sources, built as its generic modules are (storage, head sizes,
    # accesses), not reducing in shared memory
    targets: tuple = ()

    def specialization_constants(self, key: VariantKey) -> dict:
        """{constant_id: type} that the module declares: VARIANTS_SPEC_ID where it specializes the variants,
        and the op's own in GLSL (naga emits none)."""
        if key.backend != "glsl":
            return {}
        own = dict(self.matrix_spec_constants if key.matrix else
                   dict(self.target_spec_constants).get(key.target, self.spec_constants))
        query = {Q_TYPE_SPEC_ID: "uint32"} if self.push == ATTENTION_PUSH and self.q_types and not key.matrix else {}
        return {**({VARIANTS_SPEC_ID: "bool"} if self.specializes_variants(key) else {}), **own, **query}

    def specializes_variants(self, key: VariantKey) -> bool:
        """Whether the module declares VARIANTS_SPEC_ID: the GLSL modules of the attention kernels, which
        include attention_common.glsl."""
        return key.backend == "glsl" and self.push == ATTENTION_PUSH

    @property
    def push_size(self) -> int:
        return 4 * len(self.push)

    def push_offsets(self) -> dict:
        return {f.name: 4 * i for i, f in enumerate(self.push)}

    def pack_push(self, **values) -> bytes:
        missing = {f.name for f in self.push} - values.keys()
        extra = values.keys() - {f.name for f in self.push}
        if missing or extra:
            raise KeyError(f"{self.op}: push constants missing {sorted(missing)}, unknown {sorted(extra)}")
        return self.push_struct().pack(*(values[f.name] for f in self.push))

    def push_struct(self) -> struct.Struct:
        return struct.Struct("<" + "".join(f.format for f in self.push))

    def bindings_for(self, key: VariantKey) -> tuple:
        """The module's bindings: the declared ones, then, for caches read in segments, the bindings of
        segments 1 .. KV_SEGMENTS - 1 of each cache (segment 0 is key_cache / value_cache)."""
        if key.access != "seg":
            return self.bindings
        return self.bindings + tuple(Binding(f"{cache}_{i}", readonly=not self.writes_cache)
                                     for cache in ("key_cache", "value_cache")
                                     for i in range(1, KV_SEGMENTS))

    def key(self, backend: str, kv: str = "", q: str = "", head_size: int = 0, access: str = "",
            matrix: str = "", subgroup_arithmetic: bool = True, fixed: str = "", target: str = "") -> VariantKey:
        """The module that runs this op for these arguments: the one place a module is chosen. The query
        storage `q` is checked against the op's q_types and names a module only where it is a matrix module's;
        the others read it from the push constants (q_type). The head size names a module only where it is a
        matrix module's or one of WGSL's fixed decode modules'; the others read it from the push constants or a
        specialization constant. A matrix module exists only for its listed (kind, cache, query, head size).
        subgroup_arithmetic=False (the device lacks it): the generic module reducing in shared memory, for an
        op in SUBGROUP_REDUCE_OPS. fixed (a DECODE_FIXED name): the WGSL module with the layout and head-group
        width fixed, where one is built for the head size (fixed_head_sizes), else the one that reads them.
        target (one of the op's targets): its device-shaped GLSL module (the caller checks that the device has
        what it needs); ignored for WGSL, whose modules are the generic kernel's only."""
        if target and target not in self.targets:
            raise ValueError(f"{self.op} has no {target!r} kernel (targets: {', '.join(self.targets) or 'none'})")
        if fixed and fixed not in DECODE_FIXED:
            raise ValueError(f"fixed must be one of {', '.join(DECODE_FIXED)}, got {fixed!r}")
        if matrix:
            if (matrix, kv, q, head_size) not in self.matrix_variants_for(backend):
                built = ", ".join(f"{m} kv {k} q {qq} head {h}"
                                  for m, k, qq, h in self.matrix_variants_for(backend)) or "none"
                raise ValueError(f"{self.op} has no {matrix!r} module for {backend}, cache storage {kv!r}, query "
                                 f"storage {q!r}, head size {head_size} (built: {built})")
            if access not in self.matrix_accesses_for(backend):
                raise ValueError(f"{self.op} has no {matrix!r} module reading caches by {access!r}")
            return VariantKey(self.op, backend, kv, q, head_size, access, matrix)
        if backend not in self.backends:
            raise ValueError(f"{self.op} has no {backend} modules (backends: {', '.join(self.backends)})")
        if access not in self.accesses(backend):
            raise ValueError(f"{self.op} has no {backend} module reading caches by {access!r} "
                             f"(built: {', '.join(map(repr, self.accesses(backend)))})")
        for axis, value, allowed in (("cache storage", kv, self.kv_types), ("query storage", q, self.q_types)):
            if (value or allowed) and value not in allowed:
                raise ValueError(f"{self.op} has no module for {axis} {value!r} (built: {', '.join(allowed)})")
        if target and backend == "glsl":
            return VariantKey(self.op, backend, kv, access=access, target=target)
        if not subgroup_arithmetic and self.reduces_in_subgroups(backend):
            return VariantKey(self.op, backend, kv, access=access, reduce="shared")
        if (backend == "wgsl" and fixed and not access and head_size in self.fixed_head_sizes
                and q == FIXED_QUERY.get(kv)):
            return VariantKey(self.op, backend, kv, q, head_size, fixed=fixed)
        return VariantKey(self.op, backend, kv, access=access)

    def matrix_variants_for(self, backend: str) -> tuple:
        """The matrix_variants built for a backend: all of them for GLSL, those of wgsl_matrix_types for WGSL,
        none for a backend not in matrix_backends."""
        if backend not in self.matrix_backends:
            return ()
        return tuple(v for v in self.matrix_variants
                     if backend == "glsl" or (v[1] in self.wgsl_matrix_types and v[2] in self.wgsl_matrix_types))

    def matrix_accesses_for(self, backend: str) -> tuple:
        return tuple(a for a in self.matrix_accesses if a in self.accesses(backend))

    def reduces_in_subgroups(self, backend: str) -> bool:
        return self.op in SUBGROUP_REDUCE_OPS

    def accesses(self, backend: str) -> tuple:
        if not self.kv_types:
            return ("",)
        return CACHE_ACCESS if backend == "glsl" else ("", "seg")

    def keys(self):
        """Every module this op needs built: a declared product of its axes (backend, cache storage, cache
        access, then the shared-memory reduce, the device-shaped targets and WGSL's fixed decode modules), and the
        matrix modules it lists."""
        for backend in self.backends:
            for kv in self.kv_types or ("",):
                for access in self.accesses(backend):
                    yield VariantKey(self.op, backend, kv, access=access)
                    if self.reduces_in_subgroups(backend):
                        yield VariantKey(self.op, backend, kv, access=access, reduce="shared")
                    for target in self.targets if backend == "glsl" else ():
                        yield VariantKey(self.op, backend, kv, access=access, target=target)
                for hs in self.fixed_head_sizes if backend == "wgsl" else ():
                    for fixed in DECODE_FIXED:
                        yield VariantKey(self.op, backend, kv, FIXED_QUERY[kv], hs, fixed=fixed)
        for backend in self.matrix_backends:
            for matrix, kv, q, hs in self.matrix_variants_for(backend):
                for access in self.matrix_accesses_for(backend):
                    yield VariantKey(self.op, backend, kv, q, hs, access, matrix)


# What every attention kernel reading the paged cache binds first, in this order.
ATTENTION_INPUTS = (
    Binding("query", readonly=True),
    Binding("key_cache", readonly=True),
    Binding("value_cache", readonly=True),
    Binding("block_tables", readonly=True),
    Binding("seq_lens", readonly=True),
)

# One push-constant block for every attention kernel (shaders/attention_common.glsl, .wgsl), so a plan packs
# it once for all its dispatches. The caches are addressed through strides, which is how one module reads
# both cache layouts (pagedvk/ops/layouts.py computes them):
#   key quad (4 consecutive head dims d..d+3 of one token; d % 4 == 0), in units of 4 elements:
#       b*k_block_stride + h*k_head_stride + t*k_token_stride + (d/4 / CQ)*k_chunk_stride + (d/4) % CQ
#     where CQ = 4 / itemsize quads make one 16-byte chunk (vLLM's x = 16 / itemsize elements)
#   value element: b*v_block_stride + h*v_head_stride + t*v_token_stride + d*v_dim_stride
# num_blocks is the number of whole blocks the bound caches hold (the launcher's bound on block ids).
ATTENTION_PUSH = tuple(PushField(name, kind) for name, kind in (
    ("num_heads", "u32"),
    ("num_kv_heads", "u32"),
    ("head_size", "u32"),
    ("block_size", "u32"),
    ("max_blocks_per_seq", "u32"),
    ("num_blocks", "u32"),
    ("num_seqs", "u32"),
    ("q_token_stride", "u32"),   # prefill: query rows (head_size elements) from one query to the next
    ("q_head_stride", "u32"),    # prefill: query rows from one head to the next (see PREFILL_INPUTS)
    ("causal", "u32"),
    ("scale", "f32"),            # softmax scale, times k_scale for fp8 keys
    ("v_scale", "f32"),          # fp8 values' scale, applied to the output (1 otherwise)
    ("group_size", "u32"),       # decode: query heads per workgroup
    ("partition_size", "u32"),   # decode: tokens per split-K partition (the last takes the rest)
    ("num_partitions", "u32"),   # decode: 1 writes `out` directly
    ("k_block_stride", "u32"),
    ("k_head_stride", "u32"),
    ("k_token_stride", "u32"),
    ("k_chunk_stride", "u32"),
    ("v_block_stride", "u32"),
    ("v_head_stride", "u32"),
    ("v_token_stride", "u32"),
    ("v_dim_stride", "u32"),
    ("blocks_per_segment", "u32"),   # blocks per segment of a cache larger than one binding
    # Attention variants (shaders/attention_variants.glsl); all zero is plain attention.
    ("softcap", "f32"),          # logit softcapping c (FlashInfer's logits_soft_cap): c tanh(logit / c); 0: off
    ("window", "u32"),           # a query sees keys at most window - 1 before it (window_left + 1); 0: no window
    ("variants", "u32"),         # VARIANT_* flags: which of the optional bindings below are read or written
    ("q_type", "u32"),           # storage of query, out and dout: QUERY_TYPES.index(tag) (matrix modules: ignored)
))
# The flags of `variants` (the kernels' VARIANT_* constants).
VARIANT_ALIBI = 1                # alibi_slopes is read: logit += slope[head] * (key position - query position)
VARIANT_SINKS = 2                # sinks is read: one more logit per head in the softmax denominator, no value
VARIANT_LSE = 4                  # lse is written: the natural-log log-sum-exp of each (query, head)

# The specialization constant (GLSL `VARIANTS`, attention_common.glsl) that a launch without variants sets
# false: its pipeline then holds none of the variants' code. WGSL modules have none (naga emits none).
VARIANTS_SPEC_ID = 0
# The decode kernel's own specialization constants (shaders/paged_decode.comp), set per plan by pagedvk/ops/decode_rules.py:
# which V stage the cache layout needs, and how many query heads a workgroup takes. 0 (their default) reads
# both from the push constants.
DECODE_VALUE_ORDER_SPEC_ID = 1   # 1: a head dim's tokens contiguous (vLLM's layout); 2: a token's dims (nhd, hnd)
DECODE_GROUP_SPEC_ID = 2         # 4: groups of at most 4 query heads; 8: of 5 to 8
# The GPU decode kernels' (shaders/paged_decode.comp and paged_decode_coopmat.comp, not the CPU one): 1 where a split
# of at most DECODE_MERGE_PARTITIONS partitions is merged in the decode dispatch (shaders/decode_merge.glsl); 0, its
# default, leaves the merge to PAGED_DECODE_REDUCE.
DECODE_MERGE_SPEC_ID = 3
DECODE_MERGE_PARTITIONS = 4
# The matrix decode's (shaders/paged_decode_coopmat.comp; its fp8 modules use it): how an fp8 block's matrices are
# built. 0, its default: in registers where the device's element layout is a known one, else through shared memory;
# 1: through shared memory always; 2: in registers, the outputs NaN where a subgroup does not know its layout (tests).
DECODE_FP8_BUILD_SPEC_ID = 4
# The matrix decode's (float16 and bfloat16 modules; fp8 takes one block a step): how many of its blocks a subgroup
# takes a step, 1 (the default) or 2, set per plan by pagedvk/ops/decode_rules.py (MATRIX_STEP2_MIN_TOKENS).
DECODE_STEP_SPEC_ID = 5
# The scalar GPU decode's (shaders/paged_decode.comp, vLLM's layout): 1 where a float16 or bfloat16 plan's workgroups
# take one tile each, set by pagedvk/ops/decode_rules.py (values_with_keys): a tile's values are loaded beside its keys. 0, its
# default, loads them after the tile's weights, in batches.
DECODE_VALUES_SPEC_ID = 6
# The scalar decode kernels' (shaders/paged_decode.comp, paged_decode_cpu.comp) head size, set per plan by
# pagedvk/ops/decode_rules.py, so the driver unrolls the loops over head dims as it did when the head size was a define
# (BENCHMARKS.md, "Module count"). 0 (its default) reads the push constant.
DECODE_HEAD_SIZE_SPEC_ID = 7
# The query storage type in every attention kernel's GLSL modules but the matrix ones (shaders/kv_storage.glsl), set
# per plan (q_type_constant): the query's loads and the output's stores then take no branch on the push constant q_type.
Q_TYPE_SPEC_ID = 8


def head_size_constant(spec_id: int, head_size: int) -> dict:
    """The specialization on the head size (spec_id: DECODE_ or PREFILL_HEAD_SIZE_SPEC_ID), for every head size: a
    pipeline is compiled per head size in use, which a model pays once. The push-constant path the modules fall back
    to (the constant left 0) compiled 15x slower on lavapipe, whose LLVM took 100 s for the CPU decode kernel at
    head size 48 against 7 s specialized, and ran longer than PAGEDVK_TIMEOUT there (2026-12-05)."""
    return {spec_id: head_size}


# The head size, set per plan by pagedvk/ops/prefill.py in the scalar prefill and backward kernels
# (shaders/prefill_common.glsl): the driver then compiles the loops and branches on it as constants (the float32
# dk/dv on the H200: 23.5 -> 20.6 ms at issue 12's shape; BENCHMARKS.md). 0 (its default) reads the push constant.
PREFILL_HEAD_SIZE_SPEC_ID = 3

# The per-head inputs of the attention variants, float32 [num_heads] each; a 16-byte placeholder when the
# variant is off (its VARIANT_* flag clear): read only where the flag is set.
ATTENTION_VARIANT_INPUTS = (
    Binding("alibi_slopes", readonly=True),
    Binding("sinks", readonly=True),
)

# Decode attention, one query token per sequence. Workgroups: num_heads / group_size x num_seqs x
# num_partitions, numbered linearly over a grid folded to the device's limits (pagedvk.runtime.commands.
# fold_grid). With one partition the result goes to `out`; with more, to the partial buffers, and
# PAGED_DECODE_REDUCE merges them into `out`, or (a GLSL GPU kernel with DECODE_MERGE_SPEC_ID set) the last
# workgroup of each (sequence, head group) to finish does, counting on a uint32 after partial_stats' pairs: one
# (counter, unused) pair per (sequence, head group) at [num_seqs * num_heads * num_partitions + unit], zeroed when
# allocated and left at zero by every run. lse (float32 [num_seqs, num_heads]) is written where VARIANT_LSE is
# set, by whichever merges when split.
PAGED_DECODE = KernelABI(
    op="paged_decode",
    bindings=ATTENTION_INPUTS + (
        Binding("out", readonly=False),
        Binding("partial_out", readonly=False),
        Binding("partial_stats", readonly=False),
        *ATTENTION_VARIANT_INPUTS,
        Binding("lse", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    kv_types=STORAGE_TYPES,
    q_types=QUERY_TYPES,
    spec_constants=((DECODE_VALUE_ORDER_SPEC_ID, "uint32"), (DECODE_GROUP_SPEC_ID, "uint32"),
                    (DECODE_MERGE_SPEC_ID, "uint32"), (DECODE_VALUES_SPEC_ID, "uint32"),
                    (DECODE_HEAD_SIZE_SPEC_ID, "uint32")),
    # the CPU kernel (one subgroup a workgroup, no barriers) leaves every split to the reduce
    target_spec_constants=(("cpu", ((DECODE_VALUE_ORDER_SPEC_ID, "uint32"), (DECODE_GROUP_SPEC_ID, "uint32"),
                                    (DECODE_HEAD_SIZE_SPEC_ID, "uint32"))),),
    fixed_head_sizes=FIXED_WGSL_HEAD_SIZES,
    targets=TARGETS,
    # float16 and fp8 caches (float16 queries), bfloat16 caches and queries, in vLLM's layout with 16-token blocks,
    # read by binding (pagedvk.ops.decode_rules.decode_matrix)
    matrix_variants=tuple(("coopmat", kv, "f16", h) for kv in ("f16", "e4m3", "e5m2") for h in (64, 128))
    + tuple(("coopmat", "bf16", "bf16", h) for h in (64, 128)),
    matrix_accesses=("",),
    # WGSL: float16 caches and queries, and bfloat16 ones (shaders/paged_decode_coopmat.wgsl; bfloat16 through
    # spirv_passes.bfloat16_matrices)
    matrix_backends=("glsl", "wgsl"),
    wgsl_matrix_types=("f16", "bf16"),
    matrix_spec_constants=((DECODE_VALUE_ORDER_SPEC_ID, "uint32"), (DECODE_GROUP_SPEC_ID, "uint32"),
                           (DECODE_MERGE_SPEC_ID, "uint32"), (DECODE_FP8_BUILD_SPEC_ID, "uint32"),
                           (DECODE_STEP_SPEC_ID, "uint32")),
)

# Merges a split decode's partitions. Workgroups: num_heads x num_seqs, numbered linearly.
PAGED_DECODE_REDUCE = KernelABI(
    op="paged_decode_reduce",
    bindings=(
        Binding("seq_lens", readonly=True),
        Binding("partial_out", readonly=True),
        Binding("partial_stats", readonly=True),
        Binding("out", readonly=False),
        Binding("sinks", readonly=True),
        Binding("lse", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    q_types=QUERY_TYPES,
)

# Merges two attention results over disjoint key sets (FlashInfer's merge_state) from their log-sum-exps:
# out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / (exp(lse_a - m) + exp(lse_b - m)), m the larger,
# lse = m + log(...); a part with lse -inf (no keys) contributes nothing. The attention push constants, rows
# (query, head pairs) in num_seqs: outs [rows, head_size] in a query type, lses float32 [rows]. One thread per
# quad of head dims, workgroups ceil(rows * head_size / 4 / 128), numbered linearly over a folded grid.
MERGE_STATES = KernelABI(
    op="merge_states",
    bindings=(
        Binding("out_a", readonly=True),
        Binding("lse_a", readonly=True),
        Binding("out_b", readonly=True),
        Binding("lse_b", readonly=True),
        Binding("out", readonly=False),
        Binding("lse", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    q_types=QUERY_TYPES,
)

# The device's read bandwidth (benchmarks' ceiling). Grid: (workgroups, 1, 1), grid-stride loop.
READ_BANDWIDTH = KernelABI(
    op="read_bandwidth",
    bindings=(Binding("src", readonly=True), Binding("dst", readonly=False)),
    push=(PushField("num_chunks", "u32"),),
    workgroup_size=(256, 1, 1),
    backends=("glsl",),
)

# What the prefill kernels (forward, dq) bind first: a ragged batch, as vLLM's query_start_loc and
# FlashInfer's qo_indptr take it.
#   query_start_loc  int32 [num_seqs + 1]: sequence s owns query tokens query_start_loc[s] ..
#                    query_start_loc[s + 1] - 1 (q_len_s of them, 0 allowed), the LAST q_len_s positions of
#                    its context of seq_lens[s] tokens (the new tokens included), so its query i sits at
#                    position seq_lens[s] - q_len_s + i and, causal, sees keys 0 .. that position.
#   tiles            int32 [num_tiles, 2]: the launch's work, built on the host (pagedvk.ops.prefill.work_tiles):
#                    (sequence, first row) of each tile of a kernel's rows per tile (dq: 8; the forward: 8 to
#                    64, a function of the sequence's row count and the head size that the kernel computes
#                    again from those, so the table stays two numbers a tile). A sequence's rows are its
#                    (query, head) pairs for the heads sharing one kv head, query-major: row r is query
#                    r / group, head kv_head * group + r % group (group = num_heads / num_kv_heads). A tile
#                    holds rows of one sequence only; a sequence without queries has no tile (costs nothing).
# Query row (query i of the sequence starting at token q_start, head h) starts at element
#   (q_start * num_heads + i * q_token_stride + h * q_head_stride) * head_size
# of query, out, dout and dq; lse's row index is the same without the head_size factor. Ragged
# [num_tokens, num_heads, head_size]: q_token_stride = num_heads, q_head_stride = 1; the fixed-q_len form
# [num_seqs, num_heads, q_len, head_size] (query_start_loc = q_len * arange): 1 and q_len.
# Workgroups: num_tiles x num_kv_heads, kv heads fastest, numbered linearly over a folded grid.
PREFILL_INPUTS = ATTENTION_INPUTS + (
    Binding("query_start_loc", readonly=True),
    Binding("tiles", readonly=True),
)

# Prefill forward: out (the query's type) and the log-sum-exp (float32, natural log). Tiles of 8 to 64 rows for the
# scalar modules, by the sequence's rows and the head size (pagedvk.ops.prefill.forward_rows); 64 for the
# cooperative-matrix ones (pagedvk.ops.prefill: each builds its own tiles).
PAGED_PREFILL = KernelABI(
    op="paged_prefill",
    bindings=PREFILL_INPUTS + (
        Binding("out", readonly=False),
        Binding("lse", readonly=False),
        *ATTENTION_VARIANT_INPUTS,
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    kv_types=STORAGE_TYPES,
    q_types=QUERY_TYPES,
    matrix_variants=tuple(("coopmat", t, t, h) for t in ("f16", "bf16") for h in (64, 128)),
    matrix_backends=BACKENDS,   # WGSL: float16 (KernelABI.matrix_variants_for)
    spec_constants=((PREFILL_HEAD_SIZE_SPEC_ID, "uint32"),),
)

# Workgroup memory of the WGSL scalar forward (shaders/paged_prefill.wgsl's S_MEM vec4s): above the 16 KiB every
# Vulkan device offers (lavapipe offers 32 KiB, NVIDIA 48), for chunk buffers that alternate and values staged a whole
# key tile at a time; pagedvk.ops.prefill refuses the WGSL forward on a device offering less.
PREFILL_WGSL_SHARED_BYTES = 1856 * 16

# Backward, first: D = rowsum(dout * out) of every query row (FlashAttention-2's _bwd_preprocess), float32 in
# lse's shape and order ([num_tokens, num_heads] or [num_seqs, num_heads, q_len]; a row's index is its first
# element's in dout and out divided by head_size), into a scratch buffer the backward owns: dq and dk/dv read it
# in place of `out`, so that no dk/dv workgroup re-reads every row's out (issue 12's shape: 16-key workgroups each
# summed every row's D, ~0.32 ms of 2.5 ms on the H200). The rows are the first query_start_loc[num_seqs] *
# num_heads (bounded by the buffers' lengths); four consecutive rows a thread, summed as the scalar dq sums dP
# (so that dP - D is exactly 0 where a query sees one key: out == v there). Workgroups: ceil(rows / 512),
# numbered linearly over a folded grid.
PAGED_BACKWARD_DELTA = KernelABI(
    op="paged_backward_delta",
    bindings=(
        Binding("query_start_loc", readonly=True),
        Binding("dout", readonly=True),
        Binding("out", readonly=True),
        Binding("delta", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    q_types=QUERY_TYPES,
    matrix_backends=(),
    spec_constants=PAGED_PREFILL.spec_constants,
)
DELTA_ROWS_PER_THREAD = 4

# Backward, dq (float32, the query's layout). Workgroups and tiles as the forward's: forward_rows for the scalar
# modules, 64 rows for the cooperative-matrix ones (built as the forward's are). delta: PAGED_BACKWARD_DELTA's.
PAGED_BACKWARD_DQ = KernelABI(
    op="paged_backward_dq",
    bindings=PREFILL_INPUTS + (
        Binding("dout", readonly=True),
        Binding("delta", readonly=True),
        Binding("lse", readonly=True),
        Binding("dq", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    kv_types=GRADIENT_CACHE_TYPES,
    q_types=QUERY_TYPES,
    matrix_variants=PAGED_PREFILL.matrix_variants,
    spec_constants=PAGED_PREFILL.spec_constants,
)

# Backward, dk and dv (float32) in cache layout: one workgroup per (physical block, kv head, 16 tokens of the
# block, or all 8 of an 8-token block) loops over the (sequence, block-table slot) pairs that read the block, listed in block_readers
# (int32: num_blocks + 1 offsets, then sequence * max_blocks_per_seq + slot for each pair), so blocks shared
# by several sequences sum their gradients in a fixed order, without atomics. Queries and dout are ragged as in
# PREFILL_INPUTS (query_start_loc, q_token_stride, q_head_stride); delta (PAGED_BACKWARD_DELTA's) and lse index rows
# as lse does.
# Grid: (min(num_blocks, 65535), num_kv_heads, block_size / min(block_size, 16)), grid-stride over blocks, for
# the scalar and the cooperative-matrix modules alike (built as the forward's are).
PAGED_BACKWARD_DKDV = KernelABI(
    op="paged_backward_dkdv",
    bindings=(
        Binding("query", readonly=True),
        Binding("key_cache", readonly=True),
        Binding("value_cache", readonly=True),
        Binding("block_readers", readonly=True),
        Binding("seq_lens", readonly=True),
        Binding("query_start_loc", readonly=True),
        Binding("dout", readonly=True),
        Binding("delta", readonly=True),
        Binding("lse", readonly=True),
        Binding("dk_cache", readonly=False),
        Binding("dv_cache", readonly=False),
    ),
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    kv_types=GRADIENT_CACHE_TYPES,
    q_types=QUERY_TYPES,
    matrix_variants=PAGED_PREFILL.matrix_variants,
    spec_constants=PAGED_PREFILL.spec_constants,
)

# Writes new tokens' keys and values into the caches (vLLM's reshape_and_cache): one thread per (token,
# kv head, head dim) writes that key element and that value element, converted to the cache's type (fp8
# divided by k_scale / v_scale first). Elements narrower than 32 bits share words with other threads'
# (vLLM's value layout puts consecutive tokens side by side), so they are written with atomicAnd and
# atomicOr on the word, which no two threads can then undo. Cache element strides, in elements:
#   key (b, h, t, d):   b*k_block_stride + h*k_head_stride + t*k_token_stride + (d / x)*k_chunk_stride + d % x
#   value (b, h, t, d): b*v_block_stride + h*v_head_stride + t*v_token_stride + d*v_dim_stride
# key and value are [num_tokens, num_kv_heads, head_size] in the q_types; slot_mapping is int32
# (slot_words 1) or int64 (slot_words 2, read as two words); slots < 0 or >= num_blocks * block_size are
# skipped. Workgroups: ceil(num_tokens * num_kv_heads * head_size / 128), numbered linearly over a folded grid.
RESHAPE_AND_CACHE = KernelABI(
    op="reshape_and_cache",
    bindings=(
        Binding("key", readonly=True),
        Binding("value", readonly=True),
        Binding("slot_mapping", readonly=True),
        Binding("key_cache", readonly=False),
        Binding("value_cache", readonly=False),
    ),
    push=tuple(PushField(name, kind) for name, kind in (
        ("num_tokens", "u32"),
        ("num_kv_heads", "u32"),
        ("head_size", "u32"),
        ("block_size", "u32"),
        ("num_blocks", "u32"),          # whole blocks the bound caches hold
        ("slot_words", "u32"),
        ("k_scale", "f32"),
        ("v_scale", "f32"),
        ("k_block_stride", "u32"),
        ("k_head_stride", "u32"),
        ("k_token_stride", "u32"),
        ("k_chunk_stride", "u32"),
        ("v_block_stride", "u32"),
        ("v_head_stride", "u32"),
        ("v_token_stride", "u32"),
        ("v_dim_stride", "u32"),
        ("blocks_per_segment", "u32"),
        ("token_type", "u32"),          # storage of key and value: QUERY_TYPES.index(tag)
    )),
    workgroup_size=(128, 1, 1),
    kv_types=STORAGE_TYPES,
    q_types=QUERY_TYPES,
    writes_cache=True,
)

KERNELS = (PAGED_DECODE, PAGED_DECODE_REDUCE, MERGE_STATES, READ_BANDWIDTH, PAGED_PREFILL, PAGED_BACKWARD_DELTA,
           PAGED_BACKWARD_DQ, PAGED_BACKWARD_DKDV, RESHAPE_AND_CACHE)


WGSL_INCLUDE = "//!include "   # WGSL has no includes: build_shaders.py pastes the named file at such a line


def wgsl_includes(source: Path, key: VariantKey | None = None) -> list:
    """The files a WGSL source includes, with the key's storage files standing in for the generic names
    (one level: included files include nothing)."""
    swap = key.includes() if key is not None else {}
    names = [line[len(WGSL_INCLUDE):].strip() for line in source.read_text().splitlines()
             if line.startswith(WGSL_INCLUDE)]
    return [source.parent / swap.get(name, name) for name in names]


def source_files(shader_dir: Path, key: VariantKey, includes: list | None = None) -> list:
    """The files a module is built from: its op's source, then the files it includes. `includes`: their paths
    relative to shader_dir, as build_shaders.py records them in the manifest (GLSL: glslang's dependency
    output; WGSL: wgsl_includes). Without it: for WGSL the files the source names, and for GLSL, where only
    glslang can tell, every include file (what manifests without an include list were built against)."""
    source = shader_dir / key.source
    if includes is not None:
        return [source] + [shader_dir / name for name in includes]
    if key.backend == "glsl":
        return [source] + sorted(shader_dir.glob("*" + GLSL_INCLUDE_SUFFIX))
    return [source] + wgsl_includes(source, key)


def source_digest(shader_dir: Path, key: VariantKey, includes: list | None = None) -> str:
    """Identifies what a module was built from: its source and the includes it uses (see source_files), and
    what the key sets (defines, WGSL includes and constants, SPIR-V environment). The build skips a module
    whose digest is unchanged; the loader refuses one whose digest no longer matches its sources (stale). A
    file that is gone raises OSError."""
    h = hashlib.sha256()
    for path in source_files(shader_dir, key, includes):
        name = path.relative_to(shader_dir).as_posix() if path.is_relative_to(shader_dir) else path.name
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((sorted(key.defines().items()), sorted(key.includes().items()), sorted(key.constants().items()),
                   key.target_env)).encode())
    return h.hexdigest()
