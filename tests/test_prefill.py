"""Prefill attention (paged_attention_prefill) against the float64 reference, on both backends, both cache
layouts, random data and outputs poisoned with NaN; every rejected input names its argument."""

import numpy as np
import pytest

import pagedvk
from conftest import Case, poison_unread_slots, rel_error

TOL = 1e-5  # float32 storage
HEAD_SIZES = (32, 64, 80, 128, 256)
Q_LENS = (1, 3, 16, 64)
LAYOUTS = ("nhd", "vllm")
NAN_BITS = 0x7FC00000  # a float32 quiet NaN, as the 32-bit word vkCmdFillBuffer writes


@pytest.fixture(params=("glsl", "wgsl"))
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every array the ops allocate for their results starts as NaN: an element a kernel never writes
    stays NaN and fails rel_error's finiteness check (or a comparison with zero)."""
    def poisoned_empty(shape, dtype=np.float32, device=None):
        a = pagedvk.empty(shape, dtype, device)
        a.device.fill(a.buffer, NAN_BITS)
        return a
    monkeypatch.setattr(pagedvk.prefill, "empty", poisoned_empty)


class PrefillCase:
    """A random prefill problem: conftest.Case's shuffled paged cache (shared prefix blocks, padding
    columns of -1 in the block table) in either layout, and q_len queries per sequence."""

    def __init__(self, rng, *, q_len, layout="nhd", causal=True, num_heads=4, num_kv_heads=2, head_size=64,
                 block_size=16, seq_lens=None, shared_prefix_blocks=0):
        if seq_lens is None:   # one sequence that is all query, others with cached context before it
            seq_lens = [q_len, q_len + 150, q_len + int(rng.integers(1, 40))]
        case = Case(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                    block_size=block_size, seq_lens=seq_lens, shared_prefix_blocks=shared_prefix_blocks)
        self.block_tables, self.seq_lens = case.block_tables, case.seq_lens
        self.key_cache, self.value_cache = case.key_cache, case.value_cache
        if layout == "nhd":
            k, v = pagedvk.reference.caches_as_nhd(case.key_cache, case.value_cache, "vllm")
            self.key_cache = np.ascontiguousarray(k, dtype=np.float32)
            self.value_cache = np.ascontiguousarray(v, dtype=np.float32)
        shape = (len(self.seq_lens), num_heads, q_len, head_size)
        self.query = rng.standard_normal(shape).astype(np.float32)
        self.layout, self.causal = layout, causal

    def args(self):
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens

    def options(self, **kw):
        return dict(dict(layout=self.layout, causal=self.causal), **kw)

    def reference(self, scale=None):
        return pagedvk.reference.paged_attention_prefill(*self.args(), scale=scale, **self.options())


def check(case, backend, **kw):
    out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend, **case.options(**kw))
    ref_out, ref_lse = case.reference(kw.get("scale"))
    assert isinstance(out, np.ndarray) and out.shape == case.query.shape and out.dtype == np.float32
    assert isinstance(lse, np.ndarray) and lse.shape == case.query.shape[:3] and lse.dtype == np.float32
    assert rel_error(out, ref_out) <= TOL
    assert rel_error(lse, ref_lse) <= TOL
    return out, lse


@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_sizes_and_query_lengths(rng, backend, layout, head_size, q_len):
    check(PrefillCase(rng, q_len=q_len, layout=layout, head_size=head_size), backend)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes_causal_or_not(rng, backend, block_size, layout, causal):
    check(PrefillCase(rng, q_len=7, layout=layout, causal=causal, block_size=block_size), backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (8, 1), (12, 3)])
def test_mha_gqa_mqa(rng, backend, num_heads, num_kv_heads):
    check(PrefillCase(rng, q_len=5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32), backend)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix_blocks(rng, backend, layout):
    case = PrefillCase(rng, q_len=4, layout=layout, seq_lens=[70, 40, 33, 100], shared_prefix_blocks=2)
    assert (case.block_tables[:, :2] == case.block_tables[0, :2]).all()
    check(case, backend)


