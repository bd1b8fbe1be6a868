"""Prefill attention (paged_attention_prefill) against the float64 reference, on both backends, both cache
layouts, random data and outputs poisoned with NaN; every rejected input names its argument."""

import dataclasses

import numpy as np
import pytest

import pagedvk
import pagedvk.ops.prefill
import pagedvk.dtypes
import pagedvk.ops.vllm
import pagedvk.testing.reference
from support import (BLOCK_SIZES_CAUSAL_OR_NOT, HEAD_SIZES_AND_QUERY_LENGTHS, PREFILL_LAYOUTS, RAGGED_BATCHES,
                     PrefillCase, check_prefill, modules_used, poison_unread_slots, record_launches, rejects, rel_error,
                     tensors_by_name, tiered)

pytestmark = pytest.mark.usefixtures("poisoned_prefill_outputs")

TOL = 1e-5  # float32 storage



@pytest.mark.parametrize("layout,head_size,q_len", HEAD_SIZES_AND_QUERY_LENGTHS)
def test_head_sizes_and_query_lengths(rng, backend, layout, head_size, q_len):
    check_prefill(PrefillCase(rng, q_len=q_len, layout=layout, head_size=head_size), backend)


@pytest.mark.parametrize("block_size,layout,causal", BLOCK_SIZES_CAUSAL_OR_NOT)
def test_block_sizes_causal_or_not(rng, backend, block_size, layout, causal):
    check_prefill(PrefillCase(rng, q_len=7, layout=layout, causal=causal, block_size=block_size), backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", tiered([(8, 8), (8, 2), (8, 1), (12, 3)], default=[(8, 1), (12, 3)]))
def test_mha_gqa_mqa(rng, backend, num_heads, num_kv_heads):
    check_prefill(PrefillCase(rng, q_len=5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32), backend)


@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_shared_prefix_blocks(rng, backend, layout):
    case = PrefillCase(rng, q_len=4, layout=layout, seq_lens=[70, 40, 33, 100], shared_prefix_blocks=2)
    assert (case.block_tables[:, :2] == case.block_tables[0, :2]).all()
    check_prefill(case, backend)


def test_long_context_spans_many_tiles(rng, backend):
    check_prefill(PrefillCase(rng, q_len=20, seq_lens=[700, 20], block_size=32, num_heads=2, num_kv_heads=1), backend)


def test_causal_query_is_the_sequence_end(rng, backend):
    # Query i of a sequence of seq_len tokens is token seq_len - q_len + i: with causal masking it must
    # equal decode (an independent kernel) over the first seq_len - q_len + i + 1 tokens.
    case = PrefillCase(rng, q_len=6, layout="vllm", seq_lens=[6, 40, 131])
    out, _ = check_prefill(case, backend)
    for i in range(case.query.shape[2]):
        lens = (case.seq_lens - case.query.shape[2] + i + 1).astype(np.int32)
        decode = pagedvk.paged_attention(np.ascontiguousarray(case.query[:, :, i]), case.key_cache,
                                         case.value_cache, case.block_tables, lens, backend=backend)
        assert rel_error(out[:, :, i], decode) <= TOL


@pytest.mark.parametrize("head_size", tiered([64, 256], default=[64]))
def test_single_query_equals_decode(rng, backend, head_size):
    case = PrefillCase(rng, q_len=1, layout="vllm", head_size=head_size)
    out, _ = check_prefill(case, backend)
    decode = pagedvk.paged_attention(np.ascontiguousarray(case.query[:, :, 0]), case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens, backend=backend)
    assert rel_error(out[:, :, 0], decode) <= TOL


def test_empty_sequence_gives_zeros_and_minus_inf(rng, backend):
    case = PrefillCase(rng, q_len=3, seq_lens=[0, 20, 0])
    out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend, **case.options())
    assert (out[[0, 2]] == 0).all() and (lse[[0, 2]] == -np.inf).all()
    ref_out, ref_lse = case.reference()
    assert rel_error(out, ref_out) <= TOL
    assert rel_error(lse[1], ref_lse[1]) <= TOL


