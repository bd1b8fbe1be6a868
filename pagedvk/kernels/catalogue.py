"""The kernels: each one's interface and module variants, declared once (the mechanism: pagedvk/kernels/abi.py).

They are the decode and the reduce that merges its partitions, the merge of two attention states, the device's
read bandwidth (benchmarks), the prefill forward, the backward's three steps, the cache writer, the layer's other
ops (embedding, RMS norm, SiLU-and-mul, rotary embedding), the linear layer's two (matrix-vector and
matrix-matrix) and the sampler. Each declaration says what its sources bind, push and specialize, and which
modules the build makes of it. Stdlib-only, as abi:
build_shaders.py loads it by file path.
"""

from __future__ import annotations

import enum

from .abi import BACKENDS, QUERY_TYPES, STORAGE_TYPES, TARGETS, Binding, KernelABI, PushField

# Backward caches: fp8 caches are for inference.
GRADIENT_CACHE_TYPES = ("f32", "f16", "bf16")

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
    # Elements from one token's row of query (out) to the next: num_heads * head_size where contiguous, more for a
    # strided view (a fused QKV projection's query columns, an output inside a wider buffer; DeviceArray.pitch). A
    # multiple of 4. Rows are addressed through query_row / out_row (attention_common.glsl, .wgsl) and pitched()
    # (prefill's row_base); dout, dq, lse and the backward's inputs stay contiguous.
    ("q_pitch", "u32"),
    ("out_pitch", "u32"),
))
# Vulkan guarantees 128 bytes of push constants (maxPushConstantsSize): ATTENTION_PUSH takes 124.
# The flags of `variants` (the kernels' VARIANT_* constants).
VARIANT_ALIBI = 1                # alibi_slopes is read: logit += slope[head] * (key position - query position)
VARIANT_SINKS = 2                # sinks is read: one more logit per head in the softmax denominator, no value
VARIANT_LSE = 4                  # lse is written: the natural-log log-sum-exp of each (query, head)

# Specialization constants, one IntEnum per kernel (the ids are the sources' constant_ids: the modules are built with
# them). A constant left at its default, 0, reads the push constants instead. The attention kernels share two ids
# (attention_common.glsl): VARIANTS, the bool that a launch without variants sets false, so that its pipeline holds
# none of the variants' code; Q_TYPE, the query storage type in every GLSL module but the matrix ones
# (shaders/kv_storage.glsl), set per plan (KernelABI.q_type_constant), so that the query's loads and the output's
# stores take no branch on the push constant q_type. WGSL modules have none (naga emits none).


class DecodeSpec(enum.IntEnum):
    """PAGED_DECODE's (shaders/paged_decode.comp, paged_decode_cpu.comp, paged_decode_coopmat.comp), set per plan by
    pagedvk/ops/decode_rules.py."""

    VARIANTS = 0
    # which V stage the cache layout needs: 1, a head dim's tokens contiguous (vLLM's layout); 2, a token's dims
    # (nhd, hnd)
    VALUE_ORDER = 1
    GROUP = 2          # how many query heads a workgroup takes: 4, groups of at most 4; 8, of 5 to 8
    # The GPU kernels' (paged_decode.comp and paged_decode_coopmat.comp, not the CPU one): 1 where a split of at most
    # DECODE_MERGE_PARTITIONS partitions is merged in the decode dispatch (shaders/decode_merge.glsl); 0 leaves the
    # merge to PAGED_DECODE_REDUCE.
    MERGE = 3
    # The matrix decode's (paged_decode_coopmat.comp; its fp8 modules use it): how an fp8 block's matrices are built.
    # 0: in registers where the device's element layout is a known one, else through shared memory; 1: through
    # shared memory always; 2: in registers, the outputs NaN where a subgroup does not know its layout (tests).
    FP8_BUILD = 4
    # The matrix decode's (float16 and bfloat16 modules; fp8 takes one block a step): how many of its blocks a
    # subgroup takes a step, 1 (the default) or 2 (decode_rules.MATRIX_STEP2_MIN_TOKENS).
    STEP = 5
    # The scalar GPU decode's (paged_decode.comp, vLLM's layout): 1 where a float16 or bfloat16 plan's workgroups
    # take one tile each (decode_rules.values_with_keys): a tile's values are loaded beside its keys. 0 loads them
    # after the tile's weights, in batches.
    VALUES = 6
    # The scalar kernels' (paged_decode.comp, paged_decode_cpu.comp) head size, so the driver unrolls the loops over
    # head dims as it did when the head size was a define (BENCHMARKS.md, "Module count").
    HEAD_SIZE = 7
    Q_TYPE = 8


