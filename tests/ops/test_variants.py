"""Attention variants in decode (issue 11): ALiBi, logit softcapping, sinks, sliding windows, the log-sum-exp
out and merging states, against the float64 reference on random data with NaN-poisoned outputs; each option
alone and all together, in every cache dtype, both layouts, both backends, split-K on and off."""

import ml_dtypes
import numpy as np
import pytest

import pagedvk
import pagedvk.ops.vllm
from pagedvk.testing import reference
from support import VARIANTS, Case, in_layout, poison_unread_slots, rel_error, tiered, variant_args

CACHE_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
TOL = 1e-5   # float32 caches and queries


def decode(case, query, key_cache, value_cache, backend, layout="vllm", partition_size=None, **variants):
    """(out, lse) from a DecodePlan run into NaN-poisoned outputs, and the plan's partition count."""
    out = np.full(query.shape, np.nan, query.dtype)
    lse = np.full(query.shape[:2], np.nan, np.float32)
    with pagedvk.DecodePlan.for_caches(key_cache, value_cache, case.block_tables, case.seq_lens, query.shape[1],
                                       layout=layout, query_dtype=query.dtype, backend=backend,
                                       partition_size=partition_size, **variants) as plan:
        result = plan.run(query, key_cache, value_cache, out=out, lse=lse)
        assert result[0] is out and result[1] is lse
        return out, lse, plan.num_partitions


# Default tier: each variant split and not, the layout turning.
@pytest.mark.parametrize("variant,layout,split", tiered(
    [(v, layout, split) for v in VARIANTS for layout in ("vllm", "nhd") for split in (False, True)],
    default=[(v, ("vllm", "nhd")[(i + s) % 2], bool(s)) for i, v in enumerate(VARIANTS) for s in (0, 1)]))
def test_each_variant_and_all(rng, backend, variant, layout, split):
    case = Case(rng, seq_lens=[300, 45, 1, 129], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    poison_unread_slots(case, 16)
    kw = variant_args(rng, 8, VARIANTS[variant])
    out, lse, parts = decode(case, case.query, *in_layout(case, layout, np.float32), backend, layout,
                             partition_size=32 if split else 512, **kw)
    assert (parts > 1) == split
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, **kw)
    assert rel_error(out, ref_out) <= TOL
    assert rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("cache_dtype,layout", tiered(
    [(np.dtype(d).name, layout) for d in CACHE_DTYPES for layout in ("vllm", "nhd")],
    default=[(np.dtype(d).name, ("vllm", "nhd")[i % 2]) for i, d in enumerate(CACHE_DTYPES)]))
def test_all_variants_every_dtype(rng, backend, cache_dtype, layout):
    cache_dtype = {np.dtype(d).name: d for d in CACHE_DTYPES}[cache_dtype]
    # 16-bit queries with 16-bit and fp8 caches, float32 with float32; split and not, in one case each.
    case = Case(rng, seq_lens=[260, 70], num_heads=8, num_kv_heads=1, head_size=32, block_size=16, dtype=cache_dtype)
    query_dtype = np.float32 if cache_dtype is np.float32 else np.float16
    query = case.query.astype(query_dtype)
    kw = variant_args(rng, 8, VARIANTS["all"])
    ref_out, ref_lse = reference.paged_attention(query, *case.args()[1:], return_lse=True, **kw)
    tol = TOL if query_dtype is np.float32 else 2e-3
    for partition_size in (None, 16):
        out, lse, _ = decode(case, query, *in_layout(case, layout, cache_dtype), backend, layout,
                             partition_size=partition_size, **kw)
        assert rel_error(out, ref_out) <= tol
        assert rel_error(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("num_heads,num_kv_heads", tiered([(4, 4), (8, 1), (12, 3), (16, 2)], default=[(12, 3), (16, 2)]))
def test_variants_with_gqa(rng, backend, num_heads, num_kv_heads):
    # Per-head slopes and sinks must follow the query head, in groups of up to 8 heads per workgroup.
    case = Case(rng, seq_lens=[150, 77], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64)
    kw = variant_args(rng, num_heads, VARIANTS["all"])
    out, lse, _ = decode(case, case.query, case.key_cache, case.value_cache, backend, **kw)
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, **kw)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("window_left", tiered([0, 1, 15, 16, 100, 5000], default=[0, 16, 5000]))
def test_window_edges(rng, backend, window_left):
    # Only itself, a block's worth either side of a block boundary, wider than some contexts, wider than all.
    case = Case(rng, seq_lens=[300, 17, 16, 1], num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    for partition_size in (None, 16):
        out, lse, _ = decode(case, case.query, case.key_cache, case.value_cache, backend,
                             partition_size=partition_size, window_left=window_left)
        ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, window_left=window_left)
        assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("layout", ("vllm", "nhd"))
