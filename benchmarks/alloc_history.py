"""Why a decode shape is fast in a fresh process and slower after other caches were allocated and freed.

Each case runs in a process of its own: the shape alone; after another shape's caches were allocated and
freed ("after"); after they were allocated and kept ("kept"); and with dedicated allocations for every
large buffer ("after, dedicated"). GPU timestamps, medians (pagedvk.testing.bench.decode).

    python benchmarks/alloc_history.py --shapes 8x4096,1x32768 --before 64x4096 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("fresh", "after", "kept", "after-dedicated", "fresh-dedicated")


def one(case: str, shape: tuple, before: tuple, dtype: str, backend: str) -> dict:
    from pagedvk.testing import bench
    from pagedvk.runtime import memory
    if case.endswith("dedicated"):
        memory.DEDICATED_MIN_BYTES = 1 << 20
    kept = []
    if case in ("after", "kept", "after-dedicated"):
        import numpy as np
        from pagedvk.runtime.array import empty
        b, ctx = before
        nbytes = b * ctx * 8 * 128 * np.dtype(dtype).itemsize   # one cache (K or V) of the earlier shape
        for _ in range(4):
            arrays = [empty((nbytes // 4,), np.float32) for _ in range(2)]
            if case == "kept":
                kept += arrays
            else:
                for a in arrays:
                    a.close()
    r = bench.decode(bench.DecodeShape(num_seqs=shape[0], context=shape[1], dtype=dtype), backend=backend)
    return {"case": case, "shape": f"{shape[0]}x{shape[1]}", "median_us": r["median_us"], "GBps": r["GBps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x4096,1x32768,1x4096")
    p.add_argument("--before", default="64x4096")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--backend", default="glsl")
    p.add_argument("--one", help=argparse.SUPPRESS)   # CASE:BxC, run in this process
    a = p.parse_args()
    from pagedvk.testing.bench import parse_shapes
    before = parse_shapes(a.before)[0]
    if a.one:
        case, shape = a.one.split(":")
        print(json.dumps(one(case, parse_shapes(shape)[0], before, a.dtype, a.backend)))
        return
    print(f"| shape | {' | '.join(CASES)} |\n| --- |{' --- |' * len(CASES)}")
    for shape in parse_shapes(a.shapes):
        cells = []
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--one", f"{case}:{shape[0]}x{shape[1]}",
                                  "--before", a.before, "--dtype", a.dtype, "--backend", a.backend],
                                 capture_output=True, text=True)
            if out.returncode:
                cells.append("failed")
                sys.stderr.write(out.stderr[-2000:])
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            cells.append(f"{r['median_us']:.1f} us ({r['GBps']:.0f} GB/s)")
        print(f"| {shape[0]}x{shape[1]} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
