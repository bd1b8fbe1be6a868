"""The device's floors under a short decode launch: what a dispatch costs with nothing to do, and how long the
read kernel (shaders/read_bandwidth.comp, the benchmarks' ceiling) takes to read a decode's bytes in one
dispatch, and in one dispatch followed by an empty one (a split decode and its merge).

Each size is read from enough distinct buffers to rotate over 512 MiB, so that no run finds its bytes in the
GPU's last-level cache; runs are recorded back to back with a barrier between them and a timestamp after each,
as bench.time_decode records a decode (figures are medians of 3 x 50 runs, after the GPU's clocks are up).

    python benchmarks/floors.py [--sizes-mib 16,128,1024] [--json floors.json]

16 MiB is a float16 decode of 1 x 4096 (32 query heads, 8 KV heads, head 128), 128 MiB one of 1 x 32768 or
8 x 4096; the defaults.
"""

import argparse
import json
import math

import numpy as np

from pagedvk.testing import bench
from pagedvk.runtime.array import empty
from pagedvk.runtime.selection import get_device

RUNS = 50


def timed(device, steps, per_run: int) -> dict:
    """Median and p10-p90 of each run's time (a run: per_run consecutive steps, stamped after), 3 submissions."""
    return bench.percentiles(bench.time_steps(device, steps, per_run, 3))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="16,128,1024", help="comma-separated bytes to read, in MiB")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(s) * (1 << 20)) // 16 * 16 for s in args.sizes_mib.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        parser.error(f"--sizes-mib must be comma-separated positive sizes in MiB, got {args.sizes_mib!r}")
    device = get_device()
    dst = empty((bench.READ_THREADS,), np.uint32, device)
    empty_step = bench.read_step(device, dst, dst, 0, workgroups=1)   # nothing to read
    rows = {"device": device.info.name, "empty dispatch": timed(device, [empty_step] * RUNS, 1)}
    print(f"{device.info.name}\nan empty dispatch: {rows['empty dispatch']['median_us']:.2f} us")
    for nbytes in sizes:
        count = max(1, math.ceil(bench.ROTATE_BYTES / nbytes))
        sources = [empty((nbytes // 4,), np.uint32, device) for _ in range(count)]
        try:
            for src in sources:
                device.fill(src.buffer, 0x3F800000)
            reads = [bench.read_step(device, sources[i % count], dst, nbytes) for i in range(RUNS)]
            read = timed(device, reads, 1)
            pairs = timed(device, [s for r in reads for s in (r, empty_step)], 2)
        finally:
            for src in sources:
                src.close()
        rows[f"{nbytes} bytes"] = {"read": read, "read then an empty dispatch": pairs,
                                   "GBps": nbytes / (read["median_us"] * 1e3)}
        print(f"{nbytes / (1 << 20):g} MiB: read {read['median_us']:.2f} us ({nbytes / read['median_us'] / 1e3:.0f} "
              f"GB/s), read then an empty dispatch {pairs['median_us']:.2f} us", flush=True)
    dst.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
