"""The cache ops engines run between attention calls (vLLM's cache_kernels): write new tokens' keys and
values into their slots (reshape_and_cache), copy blocks within the caches of every layer (copy_blocks, for
copy-on-write) and move blocks between device and host memory (swap_blocks, for preemption).

reshape_and_cache is a kernel (shaders/reshape_and_cache.comp, .wgsl); the other two are buffer copies of
whole blocks, recorded into one submission per call.
"""

from __future__ import annotations

import numpy as np

from .. import config
from ..dtypes import QUERY_TYPES, fp8_scale, storage_type
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import RESHAPE_AND_CACHE
from ..runtime.array import Array, DeviceArray, asarray
from ..runtime.pipeline import fold_grid
from ..runtime.recording import (active_recording, array_signature, dispatch, kept_launches, refuse_recording,
                                 require_device_arrays)
from . import checks
from .layouts import bind_caches, cache_spec
from .opargs import backend_name, device_of

SLOT_DTYPES = (np.int32, np.int64)
ID_DTYPES = (np.int32, np.int64)
WORKGROUP = RESHAPE_AND_CACHE.workgroup_size[0]


def reshape_and_cache(key: Array, value: Array, key_cache: Array, value_cache: Array, slot_mapping: Array,
                      kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0, layout: str = "vllm",
                      *, backend: str | None = None, validate: bool = True) -> None:
    """Write each token's key and value into the cache slot `slot_mapping` gives it, in place (vLLM's).

    Parameters
    ----------
    key, value : DeviceArray or numpy.ndarray, shape (num_tokens, num_kv_heads, head_size)
        float32, float16 or bfloat16, one dtype; numpy and DeviceArray ones may be strided views (vLLM's key and
        value slices of a fused QKV tensor: ``qkv[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads,
        head_size)``), read where they are, at their row pitch.
    key_cache, value_cache : DeviceArray or numpy.ndarray
        Layout "vllm": key_cache (num_blocks, num_kv_heads, head_size // x, block_size, x) and value_cache
        (num_blocks, num_kv_heads, head_size, block_size); "nhd": (num_blocks, block_size, num_kv_heads,
        head_size) both; "hnd": (num_blocks, num_kv_heads, block_size, head_size) both (pagedvk.ops.layouts).
        float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, or uint8 with vLLM's kv_cache_dtype "fp8" /
        "fp8_e4m3" / "fp8_e5m2". DeviceArrays are written on the device; numpy caches are updated in place (a
        round trip), through the caller's view where they are one (kv[:, 0] and kv[:, 1] of one combined array).
    slot_mapping : DeviceArray, numpy.ndarray or sequence of ints, shape (num_tokens,), int32 or int64
        slot = block * block_size + offset; negative slots are padding and skipped.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}, default "auto"
        How uint8 caches are read (vLLM's names); "auto" takes the caches' own dtype.
    k_scale, v_scale : float, default 1.0
        fp8 caches store key / k_scale and value / v_scale, rounded to nearest even and saturated to the type's
        largest finite value (vLLM's __NV_SATFINITE); other caches store the values converted to their type (round
        to nearest even) and ignore the scales.
    layout : {"vllm", "nhd", "hnd"}, default "vllm"
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        False skips the check that every slot is below num_blocks * block_size: the kernel skips such slots
        itself, so nothing outside the caches is written.

    Raises
    ------
    ValueError, TypeError
        A bad argument, or (validate) a slot outside the caches.

    Examples
    --------
    >>> pagedvk.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    """
    # An engine's per-layer call repeats one signature every step: device arrays, unvalidated slots. Its launch is
    # kept, and a call with the signature it was recorded for (which passed the checks below) is queued at once.
    signature = None
    if validate is False:
        signature = array_signature((key, value, key_cache, value_cache, slot_mapping),
                                    ("reshape_and_cache", kv_cache_dtype, k_scale, v_scale, layout,
                                     backend if backend is not None else config.backend()))
        if (signature is not None and active_recording(key.device) is None
                and kept_launches(key.device).enqueue_kept(signature)):
            return
    for name, a in (("key", key), ("value", value)):
        checks.kind(name, a, strided=True)
        checks.ndim(name, a, 3, "[num_tokens, num_kv_heads, head_size]")
    token_type = storage_type("key", key, QUERY_TYPES)
    if value.dtype != key.dtype:
        raise TypeError(f"value must have dtype {key.dtype} (key's), got {value.dtype}")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value must have shape {tuple(key.shape)} (key's), got {tuple(value.shape)}")
    spec = cache_spec(key_cache, value_cache, layout, kv_cache_dtype)
    checks.writable("key_cache", key_cache)
    checks.writable("value_cache", value_cache)
    checks.dim("key", key, 1, spec.num_kv_heads, "num_kv_heads, from the caches")
    checks.dim("key", key, 2, spec.head_size, "head_size, from the caches")
    num_tokens = key.shape[0]
    slot_mapping = checks.ints("slot_mapping", slot_mapping)
    checks.kind("slot_mapping", slot_mapping)
    checks.ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    checks.dim("slot_mapping", slot_mapping, 0, num_tokens, "num_tokens, from key")
    k_scale, v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
    row = spec.num_kv_heads * spec.head_size
    pitches = {name: checks.token_pitch(a, row) for name, a in (("key", key), ("value", value))}
    if num_tokens * row >= 2 ** 32 or max(num_tokens - 1, 0) * max(pitches.values()) + row >= 2 ** 32:
        raise ValueError(f"key has {num_tokens} tokens of {spec.num_kv_heads} x {spec.head_size} elements, more than "
                         f"2^32 elements in all (counted at the rows' pitch): write them in several calls")
    if validate:
        check_slots(slot_mapping, spec)
    name = backend_name(backend)
    device = device_of(key, value, key_cache, value_cache, slot_mapping)
    if active_recording(device) is not None:
        require_device_arrays("reshape_and_cache inside pagedvk.record()", key=key, value=value, key_cache=key_cache,
                              value_cache=value_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return

    temporaries = []
    try:
        def on_device(a):
            d = asarray(a, device=device)
            if d is not a:
                temporaries.append(d)
            return d

        arrays = {n: on_device(a) for n, a in (("key", key), ("value", value), ("slot_mapping", slot_mapping),
                                               ("key_cache", key_cache), ("value_cache", value_cache))}
        caches = bind_caches(arrays["key_cache"], arrays["value_cache"], name)
        strides = spec.strides()
        # The layouts module gives key strides in quads of 4 elements (the attention kernels read 4 at a time);
        # this kernel writes single elements.
        element_strides = {k: v * 4 if k.startswith("k_") else v for k, v in strides.items()}
        push = RESHAPE_AND_CACHE.pack_push(
            num_tokens=num_tokens, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            block_size=spec.block_size, num_blocks=spec.blocks_held(caches.key_bytes, caches.value_bytes),
            slot_words=np.dtype(slot_mapping.dtype).itemsize // 4, k_scale=k_scale, v_scale=v_scale,
            blocks_per_segment=caches.blocks_per_segment, token_type=q_type_code(token_type.tag),
            key_pitch=pitches["key"], value_pitch=pitches["value"], **element_strides)
        module = RESHAPE_AND_CACHE.key(name, spec.storage.tag, token_type.tag, access=caches.access)
        pipeline = modules.pipeline(device, RESHAPE_AND_CACHE, module)
        buffers = [arrays["key"].buffer, arrays["value"].buffer, arrays["slot_mapping"].buffer, caches.key,
                   caches.value, *caches.extra]
        elements = num_tokens * spec.num_kv_heads * spec.head_size
        grid = fold_grid(-(-elements // WORKGROUP), device.info.max_workgroup_count)
        dispatch("reshape_and_cache", device, lambda: [(pipeline, buffers, push, grid)], signature=signature)
        for host, dev in ((key_cache, arrays["key_cache"]), (value_cache, arrays["value_cache"])):
            if isinstance(host, np.ndarray):
                host[...] = dev.numpy().view(host.dtype)
    finally:
        for a in temporaries:
            a.close()


def check_slots(slot_mapping: Array, spec) -> None:
    """ValueError naming the first slot at or past the caches' num_blocks x block_size (reads device slots back)."""
    capacity = spec.num_blocks * spec.block_size
    slots = checks.host(slot_mapping)
    bad = np.flatnonzero(slots >= capacity)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside the caches: slots must be below "
                         f"num_blocks x block_size = {spec.num_blocks} x {spec.block_size} = {capacity} "
                         "(negative slots are padding)")


def _block_ids(block_mapping, name: str = "block_mapping") -> np.ndarray:
    """block_mapping int32 or int64 [n, 2] (src, dst) pairs (or a sequence of pairs), as a host int64 array."""
    block_mapping = checks.ints(name, block_mapping)
    checks.kind(name, block_mapping)
    checks.ndim(name, block_mapping, 2, "[num_pairs, 2] (src, dst)")
    checks.dtype(name, block_mapping, ID_DTYPES)
    checks.dim(name, block_mapping, 1, 2, "(src, dst)")
    return np.asarray(checks.host(block_mapping), np.int64)


def _ids_within(pairs: np.ndarray, column: int, num_blocks: int, what: str) -> None:
    bad = np.flatnonzero((pairs[:, column] < 0) | (pairs[:, column] >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"block_mapping[{i}, {column}] = {int(pairs[i, column])} is outside [0, {num_blocks}) "
                         f"(the blocks of {what})")


def _block_places(a: DeviceArray, ids) -> list:
    """(buffer, byte offset) of each block (row of axis 0) of a device array, segments respected."""
    row = a.nbytes // a.shape[0]
    buffers, per = a.buffers, a.segment_rows
    return [(buffers[b // per], (b % per) * row) for b in map(int, ids)]


def _grouped(copies) -> list:
    """(src, dst, region) triples as copy_regions wants them: one entry, so one vkCmdCopyBuffer, per buffer pair."""
    groups = {}
    for src, dst, region in copies:
        groups.setdefault((id(src), id(dst)), (src, dst, []))[2].append(region)
    return list(groups.values())


def copy_blocks(key_caches: list[Array] | tuple[Array, ...], value_caches: list[Array] | tuple[Array, ...],
                block_mapping: Array) -> None:
    """Copy blocks within each layer's caches, every layer in one submission (vLLM's copy_blocks).

    Parameters
    ----------
    key_caches, value_caches : list or tuple of DeviceArray or numpy.ndarray
        One cache per layer, any layout and dtype, all with the same num_blocks (shape[0]): DeviceArrays (on one
        device), copied on it in one submission, or numpy arrays (writable; views of a larger array too), copied
        in place on the host, as vLLM's CPU backend does.
    block_mapping : DeviceArray, numpy.ndarray or sequence of ints, shape (num_pairs, 2), int32 or int64
        (src, dst) rows: block src is copied to block dst in every cache. No block may be written twice, nor
        written and read in one call (the copies run at once).

    Raises
    ------
    ValueError, TypeError
        Caches of differing num_blocks, ids outside the caches, or a block written twice or written and read.

    Examples
    --------
    >>> pagedvk.copy_blocks([k0, k1], [v0, v1], np.array([[3, 7]]))   # block 3 -> block 7 in both layers
    """
    for name, seq in (("key_caches", key_caches), ("value_caches", value_caches)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{name} must be a list of caches (one per layer), not {type(seq).__name__}")
        for i, a in enumerate(seq):
            checks.kind(f"{name}[{i}]", a)
            checks.writable(f"{name}[{i}]", a)
            if len(a.shape) < 2:
                raise ValueError(f"{name}[{i}] must have a block axis and more, got shape {tuple(a.shape)}")
    if len(key_caches) != len(value_caches):
        raise ValueError(f"value_caches must hold one cache per layer as key_caches ({len(key_caches)}), "
                         f"got {len(value_caches)}")
    caches = list(key_caches) + list(value_caches)
    pairs = _block_ids(block_mapping)
    if not caches or not len(pairs):
        return
    num_blocks = caches[0].shape[0]
    for name, seq in (("key_caches", key_caches), ("value_caches", value_caches)):
        for i, a in enumerate(seq):
            if a.shape[0] != num_blocks:
                raise ValueError(f"{name}[{i}].shape[0] (num_blocks) must be {num_blocks} (key_caches[0]'s), "
                                 f"got {a.shape[0]}")
    on_device = [a for a in caches if isinstance(a, DeviceArray)]
    device = device_of(*on_device) if on_device else None
    if device is not None:
        refuse_recording("copy_blocks", device)
    _ids_within(pairs, 0, num_blocks, "the caches")
    _ids_within(pairs, 1, num_blocks, "the caches")
    _distinct_targets(pairs)
    for a in caches:
        if isinstance(a, np.ndarray):   # no target is a source: one gather-scatter is the simultaneous copies
            a[pairs[:, 1]] = a[pairs[:, 0]]
    copies = []
    for a in on_device:
        row = a.nbytes // num_blocks
        for (src, s_off), (dst, d_off) in zip(_block_places(a, pairs[:, 0]), _block_places(a, pairs[:, 1])):
            copies.append((src, dst, (s_off, d_off, row)))
    if copies:
        device.copy_regions(_grouped(copies))


def _distinct_targets(pairs: np.ndarray) -> None:
    dst = pairs[:, 1]
    values, first, counts = np.unique(dst, return_index=True, return_counts=True)
    if (counts > 1).any():
        b = int(values[counts > 1][0])
        raise ValueError(f"block_mapping writes block {b} more than once (rows {np.flatnonzero(dst == b).tolist()})")
    read = np.flatnonzero(np.isin(dst, pairs[:, 0]))
    if read.size:
        i = int(read[0])
        raise ValueError(f"block_mapping[{i}, 1] = {int(dst[i])} is also a source block: a block may not be written "
                         "and read in one call")


def swap_blocks(src: Array, dst: Array, block_mapping: Array) -> None:
    """Copy blocks between device and host memory, one submission a call (vLLM's swap_blocks, for preemption).

    Parameters
    ----------
    src, dst : DeviceArray or numpy.ndarray
        A DeviceArray and a numpy array (either way round), or two DeviceArrays; the same dtype and block shape
        (shape[1:]). A numpy dst must be writable, and is written in place (through the caller's view where it is
        one).
    block_mapping : DeviceArray, numpy.ndarray or sequence of ints, shape (num_pairs, 2), int32 or int64
        block_mapping[i] = (a block of src, a block of dst); a dst block may be written once per call.

    Raises
    ------
    TypeError
        Neither array is a DeviceArray, or their dtypes differ.
    ValueError
        Block shapes differ, ids are out of range, or a dst block is written twice.

    Examples
    --------
    >>> host = np.empty(key_cache.shape, key_cache.dtype)
    >>> pagedvk.swap_blocks(key_cache, host, np.array([[3, 0], [5, 1]]))   # swap out blocks 3 and 5
    """
    for name, a in (("src", src), ("dst", dst)):
        checks.kind(name, a)
        if len(a.shape) < 2:
            raise ValueError(f"{name} must have a block axis and more, got shape {tuple(a.shape)}")
    if not (isinstance(src, DeviceArray) or isinstance(dst, DeviceArray)):
        raise TypeError("swap_blocks copies to or from the device: src or dst must be a pagedvk.DeviceArray "
                        "(both numpy arrays: use numpy)")
    if np.dtype(dst.dtype) != np.dtype(src.dtype):
        raise TypeError(f"dst must have dtype {src.dtype} (src's), got {dst.dtype}")
    if tuple(dst.shape[1:]) != tuple(src.shape[1:]):
        raise ValueError(f"dst's blocks must have src's shape {tuple(src.shape[1:])} (shape[1:]), "
                         f"got {tuple(dst.shape[1:])}")
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise ValueError("dst must be writable")
    pairs = _block_ids(block_mapping)
    _ids_within(pairs, 0, src.shape[0], "src")
    _ids_within(pairs, 1, dst.shape[0], "dst")
    values, counts = np.unique(pairs[:, 1], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"block_mapping writes block {int(values[counts > 1][0])} of dst more than once")
    device = device_of(src, dst)
    refuse_recording("swap_blocks", device)
    if not len(pairs):
        return
    row = src.nbytes // src.shape[0]
    if isinstance(src, DeviceArray) and isinstance(dst, DeviceArray):
        if src is dst and np.isin(pairs[:, 1], pairs[:, 0]).any():
            raise ValueError("block_mapping writes a block it also reads (src is dst)")
        device.copy_regions(_grouped((s, d, (so, do, row)) for (s, so), (d, do) in
                                     zip(_block_places(src, pairs[:, 0]), _block_places(dst, pairs[:, 1]))))
    elif isinstance(dst, np.ndarray):   # device -> host: gather into staging, then scatter on the host
        places = _block_places(src, pairs[:, 0])
        data = device.download_regions(len(pairs) * row, [(s, regions) for s, _, regions in _grouped(
            (s, None, (so, i * row, row)) for i, (s, so) in enumerate(places))])
        # Through dst's own indexing: reshaping a strided view (kv[:, 0]) would write a copy.
        dst[pairs[:, 1]] = data.view(dst.dtype).reshape((len(pairs),) + tuple(dst.shape[1:]))
    else:                               # host -> device
        data = np.ascontiguousarray(src).reshape(src.shape[0], -1).view(np.uint8)[pairs[:, 0]]
        places = _block_places(dst, pairs[:, 1])
        device.upload_regions(data, [(d, regions) for _, d, regions in _grouped(
            (None, d, (i * row, do, row)) for i, (d, do) in enumerate(places))])
