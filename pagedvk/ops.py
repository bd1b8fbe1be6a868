"""The ops under the names and signatures engines already call (vLLM's ``_custom_ops``), so engine code
ports by changing an import. Options pagedvk does not support yet raise NotImplementedError, never
silently ignored."""

from __future__ import annotations

import numpy as np

from . import checks
from .decode import paged_attention as _paged_attention


def _unsupported(feature: str, argument: str) -> NotImplementedError:
    return NotImplementedError(f"{feature} ({argument}) is not supported by pagedvk yet")


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0,
                       v_scale=1.0, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    """vLLM's ``paged_attention_v1``: writes softmax(scale q k^T) v into ``out`` and returns it.

    Shapes as ``pagedvk.paged_attention``; ``num_kv_heads`` and ``block_size`` must agree with the caches
    and ``max_seq_len`` must be at least every seq_len.
    """
    if alibi_slopes is not None:
        raise _unsupported("ALiBi", "alibi_slopes")
    if kv_cache_dtype != "auto":
        raise _unsupported("a quantized (fp8) KV cache", f"kv_cache_dtype={kv_cache_dtype!r}")
    if np.any(np.asarray(k_scale) != 1.0) or np.any(np.asarray(v_scale) != 1.0):
        raise _unsupported("KV cache scaling", "k_scale/v_scale")
    # As in vLLM, tp_rank and the other blocksparse_* arguments matter only for block-sparse attention.
    if blocksparse_vert_stride > 1:
        raise _unsupported("block-sparse attention", f"blocksparse_vert_stride={blocksparse_vert_stride}")
    if out is None:
        raise TypeError("out must be an array of the query's shape (vLLM writes into it)")
    checks.kind("key_cache", key_cache)
    if len(key_cache.shape) >= 4 and key_cache.shape[1] != num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) does not match key_cache.shape[1] ({key_cache.shape[1]})")
    if len(key_cache.shape) >= 4 and key_cache.shape[3] != block_size:
        raise ValueError(f"block_size ({block_size}) does not match key_cache.shape[3] ({key_cache.shape[3]})")
    checks.kind("seq_lens", seq_lens)
    lens = checks.host(seq_lens)
    if lens.size and int(np.max(lens)) > max_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) is less than the longest seq_len ({int(np.max(lens))})")
    return _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale, out=out)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, out=None, backend=None,
                    validate=True):
    return _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale, out=out,
                            backend=backend, validate=validate)


paged_attention.__doc__ = _paged_attention.__doc__
