"""Paged-attention prefill and its backward over ragged batches: each sequence's new tokens (its last q_len_s,
any number, zero included) attend over that sequence's cached keys and values (causal or not), in either
cache layout (pagedvk.ops.layouts) and any cache storage type (pagedvk.dtypes; the backward takes float32, float16
and bfloat16 caches). One module per kernel and storage type reads both layouts (the caches' strides travel in
the push constants) and both query forms, ragged [num_tokens, ...] with query_start_loc and fixed-q_len
[num_seqs, num_heads, q_len, ...] (the query strides do).

Each kernel (forward, dq, dk/dv) has a second module for devices with cooperative matrices
(VK_KHR_cooperative_matrix): shaders/<kernel>_coopmat.comp, same bindings and push constants (the forward's
attention variants included), for float16 queries and caches, and bfloat16 ones on devices with bfloat16
matrices (VK_KHR_shader_bfloat16), at head sizes 64 and 128. The forward's also has a WGSL one,
shaders/paged_prefill_coopmat.wgsl, for float16 (a WGSL plan's dq and dk/dv stay scalar). `matrix_kernel` is the
rule that picks them, from the device's listed multiplies; every variant runs on either forward kernel, so the
variants do not enter the choice.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import CACHE_TYPES, GRADIENT_CACHE_TYPES, QUERY_TYPES, fp8_scale, is_fp8, scaled, storage_type
from ..errors import UnsupportedFeatureError
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import (DELTA_ROWS_PER_THREAD, PAGED_BACKWARD_DELTA, PAGED_BACKWARD_DKDV, PAGED_BACKWARD_DQ,
                                 PAGED_PREFILL, PREFILL_WGSL_SHARED_BYTES, PrefillSpec, head_size_constant)
from ..kernels.matrix import MATRIX_KIND, MATRIX_SHAPE, matrix_unavailable, operand_type
from ..runtime.array import Array, DeviceArray, asarray, empty
from ..runtime.instance import DeviceInfo
from ..runtime.pipeline import Launch, fold_grid
from ..runtime.recording import refuse_recording
from . import checks
from .decode_plan import DecodePlan
from .layouts import bind_caches, cache_spec
from .opargs import backend_name, device_of, softmax_scale
from .variants import Variants, in_use as variants_in_use, refuse

MATRIX_ROWS = 64         # query rows (query, head) per workgroup of paged_prefill_coopmat (scalar: forward_rows)
# kernel="auto" on a device with the matrix kernel: sequences with fewer rows than this (short chunks) run the
# scalar kernel's small tiles in the same submission, where a 64-row matrix tile would be mostly empty and
# still walk the whole context. Decode tokens go to the decode kernel instead (_DecodePart).
MATRIX_MIN_ROWS = MATRIX_ROWS // 2
# The smallest block the matrix kernels take: their subgroups keep a window of 32 block ids, one per lane
# (prefill_matrix.glsl's block_window), which must cover two steps of 64 keys.
MATRIX_MIN_BLOCK_SIZE = 8
DKDV_KEYS = 16           # block tokens per workgroup of paged_backward_dkdv, at most (a whole smaller block)
MAX_GROUPS = 65535       # the fewest workgroups per grid dimension a Vulkan device may allow
PREFILL_KERNELS = ("auto", "scalar", "coopmat")


def matrix_kernel(info: DeviceInfo, features, backend: str, kv: str, q: str, head_size: int,
                  kernel: str = "auto", block_size: int = 16) -> str:
    """The forward's matrix kind for these arguments: "coopmat" where a module exists for them (GLSL: float16
    or bfloat16 caches and queries of one type; WGSL: float16; head size 64 or 128; blocks of at least
    MATRIX_MIN_BLOCK_SIZE tokens) and the device runs it (bfloat16: bfloat16 matrices too), else "" (the scalar
    kernel). A WGSL plan's backward runs the scalar
    kernels whatever this says (PrefillProblem.matrix_for).
    kernel="scalar" or "coopmat" forces the choice; "coopmat" raises ValueError where it cannot run."""
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, PREFILL_KERNELS))}, got {kernel!r}")
    if kernel == "scalar":
        return ""
    built = {(k, qq, h) for _, k, qq, h in PAGED_PREFILL.matrix_variants_for(backend)}
    why = matrix_unavailable(info, features, operand_type(kv, q), backend)
    if not why and (kv, q, head_size) not in built:
        sizes = ", ".join(str(h) for h in sorted({h for *_, h in PAGED_PREFILL.matrix_variants}))
        why = (f"the cooperative-matrix prefill is built for float16 or bfloat16 caches and queries (the same type; "
               f"backend 'wgsl': float16 only) at head sizes {sizes}, not backend {backend!r}, cache {kv}, "
               f"query {q}, head size {head_size}")
    if not why and block_size < MATRIX_MIN_BLOCK_SIZE:
        why = (f"the cooperative-matrix prefill and backward take blocks of {MATRIX_MIN_BLOCK_SIZE} tokens and more "
               f"(a subgroup's window of 32 block ids covers a step's keys), not {block_size}")
    if why and kernel == "coopmat":
        raise ValueError(f"kernel='coopmat' cannot run on {info.name}: {why}")
    return "" if why else MATRIX_KIND


def describe_choice(info: DeviceInfo) -> str:
    """The prefill kernels (forward and backward) a device gets, in words (`pagedvk devices`)."""
    why = matrix_unavailable(info)
    if why:
        return f"scalar (no cooperative matrices: {why})"
    sizes = ", ".join(str(h) for h in sorted({h for *_, h in PAGED_PREFILL.matrix_variants}))
    types = "float16 or bfloat16" if not matrix_unavailable(info, operand="bf16") else "float16"
    return (f"coopmat ({MATRIX_SHAPE}) for {types} caches and queries at head sizes {sizes}, forward and backward "
            f"(WGSL plans: the forward, for float16); scalar otherwise")


def forward_rows(head_size: int, rows: np.ndarray) -> np.ndarray:
    """Query rows (query, head) per workgroup of paged_prefill and paged_backward_dq for sequences of `rows` rows
    each (group * q_len_s): the fewest of 8, 16, 32 and 64 that hold them, at most 64, or 32 above head size 128
    so that each thread's share of the output stays 64 floats. The kernels' tile_rows() is the same rule."""
    most = 64 if head_size <= 128 else 32
    tile = np.full(np.shape(rows), 8, np.int64)
    for _ in range(3):
        tile = np.where((tile < rows) & (tile < most), 2 * tile, tile)
    return tile


def _check_query_start_loc(query_start_loc, num_tokens: int) -> np.ndarray:
    """query_start_loc of a ragged query: int32 [num_seqs + 1], 0 first, non-decreasing, num_tokens last. Read on
    the host whatever validate says: the tile table is built from it."""
    if query_start_loc is None:
        raise TypeError("query_start_loc (int32 [num_seqs + 1]) is required with a ragged query "
                        "[num_tokens, num_heads, head_size]")
    checks.kind("query_start_loc", query_start_loc)
    checks.ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    checks.dtype("query_start_loc", query_start_loc, [np.int32])
    loc = checks.host(query_start_loc)
    if len(loc) < 1:
        raise ValueError("query_start_loc must have num_seqs + 1 >= 1 entries, got 0")
    if loc[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(loc[0])}")
    down = np.flatnonzero(np.diff(loc) < 0)
    if down.size:
        s = int(down[0])
        raise ValueError(f"query_start_loc must be non-decreasing: query_start_loc[{s + 1}] = {int(loc[s + 1])} "
                         f"< query_start_loc[{s}] = {int(loc[s])}")
    if loc[-1] != num_tokens:
        raise ValueError(f"query_start_loc[-1] must be num_tokens (query.shape[0]) = {num_tokens}, "
                         f"got {int(loc[-1])}")
    return np.array(loc, np.int32)


def _check_lengths(seq_lens: np.ndarray, q_lens: np.ndarray, ragged: bool) -> None:
    """A sequence's queries are the last of its seq_lens tokens: q_len_s <= seq_lens[s] (the fixed-q_len form
    also allows an empty sequence, seq_lens[s] = 0, whose queries see nothing)."""
    short = np.flatnonzero((seq_lens < q_lens) & (ragged | (seq_lens > 0)))
    if not short.size:
        return
    s = int(short[0])
    if ragged:
        raise ValueError(f"seq_lens[{s}] = {int(seq_lens[s])} is less than q_len_s = query_start_loc[{s + 1}] - "
                         f"query_start_loc[{s}] = {int(q_lens[s])}: a sequence's queries are the last q_len_s of "
                         f"its seq_lens tokens")
    raise ValueError(f"seq_lens[{s}] = {int(seq_lens[s])} is less than q_len (query.shape[2]) = {int(q_lens[s])}: "
                     f"the queries are each sequence's last q_len tokens (0, an empty sequence, is allowed)")


def work_tiles(query_start_loc: np.ndarray, group: int, rows_per_tile, include=None) -> np.ndarray:
    """The tile table of a ragged batch (PREFILL_INPUTS in pagedvk/kernels/abi.py): int32 [num_tiles, 2], the
    (sequence, first row) of each tile of rows_per_tile rows (one number, or a function of a sequence's row
    counts giving each sequence's), in sequence order. Sequence s has group * q_len_s rows (group =
    num_heads / num_kv_heads), so ceil(group * q_len_s / its rows per tile) tiles, none when it has no queries."""
    q_lens = np.diff(np.asarray(query_start_loc, np.int64))
    rows = group * q_lens
    per_seq = np.broadcast_to(rows_per_tile(rows) if callable(rows_per_tile) else rows_per_tile, rows.shape)
    counts = -(-rows // per_seq)
    if include is not None:   # only these sequences (a bool per sequence)
        counts = np.where(include, counts, 0)
    seqs = np.repeat(np.arange(len(q_lens)), counts)
    firsts = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([seqs, firsts * per_seq[seqs]], axis=1).astype(np.int32).reshape(-1, 2)


class PrefillProblem:
    """The checked arguments of one call: dims, device, backend, the batch's layout and the push constants."""

    def __init__(self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale=None, causal=True,
                 layout="vllm", backend=None, validate=True, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                 cache_types=CACHE_TYPES, kernel="auto"):
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, not {type(causal).__name__}")
        checks.kind("query", query, strided=True)   # a fused QKV projection's query columns, say
        self.ragged = len(query.shape) == 3
        if not self.ragged and isinstance(query, DeviceArray) and not query.is_contiguous:
            raise ValueError(f"query is a strided view (strides {query.strides}) of the fixed-q_len form [num_seqs, "
                             "num_heads, q_len, head_size]: only a ragged query [num_tokens, num_heads, head_size] "
                             "(with query_start_loc) may have its rows apart")
        if len(query.shape) not in (3, 4):
            raise ValueError(f"query must have 3 dimensions [num_tokens, num_heads, head_size] (with query_start_loc) "
                             f"or 4 [num_seqs, num_heads, q_len, head_size], got shape {tuple(query.shape)}")
        self.query_type = storage_type("query", query, QUERY_TYPES)
        spec = self.spec = cache_spec(key_cache, value_cache, layout, kv_cache_dtype, cache_types)
        self.num_heads, self.head_size = query.shape[1], query.shape[-1]
        self.num_kv_heads, self.block_size, self.num_blocks = spec.num_kv_heads, spec.block_size, spec.num_blocks
        checks.dim("query", query, len(query.shape) - 1, spec.head_size, "head_size, from the caches")
        if self.num_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"query.shape[1] (num_heads) must be a positive multiple of num_kv_heads "
                             f"({self.num_kv_heads}, from the caches), got {self.num_heads}")
        if self.ragged:
            self.query_start_loc = _check_query_start_loc(query_start_loc, query.shape[0])
            self.num_seqs = len(self.query_start_loc) - 1
            q_lens = np.diff(self.query_start_loc)
            checks.tables(block_tables, seq_lens, self.num_seqs, "query_start_loc")
            strides = dict(q_token_stride=self.num_heads, q_head_stride=1)
        else:
            if query_start_loc is not None:
                raise ValueError("query_start_loc goes with a ragged query [num_tokens, num_heads, head_size]; a "
                                 "query [num_seqs, num_heads, q_len, head_size] has q_len queries per sequence")
            self.num_seqs, q_len = query.shape[0], query.shape[2]
            if q_len < 1:
                raise ValueError(f"query.shape[2] (q_len) must be at least 1, got {q_len}")
            self.query_start_loc = (np.arange(self.num_seqs + 1) * q_len).astype(np.int32)
            q_lens = np.full(self.num_seqs, q_len)
            checks.tables(block_tables, seq_lens, self.num_seqs, "query")
            strides = dict(q_token_stride=1, q_head_stride=q_len)
        self.num_tokens = int(self.query_start_loc[-1])
        if validate:
            checks.block_table_values(block_tables, seq_lens, self.block_size, self.num_blocks)
            _check_lengths(checks.host(seq_lens), q_lens, self.ragged)
        self.block_tables, self.seq_lens = block_tables, seq_lens

        self.scale = softmax_scale(scale, self.head_size)
        k_scale, v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
        # Other caches ignore the scales, as vLLM does (kv_cache_dtype "auto").
        self.k_scale, self.v_scale = k_scale, v_scale = (k_scale, v_scale) if is_fp8(spec.storage) else (1.0, 1.0)
        self.decode_part = None   # the forward's decode tokens, where the decode kernel takes them (_DecodePart)
        self.causal = bool(causal)
        self.backend = backend_name(backend)
        self.device = device_of(query, key_cache, value_cache, block_tables, seq_lens,
                                *([query_start_loc] if self.ragged else []))
        self.host = isinstance(query, np.ndarray)
        # The kernels' matrix kind ("" scalar), the forward's and the backward's alike.
        self.matrix = matrix_kernel(self.device.info, self.device.features, self.backend, spec.storage.tag,
                                    self.query_type.tag, self.head_size, kernel, spec.block_size)
        self.kernel = kernel
        # num_blocks is the caches' shape[0]: their buffers (and dk_cache's, dv_cache's) hold that many blocks,
        # and the kernels bound block ids by it rather than by the buffers' length() (attention_common.glsl).
        self.push_fields = dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_size=self.block_size, max_blocks_per_seq=block_tables.shape[1], num_blocks=self.num_blocks,
            num_seqs=self.num_seqs, causal=int(self.causal), scale=scaled("k_scale", self.scale, k_scale),
            v_scale=v_scale, group_size=1, partition_size=0, num_partitions=1, softcap=0.0, window=0, variants=0,
            q_type=q_type_code(self.query_type.tag), **strides, **spec.strides())
        self.query_start_loc_arg = query_start_loc if self.ragged else self.query_start_loc
        # Device buffers a launch allocates for itself and frees with it, name -> (shape, dtype): the backward's
        # delta (PAGED_BACKWARD_DELTA), written by one dispatch and read by the next.
        self.scratch = {}

    def query_row_bytes(self) -> int:
        """Bytes of one query token (all its heads): a row of the ragged query and out."""
        return self.num_heads * self.head_size * self.query_type.dtype.itemsize

    def tiles(self, rows_per_tile, include=None) -> np.ndarray:
        return work_tiles(self.query_start_loc, self.num_heads // self.num_kv_heads, rows_per_tile, include)

    def matrix_for(self, kernel) -> str:
        """The problem's matrix kind where `kernel` has matrix modules in the plan's backend (WGSL: the forward
        only), else "" (its scalar module)."""
        return self.matrix if self.backend in kernel.matrix_backends else ""

    def key(self, kernel, access: str = "", matrix: str | None = None):
        """The module of `kernel` of the matrix kind `matrix` ("" scalar), the problem's by default (matrix_for)."""
        matrix = self.matrix_for(kernel) if matrix is None else matrix
        if not kernel.kv_types:   # reads no cache (the backward's delta): one module per query type
            return kernel.key(self.backend, q=self.query_type.tag)
        if matrix:
            return kernel.key(self.backend, self.spec.storage.tag, self.query_type.tag, self.head_size, access,
                              matrix)
        return kernel.key(self.backend, self.spec.storage.tag, self.query_type.tag, access=access)

    def push(self, caches, arrays: dict) -> bytes:
        """The push constants for caches bound as `caches` (pagedvk.ops.layouts.CacheBinding) and the launch's
        `arrays`: the query's and out's token pitch (a view's rows may lie apart; the fixed-q_len form and the
        backward's arrays are contiguous, num_heads * head_size)."""
        row = self.num_heads * self.head_size
        pitch = {name: checks.token_pitch(arrays[name], row) if self.ragged and name in arrays else row
                 for name in ("query", "out")}
        return PAGED_PREFILL.pack_push(**dict(
            self.push_fields, blocks_per_segment=caches.blocks_per_segment,
            num_blocks=self.spec.blocks_held(caches.key_bytes, caches.value_bytes), q_pitch=pitch["query"],
            out_pitch=pitch["out"]))

    def grid(self, tiles: np.ndarray) -> tuple:
        """Workgroups (kv head, tile), numbered linearly over a grid folded to the device's limits."""
        return fold_grid(len(tiles) * self.num_kv_heads, self.device.info.max_workgroup_count)

    def check_like(self, name: str, a, shape: tuple, layout: str, dtype, strided: bool = False) -> None:
        checks.kind(name, a, strided=strided and self.ragged)
        if name == "out":
            checks.writable(name, a)
        checks.ndim(name, a, len(shape), layout)
        checks.dtype(name, a, [dtype])
        if tuple(a.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} {layout}, got {tuple(a.shape)}")
        device_of(a, device=self.device)

    def block_readers(self) -> np.ndarray:
        """int32 [num_blocks + 1 offsets, then one entry per (sequence, slot) reading a block]: the pairs
        reading block b are entries offsets[b] .. offsets[b + 1], each sequence * max_blocks_per_seq + slot,
        in sequence order. Built on the host; unchecked tables (validate=False) are bounded here as the
        kernels bound them: lengths clamped to [0, the row's capacity], ids outside the cache left out."""
        bt, lens = checks.host(self.block_tables), checks.host(self.seq_lens).astype(np.int64)
        used = (np.clip(lens, 0, bt.shape[1] * self.block_size) + self.block_size - 1) // self.block_size
        seqs, slots = np.nonzero(np.arange(bt.shape[1])[None, :] < used[:, None])
        ids = bt[seqs, slots].astype(np.int64)
        inside = (ids >= 0) & (ids < self.num_blocks)
        seqs, slots, ids = seqs[inside], slots[inside], ids[inside]
        order = np.argsort(ids, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(ids, minlength=self.num_blocks))])
        return np.concatenate([offsets, (seqs * bt.shape[1] + slots)[order]]).astype(np.int32)


