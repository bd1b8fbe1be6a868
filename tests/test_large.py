"""Caches of 2 GiB and more: NVIDIA's driver misreports such bindings' length, so the bound the kernel
uses must come from the launcher. Where the device cannot bind them, the library must say so instead."""

import numpy as np
import pytest

import pagedvk
from conftest import rel_error

NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 1, 128, 32
BLOCK_BYTES = NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE * 4
NUM_BLOCKS = 2**31 // BLOCK_BYTES + 64          # just past 2 GiB per cache


def test_caches_past_2_gib(rng, device):
    key_cache = np.empty((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE // 4, BLOCK_SIZE, 4), np.float32)
    value_cache = np.empty((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE), np.float32)
    if key_cache.nbytes > device.info.max_storage_buffer_range:
        with pytest.raises(ValueError, match="maxStorageBufferRange"):
            pagedvk.asarray(key_cache)
        return
    # Blocks at both ends of the cache, the last ones past the 2 GiB mark; the rest stay uninitialised.
    used = np.concatenate([rng.choice(NUM_BLOCKS - 128, 6, replace=False), NUM_BLOCKS - 1 - np.arange(6)])
    rng.shuffle(used)
    for b in used:
        key_cache[b] = rng.standard_normal(key_cache.shape[1:])
        value_cache[b] = rng.standard_normal(value_cache.shape[1:])
    block_tables = used.astype(np.int32).reshape(2, 6)
    seq_lens = np.array([6 * BLOCK_SIZE, 5 * BLOCK_SIZE - 3], np.int32)
    query = rng.standard_normal((2, 4, HEAD_SIZE)).astype(np.float32)
    out = np.full(query.shape, np.nan, np.float32)
    pagedvk.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)
    ref = pagedvk.reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    assert rel_error(out, ref) <= 1e-5
