"""Kernel interfaces, declared once.

Every op's interface to the GPU lives here as data: its descriptor bindings in order, its push-constant
block, its specialization constants, its workgroup size and the shader modules (one per backend and
storage variant) that implement it. The launcher reads these declarations to build pipeline layouts and
pack push constants; ``build_shaders.py`` reads them (by file path, so this module must stay stdlib-only)
to know what to compile; a test reflects every compiled module and compares it with what is declared here.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("glsl", "wgsl")
SOURCE_SUFFIX = {"glsl": ".comp", "wgsl": ".wgsl"}
# Files that GLSL sources may #include; a change to any of them makes every GLSL module stale.
GLSL_INCLUDE_SUFFIX = ".glsl"


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
class Variant:
    """One compiled module of an op. `defines` select GLSL code paths (a storage type); `constants` are
    compile-time values both backends take (GLSL as -D defines, WGSL as overrides fixed at translation),
    such as a head size that lets the compiler unroll loops."""

    name: str
    defines: dict = field(default_factory=dict)
    constants: dict = field(default_factory=dict)
    backends: tuple = BACKENDS  # the backends this variant is built for (the op's backends permitting)


@dataclass(frozen=True)
class KernelABI:
    op: str  # shader source base name in shaders/, and module name prefix
    bindings: tuple
    push: tuple
    workgroup_size: tuple
    variants: tuple
    backends: tuple = ("glsl",)
    spec_constants: tuple = ()  # (spec id, name) pairs; none yet

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
        fmt = "<" + "".join(f.format for f in self.push)
        return struct.pack(fmt, *(values[f.name] for f in self.push))

    def module_name(self, variant: str, backend: str) -> str:
        return f"{self.op}.{variant}.{backend}"

    def modules(self):
        """(module name, backend, variant) for every module this op needs built."""
        for backend in self.backends:
            for v in self.variants:
                if backend in v.backends:
                    yield self.module_name(v.name, backend), backend, v

    def has_module(self, variant: str, backend: str) -> bool:
        return any(v.name == variant and backend in v.backends for v in self.variants) and backend in self.backends


# What every attention kernel reading the paged cache binds first, in this order.
ATTENTION_INPUTS = (
    Binding("query", readonly=True),
    Binding("key_cache", readonly=True),
    Binding("value_cache", readonly=True),
    Binding("block_tables", readonly=True),
    Binding("seq_lens", readonly=True),
)

DECODE_HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)  # vLLM's; others run the generic module

# Decode attention, one query token per sequence, vLLM cache layout. Grid: (num_heads / group_size,
# num_seqs, num_partitions). Key and value caches are bound as arrays of 16-byte chunks whatever the
# element type, so the same indexing serves every storage type: a key chunk holds x = 16 / itemsize
# consecutive head dims of one token, a value chunk 16 / itemsize consecutive tokens of one head dim.
# With one partition the result goes to `out`; with more, to the partial buffers, and PAGED_DECODE_REDUCE
# merges them into `out`.
PAGED_DECODE = KernelABI(
    op="paged_decode",
    bindings=ATTENTION_INPUTS + (
        Binding("out", readonly=False),
        Binding("partial_out", readonly=False),
        Binding("partial_stats", readonly=False),
    ),
    push=(
        PushField("num_heads", "u32"),
        PushField("num_kv_heads", "u32"),
        PushField("head_size", "u32"),
        PushField("block_size", "u32"),
        PushField("max_blocks_per_seq", "u32"),
        PushField("num_blocks", "u32"),
        PushField("scale", "f32"),
        PushField("group_size", "u32"),
        PushField("partition_size", "u32"),
        PushField("num_partitions", "u32"),
    ),
    workgroup_size=(128, 1, 1),
    # Per storage type: one module for any head size, and for GLSL one per common head size with HEAD_SIZE
    # fixed at compile time (its loops unroll: about 1.4x faster on the H200). Not for WGSL: lavapipe
    # takes up to a minute to compile naga's output with the loops unrolled (HEAD_SIZE 256).
    variants=tuple(v for storage, define in (("f32", "KV_F32"),)
                   for v in [Variant(storage, {define: 1})] + [
                       Variant(f"{storage}_h{hs}", {define: 1}, {"HEAD_SIZE": hs}, backends=("glsl",))
                       for hs in DECODE_HEAD_SIZES]),
    backends=("glsl", "wgsl"),
)

# Merges a split decode's partitions. Grid: (num_heads, num_seqs, 1).
PAGED_DECODE_REDUCE = KernelABI(
    op="paged_decode_reduce",
    bindings=(
        Binding("seq_lens", readonly=True),
        Binding("partial_out", readonly=True),
        Binding("partial_stats", readonly=True),
        Binding("out", readonly=False),
    ),
    push=(
        PushField("num_heads", "u32"),
        PushField("head_size", "u32"),
        PushField("partition_size", "u32"),
        PushField("num_partitions", "u32"),
    ),
    workgroup_size=(128, 1, 1),
    variants=(Variant("f32"),),
    backends=("glsl", "wgsl"),
)

# The device's read bandwidth (benchmarks' ceiling). Grid: (workgroups, 1, 1), grid-stride loop.
READ_BANDWIDTH = KernelABI(
    op="read_bandwidth",
    bindings=(Binding("src", readonly=True), Binding("dst", readonly=False)),
    push=(PushField("num_chunks", "u32"),),
    workgroup_size=(256, 1, 1),
    variants=(Variant("u32"),),
)

# Prefill attention and its backward (pagedvk/prefill.py). The three kernels share one push block: the
# shapes, the causal flag, the scale and the caches' strides in floats, which is how one module reads both
# cache layouts ("nhd" [num_blocks, block_size, num_kv_heads, head_size] and vLLM's decode layout).
PREFILL_PUSH = (
    PushField("num_heads", "u32"),
    PushField("num_kv_heads", "u32"),
    PushField("head_size", "u32"),
    PushField("block_size", "u32"),
    PushField("max_blocks_per_seq", "u32"),
    PushField("num_blocks", "u32"),
    PushField("q_len", "u32"),
    PushField("causal", "u32"),
    PushField("scale", "f32"),
    PushField("k_block_stride", "u32"),
    PushField("k_head_stride", "u32"),
    PushField("k_token_stride", "u32"),
    PushField("k_chunk_stride", "u32"),   # between chunks of 4 consecutive head dims of one token
    PushField("v_block_stride", "u32"),
    PushField("v_head_stride", "u32"),
    PushField("v_token_stride", "u32"),
    PushField("v_dim_stride", "u32"),
)

# Forward: out and the log-sum-exp. Grid: (ceil(num_heads / num_kv_heads * q_len / 8), num_kv_heads, num_seqs).
PAGED_PREFILL = KernelABI(
    op="paged_prefill",
    bindings=ATTENTION_INPUTS + (
        Binding("out", readonly=False),
        Binding("lse", readonly=False),
    ),
    push=PREFILL_PUSH,
    workgroup_size=(128, 1, 1),
    variants=(Variant("f32"),),
    backends=("glsl", "wgsl"),
)

# Backward, dq. Grid: (ceil(num_heads / num_kv_heads * q_len / 8), num_kv_heads, num_seqs).
PAGED_BACKWARD_DQ = KernelABI(
    op="paged_backward_dq",
    bindings=ATTENTION_INPUTS + (
        Binding("dout", readonly=True),
        Binding("out", readonly=True),
        Binding("lse", readonly=True),
        Binding("dq", readonly=False),
    ),
    push=PREFILL_PUSH,
    workgroup_size=(128, 1, 1),
    variants=(Variant("f32"),),
    backends=("glsl", "wgsl"),
)

# Backward, dk and dv in cache layout: one workgroup per (physical block, kv head, 8 tokens of the block)
# loops over the (sequence, block-table slot) pairs that read the block, listed in block_readers (int32:
# num_blocks + 1 offsets, then sequence * max_blocks_per_seq + slot for each pair), so blocks shared by
# several sequences sum their gradients in a fixed order, without atomics.
# Grid: (min(num_blocks, 65535), num_kv_heads, block_size / 8), grid-stride over blocks.
PAGED_BACKWARD_DKDV = KernelABI(
    op="paged_backward_dkdv",
    bindings=(
        Binding("query", readonly=True),
        Binding("key_cache", readonly=True),
        Binding("value_cache", readonly=True),
        Binding("block_readers", readonly=True),
        Binding("seq_lens", readonly=True),
        Binding("dout", readonly=True),
        Binding("out", readonly=True),
        Binding("lse", readonly=True),
        Binding("dk_cache", readonly=False),
        Binding("dv_cache", readonly=False),
    ),
    push=PREFILL_PUSH,
    workgroup_size=(128, 1, 1),
    variants=(Variant("f32"),),
    backends=("glsl", "wgsl"),
)

KERNELS = (PAGED_DECODE, PAGED_DECODE_REDUCE, READ_BANDWIDTH, PAGED_PREFILL, PAGED_BACKWARD_DQ,
           PAGED_BACKWARD_DKDV)


def source_name(abi: KernelABI, backend: str, variant: Variant | None = None) -> str:
    """The source file of one module. GLSL: one source per op, the variant chosen by its defines. WGSL has
    no preprocessor, so the defines are not used: variants with the first variant's defines (differing
    only in constants) are built from {op}.wgsl, any other variant from its own {op}.{variant}.wgsl."""
    if backend == "wgsl" and variant is not None and variant.defines != abi.variants[0].defines:
        return f"{abi.op}.{variant.name}{SOURCE_SUFFIX[backend]}"
    return abi.op + SOURCE_SUFFIX[backend]


WGSL_INCLUDE = "//!include "   # WGSL has no includes: build_shaders.py pastes the named file at such a line


def wgsl_includes(source: Path) -> list:
    """The files a WGSL source includes (one level: included files include nothing)."""
    return [source.parent / line[len(WGSL_INCLUDE):].strip()
            for line in source.read_text().splitlines() if line.startswith(WGSL_INCLUDE)]


def source_files(shader_dir: Path, abi: KernelABI, backend: str, variant: Variant | None = None) -> list:
    """The files a module is built from: its source, and its include files (for GLSL, every one)."""
    files = [shader_dir / source_name(abi, backend, variant)]
    if backend == "glsl":
        files += sorted(shader_dir.glob("*" + GLSL_INCLUDE_SUFFIX))
    else:
        files += wgsl_includes(files[0])
    return files


def source_digest(shader_dir: Path, abi: KernelABI, backend: str, variant: Variant) -> str:
    """Identifies what a module was built from, so a module built from older sources is detected."""
    h = hashlib.sha256()
    for path in source_files(shader_dir, abi, backend, variant):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr(sorted(variant.defines.items())).encode() + repr(sorted(variant.constants.items())).encode())
    return h.hexdigest()