def _launch(problem: PrefillProblem, dispatches, arrays: dict, timestamps: bool = False) -> Launch:
    """The dispatches recorded (see _steps). A forward's decode tokens (_DecodePart) are dispatched after the
    prefill tiles with no barrier in between, and so are the two kinds of prefill tiles: each writes other rows of
    out and lse and only reads the rest, and the decode kernel's workgroups run where the prefill's leave room
    in place of after its last tile. The decode's merge of split contexts, where there is one, comes after a
    barrier. (The decode dispatched first made the prefill tiles wait for room and the batch slower.) Dispatches of
    one `group` (_steps) run side by side too."""
    steps, independent = _steps(problem, dispatches, arrays)
    if problem.decode_part is None:
        return Launch(problem.device, steps, timestamps=timestamps, independent=independent)
    decode = problem.decode_part.steps(arrays)
    return Launch(problem.device, steps + decode, timestamps=timestamps,
                  independent=frozenset(range(1, len(steps) + 1)))


def _steps(problem: PrefillProblem, dispatches, arrays: dict) -> tuple:
    """([(pipeline, buffers, push constants, grid)], independent step indices) of the dispatches with workgroups:
    each dispatch's buffers bound by the names
    its ABI declares, from `arrays` (DeviceArrays); the forward's decode tokens are not among them (_launch). A
    dispatch is (kernel ABI, grid) or (kernel ABI, grid, options): options["matrix"] the forward's matrix kind
    for this dispatch ("" scalar), options["inputs"] {binding name: name in arrays} where a binding takes another
    array (a second tile table); options["group"] a name shared by dispatches that read nothing another of them
    writes (the forward's matrix and scalar tiles; dq and dk/dv): each is recorded with no barrier after the one
    before it where that one is of its group, so they run side by side; every other dispatch follows a barrier."""
    caches = bind_caches(arrays["key_cache"], arrays["value_cache"], problem.backend)
    bound = dict(key_cache=caches.key, value_cache=caches.value)
    steps, independent, last_group = [], set(), None
    for abi, grid, *options in dispatches:
        if math.prod(grid) == 0:
            continue
        options = options[0] if options else {}
        group = options.get("group")
        if steps and group is not None and group == last_group:
            independent.add(len(steps))
        last_group = group
        key = problem.key(abi, caches.access, options.get("matrix"))
        renamed = options.get("inputs", {})
        extra = dict(zip([b.name for b in abi.bindings_for(key)[len(abi.bindings):]], caches.extra))
        buffers = [bound.get(b.name) or extra.get(b.name) or arrays[renamed.get(b.name, b.name)].buffer
                   for b in abi.bindings_for(key)]
        pipeline = modules.pipeline(problem.device, abi, key, variants_in_use(problem.push_fields),
                                    {**abi.q_type_constant(problem.query_type.tag),
                                     **head_size_constant(PrefillSpec.HEAD_SIZE, problem.head_size)})
        steps.append((pipeline, buffers, problem.push(caches, arrays), grid))
    return steps, frozenset(independent)


