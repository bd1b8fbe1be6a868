"""Float64 numpy references, written for clarity, not speed. Tests and benchmarks check against these."""

from __future__ import annotations

import numpy as np


def gather_kv(key_cache, value_cache, block_table_row, seq_len):
    """The keys and values of one sequence, in token order, from vLLM's paged layout.

    key_cache [num_blocks, num_kv_heads, head_size // x, block_size, x] -> keys [seq_len, num_kv_heads, head_size]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]      -> values [seq_len, num_kv_heads, head_size]
    """
    num_blocks, num_kv_heads, head_chunks, block_size, x = key_cache.shape
    used = -(-seq_len // block_size)
    blocks = np.asarray(block_table_row[:used], dtype=np.int64)
    k = key_cache[blocks].astype(np.float64)           # [used, kv_heads, head_size/x, block_size, x]
    k = k.transpose(0, 3, 1, 2, 4).reshape(used * block_size, num_kv_heads, head_chunks * x)
    v = value_cache[blocks].astype(np.float64)         # [used, kv_heads, head_size, block_size]
    v = v.transpose(0, 3, 1, 2).reshape(used * block_size, num_kv_heads, head_chunks * x)
    return k[:seq_len], v[:seq_len]


def attention(q, k, v, scale):
    """softmax(scale * q k^T) v for one query row set. q [n, d], k [t, d], v [t, d]; t == 0 gives zeros."""
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    logits = scale * (q @ k.T)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    denom = p.sum(axis=-1, keepdims=True)
    return (p / denom) @ v, (m + np.log(denom))[:, 0]


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=None):
    """Decode attention: query [num_seqs, num_heads, head_size] -> out [num_seqs, num_heads, head_size]."""
    query = np.asarray(query, dtype=np.float64)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    out = np.zeros_like(query)
    for s in range(num_seqs):
        k, v = gather_kv(key_cache, value_cache, block_tables[s], int(seq_lens[s]))
        for h in range(num_heads):
            out[s, h] = attention(query[s, h][None], k[:, h // group], v[:, h // group], scale)[0][0]
    return out
