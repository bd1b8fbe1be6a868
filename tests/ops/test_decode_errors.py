"""Every rejected decode input: a ValueError/TypeError naming the argument, and nothing written."""

import numpy as np
import pytest

import pagedvk
import pagedvk.ops.vllm
from support import Case, assert_untouched, fenced, in_layout, rejects, tensors_by_name


def rejects_decode(case, exc, match, **changes):
    """paged_attention on the case with `changes` raises; an output of the query's shape stays NaN (nothing written)."""
    out = rejects(pagedvk.paged_attention, dict(tensors_by_name(case), out=case.poisoned_out()), exc, match,
                  **changes)["out"]
    if isinstance(out, np.ndarray) and out.shape == case.query.shape:
        assert np.isnan(out).all(), "a rejected call wrote its output"


@pytest.fixture
def case(rng):
    return Case(rng, num_seqs=3, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[40, 17, 64])


def test_query_wrong_ndim(case):
    rejects_decode(case, ValueError, "query must have 3 dimensions", query=case.query[0])


def test_query_wrong_dtype(case):
    rejects_decode(case, TypeError, "query must have dtype float32", query=case.query.astype(np.float64))


def test_query_not_an_array(case):
    rejects_decode(case, TypeError, "query must be a numpy array", query=case.query.tolist())


def test_cache_wrong_dtype(case):
    rejects_decode(case, TypeError, "key_cache must have dtype", key_cache=case.key_cache.astype(np.float64))
    rejects_decode(case, TypeError, "value_cache must have dtype", value_cache=case.value_cache.astype(np.float16))


def test_cache_wrong_ndim(case):
    rejects_decode(case, ValueError, "key_cache must have 5 dimensions", key_cache=case.key_cache[0])
    rejects_decode(case, ValueError, "value_cache must have 4 dimensions", value_cache=case.value_cache[..., None])


def test_key_cache_wrong_x(case):
    k = np.ascontiguousarray(case.key_cache.reshape(*case.key_cache.shape[:2], -1, 16, 2))
    rejects_decode(case, ValueError, r"key_cache.shape\[4\] \(x\) must be 16 // itemsize = 4", key_cache=k)


def test_num_heads_not_multiple_of_kv_heads(rng):
    case = Case(rng, num_heads=6, num_kv_heads=4, head_size=32)
    rejects_decode(case, ValueError, r"num_heads \(6\) must be a positive multiple of num_kv_heads \(4\)")


def test_head_size_mismatch(case):
    q = np.ascontiguousarray(case.query[..., :32])
    rejects_decode(case, ValueError, r"query.shape\[2\] \(head_size\) must be 64", query=q)
    v = np.ascontiguousarray(case.value_cache[:, :, :32])
    rejects_decode(case, ValueError, r"value_cache.shape\[2\] \(head_size\) must be 64", value_cache=v)


def test_head_size_too_large(rng):
    case = Case(rng, head_size=264, num_seqs=1)
    rejects_decode(case, ValueError, r"head_size \(key_cache.shape\[2\] \* x\) must be a multiple of 4 in \[4, 256\]")


def test_block_size_unsupported(rng):
    # Blocks under 8 tokens are the token-major layouts' only; there, any power of two up to 32.
    case = Case(rng, block_size=4, num_seqs=1)
    rejects_decode(case, ValueError, r"block_size \(key_cache.shape\[3\]\) must be one of 8, 16, 32 in layout 'vllm', got 4")
    case = Case(rng, block_size=3, num_seqs=1)
    k, v = in_layout(case, "hnd", np.float32)
    rejects_decode(case, ValueError, r"block_size \(key_cache.shape\[2\]\) must be one of 1, 2, 4, 8, 16, 32 in layout 'hnd'",
            key_cache=k, value_cache=v, layout="hnd")


def test_blocks_not_whole_16_byte_chunks(rng):
    # The kernels address blocks in 16-byte chunks: one 1-token block of one float16 kv head of 4 dims is 8 bytes.
    case = Case(rng, num_heads=1, num_kv_heads=1, head_size=4, block_size=1, num_seqs=2)
    k, v = in_layout(case, "nhd", np.float16)
    rejects_decode(case, ValueError, r"block_size \(key_cache.shape\[1\]\) 1 makes blocks of 1 kv heads x 4 dims x 1 tokens "
            r"x 2 bytes = 8 bytes, not a multiple of 16", key_cache=k, value_cache=v, layout="nhd")


def test_value_cache_mismatch(case):
    v = np.ascontiguousarray(case.value_cache[:-1])
    rejects_decode(case, ValueError, r"value_cache.shape\[0\] \(num_blocks\)", value_cache=v)


