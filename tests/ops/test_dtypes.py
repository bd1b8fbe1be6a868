"""Every cache storage type x query type x layout x backend against the float64 reference, on random data
with outputs poisoned: decode, prefill and the backward (issue: KV storage as one variant system)."""

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.kernels.catalogue
import pagedvk.kernels.modules
import pagedvk.ops.vllm
from pagedvk.testing import reference
from support import Case, in_layout, poison_unread_slots, rel_error, tiered

BF16, E4M3, E5M2 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
CACHE_DTYPES = (np.float32, np.float16, BF16, E4M3, E5M2)
QUERY_DTYPES = (np.float32, np.float16, BF16)
LAYOUTS = ("vllm", "nhd")
NAMES = {np.dtype(d).name: d for d in CACHE_DTYPES}


def every_storage(cache_types, query_types=QUERY_DTYPES):
    """(cache type, query type, layout) names: all of them, and in the default tier every cache type in both
    layouts with the query type turning (the query type is a push constant, not a module of its own)."""
    names = [np.dtype(d).name for d in cache_types], [np.dtype(d).name for d in query_types]
    return tiered([(c, q, layout) for c in names[0] for q in names[1] for layout in LAYOUTS],
                  default=[(c, names[1][(i + j) % len(names[1])], layout) for i, c in enumerate(names[0])
                           for j, layout in enumerate(LAYOUTS)])


def tolerance(cache_dtype, query_dtype) -> float:
    """1e-5 for float32 throughout; 2e-3 where a 16-bit type rounds the output; 1e-4 for fp8 caches read
    into float32 (the reference sees the same dequantized values)."""
    if np.dtype(query_dtype) != np.float32:
        return 2e-3
    return {np.dtype(np.float32): 1e-5}.get(np.dtype(cache_dtype), 1e-4 if np.dtype(cache_dtype).itemsize == 1 else 2e-3)


@pytest.mark.parametrize("cache_dtype,query_dtype,layout", every_storage(CACHE_DTYPES))
def test_decode(rng, backend, cache_dtype, query_dtype, layout):
    cache_dtype, query_dtype = NAMES[cache_dtype], NAMES[query_dtype]
    case = Case(rng, num_seqs=3, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, max_len=300,
                dtype=cache_dtype)
    poison_unread_slots(case, 16)
    query = case.query.astype(query_dtype)
    key_cache, value_cache = in_layout(case, layout, cache_dtype)
    out = np.full(query.shape, np.nan, query.dtype)
    result = pagedvk.paged_attention(query, key_cache, value_cache, case.block_tables, case.seq_lens, out=out,
                                     layout=layout, backend=backend)
    assert result is out and out.dtype == query.dtype
    ref = reference.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert rel_error(out, ref) <= tolerance(cache_dtype, query_dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_decode_split_and_long(rng, backend, cache_dtype):
    # Long contexts split into partitions, merged by the reduce pass, in every storage type.
    case = Case(rng, seq_lens=[1500, 700], num_heads=4, num_kv_heads=1, head_size=128, block_size=32,
                dtype=cache_dtype)
    query = case.query.astype(np.float32)
    with pagedvk.DecodePlan.for_caches(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 4,
                                       query_dtype=np.float32, backend=backend, partition_size=256) as plan:
        assert plan.num_partitions > 1
        out = plan.run(query, case.key_cache, case.value_cache)
    ref = reference.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert rel_error(out, ref) <= tolerance(cache_dtype, np.float32)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_nhd_equals_vllm(rng, backend, cache_dtype):
    case = Case(rng, num_seqs=4, num_heads=4, num_kv_heads=2, head_size=32, block_size=8, max_len=100,
                dtype=cache_dtype)
    query = case.query.astype(np.float32)
    outs = [pagedvk.paged_attention(query, *in_layout(case, layout, cache_dtype), case.block_tables, case.seq_lens,
                                    layout=layout, backend=backend) for layout in LAYOUTS]
    assert rel_error(outs[1], outs[0]) <= 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype", (E4M3, E5M2), ids=lambda d: np.dtype(d).name)
def test_decode_reads_every_fp8_byte_exactly(rng, backend, cache_dtype, layout):
    # A sequence of one token puts its value row in the output as it is: the 256 bytes of the type (NaNs,
    # subnormals, zeros of both signs, the largest finite values) as values of two one-token sequences must come
    # out as ml_dtypes decodes them. The sentinel is no fp8 value, so an unwritten element shows too.
    case = Case(rng, seq_lens=[1, 1], num_heads=4, num_kv_heads=2, head_size=128, block_size=16, dtype=cache_dtype)
    every_byte = np.arange(256, dtype=np.uint8).reshape(2, 128)
    for seq in range(2):
        case.value_cache[case.block_tables[seq, 0], :, :, 0] = every_byte[seq].view(cache_dtype)
    query = case.query.astype(np.float32)
    out = np.full(query.shape, 7777.0, np.float32)
    pagedvk.paged_attention(query, *in_layout(case, layout, cache_dtype), case.block_tables, case.seq_lens, out=out,
                            layout=layout, backend=backend)
    expected = np.repeat(every_byte.view(cache_dtype).astype(np.float32)[:, None, :], 4, axis=1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8", E4M3), ("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)])
