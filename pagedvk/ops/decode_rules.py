"""The decode's rules: which kernel, module, specialization and split a decode runs on a device, as pure functions
of the device and the problem's dims. ``decode_choice`` returns them as one frozen ``DecodeChoice``;
``DecodePlan`` (pagedvk/ops/decode_plan.py) runs it, and ``pagedvk devices``, the tests and the benchmarks ask it
what would run without building a plan. Every threshold here was measured (BENCHMARKS.md, docs/decisions.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .. import config
from ..dtypes import CACHE_TYPES
from ..kernels.abi import DECODE_FIXED, VariantKey
from ..kernels.catalogue import (DECODE_MERGE_PARTITIONS, PAGED_DECODE, PAGED_DECODE_REDUCE, DecodeSpec,
                                 head_size_constant)
from ..kernels.matrix import MATRIX_KIND, matrix_unavailable, offers, operand_type, with_operands
from ..runtime.instance import MatrixShape
from . import checks
from .layouts import LAYOUTS, MAX_HEAD_SIZE, check_block_size
from .opargs import check_scale

MAX_PARTITION_SIZE = 2**31 - 1              # tokens: partition_size travels as a u32 push constant
MAX_GROUP = 8                                # query heads per workgroup (MAX_GROUP in the kernel)
TILE = 128                                   # tokens the kernel takes at a time (TILE in the kernel)
# The fewest tokens a workgroup must take (its partition's, or the whole context's) for plans to run the
# cooperative-matrix decode: its subgroups walk a context 16 tokens a step each, a longer chain per token than the
# scalar kernel's 128-token tiles. On the H200, with the split of matrix_partitioning: even at 128-256-token
# partitions (1 x 4096: 20.0 against 19.9 us), faster from 512 on (8 x 4096: 54.0 against 61.7 us; BENCHMARKS.md).
MATRIX_MIN_TOKENS = 512
# Matrix-decode workgroups a compute unit takes, for its split to aim at: measured, not derived. On the H200 (158
# registers a thread: three of its workgroups fit a unit) one wave of two a unit was best: 8 x 32768 91.1% of read
# with 256 workgroups, 89.6% with 512, 87.1% with 1024, and 74.8% with 384 (BENCHMARKS.md).
MATRIX_WORKGROUPS_PER_UNIT = 2
# The fewest tokens a matrix-decode workgroup must take (its partition's, or the whole context's) for its float16 and
# bfloat16 subgroups to take two blocks a step (catalogue.DecodeSpec.STEP): on the H200 two were faster from 2048
# (256 x 2048 531.7 -> 518.2 us, 8 x 32768 in 8192-token partitions 262.0 -> 257.6) and slower at 1024 (8 x 4096
# 44.5 -> 46.5 us, 1 x 32768 45.7 -> 47.4; docs/benchmarks-log.md, 2026-12-03 "Two blocks a subgroup step").
MATRIX_STEP2_MIN_TOKENS = 2048
MATRIX_BLOCK_SIZE = 16                       # the block size paged_decode_coopmat reads
# Workgroup memory the matrix decode modules declare at most (the bfloat16 ones at head size 128, GLSL and WGSL: the
# step's two blocks of S and P^T, the queries, the output sums; the H200's driver reports 47364 bytes): devices that
# offer less (maxComputeSharedMemorySize) run the scalar kernel.
MATRIX_SHARED_BYTES = 47364
MATRIX_PV_SHAPE = MatrixShape(16, 8, 16, "f16", "f16", "f32", "f32", "subgroup")   # its P.V multiply
# The P.V multiply of each operand type's module (PV_N in the kernel): bfloat16's is 16 x 16 (heads 8-15 zero), as
# the H200 lists no 16 x 8 bfloat16 multiply; 16 x 8 holds half the accumulators.
MATRIX_PV_SHAPES = {"f16": MATRIX_PV_SHAPE, "bf16": MatrixShape(16, 16, 16, "bf16", "bf16", "f32", "f32", "subgroup")}
# The WGSL modules' (shaders/paged_decode_coopmat.wgsl): naga's matrices are square, so 16 x 16 with heads 8-15 zero,
# of float16 or (the bfloat16 module) bfloat16 operands.
WGSL_MATRIX_PV_SHAPE = MatrixShape(16, 16, 16, "f16", "f16", "f32", "f32", "subgroup")


def matrix_pv_shape(backend: str, operand: str) -> MatrixShape:
    """The P.V multiply the backend's matrix decode module of this operand type takes."""
    return with_operands(WGSL_MATRIX_PV_SHAPE, operand) if backend == "wgsl" else MATRIX_PV_SHAPES[operand]
