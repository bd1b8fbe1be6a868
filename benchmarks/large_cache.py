#!/usr/bin/env python3
"""Decode over a paged cache far larger than one binding: two float16 caches of GIB GiB each (default 24), split
into segments of whole blocks; 64 blocks spread over every segment (the last block included) hold random data,
and decode's result is checked against float64.

    python benchmarks/large_cache.py 24        # 2 x 24 GiB (the H200 run in BENCHMARKS.md)
"""

import argparse
import sys
import time

import numpy as np

import pagedvk
from pagedvk.testing import reference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gib", nargs="?", type=float, default=24.0, help="GiB of each cache (default 24)")
    gib = p.parse_args(argv).gib
    if not gib > 0:
        p.error(f"gib must be a positive size, got {gib}")
    rng = np.random.default_rng(0)
    dtype, num_kv_heads, head_size, block_size, x = np.float16, 8, 128, 16, 8
    block_bytes = num_kv_heads * head_size * block_size * 2
    num_blocks = int(gib * 2**30) // block_bytes
    t0 = time.time()
    k = pagedvk.empty((num_blocks, num_kv_heads, head_size // x, block_size, x), dtype)
    v = pagedvk.empty((num_blocks, num_kv_heads, head_size, block_size), dtype)
    print(f"allocated 2 x {gib} GiB = {2 * k.nbytes / 2**30:.1f} GiB in {len(k.buffers)} + {len(v.buffers)} segments "
          f"of {k.segment_rows} blocks, {time.time() - t0:.1f} s", flush=True)
    # Blocks spread over the whole cache (every segment), written block by block into their segments.
    used = np.sort(rng.choice(num_blocks, 64, replace=False))
    used[-1] = num_blocks - 1
    kb = rng.standard_normal((64,) + k.shape[1:]).astype(dtype)
    vb = rng.standard_normal((64,) + v.shape[1:]).astype(dtype)
    for cache, data in ((k, kb), (v, vb)):
        row_bytes = cache.nbytes // cache.shape[0]
        for i, b in enumerate(used):
            segment, row = divmod(int(b), cache.segment_rows)
            cache.device.upload(cache.buffers[segment], data[i], offset=row * row_bytes)
    block_tables = rng.permutation(used).astype(np.int32).reshape(4, 16)
    seq_lens = np.array([256, 250, 200, 129], np.int32)
    q = rng.standard_normal((4, 32, head_size)).astype(dtype)
    out = pagedvk.paged_attention(q, k, v, block_tables, seq_lens)
    # The reference reads the 64 blocks only: renumbered 0 .. 63.
    renumbered = np.searchsorted(used, block_tables).astype(np.int32)
    ref = reference.paged_attention(q, kb, vb, renumbered, seq_lens)
    error = float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))
    print(f"decode over a {2 * k.nbytes / 2**30:.1f} GiB cache ({num_blocks} blocks, ids up to {used.max()}): "
          f"rel. error {error:.2e}", flush=True)
    return 0 if error <= 2e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