def test_window_does_not_read_blocks_before_it(rng, backend, layout):
    # NaN in every block wholly before each sequence's window: a kernel that reads them (even weighting them
    # by zero) gives NaN. The split covers the window only: with 16-token partitions, 3 of them, not 63.
    case = Case(rng, seq_lens=[1000, 700], num_heads=4, num_kv_heads=1, head_size=32, block_size=16)
    window_left = 20
    ref = reference.paged_attention(*case.args(), window_left=window_left)   # (of the caches before the NaN)
    for s, n in enumerate(case.seq_lens):
        first_block = (n - 1 - window_left) // 16
        for b in case.block_tables[s, :first_block]:
            case.key_cache[b] = case.value_cache[b] = np.nan
    for partition_size in (None, 16):
        out, _, parts = decode(case, case.query, *in_layout(case, layout, np.float32), backend, layout,
                               partition_size=partition_size, window_left=window_left)
        assert rel_error(out, ref) <= TOL
        if partition_size:
            assert parts == 3   # ceil((window_left + 1 + 15) / 16)


def test_sinks_with_empty_sequences(rng, backend):
    # No key at all: zeros out; lse is the sink alone with sinks, -inf without.
    case = Case(rng, seq_lens=[0, 40, 0], num_heads=4, num_kv_heads=2, head_size=32)
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse, _ = decode(case, case.query, case.key_cache, case.value_cache, backend, sinks=sinks)
    assert (out[[0, 2]] == 0).all() and (lse[[0, 2]] == sinks).all()
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, sinks=sinks)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse[1], ref_lse[1]) <= TOL
    _, lse, _ = decode(case, case.query, case.key_cache, case.value_cache, backend)
    assert np.isneginf(lse[[0, 2]]).all() and np.isfinite(lse[1]).all()


def test_large_logits_softcapped_stay_finite(rng, backend):
    # Logits in the thousands: tanh of them must be 1, not inf / inf.
    case = Case(rng, seq_lens=[50], num_heads=2, num_kv_heads=1, head_size=32)
    case.query *= 1000
    out, lse, _ = decode(case, case.query, case.key_cache, case.value_cache, backend, logits_soft_cap=30.0)
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, logits_soft_cap=30.0)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


def test_return_lse_kinds(rng, backend, device):
    # numpy in: numpy (out, lse); DeviceArrays in: DeviceArrays; the one-call op too.
    case = Case(rng, seq_lens=[90, 33], num_heads=4, num_kv_heads=2, head_size=32)
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True)
    out, lse = pagedvk.paged_attention(*case.args(), backend=backend, return_lse=True)
    assert isinstance(lse, np.ndarray) and lse.shape == (2, 4) and lse.dtype == np.float32
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL
    dev = [pagedvk.asarray(a) for a in case.args()]
    out, lse = pagedvk.paged_attention(*dev, backend=backend, return_lse=True)
    assert isinstance(out, pagedvk.DeviceArray) and isinstance(lse, pagedvk.DeviceArray)
    assert rel_error(out.numpy(), ref_out) <= TOL and rel_error(lse.numpy(), ref_lse) <= TOL
    with pagedvk.DecodePlan.for_caches(dev[1], dev[2], dev[3], dev[4], 4, backend=backend) as plan:
        o = pagedvk.asarray(np.full(case.query.shape, np.nan, np.float32))
        l = pagedvk.asarray(np.full((2, 4), np.nan, np.float32))
        for _ in range(2):   # the second run resubmits the recorded launch
            assert plan.run(dev[0], dev[1], dev[2], out=o, lse=l) == (o, l)
            assert rel_error(l.numpy(), ref_lse) <= TOL and rel_error(o.numpy(), ref_out) <= TOL
        assert plan.run(dev[0], dev[1], dev[2], out=o) is o   # the same plan without lse
    for a in dev + [out, lse, o, l]:
        a.close()


