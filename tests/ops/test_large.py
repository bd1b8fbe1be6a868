"""Caches larger than one binding. A DeviceArray larger than maxStorageBufferRange (128 MiB on lavapipe,
4 GiB on NVIDIA) is split into segments of whole blocks; GLSL kernels read them through buffer device
addresses where the device has them, otherwise (and in WGSL) through up to four bindings per cache.
NVIDIA's driver also misreports the length of bindings of 2 GiB and more, so the kernels' bound on block ids
comes from the launcher."""

import numpy as np
import pytest

import pagedvk
from pagedvk.runtime import array
from pagedvk.testing import reference
from support import rel_error

NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 1, 128, 32
BLOCK_BYTES = NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE * 4


def sparse_caches(rng, num_blocks, used_blocks, dtype=np.float32):
    """vLLM-layout caches of num_blocks blocks where only `used_blocks` hold random data (the rest is NaN: a
    read of it would show), and block tables for two sequences over them. (Untouched memory from np.empty
    could hold signalling NaNs, whose cast to float64 in the reference warned now and then.)"""
    x = 16 // np.dtype(dtype).itemsize
    key_cache = np.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x), np.nan, dtype)
    value_cache = np.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE), np.nan, dtype)
    for b in used_blocks:
        key_cache[b] = rng.standard_normal(key_cache.shape[1:])
        value_cache[b] = rng.standard_normal(value_cache.shape[1:])
    block_tables = np.asarray(used_blocks, np.int32).reshape(2, -1)
    n = block_tables.shape[1]
    seq_lens = np.array([n * BLOCK_SIZE, (n - 1) * BLOCK_SIZE - 3], np.int32)
    return key_cache, value_cache, block_tables, seq_lens


def check_decode_and_prefill(rng, key_cache, value_cache, block_tables, seq_lens, backend):
    k, v = pagedvk.asarray(key_cache), pagedvk.asarray(value_cache)
    query = rng.standard_normal((2, 4, HEAD_SIZE)).astype(np.float32)
    out = pagedvk.paged_attention(query, k, v, block_tables, seq_lens, backend=backend)
    ref = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    assert rel_error(out, ref) <= 1e-5
    q = rng.standard_normal((2, 4, 3, HEAD_SIZE)).astype(np.float32)
    out, lse = pagedvk.paged_attention_prefill(q, k, v, block_tables, seq_lens, layout="vllm", backend=backend)
    ref_out, ref_lse = reference.paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens,
                                                         layout="vllm")
    assert rel_error(out, ref_out) <= 1e-5 and rel_error(lse, ref_lse) <= 1e-5
    return k, v


def test_cache_above_one_binding(rng, device, backend):
    # Just past maxStorageBufferRange (capped at 160 MiB so this runs everywhere): the blocks read sit at both
    # ends of the cache, in both segments.
    limit = array.segment_limit(device)
    num_blocks = min(limit, 160 << 20) // BLOCK_BYTES + 64
    used = np.concatenate([rng.choice(64, 4, replace=False), num_blocks - 1 - rng.choice(64, 4, replace=False)])
    rng.shuffle(used)
    caches = sparse_caches(rng, num_blocks, used)
    k, v = check_decode_and_prefill(rng, *caches, backend)
    if caches[0].nbytes > limit:
        assert len(k.buffers) == len(v.buffers) == 2


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("backend,addressed", [("glsl", True), ("glsl", False), ("wgsl", False)],
                         ids=["glsl-addresses", "glsl-bindings", "wgsl-bindings"])
def test_segments(rng, device, monkeypatch, segments, backend, addressed):
    # Segments of 16 blocks: every segment holds blocks some sequence reads. GLSL reads them through buffer
    # device addresses (where the device has them) or, as WGSL always does, through four bindings a cache.
    monkeypatch.setattr(array, "segment_limit", lambda device: 16 * BLOCK_BYTES)
    monkeypatch.setattr(device, "buffer_device_address", addressed and device.buffer_device_address)
    num_blocks = 16 * segments
    used = np.concatenate([s * 16 + rng.choice(16, 2, replace=False) for s in range(segments)])
    rng.shuffle(used)
    key_cache, value_cache, block_tables, seq_lens = sparse_caches(rng, num_blocks, used)
    k, v = check_decode_and_prefill(rng, key_cache, value_cache, block_tables, seq_lens, backend)
    assert len(k.buffers) == segments and k.segment_rows == 16
    assert (k.numpy()[used] == key_cache[used]).all() and (v.numpy()[used] == value_cache[used]).all()


def test_more_segments_than_bindings_is_a_clear_error(rng, device, monkeypatch):
    monkeypatch.setattr(array, "segment_limit", lambda device: 16 * BLOCK_BYTES)
    monkeypatch.setattr(device, "buffer_device_address", False)
    used = np.arange(0, 80, 8)
    key_cache, value_cache, block_tables, seq_lens = sparse_caches(rng, 80, used)
    k, v = pagedvk.asarray(key_cache), pagedvk.asarray(value_cache)
    query = rng.standard_normal((2, 4, HEAD_SIZE)).astype(np.float32)
    with pytest.raises(ValueError, match=r"key_cache spans 5 buffers of 16 blocks, more than the 4 bindings"):
        pagedvk.paged_attention(query, k, v, block_tables, seq_lens, backend="glsl")


def test_segmented_array_round_trip(rng, device, monkeypatch):
    monkeypatch.setattr(array, "segment_limit", lambda device: 4096)
    host = rng.standard_normal((100, 3, 7)).astype(np.float32)   # 84-byte rows: 48 rows a segment
    a = pagedvk.asarray(host)
    assert len(a.buffers) == 3 and a.segment_rows == 48
    assert (a.numpy() == host).all()
    a.write(host[::-1].copy())
    assert (a.numpy() == host[::-1]).all()
    with pytest.raises(ValueError, match="spans 3 buffers of 48 rows"):
        a.buffer
    with pytest.raises(ValueError, match="has 8192-byte rows, more than"):
        pagedvk.empty((2, 2048), np.float32)


def test_caches_past_2_gib(rng, device):
    # NVIDIA's length() of a 2 GiB binding is wrong: the bound comes from the launcher. Elsewhere such a cache
    # is segmented; either way the blocks past the 2 GiB mark are read right.
    num_blocks = 2**31 // BLOCK_BYTES + 64
    used = np.concatenate([rng.choice(num_blocks - 128, 6, replace=False), num_blocks - 1 - np.arange(6)])
    rng.shuffle(used)
    key_cache, value_cache, block_tables, seq_lens = sparse_caches(rng, num_blocks, used)
    query = rng.standard_normal((2, 4, HEAD_SIZE)).astype(np.float32)
    out = np.full(query.shape, np.nan, np.float32)
    pagedvk.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)
    ref = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    assert rel_error(out, ref) <= 1e-5
