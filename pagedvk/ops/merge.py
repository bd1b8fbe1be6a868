"""Merging attention states: the attention over two disjoint sets of keys from each set's output and
log-sum-exp (FlashInfer's ``merge_state``), on the device. Cascade and shared-prefix attention run a shared
prefix cache and each sequence's own suffix cache separately (decode or prefill with return_lse / their lse)
and merge the two."""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import QUERY_TYPES, storage_type
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import ATTENTION_PUSH, MERGE_STATES
from ..runtime.array import Array, DeviceArray, asarray, empty
from ..runtime.pipeline import fold_grid
from ..runtime.recording import active_recording, dispatch, refuse_recording, require_device_arrays
from . import checks
from .opargs import backend_name, device_of

WG = 128   # threads per workgroup, one quad of head dims each


def lse_base(base) -> float:
    """ln(base) for a log-sum-exp base argument: "e" (natural) or 2; ValueError naming `base` otherwise."""
    if isinstance(base, str) and base == "e":
        return 1.0
    if not isinstance(base, bool) and isinstance(base, (int, float, np.integer, np.floating)) and base == 2:
        return math.log(2.0)
    raise ValueError(f"base must be 'e' (natural-log lse, as pagedvk's ops give) or 2 (FlashInfer's), got {base!r}")


def merge_attention_states(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array, *, base: str | int = "e",
                           mask: Array | None = None,
                           backend: str | None = None) -> tuple[Array, Array]:
    """(out, lse) of attention over the union of two disjoint key sets, from each set's result.

    FlashInfer's merge_state: cascade and shared-prefix attention run a shared prefix and each sequence's own
    suffix separately (with return_lse) and merge the two.

    Parameters
    ----------
    out_a, out_b : DeviceArray or numpy.ndarray, shape (..., head_size)
        float32, float16 or bfloat16, one shape and dtype (decode's (num_seqs, num_heads, head_size), prefill's
        (num_seqs, num_heads, q_len, head_size)); head_size a multiple of 4.
    lse_a, lse_b : DeviceArray or numpy.ndarray, shape (...), float32
        out's shape without head_size: log-sum-exps in `base`. A row with lse -inf saw no key and contributes
        nothing; both -inf give zeros and -inf.
    base : "e" or 2, default "e"
        The lse's base, given and returned: "e" (decode's return_lse and prefill give natural logs) or 2
        (FlashInfer's kernels), so a state of either merges unconverted.
    mask : numpy.ndarray or DeviceArray, shape (...), bool, optional
        lse's shape: where False, b is left out and the row is a's (FlashInfer's merge_state_in_place mask).
        None merges every row.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Returns
    -------
    out : DeviceArray or numpy.ndarray, shape (..., head_size)
        The inputs' dtype.
    lse : DeviceArray or numpy.ndarray, shape (...), float32
        In `base`. Both are numpy when out_a is numpy, else DeviceArrays.

    Notes
    -----
    Each part's lse includes its sink, so give a head's sink to one of the two parts only. With base 2 or a mask,
    device arrays make a round trip through the host.

    Examples
    --------
    >>> out, lse = pagedvk.merge_attention_states(out_prefix, lse_prefix, out_suffix, lse_suffix)
    """
    ln_base = lse_base(base)
    if ln_base != 1.0 or mask is not None:
        _check_two(out_a, lse_a, out_b, lse_b)
        refuse_recording("merge_attention_states with base 2 or a mask", device_of(out_a, lse_a, out_b, lse_b))
        host = [a.numpy() if isinstance(a, DeviceArray) else a for a in (out_a, lse_a, out_b, lse_b)]
        out, lse = merge_states(np.stack(host[0::2], axis=-3), np.stack(host[1::2], axis=-2), base=base,
                                mask=None if mask is None else _pair_mask(mask, np.shape(host[1])), backend=backend)
        if not isinstance(out_a, DeviceArray):
            return out, lse
        device = device_of(out_a, lse_a, out_b, lse_b)
        return asarray(out, device), asarray(lse, device)
    return _merge_two(out_a, lse_a, out_b, lse_b, backend)


def _pair_mask(mask, shape) -> np.ndarray:
    """A two-way merge's mask [...] as merge_states' [..., 2, num_heads] (a always in): the states are stacked
    on axis -3 of out, -2 of lse."""
    mask = np.asarray(checks.host(mask))
    if mask.dtype != np.bool_ or mask.shape != tuple(shape):
        raise ValueError(f"mask must be a bool array of lse_a's shape {tuple(shape)}, got {mask.dtype} {mask.shape}")
    return np.stack([np.ones_like(mask), mask], axis=-2)