WORKGROUPS_PER_UNIT = 8                      # decode workgroups per compute unit the split aims at (BENCHMARKS.md)
UNITS_ESTIMATE = {"discrete": 64, "integrated": 16, "virtual": 16, "other": 16}   # where the driver says nothing


def group_size(num_heads: int, num_kv_heads: int) -> int:
    """Query heads one workgroup serves: the largest divisor of the GQA group that is at most MAX_GROUP."""
    group = num_heads // num_kv_heads
    return max(g for g in range(1, MAX_GROUP + 1) if group % g == 0)


def compute_units(info) -> int:
    """The device's compute units (SMs, CUs, CPU cores for lavapipe): reported where Vulkan exposes them,
    else an estimate by device type."""
    if info.compute_units:
        return info.compute_units
    if info.type == "cpu":
        return os.cpu_count() or 1
    return UNITS_ESTIMATE.get(info.type, 16)


def subgroup_reductions(info) -> bool:
    """Whether the decode kernel may reduce with subgroup arithmetic: the device has it, and subgroups of at least
    4 invocations (its scratch holds WG / 4 subgroups' results); else it runs the shared-memory module."""
    return info.subgroup_arithmetic and info.subgroup_size >= 4


def decode_target(info, backend: str, kernel: str | None = None) -> str:
    """The decode kernel's abi.TARGETS tag: "cpu" (shaders/paged_decode_cpu.comp) on CPU devices, or where
    `kernel` (else PAGEDVK_DECODE_KERNEL) is "cpu"; "" (shaders/paged_decode.comp) otherwise, or "gpu" forced.
    lavapipe reads shared memory lane by lane, and paged_decode.comp's operand reads from it took about 70% of its
    time there (BENCHMARKS.md). The CPU kernel is GLSL only and needs subgroup arithmetic (subgroups of at least 4)
    and shuffle; elsewhere the generic kernel runs, forced or not."""
    choice = config.decode_kernel(kernel)
    wanted = info.type == "cpu" if choice is None else choice == "cpu"
    return "cpu" if wanted and backend == "glsl" and subgroup_reductions(info) and info.subgroup_shuffle else ""