def test_custom_scale(rng, backend):
    check_prefill(PrefillCase(rng, q_len=3), backend, scale=0.37)


@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_nan_in_unread_cache_slots_does_not_leak(rng, backend, layout):
    case = PrefillCase(rng, q_len=2, layout="vllm", seq_lens=[21, 3], block_size=16)
    poison_unread_slots(case, 16)
    if layout == "nhd":
        k, v = pagedvk.testing.reference.caches_as_nhd(case.key_cache, case.value_cache, "vllm")
        case.key_cache = np.ascontiguousarray(k, dtype=np.float32)
        case.value_cache = np.ascontiguousarray(v, dtype=np.float32)
        case.layout = "nhd"
    check_prefill(case, backend)


def test_device_arrays_in_device_arrays_out(rng, backend, device):
    case = PrefillCase(rng, q_len=5)
    out, lse = pagedvk.paged_attention_prefill(*[pagedvk.asarray(a) for a in case.args()], backend=backend,
                                               **case.options())
    assert isinstance(out, pagedvk.DeviceArray) and isinstance(lse, pagedvk.DeviceArray)
    assert out.device is device and out.shape == case.query.shape and lse.shape == case.query.shape[:3]
    ref_out, ref_lse = case.reference()
    assert rel_error(out.numpy(), ref_out) <= TOL
    assert rel_error(lse.numpy(), ref_lse) <= TOL


# -- ragged batches: query [num_tokens, num_heads, head_size] with query_start_loc ---------------------------

@pytest.mark.parametrize("batch,layout", tiered([(b, layout) for b in RAGGED_BATCHES for layout in PREFILL_LAYOUTS],
                                                default=[(b, PREFILL_LAYOUTS[i % 2]) for i, b in enumerate(RAGGED_BATCHES)]))
def test_ragged_batches(rng, backend, layout, batch):
    check_prefill(PrefillCase(rng, q_lens=RAGGED_BATCHES[batch], layout=layout), backend)


@pytest.mark.parametrize("causal,num_heads,num_kv_heads", tiered(
    [(c, h, kv) for c in (True, False) for h, kv in ((4, 4), (16, 1), (12, 4))],
    default=[(True, 16, 1), (False, 12, 4)]))
def test_ragged_gqa_groups_and_causal(rng, backend, num_heads, num_kv_heads, causal):
    # A group of 16 heads spans two 8-row tiles per query; 12 / 4 = 3 rows per query straddle tile edges.
    check_prefill(PrefillCase(rng, q_lens=[3, 0, 6, 1], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                      causal=causal, block_size=8), backend)


def test_work_tiles_cover_each_sequence_and_skip_empty_ones():
    # 3 queries x group 4 = 12 rows: tiles at rows 0 and 8; no queries: no tile; 1 query: one tile.
    tiles = pagedvk.ops.prefill.work_tiles(np.array([0, 3, 3, 4], np.int32), group=4, rows_per_tile=8)
    assert tiles.dtype == np.int32 and tiles.tolist() == [[0, 0], [0, 8], [2, 0]]
    assert pagedvk.ops.prefill.work_tiles(np.array([0, 0], np.int32), 4, 8).shape == (0, 2)
    # include: the tiles of the chosen sequences only (the matrix and scalar halves of a mixed batch)
    loc = np.array([0, 3, 3, 4], np.int32)
    assert pagedvk.ops.prefill.work_tiles(loc, 4, 8, include=np.array([True, True, False])).tolist() == [[0, 0], [0, 8]]
    assert pagedvk.ops.prefill.work_tiles(loc, 4, 8, include=np.array([False, True, True])).tolist() == [[2, 0]]


