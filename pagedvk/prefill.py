"""Paged-attention prefill and its backward: the last q_len tokens of each sequence attend over that
sequence's cached keys and values (causal or not), in either cache layout (pagedvk.layouts) and any cache
storage type (pagedvk.dtypes; the backward takes float32, float16 and bfloat16 caches). One module per
kernel and storage type reads both layouts: the caches' strides travel in the push constants.

The forward has a second kernel for devices with cooperative matrices (VK_KHR_cooperative_matrix):
shaders/paged_prefill_coopmat.comp, same bindings and push constants, for float16 queries and caches at head
sizes 64 and 128. `matrix_kernel` is the rule that picks it, from the device's listed multiplies.
"""

from __future__ import annotations

import math

import numpy as np

from . import checks, kernels
from .abi import PAGED_BACKWARD_DKDV, PAGED_BACKWARD_DQ, PAGED_PREFILL, VariantKey
from .array import Array, asarray, empty
from .dtypes import CACHE_TYPES, GRADIENT_CACHE_TYPES, QUERY_TYPES, fp8_scale, storage_type
from .layouts import bind_caches, cache_spec
from .opargs import backend_name, device_of, softmax_scale
from .runtime.instance import DeviceInfo, MatrixShape
from .runtime.pipeline import fold_grid

FORWARD_ROWS = 8         # query rows (query, head) per workgroup of paged_prefill
MATRIX_ROWS = 64         # and of paged_prefill_coopmat
DQ_ROWS = 8              # and of paged_backward_dq
DKDV_TOKENS = 8          # block tokens per workgroup of paged_backward_dkdv
MAX_GROUPS = 65535       # the fewest workgroups per grid dimension a Vulkan device may allow
# The multiply paged_prefill_coopmat is written with, and the subgroup size its softmax assumes (two lanes
# for each of a subgroup's 16 rows).
MATRIX_SHAPE = MatrixShape(16, 16, 16, "f16", "f16", "f32", "f32", "subgroup")
MATRIX_SUBGROUP = 32
MATRIX_KIND = "coopmat"
PREFILL_KERNELS = ("auto", "scalar", "coopmat")


def matrix_unavailable(info: DeviceInfo, features=None) -> str:
    """Why the device cannot run the cooperative-matrix prefill, or "" if it can. `features`: the Vulkan
    features a Device enabled (pagedvk.Device.features), where one is open."""
    shape = lambda s: (s.m, s.n, s.k, s.a, s.b, s.c, s.result, s.scope)
    if not any(shape(s) == shape(MATRIX_SHAPE) for s in info.matrix_shapes):
        return f"it lists no {MATRIX_SHAPE} cooperative-matrix multiply (VK_KHR_cooperative_matrix)"
    if info.subgroup_size != MATRIX_SUBGROUP:
        return f"its subgroup size is {info.subgroup_size}, not {MATRIX_SUBGROUP}"
    needs = VariantKey(PAGED_PREFILL.op, "glsl", matrix=MATRIX_KIND).requires()
    missing = [f for f in needs if f not in features] if features is not None else []
    return f"it lacks the Vulkan feature(s) {', '.join(missing)}" if missing else ""


def matrix_kernel(info: DeviceInfo, features, backend: str, kv: str, q: str, head_size: int,
                  kernel: str = "auto") -> str:
    """The forward's matrix kind for these arguments: "coopmat" where a module exists for them (GLSL,
    float16 caches and queries, head size 64 or 128) and the device runs it, else "" (the scalar kernel).
    kernel="scalar" or "coopmat" forces the choice; "coopmat" raises ValueError where it cannot run."""
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, PREFILL_KERNELS))}, got {kernel!r}")
    if kernel == "scalar":
        return ""
    built = {(k, qq, h) for _, k, qq, h in PAGED_PREFILL.matrix_variants}
    why = matrix_unavailable(info, features)
    if not why and (backend != "glsl" or (kv, q, head_size) not in built):
        why = (f"the cooperative-matrix prefill is built for backend 'glsl' with float16 caches and queries at "
               f"head sizes {', '.join(str(h) for _, _, h in sorted(built))}, not backend {backend!r}, cache {kv}, "
               f"query {q}, head size {head_size}")
    if why and kernel == "coopmat":
        raise ValueError(f"kernel='coopmat' cannot run on {info.name}: {why}")
    return "" if why else MATRIX_KIND


