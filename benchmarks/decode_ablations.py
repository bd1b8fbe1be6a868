#!/usr/bin/env python3
"""Where a decode kernel's time goes: the kernel timed with one stage left out at a time, in one process, on the same
inputs, against the read kernel (issue 9: "place time inside a Vulkan kernel by timing variants that leave a stage
out"). Run from a source checkout (it compiles the ablated modules with glslangValidator):

    python benchmarks/decode_ablations.py                          # the scalar kernel: 64x4096, 8x32768, 8x4096, float16
    python benchmarks/decode_ablations.py --kernel coopmat --dtype float8_e5m2 --shapes 64x4096
    python benchmarks/decode_ablations.py --shapes 8x512 --iters 5 --only "no key loads"     # on lavapipe

`--kernel` names the kernel ablated, forced in the plans as DecodePlan's `kernel` forces it: "gpu" the scalar kernel
(shaders/paged_decode.comp, SCALAR_ABLATIONS), "coopmat" the cooperative-matrix one (paged_decode_coopmat.comp,
MATRIX_ABLATIONS or, for fp8 caches, FP8_MATRIX_ABLATIONS). Each ablation is that source with statements replaced,
built as the module the plan runs (build_shaders.build_module) and loaded in its place (bench.DecodeModules); its
outputs are wrong by design (`rel. error` shows that the swap took, and a result as close as the kept kernel's is
flagged). A last pass reruns the kept kernel with identity block tables (each sequence's blocks contiguous) to show
what page locality is worth.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import build_shaders  # noqa: E402
from pagedvk.testing import bench  # noqa: E402

# -- the scalar kernel (shaders/paged_decode.comp) --
KEY_MATH = [("s_a += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 0u);", "s_a += chunk_quad(w[k], i);"),
            ("s_b += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 1u);", "s_b += chunk_quad(w[k], i);")]
VALUE_MATH = [("acc_a[slot] += v * weights(t0 >> 2, 0u);\n                                    if (wide)",
               "acc_a[slot] += v;\n                                    if (wide)")]
KEY_LOADS = [("if (k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, k * CQ) / CQ);",
              "if (k < kchunks) w[k] = uvec4(uint(phys) + k, t, 1u, 2u);"),
             ("if (c0 + k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, (c0 + k) * CQ) / CQ);",
              "if (c0 + k < kchunks) w[k] = uvec4(uint(phys) + k + c0, t, 1u, 2u);")]
VALUE_LOADS = [("return ph >= 0 ? value_load(uint(ph), (row_d + (t0 & ((1u << bs_log2) - 1u))) / CHUNK_TOKENS)",
                "return ph >= 0 ? uvec4(uint(ph), row_d + t0, 1u, 2u)")]
# The products kept, their shared-memory operands replaced by values the compiler cannot fold: what reading the
# queries (K stage) and the weights (V stage) from shared memory costs. llvmpipe reads shared memory one lane at a
# time even where every lane reads one address (BENCHMARKS.md, lavapipe's decode).
QUERY_LOADS = [("s_a += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 0u);",
                "s_a += chunk_quad(w[k], i) * mat4(vec4(float(k)), vec4(float(i)), vec4(float(c0)), vec4(2.0));"),
               ("s_b += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 1u);",
                "s_b += chunk_quad(w[k], i) * mat4(vec4(float(k)), vec4(float(i)), vec4(float(c0)), vec4(3.0));")]
WEIGHT_LOADS = [("acc_a[slot] += v * weights(t0 >> 2, 0u);\n                                    if (wide)",
                 "acc_a[slot] += v * mat4(vec4(float(t0)), vec4(float(k)), vec4(1.0), vec4(2.0));\n"
                 "                                    if (wide)")]
SCALAR_ABLATIONS = {"no key math": KEY_MATH, "no value math": VALUE_MATH, "no math": KEY_MATH + VALUE_MATH,
                    "no key loads": KEY_LOADS, "no value loads": VALUE_LOADS, "no cache loads": KEY_LOADS + VALUE_LOADS,
                    "no query reads (products kept)": QUERY_LOADS, "no weight reads (products kept)": WEIGHT_LOADS,
                    "neither read (products kept)": QUERY_LOADS + WEIGHT_LOADS}

# -- the cooperative-matrix kernel (shaders/paged_decode_coopmat.comp) --
# float16 and bfloat16 caches: a whole block's key and value tiles read from the subgroup's shared-memory tile instead
# of the caches (the products kept; what the cache reads cost beside them).
MATRIX_KEY_LOADS = [("coopMatLoad(kt[u * DT + j], key_cache, key_tile(b, kv_head, j), 2u, gl_CooperativeMatrixLayoutRowMajor);",
                     "coopMatLoad(kt[u * DT + j], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);")]
MATRIX_VALUE_LOADS = [("coopMatLoad(vt[u * DT + i], value_cache, value_tile(b, kv_head, i), 2u, gl_CooperativeMatrixLayoutRowMajor);",
                       "coopMatLoad(vt[u * DT + i], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);")]
# Every kind: the weights without their exponential (the max, the sums and P.V kept).
SOFTMAX_EXP = [("p[u] = mix(exp(x[u] - m), vec4(0.0), equal(x[u], vec4(NEG_INF)));",
                "p[u] = mix(x[u] - m, vec4(0.0), equal(x[u], vec4(NEG_INF)));")]
# fp8 caches: each lane's key and value words made up from the block id and its position instead of loaded (bytes
# below 0x10: no NaN, so e4m3 keeps its fast conversion), and the conversion to float16 reduced to one shift.
FP8_KEY_LOADS = [("? key_load(b, key_chunk(0u, kv_head, r + 8u * s, q + 4u * c)) : uvec4(0u);",
                  "? uvec4(b + r + c, b ^ q, b + s, b + base) & 0x0f0f0f0fu : uvec4(0u);")]
FP8_VALUE_LOADS = [("vw[2u * i + s] = phys >= 0 ? value_word(b, kv_head, 16u * i + r + 8u * s, q) : 0u;",
                    "vw[2u * i + s] = phys >= 0 ? (b + 16u * i + r + 8u * s + q) & 0x0f0f0f0fu : 0u;")]
FP8_CONVERSION = [("const uvec2 a = exact ? fp8_as_f16(lo) : fp8_as_f16_fast(lo), b = exact ? fp8_as_f16(hi) : fp8_as_f16_fast(hi);",
                   "const uvec2 a = uvec2(lo, lo << 8), b = uvec2(hi, hi << 8);")]
# Every kind: each subgroup takes one block of its partition and stops, so the launch is its fixed cost (launch, a
# workgroup's first round trips, the subgroups' meeting, the partials' writes and the merge) with almost nothing
# streamed: the intercept of BENCHMARKS.md's fixed-cost analysis, measured.
ONE_BLOCK = [("const uint blocks = start < end ? (end - start + BS - 1u) / BS : 0u;",
              "const uint blocks = start < end ? min((end - start + BS - 1u) / BS, SUBGROUPS) : 0u;")]
# The fixed cost taken apart: the split's merge left out (the partials written, no workgroup merges them), and an
# empty kernel on the same grid (what the launch and its timestamps cost alone).
NO_MERGE = [("    merge_if_last(seq, head0, group, partitions_holding(window0, seq_len));\n", "")]
EMPTY = [("void main() {\n", "void main() {\n    if (gl_NumWorkGroups.x > 0u) return;\n")]
FIXED_COST_PARTS = {"one block a subgroup without the merge": ONE_BLOCK + NO_MERGE, "an empty kernel (the launch)": EMPTY}


def matrix_ablations(key_loads: list, value_loads: list, **own) -> dict:
    """A matrix module's ablations: its cache loads left out (each, both, and under one block a subgroup), its `own`
    after those, then the softmax exp, the fixed cost and its parts: every cache type's table has that shape."""
    return {"no key loads": key_loads, "no value loads": value_loads, "no cache loads": key_loads + value_loads, **own,
            "no softmax exp": SOFTMAX_EXP, "one block a subgroup (the fixed cost)": ONE_BLOCK,
            "one block a subgroup without cache loads": ONE_BLOCK + key_loads + value_loads, **FIXED_COST_PARTS}


