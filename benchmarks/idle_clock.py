"""The same decode launch timed after different things: the slow-shape effect is the GPU's idle clock.

One process, one set of caches and block tables (8 x 4096, float16, one layer); each timing is preceded by
something else: nothing, the read kernel, a 4 GiB allocation freed again, 3 s of idling, a long timing, another
shape's caches made and freed. Warm-up is turned off (bench.WARMUP_SECONDS = 0) so that the timings see the
clock the GPU is at. Run `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem --format=csv -lms 200` beside
it to watch the shader clock.

    python benchmarks/idle_clock.py
"""

import argparse
import time

import numpy as np

from pagedvk.testing import bench
from pagedvk.runtime.array import empty


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    bench.WARMUP_SECONDS = 0.0
    t0 = time.monotonic()
    shape = bench.DecodeShape(num_seqs=8, context=4096, dtype="float16")

    def row(label, inputs, **kw):
        r = bench.time_decode(inputs, "glsl", **kw)
        print(f"{time.monotonic() - t0:6.1f} s  {label}: {r['median_us']:.1f} us ({r['GBps']:.0f} GB/s), "
              f"p10 {r['p10_us']:.0f} us, p90 {r['p90_us']:.0f} us", flush=True)

    with bench.DecodeInputs(shape, layers=1) as a:
        row("first timing", a)
        row("again", a)
        bench.read_bandwidth()
        row("after the read kernel", a)
        empty((1 << 30,), np.float32).close()
        row("after a 4 GiB allocation, freed", a)
        time.sleep(3)
        row("after 3 s idle", a)
        row("400 runs in a submission", a, iters=400)
        with bench.DecodeInputs(bench.DecodeShape(num_seqs=64, context=4096, dtype="float16"), layers=1) as b:
            row("64 x 4096's caches made", a)
        row("and freed", a)


if __name__ == "__main__":
    main()
