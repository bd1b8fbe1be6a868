#!/usr/bin/env python3
"""Host cost per call of the layer ops (pagedvk/ops/layer_ops.py) on device arrays: the calling thread's CPU time per
call, as an engine pays it per layer, for each op checked at every call and for the same call queued again from its
kept launch (a repeated call over DeviceArrays: validate=False where the op reads ids or positions back).

    python benchmarks/layer_ops_host.py                      # 4 tokens, hidden 576 (float16), 500 calls an op
    python benchmarks/layer_ops_host.py --tokens 64 --iters 2000

The GPU runs the queued work meanwhile; only the calling thread's CPU (time.thread_time) is counted, the wait at
the end left out. reshape_and_cache (validate=False) is timed beside them as the launch path's reference.
"""

import argparse
import time

import numpy as np

import pagedvk
import pagedvk.ops.layer_ops as layer_ops


def per_call_us(call, iters: int) -> float:
    call()   # the first call checks, records and keeps the launch
    pagedvk.synchronize()
    start = time.thread_time()
    for _ in range(iters):
        call()
    spent = time.thread_time() - start
    pagedvk.synchronize()
    return spent / iters * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    t, h, heads, head = args.tokens, args.hidden, 8, 64

    def array(*shape, dtype=np.float16):
        return pagedvk.asarray(rng.standard_normal(shape).astype(dtype))

    x, out, weight, gate = array(t, h), array(t, h), array(h), array(t, 2 * h)
    q, k = array(t, heads * head), array(t, 2 * head)
    ids = pagedvk.asarray(np.arange(t, dtype=np.int32))
    table, cos_sin = array(1000, h), pagedvk.asarray(pagedvk.rope_cos_sin_cache(4096, head))
    key, slots = array(t, 2, head, dtype=np.float32), pagedvk.asarray(np.arange(t, dtype=np.int32))
    key_cache, value_cache = pagedvk.zeros((8, 2, 16, 16, 4)), pagedvk.zeros((8, 2, 64, 16))
    calls = {
        "embedding": lambda: pagedvk.embedding(ids, table, out=out, validate=False),
        "rms_norm": lambda: pagedvk.rms_norm(out, x, weight, 1e-5),
        "fused_add_rms_norm": lambda: pagedvk.fused_add_rms_norm(x, out, weight, 1e-5),
        "silu_and_mul": lambda: pagedvk.silu_and_mul(out, gate),
        "rotary_embedding": lambda: pagedvk.rotary_embedding(ids, q, k, head, cos_sin, True, validate=False),
        "reshape_and_cache": lambda: pagedvk.reshape_and_cache(key, key, key_cache, value_cache, slots,
                                                               validate=False),
    }
    device = pagedvk.default_device()
    print(f"{device.info.name}; {t} tokens, hidden {h}, float16; calling thread's CPU per call, {args.iters} calls")
    print("| op | kept launch | checked every call |\n| --- | --- | --- |")
    kept = layer_ops.kept_launches
    for name, call in calls.items():
        fast = per_call_us(call, args.iters)
        layer_ops.kept_launches = lambda d: type("NoneKept", (), {"enqueue_kept": lambda self, s: False})()
        try:
            checked = per_call_us(call, args.iters) if name != "reshape_and_cache" else float("nan")
        finally:
            layer_ops.kept_launches = kept
        print(f"| {name} | {fast:.0f} us | {'-' if checked != checked else f'{checked:.0f} us'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
