#!/usr/bin/env python3
"""Decode module sets timed against each other in one process, on the same inputs, rounds alternating (A B A B):
how a kernel change is measured on a GPU whose clocks and neighbours drift between processes and machines.

Each set is NAME=DIR, a folder of SPIR-V modules (a `python build_shaders.py --out DIR` of some tree, or a copy of
pagedvk/spv before an edit); a plan of that set loads each decode module from DIR where DIR has it, else from the
package's modules. Every result is checked against float64 first (`rel. error`), as `pagedvk bench` checks its own.

    cp -r pagedvk/spv /tmp/before && (edit shaders/) && python build_shaders.py
    python benchmarks/decode_ab.py before=/tmp/before after=pagedvk/spv --dtypes float16,bfloat16 \\
        --shapes 8x4096,1x32768,64x4096 --json ab.json
    python benchmarks/decode_ab.py a=pagedvk/spv b=/tmp/b --partition-sizes 1x32768:512+1024 --kernel coopmat
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedvk.testing import bench  # noqa: E402


def module_sets(p, items: list) -> list:
    """[(name, folder)] of NAME=DIR arguments, each folder holding SPIR-V modules."""
    sets = []
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            p.error(f"a set is NAME=DIR, got {item!r}")
        if not Path(folder).is_dir() or not any(Path(folder).glob("*.spv")):
            p.error(f"set {name}: {folder} is not a folder of SPIR-V modules")
        sets.append((name, Path(folder)))
    if len({name for name, _ in sets}) != len(sets):
        p.error("sets need distinct names")
    return sets


def partition_sizes(p, text: str) -> dict:
    """{"BxC": [tokens, ...]} of --partition-sizes SHAPE:T1+T2,..."""
    sizes = {}
    for item in filter(None, text.split(",")):
        shape, _, tokens = item.partition(":")
        try:
            sizes[shape] = [int(t) for t in tokens.split("+")]
        except ValueError:
            p.error(f"--partition-sizes takes SHAPE:TOKENS[+TOKENS...], got {item!r}")
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sets", nargs="+", help="NAME=DIR (one alone: its figures, no comparison)")
    p.add_argument("--dtypes", default="float16")
    p.add_argument("--shapes", default="64x4096,256x2048,32x16384,8x32768,1x32768,8x4096,1x4096")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--kernel", default=None, help="DecodePlan's kernel (default: the plan's choice)")
    p.add_argument("--backend", default="glsl")
    p.add_argument("--partition-sizes", default="", help="SHAPE:TOKENS[+TOKENS...],... (default: the plan's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sets = module_sets(p, args.sets)
    sizes = partition_sizes(p, args.partition_sizes)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    device = bench.get_device()
    ceiling = bench.read_bandwidth(device, iters=args.iters)
    print(f"{device.info.name}: read kernel {ceiling['GBps']:.0f} GB/s", flush=True)
    rows = []
    with bench.DecodeModules(device) as modules:
        for dtype in args.dtypes.split(","):
            for num_seqs, context in bench.parse_shapes(args.shapes):
                shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=dtype)
                with bench.DecodeInputs(shape, device=device) as inputs:
                    for rnd in range(args.rounds):
                        for name, folder in sets:
                            for size in sizes.get(f"{num_seqs}x{context}", [None]):
                                modules.use(folder)
                                r = bench.time_decode(inputs, args.backend, iters=args.iters, partition_size=size,
                                                      kernel=args.kernel)
                                served = [m for m, from_set in modules.loaded if from_set]
                                r.update(set=name, folder=str(folder), round=rnd,
                                         fraction_of_read=r["GBps"] / ceiling["GBps"],
                                         modules_from_set=served,
                                         modules_from_package=[m for m, s in modules.loaded if not s])
                                rows.append(r)
                                print(f"{args.backend} {shape.dtype:<14} {num_seqs:>4} x {context:<6} {name:<10} "
                                      f"{r['partitions']:>3} x {r['partition_size']:<6} {r['median_us']:9.2f} us "
                                      f"({100 * r['fraction_of_read']:.1f}% of read) rel. error {r['rel_error']:.1e} "
                                      f"{r['kernel']}; modules from the set: {len(served)} of "
                                      f"{len(modules.loaded)}", flush=True)
    if len(sets) > 1:
        print(summary(rows, [name for name, _ in sets]))
    if args.json:
        Path(args.json).write_text(json.dumps({"read": ceiling, "rows": rows}, indent=1, default=str))
    return 0


def summary(rows: list, names: list) -> str:
    """A markdown table: each (dtype, shape, partition size), each set's best round and its change against the
    first set's (a set's best round, since a round's median only ever rises from what the kernel can do)."""
    best = {}
    for r in rows:
        key = (r["dtype"], r["num_seqs"], r["context"], r["partition_size"], r["set"])
        best[key] = min(best.get(key, float("inf")), r["median_us"])
    lines = ["| dtype | batch x context | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for dtype, num_seqs, context, size in dict.fromkeys(k[:4] for k in best):
        base = best[(dtype, num_seqs, context, size, names[0])]
        cells = [f"{base:.2f} us"] + [
            f"{best[(dtype, num_seqs, context, size, n)]:.2f} us "
            f"({100 * (best[(dtype, num_seqs, context, size, n)] / base - 1):+.1f}%)" for n in names[1:]]
        lines.append(f"| {dtype} | {num_seqs} x {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