def describe_choice(info: DeviceInfo) -> str:
    """The prefill forward kernel a device gets, in words (`pagedvk devices`)."""
    why = matrix_unavailable(info)
    if why:
        return f"scalar (no cooperative matrices: {why})"
    sizes = ", ".join(str(h) for *_, h in PAGED_PREFILL.matrix_variants)
    return f"coopmat ({MATRIX_SHAPE}) for float16 caches and queries at head sizes {sizes}; scalar otherwise"


class _Problem:
    """The checked arguments of one call: dims, device, backend and the push constants they give."""

    def __init__(self, query, key_cache, value_cache, block_tables, seq_lens, scale, causal, layout, backend,
                 validate=True, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, cache_types=CACHE_TYPES,
                 kernel="scalar"):
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, not {type(causal).__name__}")
        checks.kind("query", query)
        checks.ndim("query", query, 4, "[num_seqs, num_heads, q_len, head_size]")
        self.query_type = storage_type("query", query, QUERY_TYPES)
        spec = self.spec = cache_spec(key_cache, value_cache, layout, kv_cache_dtype, cache_types)
        self.num_seqs, self.num_heads, self.q_len, self.head_size = query.shape
        self.num_kv_heads, self.block_size, self.num_blocks = spec.num_kv_heads, spec.block_size, spec.num_blocks
        checks.dim("query", query, 3, spec.head_size, "head_size, from the caches")
        if self.num_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"query.shape[1] (num_heads) must be a positive multiple of num_kv_heads "
                             f"({self.num_kv_heads}, from the caches), got {self.num_heads}")
        if self.q_len < 1:
            raise ValueError(f"query.shape[2] (q_len) must be at least 1, got {self.q_len}")

        checks.tables(block_tables, seq_lens, self.num_seqs, "query")
        if validate:
            checks.block_table_values(block_tables, seq_lens, self.block_size, self.num_blocks)
        lens = checks.host(seq_lens)
        short = np.flatnonzero((lens > 0) & (lens < self.q_len))
        if validate and short.size:
            s = int(short[0])
            raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is less than q_len (query.shape[2]) = {self.q_len}: "
                             f"the queries are each sequence's last q_len tokens (0, an empty sequence, is allowed)")
        self.block_tables, self.seq_lens = block_tables, seq_lens

        self.scale = softmax_scale(scale, self.head_size)
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {scale}")
        k_scale, v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
        self.causal = bool(causal)
        self.backend = backend_name(backend)
        self.device = device_of(query, key_cache, value_cache, block_tables, seq_lens)
        self.host = isinstance(query, np.ndarray)
        # The forward's kernel ("" scalar, or a matrix kind); the backward's kernels are scalar.
        self.matrix = matrix_kernel(self.device.info, self.device.features, self.backend, spec.storage.tag,
                                    self.query_type.tag, self.head_size, kernel)
        # num_blocks is the caches' shape[0]: their buffers (and dk_cache's, dv_cache's) hold that many blocks,
        # and the kernels bound block ids by it rather than by the buffers' length() (attention_common.glsl).
        self.push_fields = dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_size=self.block_size, max_blocks_per_seq=block_tables.shape[1], num_blocks=self.num_blocks,
            num_seqs=self.num_seqs, q_len=self.q_len, causal=int(self.causal), scale=self.scale * k_scale,
            v_scale=v_scale, group_size=1, partition_size=0, num_partitions=1, **spec.strides())

    def key(self, kernel, access: str = ""):
        if kernel is PAGED_PREFILL and self.matrix:
            return kernel.key(self.backend, self.spec.storage.tag, self.query_type.tag, self.head_size, access,
                              self.matrix)
        return kernel.key(self.backend, self.spec.storage.tag, self.query_type.tag, access=access)

    def push(self, caches) -> bytes:
        """The push constants for caches bound as `caches` (pagedvk.layouts.CacheBinding)."""
        return PAGED_PREFILL.pack_push(**dict(
            self.push_fields, blocks_per_segment=caches.blocks_per_segment,
            num_blocks=self.spec.blocks_held(caches.key_bytes, caches.value_bytes)))

    def grid(self, rows_per_group: int) -> tuple:
        """Workgroups (row tile, kv head, sequence), numbered linearly over a grid folded to the device's
        limits."""
        rows = self.num_heads // self.num_kv_heads * self.q_len
        return fold_grid(-(-rows // rows_per_group) * self.num_kv_heads * self.num_seqs,
                         self.device.info.max_workgroup_count)

    def check_like(self, name: str, a, shape: tuple, layout: str, dtype) -> None:
        checks.kind(name, a)
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


def _run(problem: _Problem, dispatches, inputs: dict, outputs: dict) -> tuple:
    """Run each (kernel ABI, grid) in turn, its buffers bound by the names its ABI declares: taken from
    `inputs` (copied to the device when on the host) or allocated for `outputs` (name -> (shape, dtype)). Returns
    the outputs in order, as numpy arrays when the query came from the host, else as DeviceArrays."""
    temporaries, results = [], {}
    try:
        arrays = {}
        for name, a in inputs.items():
            arrays[name] = asarray(a, device=problem.device)
            if arrays[name] is not a:
                temporaries.append(arrays[name])
        for name, (shape, dtype) in outputs.items():
            results[name] = arrays[name] = empty(shape, dtype, problem.device)
        caches = bind_caches(arrays["key_cache"], arrays["value_cache"], problem.backend)
        bound = dict(key_cache=caches.key, value_cache=caches.value)
        for abi, grid in dispatches:
            key = problem.key(abi, caches.access)
            pipeline = kernels.pipeline(problem.device, abi, key)
            extra = dict(zip([b.name for b in abi.bindings_for(key)[len(abi.bindings):]], caches.extra))
            buffers = [bound.get(b.name) or extra.get(b.name) or arrays[b.name].buffer for b in abi.bindings_for(key)]
            launch = pipeline.launch(buffers, problem.push(caches), grid)
            try:
                launch.submit()
            finally:
                launch.close()
        if problem.host:
            return tuple(r.numpy() for r in results.values())
        handed, results = tuple(results.values()), {}
        return handed
    finally:
        for a in temporaries + list(results.values()):
            a.close()


def paged_attention_prefill(query: Array, key_cache: Array, value_cache: Array, block_tables: Array, seq_lens: Array,
                            *, scale: float | None = None, causal: bool = True, layout: str = "nhd",
                            kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                            backend: str | None = None, validate: bool = True,
                            kernel: str = "auto") -> tuple[Array, Array]:
    """Attention of each sequence's last q_len tokens over its paged KV cache.

    query        float32, float16 or bfloat16 [num_seqs, num_heads, q_len, head_size]; query i of sequence s
                 is its token seq_lens[s] - q_len + i, so with causal=True it sees keys 0 .. seq_lens[s] - q_len + i
    key_cache    layout "nhd" [num_blocks, block_size, num_kv_heads, head_size] or "vllm" (pagedvk.layouts);
    value_cache  float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 (or uint8 with vLLM's
                 kv_cache_dtype and k_scale / v_scale); num_heads a multiple of num_kv_heads (GQA/MQA);
                 head_size a multiple of 4 up to 256; block_size 8, 16 or 32
    block_tables int32 [num_seqs, max_blocks_per_seq]: physical block ids
    seq_lens     int32 [num_seqs]: cached tokens per sequence, at least q_len, or 0 for an empty sequence
                 (zeros out, lse -inf)
    scale        softmax scale, default 1 / sqrt(head_size); accumulation is float32
    Returns (out [num_seqs, num_heads, q_len, head_size] in the query's dtype, lse float32 [num_seqs,
    num_heads, q_len]), lse the natural-log sum of exp(scale q.k) over the keys seen: numpy for a numpy
    query, DeviceArrays for a DeviceArray query.
    validate=False skips the checks of the tables' values (as DecodePlan's): the kernels bound every
    index themselves, so bad values give wrong rows for their sequences, never an access outside a buffer.
    kernel       "auto": the cooperative-matrix kernel where the device has one for these arguments
                 (matrix_kernel), else the scalar one; "scalar" or "coopmat" to force it (ValueError where
                 "coopmat" cannot run). The matrix kernel multiplies in float16, accumulating in float32.

    >>> out, lse = pagedvk.paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens)
    """
    p = _Problem(query, key_cache, value_cache, block_tables, seq_lens, scale, causal, layout, backend, validate,
                 kv_cache_dtype, k_scale, v_scale, kernel=kernel)
    return _run(p, [(PAGED_PREFILL, p.grid(MATRIX_ROWS if p.matrix else FORWARD_ROWS))],
                dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                     seq_lens=seq_lens),
                dict(out=(tuple(query.shape), query.dtype), lse=(tuple(query.shape[:3]), np.float32)))


