"""Paged-attention decode: one query token per sequence over a paged KV cache in any layout (pagedvk.layouts).

Follows FlashInfer's plan/run split. A decode step runs the same attention for every layer with the same
block tables, so ``DecodePlan`` does the per-step work once (checks, block tables and lengths on the
device, the pipeline) and ``run`` does the per-layer work: bind that layer's cache and submit a command
buffer recorded the first time those buffers were seen.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict

import numpy as np

from . import checks, config, kernels
from .abi import (DECODE_FIXED, DECODE_GROUP_SPEC_ID, DECODE_HEAD_SIZE_SPEC_ID, DECODE_MERGE_PARTITIONS,
                  DECODE_MERGE_SPEC_ID, DECODE_STEP_SPEC_ID, DECODE_VALUE_ORDER_SPEC_ID, DECODE_VALUES_SPEC_ID, PAGED_DECODE,
                  PAGED_DECODE_REDUCE, head_size_constant, q_type_code, q_type_constant)
from .array import Array, DeviceArray, asarray, empty, zeros
from .dtypes import CACHE_TYPES, KV_CACHE_DTYPES, QUERY_TYPES, fp8_scale, is_fp8, scaled, storage_type
from .errors import ClosedError
from .layouts import LAYOUTS, MAX_HEAD_SIZE, CacheSpec, bind_caches, cache_spec, check_block_size
from .matrix import MATRIX_KIND, matrix_unavailable, offers, operand_type, with_operands
from .opargs import backend_name, check_scale, device_of, softmax_scale
from .runtime.instance import MatrixShape
from .runtime.owned import Owned
from .runtime.pipeline import Launch, Transfers, fold_grid
from .selection import get_device
from .variants import Variants, in_use as variants_in_use, per_head

MAX_PARTITION_SIZE = 2**31 - 1              # tokens: partition_size travels as a u32 push constant
RECORDED_LAUNCHES = 32                       # per plan: enough for every layer of most models
CHECKED_SIGNATURES = 64                      # per plan: run() argument signatures that passed the checks
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
# bfloat16 subgroups to take two blocks a step (abi.DECODE_STEP_SPEC_ID): on the H200 two were faster from 2048
# (256 x 2048 531.7 -> 518.2 us, 8 x 32768 in 8192-token partitions 262.0 -> 257.6) and slower at 1024 (8 x 4096
# 44.5 -> 46.5 us, 1 x 32768 45.7 -> 47.4; BENCHMARKS.md, fourteenth session).
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
    blocks), the device runs it (pagedvk.matrix) and each workgroup takes at least MATRIX_MIN_TOKENS tokens
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
    return {DECODE_VALUE_ORDER_SPEC_ID: 1 if layout == "vllm" else 2, DECODE_GROUP_SPEC_ID: 4 if group <= 4 else 8}


def fixed_name(constants: dict) -> str:
    """The WGSL modules' name (abi.DECODE_FIXED) for the specialization kernel_constants gives the GLSL kernel."""
    fixed = (constants[DECODE_VALUE_ORDER_SPEC_ID], constants[DECODE_GROUP_SPEC_ID])
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
    """Blocks a matrix-decode subgroup takes a step (abi.DECODE_STEP_SPEC_ID) where a workgroup takes at most
    `tokens` tokens: two for float16 and bfloat16 caches from MATRIX_STEP2_MIN_TOKENS on, else one."""
    return 2 if storage in ("f16", "bf16") and tokens >= MATRIX_STEP2_MIN_TOKENS else 1


def values_with_keys(storage: str, tokens: int) -> bool:
    """Whether the scalar GPU decode loads a tile's values beside its keys (abi.DECODE_VALUES_SPEC_ID) where a
    workgroup takes at most `tokens` tokens of a `storage` cache: for float16 and bfloat16 caches where that is one
    tile, whose chain of round trips is then the workgroup's. On the H200 (BENCHMARKS.md, fifteenth session) 1 x 4096
    took 16.5 against 17.2 us; fp8, whose tile of values is one batch already, 20.0 against 17.7 us."""
    return storage in ("f16", "bf16") and tokens <= TILE


def _signature(arrays) -> tuple | None:
    """What the run checks read of these arrays (None stays None): kind, contiguity, writability, shape, dtype; None
    when one is not an array (the checks reject it)."""
    signature = []
    for a in arrays:
        if a is None or type(a) is DeviceArray:
            signature.append(a if a is None else (DeviceArray, a.shape, a.dtype))
        elif isinstance(a, np.ndarray):
            signature.append((type(a), a.shape, a.dtype, a.flags.c_contiguous, a.flags.writeable))
        else:
            return None
    return tuple(signature)


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


