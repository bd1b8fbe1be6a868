"""reshape_and_cache, copy_blocks and swap_blocks against numpy: every cache dtype and layout, both backends
for the kernel, caches split into segments, slots past the caches with checks off, and every rejected input."""

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.ops.layouts
from pagedvk.runtime import array
from pagedvk.ops import vllm
from pagedvk.testing import reference
from pagedvk.ops.layouts import CacheSpec
from pagedvk.dtypes import CACHE_TYPES
from support import assert_untouched, fenced, tiered

CACHE_DTYPES = [np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                       ml_dtypes.float8_e5m2)]
TOKEN_DTYPES = [np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16)]
BACKENDS = ["glsl", "wgsl"]
LAYOUTS = ["vllm", "nhd"]


def random_cache(rng, shape, dtype):
    """Random bytes (NaNs included): every slot the op must leave alone has a pattern it cannot write by chance."""
    return rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def spec(layout, dtype, num_blocks=6, num_kv_heads=2, head_size=64, block_size=16):
    return CacheSpec(layout, CACHE_TYPES[np.dtype(dtype)], num_blocks, num_kv_heads, head_size, block_size)


def tokens(rng, s, num_tokens, dtype, magnitude=1.0):
    shape = (num_tokens, s.num_kv_heads, s.head_size)
    return ((rng.standard_normal(shape) * magnitude).astype(dtype), (rng.standard_normal(shape) * magnitude).astype(dtype))


def slots(rng, s, num_tokens, padding=3, dtype=np.int64):
    """Distinct slots, most of them beside another (tokens sharing the 32-bit words of vLLM's value layout),
    with `padding` of them -1."""
    out = rng.permutation(s.num_blocks * s.block_size)[:num_tokens].astype(dtype)
    out[rng.choice(num_tokens, padding, replace=False)] = -1
    return out


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    bad = np.flatnonzero(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8))
    assert bad.size == 0, f"{bad.size} bytes differ, first at byte {bad[0]}"


# Default tier: every backend, layout and cache type at 16-token blocks, and FlashInfer's HND at 16 and at 1.
@pytest.mark.parametrize("backend,layout,cache_dtype,block_size", tiered(
    [(b, layout, str(d), bs) for b in BACKENDS for layout in LAYOUTS + ["hnd"] for d in CACHE_DTYPES
     for bs in (1, 2, 4, 16) if bs in pagedvk.ops.layouts.block_sizes(layout)],
    default=[(b, layout, str(d), 16) for b in BACKENDS for layout in LAYOUTS for d in CACHE_DTYPES]
    + [("glsl", "hnd", "float16", 1), ("wgsl", "hnd", "float8_e4m3fn", 1), ("wgsl", "hnd", "bfloat16", 16),
       ("glsl", "hnd", "float8_e5m2", 16)]))
def test_reshape_and_cache(rng, device, backend, layout, cache_dtype, block_size):
    cache_dtype = np.dtype(cache_dtype)
    s = spec(layout, cache_dtype, num_blocks=96 // block_size, block_size=block_size)   # 96 slots
    token_dtype = TOKEN_DTYPES[CACHE_DTYPES.index(cache_dtype) % 3]
    fp8 = cache_dtype.itemsize == 1
    # fp8 values reach past the type's range (448 for e4m3): the saturation is checked too.
    key, value = tokens(rng, s, 70, token_dtype, magnitude=300.0 if fp8 else 1.0)
    slot_mapping = slots(rng, s, 70, dtype=np.int64 if layout == "vllm" else np.int32)
    k_scale, v_scale = (0.37, 1.9) if fp8 else (1.0, 1.0)
    kc, vc = random_cache(rng, s.key_shape, cache_dtype), random_cache(rng, s.value_shape, cache_dtype)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping, layout, k_scale, v_scale)
    dk, dv = pagedvk.asarray(kc, device), pagedvk.asarray(vc, device)
    pagedvk.reshape_and_cache(key, value, dk, dv, slot_mapping, k_scale=k_scale, v_scale=v_scale, layout=layout,
                              backend=backend)
    same_bits(dk.numpy(), ref_k)
    same_bits(dv.numpy(), ref_v)
    if fp8:
        assert (np.abs(ref_k.astype(np.float32)) == float(ml_dtypes.finfo(cache_dtype).max)).any()


@pytest.mark.parametrize("kv_cache_dtype,fp8", [("fp8", ml_dtypes.float8_e4m3fn), ("fp8_e4m3", ml_dtypes.float8_e4m3fn),
                                                ("fp8_e5m2", ml_dtypes.float8_e5m2)])
