#!/usr/bin/env python3
"""pagedvk decode beside torch's scaled_dot_product_attention, in one process, on one GPU.

Where torch with CUDA is present (the peers need it; pagedvk runs on Vulkan beside it), for each shape and
dtype: the device's read bandwidth (pagedvk's read kernel), pagedvk's decode over a paged cache (GPU
timestamps), SDPA over a contiguous KV cache, and SDPA after gathering the paged cache's blocks into a
contiguous one (what an engine without a paged kernel does). Times are medians of many runs, timed with CUDA
events for torch; caches are rotated over several layers so that no run reads from the GPU's L2.

    python benchmarks/peers.py                         # fp16, bf16 and f32 at the decode sweep's shapes
    python benchmarks/peers.py --dtypes float16 --shapes 64x4096 --json peers.json
"""

import argparse
import json
import math
import sys

import numpy as np

from pagedvk import bench

ROTATE_BYTES = 1 << 30


def sdpa_times(torch, shape: bench.DecodeShape, dtype, iters: int) -> dict:
    """Median microseconds of SDPA decode on contiguous KV and of gather + SDPA on a paged (NHD) cache."""
    F = torch.nn.functional
    dev = torch.device("cuda")
    B, H, Hkv, D, T, bs = shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_size, shape.context, shape.block_size
    kv_bytes = 2 * B * T * Hkv * D * torch.tensor([], dtype=dtype).element_size()
    layers = max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
    q = torch.randn(B, H, 1, D, device=dev, dtype=dtype)
    contiguous = [(torch.randn(B, Hkv, T, D, device=dev, dtype=dtype), torch.randn(B, Hkv, T, D, device=dev, dtype=dtype))
                  for _ in range(layers)]
    blocks_per_seq = T // bs
    num_blocks = B * blocks_per_seq
    tables = torch.randperm(num_blocks, device=dev).reshape(B, blocks_per_seq)
    paged = [(torch.randn(num_blocks, bs, Hkv, D, device=dev, dtype=dtype),
              torch.randn(num_blocks, bs, Hkv, D, device=dev, dtype=dtype)) for _ in range(layers)]

    def contiguous_step(i):
        k, v = contiguous[i % layers]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def gather_step(i):
        k, v = paged[i % layers]
        k = k[tables].reshape(B, T, Hkv, D).transpose(1, 2)
        v = v[tables].reshape(B, T, Hkv, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def timed(step):
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        times = []
        for i in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return float(np.median(times))

    result = {"sdpa_contiguous_us": timed(contiguous_step), "sdpa_gather_us": timed(gather_step)}
    contiguous.clear()   # the caches' memory goes back before the next shape's
    paged.clear()
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float16,bfloat16,float32")
    p.add_argument("--shapes", default=None, help="comma-separated BATCHxCONTEXT (default: the decode sweep)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("peers.py needs torch with CUDA (the peers it times are torch's)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("peers.py needs torch with CUDA: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    shapes = bench.SWEEP if args.shapes is None else bench.parse_shapes(args.shapes)
    ceiling = bench.read_bandwidth(iters=args.iters)
    print(f"read kernel: {ceiling['GBps']:.0f} GB/s; torch {torch.__version__} on {torch.cuda.get_device_name()}",
          flush=True)
    torch_dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    rows = []
    for dtype in args.dtypes.split(","):
        for num_seqs, context in shapes:
            shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=dtype)
            ours = bench.decode(shape, iters=args.iters)
            row = {**ours, "read_GBps": ceiling["GBps"], "fraction_of_read": ours["GBps"] / ceiling["GBps"],
                   **sdpa_times(torch, shape, torch_dtypes[dtype], args.iters)}
            rows.append(row)
            print(f"{dtype:>9} {num_seqs:>4} x {context:>6}: pagedvk {row['median_us']:8.1f} us "
                  f"({100 * row['fraction_of_read']:.0f}% of read), SDPA contiguous {row['sdpa_contiguous_us']:8.1f} us, "
                  f"gather + SDPA {row['sdpa_gather_us']:8.1f} us", flush=True)
    print("\n| dtype | batch | context | pagedvk | of read BW | SDPA, contiguous KV | gather + SDPA | pagedvk / SDPA |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['dtype']} | {r['num_seqs']} | {r['context']} | {r['median_us']:.1f} us | "
              f"{100 * r['fraction_of_read']:.0f}% | {r['sdpa_contiguous_us']:.1f} us | {r['sdpa_gather_us']:.1f} us | "
              f"{r['median_us'] / r['sdpa_contiguous_us']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read": ceiling, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
