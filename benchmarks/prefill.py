#!/usr/bin/env python3
"""Prefill forward: pagedvk's scalar and cooperative-matrix kernels beside torch SDPA, in one process.

The shape is issue 12's unless given: 4 sequences x 32 query heads (8 KV heads) x 512 new tokens over a
4096-token context, causal, head 128, block 16, float16 caches and queries (random block tables). pagedvk is
timed with GPU timestamps, `--iters` x `--repeats` submissions of the recorded forward after
pagedvk.bench.warm_up (0.5 s: the GPU's clock drops when idle); the figure is the median launch. Each kernel's
output is checked against float64 on the first sequence. Where torch with CUDA is present, SDPA float16 runs
the same problem on contiguous K/V (bottom-right causal mask, the KV heads expanded for GQA inside the timed
step, as issue 12's table measures it), timed with CUDA events after the same warm-up.
TFLOP/s count 4 * head_size flops per (query head, visible key) pair.

    python benchmarks/prefill.py --json prefill.json
"""

import argparse
import json
import time

import numpy as np

import pagedvk
from pagedvk import bench, prefill, reference
from pagedvk.abi import PAGED_PREFILL


def flops(num_heads, head_size, q_len, context, causal):
    visible = np.arange(context - q_len + 1, context + 1) if causal else np.full(q_len, context)
    return 4.0 * num_heads * head_size * float(visible.sum())


def time_pagedvk(inputs, kernel, layout, args):
    """(module name, median ms) of the forward recorded once (pagedvk.prefill.Recorded), each run its own
    submission with GPU timestamps around it."""
    recorded = prefill.Recorded.forward(*inputs, None, causal=args.causal, layout=layout, backend="glsl", kernel=kernel)
    try:
        bench.warm_up(recorded.launch)
        times = [recorded.launch.submit() for _ in range(args.iters * args.repeats)]
    finally:
        recorded.close()
    p = prefill._Problem(*inputs, None, causal=args.causal, layout=layout, backend="glsl", kernel=kernel)
    return p.key(PAGED_PREFILL).name, float(np.median(times)) / 1e6


def torch_sdpa(args):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
    except ImportError as e:
        return {"skipped": f"torch: {e}"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA device"}
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda h, n: (args.num_seqs, h, n, args.head_size)
    q = torch.randn(shape(args.num_heads, args.q_len), device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(shape(args.num_kv_heads, args.context), device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(shape(args.num_kv_heads, args.context), device="cuda", dtype=torch.float16, generator=g)
    group = args.num_heads // args.num_kv_heads
    mask = causal_lower_right(args.q_len, args.context) if args.causal else None

    def step():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=mask)

    deadline = time.monotonic() + bench.WARMUP_SECONDS
    while time.monotonic() < deadline:
        step()
        torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters + 1)]
        events[0].record()
        for i in range(args.iters):
            step()
            events[i + 1].record()
        torch.cuda.synchronize()
        times += [events[i].elapsed_time(events[i + 1]) for i in range(args.iters)]
    return {"torch": torch.__version__, "ms": float(np.median(times))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--q-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--non-causal", dest="causal", action="store_false")
    ap.add_argument("--kernels", default="scalar,coopmat")
    ap.add_argument("--layouts", default="nhd,vllm")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    device = pagedvk.default_device()
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.num_seqs * blocks_per_seq
    bt = rng.permutation(num_blocks).astype(np.int32).reshape(args.num_seqs, blocks_per_seq)
    sl = np.full(args.num_seqs, args.context, np.int32)
    nhd = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    k_nhd = rng.standard_normal(nhd).astype(np.float16)
    v_nhd = rng.standard_normal(nhd).astype(np.float16)
    query = rng.standard_normal((args.num_seqs, args.num_heads, args.q_len, args.head_size)).astype(np.float16)
    total = flops(args.num_heads, args.head_size, args.q_len, args.context, args.causal) * args.num_seqs
    record = {"device": device.info.name, "driver": f"{device.info.driver} {device.info.driver_version}",
              "shape": {k: getattr(args, k) for k in ("num_seqs", "num_heads", "num_kv_heads", "q_len", "context",
                                                       "head_size", "block_size", "causal")},
              "dtype": "float16", "gflop": total / 1e9, "iters": args.iters * args.repeats, "rows": []}
    ref = None
    for layout in args.layouts.split(","):
        if layout == "nhd":
            kc, vc = k_nhd, v_nhd
        else:   # vLLM's: key [blocks, kv heads, head / x, block, x], value [blocks, kv heads, head, block]
            x = 8
            kc = np.ascontiguousarray(k_nhd.reshape(num_blocks, args.block_size, args.num_kv_heads,
                                                    args.head_size // x, x).transpose(0, 2, 3, 1, 4))
            vc = np.ascontiguousarray(v_nhd.transpose(0, 2, 3, 1))
        arrays = [pagedvk.asarray(a, device=device) for a in (query, kc, vc, bt, sl)]
        for kernel in args.kernels.split(","):
            row = {"kernel": kernel, "layout": layout}
            try:
                out, lse = pagedvk.paged_attention_prefill(*arrays, causal=args.causal, layout=layout,
                                                           kernel=kernel)
                if ref is None:
                    ref = reference.paged_attention_prefill(query[:1], k_nhd, v_nhd, bt[:1], sl[:1],
                                                            causal=args.causal, layout="nhd")
                got = out.numpy()[:1].astype(np.float64)
                row["rel_error"] = float(np.linalg.norm(got - ref[0]) / np.linalg.norm(ref[0]))
                row["lse_rel_error"] = float(np.linalg.norm(lse.numpy()[:1] - ref[1]) / np.linalg.norm(ref[1]))
                out.close(), lse.close()
                row["module"], ms = time_pagedvk(arrays, kernel, layout, args)
                row.update(ms=ms, tflops=total / (ms * 1e-3) / 1e12)
            except Exception as e:   # noqa: BLE001 - one kernel's failure is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), flush=True)
            record["rows"].append(row)
        for a in arrays:
            a.close()
    sdpa = torch_sdpa(args)
    if "ms" in sdpa:
        sdpa["tflops"] = total / (sdpa["ms"] * 1e-3) / 1e12
    record["sdpa_f16"] = sdpa
    print(json.dumps({"sdpa_f16": sdpa}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
