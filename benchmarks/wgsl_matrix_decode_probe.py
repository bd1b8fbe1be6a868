#!/usr/bin/env python3
"""The WGSL matrix decode (shaders/paged_decode_coopmat.wgsl) beside the GLSL one and the WGSL scalar one: first
correctness on small cases (errors against float64 with where they sit: by head, head-dim tile, token in block,
and whole blocks against the tail block, to debug a matrix layout from one run), then GPU timestamps at issue 9's
float16 shapes, the kernels alternated (A B C A B C) on the same inputs.

    python benchmarks/wgsl_matrix_decode_probe.py [--shapes 64x4096,...] [--json out.json]
"""

import argparse
import json
import sys
import traceback

import numpy as np

import pagedvk
from pagedvk.testing import bench, reference

KERNELS = (("glsl", None), ("wgsl", None), ("wgsl", "gpu"))   # (backend, kernel): None is the plan's choice
# Small shapes, where plans take the scalar kernel (partitions under MATRIX_MIN_TOKENS, a rule measured for GLSL):
# the WGSL matrix kernel forced too, to see whether WGSL wants the threshold lower.
SMALL_TOKENS = 8 * 4096


def case(rng, seq_lens, num_heads, num_kv_heads, head_size):
    x, bs = 8, 16
    blocks = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    ids = list(rng.permutation(num_blocks).astype(np.int32))
    tables = np.full((len(seq_lens), max(blocks) + 1), -1, np.int32)
    for s, b in enumerate(blocks):
        tables[s, :b] = [ids.pop() for _ in range(b)]
    k = rng.standard_normal((num_blocks, num_kv_heads, head_size // x, bs, x)).astype(np.float16)
    v = rng.standard_normal((num_blocks, num_kv_heads, head_size, bs)).astype(np.float16)
    q = rng.standard_normal((len(seq_lens), num_heads, head_size)).astype(np.float16)
    return q, k, v, tables, np.asarray(seq_lens, np.int32)


def where_wrong(out, ref):
    """Relative errors by head, by 16-dim tile, as text."""
    d = np.abs(out.astype(np.float64) - ref)
    scale = np.abs(ref).mean() + 1e-30
    by_head = d.mean(axis=(0, 2)) / scale
    by_tile = d.reshape(*d.shape[:2], -1, 16).mean(axis=(0, 1, 3)) / scale
    return ("by head " + " ".join(f"{e:.2g}" for e in by_head)
            + " | by dim tile " + " ".join(f"{e:.2g}" for e in by_tile))


def correctness(results):
    rng = np.random.default_rng(1)
    ok = True
    # (seq_lens, heads, kv heads, head size, partition size): whole blocks only, a tail block, group 4 and 8, split.
    for seq_lens, h, hkv, hs, part in (([512], 8, 2, 128, None), ([512, 37], 8, 2, 128, None),
                                       ([1024, 700], 16, 2, 128, None), ([600, 33], 8, 2, 64, None),
                                       ([2048, 1500, 5], 32, 8, 128, 512), ([16], 8, 8, 128, None)):
        q, k, v, tables, lens = case(rng, seq_lens, h, hkv, hs)
        ref = reference.paged_attention(q, k, v, tables, lens)
        for backend in ("glsl", "wgsl"):
            label = f"{backend} lens {seq_lens} heads {h}/{hkv} head {hs} partition {part}"
            try:
                with pagedvk.DecodePlan(tables, lens, num_heads=h, num_kv_heads=hkv, head_size=hs, block_size=16,
                                        num_blocks=k.shape[0], dtype=np.float16, kernel="coopmat", backend=backend,
                                        partition_size=part) as plan:
                    out = plan.run(q, k, v, out=np.full(q.shape, np.nan, np.float16))
                    name, parts = plan.key.name, plan.num_partitions
                finite = bool(np.isfinite(out).all())
                o = np.nan_to_num(out.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
                err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                line = (f"{label}: {name} x{parts}: rel error {err:.3g}{'' if finite else ' (NON-FINITE outputs)'}"
                        + ("" if err < 2e-3 and finite else "\n    " + where_wrong(o, ref)))
                ok &= err < 2e-3 and finite
                results.append({"case": label, "module": name, "rel_error": err, "finite": finite})
            except Exception as e:   # a module the driver refuses: say why, go on
                line = f"{label}: FAILED {type(e).__name__}: {e}"
                if not isinstance(e, ValueError):   # ValueError: the plan refused the kernel, and says why
                    traceback.print_exc()
                ok = False
                results.append({"case": label, "error": repr(e)})
            print(line, flush=True)
    return ok


def timing(shapes, iters, repeats, rounds, rows):
    for num_seqs, context in shapes:
        shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype="float16")
        with bench.DecodeInputs(shape) as inputs:
            got = {}
            kernels = KERNELS + ((("wgsl", "coopmat"),) if num_seqs * context <= SMALL_TOKENS else ())
            for r in range(rounds):
                for backend, kernel in kernels:
                    try:
                        row = bench.time_decode(inputs, backend, iters, repeats=repeats, kernel=kernel)
                    except Exception as e:
                        print(f"{num_seqs}x{context} {backend} {kernel}: FAILED {e!r}", flush=True)
                        continue
                    got.setdefault((backend, kernel), []).append(row["median_us"])
                    rows.append({**row, "round": r, "forced": kernel})
                    if r == 0:
                        print(f"  {num_seqs}x{context} {backend:4} {row['kernel']:7} x{row['partitions']:<3} "
                              f"err {row['rel_error']:.1e}: {row['median_us']:.1f} us", flush=True)
            med = {k: float(np.median(v)) for k, v in got.items()}
            g, w, s = med.get(("glsl", None)), med.get(("wgsl", None)), med.get(("wgsl", "gpu"))
            c = med.get(("wgsl", "coopmat"))
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
            print(f"{num_seqs}x{context} f16: GLSL {g or 0:.1f} us, WGSL (plan's choice) {w or 0:.1f} us "
                  f"= {ratio(g, w)} of GLSL speed, WGSL scalar {s or 0:.1f} us = {ratio(g, s)}"
                  + (f", WGSL matrix forced {c:.1f} us = {ratio(g, c)}" if c else ""), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=bench.parse_shapes,
                   default=bench.parse_shapes("64x4096,256x2048,32x16384,8x32768,1x32768,8x4096,1x4096"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-correctness", action="store_true")
    args = p.parse_args(argv)
    info = pagedvk.default_device().info
    print(f"{info.name} ({info.driver} {info.driver_version}); features on: "
          f"{sorted(pagedvk.default_device().features)}", flush=True)
    record = {"correctness": [], "timing": []}
    ok = True
    if not args.no_correctness:
        ok = correctness(record["correctness"])
        print(f"correctness: {'all within 2e-3' if ok else 'SOME WRONG'}", flush=True)
    if not args.no_timing:
        timing(args.shapes, args.iters, args.repeats, args.rounds, record["timing"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