def test_one_call_op_takes_every_variant(rng, backend):
    case = Case(rng, seq_lens=[200, 31], num_heads=8, num_kv_heads=2, head_size=64)
    kw = variant_args(rng, 8, VARIANTS["all"])
    for _ in range(2):   # scalar options alone go through the kept plans: a second call reuses one
        out = pagedvk.paged_attention(*case.args(), backend=backend, logits_soft_cap=2.0, window_left=30)
        assert rel_error(out, reference.paged_attention(*case.args(), logits_soft_cap=2.0, window_left=30)) <= TOL
    out, lse = pagedvk.paged_attention(*case.args(), backend=backend, return_lse=True, **kw)
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, **kw)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("partition_size", (None, 32), ids=("one_partition", "split"))
def test_sinks_per_run(rng, backend, partition_size):
    # One plan for every layer, each layer its own sinks (gpt-oss): given to run() they stand in for the
    # plan's, as a DeviceArray (the recorded launch is kept and resubmitted) or numpy (copied each run).
    case = Case(rng, seq_lens=[180, 60], num_heads=8, num_kv_heads=2, head_size=64)
    layers = [rng.standard_normal(8).astype(np.float32) for _ in range(3)]
    plan_sinks = variant_args(rng, 8, ["sinks"])
    dev = [pagedvk.asarray(a) for a in case.args()]
    for kw in ({}, plan_sinks):
        with pagedvk.DecodePlan.for_caches(*dev[1:], 8, backend=backend, partition_size=partition_size, **kw) as plan:
            out = pagedvk.asarray(case.poisoned_out())
            for _ in range(2):
                for sinks in layers:
                    for given in (pagedvk.asarray(sinks), sinks):
                        plan.run(dev[0], dev[1], dev[2], out=out, sinks=given)
                        ref = reference.paged_attention(*case.args(), sinks=sinks)
                        assert rel_error(out.numpy(), ref) <= TOL
                        if isinstance(given, pagedvk.DeviceArray):
                            given.close()
            plan.run(dev[0], dev[1], dev[2], out=out)   # the plan's own again (none, or its sinks)
            assert rel_error(out.numpy(), reference.paged_attention(*case.args(), **kw)) <= TOL
            with pytest.raises(ValueError, match=r"sinks.shape\[0\] \(num_heads\) must be 8"):
                plan.run(dev[0], dev[1], dev[2], out=out, sinks=layers[0][:4])
            out.close()
    for a in dev:
        a.close()


@pytest.mark.parametrize("op", ("v1", "v2"))
def test_vllm_ops_take_alibi_slopes(rng, backend, op, monkeypatch):
    monkeypatch.setenv("PAGEDVK_BACKEND", backend)
    case = Case(rng, seq_lens=[1200, 300], num_heads=8, num_kv_heads=2, head_size=64)
    slopes = rng.uniform(0.001, 0.1, 8).astype(np.float32)
    out = case.poisoned_out()
    q, k, v, bt, sl = case.args()
    if op == "v1":
        pagedvk.ops.vllm.paged_attention_v1(out, q, k, v, 2, 0.125, bt, sl, 16, 1200, alibi_slopes=slopes)
    else:
        stats = np.zeros((2, 8, 3), np.float32)
        pagedvk.ops.vllm.paged_attention_v2(out, stats, stats.copy(), np.zeros((2, 8, 3, 64), np.float32), q, k, v, 2,
                                       0.125, bt, sl, 16, 1200, alibi_slopes=slopes)
    assert rel_error(out, reference.paged_attention(*case.args(), scale=0.125, alibi_slopes=slopes)) <= TOL