def test_long_context_spans_many_tiles(rng, backend):
    check(PrefillCase(rng, q_len=20, seq_lens=[700, 20], block_size=32, num_heads=2, num_kv_heads=1), backend)


def test_causal_query_is_the_sequence_end(rng, backend):
    # Query i of a sequence of seq_len tokens is token seq_len - q_len + i: with causal masking it must
    # equal decode (an independent kernel) over the first seq_len - q_len + i + 1 tokens.
    case = PrefillCase(rng, q_len=6, layout="vllm", seq_lens=[6, 40, 131])
    out, _ = check(case, backend)
    for i in range(case.query.shape[2]):
        lens = (case.seq_lens - case.query.shape[2] + i + 1).astype(np.int32)
        decode = pagedvk.paged_attention(np.ascontiguousarray(case.query[:, :, i]), case.key_cache,
                                         case.value_cache, case.block_tables, lens, backend=backend)
        assert rel_error(out[:, :, i], decode) <= TOL


@pytest.mark.parametrize("head_size", [64, 256])
def test_single_query_equals_decode(rng, backend, head_size):
    case = PrefillCase(rng, q_len=1, layout="vllm", head_size=head_size)
    out, _ = check(case, backend)
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
    check(PrefillCase(rng, q_len=3), backend, scale=0.37)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_unread_cache_slots_does_not_leak(rng, backend, layout):
    case = PrefillCase(rng, q_len=2, layout="vllm", seq_lens=[21, 3], block_size=16)
    poison_unread_slots(case, 16)
    if layout == "nhd":
        k, v = pagedvk.reference.caches_as_nhd(case.key_cache, case.value_cache, "vllm")
        case.key_cache = np.ascontiguousarray(k, dtype=np.float32)
        case.value_cache = np.ascontiguousarray(v, dtype=np.float32)
        case.layout = "nhd"
    check(case, backend)


def test_device_arrays_in_device_arrays_out(rng, backend, device):
    case = PrefillCase(rng, q_len=5)
    out, lse = pagedvk.paged_attention_prefill(*[pagedvk.asarray(a) for a in case.args()], backend=backend,
                                               **case.options())
    assert isinstance(out, pagedvk.DeviceArray) and isinstance(lse, pagedvk.DeviceArray)
    assert out.device is device and out.shape == case.query.shape and lse.shape == case.query.shape[:3]
    ref_out, ref_lse = case.reference()
    assert rel_error(out.numpy(), ref_out) <= TOL
    assert rel_error(lse.numpy(), ref_lse) <= TOL


def modules_used(monkeypatch) -> list:
    """The (op, backend) of every pipeline the ops ask for from now on."""
    used, pipeline = [], pagedvk.kernels.pipeline
    monkeypatch.setattr(pagedvk.kernels, "pipeline",
                        lambda device, abi, key: used.append((abi.op, key.backend)) or pipeline(device, abi, key))
    return used


def test_backend_from_environment(rng, monkeypatch):
    used = modules_used(monkeypatch)
    monkeypatch.setenv("PAGEDVK_BACKEND", "wgsl")
    check(PrefillCase(rng, q_len=2), None)
    assert used == [("paged_prefill", "wgsl")]


# -- rejected inputs: a ValueError or TypeError that names the argument ------------------------------------

@pytest.fixture
def case(rng):
    return PrefillCase(rng, q_len=4, seq_lens=[10, 30, 4])


