"""How a kernel's interface and its module variants are declared: the mechanism, not the kernels.

A kernel's interface to the GPU is data, a ``KernelABI``: its descriptor bindings in order, its push-constant
block, its workgroup size, its specialization constants, and the axes its modules vary along (cache storage type,
cache access, kernels for a kind of device or matrix unit), drawn from the vocabulary below. The kernels are
declared in pagedvk/kernels/catalogue.py. The query type is not an axis: kernels read it from the push constants
(``q_type``), except the cooperative-matrix modules, which are built for one. A module is named by a
``VariantKey``, built by ``KernelABI.key`` and nowhere else; ``KernelABI.keys`` lists every module of a kernel as
products of its axes (``Axes``), each with the combinations it leaves out and why. The launcher reads the
declarations to build pipeline layouts and pack push constants; ``build_shaders.py`` reads them (by file path, so
this module and the catalogue must stay stdlib-only) to know what to compile; a test reflects every compiled module
and compares it with what is declared.

Where a new thing goes (docs/ARCHITECTURE.md says more):
- a cache storage type: its tag in STORAGE_TYPES, its load function in shaders/kv_storage.glsl and a
  shaders/kv_<tag>.wgsl, its store function (reshape_and_cache) in shaders/kv_encode.glsl and a
  shaders/kv_write_<tag>.wgsl, and its numpy dtype in pagedvk/dtypes.py;
- a head size: nothing (GLSL specializes the head size; WGSL fixes the decode's fixed_head_sizes at translation);
- a kernel: its KernelABI in the catalogue, one .comp and one .wgsl source, its op module in pagedvk/ops/;
- a cooperative-matrix module of an op: an entry in its KernelABI's matrix_variants and a
  shaders/<op>_<kind>.comp with the op's bindings and push constants (and, with "wgsl" in its matrix_backends,
  a shaders/<op>_<kind>.wgsl);
- a kernel shaped for a kind of device (decode on CPUs): a tag in its KernelABI's targets and a
  shaders/<op>_<target>.comp with the op's bindings, push constants and specialization constants.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import struct
from dataclasses import dataclass, field
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


# How kernels reach a cache larger than one binding (pagedvk.runtime.array.DeviceArray splits it into segments of whole
# blocks): "seg" binds up to KV_SEGMENTS segments per cache, "bda" (GLSL only) reads them through buffer device
# addresses, any number of them. "" is the one-binding cache.
CACHE_ACCESS = ("", "seg", "bda")
KV_SEGMENTS = 4
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
# WGSL modules with the head size (a kernel's fixed_head_sizes), the layout and the head-group width fixed at
# translation, for the decode (naga emits no specialization constants; VariantKey.fixed names the last two), and the
# query type fixed too: each cache type's usual one (DecodePlan's default query dtype; vLLM's fp8 caches
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
    # bound as a storage texel buffer of 16-byte texels (VK_FORMAT_R32G32B32A32_UINT; GLSL `layout(rgba32ui)
    # uimageBuffer`) instead of a storage buffer: llvmpipe loads such a texel with vector instructions, where it loads
    # a storage buffer's 16 bytes as four 32-bit loads, lane by lane (shaders/linear_gemv_cpu.comp's weights)
    texels: bool = False


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
    reduce: str = ""      # "" or "shared": workgroup reductions without subgroup arithmetic (KernelABI.subgroup_reduce)
    fixed: str = ""       # WGSL decode: "" or a DECODE_FIXED name, the layout and head-group width fixed
    target: str = ""      # "" or a TARGETS tag: the op's source shaped for that kind of device
    # The declaration that made the key (KernelABI.key and keys set it), for what its WGSL sources include; not part
    # of the name, so keys compare and hash by their axes alone. None: a key made by hand (tests, probes).
    kernel: KernelABI | None = field(default=None, compare=False, repr=False)

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
        """WGSL: which storage file stands in for each generic `//!include` name (what the key's kernel reads and
        writes: KernelABI.reads_chunks, subgroup_reduce, writes_cache)."""
        kernel = self.kernel or KernelABI(self.op, (), (), ())
        inc = {"kv_storage.wgsl": f"kv_{self.kv}.wgsl",
               "kv_access.wgsl": "kv_segmented.wgsl" if self.access else "kv_bound.wgsl"} if self.kv else {}
        if (kernel.reads_chunks or self.matrix and self.backend == "wgsl") and self.kv:
            inc["kv_chunk_access.wgsl"] = "kv_chunk_segmented.wgsl" if self.access else "kv_chunk_bound.wgsl"
        # a fixed decode module's query type is q_any.wgsl's, fixed by constants()
        inc["q_storage.wgsl"] = f"q_{self.q}.wgsl" if self.q and not self.fixed else "q_any.wgsl"
        if kernel.subgroup_reduce:
            inc["decode_reduce.wgsl"] = f"decode_reduce_{self.reduce or 'subgroup'}.wgsl"
        if kernel.writes_cache:   # the cache writers' own files
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
    # the caches' bindings (segments included) are written, not read; its WGSL sources include the write-side storage
    # files (kv_write_<type>.wgsl, token_<type>.wgsl)
    writes_cache: bool = False
    # it reads its caches as 16-byte chunks (WGSL: kv_chunk_access.wgsl; GLSL: KV_CHUNKS in kv_storage.glsl), as the
    # WGSL matrix modules of every op do
    reads_chunks: bool = False
    # its modules reduce over the workgroup with subgroup arithmetic (GLSL: GL_KHR_shader_subgroup_arithmetic; WGSL:
    # naga's subgroup built-ins, through shaders/decode_reduce_subgroup.wgsl), which Vulkan leaves optional; it then
    # also has modules reducing in shared memory only, reduce="shared" (GLSL: SHARED_REDUCE; WGSL:
    # decode_reduce_shared.wgsl), for devices without it: every cache storage and access (KernelABI.key picks them)
    subgroup_reduce: bool = False
    # (matrix kind, cache tag, query tag, head size): cooperative-matrix modules, GLSL, head size fixed, one per
    # cache access in matrix_accesses; each has the op's bindings and push constants (its grid may differ: the op
    # says)
    matrix_variants: tuple = ()
    matrix_accesses: tuple = CACHE_ACCESS
    matrix_workgroup_size: tuple | None = None   # the matrix modules' where it differs from workgroup_size
    # the backends with matrix modules (shaders/<op>_coopmat.comp, .wgsl): WGSL's are built for the
    # matrix_variants whose cache and query types are in wgsl_matrix_types (matrix_variants_for) and the cache
    # accesses WGSL has
    matrix_backends: tuple = ("glsl",)
    wgsl_matrix_types: tuple = WGSL_MATRIX_TYPES
    # The kernel's specialization-constant ids (an enum.IntEnum; its GLSL sources' constant_ids), or None. Two members
    # have a meaning here: VARIANTS, the bool that a launch without attention variants sets false (every GLSL module
    # of the kernel declares it, matrix ones too: attention_common.glsl), and Q_TYPE, the query storage type (every
    # GLSL module but the matrix ones, which are built for one).
    spec_ids: type | None = None
    # ((constant_id, SPIR-V type), ...): the op's own specialization constants, in its GLSL modules only (not its
    # matrix modules, whose head size is fixed at build time, unless it lists them in matrix_spec_constants)
    spec_constants: tuple = ()
    matrix_spec_constants: tuple = ()
    target_spec_constants: tuple = ()   # ((TARGETS tag, its source's), ...) where they differ
    target_bindings: tuple = ()         # ((TARGETS tag, its source's bindings), ...) where they differ in kind
    # head sizes whose WGSL modules are also built with the layout and group width fixed (DECODE_FIXED)
    fixed_head_sizes: tuple = ()
    # TARGETS tags of the op's device-shaped GLSL sources, built as its generic modules are (storage, head sizes,
    # accesses), not reducing in shared memory
    targets: tuple = ()

    def workgroup_size_of(self, key: VariantKey) -> tuple:
        """The module's local size: matrix_workgroup_size for a matrix module where set, else workgroup_size."""
        return self.matrix_workgroup_size if key.matrix and self.matrix_workgroup_size else self.workgroup_size

    def spec_id(self, name: str) -> enum.IntEnum | None:
        """spec_ids' member `name` (VARIANTS, Q_TYPE), None where the kernel has no such constant."""
        return self.spec_ids.__members__.get(name) if self.spec_ids is not None else None

    def specialization_constants(self, key: VariantKey) -> dict:
        """{constant_id: type} that the module declares: VARIANTS where it specializes the variants, the query
        type's Q_TYPE in the modules that read it, and the op's own in GLSL (naga emits none)."""
        if key.backend != "glsl":
            return {}
        own = dict(self.matrix_spec_constants if key.matrix else
                   dict(self.target_spec_constants).get(key.target, self.spec_constants))
        q_type = self.spec_id("Q_TYPE")
        query = {q_type: "uint32"} if q_type is not None and not key.matrix else {}
        return {**({self.spec_id("VARIANTS"): "bool"} if self.specializes_variants(key) else {}), **own, **query}

    def specializes_variants(self, key: VariantKey) -> bool:
        """Whether the module declares spec_ids.VARIANTS: the GLSL modules of the attention kernels, which
        include attention_common.glsl."""
        return key.backend == "glsl" and self.spec_id("VARIANTS") is not None

    def q_type_constant(self, tag: str) -> dict:
        """The specialization that fixes the query storage type in the kernel's GLSL pipeline (spec_ids.Q_TYPE;
        its value is the code plus one, 0 reading the push constant)."""
        return {self.spec_id("Q_TYPE"): q_type_code(tag) + 1}

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
        segments 1 .. KV_SEGMENTS - 1 of each cache (segment 0 is key_cache / value_cache); a target's own where
        target_bindings gives them."""
        if key.target and key.target in dict(self.target_bindings):
            return dict(self.target_bindings)[key.target]
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
        op with subgroup_reduce. fixed (a DECODE_FIXED name): the WGSL module with the layout and head-group
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
            return VariantKey(self.op, backend, kv, q, head_size, access, matrix, kernel=self)
        if backend not in self.backends:
            raise ValueError(f"{self.op} has no {backend} modules (backends: {', '.join(self.backends)})")
        if access not in self.accesses(backend):
            raise ValueError(f"{self.op} has no {backend} module reading caches by {access!r} "
                             f"(built: {', '.join(map(repr, self.accesses(backend)))})")
        for axis, value, allowed in (("cache storage", kv, self.kv_types), ("query storage", q, self.q_types)):
            if (value or allowed) and value not in allowed:
                raise ValueError(f"{self.op} has no module for {axis} {value!r} (built: {', '.join(allowed)})")
        if target and backend == "glsl":
            return VariantKey(self.op, backend, kv, access=access, target=target, kernel=self)
        if not subgroup_arithmetic and self.subgroup_reduce:
            return VariantKey(self.op, backend, kv, access=access, reduce="shared", kernel=self)
        if (backend == "wgsl" and fixed and not access and head_size in self.fixed_head_sizes
                and q == FIXED_QUERY.get(kv)):
            return VariantKey(self.op, backend, kv, q, head_size, fixed=fixed, kernel=self)
        return VariantKey(self.op, backend, kv, access=access, kernel=self)

    def matrix_variants_for(self, backend: str) -> tuple:
        """The matrix_variants built for a backend (the matrix modules' Axes less its exclusions): all of them
        for GLSL, those of wgsl_matrix_types for WGSL, none for a backend not in matrix_backends."""
        return tuple(dict.fromkeys((p["matrix"], p["kv"], p["q"], p["head_size"])
                                   for p in self.matrix_axes().combinations() if p["backend"] == backend))

    def matrix_accesses_for(self, backend: str) -> tuple:
        return tuple(dict.fromkeys(p["access"] for p in self.matrix_axes().combinations() if p["backend"] == backend))

    def accesses(self, backend: str) -> tuple:
        """How the backend's generic modules read caches: every CACHE_ACCESS less BACKEND_EXCLUSIONS'."""
        if not self.kv_types:
            return ("",)
        return tuple(a for a in CACHE_ACCESS if not excluded({"backend": backend, "access": a}, BACKEND_EXCLUSIONS))

    def module_axes(self) -> tuple:
        """The kernel's modules as products of axes (Axes), each less the combinations it excludes: the generic
        modules, then the ones its declaration adds (shared-memory reduce, device-shaped targets, WGSL's fixed
        decode modules, matrix modules)."""
        kv = {"kv": self.kv_types or ("",), "access": CACHE_ACCESS if self.kv_types else ("",)}
        families = [Axes("the generic modules", {"backend": self.backends, **kv}, BACKEND_EXCLUSIONS)]
        if self.subgroup_reduce:
            families.append(Axes("reducing in shared memory, for devices without subgroup arithmetic",
                                 {"backend": self.backends, **kv, "reduce": ("shared",)}, BACKEND_EXCLUSIONS))
        if self.targets:
            families.append(Axes("shaped for a kind of device",
                                 {"backend": self.backends, **kv, "target": self.targets},
                                 BACKEND_EXCLUSIONS + (("the device-shaped sources are GLSL", {"backend": "wgsl"}),)))
        if self.fixed_head_sizes:
            families.append(Axes(
                "the layout and head-group width fixed at translation (naga emits no specialization constants)",
                {"backend": self.backends, ("kv", "q"): tuple((kv, FIXED_QUERY[kv]) for kv in self.kv_types),
                 "head_size": self.fixed_head_sizes, "fixed": tuple(DECODE_FIXED)},
                (("GLSL specializes the head size, layout and group width", {"backend": "glsl"}),)))
        if self.matrix_variants:
            families.append(self.matrix_axes())
        return tuple(families)

    def matrix_axes(self) -> Axes:
        """The cooperative-matrix modules: matrix_backends x matrix_variants x matrix_accesses, less the types
        WGSL's matrices cannot take and the accesses a backend lacks."""
        wgsl_types = tuple(t for t in STORAGE_TYPES if t not in self.wgsl_matrix_types)
        return Axes("cooperative-matrix modules",
                    {"backend": self.matrix_backends, ("matrix", "kv", "q", "head_size"): self.matrix_variants,
                     "access": self.matrix_accesses},
                    BACKEND_EXCLUSIONS
                    + tuple((f"WGSL matrices take {', '.join(self.wgsl_matrix_types)} only",
                             {"backend": "wgsl", axis: t}) for axis in ("kv", "q") for t in wgsl_types))

    def keys(self):
        """Every module this op needs built: the combinations of its module_axes()."""
        for family in self.module_axes():
            for point in family.combinations():
                yield VariantKey(self.op, kernel=self, **point)


# Combinations no kernel has: (why, {axis: value, ...}), excluding every combination that holds all the values.
BACKEND_EXCLUSIONS = (("WGSL has no buffer device addresses", {"backend": "wgsl", "access": "bda"}),)


def excluded(point: dict, exclusions: tuple) -> bool:
    return any(all(point.get(axis) == value for axis, value in values.items()) for _, values in exclusions)


@dataclass(frozen=True)
class Axes:
    """A family of modules, declared: every combination of the axes' values, less the excluded combinations.
    axes: {VariantKey field: values}; a tuple of fields takes its values jointly (a tuple each). exclusions:
    ((why, {field: value, ...}), ...)."""

    what: str
    axes: dict
    exclusions: tuple = ()

    def combinations(self):
        """Each combination as {VariantKey field: value}, in the axes' order."""
        names = [name if isinstance(name, tuple) else (name,) for name in self.axes]
        pools = [[v if isinstance(name, tuple) else (v,) for v in values] for name, values in self.axes.items()]
        for combination in itertools.product(*pools):
            point = dict(zip(itertools.chain(*names), itertools.chain(*combination)))
            if not excluded(point, self.exclusions):
                yield point


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