def decode_matrix(info, features, backend: str, kv: str, q: str, head_size: int, layout: str, block_size: int,
                  tokens: int, kernel: str | None = None) -> str:
    """The decode's matrix kind: "coopmat" (shaders/paged_decode_coopmat.comp or .wgsl) where a module exists for
    these arguments (GLSL: float16 or fp8 caches with float16 queries, or bfloat16 caches and queries on devices with
    bfloat16 matrices; WGSL: the same but fp8, with 16-bit storage on; head size 64 or 128; vLLM's layout with 16-token
    blocks), the device runs it (pagedvk.kernels.matrix) and each workgroup takes at least MATRIX_MIN_TOKENS tokens
    (`tokens`: the partition's, or the longest context's where unsplit); else "" (the scalar kernels). `kernel` (else
    PAGEDVK_DECODE_KERNEL) "coopmat" forces it, raising ValueError where it cannot run; "cpu" or "gpu" rule it out."""
    choice = config.decode_kernel(kernel)
    if choice in ("cpu", "gpu"):
        return ""
    built = sorted((k, qq, h) for _, k, qq, h in PAGED_DECODE.matrix_variants_for(backend))
    operand = operand_type(kv, q)
    why = matrix_unavailable(info, features, operand, backend)
    if not why and not info.subgroup_vote:   # the rescale test is a subgroupAny (uniform, as the matrix ops need)
        why = "it has no subgroup vote in compute shaders (VK_SUBGROUP_FEATURE_VOTE_BIT)"
    if not why and info.max_shared_memory < MATRIX_SHARED_BYTES:
        why = (f"it offers {info.max_shared_memory} bytes of workgroup memory (maxComputeSharedMemorySize), and the "
               f"cooperative-matrix decode needs {MATRIX_SHARED_BYTES}")
    pv_shape = matrix_pv_shape(backend, operand)
    if not why and not offers(info, pv_shape):
        why = f"it lists no {pv_shape} cooperative-matrix multiply (its P.V products into the output sums)"
    if not why and ((kv, q, head_size) not in built or layout != "vllm" or block_size != MATRIX_BLOCK_SIZE):
        pairs = "; ".join(f"{'/'.join(sorted({k for k, qq, _ in built if qq == q_}))} caches with {q_} queries"
                          for q_ in sorted({qq for _, qq, _ in built})) or "no module"
        sizes = "/".join(str(h) for h in sorted({h for *_, h in built})) or "none"
        why = (f"the cooperative-matrix decode is built for backend {backend!r} with {pairs}, head sizes {sizes}, "
               f"vLLM's layout and {MATRIX_BLOCK_SIZE}-token blocks, not "
               f"cache {kv}, query {q}, head size {head_size}, layout {layout!r}, block size {block_size}")
    if choice == MATRIX_KIND:
        if why:
            raise ValueError(f"kernel (or PAGEDVK_DECODE_KERNEL) 'coopmat' cannot run on {info.name}: {why}")
        return MATRIX_KIND
    return "" if why or tokens < MATRIX_MIN_TOKENS else MATRIX_KIND


def kernel_constants(layout: str, group: int) -> dict:
    """The GLSL kernel's specialization for a plan (abi.DECODE_*_SPEC_ID): the V stage of the cache layout
    (vLLM's keeps a head dim's tokens contiguous, nhd and hnd a token's dims: the kernel's own test,
    v_dim_stride == 1, holds exactly for them; the rest of the addressing is strides) and the width of the head
    group (at most 4 query heads per kv head, or 5 to 8)."""
    return {DecodeSpec.VALUE_ORDER: 1 if layout == "vllm" else 2, DecodeSpec.GROUP: 4 if group <= 4 else 8}


def fixed_name(constants: dict) -> str:
    """The WGSL modules' name (abi.DECODE_FIXED) for the specialization kernel_constants gives the GLSL kernel."""
    fixed = (constants[DecodeSpec.VALUE_ORDER], constants[DecodeSpec.GROUP])
    return next(name for name, values in DECODE_FIXED.items() if values == fixed)