def _run(problem: PrefillProblem, dispatches, inputs: dict, outputs: dict, given: dict | None = None) -> tuple:
    """Run the dispatches ((kernel ABI, grid) in order, one submission) on `inputs` (copied to the device when
    on the host) and outputs allocated as `outputs` says (name -> (shape, dtype)); an output in `given` is
    written instead, a DeviceArray in place, a numpy array filled from the result. Returns the outputs in order,
    as numpy arrays when the query came from the host, else as DeviceArrays. A batch without queries launches
    nothing (its outputs have no rows, and buffers of no bytes cannot be bound)."""
    refuse_recording("paged_attention_prefill and paged_attention_backward", problem.device)
    given = {name: a for name, a in (given or {}).items() if a is not None}
    if problem.num_tokens == 0:
        made = {name: np.zeros(shape, dtype) for name, (shape, dtype) in outputs.items()}
        if problem.host:
            return tuple(made[name] if name not in given else given[name] for name in outputs)
        return tuple(given[name] if name in given else asarray(a, device=problem.device) for name, a in made.items())
    temporaries, results = [], {}
    try:
        arrays = {}
        for name, a in inputs.items():
            arrays[name] = asarray(a, device=problem.device)
            if arrays[name] is not a:
                temporaries.append(arrays[name])
        for name, (shape, dtype) in outputs.items():
            if isinstance(given.get(name), DeviceArray):
                arrays[name] = given[name]
            else:
                results[name] = arrays[name] = empty(shape, dtype, problem.device)
        for name, (shape, dtype) in problem.scratch.items():
            arrays[name] = empty(shape, dtype, problem.device)
            temporaries.append(arrays[name])
        launch = _launch(problem, dispatches, arrays)
        try:
            launch.enqueue()   # host results wait below, in numpy()
        finally:
            launch.close()
        for name, a in given.items():
            if isinstance(a, np.ndarray):
                a[...] = results[name].numpy()
        if problem.host:
            return tuple(given[name] if name in given else results[name].numpy() for name in outputs)
        handed = tuple(given.get(name, arrays[name]) for name in outputs)
        results = {name: a for name, a in results.items() if name in given}   # only the copies to numpy outs
        return handed
    finally:
        for a in temporaries + list(results.values()):
            a.close()
        if problem.decode_part is not None:
            problem.decode_part.close()