def test_forward_tile_rows_follow_each_sequence_and_the_head_size():
    # The fewest of 8, 16, 32, 64 rows holding a sequence's rows; 32 at most above head size 128.
    rows = np.array([1, 8, 9, 16, 17, 33, 64, 200])
    assert pagedvk.ops.prefill.forward_rows(128, rows).tolist() == [8, 8, 16, 16, 32, 64, 64, 64]
    assert pagedvk.ops.prefill.forward_rows(256, rows).tolist() == [8, 8, 16, 16, 32, 32, 32, 32]
    # group 2: rows 2, 0, 14, 80 -> one 8-row tile, none, one 16-row tile, two 64-row tiles.
    tiles = pagedvk.ops.prefill.work_tiles(np.array([0, 1, 1, 8, 48], np.int32), group=2,
                                       rows_per_tile=lambda r: pagedvk.ops.prefill.forward_rows(64, r))
    assert tiles.tolist() == [[0, 0], [2, 0], [3, 0], [3, 64]]


@pytest.mark.parametrize("head_size,layout", tiered([(h, layout) for h in (72, 128, 192) for layout in PREFILL_LAYOUTS],
                                                    default=[(72, "vllm"), (128, "nhd")]))
def test_every_tile_size_over_long_contexts(rng, backend, layout, head_size):
    # Group 3: rows 3, 9, 21, 48, 105 give tiles of 8, 16, 32 and 64 rows (32 at most for head 192: its
    # 105 rows take four), key tiles of 256 down to 32 keys over contexts of several tiles whose lengths are
    # not multiples of 4 (vLLM's value quads run past a tile's end), and value sub-tiles that fill shared
    # memory (head 72: 18 quads a key). Head 128's 64-row tiles run the WGSL kernel's instance with its sizes
    # as constants (partial tiles of rows and keys included), its other tiles the generic one.
    check_prefill(PrefillCase(rng, q_lens=[1, 3, 7, 16, 35], seq_lens=[601, 263, 150, 97, 333], num_heads=6,
                      num_kv_heads=2, head_size=head_size, layout=layout, block_size=8), backend)


def test_ragged_batch_equals_its_parts_run_alone(rng, backend):
    # Each sequence's rows are tiled from the sequence's own first row, so running it alone does the same sums.
    case = PrefillCase(rng, q_lens=[4, 1, 0, 9], layout="vllm")
    out, lse = check_prefill(case, backend)
    loc = case.query_start_loc
    for s in range(len(loc) - 1):
        rows = slice(loc[s], loc[s + 1])
        alone = pagedvk.paged_attention_prefill(
            np.ascontiguousarray(case.query[rows]), case.key_cache, case.value_cache, case.block_tables[s:s + 1],
            case.seq_lens[s:s + 1], np.array([0, loc[s + 1] - loc[s]], np.int32), layout="vllm", backend=backend)
        assert np.array_equal(alone[0], out[rows]) and np.array_equal(alone[1], lse[rows])


def test_fixed_q_len_is_the_ragged_batch(rng, backend):
    case = PrefillCase(rng, q_len=5, layout="vllm")
    out, lse = check_prefill(case, backend)
    num_seqs, num_heads, q_len, head_size = case.query.shape
    ragged = np.ascontiguousarray(case.query.transpose(0, 2, 1, 3).reshape(-1, num_heads, head_size))
    loc = (np.arange(num_seqs + 1) * q_len).astype(np.int32)
    r_out, r_lse = pagedvk.paged_attention_prefill(ragged, *case.args()[1:], loc, layout="vllm", backend=backend)
    assert np.array_equal(r_out, out.transpose(0, 2, 1, 3).reshape(ragged.shape))
    assert np.array_equal(r_lse, lse.transpose(0, 2, 1).reshape(-1, num_heads))


def test_ragged_decode_tokens_equal_decode(rng, backend):
    case = PrefillCase(rng, q_lens=[1, 1, 1], layout="vllm", head_size=128)
    out, _ = check_prefill(case, backend)
    decode = pagedvk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, backend=backend)
    assert rel_error(out, decode) <= TOL