@pytest.mark.parametrize("bad_id", [-1, -2**31, "num_blocks", 2**31 - 1])
def test_block_id_outside_cache(case, bad_id):
    bt = case.block_tables.copy()
    bt[1, 1] = case.key_cache.shape[0] if bad_id == "num_blocks" else bad_id
    rejects_decode(case, ValueError, r"block_tables\[1, 1\] = .* is outside \[0, ", block_tables=bt)


def test_block_ids_past_the_used_blocks_are_not_checked(case):
    bt = case.block_tables.copy()
    bt[1, 2:] = 10**6              # sequence 1 has 17 tokens: it reads its first 2 blocks only
    pagedvk.paged_attention(*case.args()[:3], bt, case.seq_lens)


def test_negative_seq_len(case):
    sl = case.seq_lens.copy()
    sl[2] = -1
    rejects_decode(case, ValueError, r"seq_lens\[2\] = -1 is outside \[0, ", seq_lens=sl)


def test_seq_len_beyond_block_table_row(case):
    sl = case.seq_lens.copy()
    sl[0] = case.block_tables.shape[1] * 16 + 1
    rejects_decode(case, ValueError, r"seq_lens\[0\] = .* is outside \[0, .*max_blocks_per_seq", seq_lens=sl)


def test_table_dtypes(case):
    rejects_decode(case, TypeError, "block_tables must have dtype int32", block_tables=case.block_tables.astype(np.int64))
    rejects_decode(case, TypeError, "seq_lens must have dtype int32", seq_lens=case.seq_lens.astype(np.uint32))


def test_table_shapes(case):
    rejects_decode(case, ValueError, r"seq_lens.shape\[0\] \(num_seqs", seq_lens=case.seq_lens[:2])
    rejects_decode(case, ValueError, "block_tables must have 2 dimensions", block_tables=case.block_tables[0])
    rejects_decode(case, ValueError, r"query.shape\[0\] \(num_seqs\)", query=np.ascontiguousarray(case.query[:2]))


def test_out_wrong_shape_or_dtype(case):
    rejects_decode(case, ValueError, "out must have the query's shape", out=np.zeros((3, 8, 32), np.float32))
    rejects_decode(case, TypeError, "out must have dtype float32", out=np.full(case.query.shape, np.nan, np.float64))


def test_bad_scale_and_backend(case):
    rejects_decode(case, ValueError, "scale must be finite", scale=float("nan"))
    rejects_decode(case, ValueError, "backend must be one of", backend="cuda")


def test_bad_backend_env(case, monkeypatch):
    monkeypatch.setenv("PAGEDVK_BACKEND", "metal")
    rejects_decode(case, ValueError, "PAGEDVK_BACKEND must be one of")


def test_device_table_checked_too(case):
    bt = case.block_tables.copy()
    bt[0, 0] = 999
    rejects_decode(case, ValueError, r"block_tables\[0, 0\] = 999", block_tables=pagedvk.asarray(bt))


def test_vllm_unsupported_options_raise(case):
    q, k, v, bt, sl = case.args()
    out = case.poisoned_out()
    call = lambda **kw: pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.1, bt, sl, 16, 64, **kw)
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(num_heads\) must be 8"):
        call(alibi_slopes=np.ones(7, np.float32))   # ALiBi is supported (tests/ops/test_variants.py); its checks hold
    with pytest.raises(TypeError, match=r"key_cache must be uint8 \(or float8_e4m3fn\) with kv_cache_dtype='fp8'"):
        call(kv_cache_dtype="fp8")   # fp8 caches arrive as uint8 (tests/ops/test_dtypes.py runs them)
    with pytest.raises(NotImplementedError, match="block-sparse"):
        call(blocksparse_vert_stride=4)
    assert np.isnan(out).all()


def test_vllm_tp_rank_and_local_blocks_ignored_without_block_sparsity(case):
    # vLLM passes tp_rank and blocksparse_local_blocks on every call; they mean nothing unless
    # blocksparse_vert_stride > 1, so they must not be refused.
    q, k, v, bt, sl = case.args()
    out = case.poisoned_out()
    pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.125, bt, sl, 16, 64, tp_rank=3, blocksparse_local_blocks=16,
                                   blocksparse_vert_stride=1)
    np.testing.assert_allclose(out, case.reference(scale=0.125), rtol=1e-5, atol=1e-5)


def test_device_array_refuses_a_view_without_copy(case):
    a = pagedvk.asarray(case.query)
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(a, copy=False)
    np.testing.assert_array_equal(np.asarray(a), case.query)   # a copy is fine
    a.close()