QUERY_DOC = """\
query : DeviceArray or ndarray, shape (num_tokens, num_heads, head_size) or (num_seqs, num_heads, q_len, head_size)
        float32, float16 or bfloat16: ragged, with query_start_loc, or q_len queries per sequence.
    query_start_loc : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs + 1,), int32, optional
        With a ragged query only, None otherwise (vLLM's query_start_loc, FlashInfer's qo_indptr): sequence s owns
        query tokens query_start_loc[s] .. query_start_loc[s + 1] - 1, q_len_s of them (0 allowed), the last
        q_len_s of its seq_lens[s] tokens; 0 first, non-decreasing, num_tokens last."""


def paged_attention_prefill(query: Array, key_cache: Array, value_cache: Array, block_tables: Array, seq_lens: Array,
                            query_start_loc: Array | None = None, *, scale: float | None = None, causal: bool = True,
                            layout: str = "vllm", kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                            v_scale: float = 1.0, backend: str | None = None, validate: bool = True,
                            out: Array | None = None, alibi_slopes: Array | None = None,
                            logits_soft_cap: float | None = None, sinks: Array | None = None,
                            window_left: int = -1, kernel: str = "auto") -> tuple[Array, Array]:
    """Attention of each sequence's new tokens (its last q_len_s positions) over its paged KV cache.

    A ragged batch of prompts, prompt chunks and decode tokens (q_len_s = 1) in one launch.

    Parameters
    ----------
    {query}
    key_cache, value_cache : DeviceArray or numpy.ndarray
        Layout "nhd": shape (num_blocks, block_size, num_kv_heads, head_size); "hnd": (num_blocks, num_kv_heads,
        block_size, head_size); or "vllm" (pagedvk.ops.layouts). float32, float16, bfloat16, float8_e4m3fn or
        float8_e5m2 (or uint8 with vLLM's kv_cache_dtype and k_scale / v_scale). num_heads is a multiple of
        num_kv_heads (GQA/MQA); head_size a multiple of 4 up to 256; block_size 8, 16 or 32, and in "nhd" and
        "hnd" also 1, 2 or 4.
    block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
        Physical block ids.
    seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        Tokens per sequence, the new ones included (vLLM's seq_lens); at least q_len_s (the fixed-q_len form also
        takes 0, an empty sequence: zeros out, lse -inf).
    scale : float, optional
        Softmax scale; None means 1 / sqrt(head_size). Accumulation is float32.
    causal : bool, default True
        Query i of sequence s (position seq_lens[s] - q_len_s + i) sees keys 0 .. that position; False: all keys.
    layout : "vllm", "nhd" or "hnd", default "vllm"
        The caches' layout, as for `paged_attention`, `DecodePlan` and `KVCache` (the one default everywhere).
    kv_cache_dtype : "auto", "fp8", "fp8_e4m3" or "fp8_e5m2", default "auto"
        How uint8 caches are read (vLLM's names); "auto" reads the caches' own dtype.
    k_scale, v_scale : float, default 1.0
        fp8 caches hold key / k_scale and value / v_scale; other caches ignore them.
    backend : "glsl" or "wgsl", optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        False skips the checks of the tables' values (as DecodePlan's): the kernels bound every index themselves,
        so bad values give wrong rows for their sequences, never an access outside a buffer. query_start_loc is
        always checked (the launch's tile table is built from it on the host).
    out : DeviceArray or numpy.ndarray, optional
        The query's shape and dtype: written with the result and returned (a DeviceArray in place, a numpy array
        filled), as vLLM's ops take it. None allocates it.
    alibi_slopes : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
    logits_soft_cap : float, optional
    sinks : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
    window_left : int, default -1
        The attention variants (pagedvk.ops.variants); None (-1 for window_left) turns each off. The window
        counts back from each query's own position.
    kernel : "auto", "scalar" or "coopmat", default "auto"
        "auto": the cooperative-matrix kernel where the device has one for these arguments (matrix_kernel), else
        the scalar one; "scalar" or "coopmat" force it. The matrix kernel multiplies in float16 (bfloat16 for
        bfloat16 caches and queries), accumulating in float32.

    Returns
    -------
    out : DeviceArray or numpy.ndarray
        The query's shape and dtype.
    lse : DeviceArray or numpy.ndarray, float32
        The query's shape without its head_size axis: (num_tokens, num_heads) or (num_seqs, num_heads, q_len);
        the natural-log sum of exp(logit) over the keys seen and the sink (FlashInfer's, in natural log).
        Both are numpy for a numpy query, DeviceArrays for a DeviceArray query.

    Raises
    ------
    ValueError
        A bad argument; also kernel="coopmat" where it cannot run.
    TypeError
        An argument of the wrong kind or dtype.
    UnsupportedFeatureError
        The WGSL forward on a device with too little workgroup memory.

    Examples
    --------
    >>> out, lse = pagedvk.paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    """
    return _run(*_forward(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale=scale,
                          causal=causal, layout=layout, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                          v_scale=v_scale, backend=backend, validate=validate, alibi_slopes=alibi_slopes,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, window_left=window_left, kernel=kernel),
                dict(out=out))