@pytest.mark.parametrize("spelling,layout", [(vllm.reshape_and_cache, "vllm"), (vllm.reshape_and_cache_flash, "nhd")])
def test_vllm_spellings_uint8_fp8(rng, device, kv_cache_dtype, fp8, spelling, layout):
    s = spec(layout, fp8)
    key, value = tokens(rng, s, 40, np.float16, magnitude=4.0)
    slot_mapping = slots(rng, s, 40)
    kc = random_cache(rng, s.key_shape, np.uint8)
    vc = random_cache(rng, s.value_shape, np.uint8)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping, layout, 0.5, 0.25, dtype=fp8)
    dk, dv = pagedvk.asarray(kc, device), pagedvk.asarray(vc, device)
    spelling(key, value, dk, dv, slot_mapping, kv_cache_dtype, 0.5, 0.25)
    same_bits(dk.numpy(), ref_k)
    same_bits(dv.numpy(), ref_v)


def test_numpy_caches_are_updated_in_place(rng, device):
    s = spec("vllm", np.float16)
    key, value = tokens(rng, s, 20, np.float32)
    slot_mapping = slots(rng, s, 20)
    kc, vc = random_cache(rng, s.key_shape, np.float16), random_cache(rng, s.value_shape, np.float16)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    pagedvk.reshape_and_cache(key, value, kc, vc, slot_mapping)
    same_bits(kc, ref_k)
    same_bits(vc, ref_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv_slices_into_a_combined_kv_cache(rng, device, backend):
    # vLLM passes key and value as slices of the fused QKV projection (strided rows); FlashInfer-style engines hold
    # one cache [num_blocks, 2, ...] and pass its [:, 0] and [:, 1] views (here HND with 1-token pages). Both are
    # taken, and the caches are updated through the caller's views: the combined array itself changes.
    s = spec("hnd", np.float16, num_blocks=32, block_size=1)
    q_size, kv_size = 4 * s.head_size, s.num_kv_heads * s.head_size
    qkv = rng.standard_normal((20, q_size + 2 * kv_size)).astype(np.float16)
    key = qkv[:, q_size:q_size + kv_size].reshape(20, s.num_kv_heads, s.head_size)
    value = qkv[:, q_size + kv_size:].reshape(20, s.num_kv_heads, s.head_size)
    assert not key.flags.c_contiguous and np.shares_memory(key, qkv)
    kv = random_cache(rng, (s.num_blocks, 2) + s.key_shape[1:], np.float16)
    slot_mapping = slots(rng, s, 20, dtype=np.int32)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slot_mapping, "hnd")
    pagedvk.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slot_mapping, layout="hnd", backend=backend)
    same_bits(kv[:, 0], ref_k)
    same_bits(kv[:, 1], ref_v)


def test_copy_and_swap_blocks_through_views_of_a_combined_cache(rng, device):
    s = spec("nhd", np.float32, num_blocks=10, block_size=2)
    kv = random_cache(rng, (10, 2) + s.key_shape[1:], np.float32)
    before = kv.copy()
    mapping = np.array([[1, 7], [4, 0]])
    pagedvk.copy_blocks([kv[:, 0]], [kv[:, 1]], mapping)
    want = before.copy()
    want[mapping[:, 1]] = before[mapping[:, 0]]
    same_bits(kv, want)
    # swapped out into, and back in from, the key half of a combined host array
    device_k = pagedvk.asarray(kv[:, 0], device)
    host = np.full((4, 2) + s.key_shape[1:], np.nan, np.float32)
    pagedvk.swap_blocks(device_k, host[:, 0], np.array([[7, 2], [3, 0]]))
    same_bits(host[[2, 0], 0], kv[[7, 3], 0])
    assert np.isnan(host[:, 1]).all() and np.isnan(host[[1, 3], 0]).all()
    pagedvk.swap_blocks(host[:, 0], device_k, np.array([[2, 5]]))
    want_k = kv[:, 0].copy()
    want_k[5] = host[2, 0]
    same_bits(device_k.numpy(), want_k)


