#!/usr/bin/env python3
"""Where a queued decode step's wall time goes: the stream's batching taken apart (issue 38's queued row).

    python benchmarks/queue_probe.py                       # 32 layers, 8 x 4096, 32q/8kv, d128, float16
    python benchmarks/queue_probe.py --batch 1 --context 64 --layers 2 --steps 3 --json probe.json

The step of benchmarks/step.py (a cache write and an attention per layer), timed as:
  gpu                  its GPU time (a timestamp after each op, summed);
  replay               recorded once, replayed: one command buffer;
  queued, in flight k  the ops called one by one, with Stream.IN_FLIGHT = k (2 is the library's): wall per step,
                       and the calling thread's CPU per op to issue them;
  one submission       every op of the step in one vkQueueSubmit of its 64 command buffers (nothing submitted
                       until the step is queued): wall from that submit to the end, and the issue cost with no
                       submission at all (the library's Python per op);
  light barriers       the same, each op's command buffer recorded with a compute-to-compute barrier where the library
                       records all-commands-to-all-commands, and none to the host stage where the library records
                       one (what the per-command-buffer barriers cost on the GPU; not correct for host reads of
                       mapped memory, so a probe only).
Medians of --steps steps after --warm seconds of replays (a GPU left idle drops its clocks).
"""

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np
import vulkan as vk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_benchmark  # noqa: E402

import pagedvk  # noqa: E402
from pagedvk.runtime import commands  # noqa: E402
from pagedvk.runtime.pipeline import Launch  # noqa: E402
from pagedvk.runtime.recording import kept_launches  # noqa: E402
from pagedvk.runtime.stream import Stream  # noqa: E402


@contextlib.contextmanager
def in_flight(k: int, batch: int | None = None):
    """Stream.IN_FLIGHT = k (and PAGEDVK_BATCH = batch) inside the block."""
    saved, saved_batch = Stream.IN_FLIGHT, os.environ.get("PAGEDVK_BATCH")
    Stream.IN_FLIGHT = k
    if batch is not None:
        os.environ["PAGEDVK_BATCH"] = str(batch)
    try:
        yield
    finally:
        Stream.IN_FLIGHT = saved
        if saved_batch is None:
            os.environ.pop("PAGEDVK_BATCH", None)
        else:
            os.environ["PAGEDVK_BATCH"] = saved_batch


@contextlib.contextmanager
def light_barriers():
    """Command buffers recorded inside the block open with a compute-to-compute barrier and close with none."""
    heavy = commands.memory_barrier

    def light(cmd, src_stage, src_access, dst_stage, dst_access):
        if dst_stage == vk.VK_PIPELINE_STAGE_HOST_BIT:
            return
        if src_stage == dst_stage == vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT:
            src_stage = dst_stage = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        heavy(cmd, src_stage, src_access, dst_stage, dst_access)
    commands.memory_barrier = light
    try:
        yield
    finally:
        commands.memory_barrier = heavy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warm", type=float, default=1.0, help="seconds of replays before measuring")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    args = argparse.Namespace(layers=a.layers, batch=a.batch, context=a.context, heads=32, kv_heads=8, head_size=128,
                              dtype="float16")
    dev = pagedvk.default_device()
    cache, plan, step, _, keep = step_benchmark.build(args, dev)
    ops = 2 * a.layers
    out = dict(device=dev.info.name, layers=a.layers, batch=a.batch, context=a.context)
    with pagedvk.record(dev) as recorded:
        step()

    def walls(body):
        wall, cpu = [], []
        for _ in range(a.steps):
            dev.synchronize()
            t, c = time.perf_counter_ns(), time.thread_time_ns()
            body()
            cpu.append(time.thread_time_ns() - c)
            dev.synchronize()
            wall.append(time.perf_counter_ns() - t)
        return float(np.median(wall)) / 1e3, float(np.median(cpu)) / 1e3

    flushed_at = []
    flush = Stream.flush

    def noting_flush(self):
        if self._batch:
            flushed_at.append(time.perf_counter_ns())
        flush(self)

    def one_submission():
        """Wall from the step's one vkQueueSubmit to its end, and the calling thread's CPU to queue it."""
        wall, cpu = [], []
        Stream.flush = noting_flush
        try:
            with in_flight(0, batch=1024):
                for _ in range(a.steps):
                    dev.synchronize()
                    flushed_at.clear()
                    c = time.thread_time_ns()
                    step()
                    cpu.append(time.thread_time_ns() - c)
                    dev.synchronize()
                    wall.append(time.perf_counter_ns() - flushed_at[0])
        finally:
            Stream.flush = flush
        return float(np.median(wall)) / 1e3, float(np.median(cpu)) / 1e3 / ops

    try:
        end = time.perf_counter() + a.warm
        while time.perf_counter() < end:
            recorded.replay()
            dev.synchronize()
        timed = Launch(dev, recorded.dispatches(), timestamps=1)
        out["gpu_us"] = float(np.median([np.sum(timed.submit()) for _ in range(10)])) / 1e3
        timed.close()
        out["replay_us"], _ = walls(recorded.replay)
        for k in (2, 3, 4, 8):
            with in_flight(k):
                wall, cpu = walls(step)
            out[f"queued_inflight{k}_us"], out[f"queued_inflight{k}_issue_per_op_us"] = wall, cpu / ops
        out["one_submit_us"], out["issue_no_submit_per_op_us"] = one_submission()
        # Record every op's launch again under light barriers: the kept launches and the plan's are dropped first.
        dev.synchronize()
        kept_launches(dev).clear()
        plan._forget_launches()   # (a probe of the library's internals: no public way to drop them)
        with light_barriers():
            step()
            dev.synchronize()
        for k in (2, 4):
            with in_flight(k):
                wall, cpu = walls(step)
            out[f"light_queued_inflight{k}_us"], out[f"light_queued_inflight{k}_issue_per_op_us"] = wall, cpu / ops
        out["light_one_submit_us"], _ = one_submission()
        dev.synchronize()
        kept_launches(dev).clear()
        plan._forget_launches()   # nothing recorded under light barriers outlives the probe
    finally:
        recorded.close()
        plan.close()
        cache.close()
        del keep
    for key, value in out.items():
        print(f"{key:40s} {value if isinstance(value, str) else round(value, 2)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