# -- merging states -------------------------------------------------------------------------------------

def split_case(case, prefix_blocks):
    """The case's caches as a shared prefix (each sequence's first prefix_blocks blocks) and a suffix (the rest):
    (block tables, lengths) of each, over the same caches."""
    bs = case.block_size
    prefix_len = np.minimum(case.seq_lens, prefix_blocks * bs).astype(np.int32)
    suffix_tables = np.full_like(case.block_tables, -1)
    suffix_tables[:, :-prefix_blocks] = case.block_tables[:, prefix_blocks:]
    return ((case.block_tables, prefix_len), (suffix_tables, (case.seq_lens - prefix_len).astype(np.int32)))


@pytest.mark.parametrize("sinks", (False, True), ids=("plain", "sinks"))
def test_prefix_and_suffix_merged_equal_the_whole(rng, backend, sinks):
    # Cascade attention: a prefix cache and a suffix cache, each with its lse, merged on the device. Sinks
    # go to one part only (each lse includes its sink). A sequence whose suffix is empty merges a -inf lse.
    case = Case(rng, seq_lens=[200, 64, 150, 20], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    kw = variant_args(rng, 8, ["sinks"]) if sinks else {}
    (pt, pl), (st, sl) = split_case(case, 4)
    assert sl[1] == 0 and sl[3] == 0
    q, k, v = case.query, case.key_cache, case.value_cache
    out_a, lse_a = pagedvk.paged_attention(q, k, v, pt, pl, backend=backend, return_lse=True, **kw)
    out_b, lse_b = pagedvk.paged_attention(q, k, v, st, sl, backend=backend, return_lse=True)
    assert np.isneginf(lse_b[[1, 3]]).all()
    out, lse = pagedvk.merge_attention_states(out_a, lse_a, out_b, lse_b, backend=backend)
    ref_out, ref_lse = reference.paged_attention(*case.args(), return_lse=True, **kw)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("dtype", (np.float32, np.float16, ml_dtypes.bfloat16), ids=lambda d: np.dtype(d).name)
def test_merge_against_reference(rng, backend, dtype, device):
    # Random states, prefill-shaped ([seqs, heads, q_len, head_size]), with rows empty in one part and in both.
    shape = (3, 4, 5, 40)
    out_a, out_b = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    lse_a, lse_b = (rng.normal(0, 3, shape[:3]).astype(np.float32) for _ in range(2))
    lse_a[0, 0, :2] = -np.inf
    lse_b[0, 0, 1:3] = -np.inf
    out_a[0, 0, :2] = np.nan   # an empty part's output is never read
    out, lse = pagedvk.merge_attention_states(out_a, lse_a, out_b, lse_b, backend=backend)
    ref_out, ref_lse = reference.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np.dtype(dtype) and out.shape == shape and lse.shape == shape[:3]
    assert (out[0, 0, 1] == 0).all() and np.isneginf(lse[0, 0, 1])
    assert rel_error(out, ref_out) <= (TOL if dtype is np.float32 else 4e-3)
    assert rel_error(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(ref_lse), 0, ref_lse)) <= 1e-6
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    dev = [pagedvk.asarray(a) for a in (out_a, lse_a, out_b, lse_b)]
    d_out, d_lse = pagedvk.merge_attention_states(*dev, backend=backend)
    assert isinstance(d_out, pagedvk.DeviceArray) and (d_out.numpy() == out).all()
    for a in dev + [d_out, d_lse]:
        a.close()


# -- rejected inputs: each names its argument -----------------------------------------------------------

