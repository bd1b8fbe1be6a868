#!/usr/bin/env python3
"""pagedvk decode (GLSL and WGSL) beside torch's scaled_dot_product_attention, in one process, on one GPU.

pagedvk's side is `pagedvk bench --suite`'s (pagedvk.testing.suite.run): the read kernel first, then each shape and
dtype with GPU timestamps. Where torch with CUDA is present, the same shapes and dtypes then run through SDPA:
  - SDPA on a contiguous KV cache ([batch, kv heads, context, head]);
  - gather + SDPA on a paged cache (vLLM's NHD blocks [blocks, block, kv heads, head], random block tables):
    indexing the cache by the block tables copies each sequence's blocks into contiguous K and V, then SDPA
    reads them; the time is of both together, as an engine without a paged kernel pays it; the gather is
    also timed alone.
GQA through SDPA's enable_gqa=True where torch has it (2.5+), else by repeat_interleave of the KV heads inside
the timed step (the output says which). Torch times are CUDA-event medians over batches of runs back to back,
rotating over enough layers' caches that no run reads from the GPU's L2. Without torch or CUDA it says so and
prints pagedvk's figures alone. SDPA has no fp8 path: fp8 rows have pagedvk's figures only.

    python benchmarks/peers.py                                  # f16, bf16, f32 at issue 9's shapes
    python benchmarks/peers.py --dtypes f16 --shapes 64x4096 --json peers.json
    python benchmarks/peers.py --dtypes bf16 --no-torch                 # GLSL and WGSL alone
"""

import argparse
import json
import math
import sys

import numpy as np

from pagedvk.testing import bench, suite
from pagedvk.cli import parsed, positive

ROTATE_BYTES = 1 << 30