class AttentionSpec(enum.IntEnum):
    """PAGED_DECODE_REDUCE's and MERGE_STATES': the attention kernels' shared ids only."""

    VARIANTS = 0
    Q_TYPE = 8


class PrefillSpec(enum.IntEnum):
    """The prefill and backward kernels' (PAGED_PREFILL, PAGED_BACKWARD_DELTA, _DQ, _DKDV: all include
    shaders/prefill_common.glsl, which declares them), set per plan by pagedvk/ops/prefill.py."""

    VARIANTS = 0
    # The head size in the scalar modules: the driver then compiles the loops and branches on it as constants (the
    # float32 dk/dv on the H200: 23.5 -> 20.6 ms at issue 12's shape; BENCHMARKS.md).
    HEAD_SIZE = 3
    Q_TYPE = 8


DECODE_MERGE_PARTITIONS = 4   # the most partitions DecodeSpec.MERGE merges in the decode dispatch


def head_size_constant(spec_id: int, head_size: int) -> dict:
    """The specialization on the head size (spec_id: DecodeSpec.HEAD_SIZE or PrefillSpec.HEAD_SIZE), for every
    head size: a pipeline is compiled per head size in use, which a model pays once. The push-constant path the
    modules fall back to (the constant left 0) compiled 15x slower on lavapipe, whose LLVM took 100 s for the CPU
    decode kernel at head size 48 against 7 s specialized, and ran longer than PAGEDVK_TIMEOUT there (2026-12-05)."""
    return {spec_id: head_size}


# The per-head inputs of the attention variants, float32 [num_heads] each; a 16-byte placeholder when the
# variant is off (its VARIANT_* flag clear): read only where the flag is set.
ATTENTION_VARIANT_INPUTS = (
    Binding("alibi_slopes", readonly=True),
    Binding("sinks", readonly=True),
)

# Decode attention, one query token per sequence. Workgroups: num_heads / group_size x num_seqs x
# num_partitions, numbered linearly over a grid folded to the device's limits (pagedvk.runtime.commands.
# fold_grid). With one partition the result goes to `out`; with more, to the partial buffers, and
# PAGED_DECODE_REDUCE merges them into `out`, or (a GLSL GPU kernel with DecodeSpec.MERGE set) the last
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
    reads_chunks=True,
    subgroup_reduce=True,
    spec_ids=DecodeSpec,
    spec_constants=((DecodeSpec.VALUE_ORDER, "uint32"), (DecodeSpec.GROUP, "uint32"), (DecodeSpec.MERGE, "uint32"),
                    (DecodeSpec.VALUES, "uint32"), (DecodeSpec.HEAD_SIZE, "uint32")),
    # the CPU kernel (one subgroup a workgroup, no barriers) leaves every split to the reduce
    target_spec_constants=(("cpu", ((DecodeSpec.VALUE_ORDER, "uint32"), (DecodeSpec.GROUP, "uint32"),
                                    (DecodeSpec.HEAD_SIZE, "uint32"))),),
    # WGSL modules with the head size, layout and head-group width fixed: vLLM's most common head sizes only, four
    # modules each (DECODE_FIXED); every other head size runs the module that reads them from the push constants.
    # GLSL modules take all three as specialization constants: one module serves every head size, and the driver
    # still compiles its loops with the head size as a constant.
    fixed_head_sizes=(64, 128),
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
    matrix_spec_constants=((DecodeSpec.VALUE_ORDER, "uint32"), (DecodeSpec.GROUP, "uint32"),
                           (DecodeSpec.MERGE, "uint32"), (DecodeSpec.FP8_BUILD, "uint32"), (DecodeSpec.STEP, "uint32")),
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
    spec_ids=AttentionSpec,
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
    spec_ids=AttentionSpec,
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
    spec_ids=PrefillSpec,
    spec_constants=((PrefillSpec.HEAD_SIZE, "uint32"),),
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
    spec_ids=PrefillSpec,
    spec_constants=PAGED_PREFILL.spec_constants,
)
DELTA_ROWS_PER_THREAD = 4

