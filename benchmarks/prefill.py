#!/usr/bin/env python3
"""Prefill sweep for BENCHMARKS.md: paged_attention_prefill and its backward, GPU-timed (timestamps), in
TFLOP/s, over prompt lengths and batch mixes, beside torch SDPA where torch with CUDA is present.

Each batch is a list of (new tokens, context) per sequence, run as one ragged launch (query_start_loc). A
mixed batch (prefill chunks and decode tokens) is also run as its parts in separate calls, the prefill
chunks through paged_attention_prefill and the decode tokens through a DecodePlan, and the two times are
added: the issue's target is that the one launch is no slower. FLOPs: 4 * head_size per (query head, visible
key) in the forward, 2.5x that in the backward (five products in place of two). SDPA runs batches whose
sequences share one shape: q [batch, heads, new, head], K and V contiguous [batch, kv heads, context, head],
the KV heads expanded for GQA inside the timed step, a bottom-right causal mask; its backward is the time of
forward + backward less the forward's. pagedvk's forward of the first sequence is checked against float64.
`--kernels` picks the forward's and the backward's kernels (pagedvk.ops.prefill.matrix_kernel: auto, scalar,
coopmat); a kernel the device cannot run for a row's arguments is reported and skipped.

    python benchmarks/prefill.py                      # the issue's shape and a sweep sized for a datacenter GPU
    python benchmarks/prefill.py --small              # a sweep lavapipe finishes in a few minutes
    python benchmarks/prefill.py --dtypes f16 --backends glsl --json prefill.json
    python benchmarks/prefill.py --dtypes f16 --backends glsl --kernels scalar,coopmat   # both kernels
    python benchmarks/prefill.py --batches 4x512/4096 --dtypes f16         # the issue's shape only
    python benchmarks/prefill.py --batches 4x512/4096 --dtypes f16 --forward-only   # no backward (nor SDPA's)
"""

import argparse
import json
import sys

import numpy as np

import pagedvk
from pagedvk.testing import bench, reference
from pagedvk.cli import parsed, positive
from pagedvk.ops.decode_plan import DecodePlan
from pagedvk.ops.prefill import PREFILL_KERNELS, Recorded
from pagedvk.runtime.pipeline import Launch

# name -> [(new tokens, context)] per sequence; "mixed" batches are also timed as their parts.
SWEEP = {
    "4x512/4096": [(512, 4096)] * 4,            # issue 12's shape
    "4x128/4096": [(128, 4096)] * 4,
    "4x2048/4096": [(2048, 4096)] * 4,
    "8x1024/1024": [(1024, 1024)] * 8,           # whole prompts
    "mixed 2x512/4096 + 64 decode": [(512, 4096)] * 2 + [(1, 4096)] * 64,
}
SMALL_SWEEP = {
    "2x64/256": [(64, 256)] * 2,
    "4x16/256": [(16, 256)] * 4,
    "mixed 2x32/256 + 8 decode": [(32, 256)] * 2 + [(1, 256)] * 8,
}
HEADS = {"full": dict(num_heads=32, num_kv_heads=8, head_size=128), "small": dict(num_heads=4, num_kv_heads=2,
                                                                                  head_size=64)}
BLOCK_SIZE = 16
LAYOUT = "nhd"   # the caches' layout: FlashInfer's NHD, as BENCHMARKS.md's prefill figures were measured
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


class Inputs:
    """A batch's random device inputs: nhd caches of the batch's blocks (shuffled), ragged query."""

    def __init__(self, batch, dtype, num_heads, num_kv_heads, head_size, seed=0):
        rng = np.random.default_rng(seed)
        self.batch, self.dtype = batch, np.dtype(dtype)
        q_lens, contexts = np.array([b[0] for b in batch]), np.array([b[1] for b in batch])
        blocks = -(-contexts // BLOCK_SIZE)
        ids = rng.permutation(int(blocks.sum())).astype(np.int32)
        self.block_tables = np.full((len(batch), int(blocks.max())), -1, np.int32)
        for s, (first, n) in enumerate(zip(np.cumsum(blocks) - blocks, blocks)):
            self.block_tables[s, :n] = ids[first:first + n]
        self.seq_lens = contexts.astype(np.int32)
        self.query_start_loc = np.cumsum(np.concatenate([[0], q_lens])).astype(np.int32)
        shape = (len(ids), BLOCK_SIZE, num_kv_heads, head_size)
        self.host = [rng.standard_normal(s).astype(self.dtype)
                     for s in ((int(q_lens.sum()), num_heads, head_size), shape, shape)]
        self.query, self.key_cache, self.value_cache = (pagedvk.asarray(a) for a in self.host)
        self.dout = pagedvk.asarray(rng.standard_normal(self.host[0].shape).astype(self.dtype))
        # (query head, visible key) pairs of the causal batch
        self.pairs = num_heads * sum(int(n) * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, contexts))
        self.flops = 4 * head_size * self.pairs

    def args(self, rows=slice(None)):
        return (self.query, self.key_cache, self.value_cache, self.block_tables[rows], self.seq_lens[rows],
                self.query_start_loc)

    def close(self):
        for a in (self.query, self.key_cache, self.value_cache, self.dout):
            a.close()


