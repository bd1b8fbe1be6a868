#!/usr/bin/env python3
"""A whole decode step, as an engine runs it: every layer's cache write and attention (issue 38's targets).

    python benchmarks/step.py                                  # H200 row: 32 layers, 8 x 4096, 32q/8kv, d128, f16
    python benchmarks/step.py --layers 30 --batch 4 --context 256 --heads 9 --kv-heads 3 --head-size 64   # SmolLM2
    python benchmarks/step.py --json results.json

Each layer writes the step's new keys and values (reshape_and_cache, one token per sequence) and attends (one
DecodePlan, updated never: the step is steady). Four figures, medians over --steps steps after the GPU was kept
busy for --warm seconds (a GPU left idle drops its clocks):
  GPU          the step's GPU time: the same dispatches in one command buffer with a timestamp after each op,
               summed (the ceiling the other rows are quoted against);
  replayed     `pagedvk.record()` once, then `step.replay()` + `synchronize()` per step: wall time, and the calling
               thread's CPU time per layer;
  queued       the same ops called one by one (each queued at once), then `synchronize()`: wall per step, and the
               calling thread's CPU time per op;
  fused        each layer's write and attention as one `DecodePlan.append_and_run` (one submission a layer);
  waiting      synchronize() after queuing --wait-steps replays: the waiting thread's CPU time as a share of the
               wait's wall time (it should sleep: PAGEDVK_SPIN_US is the window it polls first).
"""

import argparse
import json
import sys
import time

import ml_dtypes
import numpy as np

import pagedvk
import pagedvk.config
from pagedvk.runtime.pipeline import Launch


