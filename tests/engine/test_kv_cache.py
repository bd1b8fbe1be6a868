"""pagedvk.KVCache: device caches, host swap space and the block manager together, and the demo served over it
on the device (every step's attention against float64, every sample's tokens against a dense run)."""

import io

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.testing.reference
from support import tiered
from pagedvk.demo.serve import demo


# Default tier: a float cache in vLLM's layout and a 16-bit one in hnd; each other cache type costs lavapipe about a
# minute of pipeline compiles cold (the ops' own tests cover every type and layout).
@pytest.mark.parametrize("dtype,layout", tiered(
    [(np.float32, "vllm"), (np.float16, "nhd"), (ml_dtypes.bfloat16, "vllm"), (ml_dtypes.float8_e4m3fn, "nhd"),
     (ml_dtypes.float8_e5m2, "vllm"), (ml_dtypes.float8_e5m2, "nhd"), (np.float16, "hnd")],
    default=[(np.float32, "vllm"), (np.float16, "hnd")]))
def test_demo_on_the_device_matches_float64(dtype, layout):
    out = io.StringIO()
    assert demo(requests=10, num_blocks=20, block_size=8, check=True, dtype=np.dtype(dtype).name, layout=layout,
                out=out, progress=io.StringIO()) == 0
    text = out.getvalue()
    assert "every sample's tokens equal the dense reference's" in text
    assert "preemptions 0" not in text and "forks 0" not in text and "prefix hits 0" not in text


def test_cache_sized_by_a_fraction_of_the_memory_budget(device):
    budget = device.memory_budget()
    free = budget.budget - (budget.usage or 0)
    with pagedvk.KVCache(2, 2, 64, block_size=16, dtype=np.float16, memory_fraction=0.001) as cache:
        block_bytes = 2 * 64 * 16 * 2
        assert cache.num_blocks == int(0.001 * free) // (2 * 2 * block_bytes) > 0
        assert cache.key[0].shape == (cache.num_blocks, 2, 8, 16, 8)
        assert cache.blocks.num_free_blocks == cache.num_blocks
    assert cache.closed