def partitioning(num_seqs: int, workgroups_per_seq: int, max_seq_len: int, units: int,
                 per_unit: int = WORKGROUPS_PER_UNIT, whole_wave: bool = False) -> tuple:
    """(partition_size, num_partitions): the one rule for splitting contexts (split-K).

    A split costs a second pass and the partial results' traffic, so contexts are split only when the
    unsplit grid (a workgroup per sequence and head group) would leave compute units idle: into as many
    partitions as fill `units` x `per_unit` workgroups (whole_wave: as fit in them, rounded down), each at least
    one TILE of tokens, their size rounded up to whole tiles.
    """
    base = max(1, num_seqs * workgroups_per_seq)
    tiles = max(1, -(-max_seq_len // TILE))
    slots = units * per_unit
    parts = min(tiles, max(1, slots // base if whole_wave else -(-slots // base)))
    size = -(-tiles // parts) * TILE
    return size, max(1, -(-max_seq_len // size))


def matrix_partitioning(num_seqs: int, workgroups_per_seq: int, max_seq_len: int, units: int) -> tuple:
    """The cooperative-matrix decode's split: one wave of its workgroups (MATRIX_WORKGROUPS_PER_UNIT a unit)."""
    return partitioning(num_seqs, workgroups_per_seq, max_seq_len, units, MATRIX_WORKGROUPS_PER_UNIT, True)


def matrix_step(storage: str, tokens: int) -> int:
    """Blocks a matrix-decode subgroup takes a step (catalogue.DecodeSpec.STEP) where a workgroup takes at most
    `tokens` tokens: two for float16 and bfloat16 caches from MATRIX_STEP2_MIN_TOKENS on, else one."""
    return 2 if storage in ("f16", "bf16") and tokens >= MATRIX_STEP2_MIN_TOKENS else 1


def values_with_keys(storage: str, tokens: int) -> bool:
    """Whether the scalar GPU decode loads a tile's values beside its keys (catalogue.DecodeSpec.VALUES) where a
    workgroup takes at most `tokens` tokens of a `storage` cache: for float16 and bfloat16 caches where that is one
    tile, whose chain of round trips is then the workgroup's. On the H200 (docs/benchmarks-log.md, 2026-12-03 "A
    truer ceiling") 1 x 4096 took 16.5 against 17.2 us; fp8, whose tile of values is one batch already, 20.0 against
    17.7 us."""
    return storage in ("f16", "bf16") and tokens <= TILE


def plan_arguments(*, num_heads, num_kv_heads, head_size, block_size, num_blocks, dtype, scale, layout) -> np.dtype:
    """Check a plan's arguments, each error naming its argument; returns the cache dtype."""
    checks.one_of("layout", layout, LAYOUTS)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in CACHE_TYPES:
        raise TypeError(f"dtype must be one of the supported cache dtypes ({', '.join(map(str, CACHE_TYPES))}), "
                        f"got {dtype!r}")
    checks.integer("num_kv_heads", num_kv_heads, 1)
    checks.integer("num_heads", num_heads, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    checks.integer("head_size", head_size, 4, MAX_HEAD_SIZE)
    if head_size % 4:   # the kernels read 4 head dims at a time
        raise ValueError(f"head_size must be a multiple of 4 in [4, {MAX_HEAD_SIZE}], got {head_size}")
    checks.integer("block_size", block_size, 1)
    check_block_size("block_size", block_size, layout, num_kv_heads, head_size, dt.itemsize)
    checks.integer("num_blocks", num_blocks, 0)
    check_scale(scale)
    return dt


@dataclass(frozen=True)
class DecodeChoice:
    """What a decode runs on one device: the kernel, its split and its specialization.

    backend             "glsl" or "wgsl"
    target              abi.TARGETS tag of the scalar kernel: "cpu" or "" (the GPU one)
    matrix              "coopmat" where the cooperative-matrix kernel runs, else ""
    storage, query      the cache's and the query's storage tags ("f16", "e4m3", ...)
    head_size, group_size, subgroup_arithmetic  the module's other axes (group_size: query heads a workgroup serves)
    partition_size, num_partitions  the split of each context (num_partitions 1: unsplit)
    merge_in_decode     whether the decode dispatch merges the split itself (no reduce dispatch)
    constants           the pipeline's specialization, ((spec id, value), ...) sorted
    """

    backend: str
    target: str
    matrix: str
    storage: str
    query: str
    head_size: int
    group_size: int
    subgroup_arithmetic: bool
    partition_size: int
    num_partitions: int
    merge_in_decode: bool
    constants: tuple

    @property
    def split(self) -> bool:
        return self.num_partitions > 1

    @property
    def spec_constants(self) -> dict:
        return dict(self.constants)

    @property
    def kernel(self) -> str:
        """The kernel's name as PAGEDVK_DECODE_KERNEL spells it: "coopmat", "cpu" or "gpu"."""
        return self.matrix or self.target or "gpu"

    def module(self, access: str = "") -> VariantKey:
        """The decode module for a cache access (abi.CACHE_ACCESS): the matrix kernel reads caches by binding only,
        so segmented or addressed caches run the scalar one."""
        if self.matrix and access in PAGED_DECODE.matrix_accesses:
            return PAGED_DECODE.key(self.backend, self.storage, self.query, self.head_size, access, matrix=self.matrix)
        return PAGED_DECODE.key(self.backend, self.storage, self.query, self.head_size, access,
                                subgroup_arithmetic=self.subgroup_arithmetic, fixed=fixed_name(self.spec_constants),
                                target=self.target)

    @property
    def reduce_module(self) -> VariantKey | None:
        """The reduce dispatch's module where the split needs one, else None."""
        if not self.split or self.merge_in_decode:
            return None
        return PAGED_DECODE_REDUCE.key(self.backend, q=self.query)


def decode_choice(info, features, backend: str, *, storage: str, query: str, num_seqs: int, num_heads: int,
                  num_kv_heads: int, head_size: int, layout: str, block_size: int, max_seq_len: int,
                  partition_size: int | None = None, kernel: str | None = None) -> DecodeChoice:
    """The decode a device runs for these dims (`info`, `features`: a Device's). max_seq_len: the most tokens a
    sequence's partitions cover (its context, or its window where shorter). partition_size: the caller's split (a
    multiple of block_size), else each kernel's own rule. kernel (else PAGEDVK_DECODE_KERNEL): "cpu", "gpu" or
    "coopmat" forces a kernel where it can run ("coopmat" raises ValueError where it cannot)."""
    target = decode_target(info, backend, kernel)
    group = group_size(num_heads, num_kv_heads)
    # The head size too: the scalar kernels' loops over head dims unroll on it.
    constants = {**kernel_constants(layout, group), **PAGED_DECODE.q_type_constant(query),
                 **head_size_constant(DecodeSpec.HEAD_SIZE, head_size)}
    workgroups_per_seq = num_heads // group
    if partition_size is None:   # each kernel's own split; the matrix kernel where its partitions are long
        units = compute_units(info)
        splits = [matrix_partitioning(num_seqs, workgroups_per_seq, max_seq_len, units),
                  partitioning(num_seqs, workgroups_per_seq, max_seq_len, units)]
    else:
        # a u32 push constant; a partition longer than any block-table row splits nothing
        checks.integer("partition_size", partition_size, 1, MAX_PARTITION_SIZE)
        if partition_size % block_size:
            raise ValueError(f"partition_size must be a multiple of block_size ({block_size}), got {partition_size}")
        splits = [(partition_size, max(1, -(-max_seq_len // partition_size)))] * 2
    size, parts = splits[0]
    matrix = decode_matrix(info, features, backend, storage, query, head_size, layout, block_size,
                           size if parts > 1 else max_seq_len, kernel)
    partition_size, num_partitions = splits[0 if matrix else 1]
    # A split of a few partitions is merged in the decode dispatch: the last workgroup of each (sequence, head
    # group) to finish does (shaders/decode_merge.glsl), so the split costs no second dispatch and no barrier
    # (3.6 us at least on the H200). Measured there (docs/decisions.md, "Long splits merged in the decode
    # dispatch"): the merging workgroup's reads of the coherent partials cost about 0.3 us a partition, so past
    # four partitions the reduce dispatch is faster (32: 26.3 against 18.9 us at 1 x 4096); the scalar kernel
    # gains with float32 caches (64 x 4096: 527-533 against 552 us) and loses with float16 (400 against 343 us),
    # so it merges float32 splits only.
    # Plain loads ordered by the counter's acquire (the Vulkan memory model) cut a 32-partition merge by 3.8 us but
    # cost every workgroup's release 0.9 us at 8 x 4096, and still lost to the reduce (docs/decisions.md, "The
    # merge under the Vulkan memory model").
    # WGSL keeps the reduce (its memory model orders nothing between workgroups), and so does the CPU kernel
    # (one subgroup a workgroup, no barriers).
    merge_in_decode = (backend == "glsl" and target != "cpu" and (bool(matrix) or storage == "f32")
                       and 1 < num_partitions <= DECODE_MERGE_PARTITIONS)
    if merge_in_decode:
        constants[DecodeSpec.MERGE] = 1
    tokens = partition_size if num_partitions > 1 else max_seq_len   # the most a workgroup takes
    if matrix:
        constants[DecodeSpec.STEP] = matrix_step(storage, tokens)
    elif values_with_keys(storage, tokens):
        constants[DecodeSpec.VALUES] = 1
    return DecodeChoice(backend, target, matrix, storage, query, head_size, group, subgroup_reductions(info),
                        partition_size, num_partitions, merge_in_decode, tuple(sorted(constants.items())))