def _int_arguments(block_tables, seq_lens, query_start_loc) -> tuple:
    """The three int arguments, Python sequences made int32 arrays (checks.ints)."""
    return (checks.ints("block_tables", block_tables), checks.ints("seq_lens", seq_lens),
            checks.ints("query_start_loc", query_start_loc))


def _bindable(tiles: np.ndarray) -> np.ndarray:
    """A tile table a buffer can hold: one unread row where it has none (its dispatch has no workgroups)."""
    return tiles if len(tiles) else np.zeros((1, 2), np.int32)


def _tiled(p: PrefillProblem, kernel, include: np.ndarray) -> tuple:
    """(dispatches, tile tables) of a tiled kernel (the forward, dq) over the sequences in `include`: the scalar
    module's tiles (forward_rows) where the problem has no matrix kind; else 64-row matrix tiles, and under
    kernel="auto" the short sequences' (fewer than MATRIX_MIN_ROWS rows) scalar tiles in a second dispatch of
    the same submission, binding its own table."""
    scalar_rows = lambda rows: forward_rows(p.head_size, rows)
    if not p.matrix_for(kernel):
        tiles = p.tiles(scalar_rows, include=include)
        return [(kernel, p.grid(tiles), dict(group="tiles"))], dict(tiles=_bindable(tiles))
    rows = (p.num_heads // p.num_kv_heads) * np.diff(p.query_start_loc)
    short = rows < MATRIX_MIN_ROWS if p.kernel == "auto" else np.zeros(len(rows), bool)
    tiles = p.tiles(MATRIX_ROWS, include=include & ~short)
    scalar_tiles = p.tiles(scalar_rows, include=include & short)
    return ([(kernel, p.grid(tiles), dict(group="tiles")),
             (kernel, p.grid(scalar_tiles), dict(matrix="", inputs=dict(tiles="scalar_tiles"), group="tiles"))],
            dict(tiles=_bindable(tiles), scalar_tiles=_bindable(scalar_tiles)))


def _forward(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out=None, alibi_slopes=None,
             logits_soft_cap=None, sinks=None, window_left=-1, **options) -> tuple:
    """The checked forward: (problem, dispatches, inputs, outputs) for _run or launch()."""
    block_tables, seq_lens, query_start_loc = _int_arguments(block_tables, seq_lens, query_start_loc)
    p = PrefillProblem(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, **options)
    info = p.device.info
    if p.backend == "wgsl" and info.max_shared_memory < PREFILL_WGSL_SHARED_BYTES:
        raise UnsupportedFeatureError(
            f"the WGSL prefill forward needs {PREFILL_WGSL_SHARED_BYTES} bytes of workgroup memory; {info.name} offers "
            f"{info.max_shared_memory} (maxComputeSharedMemorySize): use backend='glsl'")
    if out is not None:   # a view whose rows lie apart (a ragged out inside a wider array) is written at its pitch
        p.check_like("out", out, tuple(query.shape), "(the query's shape)", query.dtype, strided=True)
    variants = Variants(p.num_heads, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sinks=sinks,
                        window_left=window_left)
    device_of(*variants.inputs.values(), device=p.device)
    p.push_fields.update(variants.push())
    q_lens = np.diff(p.query_start_loc)
    tokens = decode_tokens(p, q_lens, query, out) if p.kernel == "auto" else None
    rest = np.ones(len(q_lens), bool)   # the sequences the prefill kernels take
    if tokens is not None:
        p.decode_part = _DecodePart(p, *tokens, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                                    sinks=sinks, window_left=window_left)
        rest[tokens[0]:tokens[1]] = False
    dispatches, tiles = _tiled(p, PAGED_PREFILL, rest)
    return (p, dispatches,
            dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                 seq_lens=seq_lens, query_start_loc=p.query_start_loc_arg, **tiles, **variants.inputs),
            dict(out=(tuple(query.shape), query.dtype), lse=(tuple(query.shape[:-1]), np.float32)))