@pytest.mark.parametrize("layout,block_size", [("vllm", 8), ("hnd", 1)])   # and FlashInfer's 1-token pages
def test_block_tables_feed_decode(rng, layout, block_size):
    # Sequences added through the manager, written with reshape_and_cache, read back by decode over the
    # manager's own block tables.
    with pagedvk.KVCache(1, 2, 32, block_size=block_size, dtype=np.float16, num_blocks=80 // block_size,
                         layout=layout) as cache:
        lens = [13, 20]
        keys = [rng.standard_normal((n, 2, 32)).astype(np.float32) for n in lens]
        values = [rng.standard_normal((n, 2, 32)).astype(np.float32) for n in lens]
        for s, n in enumerate(lens):
            w = cache.blocks.add_sequence(s, list(range(100 * s, 100 * s + n)))
            cache.write(0, keys[s], values[s], w.slots)
        tables, seq_lens = cache.blocks.block_tables([0, 1])
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        out = pagedvk.paged_attention(q, cache.key[0], cache.value[0], tables, seq_lens, layout=layout)
    for s, n in enumerate(lens):
        k = keys[s].astype(np.float16).astype(np.float64)
        v = values[s].astype(np.float16).astype(np.float64)
        for h in range(4):
            logits = q[s, h] @ k[:, h // 2].T / np.sqrt(32)
            p = np.exp(logits - logits.max())
            ref = (p / p.sum()) @ v[:, h // 2]
            assert np.linalg.norm(out[s, h] - ref) / np.linalg.norm(ref) <= 1e-4


@pytest.mark.parametrize("layout", ["vllm", "nhd", "hnd"])
def test_decode_plan_takes_its_dims_from_the_cache(rng, layout):
    # cache.decode_plan: dims, dtype, layout, device and backend from the cache; poisoned outputs against float64,
    # then the same plan updated for the next step. A num_heads the cache's kv heads do not divide is refused by name.
    with pagedvk.KVCache(2, 2, 32, block_size=16, dtype=np.float16, num_blocks=6, layout=layout) as cache:
        for layer in range(2):
            for array in (cache.key[layer], cache.value[layer]):
                array.write(rng.standard_normal(array.shape).astype(np.float16))
        tables, lens = [[4, 1, -1], [0, 5, 2]], [20, 40]
        with cache.decode_plan(tables, lens, num_heads=4, query_dtype=np.float32) as plan:
            assert (plan.layout, plan.dtype, plan.num_kv_heads, plan.head_size) == (layout, np.float16, 2, 32)
            for step in range(2):
                if step:
                    tables, lens = [[4, 1, 3], [0, 5, 2]], [33, 41]
                    plan.update(tables, lens)
                q = rng.standard_normal((2, 4, 32)).astype(np.float32)
                for layer in range(2):
                    out = np.full(q.shape, np.nan, np.float32)
                    plan.run(q, cache.key[layer], cache.value[layer], out=out)
                    ref = pagedvk.testing.reference.paged_attention(
                        q, cache.key[layer].numpy(), cache.value[layer].numpy(), np.array(tables, np.int32),
                        np.array(lens, np.int32), layout=layout)
                    assert np.linalg.norm(out - ref) <= 2e-3 * np.linalg.norm(ref), (step, layer)
        with pytest.raises(ValueError, match="num_heads"):
            cache.decode_plan(tables, lens, num_heads=3)


def test_kv_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of num_blocks and memory_fraction"):
        pagedvk.KVCache(1, 2, 32)
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        pagedvk.KVCache(1, 2, 32, memory_fraction=1.5)
    with pytest.raises(ValueError, match="layout must be one of 'vllm', 'nhd', 'hnd'"):
        pagedvk.KVCache(1, 2, 32, num_blocks=4, layout="HND")
    with pytest.raises(TypeError, match="dtype must have dtype"):
        pagedvk.KVCache(1, 2, 32, num_blocks=4, dtype=np.int8)
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32 in layout 'vllm', got 4"):
        pagedvk.KVCache(1, 2, 32, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="block_size must be one of 1, 2, 4, 8, 16, 32 in layout 'hnd', got 3"):
        pagedvk.KVCache(1, 2, 32, block_size=3, num_blocks=4, layout="hnd")
    with pytest.raises(ValueError, match="block_size 1 makes blocks of 1 kv heads x 4 dims x 1 tokens x 2 bytes = 8 "
                                         "bytes, not a multiple of 16"):
        pagedvk.KVCache(1, 1, 4, block_size=1, num_blocks=4, layout="nhd")
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, inf\], got 0"):
        pagedvk.KVCache(0, 2, 32, num_blocks=4)


def test_write_takes_device_arrays_without_reading_them_back(rng, monkeypatch):
    # Keys, values and slots already on the device go to the kernel as they are: nothing is read back to the host.
    cache = pagedvk.KVCache(num_layers=1, num_kv_heads=2, head_size=64, dtype=np.float16, num_blocks=4)
    cache.key[0].write(np.zeros(cache.spec.key_shape, np.float16))
    cache.value[0].write(np.zeros(cache.spec.value_shape, np.float16))
    k, v = rng.standard_normal((2, 3, 2, 64)).astype(np.float16)
    slots = np.array([0, 17, 63], np.int32)
    dk, dv, dslots = pagedvk.asarray(k), pagedvk.asarray(v), pagedvk.asarray(slots)
    with monkeypatch.context() as m:
        m.setattr(pagedvk.DeviceArray, "numpy", lambda self: pytest.fail("a device input was read back"))
        cache.write(0, dk, dv, dslots)
    want_k, want_v = pagedvk.testing.reference.reshape_and_cache(k, v, np.zeros(cache.spec.key_shape, np.float16),
                                                                  np.zeros(cache.spec.value_shape, np.float16), slots)
    np.testing.assert_array_equal(cache.key[0].numpy(), want_k)
    np.testing.assert_array_equal(cache.value[0].numpy(), want_v)
    cache.close()


@pytest.mark.parametrize("name, value", [("k_scale", 0.0), ("v_scale", float("nan")), ("k_scale", [1.0, 2.0])])
def test_rejected_scales(device, name, value):
    with pytest.raises(ValueError, match=f"{name} must be one positive finite number"):
        pagedvk.KVCache(2, 2, 16, num_blocks=4, dtype=ml_dtypes.float8_e4m3fn, device=device, **{name: value})


def test_fp8_scales_reach_writes_and_plans(rng, device):
    """What an fp8 cache with scales holds, and what its plans read back, are reference.cache_element's."""
    cache = pagedvk.KVCache(1, 2, 16, block_size=16, num_blocks=2, dtype=ml_dtypes.float8_e4m3fn, device=device,
                            k_scale=0.25, v_scale=8.0, prefix_caching=False)
    k, v = rng.standard_normal((3, 2, 16)).astype(np.float32) * 20, rng.standard_normal((3, 2, 16)).astype(np.float32)
    slots = cache.blocks.add_sequence(0, [1, 2, 3]).slots
    cache.write(0, k, v, slots)
    tables, lens = cache.blocks.block_tables([0], 2)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    with cache.decode_plan(tables, lens, num_heads=4, query_dtype=np.float32) as plan:
        got = plan.run(q, cache.key[0], cache.value[0])
    reference = pagedvk.testing.reference
    kq = reference.cache_element(k, ml_dtypes.float8_e4m3fn, 0.25).astype(np.float64) * 0.25
    vq = reference.cache_element(v, ml_dtypes.float8_e4m3fn, 8.0).astype(np.float64) * 8.0
    want = np.stack([reference.attention(q[0, h][None], kq[:, h // 2], vq[:, h // 2], 16 ** -0.5)[0][0]
                     for h in range(4)])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
