"""The ops under the names and signatures engines already call (vLLM's ``_custom_ops``), so engine code
ports by changing an import. Options pagedvk does not support yet raise NotImplementedError, never
silently ignored."""

from __future__ import annotations

import numpy as np

from ..dtypes import QUERY_TYPES, storage_type
from . import cache_ops, checks
from .decode import paged_attention as _paged_attention
from .decode_plan import DecodePlan
from .layer_ops import embedding, fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul  # noqa: F401 (vLLM's)
from .layouts import cache_spec
from .opargs import device_of
from .prefill import paged_attention_prefill

V2_PARTITION_SIZE = 512   # vLLM's PARTITION_SIZE for paged_attention_v2


def _unsupported(feature: str, argument: str) -> NotImplementedError:
    return NotImplementedError(f"{feature} ({argument}) is not supported by pagedvk yet")


def _plan(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
          alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
          blocksparse_vert_stride, **plan_options) -> DecodePlan:
    """Check vLLM's arguments (block-sparse ones are ignored unless blocksparse_vert_stride > 1, as vLLM
    does) and make the plan that runs them."""
    # As in vLLM, tp_rank and the other blocksparse_* arguments matter only for block-sparse attention.
    if blocksparse_vert_stride > 1:
        raise _unsupported("block-sparse attention", "blocksparse_vert_stride > 1")
    if out is None:
        raise TypeError("out must be an array of the query's shape (vLLM writes into it)")
    checks.kind("query", query, strided=True)
    checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
    spec = cache_spec(key_cache, value_cache, "vllm", kv_cache_dtype)
    if spec.num_kv_heads != num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) does not match key_cache.shape[1] ({spec.num_kv_heads})")
    if spec.block_size != block_size:
        raise ValueError(f"block_size ({block_size}) does not match key_cache.shape[3] ({spec.block_size})")
    block_tables, seq_lens = checks.ints("block_tables", block_tables), checks.ints("seq_lens", seq_lens)
    checks.tables(block_tables, seq_lens)
    lens = checks.host(seq_lens)
    if lens.size and int(np.max(lens)) > max_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) is less than the longest seq_len ({int(np.max(lens))})")
    query_type = storage_type("query", query, QUERY_TYPES)
    return DecodePlan.for_caches(key_cache, value_cache, block_tables, seq_lens, query.shape[1],
                                 kv_cache_dtype=kv_cache_dtype, query_dtype=query_type.dtype, scale=scale,
                                 k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                                 device=device_of(query, key_cache, value_cache, block_tables, seq_lens, out,
                                                  alibi_slopes),
                                 **plan_options)


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0,
                       v_scale=1.0, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    """vLLM's ``paged_attention_v1``: writes softmax(scale q k^T) v into ``out`` and returns it; alibi_slopes
    (float32 [num_heads], or None) adds vLLM's ALiBi bias slope * (key position - query position).

    Shapes as ``pagedvk.paged_attention`` in vLLM's cache layout; fp8 caches as uint8 with kv_cache_dtype
    "fp8" / "fp8_e4m3" / "fp8_e5m2" and k_scale / v_scale. ``num_kv_heads`` and ``block_size`` must agree
    with the caches and ``max_seq_len`` must be at least every seq_len. The split-K rule is pagedvk's own.
    """
    with _plan(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
               blocksparse_vert_stride) as plan:
        return plan.run(query, key_cache, value_cache, out=out)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
                       block_tables, seq_lens, block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto",
                       k_scale=1.0, v_scale=1.0, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    """vLLM's ``paged_attention_v2``: as v1, with the context split into 512-token partitions merged by a
    second pass. exp_sums and max_logits (float32 [num_seqs, num_heads, max_num_partitions]) and tmp_out
    ([num_seqs, num_heads, max_num_partitions, head_size], float32 or the output's dtype, as vLLM allocates it),
    max_num_partitions = ceil(max_seq_len / 512), are vLLM's scratch: their shapes are checked, and numpy ones
    are filled as vLLM fills them (each partition's sum of exp(logit - max), its max logit and its normalized
    output)."""
    checks.kind("query", query, strided=True)
    checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
    partitions = max(1, -(-int(max_seq_len) // V2_PARTITION_SIZE))
    stats_shape = tuple(query.shape[:2]) + (partitions,)
    for name, a, shape, dtypes in (("exp_sums", exp_sums, stats_shape, [np.float32]),
                                   ("max_logits", max_logits, stats_shape, [np.float32]),
                                   ("tmp_out", tmp_out, stats_shape + (query.shape[2],),
                                    [np.float32] + ([query.dtype] if query.dtype != np.float32 else []))):
        checks.kind(name, a)
        checks.writable(name, a)
        checks.dtype(name, a, dtypes)
        if tuple(a.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (max_num_partitions = ceil(max_seq_len / "
                             f"{V2_PARTITION_SIZE}) = {partitions}), got {tuple(a.shape)}")
    with _plan(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
               blocksparse_vert_stride, partition_size=V2_PARTITION_SIZE) as plan:
        result = plan.run(query, key_cache, value_cache, out=out)
        if plan.num_partitions > 1:
            n = plan.num_partitions
            stats = plan.partial_stats.numpy()
            for a, values in ((max_logits, stats[..., 0]), (exp_sums, stats[..., 1]),
                              (tmp_out, plan.partial_out.numpy())):
                if isinstance(a, np.ndarray):
                    a[:, :, :n] = values   # rounded to tmp_out's dtype where it is the output's
        return result


def _descale(name: str, value) -> float:
    """vLLM's k_descale / v_descale (a scale per sequence and kv head, or None): one value for the whole cache."""
    if value is None:
        return 1.0
    values = np.unique(np.asarray(checks.host(value) if not np.isscalar(value) else value, np.float64))
    if values.size != 1:
        raise _unsupported("a scale that differs between sequences or kv heads", name)
    return float(values[0])


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, alibi_slopes=None,
                      output_scale=None, qq_bias=None, sinks=None):
    """vLLM's ``unified_attention`` (its Triton attention for mixed batches of prefill chunks and decode
    tokens): writes the attention of each sequence's new tokens over its paged cache into ``out`` and returns it.

    q             [num_tokens, num_heads, head_size] float32, float16 or bfloat16; out the same
    k, v          caches [num_blocks, block_size, num_kv_heads, head_size] (pagedvk's "nhd"), any cache dtype
    cu_seqlens_q  int32 [num_seqs + 1]: sequence s owns query tokens cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1
    seqused_k     int32 [num_seqs]: tokens per sequence, the new ones included
    block_table   int32 [num_seqs, max_blocks_per_seq]
    max_seqlen_q and max_seqlen_k must be at least the longest q_len_s and seqused_k; k_descale and v_descale
    (None, a number, or one value repeated) are fp8 caches' scales, ignored for other caches as vLLM does.
    The attention variants as vLLM passes them: window_size (left, right), a query seeing its own and the
    `left` keys before it (-1: no window; vLLM's (sliding_window - 1, 0)), softcap (0: off), alibi_slopes and
    sinks (float32 [num_heads]); see pagedvk.ops.variants.
    Not supported yet, each raising NotImplementedError that names it: q_descale, a window to the right
    (window_size[1] other than -1 or 0), output_scale, qq_bias, and scales differing between kv heads.
    """
    for name, value, feature in (("q_descale", q_descale, "query scaling"), ("output_scale", output_scale, "fp8 output"),
                                 ("qq_bias", qq_bias, "a query bias")):
        if value is not None:
            raise _unsupported(feature, name)
    if len(tuple(window_size)) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    if right not in (-1, 0):
        raise _unsupported(f"a window to the right of the query (window_size[1] = {right}, not -1 or 0)",
                           "window_size")
    if out is None:
        raise TypeError("out must be an array of q's shape (vLLM writes into it)")
    cu_seqlens_q, seqused_k = checks.ints("cu_seqlens_q", cu_seqlens_q), checks.ints("seqused_k", seqused_k)
    block_table = checks.ints("block_table", block_table)
    checks.kind("cu_seqlens_q", cu_seqlens_q)
    checks.kind("seqused_k", seqused_k)
    loc, lens = checks.host(cu_seqlens_q), checks.host(seqused_k)
    for name, longest, limit in (("max_seqlen_q", np.diff(loc).max(initial=0), max_seqlen_q),
                                 ("max_seqlen_k", lens.max(initial=0), max_seqlen_k)):
        if int(longest) > limit:
            raise ValueError(f"{name} ({limit}) is less than the longest length in the batch ({int(longest)})")
    fp8 = np.dtype(k.dtype).itemsize == 1   # as in vLLM, the descales apply to fp8 caches only
    paged_attention_prefill(q, k, v, block_table, seqused_k, cu_seqlens_q, scale=softmax_scale, causal=causal,
                            layout="nhd", k_scale=_descale("k_descale", k_descale) if fp8 else 1.0,
                            v_scale=_descale("v_descale", v_descale) if fp8 else 1.0, out=out,
                            alibi_slopes=alibi_slopes, logits_soft_cap=softcap if softcap else None, sinks=sinks,
                            window_left=left)
    return out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0,
                      v_scale=1.0):
    """vLLM's ``reshape_and_cache``: caches in vLLM's layout (key [num_blocks, num_kv_heads, head_size // x,
    block_size, x], value [num_blocks, num_kv_heads, head_size, block_size]); see
    ``pagedvk.reshape_and_cache``."""
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                                layout="vllm")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0,
                            v_scale=1.0):
    """vLLM's ``reshape_and_cache_flash``: both caches [num_blocks, block_size, num_kv_heads, head_size]
    (pagedvk's "nhd" layout); see ``pagedvk.reshape_and_cache``."""
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                                layout="nhd")


copy_blocks = cache_ops.copy_blocks
swap_blocks = cache_ops.swap_blocks

# pagedvk's own spelling, for engines that want one namespace.
paged_attention = _paged_attention