def decode_tokens(p: PrefillProblem, q_lens: np.ndarray, query=None, out=None) -> tuple | None:
    """(s0, s1): the batch's decode tokens (sequences of one new token) where the decode kernel can take them in
    the forward's launch, else None. They must be consecutive sequences (vLLM and FlashInfer batch decode
    requests together), so that their query, out and lse rows are one range of each buffer (at the query's and
    out's row pitch, where they are views), bound at an offset the device allows."""
    single = np.flatnonzero(q_lens == 1)
    if single.size == 0 or single[-1] - single[0] + 1 != single.size:
        return None
    s0, s1 = int(single[0]), int(single[-1]) + 1
    r0 = int(p.query_start_loc[s0])
    align = p.device.info.min_storage_buffer_offset_alignment

    def start(a):   # where row r0 of query or out lies in the buffer it is bound from
        if isinstance(a, DeviceArray) and not a.closed:
            return a.buffer.offset + r0 * a.strides[0]
        return r0 * p.query_row_bytes()   # a numpy array, or an out the op allocates: contiguous from byte 0

    if start(query) % align or start(out) % align or (r0 * p.num_heads * 4) % align:
        return None
    return s0, s1


class _DecodePart:
    """The forward's decode tokens, sequences s0 .. s1 - 1, run by the decode kernel (pagedvk.ops.decode) in the
    forward's submission: a prefill tile of one token per head group would still walk the whole context alone,
    where the decode kernel reads it at bandwidth and splits long contexts. A mixed batch of 2 x 512 new tokens
    and 64 decode tokens over 4096 cached ones took 2.78 ms through the matrix kernel alone and 4.23 ms with the
    tokens on the scalar kernel; with them on the decode kernel, dispatched beside the prefill tiles (_launch),
    1.92 ms, against 1.99 ms as separate prefill and decode calls (H200, float16). The tables' rows are read to
    the host (small; device tables are read back)."""

    def __init__(self, p: PrefillProblem, s0: int, s1: int, **variants):
        self.rows, self.views, self.sequences = (int(p.query_start_loc[s0]), s1 - s0), (), (s0, s1)
        self.query_type, self.num_heads, self.head_size = p.query_type, p.num_heads, p.head_size
        self.row_bytes = p.query_row_bytes()
        tables, lens = checks.host(p.block_tables)[s0:s1], checks.host(p.seq_lens)[s0:s1]
        self.plan = DecodePlan(tables, lens, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
                               head_size=p.head_size, block_size=p.block_size, num_blocks=p.num_blocks,
                               dtype=p.spec.storage.dtype, query_dtype=p.query_type.dtype, layout=p.spec.layout,
                               scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, device=p.device,
                               backend=p.backend, validate=False, **variants)

    def update(self, block_tables, seq_lens) -> None:
        """The next step's tables (a PrefillPlan kept this part): its rows of them, into its plan in place."""
        s0, s1 = self.sequences
        self.plan.update(checks.host(block_tables)[s0:s1], checks.host(seq_lens)[s0:s1], validate=False)

    def steps(self, arrays: dict) -> list:
        """The decode kernel's dispatches over the tokens' rows of query, out and lse (views, no copies)."""
        r0, n = self.rows
        # Row views of query, out (at their pitch, where they are views themselves) and lse.
        query, out, lse = (arrays[name][r0:r0 + n] for name in ("query", "out", "lse"))
        self.views = (query, out, lse)   # a launch binds its arrays weakly: these must outlive it
        return self.plan.steps(query, arrays["key_cache"], arrays["value_cache"], out,
                                arrays["key_cache"].shape[0], lse=lse)

    def close(self) -> None:
        self.views = ()
        self.plan.close()