def parse_kernels(text: str) -> list:
    items = text.split(",")
    if any(item not in PREFILL_KERNELS for item in items):
        raise ValueError(f"kernels must be comma-separated names from {', '.join(PREFILL_KERNELS)}, got {text!r}")
    return items


def median_ns(launch, repeats: int) -> float:
    bench.warm_up(launch)
    return float(np.median([launch.submit() for _ in range(repeats)]))


def part(inputs, seqs, rows):
    """The sub-batch of sequences `seqs` (their query rows `rows`) as (query, block_tables, seq_lens, loc)."""
    q = pagedvk.asarray(inputs.host[0][rows])
    lens = inputs.seq_lens[seqs]
    loc = np.cumsum(np.concatenate([[0], np.diff(inputs.query_start_loc)[seqs]])).astype(np.int32)
    return q, np.ascontiguousarray(inputs.block_tables[seqs]), np.ascontiguousarray(lens), loc


def time_pagedvk(inputs, backend, kernel, repeats, heads, backward=True) -> dict:
    forward = Recorded.forward(*inputs.args(), backend=backend, kernel=kernel, layout=LAYOUT)
    try:
        fwd_ns = median_ns(forward.launch, repeats)
        out, lse = forward.outputs
        loc = inputs.query_start_loc
        got = out.numpy()[loc[0]:loc[1]].astype(np.float64)
        ref, _ = reference.paged_attention_prefill(inputs.host[0][loc[0]:loc[1]], *inputs.host[1:],
                                                   inputs.block_tables[:1], inputs.seq_lens[:1], loc[:2] - loc[0],
                                                   layout=LAYOUT)
        error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        bwd_ns = None
        if backward:
            bwd = Recorded.backward(inputs.dout, inputs.query, inputs.key_cache, inputs.value_cache,
                                    inputs.block_tables, inputs.seq_lens, out, lse, loc, backend=backend,
                                    kernel=kernel, layout=LAYOUT)
            try:
                bwd_ns = median_ns(bwd.launch, repeats)
            finally:
                bwd.close()
    finally:
        forward.close()
    row = {"backend": backend, "kernel": kernel, "forward_us": fwd_ns / 1e3,
           "forward_TFLOPs": inputs.flops / fwd_ns / 1e3, "rel_error": error,
           "ok": error <= TOLERANCE[inputs.dtype.name]}
    if bwd_ns is not None:
        row.update(backward_us=bwd_ns / 1e3, backward_TFLOPs=2.5 * inputs.flops / bwd_ns / 1e3)
    q_lens = np.diff(inputs.query_start_loc)
    decode = np.flatnonzero(q_lens == 1)
    if decode.size and decode.size < len(q_lens):
        row["separate_us"] = time_parts(inputs, backend, repeats, heads, decode) / 1e3
    return row


def time_parts(inputs, backend, repeats, heads, decode) -> float:
    """GPU ns of the batch run as two calls: its prefill chunks (one ragged launch) and its decode tokens (a
    DecodePlan)."""
    loc = inputs.query_start_loc
    prefill = np.setdiff1d(np.arange(len(loc) - 1), decode)
    rows = np.concatenate([np.arange(loc[s], loc[s + 1]) for s in prefill])
    q, tables, lens, part_loc = part(inputs, prefill, rows)
    chunks = Recorded.forward(q, inputs.key_cache, inputs.value_cache, tables, lens, part_loc, backend=backend,
                              layout=LAYOUT)
    dq, dtables, dlens, _ = part(inputs, decode, loc[decode])
    plan = DecodePlan(dtables, dlens, block_size=BLOCK_SIZE, num_blocks=inputs.key_cache.shape[0],
                      dtype=inputs.dtype, query_dtype=inputs.dtype, layout=LAYOUT, backend=backend, **heads)
    out = pagedvk.empty(dq.shape, inputs.dtype)
    tokens = Launch(dq.device, plan.steps(dq, inputs.key_cache, inputs.value_cache, out, inputs.key_cache.shape[0]),
                    timestamps=True)
    try:
        return median_ns(chunks.launch, repeats) + median_ns(tokens, repeats)
    finally:
        tokens.close()
        plan.close()
        chunks.close()
        for a in (q, dq, out):
            a.close()