def merge_states(v: Array, s: Array, *, base: str | int = "e", mask: Array | None = None,
                 backend: str | None = None) -> tuple[Array, Array]:
    """(V, S) of attention over the union of num_states disjoint key sets (FlashInfer's merge_states, n-way).

    Parameters
    ----------
    v : DeviceArray or numpy.ndarray, shape (..., num_states, num_heads, head_size)
        float32, float16 or bfloat16 (FlashInfer's (seq_len, num_states, num_heads, head_dim)); head_size a
        multiple of 4.
    s : DeviceArray or numpy.ndarray, shape (..., num_states, num_heads), float32
        Each state's log-sum-exp in `base`; -inf for a state that saw no key (its v is never read).
    base : "e" or 2, default "e"
        "e" (pagedvk's ops) or 2 (FlashInfer's kernels), for s and S alike.
    mask : numpy.ndarray or DeviceArray, shape (..., num_states, num_heads) or (..., num_states), bool, optional
        False leaves a state out of its row; None keeps them all.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Returns
    -------
    V : DeviceArray or numpy.ndarray, shape (..., num_heads, head_size)
        v's dtype.
    S : DeviceArray or numpy.ndarray, shape (..., num_heads), float32
        In `base`. numpy for a numpy v, DeviceArrays for a DeviceArray v. The states are merged on the device
        one after another, in float32.

    Examples
    --------
    >>> V, S = pagedvk.merge_states(v, s, base=2)   # FlashInfer's states, unconverted
    """
    ln_base = lse_base(base)
    checks.kind("v", v)
    checks.kind("s", s)
    refuse_recording("merge_states", device_of(v, s, mask))
    storage_type("v", v, QUERY_TYPES)
    checks.dtype("s", s, [np.float32])
    shape = tuple(v.shape)
    if len(shape) < 3 or shape[-1] < 4 or shape[-1] % 4:
        raise ValueError(f"v must be [..., num_states, num_heads, head_size] with head_size a positive multiple of "
                         f"4, got shape {shape}")
    if tuple(s.shape) != shape[:-1]:
        raise ValueError(f"s must have shape {shape[:-1]} (v's without head_size), got {tuple(s.shape)}")
    lse = np.array(checks.host(s), np.float64) * ln_base   # natural log, as the kernel takes it
    if mask is not None:
        m = np.asarray(checks.host(mask))
        if m.dtype != np.bool_ or m.shape not in (shape[:-1], shape[:-2]):
            raise ValueError(f"mask must be a bool array of shape {shape[:-1]} or {shape[:-2]}, got {m.dtype} "
                             f"{m.shape}")
        lse = np.where(m if m.shape == shape[:-1] else m[..., None], lse, -np.inf)
    values = np.asarray(checks.host(v)).astype(np.float32)   # merged in float32, rounded once at the end
    device = device_of(v, s, mask)
    out = np.zeros(shape[:-3] + shape[-2:], np.float32)
    total = np.full(shape[:-3] + shape[-2:-1], -np.inf, np.float32)
    for i in range(shape[-3]):
        out, total = _merge_two(out, total, np.ascontiguousarray(values[..., i, :, :]),
                                np.ascontiguousarray(lse[..., i, :], np.float32), backend, device)
    with np.errstate(invalid="ignore"):
        total = (total / np.float32(ln_base)).astype(np.float32)
    out = out.astype(v.dtype)
    if isinstance(v, DeviceArray):
        return asarray(out, device), asarray(total, device)
    return out, total


def _check_two(out_a, lse_a, out_b, lse_b) -> None:
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


def _merge_two(out_a, lse_a, out_b, lse_b, backend, device=None) -> tuple:
    """The two-way merge on the device (the MERGE_STATES kernel), natural-log lse."""
    _check_two(out_a, lse_a, out_b, lse_b)
    query_type = storage_type("out_a", out_a, QUERY_TYPES)
    shape = tuple(out_a.shape)
    device = device_of(out_a, lse_a, out_b, lse_b, device=device)
    backend = backend_name(backend)
    rows, head_size = int(np.prod(shape[:-1])), shape[-1]
    push = MERGE_STATES.pack_push(**{f.name: 0 for f in ATTENTION_PUSH}
                                  | dict(num_seqs=rows, head_size=head_size, scale=0.0, v_scale=0.0, softcap=0.0,
                                         q_type=q_type_code(query_type.tag)))
    if active_recording(device) is not None:
        require_device_arrays("merge_attention_states inside pagedvk.record()", out_a=out_a, lse_a=lse_a, out_b=out_b,
                              lse_b=lse_b)
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
            pipeline = modules.pipeline(device, MERGE_STATES, MERGE_STATES.key(backend, q=query_type.tag),
                                        constants=MERGE_STATES.q_type_constant(query_type.tag))
            grid = fold_grid(-(-rows * head_size // 4 // WG), device.info.max_workgroup_count)
            buffers = [a.buffer for a in inputs + results]
            dispatch("merge_attention_states", device, lambda: [(pipeline, buffers, push, grid)])
        if not isinstance(out_a, DeviceArray):
            return tuple(r.numpy() for r in results)
        handed, results = tuple(results), []
        return handed
    finally:
        for a in temporaries + results:
            a.close()