def build(args, device):
    dtype = np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else args.dtype)
    blocks_per_seq = -(-args.context // 16)
    num_blocks = args.batch * blocks_per_seq + 1
    cache = pagedvk.KVCache(num_layers=args.layers, num_kv_heads=args.kv_heads, head_size=args.head_size,
                            block_size=16, dtype=dtype, num_blocks=num_blocks, device=device)
    rng = np.random.default_rng(0)
    # Random caches, written once (not timed): one draw for every layer's keys and values, as their values do not
    # change the time and drawing 64 x 4096 tokens per array for 64 arrays would take minutes.
    fill = rng.standard_normal(cache.key[0].shape, np.float32).astype(dtype)
    for layer in range(args.layers):
        for a in (cache.key[layer], cache.value[layer]):
            a.write(fill.reshape(a.shape))   # a value cache holds as many elements as a key cache
    del fill
    tables = rng.permutation(num_blocks - 1)[:args.batch * blocks_per_seq].astype(np.int32)
    tables = tables.reshape(args.batch, blocks_per_seq)
    lens = np.full(args.batch, args.context, np.int32)
    plan = cache.decode_plan(tables, lens, num_heads=args.heads, query_dtype=dtype)
    q = [pagedvk.asarray(rng.standard_normal((args.batch, args.heads, args.head_size), np.float32).astype(dtype),
                         device) for _ in range(args.layers)]
    kv = [pagedvk.asarray(rng.standard_normal((args.batch, args.kv_heads, args.head_size), np.float32).astype(dtype),
                          device) for _ in range(2 * args.layers)]
    out = [pagedvk.empty(q[0].shape, dtype, device) for _ in range(args.layers)]
    # Each sequence's next token goes to the slot after its last (its table has room: the slot is in its last
    # block or, at a block boundary, in block num_blocks - 1, kept free).
    slots = np.array([tables[s, (args.context) // 16] * 16 + args.context % 16 if args.context % 16
                      else (num_blocks - 1) * 16 for s in range(args.batch)], np.int32)
    slots = pagedvk.asarray(slots, device)

    def step():
        for layer in range(args.layers):
            pagedvk.reshape_and_cache(kv[2 * layer], kv[2 * layer + 1], cache.key[layer], cache.value[layer], slots,
                                      validate=False)
            plan.run(q[layer], cache.key[layer], cache.value[layer], out=out[layer])
    def fused_step():   # each layer's write and attention in one submission (DecodePlan.append_and_run)
        for layer in range(args.layers):
            plan.append_and_run(kv[2 * layer], kv[2 * layer + 1], slots, q[layer], cache.key[layer],
                                cache.value[layer], out=out[layer], validate=False)
    return cache, plan, step, fused_step, (q, kv, out, slots)


def median(xs):
    return float(np.median(xs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--wait-steps", type=int, default=20)
    p.add_argument("--warm", type=float, default=1.0, help="seconds of replays before measuring")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = pagedvk.default_device()
    cache, plan, step, fused_step, keep = build(args, device)
    ops = 2 * args.layers
    with pagedvk.record(device) as recorded:
        step()
    results = dict(device=device.info.name, layers=args.layers, batch=args.batch, context=args.context,
                   heads=args.heads, kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype,
                   spin_us=pagedvk.config.spin_ns(device.info.type == "cpu") / 1e3,
                   batch_limit=pagedvk.config.batch())
    try:
        end = time.perf_counter() + args.warm
        while time.perf_counter() < end:
            recorded.replay()
            device.synchronize()

        # GPU: the recorded dispatches with a timestamp after each op.
        dispatches = recorded.dispatches()
        timed = Launch(device, dispatches, timestamps=1)
        gpu = median([float(np.sum(timed.submit())) for _ in range(max(5, args.steps // 5))])
        timed.close()

        def timed_steps(body):
            walls, cpus = [], []
            for _ in range(args.steps):
                c, t = time.thread_time_ns(), time.perf_counter_ns()
                body()
                device.synchronize()
                walls.append(time.perf_counter_ns() - t)
                cpus.append(time.thread_time_ns() - c)
            return median(walls), median(cpus)

        def issue_only(body):
            cpus = []
            for _ in range(args.steps):
                device.synchronize()
                c = time.thread_time_ns()
                body()
                cpus.append(time.thread_time_ns() - c)
            device.synchronize()
            return median(cpus)

        replay_wall, replay_cpu = timed_steps(recorded.replay)
        replay_issue = issue_only(recorded.replay)
        queued_wall, queued_cpu = timed_steps(step)
        queued_issue = issue_only(step)
        fused_wall, fused_cpu = timed_steps(fused_step)
        fused_issue = issue_only(fused_step)
        # Waiting: queue several replays, then measure the wait alone.
        shares = []
        for _ in range(5):
            for _ in range(args.wait_steps):
                recorded.replay()
            c, t = time.thread_time_ns(), time.perf_counter_ns()
            device.synchronize()
            shares.append((time.thread_time_ns() - c) / max(time.perf_counter_ns() - t, 1))
        results.update(gpu_us=gpu / 1e3, replay_wall_us=replay_wall / 1e3, replay_over_gpu=replay_wall / gpu,
                       replay_cpu_per_layer_us=replay_cpu / args.layers / 1e3,
                       replay_issue_per_layer_us=replay_issue / args.layers / 1e3,
                       queued_wall_us=queued_wall / 1e3, queued_over_gpu=queued_wall / gpu,
                       queued_cpu_per_op_us=queued_cpu / ops / 1e3, queued_issue_per_op_us=queued_issue / ops / 1e3,
                       fused_wall_us=fused_wall / 1e3, fused_over_gpu=fused_wall / gpu,
                       fused_issue_per_layer_us=fused_issue / args.layers / 1e3, wait_cpu_share=median(shares))
    finally:
        recorded.close()
        plan.close()
        cache.close()
    r = results
    print(f"device: {r['device']}; {args.layers} layers, {args.batch} x {args.context}, {args.heads}q/{args.kv_heads}kv, "
          f"head {args.head_size}, {args.dtype}; PAGEDVK_SPIN_US {r['spin_us']:g}, PAGEDVK_BATCH {r['batch_limit']}; "
          f"medians of {args.steps} steps")
    print(f"GPU       {r['gpu_us']:9.1f} us per step (sum of its ops' GPU times)")
    print(f"replayed  {r['replay_wall_us']:9.1f} us per step = {r['replay_over_gpu']:.3f} x GPU;  calling thread "
          f"{r['replay_cpu_per_layer_us']:.2f} us per layer with the wait, {r['replay_issue_per_layer_us']:.2f} to issue")
    print(f"queued    {r['queued_wall_us']:9.1f} us per step = {r['queued_over_gpu']:.3f} x GPU;  calling thread "
          f"{r['queued_cpu_per_op_us']:.2f} us per op with the wait, {r['queued_issue_per_op_us']:.2f} to issue")
    print(f"fused     {r['fused_wall_us']:9.1f} us per step = {r['fused_over_gpu']:.3f} x GPU;  calling thread "
          f"{r['fused_issue_per_layer_us']:.2f} us per layer to issue (append_and_run: one submission a layer)")
    print(f"waiting   the waiting thread's CPU is {100 * r['wait_cpu_share']:.1f}% of the wait")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