@pytest.mark.parametrize("backend,addressed", [("glsl", False), ("glsl", True), ("wgsl", False)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache_segmented(rng, device, monkeypatch, backend, addressed, layout):
    s = spec(layout, np.float16, num_blocks=12)
    if addressed and not device.buffer_device_address:
        pytest.fail(f"{device.info.name} has no bufferDeviceAddress: this test needs it")
    monkeypatch.setattr(array, "segment_limit", lambda device: 4 * s.block_bytes)   # 3 segments of 4 blocks
    monkeypatch.setattr(device, "buffer_device_address", addressed)
    key, value = tokens(rng, s, 60, ml_dtypes.bfloat16)   # one binding each (16 KiB)
    slot_mapping = slots(rng, s, 60)
    kc, vc = random_cache(rng, s.key_shape, np.float16), random_cache(rng, s.value_shape, np.float16)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping, layout)
    dk, dv = pagedvk.asarray(kc, device), pagedvk.asarray(vc, device)
    assert len(dk.buffers) == 3
    pagedvk.reshape_and_cache(key, value, dk, dv, slot_mapping, layout=layout, backend=backend)
    same_bits(dk.numpy(), ref_k)
    same_bits(dv.numpy(), ref_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [np.float32, ml_dtypes.float8_e5m2], ids=str)
def test_unchecked_slots_past_the_caches_are_skipped(rng, device, backend, cache_dtype):
    s = spec("vllm", cache_dtype)
    capacity = s.num_blocks * s.block_size
    key, value = tokens(rng, s, 30, np.float32)
    slot_mapping = slots(rng, s, 30)
    slot_mapping[:6] = [capacity, capacity + 1, capacity + 17, 2 ** 31 - 1, 2 ** 32 + 5, 2 ** 40]
    kc, vc = random_cache(rng, s.key_shape, cache_dtype), random_cache(rng, s.value_shape, cache_dtype)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    (dk, dv), guards = fenced(device, kc, vc)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 96 is outside the caches"):
        pagedvk.reshape_and_cache(key, value, dk, dv, slot_mapping, backend=backend)
    same_bits(dk.numpy(), kc)   # nothing written
    pagedvk.reshape_and_cache(key, value, dk, dv, slot_mapping, backend=backend, validate=False)
    same_bits(dk.numpy(), ref_k)
    same_bits(dv.numpy(), ref_v)
    assert_untouched(*guards)


def bad_arguments(s, key, value, kc, vc, slot_mapping):
    """(what is changed, keyword arguments, error type, message pattern)."""
    num_tokens = len(key)
    return [
        ("key kind", dict(key=key.tolist()), TypeError, "key must be a numpy array"),
        ("key ndim", dict(key=key[0]), ValueError, r"key must have 3 dimensions"),
        ("key dtype", dict(key=key.astype(np.float64), value=value.astype(np.float64)), TypeError, "key must have dtype"),
        ("value dtype", dict(value=value.astype(np.float16)), TypeError, "value must have dtype float32"),
        ("value shape", dict(value=value[:-1]), ValueError, r"value must have shape"),
        ("heads", dict(key=key[:, :1].copy(), value=value[:, :1].copy()), ValueError, r"key.shape\[1\] \(num_kv_heads"),
        ("head size", dict(key=key[:, :, :32].copy(), value=value[:, :, :32].copy()), ValueError,
         r"key.shape\[2\] \(head_size"),
        ("cache dtype", dict(key_cache=np.zeros(kc.shape)), TypeError, "key_cache must have dtype"),
        ("value cache dtype", dict(value_cache=np.zeros(vc.shape, np.float16)), TypeError, "value_cache must have dtype"),
        ("layout", dict(layout="HND"), ValueError, "layout must be one of"),
        ("nhd shapes", dict(layout="nhd"), ValueError, "key_cache must have 4 dimensions"),
        ("kv_cache_dtype", dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be"),
        ("fp8 on float caches", dict(kv_cache_dtype="fp8"), TypeError, "key_cache must be uint8"),
        ("slot dtype", dict(slot_mapping=slot_mapping.astype(np.float32)), TypeError, "slot_mapping must have dtype"),
        ("slot length", dict(slot_mapping=slot_mapping[:-1]), ValueError, r"slot_mapping.shape\[0\] \(num_tokens"),
        ("slot ndim", dict(slot_mapping=slot_mapping[None]), ValueError, "slot_mapping must have 1 dimensions"),
        ("slot range", dict(slot_mapping=np.where(np.arange(num_tokens) == 3, s.num_blocks * s.block_size,
                                                  slot_mapping)), ValueError, r"slot_mapping\[3\] = 96 is outside"),
        ("k_scale", dict(k_scale=0.0), ValueError, "k_scale must be one positive finite number"),
        ("v_scale", dict(v_scale=float("nan")), ValueError, "v_scale must be one positive finite number"),
        ("backend", dict(backend="cuda"), ValueError, "backend must be one of"),
    ]


@pytest.mark.parametrize("case", range(20))
def test_rejected_inputs_write_nothing(rng, device, case):
    s = spec("vllm", np.float32)
    key, value = tokens(rng, s, 10, np.float32)
    slot_mapping = slots(rng, s, 10, padding=1)
    kc, vc = random_cache(rng, s.key_shape, np.float32), random_cache(rng, s.value_shape, np.float32)
    dk, dv = pagedvk.asarray(kc, device), pagedvk.asarray(vc, device)
    bad = bad_arguments(s, key, value, kc, vc, slot_mapping)
    assert len(bad) == 20
    what, changes, error, pattern = bad[case]
    args = dict(key=key, value=value, key_cache=dk, value_cache=dv, slot_mapping=slot_mapping)
    args.update(changes)
    with pytest.raises(error, match=pattern):
        pagedvk.reshape_and_cache(**args)
    same_bits(dk.numpy(), kc)
    same_bits(dv.numpy(), vc)


# -- copy_blocks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_copy_blocks(rng, device, layout, cache_dtype):
    s = spec(layout, cache_dtype, num_blocks=10)
    hosts = [(random_cache(rng, s.key_shape, cache_dtype), random_cache(rng, s.value_shape, cache_dtype))
             for _ in range(3)]
    mapping = np.array([[1, 7], [1, 8], [4, 0], [9, 2]], np.int64 if layout == "vllm" else np.int32)
    keys = [pagedvk.asarray(k, device) for k, _ in hosts]
    values = [pagedvk.asarray(v, device) for _, v in hosts]
    pagedvk.copy_blocks(keys, values, mapping)
    for (k, v), dk, dv in zip(hosts, keys, values):
        for host, dev in ((k, dk), (v, dv)):
            want = host.copy()
            want[mapping[:, 1]] = host[mapping[:, 0]]
            same_bits(dev.numpy(), want)


def test_copy_blocks_segmented(rng, device, monkeypatch):
    s = spec("nhd", np.float16, num_blocks=12)
    monkeypatch.setattr(array, "segment_limit", lambda device: 5 * s.block_bytes)
    k, v = random_cache(rng, s.key_shape, np.float16), random_cache(rng, s.value_shape, np.float16)
    dk, dv = pagedvk.asarray(k, device), pagedvk.asarray(v, device)
    assert len(dk.buffers) == 3
    mapping = np.array([[0, 11], [11, 3], [6, 5], [10, 9]])[[0, 2, 3]]   # across segments both ways
    pagedvk.copy_blocks([dk], [dv], mapping)
    for host, dev in ((k, dk), (v, dv)):
        want = host.copy()
        want[mapping[:, 1]] = host[mapping[:, 0]]
        same_bits(dev.numpy(), want)


@pytest.mark.parametrize("changes,error,pattern", [
    (dict(block_mapping=np.array([[0, 10]])), ValueError, r"block_mapping\[0, 1\] = 10 is outside \[0, 10\)"),
    (dict(block_mapping=np.array([[-1, 2]])), ValueError, r"block_mapping\[0, 0\] = -1 is outside"),
    (dict(block_mapping=np.array([[1, 2], [3, 2]])), ValueError, "writes block 2 more than once"),
    (dict(block_mapping=np.array([[1, 2], [2, 3]])), ValueError, r"block_mapping\[0, 1\] = 2 is also a source"),
    (dict(block_mapping=np.array([[1.0, 2.0]])), TypeError, "block_mapping must have dtype"),
    (dict(block_mapping=np.array([1, 2])), ValueError, "block_mapping must have 2 dimensions"),
    (dict(block_mapping=np.array([[1, 2, 3]])), ValueError, r"block_mapping.shape\[1\] \(\(src, dst\)\) must be 2"),
    (dict(value_caches=[]), ValueError, "value_caches must hold one cache per layer"),
    (dict(key_caches="k"), TypeError, "key_caches must be a list"),
    (dict(key_caches=[np.broadcast_to(np.zeros(4), (10, 4))]), ValueError, r"key_caches\[0\] must be writable"),
    (dict(value_caches=["short"]), TypeError, r"value_caches\[0\] must be a numpy array or a pagedvk.DeviceArray"),
])
def test_copy_blocks_rejects(rng, device, changes, error, pattern):
    s = spec("nhd", np.float32, num_blocks=10)
    k, v = random_cache(rng, s.key_shape, np.float32), random_cache(rng, s.value_shape, np.float32)
    dk, dv = pagedvk.asarray(k, device), pagedvk.asarray(v, device)
    args = dict(key_caches=[dk], value_caches=[dv], block_mapping=np.array([[1, 2]]))
    args.update(changes)
    with pytest.raises(error, match=pattern):
        pagedvk.copy_blocks(**args)
    same_bits(dk.numpy(), k)
    same_bits(dv.numpy(), v)


def test_copy_blocks_num_blocks_must_agree(rng, device):
    a, b = pagedvk.asarray(random_cache(rng, (10, 4), np.float32), device), pagedvk.zeros((9, 4), device=device)
    with pytest.raises(ValueError, match=r"value_caches\[0\].shape\[0\] \(num_blocks\) must be 10"):
        pagedvk.copy_blocks([a], [b], np.array([[1, 2]]))


# -- swap_blocks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_swap_out_and_in(rng, device, cache_dtype):
    s = spec("vllm", cache_dtype, num_blocks=10)
    cache = random_cache(rng, s.value_shape, cache_dtype)
    device_cache = pagedvk.asarray(cache, device)
    host = random_cache(rng, (4,) + s.value_shape[1:], cache_dtype)
    host_before = host.copy()
    out = np.array([[7, 2], [3, 0]], np.int32)
    pagedvk.swap_blocks(device_cache, host, out)
    want = host_before.copy()
    want[out[:, 1]] = cache[out[:, 0]]
    same_bits(host, want)
    back = np.array([[2, 1], [0, 9], [1, 4]], np.int64)   # host block 1 holds random bytes: swapped in as they are
    pagedvk.swap_blocks(host, device_cache, back)
    want_device = cache.copy()
    want_device[back[:, 1]] = host[back[:, 0]]
    same_bits(device_cache.numpy(), want_device)


def test_swap_between_device_arrays_and_segments(rng, device, monkeypatch):
    s = spec("nhd", np.float32, num_blocks=12)
    monkeypatch.setattr(array, "segment_limit", lambda device: 5 * s.block_bytes)
    a, b = random_cache(rng, s.key_shape, np.float32), random_cache(rng, s.key_shape, np.float32)
    da, db = pagedvk.asarray(a, device), pagedvk.asarray(b, device)
    assert len(da.buffers) == 3
    mapping = np.array([[0, 11], [11, 0], [6, 5]])
    pagedvk.swap_blocks(da, db, mapping)
    want = b.copy()
    want[mapping[:, 1]] = a[mapping[:, 0]]
    same_bits(db.numpy(), want)
    host = np.full((3,) + s.key_shape[1:], np.nan, np.float32)
    pagedvk.swap_blocks(db, host, np.array([[11, 0], [5, 1], [4, 2]]))
    same_bits(host, want[[11, 5, 4]])


@pytest.mark.parametrize("changes,error,pattern", [
    (dict(dst=np.zeros((4, 2, 16, 64), np.float16)), TypeError, "dst must have dtype float32"),
    (dict(dst=np.zeros((4, 2, 16, 32), np.float32)), ValueError, r"dst's blocks must have src's shape"),
    (dict(block_mapping=np.array([[10, 0]])), ValueError, r"block_mapping\[0, 0\] = 10 is outside \[0, 10\)"),
    (dict(block_mapping=np.array([[1, 4]])), ValueError, r"block_mapping\[0, 1\] = 4 is outside \[0, 4\)"),
    (dict(block_mapping=np.array([[1, 0], [2, 0]])), ValueError, "writes block 0 of dst more than once"),
    (dict(block_mapping=np.array([[1, 0]], np.uint8)), TypeError, "block_mapping must have dtype"),
    (dict(src=np.zeros((10, 2, 16, 64), np.float32)), TypeError, "src or dst must be a pagedvk.DeviceArray"),
    (dict(dst=[0]), TypeError, "dst must be a numpy array"),
])
def test_swap_blocks_rejects(rng, device, changes, error, pattern):
    s = spec("vllm", np.float32, num_blocks=10)
    cache = random_cache(rng, s.value_shape, np.float32)
    src = pagedvk.asarray(cache, device)
    dst = np.full((4,) + s.value_shape[1:], np.nan, np.float32)
    args = dict(src=src, dst=dst, block_mapping=np.array([[1, 0]]))
    args.update(changes)
    with pytest.raises(error, match=pattern):
        pagedvk.swap_blocks(**args)
    assert np.isnan(dst).all()
    same_bits(src.numpy(), cache)
