#!/usr/bin/env python3
"""Where the decode kernel's time goes: the kernel timed with one stage left out at a time, in one process,
on the same inputs, against the read kernel (issue 9: "place time inside a Vulkan kernel by timing variants
that leave a stage out"). Run from a source checkout (it compiles the ablated modules with glslangValidator):

    python benchmarks/decode_ablations.py                          # 64x4096, 8x32768, 8x4096, float16
    python benchmarks/decode_ablations.py --shapes 2x256 --json out.json
    python benchmarks/decode_ablations.py --shapes 8x512 --iters 5      # on lavapipe

Each ablation is shaders/paged_decode.comp with statements replaced (ABLATIONS below), built with the defines
of the module the plan runs (GLSL, head size 128, vLLM layout), and swapped into the plan's pipeline; its
outputs are wrong by design (`rel. error` shows that the swap took). A last pass reruns the kept kernel with
identity block tables (each sequence's blocks contiguous) to show what page locality is worth.
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
from pagedvk import bench  # noqa: E402
from pagedvk import kernels  # noqa: E402
from pagedvk.abi import PAGED_DECODE  # noqa: E402
from pagedvk.decode import group_size, kernel_constants  # noqa: E402
from pagedvk.runtime.pipeline import Pipeline  # noqa: E402

KEY_MATH = [("s_a += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 0u);", "s_a += chunk_quad(w[k], i);"),
            ("s_b += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 1u);", "s_b += chunk_quad(w[k], i);")]
VALUE_MATH = [("acc_a[slot] += v * weights(t0 >> 2, 0u);\n                                    if (wide)",
               "acc_a[slot] += v;\n                                    if (wide)")]
KEY_LOADS = [("if (k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, k * CQ) / CQ);",
              "if (k < kchunks) w[k] = uvec4(uint(phys) + k, t, 1u, 2u);"),
             ("if (c0 + k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, (c0 + k) * CQ) / CQ);",
              "if (c0 + k < kchunks) w[k] = uvec4(uint(phys) + k + c0, t, 1u, 2u);")]
VALUE_LOADS = [("w[K_BATCH + k] = ph >= 0 ? value_load(uint(ph), (row_d + (t0 & bs_mask)) / CHUNK_TOKENS)",
                "w[K_BATCH + k] = ph >= 0 ? uvec4(uint(ph), row_d + t0, 1u, 2u)")]
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
ABLATIONS = {"no key math": KEY_MATH, "no value math": VALUE_MATH, "no math": KEY_MATH + VALUE_MATH,
             "no key loads": KEY_LOADS, "no value loads": VALUE_LOADS, "no cache loads": KEY_LOADS + VALUE_LOADS,
             "no query reads (products kept)": QUERY_LOADS, "no weight reads (products kept)": WEIGHT_LOADS,
             "neither read (products kept)": QUERY_LOADS + WEIGHT_LOADS}
# Cache dtype: (cache tag, query tag) of the module the benchmark's plan runs (fp8 caches take float16 queries).
TAGS = {"float16": ("f16", "f16"), "bfloat16": ("bf16", "bf16"), "float32": ("f32", "f32"),
        "float8_e4m3fn": ("e4m3", "f16"), "float8_e5m2": ("e5m2", "f16")}


def build(key, folder: Path) -> dict:
    """{name: SPIR-V} of the kept kernel and each ablation, built as the module `key` is."""
    source = (build_shaders.SHADER_DIR / "paged_decode.comp").read_text()
    built = {}
    for name, replacements in {"kept kernel": [], **ABLATIONS}.items():
        text = source
        for old, new in replacements:
            if old not in text:
                raise SystemExit(f"{name}: the statement it replaces is no longer in paged_decode.comp: {old}")
            text = text.replace(old, new)
        src = folder / f"ablation_{len(built)}.comp"
        out = src.with_suffix(".spv")
        src.write_text(text)
        build_shaders.compile_glsl(src, out, key)
        built[name] = out.read_bytes()
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x4096,8x32768,8x4096")
    p.add_argument("--dtype", default="float16", choices=sorted(TAGS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = bench.get_device()
    key = PAGED_DECODE.key("glsl", *TAGS[args.dtype], 128)
    with tempfile.TemporaryDirectory() as tmp:
        modules = build(key, Path(tmp))
    ceiling = bench.read_bandwidth(device, iters=args.iters)
    print(f"{device.info.name}: read kernel {ceiling['GBps']:.0f} GB/s", flush=True)
    rows = []
    for identity_tables in (False, True):
        for num_seqs, context in bench.parse_shapes(args.shapes):
            shape = bench.DecodeShape(num_seqs=num_seqs, context=context, dtype=args.dtype)
            constants = kernel_constants("vllm", group_size(shape.num_heads, shape.num_kv_heads))   # the plan's
            with bench.DecodeInputs(shape, device=device) as inputs:
                if identity_tables:
                    inputs.block_tables = np.arange(inputs.num_blocks, dtype=np.int32).reshape(inputs.block_tables.shape)
                for name, spirv in modules.items() if not identity_tables else [("kept kernel", modules["kept kernel"])]:
                    # The plan runs without variants, specialized for the benchmark's layout and head group.
                    cached, specialization = kernels.specialized(PAGED_DECODE, key, False, constants)
                    replaced = device._pipelines.pop(cached, None)
                    if replaced is not None:
                        replaced.close()
                    device._pipelines[cached] = Pipeline(device, PAGED_DECODE, spirv, name,
                                                         PAGED_DECODE.bindings_for(key), specialization)
                    r = bench.time_decode(inputs, "glsl", iters=args.iters)
                    label = name + (", identity block tables" if identity_tables else "")
                    r.update(kernel=label, fraction_of_read=r["GBps"] / ceiling["GBps"])
                    rows.append(r)
                    print(f"{num_seqs:>5} x {context:>6}  {label:<40} {r['median_us']:9.1f} us  "
                          f"({100 * r['fraction_of_read']:.0f}% of read)  rel. error {r['rel_error']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read": ceiling, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