def time_sdpa(torch, batch, dtype, heads, repeats, backward=True) -> dict | None:
    """SDPA forward and backward (CUDA events, median of `repeats` batches of runs) for a batch whose
    sequences share one (new tokens, context); None for other batches."""
    if len(set(batch)) != 1:
        return None
    (L, T), B = batch[0], len(batch)
    H, Hkv, D = heads["num_heads"], heads["num_kv_heads"], heads["head_size"]
    F = torch.nn.functional
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, L, D, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    mask = torch.ones(L, T, device="cuda", dtype=torch.bool).tril(diagonal=T - L)   # bottom-right causal
    dout = torch.randn(B, H, L, D, device="cuda", dtype=dt)

    def forward():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1),
                                              attn_mask=mask)

    def both():
        forward().backward(dout)

    def timed(step, iters=10):
        step()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        return float(np.median(times))

    with torch.no_grad():
        fwd = timed(forward)
    return {"sdpa_forward_us": fwd, **({"sdpa_backward_us": timed(both) - fwd} if backward else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="the lavapipe-sized sweep and heads (4 / 2 kv, head 64)")
    p.add_argument("--dtypes", type=parsed(bench.parse_dtypes), default=["float16", "float32"],
                   help="comma-separated query and cache dtypes: float32, float16, bfloat16 (default: f16,f32)")
    p.add_argument("--backends", type=parsed(bench.parse_backends), default=["glsl", "wgsl"])
    p.add_argument("--kernels", type=parsed(parse_kernels), default=["auto"],
                   help="comma-separated kernels, forward and backward: auto, scalar, coopmat (default: auto)")
    p.add_argument("--batches", default=None,
                   help="comma-separated names of the sweep's batches to run (default: all), e.g. 4x512/4096")
    p.add_argument("--repeats", type=positive, default=10, help="timed submissions per figure")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone (no backward)")
    args = p.parse_args(argv)
    sweep, heads = (SMALL_SWEEP, HEADS["small"]) if args.small else (SWEEP, HEADS["full"])
    if args.batches is not None:
        names = [n.strip() for n in args.batches.split(",")]
        unknown = [n for n in names if n not in sweep]
        if unknown:
            p.error(f"--batches: no batch {unknown[0]!r} in the sweep; it has {', '.join(map(repr, sweep))}")
        sweep = {n: sweep[n] for n in names}
    torch = None
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        pass
    rows = []
    for name, batch in sweep.items():
        for dtype in args.dtypes:
            inputs = Inputs(batch, dtype, **heads)
            try:
                peer = (time_sdpa(torch, batch, dtype, heads, args.repeats, backward=not args.forward_only)
                        if torch is not None else None)
                for backend, kernel in ((b, k) for b in args.backends for k in args.kernels):
                    try:
                        timed = time_pagedvk(inputs, backend, kernel, args.repeats, heads,
                                             backward=not args.forward_only)
                    except ValueError as e:   # kernel="coopmat" where it cannot run: say why, time the others
                        print(f"{name:>30} {dtype:>9} {backend} {kernel}: skipped: {e}", flush=True)
                        continue
                    r = {"batch": name, "dtype": dtype, "GFLOP": inputs.flops / 1e9, **timed, **(peer or {})}
                    rows.append(r)
                    print(f"{name:>30} {dtype:>9} {backend} {kernel}: forward {r['forward_us']:10.1f} us "
                          f"({r['forward_TFLOPs']:.3g} TFLOP/s)"
                          + (f", backward {r['backward_us']:10.1f} us ({r['backward_TFLOPs']:.3g} TFLOP/s)"
                             if "backward_us" in r else "")
                          + f", err {r['rel_error']:.1e}"
                          + (f"; as separate calls {r['separate_us']:.1f} us" if "separate_us" in r else ""),
                          flush=True)
            finally:
                inputs.close()
    device = pagedvk.get_device().info.name
    print(f"\n{device}; heads {heads}, block {BLOCK_SIZE}, causal; GPU timestamps (median of {args.repeats}); "
          + ("torch SDPA: CUDA events" if torch is not None else "no torch with CUDA: pagedvk's figures alone") + "\n")
    print("| batch | dtype | backend | kernel | GFLOP | forward | TFLOP/s | backward | TFLOP/s | parts as separate calls "
          "| SDPA forward | SDPA backward |")
    print("| --- " * 12 + "|")

    def us(r, key):
        return f"{r[key]:.1f} us" if key in r else "-"

    def rate(r, key):
        return f"{r[key]:.3g}" if key in r else "-"

    for r in rows:
        print(f"| {r['batch']} | {r['dtype']} | {r['backend']} | {r['kernel']} | {r['GFLOP']:.3f} | {us(r, 'forward_us')} | "
              f"{rate(r, 'forward_TFLOPs')} | {us(r, 'backward_us')} | {rate(r, 'backward_TFLOPs')} | "
              f"{us(r, 'separate_us')} | {us(r, 'sdpa_forward_us')} | {us(r, 'sdpa_backward_us')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "heads": heads, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
