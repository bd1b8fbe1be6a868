#!/usr/bin/env python3
"""pagedvk.linear timed on the GPU against the device's read kernel (shaders/read_bandwidth.comp) in the same run.

The decode's linear layers only stream their weights, so the figure to watch is the weights' bytes over the GPU
time, as GB/s and as a share of what the plain read kernel reaches on this device (measured first, as for
benchmarks/decode.py). Each shape's result is checked against float64 before anything is timed. Weights of several
copies (at least 512 MiB in all, up to 16 copies) are rotated so that one copy is not re-read from the GPU's cache.
Times: timestamp queries around each launch, median of --iters x 2 launches, after half a second of warm-up.

Default shapes: one Llama-3.2-1B layer (hidden 2048, 32 query / 8 kv heads of 64, MLP 8192) and its lm head:
2048->2048 (q, o), 2048->512 (k, v), 2048->8192 (gate, up), 8192->2048 (down), 2048->128256 (lm head); float16
weights and activations; 1 token (decode: the matrix-vector kernel) and 32 (the tiled kernel).

    python benchmarks/linear.py                                  # the defaults above
    python benchmarks/linear.py --tokens 1,4,8,32 --dtype bfloat16
    python benchmarks/linear.py --shapes 4096x14336 --kernel gemv --tokens 8   # force a kernel
    python benchmarks/linear.py --small                          # a sweep lavapipe finishes in seconds
    python benchmarks/linear.py --json linear.json               # also write every figure
"""

import argparse
import json
import math
import sys

import ml_dtypes
import numpy as np

import pagedvk
from pagedvk import config
from pagedvk.ops.linear import LINEAR_KERNELS, linear_kernel
from pagedvk.testing import bench, reference

LLAMA_3_2_1B = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (2048, 128256)]
SMALL = [(256, 96), (96, 300)]
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# float64 check: float32 sums, then the output rounded (float16 2^-12, bfloat16 2^-9 relative at most)
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}
MAX_COPIES = 16


def parse_shapes(text: str) -> list:
    """IN_FEATURESxOUT_FEATURES, comma-separated ("2048x512,8192x2048")."""
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes must be comma-separated INxOUT of positive ints, got {text!r}")
    return shapes


def time_linear(device, in_features: int, out_features: int, tokens: int, dtype, kernel: str, backend, iters: int):
    rng = np.random.default_rng(0)
    weight_bytes = in_features * out_features * np.dtype(dtype).itemsize
    copies = max(1, min(MAX_COPIES, math.ceil(bench.ROTATE_BYTES / weight_bytes)))
    host_w = (rng.standard_normal((out_features, in_features)) / math.sqrt(in_features)).astype(dtype)
    host_x = rng.standard_normal((tokens, in_features)).astype(dtype)
    weights = [pagedvk.asarray(host_w, device) for _ in range(copies)]
    x = pagedvk.asarray(host_x, device)
    y = pagedvk.empty((tokens, out_features), dtype, device)
    try:
        pagedvk.linear(x, weights[0], out=y, kernel=kernel, backend=backend)
        error = float(np.linalg.norm(y.numpy().astype(np.float64) - reference.linear(host_x, host_w))
                      / np.linalg.norm(reference.linear(host_x, host_w)))
        with pagedvk.record(device) as step:   # each copy's launch, timed one by one
            for w in weights:
                pagedvk.linear(x, w, out=y, kernel=kernel, backend=backend)
        launches = step.dispatches()
        step.close()
        steps = (launches * math.ceil(iters / copies))[:max(iters, copies)]
        times = bench.time_steps(device, steps, 1, 2)
    finally:
        for a in weights + [x, y]:
            a.close()
    figures = bench.percentiles(times)
    seconds = figures["median_us"] * 1e-6
    return {"in_features": in_features, "out_features": out_features, "tokens": tokens,
            "dtype": np.dtype(dtype).name, "kernel": linear_kernel(tokens) if kernel == "auto" else kernel,
            "weight_bytes": weight_bytes, "copies": copies, **figures, "GBps": weight_bytes / seconds / 1e9,
            "TFLOPs": 2.0 * tokens * in_features * out_features / seconds / 1e12, "rel_error": error}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma-separated IN_FEATURESxOUT_FEATURES (default: a Llama-3.2-1B layer and its lm head)")
    p.add_argument("--tokens", default="1,32", help="comma-separated token counts (default 1,32)")
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="weights and activations (default float16)")
    p.add_argument("--kernel", default="auto", choices=LINEAR_KERNELS,
                   help="auto: gemv up to 8 tokens, gemm beyond (pagedvk.ops.linear.linear_kernel)")
    p.add_argument("--backend", default=None, help="glsl or wgsl (default: PAGEDVK_BACKEND, else glsl)")
    p.add_argument("--iters", type=int, default=50, help="launches per timing submission (default 50)")
    p.add_argument("--small", action="store_true", help="tiny shapes, to check the script (lavapipe)")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    shapes = SMALL if args.small else LLAMA_3_2_1B if args.shapes is None else parse_shapes(args.shapes)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens must be comma-separated ints, got {args.tokens!r}") from None
    device = pagedvk.default_device()
    ceiling = bench.read_bandwidth(device, nbytes=(64 << 20) if args.small else 1 << 30, iters=args.iters)
    read_gbps = ceiling["GBps"]   # bytes per ns: GB/s
    rows = []
    for in_features, out_features in shapes:
        for n in tokens:
            r = time_linear(device, in_features, out_features, n, DTYPES[args.dtype], args.kernel, args.backend,
                            args.iters)
            r["fraction_of_read"] = r["GBps"] / read_gbps
            rows.append(r)
            ok = "" if r["rel_error"] <= TOLERANCE[args.dtype] else "  WRONG (error above tolerance)"
            print(f"{in_features:>6} -> {out_features:>6} x {n:>3} tokens {r['kernel']}: {r['median_us']:9.1f} us "
                  f"{r['GBps']:8.1f} GB/s ({100 * r['fraction_of_read']:.0f}% of read) {r['TFLOPs']:7.2f} TFLOP/s "
                  f"err {r['rel_error']:.1e}{ok}", flush=True)
    print(f"\ndevice: {device.info.name}; read kernel {read_gbps:.1f} GB/s over {ceiling['bytes'] / 2**30:.2f} GiB; "
          f"backend {config.backend(args.backend)}; {args.dtype} weights and activations\n")
    print("| in | out | tokens | kernel | median | p10-p90 | weights GB/s | of read BW | TFLOP/s | rel. error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['in_features']} | {r['out_features']} | {r['tokens']} | {r['kernel']} | {r['median_us']:.1f} us | "
              f"{r['p10_us']:.1f}-{r['p90_us']:.1f} us | {r['GBps']:.1f} | {100 * r['fraction_of_read']:.0f}% | "
              f"{r['TFLOPs']:.2f} | {r['rel_error']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.info.name, "read_GBps": read_gbps, "rows": rows}, f, indent=1)
    return 0 if all(r["rel_error"] <= TOLERANCE[args.dtype] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
