#!/usr/bin/env python3
"""A decode plan rule against fixed answers, in one process, on the same inputs: each plan is made with the rule
replaced (its function in pagedvk.ops.decode_rules), checked against float64 and timed, rounds alternating.

    python benchmarks/decode_rules.py values_with_keys --shapes 1x4096,2x4096 --dtypes f16,bf16,e5m2
    python benchmarks/decode_rules.py matrix_step --answers rule,1,2 --shapes 64x4096,8x4096
    python benchmarks/decode_rules.py values_with_keys --shapes 1x256 --kernel gpu --iters 5    # on lavapipe

Rules and the answers they can be pinned to (RULES): `values_with_keys` (the scalar kernel's values loaded beside
its keys: never, always) and `matrix_step` (blocks a matrix-decode subgroup takes a step: 1, 2). "rule" is the
library's own choice.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedvk.testing import bench  # noqa: E402

from pagedvk.ops import decode_rules

RULES = {
    "values_with_keys": {"never": False, "always": True},
    "matrix_step": {"1": 1, "2": 2},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rule", choices=sorted(RULES))
    p.add_argument("--answers", default=None, help="comma-separated: rule and the rule's fixed answers (default: all)")
    p.add_argument("--shapes", default="1x4096,2x4096", type=bench.parse_shapes)
    p.add_argument("--dtypes", default="f16,bf16", type=bench.parse_dtypes)
    p.add_argument("--kernel", default=None, help="DecodePlan's kernel= (default: the plan's choice)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    fixed = RULES[args.rule]
    names = args.answers.split(",") if args.answers else ["rule", *fixed]
    unknown = [n for n in names if n != "rule" and n not in fixed]
    if unknown:
        p.error(f"answers of {args.rule} are rule, {', '.join(fixed)}; got {', '.join(unknown)}")
    own = getattr(decode_rules, args.rule)
    device = bench.get_device()
    ceiling = bench.read_bandwidth(device)
    print(f"{device.info.name}: read kernel {ceiling['GBps']:.0f} GB/s", flush=True)
    rows = []
    try:
        for dtype in args.dtypes:
            for num_seqs, context in args.shapes:
                shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=dtype)
                with bench.DecodeInputs(shape, device=device) as inputs:
                    for rnd in range(args.rounds):
                        for name in names:
                            setattr(decode_rules, args.rule, own if name == "rule" else (lambda *_, a=fixed[name]: a))
                            r = bench.time_decode(inputs, "glsl", iters=args.iters, kernel=args.kernel)
                            r.update(rule=args.rule, answer=name, round=rnd, fraction_of_read=r["GBps"] / ceiling["GBps"])
                            rows.append(r)
                            print(f"{dtype} {num_seqs}x{context} {name:8s} {r['kernel']} {r['partitions']}x"
                                  f"{r['partition_size']}: {r['median_us']:.2f} us (p10 {r['p10_us']:.2f}, p90 "
                                  f"{r['p90_us']:.2f}), rel. error {r['rel_error']:.1e}", flush=True)
    finally:
        setattr(decode_rules, args.rule, own)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.info.name, "read": ceiling, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