def test_batch_without_queries(rng, backend):
    case = PrefillCase(rng, q_lens=[0, 0], seq_lens=[5, 0])
    out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend, **case.options())
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_ragged_device_arrays(rng, backend, device):
    case = PrefillCase(rng, q_lens=[2, 0, 7])
    out, lse = pagedvk.paged_attention_prefill(*[pagedvk.asarray(a) for a in case.args()], backend=backend,
                                               **case.options())
    assert isinstance(out, pagedvk.DeviceArray) and out.shape == case.query.shape and lse.shape == (9, 4)
    ref_out, ref_lse = case.reference()
    assert rel_error(out.numpy(), ref_out) <= TOL
    assert rel_error(lse.numpy(), ref_lse) <= TOL


@pytest.mark.parametrize("q_lens,routed", [
    ([5, 1, 1, 1, 9], True),    # decode tokens between prefill chunks
    ([1, 1, 0, 7], True),       # first, an empty sequence after them
    ([1, 1, 1], True),          # decode only
    ([1, 3, 1], False),         # not consecutive: the prefill kernels take them
    (None, True),               # the fixed form with q_len 1
])
@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_mixed_batch_decode_tokens_run_the_decode_kernel(rng, backend, monkeypatch, layout, q_lens, routed):
    used = modules_used(monkeypatch)
    # contexts long enough that the decode part splits them (partitions merged by its reduce)
    seq_lens = None if q_lens is None else [n + int(rng.integers(300, 900)) for n in q_lens]
    case = PrefillCase(rng, q_lens=q_lens, q_len=1 if q_lens is None else None, layout=layout, seq_lens=seq_lens,
                       head_size=128)
    check_prefill(case, backend)
    assert (("paged_decode", backend) in used) == routed
    assert (("paged_prefill", backend) in used) == (q_lens is not None and max(q_lens) > 1)
    del used[:]
    check_prefill(case, backend, kernel="scalar")   # a kernel asked for by name takes every sequence itself
    assert used == [("paged_prefill", backend)]


def test_mixed_batch_runs_decode_and_prefill_side_by_side(rng, monkeypatch):
    # The prefill tiles, the decode dispatch beside them with no barrier in between, the decode's merge of split
    # contexts after one barrier: one barrier in all where the forward ran them one after the other (2).
    barriers, recorded = record_launches(monkeypatch)
    q_lens = [5, 1, 1, 1, 9]
    case = PrefillCase(rng, q_lens=q_lens, layout="nhd", head_size=128,
                       seq_lens=[n + int(rng.integers(300, 900)) for n in q_lens])
    check_prefill(case, "glsl")
    names, independent = recorded[-1]
    assert [n.split(".")[0] for n in names] == ["paged_prefill", "paged_decode", "paged_decode_reduce"], names
    assert independent == {1}
    assert len(barriers) == 1


def test_independent_steps_cannot_split_timestamped_groups(device):
    from pagedvk.runtime.pipeline import Launch
    with pytest.raises(ValueError, match="independent"):
        Launch(device, [], timestamps=1, independent=frozenset({2}))


def test_decode_tokens_at_an_offset_the_device_cannot_bind_stay_in_the_prefill_launch(rng, device, monkeypatch):
    from pagedvk.ops.prefill import PrefillProblem, decode_tokens
    # one head of 4 float32 dims: the decode tokens' query rows start at byte 32 and their lse rows at byte 8
    case = PrefillCase(rng, q_lens=[2, 1, 1], num_heads=1, num_kv_heads=1, head_size=4)
    problem = PrefillProblem(*case.args(), **case.options())
    for align, tokens in ((4, (1, 3)), (8, (1, 3)), (16, None), (64, None)):
        monkeypatch.setattr(device, "info", dataclasses.replace(device.info, min_storage_buffer_offset_alignment=align))
        assert decode_tokens(problem, np.array([2, 1, 1])) == tokens
    first = PrefillCase(rng, q_lens=[1, 1, 2], num_heads=1, num_kv_heads=1, head_size=4)
    assert decode_tokens(PrefillProblem(*first.args(), **first.options()), np.array([1, 1, 2])) == (0, 2)   # offset 0


def test_backend_from_environment(rng, monkeypatch):
    used = modules_used(monkeypatch)
    monkeypatch.setenv("PAGEDVK_BACKEND", "wgsl")
    check_prefill(PrefillCase(rng, q_len=2), None)
    assert used == [("paged_prefill", "wgsl")]


