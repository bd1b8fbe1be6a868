"""`pagedvk devices`, `pagedvk bench` and `pagedvk demo`."""

from __future__ import annotations

import argparse
import json
import sys

from . import bench
from .errors import PagedVKError
from .selection import devices, select

TOLERANCE = {"float32": 1e-5}


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def cmd_devices(args) -> int:
    infos = devices()
    chosen, reason = select()
    yes = lambda b: "yes" if b else "-"
    rows = [("", "#", "name", "type", "vendor", "driver", "vulkan", "local mem", "subgroup", "fp16", "16-bit",
             "8-bit", "bf16", "coop-mat", "max binding")]
    for i in infos:
        rows.append(("*" if i.index == chosen.index else "", str(i.index), i.name, i.type, i.vendor,
                     f"{i.driver} {i.driver_version}", i.api_version, gib(i.device_local_bytes),
                     str(i.subgroup_size), yes(i.fp16), yes(i.storage16), yes(i.storage8), yes(i.bf16),
                     yes(i.cooperative_matrix), gib(i.max_storage_buffer_range)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    print(f"\nselected: [{chosen.index}] {chosen.name}: {reason}")
    return 0


def cmd_bench(args) -> int:
    shape = bench.DecodeShape(num_seqs=args.num_seqs, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                              head_size=args.head_size, block_size=args.block_size, context=args.context,
                              dtype=args.dtype)
    ceiling = bench.read_bandwidth(args.device, iters=args.iters, progress=not args.json)
    r = bench.decode(shape, iters=args.iters, repeats=args.repeats, layers=args.layers, device=args.device,
                     backend=args.backend, progress=not args.json)
    r["read_GBps"] = ceiling["GBps"]
    r["fraction_of_read"] = r["GBps"] / ceiling["GBps"]
    ok = r["rel_error"] <= TOLERANCE[shape.dtype]
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"device       {r['device']} (backend {r['backend']})")
        print(f"shape        {shape.num_seqs} seqs x {shape.context} tokens, {shape.num_heads} heads / "
              f"{shape.num_kv_heads} kv heads, head {shape.head_size}, block {shape.block_size}, {shape.dtype}")
        print(f"check        rel. error {r['rel_error']:.2e} vs float64 on {r['checked_seqs']} seqs: "
              f"{'ok' if ok else 'FAILED'}")
        print(f"latency      median {r['median_us']:.1f} us (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}), "
              f"{r['iters']} runs over {r['layers']} rotated caches, GPU timestamps; "
              f"{r['partitions']} partition(s) of {r['partition_size']} tokens")
        print(f"KV bandwidth {r['GBps']:.1f} GB/s effective = {100 * r['fraction_of_read']:.0f}% of the "
              f"device's read kernel ({ceiling['GBps']:.1f} GB/s over {gib(ceiling['bytes'])})")
    return 0 if ok else 1


def cmd_demo(args) -> int:
    from .serve import demo     # numpy-only: no device is opened for it yet
    return demo(args.requests, args.layers, args.heads, args.kv_heads, args.head_size, args.num_blocks,
                args.block_size, args.seed, args.check)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedvk", description="Paged attention on Vulkan devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="list Vulkan devices and which one is selected").set_defaults(run=cmd_devices)
    b = sub.add_parser("bench", help="time decode attention on the selected device",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = bench.DecodeShape()
    b.add_argument("--num-seqs", type=int, default=d.num_seqs)
    b.add_argument("--num-heads", type=int, default=d.num_heads)
    b.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    b.add_argument("--head-size", type=int, default=d.head_size)
    b.add_argument("--block-size", type=int, default=d.block_size)
    b.add_argument("--context", type=int, default=d.context, help="tokens cached per sequence")
    b.add_argument("--dtype", choices=sorted(TOLERANCE), default=d.dtype)
    b.add_argument("--iters", type=int, default=20, help="runs back to back in one submission")
    b.add_argument("--repeats", type=int, default=3, help="timed submissions (after one warm-up)")
    b.add_argument("--layers", type=int, default=None, help="caches rotated (default: enough for 512 MiB)")
    b.add_argument("--backend", default=None, help="glsl or wgsl (default: PAGEDVK_BACKEND or glsl)")
    b.add_argument("--device", default=None, help="index or name (default: PAGEDVK_DEVICE or the best)")
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    b.set_defaults(run=cmd_bench)
    m = sub.add_parser("demo", help="serve a stream of requests with a small model over a paged KV cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m.add_argument("--requests", type=int, default=24)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-size", type=int, default=16)
    m.add_argument("--num-blocks", type=int, default=48, help="device blocks (few enough to preempt)")
    m.add_argument("--block-size", type=int, default=8)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--check", action="store_true", help="compare every sample's tokens with a dense reference run")
    m.set_defaults(run=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (PagedVKError, ValueError, TypeError) as e:
        print(f"pagedvk: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