def test_rejected_variant_arguments(rng):
    case = Case(rng, seq_lens=[20], num_heads=4, num_kv_heads=2, head_size=32)
    call = lambda **kw: pagedvk.paged_attention(*case.args(), **kw)
    good = np.zeros(4, np.float32)
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(ValueError, match=rf"{name}.shape\[0\] \(num_heads\) must be 4"):
            call(**{name: np.zeros(5, np.float32)})
        with pytest.raises(TypeError, match=f"{name} must have dtype float32"):
            call(**{name: good.astype(np.float64)})
        with pytest.raises(ValueError, match=rf"{name} must have 1 dimensions \[num_heads\]"):
            call(**{name: np.zeros((4, 1), np.float32)})
        with pytest.raises(TypeError, match=f"{name} must be a numpy array"):
            call(**{name: [0.0] * 4})
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            call(**{name: np.array([0, np.nan, 0, 0], np.float32)})
    for cap in (-1.0, float("nan"), float("inf"), 1e39, 1e-300, 1e3):   # 0 is off (FlashInfer's)
        with pytest.raises(ValueError, match=r"logits_soft_cap must be 0 or None \(no softcapping\), or in \["):
            call(logits_soft_cap=cap)
    with pytest.raises(TypeError, match="logits_soft_cap must be a real number or None"):
        call(logits_soft_cap=True)
    for w in (-2, -100, 2**31):
        with pytest.raises(ValueError, match=r"window_left must be -1 \(no window\) or in \[0, "):
            call(window_left=w)
    for w in (1.5, None, True):
        with pytest.raises(TypeError, match="window_left must be an int"):
            call(window_left=w)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(return_lse=1)
    with pagedvk.DecodePlan.for_caches(*case.args()[1:], 4) as plan:
        out = case.poisoned_out()
        with pytest.raises(ValueError, match=r"lse must have shape \[num_seqs, num_heads\] = \(1, 4\)"):
            plan.run(case.query, case.key_cache, case.value_cache, out=out, lse=np.zeros((4,), np.float32))
        with pytest.raises(TypeError, match="lse must have dtype float32"):
            plan.run(case.query, case.key_cache, case.value_cache, out=out, lse=np.zeros((1, 4)))
        with pytest.raises(TypeError, match="lse must be given with out"):
            plan.run(case.query, case.key_cache, case.value_cache, lse=np.zeros((1, 4), np.float32))
        assert np.isnan(out).all()


def test_rejected_merge_arguments(rng):
    a = rng.standard_normal((2, 4, 32)).astype(np.float32)
    s = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"out_b must have out_a's shape \(2, 4, 32\)"):
        pagedvk.merge_attention_states(a, s, a[:1], s)
    with pytest.raises(TypeError, match="out_b must have dtype float32"):
        pagedvk.merge_attention_states(a, s, a.astype(np.float16), s)
    with pytest.raises(ValueError, match=r"lse_b must have shape \(2, 4\)"):
        pagedvk.merge_attention_states(a, s, a, s[:1])
    with pytest.raises(TypeError, match="lse_a must have dtype float32"):
        pagedvk.merge_attention_states(a, s.astype(np.float64), a, s)
    with pytest.raises(ValueError, match="head_size a positive multiple of 4"):
        pagedvk.merge_attention_states(*[np.ascontiguousarray(a[..., :30]), s] * 2)
    with pytest.raises(TypeError, match="out_a must"):
        pagedvk.merge_attention_states(a.astype(np.int32), s, a, s)


# -- prefill ------------------------------------------------------------------------------------------------

def prefill(case, query, key_cache, value_cache, backend, layout, causal=True, **kw):
    """(out, lse) of prefill and of the float64 reference, the last q_len tokens of each sequence as queries."""
    got = pagedvk.paged_attention_prefill(query, key_cache, value_cache, case.block_tables, case.seq_lens,
                                          layout=layout, causal=causal, backend=backend, **kw)
    ref = reference.paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                            causal=causal, layout="vllm", **kw)
    return got, ref