def paged_attention_backward(dout: Array, query: Array, key_cache: Array, value_cache: Array, block_tables: Array,
                             seq_lens: Array, out: Array, lse: Array, query_start_loc: Array | None = None, *,
                             scale: float | None = None, causal: bool = True, layout: str = "vllm",
                             backend: str | None = None, validate: bool = True, alibi_slopes: Array | None = None,
                             logits_soft_cap: float | None = None, sinks: Array | None = None, window_left: int = -1,
                             kernel: str = "auto") -> tuple[Array, Array, Array]:
    """Gradients of `paged_attention_prefill`: (dq, dk_cache, dv_cache) for the upstream gradient dout.

    Where several sequences read one physical block their gradients add up (in a fixed order, so results are
    deterministic), and slots no sequence reads get zero. The attention variants are not supported here yet.

    Parameters
    ----------
    dout : DeviceArray or numpy.ndarray
        The query's shape and dtype.
    {query}
    key_cache, value_cache : DeviceArray or numpy.ndarray
        float32, float16 or bfloat16, in any layout (see `paged_attention_prefill` for their shapes).
    block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
    seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
    out : DeviceArray or numpy.ndarray
        What paged_attention_prefill returned for these arguments: the query's shape and dtype.
    lse : DeviceArray or numpy.ndarray, float32
        What paged_attention_prefill returned: the query's shape without head_size.
    scale, causal, layout, backend, validate
        As for `paged_attention_prefill`.
    alibi_slopes, logits_soft_cap, sinks, window_left
        Accepted, so that a forward's arguments can be passed on, and refused (ValueError) unless off (None,
        -1 for window_left).
    kernel : "auto", "scalar" or "coopmat", default "auto"
        As for paged_attention_prefill: the cooperative-matrix dq and dk/dv kernels multiply in float16
        (bfloat16 for bfloat16 caches and queries; P and dS rounded to it), accumulating in float32.

    Returns
    -------
    dq : DeviceArray or numpy.ndarray, float32
        The query's shape.
    dk_cache, dv_cache : DeviceArray or numpy.ndarray, float32
        The caches' shapes and layout. All three accumulate in float32; numpy for a numpy query, DeviceArrays
        for a DeviceArray query.

    Examples
    --------
    >>> dq, dk, dv = pagedvk.paged_attention_backward(dout, q, key_cache, value_cache, block_tables, seq_lens, out, lse,
    ...                                               query_start_loc)
    """
    refuse("paged_attention_backward", alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sinks=sinks,
           window_left=window_left)
    return _run(*_backward(dout, query, key_cache, value_cache, block_tables, seq_lens, out, lse, query_start_loc,
                           scale=scale, causal=causal, layout=layout, backend=backend, validate=validate,
                           kernel=kernel))