# What the dq and dk/dv kernels share: the forward's push constants, query types, matrix modules and specialization
# constants, over the cache types gradients are kept in.
GRADIENT_KERNEL = dict(
    push=ATTENTION_PUSH,
    workgroup_size=(128, 1, 1),
    kv_types=GRADIENT_CACHE_TYPES,
    q_types=QUERY_TYPES,
    matrix_variants=PAGED_PREFILL.matrix_variants,
    spec_ids=PrefillSpec,
    spec_constants=PAGED_PREFILL.spec_constants,
)

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
    **GRADIENT_KERNEL,
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
    **GRADIENT_KERNEL,
)

# Writes new tokens' keys and values into the caches (vLLM's reshape_and_cache): one thread per (token,
# kv head, head dim) writes that key element and that value element, converted to the cache's type (fp8
# divided by k_scale / v_scale first). Elements narrower than 32 bits share words with other threads'
# (vLLM's value layout puts consecutive tokens side by side), so they are written with atomicAnd and
# atomicOr on the word, which no two threads can then undo. Cache element strides, in elements:
#   key (b, h, t, d):   b*k_block_stride + h*k_head_stride + t*k_token_stride + (d / x)*k_chunk_stride + d % x
#   value (b, h, t, d): b*v_block_stride + h*v_head_stride + t*v_token_stride + d*v_dim_stride
# key and value are [num_tokens, num_kv_heads, head_size] in the q_types, token rows key_pitch / value_pitch
# elements apart; slot_mapping is int32
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
        ("key_pitch", "u32"),           # elements from one token's keys to the next: num_kv_heads * head_size
        ("value_pitch", "u32"),         # where contiguous, more in a strided view (a fused QKV projection's)
    )),
    workgroup_size=(128, 1, 1),
    kv_types=STORAGE_TYPES,
    q_types=QUERY_TYPES,
    writes_cache=True,   # and its WGSL sources include the write-side storage files
)

# The layer's other ops (pagedvk/ops/layer_ops.py): embedding, RMS norms, SiLU-and-mul and rotary embedding. One module
# per backend each: every activation, weight and table is bound as 32-bit words and read in pairs of elements of the
# float type its push constant names (QUERY_TYPES' codes; shaders/layer_elements.glsl, .wgsl), so the element types
# add no module. Row lengths and pitches are even (a pair never spans two rows), counted in elements. Grids are
# numbered linearly over a folded grid, 128 threads a workgroup.
LAYER_WORKGROUP = (128, 1, 1)


def _push(*fields) -> tuple:
    return tuple(PushField(name, kind) for name, kind in fields)


# out[t] = weight[token_ids[t]]: one thread per pair of a row; an id outside [0, vocab_size) gives zeros.
# Workgroups: ceil(num_tokens * hidden_size / 2 / 128).
EMBEDDING = KernelABI(
    op="embedding",
    bindings=(Binding("token_ids", readonly=True), Binding("weight", readonly=True), Binding("out", readonly=False)),
    push=_push(("num_tokens", "u32"), ("hidden_size", "u32"), ("vocab_size", "u32"),
               ("id_words", "u32"),         # 1: int32 ids, 2: int64 (two words, low first)
               ("weight_type", "u32"), ("out_type", "u32"), ("out_pitch", "u32")),
    workgroup_size=LAYER_WORKGROUP,
)

# RMS norm of each row, optionally after adding it into the residual (vLLM's fused_add_rms_norm): one workgroup per
# row, reduced in float32 in shared memory. x, residual and out have x_type; flags: RMS_ADD_RESIDUAL,
# RMS_WRITE_INPUT. Workgroups: num_tokens.
RMS_NORM = KernelABI(
    op="rms_norm",
    bindings=(Binding("x", readonly=False), Binding("residual", readonly=False), Binding("weight", readonly=True),
              Binding("out", readonly=False)),
    push=_push(("num_tokens", "u32"), ("hidden_size", "u32"), ("epsilon", "f32"), ("x_type", "u32"),
               ("weight_type", "u32"), ("flags", "u32"), ("x_pitch", "u32"), ("residual_pitch", "u32"),
               ("out_pitch", "u32")),
    workgroup_size=LAYER_WORKGROUP,
)
RMS_ADD_RESIDUAL = 1   # residual += x (stored rounded to its type), and the sum is normalized
RMS_WRITE_INPUT = 2    # the result goes into x (the out binding is unused)