MATRIX_ABLATIONS = matrix_ablations(MATRIX_KEY_LOADS, MATRIX_VALUE_LOADS)
FP8_MATRIX_ABLATIONS = matrix_ablations(FP8_KEY_LOADS, FP8_VALUE_LOADS, **{
    "no fp8 conversion": FP8_CONVERSION,
    "no cache loads or conversion": FP8_KEY_LOADS + FP8_VALUE_LOADS + FP8_CONVERSION})
KERNELS = {"gpu": "paged_decode.comp", "coopmat": "paged_decode_coopmat.comp"}   # --kernel: the source ablated


def ablations_for(key) -> dict:
    """{name: replacements} of the kernel and cache type of module `key`."""
    if key.source == KERNELS["gpu"]:
        return SCALAR_ABLATIONS
    return FP8_MATRIX_ABLATIONS if key.kv in ("e4m3", "e5m2") else MATRIX_ABLATIONS


def build(key, names, folder: Path) -> dict:
    """{name: folder holding its module} of the kept kernel and each named ablation, built as the module `key` is."""
    source = (build_shaders.SHADER_DIR / key.source).read_text()
    folder.mkdir(parents=True)
    built = {}
    for name in ["kept kernel", *names]:
        text = source
        for old, new in ablations_for(key).get(name, []):
            if old not in text:
                raise SystemExit(f"{name}: the statement it replaces is no longer in {key.source}: {old}")
            text = text.replace(old, new)
        src = folder / f"ablation_{len(built)}{Path(key.source).suffix}"
        src.write_text(text)
        out = folder / str(len(built))
        out.mkdir()
        build_shaders.build_module(key, out, source=src)
        built[name] = out
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x4096,8x32768,8x4096")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float8_e4m3fn",
                                                          "float8_e5m2"])
    p.add_argument("--kernel", default="gpu", choices=sorted(KERNELS))
    p.add_argument("--only", default=None, help="comma-separated ablations to time (default: every one of the kernel's)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = bench.get_device()
    ceiling = bench.read_bandwidth(device, iters=args.iters)
    print(f"{device.info.name}: read kernel {ceiling['GBps']:.0f} GB/s", flush=True)
    rows, built = [], {}
    with tempfile.TemporaryDirectory() as tmp, bench.DecodeModules(device) as swap:
        for identity_tables in (False, True):
            for num_seqs, context in bench.parse_shapes(args.shapes):
                shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=args.dtype)
                with bench.DecodeInputs(shape, device=device) as inputs:
                    if identity_tables:
                        inputs.block_tables = np.arange(inputs.num_blocks, dtype=np.int32).reshape(
                            inputs.block_tables.shape)
                    try:   # the module the timed plan runs
                        with bench.decode_plan(inputs, "glsl", kernel=args.kernel) as plan:
                            key = plan.key
                    except ValueError as e:
                        p.error(f"--kernel {args.kernel} cannot run here: {e}")
                    names = list(ablations_for(key))
                    if args.only is not None:
                        names = [n.strip() for n in args.only.split(",")]
                        unknown = [n for n in names if n not in ablations_for(key)]
                        if unknown:
                            p.error(f"--only: {key.name} has no ablation {unknown[0]!r}; it has "
                                    f"{', '.join(ablations_for(key))}")
                    if key.name not in built:
                        built[key.name] = build(key, names, Path(tmp) / str(len(built)))
                    modules = built[key.name]
                    kept_error = None
                    for name, folder in modules.items() if not identity_tables else [("kept kernel", modules["kept kernel"])]:
                        swap.use(folder)
                        r = bench.time_decode(inputs, "glsl", iters=args.iters, kernel=args.kernel)
                        label = name + (", identity block tables" if identity_tables else "")
                        r.update(ablation=label, module=key.name, fraction_of_read=r["GBps"] / ceiling["GBps"])
                        kept_error = r["rel_error"] if name == "kept kernel" else kept_error
                        r["swapped"] = name == "kept kernel" or not r["rel_error"] <= 2 * kept_error
                        rows.append(r)
                        flag = "" if r["swapped"] else "  (as close as the kept kernel: did the swap take?)"
                        print(f"{num_seqs:>5} x {context:>6}  {label:<40} {r['median_us']:9.1f} us  "
                              f"({100 * r['fraction_of_read']:.0f}% of read)  rel. error {r['rel_error']:.1e}{flag}",
                              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read": ceiling, "kernel": args.kernel, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
