"""Merging attention states: the attention over two disjoint sets of keys from each set's output and
log-sum-exp (FlashInfer's ``merge_state``), on the device. Cascade and shared-prefix attention run a shared
prefix cache and each sequence's own suffix cache separately (decode or prefill with return_lse / their lse)
and merge the two."""

from __future__ import annotations

import numpy as np

from . import checks, kernels
from .abi import ATTENTION_PUSH, MERGE_STATES, q_type_code, q_type_constant
from .array import Array, DeviceArray, asarray, empty
from .dtypes import QUERY_TYPES, storage_type
from .opargs import backend_name, device_of
from .runtime.pipeline import fold_grid

WG = 128   # threads per workgroup, one quad of head dims each


def merge_attention_states(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array, *,
                           backend: str | None = None) -> tuple[Array, Array]:
    """(out, lse) of attention over the union of two disjoint key sets, from each set's result.

    out_a, out_b  float32, float16 or bfloat16 [..., head_size], one shape and dtype (decode's [num_seqs,
                  num_heads, head_size], prefill's [num_seqs, num_heads, q_len, head_size]); head_size a
                  multiple of 4
    lse_a, lse_b  float32 [...] (out's shape without head_size): natural-log log-sum-exps, as decode's
                  return_lse and prefill give them (FlashInfer's kernels give base-2 ones: multiply those by
                  ln 2 first). A row with lse -inf saw no key and contributes nothing; both -inf give zeros
                  and -inf.
    Returns out (the inputs' dtype and shape) and lse (float32): numpy when out_a is numpy, else DeviceArrays.
    Sinks: each part's lse includes its sink, so give a head's sink to one of the two parts only.

    >>> out, lse = pagedvk.merge_attention_states(out_prefix, lse_prefix, out_suffix, lse_suffix)
    """
    for name, a in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        checks.kind(name, a)
    query_type = storage_type("out_a", out_a, QUERY_TYPES)
    checks.dtype("out_b", out_b, [out_a.dtype])
    shape = tuple(out_a.shape)
    if len(shape) < 2 or shape[-1] < 4 or shape[-1] % 4:
        raise ValueError(f"out_a must be [..., head_size] with head_size a positive multiple of 4, got shape {shape}")
    if tuple(out_b.shape) != shape:
        raise ValueError(f"out_b must have out_a's shape {shape}, got {tuple(out_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        checks.dtype(name, lse, [np.float32])
        if tuple(lse.shape) != shape[:-1]:
            raise ValueError(f"{name} must have shape {shape[:-1]} (out_a's without head_size), got {tuple(lse.shape)}")
    device = device_of(out_a, lse_a, out_b, lse_b)
    backend = backend_name(backend)
    rows, head_size = int(np.prod(shape[:-1])), shape[-1]
    push = MERGE_STATES.pack_push(**{f.name: 0 for f in ATTENTION_PUSH}
                                  | dict(num_seqs=rows, head_size=head_size, scale=0.0, v_scale=0.0, softcap=0.0,
                                         q_type=q_type_code(query_type.tag)))
    temporaries, results = [], []
    try:
        inputs = []
        for a in (out_a, lse_a, out_b, lse_b):
            d = asarray(a, device=device)
            inputs.append(d)
            if d is not a:
                temporaries.append(d)
        results = [empty(shape, out_a.dtype, device), empty(shape[:-1], np.float32, device)]
        if rows:
            pipeline = kernels.pipeline(device, MERGE_STATES, MERGE_STATES.key(backend, q=query_type.tag),
                                        constants=q_type_constant(query_type.tag))
            grid = fold_grid(-(-rows * head_size // 4 // WG), device.info.max_workgroup_count)
            launch = pipeline.launch([a.buffer for a in inputs + results], push, grid)
            try:
                launch.submit()
            finally:
                launch.close()
        if not isinstance(out_a, DeviceArray):
            return tuple(r.numpy() for r in results)
        handed, results = tuple(results), []
        return handed
    finally:
        for a in temporaries + results:
            a.close()