# out = silu(x[:, :d]) * x[:, d:], one thread per pair of an output row. Workgroups: ceil(num_rows * d / 2 / 128).
SILU_AND_MUL = KernelABI(
    op="silu_and_mul",
    bindings=(Binding("x", readonly=True), Binding("out", readonly=False)),
    push=_push(("num_rows", "u32"), ("d", "u32"), ("x_type", "u32"), ("x_pitch", "u32"), ("out_pitch", "u32")),
    workgroup_size=LAYER_WORKGROUP,
)

# vLLM's rotary_embedding, in place on query and key (key unused where num_kv_heads is 0): one thread per two
# rotations of one head. Workgroups: ceil(num_tokens * (num_heads + num_kv_heads) * rot_dim / 4 / 128).
ROTARY_EMBEDDING = KernelABI(
    op="rotary_embedding",
    bindings=(Binding("positions", readonly=True), Binding("query", readonly=False), Binding("key", readonly=False),
              Binding("cos_sin_cache", readonly=True)),
    push=_push(("num_tokens", "u32"), ("num_heads", "u32"), ("num_kv_heads", "u32"), ("head_size", "u32"),
               ("rot_dim", "u32"), ("max_position", "u32"), ("is_neox", "u32"),
               ("position_words", "u32"),   # 1: int32 positions, 2: int64
               ("x_type", "u32"), ("cache_type", "u32"), ("query_pitch", "u32"), ("key_pitch", "u32")),
    workgroup_size=LAYER_WORKGROUP,
)

class LinearSpec(enum.IntEnum):
    """LINEAR_GEMV's CPU kernel's (shaders/linear_gemv_cpu.comp), set per launch by pagedvk/ops/linear.py: the tokens
    of a pass (its loops over them unroll), the weight's and x's QUERY_TYPES codes (no type branch left in its
    loop; 3 leaves one to the push constants), the x chunks a lane holds in registers a token (0: none) and the
    workgroup's size (local_size_x_id: the device's subgroup size, one subgroup a workgroup)."""

    TOKENS = 0
    WEIGHT_TYPE = 1
    X_TYPE = 2
    HELD = 3
    LANES = 4


# A linear layer, y = x @ weight.T (+ bias) (pagedvk/ops/linear.py): x [tokens, in_features], weight [out_features,
# in_features] row-major (PyTorch's, GGUF's), bias [out_features], y [tokens, out_features], each in a QUERY_TYPES
# type its push constant names (all bound as 32-bit words, weight as 16-byte chunks), accumulated in float32. bias
# unused (has_bias 0) is bound to weight's buffer and never read. 16-bit outputs share words across rows and
# workgroups: written with atomicAnd / atomicOr on the word, as reshape_and_cache writes caches.
LINEAR_KERNEL = dict(
    bindings=(
        Binding("x", readonly=True),
        Binding("weight", readonly=True),
        Binding("bias", readonly=True),
        Binding("y", readonly=False),
    ),
    push=tuple(PushField(name, "u32") for name in (
        "tokens", "in_features", "out_features", "x_type", "weight_type", "bias_type", "y_type", "has_bias")),
)
# The decode's matrix-vector product: each workgroup takes LINEAR_GEMV_ROWS weight rows (GLSL: 32 threads for two
# rows, WGSL: for one, each reading 16-byte chunks of them) for up to LINEAR_GEMV_TOKENS tokens, so a weight is read
# once for all of them.
# Workgroups: ceil(out_features / LINEAR_GEMV_ROWS) x ceil(tokens / LINEAR_GEMV_TOKENS), row groups fastest,
# numbered linearly over a folded grid.
# Its CPU kernel (target "cpu", shaders/linear_gemv_cpu.comp): one subgroup a workgroup (its size specialized to the
# subgroup's; 128 where unset, as declared here), LINEAR_GEMV_CPU_ROWS rows
# (passes of 8, or one row at a time with x held in registers), LinearSpec.TOKENS tokens a pass; workgroups
# ceil(out_features / LINEAR_GEMV_CPU_ROWS) x ceil(tokens / TOKENS), numbered likewise. pagedvk/ops/linear.py chooses
# it (linear_target).
# The CPU kernel reads the weight as a storage texel buffer of 16-byte chunks (Binding.texels): lavapipe loads a texel
# with vector instructions, where a storage buffer's chunk is four loads lane by lane; SmolLM2's linear layers ran
# about 2x faster so (BENCHMARKS.md, "SmolLM2 on lavapipe: where a decode step goes").
LINEAR_GEMV = KernelABI(op="linear_gemv", workgroup_size=(128, 1, 1), spec_ids=LinearSpec, targets=TARGETS,
                        target_spec_constants=(("cpu", ((LinearSpec.TOKENS, "uint32"), (LinearSpec.WEIGHT_TYPE, "uint32"),
                                                         (LinearSpec.X_TYPE, "uint32"), (LinearSpec.HELD, "uint32"),
                                                         (LinearSpec.LANES, "uint32"))),),
                        target_bindings=(("cpu", tuple(Binding(b.name, b.readonly, texels=b.name == "weight")
                                                       for b in LINEAR_KERNEL["bindings"])),),
                        **LINEAR_KERNEL)