class DecodePlan(Owned):
    """The per-step part of decode attention, reused by every layer's ``run``.

    block_tables  int32 [num_seqs, max_blocks_per_seq]: physical block ids; only each sequence's first
                  ceil(seq_len / block_size) entries are read.
    seq_lens      int32 [num_seqs]: tokens cached per sequence (0 gives an output of zeros).
    num_heads, num_kv_heads, head_size, block_size, num_blocks: the model's and the caches' dims; the
                  caches passed to ``run`` must match them and hold at least num_blocks blocks.
    dtype         the caches' dtype: float32, float16, ml_dtypes.bfloat16, float8_e4m3fn or float8_e5m2.
    query_dtype   float32, float16 or bfloat16; the output has it too. Default: dtype where it is one of
                  those, else float16 (fp8 caches serve 16-bit models).
    layout        "vllm", "nhd" or "hnd" (see pagedvk.layouts).
    k_scale, v_scale  fp8 caches hold key / scale and value / scale (vLLM's): the kernels multiply back. Other
                  caches ignore them, as vLLM does.
    validate=False skips the checks of the tables' values (ids, lengths), which read device-resident
    tables back to the host. The kernel bounds every index itself, so bad values then give wrong
    attention for the sequences that hold them, never a read outside the caches. Lengths may grow after
    the plan is made (the last partition takes every token past its start), up to the block-table row.
    partition_size (tokens) overrides the split-K rule (``partitioning``; ``matrix_partitioning`` for the
    cooperative-matrix kernel); it must be a multiple of block_size.
    alibi_slopes, logits_soft_cap, sinks, window_left: the attention variants (pagedvk.variants), the same for
    every run of the plan. With a window, the partitions cover each sequence's window only.
    kernel        "cpu" or "gpu": the decode kernel shaped for CPU devices or the scalar one for GPUs, whatever
                  the device; "coopmat": the cooperative-matrix kernel (ValueError where it cannot run). Default:
                  PAGEDVK_DECODE_KERNEL, else by the device's type, with the cooperative-matrix kernel where the
                  device has it and the plan suits it (see ``decode_target`` and ``decode_matrix``). WGSL plans
                  run the WGSL matrix kernel (float16 caches and queries) or the scalar GPU kernel, never "cpu".
    """

    def __init__(self, block_tables, seq_lens, *, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, num_blocks: int, dtype=np.float32, query_dtype=None, layout: str = "vllm",
                 scale: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0, device=None,
                 backend: str | None = None, validate: bool = True, partition_size: int | None = None,
                 alibi_slopes=None, logits_soft_cap: float | None = None, sinks=None, window_left: int = -1,
                 kernel: str | None = None):
        self._closed, self._lock = True, threading.Lock()   # until constructed: close() works on a half-made plan
        checks.tables(block_tables, seq_lens)
        dtype = plan_arguments(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                               block_size=block_size, num_blocks=num_blocks, dtype=dtype, scale=scale,
                               layout=layout)
        if validate:  # reads device-resident tables back; engines that trust their tables can skip it
            checks.block_table_values(block_tables, seq_lens, block_size, num_blocks)
        self.backend = backend_name(backend)
        self.device = device_of(block_tables, seq_lens, alibi_slopes, sinks, device=device)
        self.target = decode_target(self.device.info, self.backend, kernel)
        self.num_seqs = block_tables.shape[0]
        self.num_heads, self.num_kv_heads, self.head_size = int(num_heads), int(num_kv_heads), int(head_size)
        self.block_size, self.num_blocks = int(block_size), int(num_blocks)
        self.layout = layout
        self.spec = CacheSpec(layout, CACHE_TYPES[dtype], self.num_blocks, self.num_kv_heads, self.head_size,
                              self.block_size)
        self.query_type = (storage_type("query_dtype", np.empty(0, query_dtype), QUERY_TYPES)
                           if query_dtype is not None else QUERY_TYPES.get(dtype, QUERY_TYPES[np.dtype(np.float16)]))
        self.dtype, self.query_dtype = dtype, self.query_type.dtype
        self.scale = softmax_scale(scale, head_size)
        k_scale, v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
        # Other caches ignore the scales, as vLLM does (kv_cache_dtype "auto"): applied, they gave wrong answers.
        self.k_scale, self.v_scale = (k_scale, v_scale) if is_fp8(self.spec.storage) else (1.0, 1.0)
        self.logit_scale = scaled("k_scale", self.scale, self.k_scale)
        if config.decode_kernel(kernel) == MATRIX_KIND:   # refused before anything is made for the plan
            decode_matrix(self.device.info, self.device.features, self.backend, self.spec.storage.tag,
                          self.query_type.tag, self.head_size, layout, self.block_size, 0, kernel)
        self.block_tables = asarray(block_tables, device=self.device)
        self.seq_lens = asarray(seq_lens, device=self.device)
        self._owned = [a for a, given in ((self.block_tables, block_tables), (self.seq_lens, seq_lens))
                       if a is not given]
        self.variants = Variants(self.num_heads, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                                 sinks=sinks, window_left=window_left)
        self.variant_arrays = {name: asarray(a, device=self.device) for name, a in self.variants.inputs.items()}
        self._owned += [a for name, a in self.variant_arrays.items() if a is not self.variants.inputs[name]]
        self._no_lse = empty((4,), np.float32, self.device)   # the lse binding of runs that return none
        self._owned.append(self._no_lse)
        self.group_size = group_size(num_heads, num_kv_heads)
        # The head size too, where it is one of vLLM's: the scalar kernels' loops over head dims unroll on it.
        self.constants = {**kernel_constants(layout, self.group_size), **q_type_constant(self.query_type.tag),
                          **head_size_constant(DECODE_HEAD_SIZE_SPEC_ID, head_size)}
        lens = checks.host(seq_lens)
        # Tokens the partitions cover: the longest context, or the window where it is shorter.
        max_seq_len = self.variants.span(min(int(lens.max(initial=0)), block_tables.shape[1] * block_size),
                                         block_size)
        workgroups_per_seq = num_heads // self.group_size
        if partition_size is None:   # each kernel's own split; the matrix kernel where its partitions are long
            units = compute_units(self.device.info)
            splits = [matrix_partitioning(self.num_seqs, workgroups_per_seq, max_seq_len, units),
                      partitioning(self.num_seqs, workgroups_per_seq, max_seq_len, units)]
        else:
            # a u32 push constant; a partition longer than any block-table row splits nothing
            checks.integer("partition_size", partition_size, 1, MAX_PARTITION_SIZE)
            if partition_size % block_size:
                raise ValueError(f"partition_size must be a multiple of block_size ({block_size}), got {partition_size}")
            splits = [(partition_size, max(1, -(-max_seq_len // partition_size)))] * 2
        # The module (unrolled for this head size; the matrix kernel where it is faster). Its pipeline for the
        # plan's variants is made now; a run that adds lse or sinks, or reads segmented caches, gets its own at
        # first use (kernels.pipeline keeps them).
        size, parts = splits[0]
        self.matrix = decode_matrix(self.device.info, self.device.features, self.backend, self.spec.storage.tag,
                                    self.query_type.tag, self.head_size, layout, self.block_size,
                                    size if parts > 1 else max_seq_len, kernel)
        self.partition_size, self.num_partitions = splits[0 if self.matrix else 1]
        split = self.num_partitions > 1
        # A split of a few partitions is merged in the decode dispatch: the last workgroup of each (sequence, head
        # group) to finish does (shaders/decode_merge.glsl), so the split costs no second dispatch and no barrier
        # (3.6 us at least on the H200). Measured there (BENCHMARKS.md, tenth session): the merging workgroup's
        # reads of the coherent partials cost about 0.3 us a partition, so past four partitions the reduce dispatch
        # is faster (32: 26.3 against 18.9 us at 1 x 4096); the scalar kernel gains with float32 caches (64 x 4096:
        # 527-533 against 552 us) and loses with float16 (400 against 343 us), so it merges float32 splits only.
        # Plain loads ordered by the counter's acquire (the Vulkan memory model) cut a 32-partition merge by 3.8 us but
        # cost every workgroup's release 0.9 us at 8 x 4096, and still lost to the reduce (sixteenth session).
        # WGSL keeps the reduce (its memory model orders nothing between workgroups), and so does the CPU kernel
        # (one subgroup a workgroup, no barriers).
        self.merge_in_decode = (self.backend == "glsl" and self.target != "cpu"
                                and (bool(self.matrix) or self.spec.storage.tag == "f32")
                                and 1 < self.num_partitions <= DECODE_MERGE_PARTITIONS)
        if self.merge_in_decode:
            self.constants[DECODE_MERGE_SPEC_ID] = 1
        tokens = self.partition_size if split else max_seq_len   # the most a workgroup takes
        if self.matrix:
            self.constants[DECODE_STEP_SPEC_ID] = matrix_step(self.spec.storage.tag, tokens)
        elif values_with_keys(self.spec.storage.tag, tokens):
            self.constants[DECODE_VALUES_SPEC_ID] = 1
        self.key = self._module()
        kernels.pipeline(self.device, PAGED_DECODE, self.key, variants_in_use(self.variants.push()), self.constants)
        limits = self.device.info.max_workgroup_count
        self.grid = fold_grid(workgroups_per_seq * self.num_seqs * self.num_partitions, limits)
        # Scratch for split contexts; 16-byte placeholders keep the bindings valid when there is no split. A merge
        # in the decode counts on the uint32 pairs after partial_stats' (abi.PAGED_DECODE), zeroed here once.
        self.partial_out = empty((self.num_seqs, num_heads, self.num_partitions, head_size) if split else (4,),
                                 np.float32, self.device)
        stats_shape = (self.num_seqs, num_heads, self.num_partitions, 2) if split else (4,)
        units = self.num_seqs * workgroups_per_seq if self.merge_in_decode else 0
        self._stats_and_counters = zeros((math.prod(stats_shape) // 2 + units, 2), np.float32, self.device)
        self.partial_stats = DeviceArray._over(self._stats_and_counters.buffer, 0, stats_shape, np.float32)
        self.merge_counters = (DeviceArray._over(self._stats_and_counters.buffer, self.partial_stats.nbytes,
                                                 (units, 2), np.uint32) if units else None)
        self._owned += [self.partial_out, self._stats_and_counters]
        self.reduce_key = PAGED_DECODE_REDUCE.key(self.backend, q=self.query_type.tag) if split else None
        self.reduce_grid = fold_grid(num_heads * self.num_seqs, limits)
        self._launches = OrderedDict()  # buffer uids -> recorded Launch, least recently used first
        self._checked = set()           # argument signatures _check_run has passed
        self._closed = False

    @classmethod
    def for_caches(cls, key_cache, value_cache, block_tables, seq_lens, num_heads, *, layout="vllm",
                   kv_cache_dtype="auto", query_dtype=None, **kw) -> "DecodePlan":
        spec = cache_spec(key_cache, value_cache, layout, kv_cache_dtype)
        device = device_of(key_cache, value_cache, block_tables, seq_lens, device=kw.pop("device", None))
        return cls(block_tables, seq_lens, num_heads=num_heads, num_kv_heads=spec.num_kv_heads,
                   head_size=spec.head_size, block_size=spec.block_size, num_blocks=spec.num_blocks,
                   dtype=spec.storage.dtype, query_dtype=query_dtype, layout=layout, device=device, **kw)

    def _check_lse(self, lse, out) -> None:
        checks.kind("lse", lse)
        checks.writable("lse", lse)
        checks.dtype("lse", lse, [np.float32])
        if tuple(lse.shape) != (self.num_seqs, self.num_heads):
            raise ValueError(f"lse must have shape [num_seqs, num_heads] = {(self.num_seqs, self.num_heads)}, "
                             f"got {tuple(lse.shape)}")
        if out is None or type(lse) is not type(out):
            raise TypeError("lse must be given with out, and be the same kind of array (numpy or DeviceArray)")
        device_of(lse, device=self.device)

    def _check_run(self, query, key_cache, value_cache, out) -> None:
        """The run arguments' checks. They read only kinds, shapes and dtypes, so arguments that look like
        ones already passed pass again without them (a layer's run repeats the last layer's shapes)."""
        signature = _signature((query, key_cache, value_cache, out))
        if signature is not None and signature in self._checked:
            return
        self._check_run_arguments(query, key_cache, value_cache, out)
        if signature is not None:
            if len(self._checked) >= CHECKED_SIGNATURES:
                self._checked.clear()
            self._checked.add(signature)

    def _check_run_arguments(self, query, key_cache, value_cache, out) -> None:
        checks.kind("query", query)
        checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
        # A uint8 cache (vLLM's fp8) is read as the plan's storage type.
        kv_cache_dtype = "auto" if np.dtype(key_cache.dtype) != np.dtype(np.uint8) else next(
            (name for name, t in KV_CACHE_DTYPES.items() if t == self.spec.storage), "auto")
        spec = cache_spec(key_cache, value_cache, self.layout, kv_cache_dtype)
        for name in ("num_kv_heads", "head_size", "block_size", "storage"):
            if getattr(spec, name) != getattr(self.spec, name):
                raise ValueError(f"key_cache {name} is {getattr(spec, name)} but the plan was made for "
                                 f"{getattr(self.spec, name)}")
        if spec.num_blocks < self.num_blocks:
            raise ValueError(f"key_cache num_blocks is {spec.num_blocks}, but the plan's block_tables "
                             f"were checked against {self.num_blocks} blocks")
        checks.dtype("query", query, [self.query_dtype])
        for axis, (n, what) in enumerate([(self.num_seqs, "num_seqs"), (self.num_heads, "num_heads"),
                                          (self.head_size, "head_size")]):
            checks.dim("query", query, axis, n, what)
        if out is not None:
            checks.kind("out", out)
            checks.writable("out", out)
            checks.dtype("out", out, [self.query_dtype])
            if tuple(out.shape) != tuple(query.shape):
                raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")

    def run(self, query: Array, key_cache: Array, value_cache: Array, out: Array | None = None,
            lse: Array | None = None, return_lse: bool = False, sinks: Array | None = None):
        """Attention of each sequence's query over its cached tokens. query [num_seqs, num_heads,
        head_size] -> [num_seqs, num_heads, head_size]; numpy query in gives numpy out, DeviceArray in
        gives DeviceArray out (``out`` is written and returned when given).

        return_lse=True (or an ``lse`` to write, given with ``out``) returns (out, lse): lse float32
        [num_seqs, num_heads], the natural-log log-sum-exp of each head's logits (the sink's included),
        -inf for a sequence with no visible key; pagedvk.merge_attention_states merges such results.

        sinks (float32 [num_heads]) stand in for the plan's for this run: models whose layers have their own
        sinks (gpt-oss) share one plan. Give them as a DeviceArray: a numpy one is copied at every run."""
        self._require_open()
        self._check_run(query, key_cache, value_cache, out)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, not {type(return_lse).__name__}")
        if lse is not None:
            self._check_lse(lse, out)
        if sinks is not None:
            per_head("sinks", sinks, self.num_heads)
            device_of(sinks, device=self.device)
        sinks_d = asarray(sinks, device=self.device) if sinks is not None else None
        try:
            # A copied sinks array is the run's own: its launch is not kept.
            return self._run(query, key_cache, value_cache, out, lse, return_lse, sinks_d, sinks_d is sinks)
        finally:
            if sinks_d is not None and sinks_d is not sinks:
                sinks_d.close()

    def _run(self, query, key_cache, value_cache, out, lse, return_lse, sinks, keep: bool):
        if return_lse or lse is not None:
            return self._run_with_lse(query, key_cache, value_cache, out, lse, sinks, keep)
        dev = self.device
        if (type(query) is type(key_cache) is type(value_cache) is type(out) is DeviceArray
                and query.device is key_cache.device is value_cache.device is out.device is dev):
            # A decode step's per-layer call: nothing to copy, the launch is recorded once.
            self._launch(query, key_cache, value_cache, out, num_blocks=key_cache.shape[0], cache=keep, sinks=sinks)
            return out
        return self._run_copied(query, key_cache, value_cache, out, None, sinks, keep)

    def _run_with_lse(self, query, key_cache, value_cache, out, lse, sinks, keep: bool) -> tuple:
        """run() returning (out, lse): lse as given, else numpy for a numpy result, a DeviceArray for a DeviceArray."""
        lse_d = lse if isinstance(lse, DeviceArray) else empty((self.num_seqs, self.num_heads), np.float32, self.device)
        try:
            result = self._run_copied(query, key_cache, value_cache, out, lse_d, sinks, keep)
            if isinstance(lse, np.ndarray):
                lse[...] = lse_d.numpy()
                return result, lse
            if lse is None and not isinstance(result, DeviceArray):
                return result, lse_d.numpy()
            handed, lse_d = lse_d, None
            return result, handed
        finally:
            if lse_d is not None and lse_d is not lse:
                lse_d.close()

    def _run_copied(self, query, key_cache, value_cache, out, lse, sinks, keep: bool):
        dev = self.device
        device_of(query, key_cache, value_cache, out, device=dev)
        temporaries = []

        def on_device(a):
            d = asarray(a, device=self.device)
            if d is not a:
                temporaries.append(d)
            return d

        try:
            q, k, v = on_device(query), on_device(key_cache), on_device(value_cache)
            o = out if isinstance(out, DeviceArray) else empty(query.shape, self.query_dtype, self.device)
            if o is not out:
                temporaries.append(o)
            self._launch(q, k, v, o, num_blocks=key_cache.shape[0], cache=keep and not temporaries, lse=lse,
                         sinks=sinks)
            if isinstance(out, np.ndarray):
                out[...] = o.numpy()
                return out
            if out is not None:
                return out
            if isinstance(query, np.ndarray):
                return o.numpy()
            temporaries.remove(o)
            return o
        finally:
            for a in temporaries:
                a.close()

    def _launch(self, q, k, v, o, num_blocks: int, cache: bool, timed: bool = False,
                transfers: Transfers | None = None, lse: DeviceArray | None = None, sinks: DeviceArray | None = None):
        # One thread at a time per plan: its recorded launches are looked up, evicted and submitted under
        # the lock, so no thread submits a launch another has just evicted (the device serializes
        # submissions anyway), and close(), which frees the plan's arrays under the same lock, either
        # waits for a run or makes it raise.
        with self._lock:
            self._require_open()
            return self._launch_locked(q, k, v, o, num_blocks, cache, timed, transfers, lse, sinks)

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

    def _launch_locked(self, q, k, v, o, num_blocks: int, cache: bool, timed: bool, transfers, lse, sinks):
        # The plan's own tables and scratch are the same in every launch: the key holds the callers' buffers.
        key = (q.buffer.uid, *[b.uid for b in k.buffers], *[b.uid for b in v.buffers], o.buffer.uid, timed,
               transfers.uids if transfers is not None else (), *[a.buffer.uid if a is not None else None
                                                                   for a in (lse, sinks)])
        launch = self._launches.get(key)
        if launch is not None:
            self._launches.move_to_end(key)
            try:
                return launch.submit()
            except ClosedError:
                # A buffer it binds was closed or collected (its uid is never reused, so only a plan
                # table given by the caller can be): record anew, which raises if one still is.
                self._forget(key)
        launch = Launch(self.device, self._steps(q, k, v, o, num_blocks, lse, sinks), timestamps=timed,
                        transfers=transfers)
        if cache:
            self._launches[key] = launch
            while len(self._launches) > RECORDED_LAUNCHES:
                self._forget(next(iter(self._launches)))
        try:
            return launch.submit()
        finally:
            if not cache:
                launch.close()

    def _steps(self, q, k, v, o, num_blocks: int, lse: DeviceArray | None = None,
               sinks: DeviceArray | None = None) -> list:
        """The dispatches of one run: decode, and the reduce of its partitions when split (unless the decode
        kernel merges them in its own dispatch: merge_in_decode). Both take the same push constants; lse, when
        given, is written; sinks, when given, stand in for the plan's."""
        tables = (self.block_tables.buffer, self.seq_lens.buffer)
        partials = (self.partial_out.buffer, self._stats_and_counters.buffer)
        spec = CacheSpec(self.layout, self.spec.storage, num_blocks, self.num_kv_heads, self.head_size,
                         self.block_size)
        caches = bind_caches(k, v, self.backend)
        key = self.key if not caches.access else self._module(caches.access)
        variant_push = self.variants.push(lse=lse is not None, sinks=sinks is not None)
        variants = variants_in_use(variant_push)
        push = PAGED_DECODE.pack_push(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_size=self.block_size, max_blocks_per_seq=self.block_tables.shape[1],
            num_blocks=spec.blocks_held(caches.key_bytes, caches.value_bytes), num_seqs=self.num_seqs,
            q_token_stride=self.num_heads, q_head_stride=1, causal=0, scale=self.logit_scale,
            v_scale=self.v_scale, group_size=self.group_size, partition_size=self.partition_size,
            num_partitions=self.num_partitions, blocks_per_segment=caches.blocks_per_segment, **spec.strides(),
            q_type=q_type_code(self.query_type.tag), **variant_push)
        lse_buffer = (lse if lse is not None else self._no_lse).buffer
        decode = (kernels.pipeline(self.device, PAGED_DECODE, key, variants, self.constants),
                  (q.buffer, caches.key, caches.value, *tables, o.buffer, *partials, *self._variant_buffers(sinks),
                   lse_buffer, *caches.extra), push, self.grid)
        if self.reduce_key is None or self.merge_in_decode:
            return [decode]
        reduce = (kernels.pipeline(self.device, PAGED_DECODE_REDUCE, self.reduce_key, variants,
                                   q_type_constant(self.query_type.tag)),
                  (self.seq_lens.buffer, *partials, o.buffer, self._variant_buffers(sinks)[1], lse_buffer), push,
                  self.reduce_grid)
        return [decode, reduce]

    def _module(self, access: str = ""):
        """The decode module for this plan and a cache access (abi.CACHE_ACCESS): the matrix kernel reads caches
        by binding only, so segmented or addressed caches run the scalar one."""
        if self.matrix and access in PAGED_DECODE.matrix_accesses:
            return PAGED_DECODE.key(self.backend, self.spec.storage.tag, self.query_type.tag, self.head_size, access,
                                    matrix=self.matrix)
        return PAGED_DECODE.key(self.backend, self.spec.storage.tag, self.query_type.tag, self.head_size, access,
                                subgroup_arithmetic=subgroup_reductions(self.device.info),
                                fixed=fixed_name(self.constants), target=self.target)

    def _variant_buffers(self, sinks: DeviceArray | None) -> tuple:
        """The alibi_slopes and sinks bindings (ATTENTION_VARIANT_INPUTS' order); `sinks` in place of the plan's."""
        return (self.variant_arrays["alibi_slopes"].buffer,
                (sinks if sinks is not None else self.variant_arrays["sinks"]).buffer)

    def time_ns(self, query: DeviceArray, key_cache: DeviceArray, value_cache: DeviceArray, out: DeviceArray) -> float:
        """One launch, timed on the GPU by timestamp queries (device arrays only: no copies in the timing)."""
        self._require_open()
        self._check_run(query, key_cache, value_cache, out)
        if not all(isinstance(a, DeviceArray) for a in (query, key_cache, value_cache, out)):
            raise TypeError("time_ns takes device arrays only")
        return self._launch(query, key_cache, value_cache, out, key_cache.shape[0], cache=True, timed=True)

    def _forget(self, key) -> None:
        self._launches.pop(key).close()

    def close(self) -> None:
        """Free the plan's recorded launches and device arrays; a run after (or racing) it raises
        ClosedError. Safe to call twice."""
        with self._lock:
            self._closed = True
            for key in list(getattr(self, "_launches", ())):
                self._forget(key)
            for a in getattr(self, "_owned", ()):
                a.close()
            self._owned = []

    def __repr__(self) -> str:
        if not hasattr(self, "device"):
            return "DecodePlan(<not constructed>)"
        state = ", closed" if self._closed else ""
        return (f"DecodePlan(num_seqs={self.num_seqs}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, block_size={self.block_size}, dtype={self.dtype}, "
                f"backend={self.backend!r}, partitions={self.num_partitions}, device={self.device!r}{state})")


def paged_attention(query: Array, key_cache: Array, value_cache: Array, block_tables: Array, seq_lens: Array, *,
                    scale: float | None = None, out: Array | None = None, layout: str = "vllm",
                    kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                    backend: str | None = None, validate: bool = True, alibi_slopes: Array | None = None,
                    logits_soft_cap: float | None = None, sinks: Array | None = None, window_left: int = -1,
                    return_lse: bool = False):
    """Decode attention over a paged KV cache: each sequence's one query token over its cached tokens.

    query        float32, float16 or bfloat16 [num_seqs, num_heads, head_size]; num_heads a multiple of
                 num_kv_heads (MHA, GQA, MQA)
    key_cache    layout "vllm": [num_blocks, num_kv_heads, head_size // x, block_size, x], x = 16 // itemsize
                 layout "nhd":  [num_blocks, block_size, num_kv_heads, head_size]
                 layout "hnd":  [num_blocks, num_kv_heads, block_size, head_size] (FlashInfer's HND)
    value_cache  "vllm": [num_blocks, num_kv_heads, head_size, block_size]; "nhd", "hnd": as key_cache
                 block_size 8, 16 or 32; "nhd" and "hnd" also 1, 2 or 4 (pagedvk.layouts)
                 float32, float16, ml_dtypes.bfloat16, float8_e4m3fn or float8_e5m2; or uint8 with
                 kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" (vLLM's), scaled by k_scale / v_scale
    block_tables int32 [num_seqs, max_blocks_per_seq]: physical block ids
    seq_lens     int32 [num_seqs]: cached tokens per sequence (0 gives zeros)
    scale        softmax scale, default 1 / sqrt(head_size); accumulation is float32
    out          optional array of the query's shape and dtype to write into
    Returns [num_seqs, num_heads, head_size] in the query's dtype: numpy for a numpy query, a DeviceArray
    for a DeviceArray. For many layers with the same block tables, make one DecodePlan and call its run()
    per layer. validate=False skips the block-table value checks (see DecodePlan). Calls that repeat a signature
    (shapes, dtypes, options, longest context) with numpy block tables reuse a plan the device keeps, with
    staging for the numpy arguments: the tables and lengths are still copied in every call
    (``pagedvk.decode.release_cached_plans`` frees what is kept).
    alibi_slopes float32 [num_heads], logits_soft_cap, sinks float32 [num_heads], window_left: the attention
                 variants (see pagedvk.variants), each composable with the others
    return_lse   True returns (out, lse): lse float32 [num_seqs, num_heads], each head's natural-log
                 log-sum-exp (the sink included; -inf where no key is visible), for merge_attention_states

    >>> out = pagedvk.paged_attention(q, key_cache, value_cache, block_tables, seq_lens)
    """
    checks.kind("query", query)
    checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
    query_type = storage_type("query", query, QUERY_TYPES)
    if out is not None:   # before a plan is made for the call (which uploads its tables)
        checks.kind("out", out)
        checks.writable("out", out)
    device = device_of(query, key_cache, value_cache, block_tables, seq_lens, out, alibi_slopes, sinks)
    options = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, layout=layout, kv_cache_dtype=kv_cache_dtype,
                   backend=backend, logits_soft_cap=logits_soft_cap, window_left=window_left)
    # Kept plans serve scalar options only: per-head arrays and an lse output take a plan of their own.
    key = (_oneshot_key(query, key_cache, value_cache, block_tables, seq_lens, out, options)
           if alibi_slopes is None and sinks is None and return_lse is False else None)
    if key is not None:
        plans = _oneshot_plans(device)
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, _OneShot.make(query, key_cache, value_cache, block_tables, seq_lens, out,
                                                 options, query_type, validate, device))
        elif validate:   # a hit has this call's shapes checked already, not its tables' values
            checks.block_table_values(block_tables, seq_lens, entry.plan.block_size, entry.plan.num_blocks)
        result = entry(query, key_cache, value_cache, block_tables, seq_lens, out)
        if result is not None:
            return result
        # Evicted by another thread between the look-up and the call: run uncached.
    with DecodePlan.for_caches(key_cache, value_cache, block_tables, seq_lens, query.shape[1], layout=layout,
                               kv_cache_dtype=kv_cache_dtype, query_dtype=query_type.dtype, scale=scale,
                               k_scale=k_scale, v_scale=v_scale, backend=backend, validate=validate,
                               device=device, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                               sinks=sinks, window_left=window_left) as plan:
        return plan.run(query, key_cache, value_cache, out=out, return_lse=return_lse)


# One-shot calls repeat shapes (a model's layers, a benchmark's loop): each device keeps the plans of its last
# few call signatures, each with device arrays and a staging buffer for the numpy arguments.
ONESHOT_PLANS = 8                  # per device
ONESHOT_HOST_BYTES = 16 << 20      # calls with more bytes of numpy arguments are not cached (nor their staging)


def _oneshot_key(query, key_cache, value_cache, block_tables, seq_lens, out, options) -> tuple | None:
    """What a cached plan serves: every argument's kind, shape, dtype and contiguity (so a hit passes the checks a
    first call ran), the longest context (the split-K rule reads it) and the options, each with its type (1 and
    True are equal, but True is refused). None when the call is not cached: device tables (their values
    would be read back), a DeviceArray result made for the caller, a large numpy argument, or an argument the
    checks will refuse."""
    signature = _signature((query, key_cache, value_cache, out, block_tables, seq_lens))
    if (signature is None or type(block_tables) is not np.ndarray or type(seq_lens) is not np.ndarray
            or (out is None and type(query) is DeviceArray) or seq_lens.ndim != 1 or seq_lens.dtype != np.int32):
        return None
    host = sum(a.nbytes for a in (query, key_cache, value_cache, out, block_tables, seq_lens)
               if isinstance(a, np.ndarray))
    if host > ONESHOT_HOST_BYTES:
        return None
    if options["backend"] is None:   # then PAGEDVK_BACKEND picks it, which may change between calls
        options = dict(options, backend=(None, config.backend()))
    # PAGEDVK_DECODE_KERNEL too may change between calls
    key = (signature, int(seq_lens.max(initial=0)), tuple((k, type(v), v) for k, v in options.items()),
           config.decode_kernel())
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _OneShotPlans:
    """A device's cached one-shot entries, least recently used first; an evicted one is closed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries = OrderedDict()

    def get(self, key):
        with self.lock:
            entry = self.entries.get(key)
            if entry is None or entry.closed:   # closed: its device was
                return None
            self.entries.move_to_end(key)
            return entry

    def add(self, key, entry):
        with self.lock:
            evicted = [e for e in [self.entries.pop(key, None)] if e is not None]
            self.entries[key] = entry
            while len(self.entries) > ONESHOT_PLANS:
                evicted.append(self.entries.popitem(last=False)[1])
        for e in evicted:   # outside the lock: closing waits for a call still using it
            e.close()
        return entry

    def clear(self) -> None:
        with self.lock:
            entries, self.entries = list(self.entries.values()), OrderedDict()
        for e in entries:
            e.close()

    def plans(self) -> list:
        with self.lock:
            return [e.plan for e in self.entries.values()]


_ONESHOT = weakref.WeakKeyDictionary()   # device -> _OneShotPlans
_ONESHOT_LOCK = threading.Lock()


def release_cached_plans(device=None) -> None:
    """Close the plans, arrays and staging that paged_attention keeps for repeated shapes on a device
    (default: the default device); later calls make them again."""
    with _ONESHOT_LOCK:
        plans = _ONESHOT.pop(get_device(device), None)
    if plans is not None:
        plans.clear()


def _oneshot_plans(device) -> _OneShotPlans:
    with _ONESHOT_LOCK:
        plans = _ONESHOT.get(device)
        if plans is None:
            plans = _ONESHOT[device] = _OneShotPlans()
        return plans


def _stage(staged: list, array: DeviceArray, offset: int) -> int:
    """Lay the array's segments out in a staging buffer from `offset`: append (segment, its offset) for each
    non-empty one (Vulkan has no empty copies) and return the next 16-byte-aligned offset."""
    for b in array.buffers:
        if b.nbytes:
            staged.append((b, offset))
        offset += b.nbytes
    return (offset + 15) // 16 * 16


class _OneShot(Owned):
    """A plan kept for the one-shot calls of one key, with device arrays for the numpy query, caches and output,
    and a host-visible staging buffer. A call writes its numpy arguments into the staging (the block tables
    and lengths every time: a kept plan never serves earlier tables) and submits one recorded launch that
    copies them in, runs the decode and copies the output out."""

    IN = ("block_tables", "seq_lens", "query", "key_cache", "value_cache")

    @classmethod
    def make(cls, query, key_cache, value_cache, block_tables, seq_lens, out, options, query_type, validate,
             device) -> "_OneShot":
        plan = DecodePlan.for_caches(key_cache, value_cache, block_tables, seq_lens, query.shape[1],
                                     query_dtype=query_type.dtype, validate=validate, device=device, **options)
        try:
            plan._check_run(query, key_cache, value_cache, out)
            return cls(plan, dict(zip(cls.IN, (block_tables, seq_lens, query, key_cache, value_cache))), out)
        except BaseException:
            plan.close()
            raise

    def __init__(self, plan: DecodePlan, args: dict, out):
        self.plan, self.lock, dev = plan, threading.Lock(), plan.device
        self.staging = None
        # The arrays the launch binds in place of numpy arguments (the plan's own tables among them).
        self.arrays = {"block_tables": plan.block_tables, "seq_lens": plan.seq_lens}
        self._owned = []
        try:
            for name in ("query", "key_cache", "value_cache"):
                if isinstance(args[name], np.ndarray):
                    self.arrays[name] = empty(args[name].shape, args[name].dtype, dev)
                    self._owned.append(self.arrays[name])
            # The output comes back through the staging unless the caller gave a DeviceArray for it.
            self.out = None if type(out) is DeviceArray else empty(args["query"].shape, plan.query_dtype, dev)
            if self.out is not None:
                self._owned.append(self.out)
            self.inputs, staged_in, offset = [], [], 0   # staged: (segment buffer, staging offset)
            for name in self.IN:
                if isinstance(args[name], np.ndarray):
                    self.inputs.append((name, offset))
                    offset = _stage(staged_in, self.arrays[name], offset)
            self.out_offset, staged_out = offset, []
            if self.out is not None:
                offset = _stage(staged_out, self.out, offset)
            self.staging = dev.host_buffer(offset)
            self.transfers = Transfers([(self.staging, b, [(at, 0, b.nbytes)]) for b, at in staged_in],
                                       [(b, self.staging, [(0, at, b.nbytes)]) for b, at in staged_out])
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self.staging is None or self.staging.closed or self.plan.closed or self.plan.block_tables.closed

    def __call__(self, query, key_cache, value_cache, block_tables, seq_lens, out):
        """The call's result, or None when this entry was closed (evicted) first."""
        args = dict(zip(self.IN, (block_tables, seq_lens, query, key_cache, value_cache)))
        dev, plan = self.plan.device, self.plan
        with self.lock:   # one call at a time writes the staging
            if self.closed:
                return None
            for name, offset in self.inputs:
                dev.upload(self.staging, args[name], offset)
            bound = [self.arrays.get(name, args[name]) for name in ("query", "key_cache", "value_cache")]
            o = out if self.out is None else self.out
            plan._launch(*bound, o, num_blocks=key_cache.shape[0], cache=True, transfers=self.transfers)
            if self.out is None:
                return out
            result = dev.download(self.staging, self.out.nbytes, self.out_offset)
        result = result.view(self.out.dtype).reshape(self.out.shape)
        if out is None:
            return result
        out[...] = result
        return out

    def close(self) -> None:
        with self.lock:
            self.plan.close()
            for a in self._owned:
                a.close()
            if self.staging is not None:
                self.staging.close()