@pytest.mark.parametrize("variant,layout", tiered(
    [(v, layout) for v in VARIANTS for layout in ("vllm", "nhd")],
    default=[(v, ("vllm", "nhd")[i % 2]) for i, v in enumerate(VARIANTS)] + [("all", "vllm"), ("all", "nhd")]))
def test_prefill_each_variant_and_all(rng, backend, variant, layout, poisoned_prefill_outputs):
    case = Case(rng, seq_lens=[200, 9, 70], num_heads=8, num_kv_heads=2, head_size=32, block_size=16)
    query = rng.standard_normal((3, 8, 9, 32)).astype(np.float32)
    kw = variant_args(rng, 8, VARIANTS[variant])
    for causal in (True, False) if variant == "all" else (True,):
        (out, lse), (ref_out, ref_lse) = prefill(case, query, *in_layout(case, layout, np.float32), backend, layout,
                                                 causal, **kw)
        assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_prefill_all_variants_every_dtype(rng, backend, cache_dtype, poisoned_prefill_outputs):
    case = Case(rng, seq_lens=[150, 40], num_heads=4, num_kv_heads=1, head_size=32, block_size=8, dtype=cache_dtype)
    query_dtype = np.float32 if cache_dtype is np.float32 else np.float16
    query = rng.standard_normal((2, 4, 6, 32)).astype(query_dtype)
    kw = variant_args(rng, 4, VARIANTS["all"])
    (out, lse), (ref_out, ref_lse) = prefill(case, query, *in_layout(case, "nhd", cache_dtype), backend, "nhd", **kw)
    assert rel_error(out, ref_out) <= (TOL if query_dtype is np.float32 else 2e-3)
    assert rel_error(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("layout", ("vllm", "nhd"))
def test_ragged_prefill_with_every_variant(rng, backend, layout, poisoned_prefill_outputs):
    # A ragged batch (prompt chunks, a decode token, a sequence without new tokens), every variant at once.
    case = Case(rng, seq_lens=[200, 40, 90, 33], num_heads=8, num_kv_heads=2, head_size=32, block_size=16)
    q_lens = [17, 1, 0, 33]
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(loc[-1]), 8, 32)).astype(np.float32)
    kw = variant_args(rng, 8, VARIANTS["all"])
    out, lse = pagedvk.paged_attention_prefill(query, *in_layout(case, layout, np.float32), case.block_tables,
                                               case.seq_lens, loc, layout=layout, backend=backend, **kw)
    ref_out, ref_lse = reference.paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables,
                                                         case.seq_lens, loc, layout="vllm", **kw)
    assert rel_error(out, ref_out) <= TOL and rel_error(lse, ref_lse) <= TOL


@pytest.mark.parametrize("window_size", [(-1, -1), (40, 0), (40, -1)])
def test_unified_attention_takes_the_variants(rng, backend, window_size, monkeypatch):
    # vLLM's spelling: window_size (left, right), softcap 0 for none, alibi_slopes, sinks.
    monkeypatch.setenv("PAGEDVK_BACKEND", backend)
    case = Case(rng, seq_lens=[120, 9], num_heads=8, num_kv_heads=2, head_size=32, block_size=16)
    loc = np.array([0, 7, 16], np.int32)
    query = rng.standard_normal((16, 8, 32)).astype(np.float32)
    kw = variant_args(rng, 8, ["alibi_slopes", "sinks"])
    k, v = in_layout(case, "nhd", np.float32)
    out = np.full_like(query, np.nan)
    pagedvk.ops.vllm.unified_attention(query, k, v, out, loc, 9, case.seq_lens, 120, 0.2, True, window_size,
                                  case.block_tables, 1.5, None, None, None, **kw)
    ref, _ = reference.paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables,
                                               case.seq_lens, loc, scale=0.2, layout="vllm", logits_soft_cap=1.5,
                                               window_left=window_size[0], **kw)
    assert rel_error(out, ref) <= TOL