LINEAR_GEMV_ROWS = {"glsl": 8, "wgsl": 4}   # rows a workgroup, by backend (GLSL: two a subgroup of 32)
LINEAR_GEMV_TOKENS = 8
LINEAR_GEMV_CPU_ROWS = 32
# The CPU kernel holds x in registers where a lane's chunks times the pass's tokens are at most this many: llvmpipe
# compiles the unrolled loops in about 1-4 s up to it (24 chunks of one token: a row of 1536 16-bit weights over 8
# lanes), 8-50 s at 96-192 (2026-12-06).
LINEAR_GEMV_CPU_HELD = 24
# The prefill's matrix product: 64 x 64 tiles of y (tokens x out_features) through shared memory, 16 of in_features
# a step, each thread 4 x 4 outputs. Workgroups: ceil(out_features / 64) x ceil(tokens / 64), column tiles fastest,
# numbered linearly over a folded grid.
# Its cooperative-matrix module (shaders/linear_gemm_coopmat.comp: float16 weights, 128 invocations, the same tiles and
# grid), which pagedvk/ops/linear.py picks where the device has the multiply: its storage axis is the weights'.
LINEAR_GEMM = KernelABI(op="linear_gemm", workgroup_size=(256, 1, 1), matrix_variants=(("coopmat", "f16", "", 0),),
                        matrix_accesses=("",), matrix_workgroup_size=(128, 1, 1), **LINEAR_KERNEL)
LINEAR_GEMM_TILE = 64

# One token per row of logits (pagedvk/ops/sampling.py): greedy, or temperature, top-k and top-p then a seeded draw,
# shaders/sampling.comp says how. logits [batch, vocab] in a QUERY_TYPES type (logits_type), bound as words; the
# per-row arrays (float32 temperatures and top_ps, int32 top_ks, int64 seeds, [batch] each) are read where per_row's
# bit says so, else the push constants' values serve every row and the binding is the logits' buffer, unread.
# tokens: int32 [batch]. Workgroups: batch, one a row, numbered linearly over a folded grid.
SAMPLING = KernelABI(
    op="sampling",
    bindings=(
        Binding("logits", readonly=True),
        Binding("temperatures", readonly=True),
        Binding("top_ks", readonly=True),
        Binding("top_ps", readonly=True),
        Binding("seeds", readonly=True),
        Binding("tokens", readonly=False),
    ),
    push=tuple(PushField(name, kind) for name, kind in (
        ("batch", "u32"), ("vocab", "u32"), ("logits_type", "u32"), ("temperature", "f32"), ("top_k", "u32"),
        ("top_p", "f32"), ("seed_lo", "u32"), ("seed_hi", "u32"), ("offset", "u32"),
        ("per_row", "u32"),   # SAMPLING_PER_ROW's bits: the arrays read
        ("mix_row", "u32"),   # 1: one seed for the batch, each row's draw keyed by its row too
    )),
    workgroup_size=(256, 1, 1),
)
SAMPLING_PER_ROW = {"temperatures": 1, "top_ks": 2, "top_ps": 4, "seeds": 8}

KERNELS = (PAGED_DECODE, PAGED_DECODE_REDUCE, MERGE_STATES, READ_BANDWIDTH, PAGED_PREFILL, PAGED_BACKWARD_DELTA,
           PAGED_BACKWARD_DQ, PAGED_BACKWARD_DKDV, RESHAPE_AND_CACHE, EMBEDDING, RMS_NORM, SILU_AND_MUL,
           ROTARY_EMBEDDING, LINEAR_GEMV, LINEAR_GEMM, SAMPLING)
