#!/usr/bin/env python3
"""Two streams side by side: whether work queued on two `pagedvk.Stream`s overlaps on the device.

    python benchmarks/streams.py
    python benchmarks/streams.py --context 8192 --repeats 100

Two decode plans, each one sequence of --context tokens with no split (one partition: a grid of a few workgroups
that leaves most of a GPU idle), each run --repeats times: first both on one stream, then each on a stream of its
own. Wall times from the first launch to the end of the synchronize, medians of 5 rounds; "overlap" is one
stream's time over two streams' (2.0: the two ran fully side by side; 1.0: one after the other).
"""

import argparse
import sys
import time

import numpy as np

import pagedvk


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    device = pagedvk.default_device()
    rng = np.random.default_rng(0)
    blocks = -(-args.context // 16)
    caches = [(pagedvk.asarray(rng.standard_normal((blocks, 8, 16, 16, 8), np.float32).astype(np.float16)),
               pagedvk.asarray(rng.standard_normal((blocks, 8, 128, 16), np.float32).astype(np.float16)))
              for _ in range(2)]
    tables, lens = np.arange(blocks, dtype=np.int32)[None], np.array([args.context], np.int32)
    plans = [pagedvk.DecodePlan.for_caches(k, v, tables, lens, 32, partition_size=blocks * 16) for k, v in caches]
    q = pagedvk.asarray(rng.standard_normal((1, 32, 128), np.float32).astype(np.float16))
    outs = [pagedvk.empty((1, 32, 128), np.float16) for _ in range(2)]
    streams = [pagedvk.Stream(device), pagedvk.Stream(device)]

    def round_(two: bool) -> float:
        device.synchronize()
        t = time.perf_counter_ns()
        for _ in range(args.repeats):
            for i in range(2):
                with streams[i if two else 0]:
                    plans[i].run(q, *caches[i], out=outs[i])
        device.synchronize()
        return time.perf_counter_ns() - t

    for _ in range(3):
        round_(False), round_(True)
    one = float(np.median([round_(False) for _ in range(5)]))
    two = float(np.median([round_(True) for _ in range(5)]))
    queues = len({id(s.queue) for s in streams})
    print(f"device: {device.info.name}; {len(device.queues)} queues, the two streams on {queues} of them; "
          f"2 x {args.repeats} decodes of 1 x {args.context}, one partition")
    print(f"one stream  {one / 1e3:9.1f} us\ntwo streams {two / 1e3:9.1f} us\noverlap     {one / two:9.2f}")
    for plan in plans:
        plan.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