# -- rejected inputs: a ValueError or TypeError that names the argument ------------------------------------

@pytest.fixture
def case(rng):
    return PrefillCase(rng, q_len=4, seq_lens=[10, 30, 4])


def rejects_prefill(case, exc, match, **changes):
    """paged_attention_prefill on the case with `changes` (tensors or options) raises."""
    rejects(pagedvk.paged_attention_prefill, dict(tensors_by_name(case), **case.options()), exc, match, **changes)


def test_rejects_bad_layout(case):
    rejects_prefill(case, ValueError, "layout must be one of 'vllm', 'nhd', 'hnd', got 'NHD'", layout="NHD")


def test_rejects_layout_not_matching_the_caches(case):
    rejects_prefill(case, ValueError, r"key_cache must have 5 dimensions", layout="vllm")


def test_rejects_seq_len_shorter_than_q_len(case):
    case.seq_lens[1] = 3
    rejects_prefill(case, ValueError, r"seq_lens\[1\] = 3 is less than q_len")


def test_rejects_negative_seq_len(case):
    case.seq_lens[2] = -1
    rejects_prefill(case, ValueError, r"seq_lens\[2\] = -1 is outside")


def test_rejects_block_id_out_of_range(case):
    case.block_tables[1, 1] = case.key_cache.shape[0]
    rejects_prefill(case, ValueError, r"block_tables\[1, 1\]")
    case.block_tables[1, 1] = -1
    rejects_prefill(case, ValueError, r"block_tables\[1, 1\] = -1")


def test_block_ids_past_the_used_blocks_are_not_checked(case, backend):
    case.block_tables[:, -1] = 10_000   # padding columns no sequence reaches
    check_prefill(case, backend)


def test_rejects_num_heads_not_a_multiple_of_kv_heads(rng):
    case = PrefillCase(rng, q_len=2, num_heads=3, num_kv_heads=2)
    rejects_prefill(case, ValueError, r"query.shape\[1\] \(num_heads\) must be a positive multiple of num_kv_heads")


@pytest.mark.parametrize("name,value,match", [
    ("query", lambda c: c.query[0, 0], r"query must have 3 dimensions \[num_tokens, num_heads, head_size\] \(with "
                                       r"query_start_loc\) or 4 \[num_seqs, num_heads, q_len, head_size\], got"),
    ("query", lambda c: c.query[..., :32].copy(), r"query.shape\[3\] \(head_size, from the caches\) must be 64"),
    ("query", lambda c: c.query[:2].copy(), r"block_tables.shape\[0\] \(num_seqs, from query\) must be 2"),
    ("query", lambda c: c.query[:, :, :0].copy(), r"query.shape\[2\] \(q_len\) must be at least 1"),
    ("key_cache", lambda c: c.key_cache[..., :32].copy(), r"value_cache.shape\[3\] \(head_size\) must be 32"),
    ("key_cache", lambda c: c.key_cache[:, :12].copy(),
     r"block_size \(key_cache.shape\[1\]\) must be one of 1, 2, 4, 8, 16, 32 in layout 'nhd', got 12"),
    ("value_cache", lambda c: c.value_cache[:, :, :1].copy(), r"value_cache.shape\[2\] \(num_kv_heads\) must be 2"),
    ("key_cache", lambda c: c.key_cache[..., :6].copy(), r"head_size \(key_cache.shape\[3\]\) must be a multiple of 4"),
    ("block_tables", lambda c: c.block_tables[0], r"block_tables must have 2 dimensions"),
    ("seq_lens", lambda c: c.seq_lens[:2], r"seq_lens.shape\[0\] \(num_seqs, from query\) must be 3"),
])
def test_rejects_wrong_shapes(case, name, value, match):
    rejects_prefill(case, ValueError, match, **{name: value(case)})


@pytest.mark.parametrize("name,dtype", [("query", np.float64), ("key_cache", np.float64), ("value_cache", np.float64),
                                        ("block_tables", np.int64), ("seq_lens", np.uint32)])
