"""Property tests: hypothesis draws the shapes, lengths and block tables, and every result must match the
float64 reference to 1e-5 relative (float32 storage; 16-bit and fp8 caches to their types' precision, on the
dequantized values). Examples are bounded by the tier's hypothesis profile (tests/conftest.py: 12 by default, 40
with --hypothesis-profile=full), so the file runs in a few minutes on lavapipe with a cold shader cache."""

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pagedvk
import pagedvk.testing.reference
from support import rel_error   # relative, or absolute where the reference is exactly zero

SETTINGS = settings(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
TOLERANCE = 1e-5


@st.composite
def paged_tables(draw, num_seqs, block_size, min_len=1, max_len=600):
    """(block_tables, seq_lens, num_blocks): lengths 0 and up; physical blocks shuffled; the first blocks
    of several sequences possibly shared (a common prefix); spare blocks no sequence uses; padding past
    each sequence's used blocks holding -1, out-of-range ids or other sequences' blocks (never read)."""
    lengths = st.one_of(st.just(0), st.integers(min_len, max_len))
    seq_lens = draw(st.lists(lengths, min_size=num_seqs, max_size=num_seqs))
    used = [-(-n // block_size) for n in seq_lens]
    shared = draw(st.integers(0, min(used + [3])))           # prefix blocks common to every sequence
    spare = draw(st.integers(0, 4))
    own = [u - shared for u in used]
    num_blocks = max(shared + sum(own) + spare, 1)
    perm = draw(st.permutations(range(num_blocks)))
    prefix, pool = perm[:shared], list(perm[shared:])
    width = max(used + [1]) + draw(st.integers(0, 3))        # extra padding columns
    padding = draw(st.sampled_from(["minus_one", "out_of_range", "other_blocks"]))
    pad_value = {"minus_one": lambda: -1, "out_of_range": lambda: num_blocks + 7,
                 "other_blocks": lambda: perm[0]}[padding]
    tables = np.empty((num_seqs, width), np.int32)
    for s in range(num_seqs):
        row = list(prefix) + [pool.pop() for _ in range(own[s])]
        tables[s] = row + [pad_value() for _ in range(width - len(row))]
    return tables, np.array(seq_lens, np.int32), num_blocks


# Pipelines are specialized on the head size, and each costs lavapipe seconds to compile cold: the default tier draws
# head sizes from the edges and a few models' (pipelines the other tests share), the full tier any multiple of 4.
DEFAULT_TIER_HEAD_SIZES = (4, 64, 80, 128, 256)


def head_sizes():
    if settings.get_current_profile_name() == "full":
        return st.integers(1, 64).map(lambda n: 4 * n)
    return st.sampled_from(DEFAULT_TIER_HEAD_SIZES)


@st.composite
def heads(draw, max_kv_heads=4):
    """(num_heads, num_kv_heads, head_size): MHA, GQA and MQA ratios; head sizes multiples of 4 up to 256."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4][:max_kv_heads.bit_length()]))
    return num_kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8])), num_kv_heads, draw(head_sizes())


@st.composite
def decode_problems(draw):
    num_seqs = draw(st.integers(1, 6))
    num_heads, num_kv_heads, head_size = draw(heads())
    block_size = draw(st.sampled_from([8, 16, 32]))
    block_tables, seq_lens, num_blocks = draw(paged_tables(num_seqs, block_size))
    return dict(num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=block_size, block_tables=block_tables, seq_lens=seq_lens, num_blocks=num_blocks,
                seed=draw(st.integers(0, 2**32 - 1)), on_device=draw(st.booleans()))


def assert_matches(out, ref, seq_lens):
    """Each sequence within TOLERANCE of the reference (relative to its norm); empty ones exactly 0."""
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert (out[s] == 0).all(), f"sequence {s} has no tokens but a non-zero output"
            continue
        err = np.linalg.norm(out[s] - ref[s]) / max(np.linalg.norm(ref[s]), 1e-30)
        assert err <= TOLERANCE, f"sequence {s} (length {n}): relative error {err:.2e}"


@SETTINGS
@given(p=decode_problems())
def test_decode_matches_reference(p, device):
    rng = np.random.default_rng(p["seed"])
    hs, bs, kv = p["head_size"], p["block_size"], p["num_kv_heads"]
    key_cache = rng.standard_normal((p["num_blocks"], kv, hs // 4, bs, 4)).astype(np.float32)
    value_cache = rng.standard_normal((p["num_blocks"], kv, hs, bs)).astype(np.float32)
    query = rng.standard_normal((p["num_seqs"], p["num_heads"], hs)).astype(np.float32)
    bt, sl = p["block_tables"], p["seq_lens"]
    ref = pagedvk.testing.reference.paged_attention(query, key_cache, value_cache, bt, sl)
    if p["on_device"]:   # device caches and tables through a plan, as an engine would keep them
        arrays = [pagedvk.asarray(a) for a in (query, key_cache, value_cache, bt, sl)]
        q, k, v, dbt, dsl = arrays
        with pagedvk.DecodePlan.for_caches(k, v, dbt, dsl, num_heads=p["num_heads"]) as plan:
            out = plan.run(q, k, v)
            arrays.append(out)
            result = out.numpy()
        for a in arrays:
            a.close()
    else:
        result = pagedvk.paged_attention(query, key_cache, value_cache, bt, sl)
    assert_matches(result, ref, sl)


STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
           "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
# Relative error against float64 on the stored (dequantized) values: the queries, weights and outputs round to the
# 16-bit type (float16 queries for fp8 caches), about 4 units of its last place.
STORAGE_TOLERANCE = {"float32": TOLERANCE, "float16": 3e-3, "bfloat16": 2e-2, "float8_e4m3fn": 3e-3,
                     "float8_e5m2": 3e-3}


@st.composite
def decode_plan_problems(draw):
    """decode_problems over every storage type and cache layout, both kernels and backends, forced splits, fp8
    scales, the attention variants and lse: combinations the parametrized tests do not each reach."""
    num_seqs = draw(st.integers(1, 5))
    num_heads, num_kv_heads, head_size = draw(heads())
    block_size = draw(st.sampled_from([8, 16, 32]))
    block_tables, seq_lens, num_blocks = draw(paged_tables(num_seqs, block_size, max_len=400))
    dtype = draw(st.sampled_from(sorted(STORAGE)))
    layout = draw(st.sampled_from(["vllm", "nhd"]))
    # vLLM's key layout packs 16 bytes of a token's dims a chunk: the head size must fill whole chunks
    assume(layout == "nhd" or head_size % (16 // np.dtype(STORAGE[dtype]).itemsize) == 0)
    fp8 = dtype.startswith("float8")
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                block_tables=block_tables, seq_lens=seq_lens, num_blocks=num_blocks, dtype=dtype, layout=layout,
                kernel=draw(st.sampled_from(["gpu", "cpu"])), backend=draw(st.sampled_from(["glsl", "wgsl"])),
                partition_size=draw(st.one_of(st.none(), st.integers(1, 8).map(lambda k: k * block_size))),
                scales=draw(st.sampled_from([(1.0, 1.0), (0.5, 2.0), (3.0, 0.25)])) if fp8 else (1.0, 1.0),
                window_left=draw(st.one_of(st.just(-1), st.integers(0, 300))),
                logits_soft_cap=draw(st.one_of(st.none(), st.floats(1.0, 50.0))), alibi=draw(st.booleans()),
                sinks=draw(st.booleans()), lse=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(p=decode_plan_problems())
def test_decode_plans_match_reference_across_storage_kernels_and_variants(p, device):
    rng = np.random.default_rng(p["seed"])
    hs, bs, kv, heads_ = p["head_size"], p["block_size"], p["num_kv_heads"], p["num_heads"]
    storage, (k_scale, v_scale) = STORAGE[p["dtype"]], p["scales"]
    qdtype = np.float16 if p["dtype"].startswith("float8") else storage
    nb, x = p["num_blocks"], 16 // np.dtype(storage).itemsize
    k_nhd = rng.standard_normal((nb, bs, kv, hs)).astype(storage)   # [block, token, kv head, dim]
    v_nhd = rng.standard_normal((nb, bs, kv, hs)).astype(storage)
    query = rng.standard_normal((len(p["seq_lens"]), heads_, hs)).astype(qdtype)
    alibi = rng.uniform(-0.5, 0.0, heads_).astype(np.float32) if p["alibi"] else None
    sinks = rng.standard_normal(heads_).astype(np.float32) if p["sinks"] else None
    # The reference reads vLLM's layout (x = 4) of the dequantized values.
    as_vllm_keys = lambda k, x: k.transpose(0, 2, 3, 1).reshape(nb, kv, hs // x, x, bs).transpose(0, 1, 2, 4, 3)
    ref, ref_lse = pagedvk.testing.reference.paged_attention(
        query.astype(np.float64), as_vllm_keys(k_nhd.astype(np.float64) * k_scale, 4),
        v_nhd.astype(np.float64).transpose(0, 2, 3, 1) * v_scale, p["block_tables"], p["seq_lens"],
        alibi_slopes=alibi, logits_soft_cap=p["logits_soft_cap"], sinks=sinks, window_left=p["window_left"],
        return_lse=True)
    if p["layout"] == "nhd":
        key_cache, value_cache = k_nhd, v_nhd
    else:
        key_cache = np.ascontiguousarray(as_vllm_keys(k_nhd, x))
        value_cache = np.ascontiguousarray(v_nhd.transpose(0, 2, 3, 1))
    out = np.full(query.shape, np.nan, qdtype)   # poisoned
    lse = np.full(query.shape[:2], np.nan, np.float32) if p["lse"] else None
    with pagedvk.DecodePlan(p["block_tables"], p["seq_lens"], num_heads=heads_, num_kv_heads=kv, head_size=hs,
                            block_size=bs, num_blocks=nb, dtype=storage, layout=p["layout"], backend=p["backend"],
                            partition_size=p["partition_size"], kernel=p["kernel"], k_scale=k_scale,
                            v_scale=v_scale, alibi_slopes=alibi, logits_soft_cap=p["logits_soft_cap"], sinks=sinks,
                            window_left=p["window_left"]) as plan:
        plan.run(query, key_cache, value_cache, out=out, lse=lse)
    got = np.asarray(out, np.float64)
    for s, n in enumerate(p["seq_lens"]):
        if not np.linalg.norm(ref[s]):   # no key seen (an empty sequence, or an empty window with no sink)
            assert (got[s] == 0).all(), f"sequence {s} (length {n}) sees no key but has a non-zero output"
            continue
        err = np.linalg.norm(got[s] - ref[s]) / np.linalg.norm(ref[s])
        assert err <= STORAGE_TOLERANCE[p["dtype"]], f"sequence {s} (length {n}): relative error {err:.2e}"
    if lse is not None:
        seen = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-3, atol=1e-3)
        assert np.isneginf(lse[~seen]).all()


# -- prefill and its backward ---------------------------------------------------------------------------


@st.composite
def prefill_problems(draw):
    """A prefill problem in either cache layout, causal or not: each sequence's last q_len tokens are its
    queries, so every length is 0 (an empty sequence) or at least q_len."""
    num_seqs = draw(st.integers(1, 4))
    num_heads, num_kv_heads, head_size = draw(heads())
    block_size = draw(st.sampled_from([8, 16, 32]))
    q_len = draw(st.integers(1, 12))
    block_tables, seq_lens, num_blocks = draw(paged_tables(num_seqs, block_size, min_len=q_len, max_len=200))
    layout, causal = draw(st.sampled_from(["nhd", "vllm"])), draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if layout == "nhd":
        k_shape = v_shape = (num_blocks, block_size, num_kv_heads, head_size)
    else:
        k_shape = (num_blocks, num_kv_heads, head_size // 4, block_size, 4)
        v_shape = (num_blocks, num_kv_heads, head_size, block_size)
    args = (rng.standard_normal((num_seqs, num_heads, q_len, head_size)).astype(np.float32),
            rng.standard_normal(k_shape).astype(np.float32), rng.standard_normal(v_shape).astype(np.float32),
            block_tables, seq_lens)
    return args, dict(layout=layout, causal=causal), rng




@SETTINGS
@given(p=prefill_problems())
def test_prefill_matches_reference(p, device):
    args, options, _ = p
    out, lse = pagedvk.paged_attention_prefill(*args, **options)
    ref_out, ref_lse = pagedvk.testing.reference.paged_attention_prefill(*args, **options)
    assert_matches(out, ref_out, args[4])
    empty = args[4] == 0
    assert np.isneginf(lse[empty]).all()   # no keys: -inf
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=TOLERANCE, atol=TOLERANCE)


@settings(SETTINGS, max_examples=max(SETTINGS.max_examples * 5 // 8, 1))   # the backward: 5/8 of the others
@given(p=prefill_problems())
def test_backward_matches_reference(p, device):
    # On the reference forward's out and lse (rounded to float32), as an autograd engine would pass them.
    # A query that sees one key has dq exactly 0 in float64; float32 rounding of out leaves ~1e-7 there,
    # which rel_error measures absolutely.
    args, options, rng = p
    out, lse = pagedvk.testing.reference.paged_attention_prefill(*args, **options)
    dout = rng.standard_normal(args[0].shape).astype(np.float32)
    grads = pagedvk.paged_attention_backward(dout, *args, out.astype(np.float32), lse.astype(np.float32), **options)
    refs = pagedvk.testing.reference.paged_attention_backward(dout, *args, **options)
    for name, g, ref in zip(("dq", "dk_cache", "dv_cache"), grads, refs):
        assert rel_error(g, ref) <= TOLERANCE, name