def paged_attention_backward(dout: Array, query: Array, key_cache: Array, value_cache: Array, block_tables: Array,
                             seq_lens: Array, out: Array, lse: Array, *, scale: float | None = None,
                             causal: bool = True, layout: str = "nhd", backend: str | None = None,
                             validate: bool = True) -> tuple[Array, Array, Array]:
    """Gradients of paged_attention_prefill: (dq, dk_cache, dv_cache) for the upstream gradient dout.

    query, dout, out  float32, float16 or bfloat16, one dtype, [num_seqs, num_heads, q_len, head_size]
    key_cache, value_cache  float32, float16 or bfloat16, either layout
    lse          float32 [num_seqs, num_heads, q_len]
    out and lse are what paged_attention_prefill returned for these arguments. The gradients are float32,
    accumulated in float32: dq has the query's shape, dk_cache and dv_cache the caches' shapes and layout.
    Where several sequences read one physical block their gradients add up (in a fixed order, so results
    are deterministic), and slots no sequence reads get zero. numpy in, numpy out; a DeviceArray query
    gives DeviceArrays. validate as for paged_attention_prefill.

    >>> dq, dk, dv = pagedvk.paged_attention_backward(dout, q, key_cache, value_cache, block_tables, seq_lens, out, lse)
    """
    p = _Problem(query, key_cache, value_cache, block_tables, seq_lens, scale, causal, layout, backend, validate,
                 cache_types=GRADIENT_CACHE_TYPES)
    query_layout = "[num_seqs, num_heads, q_len, head_size] (the query's shape)"
    p.check_like("dout", dout, tuple(query.shape), query_layout, query.dtype)
    p.check_like("out", out, tuple(query.shape), query_layout, query.dtype)
    p.check_like("lse", lse, tuple(query.shape[:3]), "[num_seqs, num_heads, q_len]", np.float32)
    inputs = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  seq_lens=seq_lens, dout=dout, out=out, lse=lse, block_readers=p.block_readers())
    dkdv_grid = (min(p.num_blocks, MAX_GROUPS), p.num_kv_heads, p.block_size // DKDV_TOKENS)
    return _run(p, [(PAGED_BACKWARD_DQ, p.grid(DQ_ROWS)), (PAGED_BACKWARD_DKDV, dkdv_grid)], inputs,
                dict(dq=(tuple(query.shape), np.float32), dk_cache=(tuple(key_cache.shape), np.float32),
                     dv_cache=(tuple(value_cache.shape), np.float32)))