def test_rejects_wrong_dtypes(case, name, dtype):
    rejects_prefill(case, TypeError, f"{name} must have dtype", **{name: getattr(case, name).astype(dtype)})


def test_takes_strided_numpy_arrays(case):
    # Views of larger arrays and Fortran-ordered arrays in, a view out (vLLM's out slices): the result is the
    # contiguous arrays', written through the caller's view.
    want_out, want_lse = check_prefill(case, "glsl")
    for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"):
        setattr(case, name, np.asfortranarray(getattr(case, name)))
    case.query = np.concatenate([case.query, case.query], axis=-1)[..., :case.query.shape[-1]]
    assert not case.query.flags.c_contiguous and not case.key_cache.flags.c_contiguous
    wide = np.full(case.query.shape[:-1] + (2 * case.query.shape[-1],), np.nan, np.float32)
    out = wide[..., 1::2]
    result, lse = pagedvk.paged_attention_prefill(*case.args(), out=out, **case.options())
    assert result is out
    np.testing.assert_array_equal(wide[..., 1::2], want_out)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isnan(wide[..., ::2]).all()


def test_rejects_lists_and_bad_options(case):
    rejects_prefill(case, TypeError, "query must be a numpy array", query=case.query.tolist())
    rejects_prefill(case, TypeError, "causal must be a bool", causal=1)
    rejects_prefill(case, ValueError, "scale must be finite", scale=float("inf"))
    rejects_prefill(case, ValueError, "backend must be one of glsl, wgsl", backend="hlsl")


@pytest.fixture
def ragged(rng):
    return PrefillCase(rng, q_lens=[3, 0, 5], seq_lens=[3, 10, 20])


def rejects_ragged(case, exc, match, query_start_loc):
    with pytest.raises(exc, match=match):
        pagedvk.paged_attention_prefill(*case.args()[:5], query_start_loc, **case.options())


@pytest.mark.parametrize("value,exc,match", [
    (None, TypeError, r"query_start_loc \(int32 \[num_seqs \+ 1\]\) is required with a ragged query"),
    ([0.0, 3.0, 3.0, 8.0], TypeError, "query_start_loc must be an int32 array or a sequence of ints, got a sequence of "
                                      "float64 values"),
    (np.array([0, 3, 3, 8], np.int64), TypeError, "query_start_loc must have dtype int32"),
    (np.array([[0, 3, 3, 8]], np.int32), ValueError, "query_start_loc must have 1 dimensions"),
    (np.array([0, 3, 8], np.int32), ValueError,
     r"block_tables.shape\[0\] \(num_seqs, from query_start_loc\) must be 2"),
    (np.array([1, 3, 3, 8], np.int32), ValueError, r"query_start_loc\[0\] must be 0, got 1"),
    (np.array([0, 4, 3, 8], np.int32), ValueError,
     r"non-decreasing: query_start_loc\[2\] = 3 < query_start_loc\[1\] = 4"),
    (np.array([0, 3, 3, 7], np.int32), ValueError,
     r"query_start_loc\[-1\] must be num_tokens \(query.shape\[0\]\) = 8"),
    (np.array([0, 4, 4, 8], np.int32), ValueError, r"seq_lens\[0\] = 3 is less than q_len_s = query_start_loc\[1\] - "
                                                 r"query_start_loc\[0\] = 4"),
])
def test_rejects_bad_query_start_loc(ragged, value, exc, match):
    rejects_ragged(ragged, exc, match, value)


def test_rejects_query_start_loc_with_a_fixed_q_len_query(case):
    with pytest.raises(ValueError, match="query_start_loc goes with a ragged query"):
        pagedvk.paged_attention_prefill(*case.args(), np.array([0, 4, 8, 12], np.int32), **case.options())


def test_rejects_ragged_seq_len_of_zero_with_queries(ragged):
    ragged.seq_lens[2] = 0
    rejects_ragged(ragged, ValueError, r"seq_lens\[2\] = 0 is less than q_len_s", ragged.query_start_loc)


# -- vLLM's spelling of a mixed batch: pagedvk.ops.vllm.unified_attention ----------------------------------------

