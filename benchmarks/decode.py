#!/usr/bin/env python3
"""Decode sweep for BENCHMARKS.md: the device's read bandwidth, then each shape's GPU-timed decode.

    python benchmarks/decode.py                       # the sweep sized for a datacenter GPU
    python benchmarks/decode.py --small               # a sweep lavapipe finishes in a minute or two
    python benchmarks/decode.py --json out.json       # also write every figure
    python benchmarks/decode.py --shapes 64x4096,8x4096 --dtype float16   # these shapes, in this order
    python benchmarks/decode.py --shapes 8x4096,8x32768 --window-left 1023 # a sliding window: the time follows
                                                                            # the window, not the context
    python benchmarks/decode.py --dtype float16 --kernels gpu,coopmat       # each kernel forced, on the same
                                                                            # inputs in one process
"""

import argparse
import json
import sys

from pagedvk.testing import bench



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--backend", default=None)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="cache dtype: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2")
    p.add_argument("--shapes", default=None, help="comma-separated BATCHxCONTEXT, run in this order (default: the sweep)")
    p.add_argument("--window-left", type=int, default=-1,
                   help="sliding window: each query sees its last WINDOW_LEFT + 1 keys (default -1: no window)")
    p.add_argument("--kernels", default="",
                   help="comma-separated DecodePlan kernels (cpu, gpu, coopmat), each timed on the same inputs "
                        "(default: the plan's own choice)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()] or [None]
    ceiling = bench.read_bandwidth(iters=args.iters)
    rows = []
    shapes = (bench.SMALL_SWEEP if args.small else bench.SWEEP) if args.shapes is None else bench.parse_shapes(args.shapes)
    for num_seqs, context in shapes:
        shape = bench.DecodeShape(num_seqs=num_seqs, context=context, block_size=args.block_size, dtype=args.dtype,
                                  window_left=args.window_left)
        with bench.DecodeInputs(shape) as inputs:
            for kernel in kernels:
                r = bench.time_decode(inputs, args.backend, args.iters, kernel=kernel)
                r["fraction_of_read"] = r["GBps"] / ceiling["GBps"]
                rows.append(r)
                print(f"{num_seqs:>5} x {context:>6} {r['kernel']:>7}: {r['median_us']:10.1f} us  {r['GBps']:8.1f} GB/s "
                      f"({100 * r['fraction_of_read']:.0f}% of read)  err {r['rel_error']:.1e}", flush=True)
    device = rows[0]["device"]
    print(f"\ndevice: {device}; read kernel {ceiling['GBps']:.1f} GB/s over {ceiling['bytes'] / 2**30:.2f} GiB "
          f"(median of {2 * args.iters} runs); backend {rows[0]['backend']}\n")
    print("| batch | context | window | dtype | kernel | median | p10-p90 | KV GB/s | of read BW | rel. error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        window = "-" if r["window_left"] < 0 else r["window_left"] + 1
        print(f"| {r['num_seqs']} | {r['context']} | {window} | {r['dtype']} | {r['kernel']} | {r['median_us']:.1f} us | "
              f"{r['p10_us']:.1f}-{r['p90_us']:.1f} us | {r['GBps']:.1f} | {100 * r['fraction_of_read']:.0f}% | "
              f"{r['rel_error']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read": ceiling, "decode": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