def load_torch():
    """torch, or None and why not."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA device (torch.cuda.is_available() is False)"
    return torch, None


def gqa_mode(torch) -> str:
    try:
        q = torch.zeros(1, 2, 1, 8, device="cuda")
        kv = torch.zeros(1, 1, 4, 8, device="cuda")
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return "enable_gqa=True"
    except TypeError:
        return "repeat_interleave of the KV heads inside the timed step"


def sdpa_times(torch, shape: bench.DecodeShape, iters: int, repeats: int, gqa: str) -> dict:
    """Median microseconds a step of SDPA on contiguous KV, of the gather alone, and of gather + SDPA."""
    F = torch.nn.functional
    dtype = getattr(torch, shape.dtype)
    dev = torch.device("cuda")
    B, H, Hkv, D, T, bs = (shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_size, shape.context,
                           shape.block_size)
    layers = max(1, min(8, math.ceil(ROTATE_BYTES / shape.kv_bytes)))
    blocks_per_seq = math.ceil(T / bs)
    num_blocks = B * blocks_per_seq
    q = torch.randn(B, H, 1, D, device=dev, dtype=dtype)
    contiguous = [(torch.randn(B, Hkv, T, D, device=dev, dtype=dtype),
                   torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)) for _ in range(layers)]
    paged = [(torch.randn(num_blocks, bs, Hkv, D, device=dev, dtype=dtype),
              torch.randn(num_blocks, bs, Hkv, D, device=dev, dtype=dtype)) for _ in range(layers)]
    tables = torch.randperm(num_blocks, device=dev).reshape(B, blocks_per_seq)

    def attention(k, v):
        if gqa == "enable_gqa=True":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))

    def gather(i):
        k, v = paged[i % layers]
        return (k[tables].reshape(B, blocks_per_seq * bs, Hkv, D)[:, :T].transpose(1, 2),
                v[tables].reshape(B, blocks_per_seq * bs, Hkv, D)[:, :T].transpose(1, 2))

    def timed(step):
        for i in range(layers):   # warm-up: allocator, kernels chosen
            step(i)
        torch.cuda.synchronize()
        per_step = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(iters):
                step(i)
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) * 1e3 / iters)
        return float(np.median(per_step))

    try:
        return {"sdpa_contiguous_us": timed(lambda i: attention(*contiguous[i % layers])),
                "gather_us": timed(gather), "gather_sdpa_us": timed(lambda i: attention(*gather(i)))}
    finally:
        contiguous.clear()   # the caches' memory goes back before the next shape's
        paged.clear()
        torch.cuda.empty_cache()


def us(value) -> str:
    return "-" if value is None else f"{value:.1f} us"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--shapes", type=parsed(bench.parse_shapes), default=bench.SWEEP,
                       help="comma-separated BATCHxCONTEXT (default: issue 9's decode sweep)")
    sweep.add_argument("--small", action="store_true", help="the lavapipe-sized sweep instead")
    p.add_argument("--dtypes", type=parsed(bench.parse_dtypes), default=["float16", "bfloat16", "float32"],
                   help="comma-separated cache dtypes, by name or tag (default: f16,bf16,f32)")
    p.add_argument("--backends", type=parsed(bench.parse_backends), default=["glsl", "wgsl"])
    p.add_argument("--iters", type=positive, default=50, help="runs back to back per timed batch")
    p.add_argument("--repeats", type=positive, default=5, help="timed batches (pagedvk: submissions)")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--no-torch", action="store_true",
                   help="pagedvk's figures alone, without torch's (a GLSL-WGSL comparison needs no peers)")
    args = p.parse_args(argv)
    shapes = bench.SMALL_SWEEP if args.small else args.shapes
    torch, why_not = (None, "--no-torch given") if args.no_torch else load_torch()

    def on_row(r):
        print(f"pagedvk {r['backend']} {r['kernel']:>7} {r['dtype']:>13} {r['num_seqs']:>4} x {r['context']:>6}: "
              f"{r['median_us']:9.1f} us "
              f"({100 * r['fraction_of_read']:.0f}% of read), err {r['rel_error']:.1e}", flush=True)

    record = suite.run(shapes, args.dtypes, args.backends, iters=args.iters, repeats=args.repeats, on_row=on_row)
    peers, gqa = {}, None
    if torch is None:
        print(f"\nno torch peers: {why_not}; pagedvk's figures alone", flush=True)
    else:
        gqa = gqa_mode(torch)
        record["torch"] = {"version": torch.__version__, "device": torch.cuda.get_device_name(), "gqa": gqa}
        for num_seqs, context in shapes:
            for dtype in args.dtypes:
                if not hasattr(torch, dtype) or dtype.startswith("float8"):
                    continue   # SDPA has no fp8 path
                shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=dtype)
                peers[num_seqs, context, dtype] = t = sdpa_times(torch, shape, args.iters, args.repeats, gqa)
                print(f"torch {dtype:>9} {num_seqs:>4} x {context:>6}: "
                      f"SDPA contiguous {t['sdpa_contiguous_us']:.1f} us, "
                      f"gather {t['gather_us']:.1f} us, gather + SDPA {t['gather_sdpa_us']:.1f} us", flush=True)
        record["peers"] = [{"num_seqs": b, "context": c, "dtype": d, **t} for (b, c, d), t in peers.items()]

    ours = {(r["num_seqs"], r["context"], r["dtype"], r["backend"]): r for r in record["rows"]}
    print(f"\n{record['device']} ({record['driver']}): read kernel {record['read']['GBps']:.1f} GB/s; "
          + (f"torch {torch.__version__} on {record['torch']['device']}, GQA by {gqa}" if torch else why_not))
    print("pagedvk: GPU timestamps, % of the read kernel; torch: CUDA events; gather + SDPA: the block-table "
          "copy of K and V into contiguous tensors, then SDPA\n")
    head = "".join(f" pagedvk {b.upper()} | of read |" for b in args.backends)
    print(f"| dtype | batch | context |{head} SDPA, contiguous KV | gather + SDPA | gather alone |")
    print("| --- " * (3 + 2 * len(args.backends) + 3) + "|")
    for num_seqs, context in shapes:
        for dtype in args.dtypes:
            cells = ""
            for backend in args.backends:
                r = ours[num_seqs, context, dtype, backend]
                cells += f" {us(r['median_us'])} | {100 * r['fraction_of_read']:.0f}% |"
            t = peers.get((num_seqs, context, dtype), {})
            print(f"| {dtype} | {num_seqs} | {context} |{cells} {us(t.get('sdpa_contiguous_us'))} | "
                  f"{us(t.get('gather_sdpa_us'))} | {us(t.get('gather_us'))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if all(r["ok"] for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