def rejects(case, exc, match, **changes):
    args = dict(zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens"), case.args()))
    options = case.options()
    for name, value in changes.items():
        (args if name in args else options)[name] = value
    with pytest.raises(exc, match=match):
        pagedvk.paged_attention_prefill(*args.values(), **options)


def test_rejects_bad_layout(case):
    rejects(case, ValueError, "layout must be one of 'vllm', 'nhd', got 'NHD'", layout="NHD")


def test_rejects_layout_not_matching_the_caches(case):
    rejects(case, ValueError, r"key_cache must have 5 dimensions", layout="vllm")


def test_rejects_seq_len_shorter_than_q_len(case):
    case.seq_lens[1] = 3
    rejects(case, ValueError, r"seq_lens\[1\] = 3 is less than q_len")


def test_rejects_negative_seq_len(case):
    case.seq_lens[2] = -1
    rejects(case, ValueError, r"seq_lens\[2\] = -1 is outside")


def test_rejects_block_id_out_of_range(case):
    case.block_tables[1, 1] = case.key_cache.shape[0]
    rejects(case, ValueError, r"block_tables\[1, 1\]")
    case.block_tables[1, 1] = -1
    rejects(case, ValueError, r"block_tables\[1, 1\] = -1")


def test_block_ids_past_the_used_blocks_are_not_checked(case, backend):
    case.block_tables[:, -1] = 10_000   # padding columns no sequence reaches
    check(case, backend)


def test_rejects_num_heads_not_a_multiple_of_kv_heads(rng):
    case = PrefillCase(rng, q_len=2, num_heads=3, num_kv_heads=2)
    rejects(case, ValueError, r"query.shape\[1\] \(num_heads\) must be a positive multiple of num_kv_heads")


@pytest.mark.parametrize("name,value,match", [
    ("query", lambda c: c.query[0], r"query must have 4 dimensions"),
    ("query", lambda c: c.query[..., :32].copy(), r"query.shape\[3\] \(head_size, from the caches\) must be 64"),
    ("query", lambda c: c.query[:2].copy(), r"block_tables.shape\[0\] \(num_seqs, from query\) must be 2"),
    ("query", lambda c: c.query[:, :, :0].copy(), r"query.shape\[2\] \(q_len\) must be at least 1"),
    ("key_cache", lambda c: c.key_cache[..., :32].copy(), r"value_cache.shape\[3\] \(head_size\) must be 32"),
    ("key_cache", lambda c: c.key_cache[:, :12].copy(), r"block_size \(key_cache.shape\[1\]\) must be one of 8, 16, 32"),
    ("value_cache", lambda c: c.value_cache[:, :, :1].copy(), r"value_cache.shape\[2\] \(num_kv_heads\) must be 2"),
    ("key_cache", lambda c: c.key_cache[..., :6].copy(), r"head_size \(key_cache.shape\[3\]\) must be a multiple of 4"),
    ("block_tables", lambda c: c.block_tables[0], r"block_tables must have 2 dimensions"),
    ("seq_lens", lambda c: c.seq_lens[:2], r"seq_lens.shape\[0\] \(num_seqs, from query\) must be 3"),
])
def test_rejects_wrong_shapes(case, name, value, match):
    rejects(case, ValueError, match, **{name: value(case)})


@pytest.mark.parametrize("name,dtype", [("query", np.float64), ("key_cache", np.float64), ("value_cache", np.float64),
                                        ("block_tables", np.int64), ("seq_lens", np.uint32)])
def test_rejects_wrong_dtypes(case, name, dtype):
    rejects(case, TypeError, f"{name} must have dtype", **{name: getattr(case, name).astype(dtype)})


@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "block_tables"])
def test_rejects_non_contiguous(case, name):
    rejects(case, ValueError, f"{name} must be C-contiguous", **{name: np.asfortranarray(getattr(case, name))})


def test_rejects_lists_and_bad_options(case):
    rejects(case, TypeError, "query must be a numpy array", query=case.query.tolist())
    rejects(case, TypeError, "causal must be a bool", causal=1)
    rejects(case, ValueError, "scale must be finite", scale=float("inf"))
    rejects(case, ValueError, "backend must be one of glsl, wgsl", backend="hlsl")