def test_vllm_argument_mismatches(case):
    q, k, v, bt, sl = case.args()
    out = case.poisoned_out()
    with pytest.raises(ValueError, match="num_kv_heads"):
        pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 4, 0.1, bt, sl, 16, 64)
    with pytest.raises(ValueError, match="block_size"):
        pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.1, bt, sl, 32, 64)
    with pytest.raises(ValueError, match="max_seq_len"):
        pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.1, bt, sl, 16, 63)
    assert np.isnan(out).all()


def test_unchecked_bad_ids_stay_inside_the_cache(case, device):
    # With validation off, out-of-range and negative ids reach the kernel, which must treat those blocks
    # as empty: the other sequences stay right, the cache and the sentinels beside it are untouched, the
    # device lives on.
    bt = case.block_tables.copy()
    bt[1, 0], bt[1, 1] = -5, 10**9
    (dk, dv), guards = fenced(device, case.key_cache, case.value_cache)
    out = pagedvk.paged_attention(case.query, dk, dv, pagedvk.asarray(bt), case.seq_lens, validate=False)
    ref = case.reference()
    assert np.isfinite(out).all()
    for s in (0, 2):
        assert np.linalg.norm(out[s] - ref[s]) / np.linalg.norm(ref[s]) < 1e-5
    np.testing.assert_array_equal(dk.numpy(), case.key_cache)
    np.testing.assert_array_equal(dv.numpy(), case.value_cache)
    assert_untouched(*guards)
    assert np.isfinite(pagedvk.paged_attention(*case.args())).all()   # still usable


# -- DecodePlan arguments: checked at construction, each error naming its argument --

def plan_with(case, **kw):
    args = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=case.key_cache.shape[0])
    args.update(kw)
    return pagedvk.DecodePlan(case.block_tables, case.seq_lens, **args)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dtype=np.float64), TypeError, "dtype must be one of the supported cache dtypes"),
    (dict(dtype="no-such-type"), TypeError, "dtype must be one of the supported cache dtypes"),
    (dict(num_heads=4.0), TypeError, "num_heads must be an int"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads must be an int"),
    (dict(num_heads=0), ValueError, r"num_heads must be in \[1, inf\]"),
    (dict(num_heads=7), ValueError, r"num_heads \(7\) must be a positive multiple of num_kv_heads"),
    (dict(scale=1e39), ValueError, "scale must be finite and representable as float32"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(scale="0.25"), TypeError, "scale must be a real number or None"),
    (dict(head_size=17), ValueError, "head_size must be a multiple of 4"),
    (dict(head_size=260), ValueError, r"head_size must be in \[4, 256\]"),
    (dict(block_size=12), ValueError, "block_size must be one of 8, 16, 32 in layout 'vllm', got 12"),
    (dict(block_size=12, layout="hnd"), ValueError, "block_size must be one of 1, 2, 4, 8, 16, 32 in layout 'hnd'"),
    (dict(layout="HND"), ValueError, "layout must be one of vllm, nhd, hnd, got HND"),
    (dict(num_blocks=-1), ValueError, r"num_blocks must be in \[0, inf\]"),
])
def test_plan_arguments_checked_at_construction(case, kw, exc, match):
    with pytest.raises(exc, match=match):
        plan_with(case, **kw)


def test_plan_takes_numpy_integers_and_float32_scale(case):
    with plan_with(case, num_heads=np.int64(8), scale=np.float32(0.125)) as plan:
        out = plan.run(case.query, case.key_cache, case.value_cache)
    np.testing.assert_allclose(out, case.reference(scale=0.125), rtol=1e-5, atol=1e-5)


def test_two_devices_on_one_gpu_are_told_apart(case):
    other = pagedvk.Device(pagedvk.devices()[0])
    try:
        k, q = pagedvk.asarray(case.key_cache, device=other), pagedvk.asarray(case.query)
        with pytest.raises(ValueError, match=r"one device, got Device\(.*serial=\d+\), Device\(.*serial=\d+\)") as e:
            pagedvk.paged_attention(q, k, case.value_cache, case.block_tables, case.seq_lens)
        serials = [int(s) for s in __import__("re").findall(r"serial=(\d+)", str(e.value))]
        assert len(set(serials)) == 2, str(e.value)
        k.close()
        q.close()
    finally:
        other.close()


def test_device_name_and_repr():
    device = pagedvk.default_device()
    assert device.name == device.info.name
    assert repr(device).startswith(f"Device({device.name!r}, index={device.info.index}, serial=")