def _backward(dout, query, key_cache, value_cache, block_tables, seq_lens, out, lse, query_start_loc,
              **options) -> tuple:
    """The checked backward: (problem, dispatches, inputs, outputs) for _run or launch()."""
    block_tables, seq_lens, query_start_loc = _int_arguments(block_tables, seq_lens, query_start_loc)
    checks.kind("query", query)   # the backward reads contiguous queries only: a strided view is refused by name
    p = PrefillProblem(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                 cache_types=GRADIENT_CACHE_TYPES, **options)
    query_layout = "(the query's shape)"
    p.check_like("dout", dout, tuple(query.shape), query_layout, query.dtype)
    p.check_like("out", out, tuple(query.shape), query_layout, query.dtype)
    p.check_like("lse", lse, tuple(query.shape[:-1]), "(the query's shape without head_size)", np.float32)
    # D = rowsum(dout * out) once per row, into the launch's scratch delta (lse's shape), before dq and dk/dv read it.
    p.scratch["delta"] = (tuple(query.shape[:-1]), np.float32)
    delta_groups = -(-p.num_tokens * p.num_heads // (PAGED_BACKWARD_DELTA.workgroup_size[0] * DELTA_ROWS_PER_THREAD))
    delta_dispatch = (PAGED_BACKWARD_DELTA, fold_grid(delta_groups, p.device.info.max_workgroup_count))
    dq_dispatches, tiles = _tiled(p, PAGED_BACKWARD_DQ, np.ones(p.num_seqs, bool))
    inputs = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  seq_lens=seq_lens, query_start_loc=p.query_start_loc_arg, **tiles, dout=dout, out=out, lse=lse,
                  block_readers=p.block_readers())
    dkdv_grid = (min(p.num_blocks, MAX_GROUPS), p.num_kv_heads, -(-p.block_size // DKDV_KEYS))
    # dq and dk/dv read what delta wrote (one barrier after it) and nothing of each other's: side by side (3630
    # against 3704 us with a barrier between them on the H200 at issue 12's shape; docs/benchmarks-log.md, 2026-12-03).
    return (p, [delta_dispatch] + dq_dispatches + [(PAGED_BACKWARD_DKDV, dkdv_grid, dict(group="tiles"))], inputs,
            dict(dq=(tuple(query.shape), np.float32), dk_cache=(tuple(key_cache.shape), np.float32),
                 dv_cache=(tuple(value_cache.shape), np.float32)))


class Recorded:
    """A forward or backward recorded once over device arrays, to run again and again (benchmarks): `launch`
    (pagedvk.runtime.pipeline.Launch; submit() returns the GPU time in ns), `outputs` (DeviceArrays, as the op
    returns them). close() frees the launch, the outputs and the tables uploaded for it."""

    def __init__(self, problem: PrefillProblem, dispatches, inputs: dict, outputs: dict):
        self._owned, self.problem = [], problem
        arrays = {}
        for name, a in inputs.items():
            arrays[name] = asarray(a, device=problem.device)
            if arrays[name] is not a:
                self._owned.append(arrays[name])
        for name, (shape, dtype) in outputs.items():
            arrays[name] = empty(shape, dtype, problem.device)
            self._owned.append(arrays[name])
        self.outputs = tuple(arrays[name] for name in outputs)
        self.scratch = {}   # the launch's own buffers (PrefillProblem.scratch), kept for tests to read or poison
        for name, (shape, dtype) in problem.scratch.items():
            self.scratch[name] = arrays[name] = empty(shape, dtype, problem.device)
            self._owned.append(arrays[name])
        self.launch = _launch(problem, dispatches, arrays, timestamps=True)

    @classmethod
    def forward(cls, *args, **options) -> "Recorded":
        """paged_attention_prefill's arguments (query and caches DeviceArrays)."""
        return cls(*_forward(*args, **options))

    @classmethod
    def backward(cls, *args, **options) -> "Recorded":
        """paged_attention_backward's arguments (query, caches, dout, out and lse DeviceArrays)."""
        return cls(*_backward(*args, **options))

    def close(self) -> None:
        self.launch.close()
        for a in self._owned:
            a.close()
        if self.problem.decode_part is not None:
            self.problem.decode_part.close()


paged_attention_prefill.__doc__ = paged_attention_prefill.__doc__.format(query=QUERY_DOC)
paged_attention_backward.__doc__ = paged_attention_backward.__doc__.format(query=QUERY_DOC)
