#!/usr/bin/env python3
"""What the device's arithmetic costs through Vulkan: float32 multiply-adds, and 16x16x16 float16 cooperative-matrix
products alone and with each product's operand loaded from shared memory as the prefill matrix kernels load them
(benchmarks/coopmat_probe.comp explains the modes): what a matrix kernel's products and the shared-memory loads
that feed them can reach, to compare a kernel's rate with. On the H200 (driver 580.159.04, BENCHMARKS.md) the
products run at 558 TFLOP/s and 450-500 with their loads, float32 multiply-adds at 52.5; the matrix forward ran at
52 TFLOP/s then (its accumulators were in local memory), 98 now. Run from a source checkout (it compiles the probe
with the build's glslang):

    python benchmarks/coopmat_probe.py                  # every mode the device runs
    python benchmarks/coopmat_probe.py --iters 512 --json probe.json

Devices without a 16x16x16 float16 multiply (lavapipe) run the float32 mode only. Times are GPU timestamps, the
median of --repeats submissions after the clocks are up (pagedvk.testing.bench.warm_up). tests/app/test_bench.py builds every
mode and runs the float32 one.

The LAYOUT mode, on devices with the multiplies, prints which elements of a 16x16 float16 A matrix, a 16x8 float16
B and a 16x8 float32 accumulator each invocation holds (KHR_cooperative_matrix leaves this to the device), and
whether that is the layout of PTX's mma.m16n8k16 fragments; --json keeps the whole map.
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
from pagedvk import empty, get_device
from pagedvk.kernels.abi import Binding, KernelABI, PushField, VariantKey
from pagedvk.ops.prefill import matrix_unavailable  # noqa: E402
from pagedvk.runtime.pipeline import Launch, Pipeline  # noqa: E402

SOURCE = Path(__file__).with_suffix(".comp")
MODES = ("FMA", "MMA", "MMA_BCOL", "MMA_BROW", "MMA_AROW", "LAYOUT")
TIMED = MODES[:-1]
PROBE = KernelABI(op="coopmat_probe", bindings=(Binding("out", readonly=False),),
                  push=(PushField("iters", "u32"),), workgroup_size=(128, 1, 1), backends=("glsl",))
MMA_FLOP = 2 * 16 * 16 * 16


def build(mode: str, folder: Path) -> bytes:
    """The probe's SPIR-V for one mode, with the tools and target environment the build gives a module of its kind
    (the cooperative-matrix modes: glslang 13 or newer), checked by spirv-val as the build checks its modules."""
    key = VariantKey(PROBE.op, "glsl", matrix="" if mode == "FMA" else "coopmat")
    glslang, _, env = build_shaders.glsl_tools(key)
    out = folder / f"coopmat_probe_{mode.lower()}.spv"
    defines = [f"-DMODE_{m}={i}" for i, m in enumerate(MODES)] + [f"-DMODE=MODE_{mode}"]
    build_shaders.run([glslang, "-V", "--target-env", key.target_env, *defines, "-o", str(out), str(SOURCE)],
                      f"glslangValidator {SOURCE.name} ({mode})", env)
    build_shaders.validate(out, key)
    return out.read_bytes()


def time_mode(device, mode: str, spirv: bytes, iters: int, repeats: int) -> dict:
    """GPU time of one launch of the probe, and its rate: TFLOP/s (a multiply-add is two)."""
    groups = 8 * device.info.compute_units or 1024   # several workgroups a compute unit, so that latency hides
    floats = groups * 128 if mode == "FMA" else groups * 4 * 8 * 256
    out = empty((floats,), np.float32, device)
    pipeline = Pipeline(device, PROBE, spirv, f"coopmat_probe ({mode})")
    launch = Launch(device, [(pipeline, (out.buffer,), PROBE.pack_push(iters=iters), (groups, 1, 1))], timestamps=True)
    try:
        bench.warm_up(launch)
        ns = float(np.median([launch.submit() for _ in range(repeats)]))
        result = out.numpy()
    finally:
        launch.close()
        pipeline.close()
        out.close()
    if not np.all(np.isfinite(result)):
        raise RuntimeError(f"{mode}: the probe wrote non-finite values")
    flop = groups * 128 * iters * 32 * 2 if mode == "FMA" else groups * 4 * iters * 8 * MMA_FLOP
    return {"mode": mode, "workgroups": groups, "iters": iters, "ns": ns, "TFLOPs": flop / ns / 1e3}


# PTX's mma.m16n8k16 fragments (float16 A and B, float32 C): (row, column) of element e of lane l.
def _a(l, e): return l // 4 + 8 * (e // 2 % 2), 2 * (l % 4) + e % 2 + 8 * (e // 4)
def _b(l, e): return 2 * (l % 4) + e % 2 + 8 * (e // 2), l // 4
def _c(l, e): return l // 4 + 8 * (e // 2), 2 * (l % 4) + e % 2
MMA_FRAGMENTS = {"A 16x16 f16": (16, _a), "B 16x8 f16": (8, _b), "C 16x8 f32": (8, _c)}


def element_layout(device, spirv: bytes) -> dict:
    """{matrix: [[(row, column) of each element] of each of the 32 invocations], and whether it is mma.m16n8k16's}
    as the LAYOUT mode reads it off the device."""
    out = empty((3 * 32 * 16,), np.float32, device)
    pipeline = Pipeline(device, PROBE, spirv, "coopmat_probe (LAYOUT)")
    launch = Launch(device, [(pipeline, (out.buffer,), PROBE.pack_push(iters=0), (1, 1, 1))])
    try:
        launch.submit()
        values = out.numpy().reshape(3, 32, 16)
    finally:
        launch.close()
        pipeline.close()
        out.close()
    result = {}
    for m, (name, (cols, fragment)) in enumerate(MMA_FRAGMENTS.items()):
        held = [[divmod(int(v), cols) for v in values[m, lane] if v >= 0] for lane in range(32)]
        mma = all(held[lane] == [fragment(lane, e) for e in range(len(held[lane]))] for lane in range(32))
        result[name] = {"elements": held, "mma_m16n8k16": mma}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=1024, help="steps of eight products (default 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    device = get_device()
    why_not = matrix_unavailable(device.info, device.features)
    modes = TIMED if not why_not else ("FMA",)
    print(f"{device.info.name}: {device.info.compute_units or 'unknown'} compute units" +
          (f"; cooperative-matrix modes skipped: {why_not}" if why_not else ""))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            row = time_mode(device, mode, build(mode, Path(tmp)), args.iters, args.repeats)
            rows.append(row)
            print(f"{mode:9s} {row['ns'] / 1e3:10.1f} us  {row['TFLOPs']:8.3g} TFLOP/s", flush=True)
        layout = element_layout(device, build("LAYOUT", Path(tmp))) if not why_not else None
    for name, held in (layout or {}).items():
        print(f"{name}: {len(held['elements'][0])} elements an invocation; invocation 1 holds (row, column) "
              f"{held['elements'][1]}; PTX mma.m16n8k16's layout: {'yes' if held['mma_m16n8k16'] else 'no'}")
    if args.json:
        args.json.write_text(json.dumps({"device": device.info.name, "results": rows, "layout": layout}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