def unified_args(case, out=None, **changes):
    lens = case.seq_lens
    args = dict(q=case.query, k=case.key_cache, v=case.value_cache, out=out, cu_seqlens_q=case.query_start_loc,
                max_seqlen_q=int(np.diff(case.query_start_loc).max()), seqused_k=lens, max_seqlen_k=int(lens.max()),
                softmax_scale=0.3, causal=True, window_size=(-1, -1), block_table=case.block_tables, softcap=0,
                q_descale=None, k_descale=None, v_descale=None)
    return dict(args, **changes)


def test_unified_attention_writes_out(rng, device):
    case = PrefillCase(rng, q_lens=[4, 1, 0, 6, 1])
    ref, _ = case.reference(0.3)
    out = np.full_like(case.query, np.nan)
    assert pagedvk.ops.vllm.unified_attention(**unified_args(case, out)) is out
    assert rel_error(out, ref) <= TOL
    dev_out = pagedvk.asarray(np.full_like(case.query, np.nan))
    assert pagedvk.ops.vllm.unified_attention(**unified_args(case, dev_out, q=pagedvk.asarray(case.query))) is dev_out
    assert rel_error(dev_out.numpy(), ref) <= TOL


def test_unified_attention_fp8_descales(rng):
    case = PrefillCase(rng, q_lens=[3, 1])
    k8 = pagedvk.testing.reference.cache_element(case.key_cache, pagedvk.dtypes.FP8_E4M3.dtype, 0.5)
    v8 = pagedvk.testing.reference.cache_element(case.value_cache, pagedvk.dtypes.FP8_E4M3.dtype, 0.25)
    descale = np.full((2, 2), 0.5, np.float32)   # vLLM's shape: [num_seqs, num_kv_heads]
    out = np.full_like(case.query, np.nan)
    pagedvk.ops.vllm.unified_attention(**unified_args(case, out, k=k8, v=v8, k_descale=descale, v_descale=0.25))
    ref, _ = pagedvk.testing.reference.paged_attention_prefill(case.query, k8.astype(np.float64) * 0.5,
                                                       v8.astype(np.float64) * 0.25, case.block_tables, case.seq_lens,
                                                       case.query_start_loc, scale=0.3, layout="nhd")
    assert rel_error(out, ref) <= 1e-5


@pytest.mark.parametrize("name,value,match", [
    ("window_size", (128, 5), r"a window to the right of the query \(window_size\[1\] = 5, not -1 or 0\)"),
    ("q_descale", 1.0, "query scaling"),
    ("output_scale", 1.0, "fp8 output"),
    ("qq_bias", np.zeros((8, 8), np.float32), "a query bias"),
    ("k_descale", np.array([[1.0, 2.0]], np.float32), "differs between sequences or kv heads"),
])
def test_unified_attention_unsupported_options(rng, name, value, match):
    case = PrefillCase(rng, q_lens=[3, 5])
    k = pagedvk.testing.reference.cache_element(case.key_cache, pagedvk.dtypes.FP8_E4M3.dtype)
    with pytest.raises(NotImplementedError, match=f"{match} \\({name}\\) is not supported"):
        pagedvk.ops.vllm.unified_attention(**unified_args(case, np.empty_like(case.query), k=k, v=k, **{name: value}))


@pytest.mark.parametrize("changes,exc,match", [
    (dict(out=None), TypeError, "out must be an array of q's shape"),
    (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q \(4\) is less than the longest length in the batch \(5\)"),
    (dict(max_seqlen_k=1), ValueError, r"max_seqlen_k \(1\) is less than"),
    (dict(cu_seqlens_q=[0.0, 3.0, 8.0]), TypeError, "cu_seqlens_q must be an int32 array or a sequence of ints"),
])
def test_unified_attention_rejects(rng, changes, exc, match):
    case = PrefillCase(rng, q_lens=[3, 5])
    with pytest.raises(exc, match=match):
        pagedvk.ops.vllm.unified_attention(**unified_args(case, **dict(dict(out=np.empty_like(case.query)), **changes)))