def test_vllm_fp8_cache_as_uint8_with_scales(rng, backend, kv_cache_dtype, dtype):
    # vLLM keeps fp8 caches as uint8 and passes the per-tensor scales: the cache holds k / k_scale.
    case = Case(rng, num_seqs=2, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, max_len=200,
                dtype=dtype)
    k_scale, v_scale = 0.37, 2.5
    query = case.query.astype(np.float16)
    out = np.full(query.shape, np.nan, np.float16)
    pagedvk.ops.vllm.paged_attention_v1(out, query, case.key_cache.view(np.uint8), case.value_cache.view(np.uint8), 2,
                                   0.1, case.block_tables, case.seq_lens, 16, 200, kv_cache_dtype=kv_cache_dtype,
                                   k_scale=k_scale, v_scale=v_scale)
    k = case.key_cache.astype(np.float64) * k_scale
    v = case.value_cache.astype(np.float64) * v_scale
    ref = reference.paged_attention(query, k, v, case.block_tables, case.seq_lens, scale=0.1)
    assert rel_error(out, ref) <= 2e-3


def test_paged_attention_v2_fills_vllm_scratch(rng):
    case = Case(rng, seq_lens=[1300, 40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    max_seq_len, parts = 1300, 3   # ceil(1300 / 512)
    out = case.poisoned_out()
    exp_sums = np.full((2, 4, parts), np.nan, np.float32)
    max_logits = np.full((2, 4, parts), np.nan, np.float32)
    tmp_out = np.full((2, 4, parts, 64), np.nan, np.float32)
    pagedvk.ops.vllm.paged_attention_v2(out, exp_sums, max_logits, tmp_out, case.query, case.key_cache, case.value_cache,
                                   2, 0.125, case.block_tables, case.seq_lens, 16, max_seq_len)
    assert rel_error(out, case.reference(0.125)) <= 1e-5
    # Partition 1 of sequence 0 (tokens 512..1023): vLLM's max, sum and normalized output.
    k, v = reference.gather_kv(case.key_cache, case.value_cache, case.block_tables[0], 1300)
    logits = 0.125 * case.query[0, :2].astype(np.float64) @ k[512:1024, 0].T     # heads 0, 1 read kv head 0
    m = logits.max(axis=1)
    p = np.exp(logits - m[:, None])
    assert np.allclose(max_logits[0, :2, 1], m, rtol=1e-5)
    assert np.allclose(exp_sums[0, :2, 1], p.sum(axis=1), rtol=1e-4)
    assert rel_error(tmp_out[0, :2, 1], (p / p.sum(axis=1, keepdims=True)) @ v[512:1024, 0]) <= 1e-5
    with pytest.raises(ValueError, match=r"tmp_out must have shape \(2, 4, 3, 64\)"):
        pagedvk.ops.vllm.paged_attention_v2(out, exp_sums, max_logits, np.zeros((2, 4, 2, 64), np.float32), case.query, case.key_cache,
                                       case.value_cache, 2, 0.125, case.block_tables, case.seq_lens, 16, max_seq_len)


@pytest.mark.parametrize("cache_dtype,query_dtype,layout", every_storage(CACHE_DTYPES))
def test_prefill(rng, backend, cache_dtype, query_dtype, layout):
    cache_dtype, query_dtype = NAMES[cache_dtype], NAMES[query_dtype]
    # A ragged batch: a whole prompt, a chunk over cached context, an empty sequence and a decode token.
    case = Case(rng, seq_lens=[5, 80, 0, 33], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                dtype=cache_dtype)
    key_cache, value_cache = in_layout(case, layout, cache_dtype)
    loc = np.array([0, 5, 12, 12, 13], np.int32)
    query = rng.standard_normal((13, 4, 64)).astype(query_dtype)
    out, lse = pagedvk.paged_attention_prefill(query, key_cache, value_cache, case.block_tables, case.seq_lens, loc,
                                               layout=layout, backend=backend)
    assert out.dtype == query.dtype and lse.dtype == np.float32
    ref_out, ref_lse = reference.paged_attention_prefill(query, key_cache, value_cache, case.block_tables,
                                                         case.seq_lens, loc, layout=layout)
    assert rel_error(out, ref_out) <= tolerance(cache_dtype, query_dtype)
    assert rel_error(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("cache_dtype,query_dtype,layout", every_storage((np.float32, np.float16, BF16)))
def test_backward(rng, backend, cache_dtype, query_dtype, layout):
    cache_dtype, query_dtype = NAMES[cache_dtype], NAMES[query_dtype]
    case = Case(rng, seq_lens=[4, 40, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                shared_prefix_blocks=1, dtype=cache_dtype)
    key_cache, value_cache = in_layout(case, layout, cache_dtype)
    loc = np.array([0, 4, 9, 9], np.int32)   # 4 and 5 new tokens, and a sequence without any
    query = rng.standard_normal((9, 4, 32)).astype(query_dtype)
    dout = rng.standard_normal(query.shape).astype(query_dtype)
    out, lse = pagedvk.paged_attention_prefill(query, key_cache, value_cache, case.block_tables, case.seq_lens, loc,
                                               layout=layout, backend=backend)
    grads = pagedvk.paged_attention_backward(dout, query, key_cache, value_cache, case.block_tables, case.seq_lens,
                                             out, lse, loc, layout=layout, backend=backend)
    refs = reference.paged_attention_backward(dout, query, key_cache, value_cache, case.block_tables,
                                              case.seq_lens, loc, layout=layout)
    # The gradients are float32 whatever the inputs; 16-bit `out` (rounded) feeds D = rowsum(dout * out).
    tol = 1e-4 if np.dtype(query_dtype) == np.float32 else 2e-2
    for got, ref in zip(grads, refs):
        assert got.dtype == np.float32
        assert rel_error(got, ref) <= tol


def test_fp8_backward_is_refused(rng):
    case = Case(rng, seq_lens=[4], num_heads=2, num_kv_heads=1, head_size=32, block_size=8, dtype=E4M3)
    q = rng.standard_normal((1, 2, 4, 32)).astype(np.float32)
    k, v = in_layout(case, "nhd", E4M3)
    with pytest.raises(TypeError, match="key_cache must have dtype float32, float16, bfloat16"):
        pagedvk.paged_attention_backward(q, q, k, v, case.block_tables, case.seq_lens, q, np.zeros((1, 2, 4), np.float32),
                                         layout="nhd")


def test_bad_dtypes_name_the_argument(rng):
    case = Case(rng, num_seqs=2, head_size=64)
    with pytest.raises(TypeError, match="key_cache must have dtype float32, float16, bfloat16, float8_e4m3fn"):
        pagedvk.paged_attention(case.query, case.key_cache.astype(np.float64), case.value_cache, case.block_tables,
                                case.seq_lens)
    with pytest.raises(TypeError, match=r"value_cache must have dtype float32 \(key_cache's\)"):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache.astype(np.float16), case.block_tables,
                                case.seq_lens)
    with pytest.raises(TypeError, match="query must have dtype float32, float16, bfloat16"):
        pagedvk.paged_attention(case.query.astype(E4M3), case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="v_scale must be one positive finite number"):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                v_scale=0.0)
    with pytest.raises(ValueError, match=r"key_cache.shape\[4\] \(x\) must be 16 // itemsize = 8"):
        pagedvk.paged_attention(case.query, case.key_cache.astype(np.float16), case.value_cache.astype(np.float16),
                                case.block_tables, case.seq_lens)
    with pytest.raises(ValueError, match="layout must be one of 'vllm', 'nhd', 'hnd'"):
        pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                layout="HND")



def masked_device(monkeypatch, *features):
    """A new Device on the default GPU with the named Vulkan 1.1/1.2 features reported as missing."""
    from pagedvk.runtime import device as device_module
    real = device_module.query_features

    def without(pd, f11=None, f12=None, chain=None):
        f11, f12 = real(pd, f11, f12, chain)
        for name in features:
            for struct in (f11, f12):
                if hasattr(struct, name):
                    setattr(struct, name, 0)
        return f11, f12
    monkeypatch.setattr(device_module, "query_features", without)
    return pagedvk.Device(pagedvk.select()[0])


@pytest.mark.parametrize("cache_dtype", (np.float16, BF16, E4M3), ids=lambda d: np.dtype(d).name)
def test_no_16_or_8_bit_storage_feature_is_needed(rng, monkeypatch, cache_dtype):
    # The kernels read 16-bit and 8-bit types through 32-bit words: a device without storageBuffer16BitAccess
    # and storageBuffer8BitAccess runs every storage type.
    with masked_device(monkeypatch, "storageBuffer16BitAccess", "storageBuffer8BitAccess", "shaderFloat16",
                       "shaderInt8") as device:
        assert not {"storageBuffer16BitAccess", "storageBuffer8BitAccess"} & device.features
        case = Case(rng, num_seqs=2, num_heads=4, num_kv_heads=2, head_size=64, max_len=100, dtype=cache_dtype)
        query = pagedvk.asarray(case.query.astype(np.float16), device=device)
        out = pagedvk.paged_attention(query, *case.args()[1:]).numpy()
        ref = reference.paged_attention(query.numpy(), case.key_cache, case.value_cache, case.block_tables,
                                        case.seq_lens)
        assert rel_error(out, ref) <= 2e-3


def test_a_module_needing_a_missing_feature_names_it(rng, monkeypatch):
    with masked_device(monkeypatch, "bufferDeviceAddress") as device:
        assert not device.buffer_device_address
        key = pagedvk.kernels.catalogue.PAGED_DECODE.key("glsl", "f16", "f16", access="bda")
        with pytest.raises(pagedvk.UnsupportedFeatureError, match="needs the Vulkan feature.*bufferDeviceAddress"):
            pagedvk.kernels.modules.pipeline(device, pagedvk.kernels.catalogue.PAGED_DECODE, key)