def test_prefill_window_does_not_read_blocks_before_it(rng, backend, poisoned_prefill_outputs):
    # NaN in every block wholly before the first query's window.
    case = Case(rng, seq_lens=[600, 300], num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    q_len, window_left = 5, 30
    query = rng.standard_normal((2, 4, q_len, 32)).astype(np.float32)
    ref = reference.paged_attention_prefill(query, *case.args()[1:], layout="vllm", window_left=window_left)
    for s, n in enumerate(case.seq_lens):
        for b in case.block_tables[s, :(n - q_len - window_left) // 16]:
            case.key_cache[b] = case.value_cache[b] = np.nan
    out, lse = pagedvk.paged_attention_prefill(query, *case.args()[1:], layout="vllm", backend=backend,
                                               window_left=window_left)
    assert rel_error(out, ref[0]) <= TOL and rel_error(lse, ref[1]) <= TOL


def test_prefill_of_one_token_equals_decode(rng, backend):
    # One query per sequence, every variant: prefill's out and lse are decode's.
    case = Case(rng, seq_lens=[130, 20, 64], num_heads=8, num_kv_heads=2, head_size=64)
    kw = variant_args(rng, 8, VARIANTS["all"])
    out, lse = pagedvk.paged_attention_prefill(case.query[:, :, None], *case.args()[1:], layout="vllm",
                                               backend=backend, **kw)
    d_out, d_lse = pagedvk.paged_attention(*case.args(), backend=backend, return_lse=True, **kw)
    assert rel_error(out[:, :, 0], d_out) <= 1e-6 and rel_error(lse[:, :, 0], d_lse) <= 1e-6


@pytest.mark.parametrize("name,value", [("alibi_slopes", np.zeros(4, np.float32)), ("logits_soft_cap", 5.0),
                                        ("sinks", np.zeros(4, np.float32)), ("window_left", 0)])
def test_backward_refuses_variants(rng, name, value):
    case = Case(rng, seq_lens=[20], num_heads=4, num_kv_heads=2, head_size=32)
    k, v = in_layout(case, "nhd", np.float32)
    q = rng.standard_normal((1, 4, 3, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=f"paged_attention_backward does not support attention variants: {name} "
                                         f"must be"):
        pagedvk.paged_attention_backward(q, q, k, v, case.block_tables, case.seq_lens, q,
                                         np.zeros((1, 4, 3), np.float32), layout="nhd", **{name: value})
    with pytest.raises(ValueError, match=r"logits_soft_cap must be 0 or None \(no softcapping\), or in \["):
        pagedvk.paged_attention_prefill(q, k, v, case.block_tables, case.seq_lens, layout="nhd", logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"sinks.shape\[0\] \(num_heads\) must be 4"):
        pagedvk.paged_attention_prefill(q, k, v, case.block_tables, case.seq_lens, layout="nhd",
                                        sinks=np.zeros(3, np.float32))


@pytest.mark.parametrize("split", (False, True), ids=("one_partition", "split"))
def test_runs_without_variants_take_the_pipeline_without_their_code(rng, backend, split, monkeypatch):
    """A run with no variant (nor lse) takes the pipeline specialized with VARIANTS false where the module has
    the constant (GLSL): shown by giving that pipeline a window through the push constants, which it then
    ignores. WGSL modules have no specialization constants and keep applying it."""
    case = Case(rng, seq_lens=[300, 45], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    key_cache, value_cache = in_layout(case, "vllm", np.float32)
    out = np.full(case.query.shape, np.nan, np.float32)
    with pagedvk.DecodePlan.for_caches(key_cache, value_cache, case.block_tables, case.seq_lens, 8, backend=backend,
                                       window_left=40, partition_size=32 if split else 512) as plan:
        assert (plan.num_partitions > 1) == split
        monkeypatch.setattr(pagedvk.ops.decode_plan, "variants_in_use", lambda push: False)   # the window, the plain pipeline
        plan.run(case.query, key_cache, value_cache, out=out)
    window_left = -1 if backend == "glsl" else 40
    assert rel_error(out, reference.paged_attention(*case.args(), window_left=window_left)) <= TOL
