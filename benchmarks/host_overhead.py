#!/usr/bin/env python3
"""Host time per call: what Python and the driver add to a decode launch (issue 9's host rows).

    python benchmarks/host_overhead.py                      # run(): 1 x 4096; one-shot: 1 x 16 tokens
    python benchmarks/host_overhead.py --context 1024 --iters 500
    PAGEDVK_DEVICE=nvidia python benchmarks/host_overhead.py

Three figures, each the median over --iters calls after a warm-up (on lavapipe use a short --context: its GPU
time swings with the machine's load, and a long kernel's swing hides the host's microseconds):
  run       DecodePlan.run on device arrays (query, caches, out), the same buffers every call (the launch is
            recorded once), 1 sequence x --context tokens;
  run, Python only  the same run() with the driver's submit and fence calls stubbed out: the library's share
            (20x --iters calls: they are short);
  one-shot  pagedvk.paged_attention with numpy inputs (query, caches, tables, lengths), 1 sequence x
            --oneshot-context tokens, numpy out: uploads, launch and download.
GPU time is DecodePlan.time_ns of the same launch (timestamp queries), so "wall - GPU" is the host's share;
"host thread CPU" is the calling thread's CPU time per call (the waits left out).
32 query heads, 8 KV heads, head 128, block 16, float16 by default (--dtype).
"""

import argparse
import contextlib
import math
import sys
import time

import ml_dtypes
import numpy as np
import vulkan as vk

import pagedvk
import pagedvk.config
from pagedvk.runtime.array import asarray, empty
from pagedvk.runtime import commands


def make_inputs(rng, context: int, dtype, num_heads=32, num_kv_heads=8, head_size=128, block_size=16):
    x = 16 // dtype.itemsize
    num_blocks = math.ceil(context / block_size)
    k = rng.standard_normal((num_blocks, num_kv_heads, head_size // x, block_size, x), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((num_blocks, num_kv_heads, head_size, block_size), dtype=np.float32).astype(dtype)
    q = rng.standard_normal((1, num_heads, head_size), dtype=np.float32).astype(dtype)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(1, num_blocks)
    lens = np.array([context], np.int32)
    return q, k, v, tables, lens


def measure(call, gpu, iters: int, warmup: int = 10) -> tuple:
    """Medians of the wall time and of the calling thread's CPU time over `iters` calls in a row (the steady
    state: the launch recorded, the code warm), then of the same launch's GPU time over as many gpu() calls
    (ns, from timestamp queries). The CPU time leaves out the waits, where a CPU driver (lavapipe) runs the
    kernel on threads of its own: on a shared machine it is the steadier measure of what Python and the
    driver's submission cost."""
    for _ in range(warmup):
        call()
    wall, cpu = [], []
    for _ in range(iters):
        c, t = time.thread_time_ns(), time.perf_counter_ns()
        call()
        wall.append(time.perf_counter_ns() - t)
        cpu.append(time.thread_time_ns() - c)
    gpu()   # its own recording's warm-up
    gpu_ns = [gpu() for _ in range(iters)]
    return float(np.median(wall)), float(np.median(cpu)), float(np.median(gpu_ns))


@contextlib.contextmanager
def stubbed_submission():
    """The Vulkan calls by which a recorded launch is submitted and waited for, made to succeed at once."""
    names = ("queue_submit", "wait_for_fences", "reset_fences", "get_fence_status")
    saved = {name: getattr(commands, name) for name in names}
    try:
        for name in names:
            setattr(commands, name, lambda *a: vk.VK_SUCCESS)
        yield
        pagedvk.synchronize()   # what is still queued "finishes" under the stubs: no real wait meets a fence never sent
    finally:
        for name, f in saved.items():
            setattr(commands, name, f)


def report(name: str, figures: tuple) -> None:
    wall, cpu, gpu = figures
    print(f"{name:<16} wall {wall / 1e3:9.1f} us   GPU {gpu / 1e3:9.1f} us   wall - GPU {(wall - gpu) / 1e3:8.1f} us"
          f"   host thread CPU {cpu / 1e3:7.1f} us", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096, help="tokens of the run() figure's sequence")
    p.add_argument("--oneshot-context", type=int, default=16, help="tokens of the one-shot figure's sequence")
    p.add_argument("--dtype", default="float16", help="float32, float16 or bfloat16 (cache and query)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--backend", default=None)
    args = p.parse_args(argv)
    dtype = np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else args.dtype)
    rng = np.random.default_rng(0)
    device = pagedvk.default_device()
    print(f"device: {device.info.name}; backend {pagedvk.config.backend(args.backend)}; {args.dtype}; "
          f"32 heads / 8 KV heads, head 128, block 16; medians of {args.iters} calls")

    # run(): device arrays, one recorded launch resubmitted.
    q, k, v, tables, lens = make_inputs(rng, args.context, dtype)
    dq, dk, dv, out = asarray(q, device), asarray(k, device), asarray(v, device), empty(q.shape, dtype, device)
    plan = pagedvk.DecodePlan.for_caches(dk, dv, tables, lens, q.shape[1], device=device, backend=args.backend)
    try:
        report(f"run 1x{args.context}", measure(lambda: plan.run(dq, dk, dv, out=out),
                                                lambda: plan.time_ns(dq, dk, dv, out), args.iters))
        # run()'s Python alone: the same call with the driver's submit and fence calls stubbed out (nothing
        # reaches the GPU), so the library's own share shows apart from the driver's and the wake-up's.
        with stubbed_submission():
            wall, _, _ = measure(lambda: plan.run(dq, dk, dv, out=out), lambda: 0.0, 20 * args.iters)
        print(f"{'run, Python only':<16} wall {wall / 1e3:9.1f} us   (submission and fence calls stubbed)", flush=True)
    finally:
        plan.close()
        for a in (dq, dk, dv, out):
            a.close()

    # One-shot: numpy in, numpy out; its GPU time is that of the same decode on device arrays.
    q, k, v, tables, lens = make_inputs(rng, args.oneshot_context, dtype)
    dq, dk, dv, out = asarray(q, device), asarray(k, device), asarray(v, device), empty(q.shape, dtype, device)
    plan = pagedvk.DecodePlan.for_caches(dk, dv, tables, lens, q.shape[1], device=device, backend=args.backend)
    try:
        report(f"one-shot 1x{args.oneshot_context}",
               measure(lambda: pagedvk.paged_attention(q, k, v, tables, lens, backend=args.backend),
                       lambda: plan.time_ns(dq, dk, dv, out), args.iters))
    finally:
        plan.close()
        for a in (dq, dk, dv, out):
            a.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
