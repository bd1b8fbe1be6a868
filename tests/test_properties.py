"""Property tests: hypothesis draws the shapes, lengths and block tables, and every result must match the
float64 reference to 1e-5 relative. Examples are bounded so the file runs in well under a minute on
lavapipe."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedvk
from conftest import rel_error   # relative, or absolute where the reference is exactly zero

SETTINGS = settings(max_examples=40, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
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


@st.composite
def heads(draw, max_kv_heads=4):
    """(num_heads, num_kv_heads, head_size): MHA, GQA and MQA ratios; head sizes multiples of 4 up to 256."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4][:max_kv_heads.bit_length()]))
    return num_kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8])), num_kv_heads, 4 * draw(st.integers(1, 64))


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
    ref = pagedvk.reference.paged_attention(query, key_cache, value_cache, bt, sl)
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
    ref_out, ref_lse = pagedvk.reference.paged_attention_prefill(*args, **options)
    assert_matches(out, ref_out, args[4])
    empty = args[4] == 0
    assert np.isneginf(lse[empty]).all()   # no keys: -inf
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=TOLERANCE, atol=TOLERANCE)


@settings(SETTINGS, max_examples=25)
@given(p=prefill_problems())
def test_backward_matches_reference(p, device):
    # On the reference forward's out and lse (rounded to float32), as an autograd engine would pass them.
    # A query that sees one key has dq exactly 0 in float64; float32 rounding of out leaves ~1e-7 there,
    # which rel_error measures absolutely.
    args, options, rng = p
    out, lse = pagedvk.reference.paged_attention_prefill(*args, **options)
    dout = rng.standard_normal(args[0].shape).astype(np.float32)
    grads = pagedvk.paged_attention_backward(dout, *args, out.astype(np.float32), lse.astype(np.float32), **options)
    refs = pagedvk.reference.paged_attention_backward(dout, *args, **options)
    for name, g, ref in zip(("dq", "dk_cache", "dv_cache"), grads, refs):
        assert rel_error(g, ref) <= TOLERANCE, name
