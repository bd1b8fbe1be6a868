"""The prefill backward (paged_attention_backward): the float64 reference against finite differences of the
float64 forward, then both backends against the reference on random data with poisoned outputs."""

import numpy as np
import pytest

import pagedvk
import pagedvk.testing.reference
from support import (BLOCK_SIZES_CAUSAL_OR_NOT, HEAD_SIZES_AND_QUERY_LENGTHS, PREFILL_LAYOUTS, RAGGED_BATCHES,
                     PrefillCase, check_prefill, record_launches, rejects, rel_error, tensors_by_name, tiered)

pytestmark = pytest.mark.usefixtures("poisoned_prefill_outputs")

# float32 storage. The kernels sum dK and dV over rows in a fixed order; measured errors stay below 1e-6,
# so the forward's tolerance holds and is not loosened.
TOL = 1e-5
NAMES = ("dq", "dk_cache", "dv_cache")


def check(case, rng, backend, **kw):
    """Run the backward on the reference forward's out and lse (rounded to float32); compare every gradient."""
    out, lse = case.reference(kw.get("scale"))
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    grads = pagedvk.paged_attention_backward(dout, *case.args()[:5], out.astype(np.float32), lse.astype(np.float32),
                                             backend=backend, **case.loc(), **case.options(**kw))
    refs = pagedvk.testing.reference.paged_attention_backward(dout, *case.args(), **case.options(**kw))
    for name, g, ref, like in zip(NAMES, grads, refs, (case.query, case.key_cache, case.value_cache)):
        assert isinstance(g, np.ndarray) and g.shape == like.shape and g.dtype == np.float32, name
        assert rel_error(g, ref) <= TOL, name
    return grads


# -- the reference itself, by central differences of the float64 forward ------------------------------------

@pytest.mark.parametrize("ragged", [False, True], ids=["fixed_q_len", "ragged"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_reference_gradient_matches_finite_differences(rng, layout, causal, ragged):
    # Tiny: 2 sequences sharing physical block 0 (so dK and dV add up there), GQA 2:1, blocks 1 and 3 unread;
    # ragged: 3 and 2 new tokens, and an empty third sequence between them.
    num_blocks, block_size, head_size, q_len = 5, 4, 4, 3
    block_tables = np.array([[0, -1, -1], [0, 2, 4]], np.int32)
    seq_lens = np.array([3, 10], np.int32)
    loc = ()
    if ragged:
        block_tables, seq_lens = block_tables[[0, 0, 1]], np.array([3, 0, 10], np.int32)
        loc = (np.array([0, 3, 3, 5], np.int32),)
    if layout == "nhd":
        k_shape = v_shape = (num_blocks, block_size, 1, head_size)
    else:
        k_shape, v_shape = (num_blocks, 1, head_size // 4, block_size, 4), (num_blocks, 1, head_size, block_size)
    q_shape = (5, 2, head_size) if ragged else (2, 2, q_len, head_size)
    q, k, v = rng.standard_normal(q_shape), rng.standard_normal(k_shape), rng.standard_normal(v_shape)
    dout = rng.standard_normal(q.shape)
    opts = dict(causal=causal, layout=layout, scale=0.7)

    def loss(q, k, v):
        out = pagedvk.testing.reference.paged_attention_prefill(q, k, v, block_tables, seq_lens, *loc, **opts)[0]
        return float(np.sum(dout * out))

    grads = pagedvk.testing.reference.paged_attention_backward(dout, q, k, v, block_tables, seq_lens, *loc, **opts)
    h = 1e-6
    for i, (name, grad) in enumerate(zip(NAMES, grads)):
        x = (q, k, v)[i]
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + h
            up = loss(q, k, v)
            x[idx] = saved - h
            down = loss(q, k, v)
            x[idx] = saved
            numeric[idx] = (up - down) / (2 * h)
        assert rel_error(grad, numeric) <= 1e-6, name
    dk, dv = grads[1], grads[2]
    assert (dk[[1, 3]] == 0).all() and (dv[[1, 3]] == 0).all()


def test_reference_reads_hnd_as_nhd_with_tokens_and_heads_swapped(rng):
    # FlashInfer's HND holds what NHD holds, a block's token and head axes swapped: every float64 reference (forward,
    # gradients, decode, reshape_and_cache) gives NHD's results, the caches' gradients and contents swapped back.
    case = PrefillCase(rng, q_len=3, num_heads=4, num_kv_heads=2, head_size=8, block_size=4, seq_lens=[3, 9])
    k, v = case.key_cache, case.value_cache
    kh, vh = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (k, v))
    ref = pagedvk.testing.reference
    args = (case.block_tables, case.seq_lens)
    for a, b in zip(ref.paged_attention_prefill(case.query, k, v, *args, layout="nhd"),
                    ref.paged_attention_prefill(case.query, kh, vh, *args, layout="hnd")):
        np.testing.assert_array_equal(a, b)
    dout = rng.standard_normal(case.query.shape)
    nhd = ref.paged_attention_backward(dout, case.query, k, v, *args, layout="nhd")
    hnd = ref.paged_attention_backward(dout, case.query, kh, vh, *args, layout="hnd")
    np.testing.assert_array_equal(nhd[0], hnd[0])
    for a, b in zip(nhd[1:], hnd[1:]):
        np.testing.assert_array_equal(a, b.transpose(0, 2, 1, 3))
    decode_query = np.ascontiguousarray(case.query[:, :, -1])
    np.testing.assert_array_equal(ref.paged_attention(decode_query, k, v, *args, layout="nhd"),
                                  ref.paged_attention(decode_query, kh, vh, *args, layout="hnd"))
    tokens = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    slot_mapping = np.array([0, 7, -1, 30, 5])
    nhd = ref.reshape_and_cache(*tokens, k, v, slot_mapping, "nhd")
    hnd = ref.reshape_and_cache(*tokens, kh, vh, slot_mapping, "hnd")
    for a, b in zip(nhd, hnd):
        np.testing.assert_array_equal(a, b.transpose(0, 2, 1, 3))


# -- the kernels against the reference -----------------------------------------------------------------------

@pytest.mark.parametrize("layout,head_size,q_len", HEAD_SIZES_AND_QUERY_LENGTHS)
def test_head_sizes_and_query_lengths(rng, backend, layout, head_size, q_len):
    check(PrefillCase(rng, q_len=q_len, layout=layout, head_size=head_size, shared_prefix_blocks=1), rng, backend)


@pytest.mark.parametrize("block_size,layout,causal", BLOCK_SIZES_CAUSAL_OR_NOT)
def test_block_sizes_causal_or_not(rng, backend, block_size, layout, causal):
    case = PrefillCase(rng, q_len=9, layout=layout, causal=causal, block_size=block_size, shared_prefix_blocks=1)
    check(case, rng, backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", tiered([(8, 8), (8, 2), (8, 1), (12, 3)], default=[(8, 8), (12, 3)]))
def test_mha_gqa_mqa(rng, backend, num_heads, num_kv_heads):
    check(PrefillCase(rng, q_len=5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32), rng, backend)


@pytest.mark.parametrize("head_size,specialized", tiered([(h, s) for h in (32, 80, 256) for s in (True, False)],
                                                         default=[(32, True), (80, False)]))
def test_head_size_specialization(rng, monkeypatch, specialized, head_size):
    # The scalar kernels' GLSL pipelines are specialized on the plan's head size (catalogue.PrefillSpec.HEAD_SIZE);
    # a pipeline made without the constant reads the head size from the push constants. Both give the reference's
    # forward and gradients. Head size 32: one S chunk in dk/dv, the case the H200's driver once miscompiled
    # (BENCHMARKS.md); 80: a part chunk; 256: dk/dv's second head-quad column.
    from pagedvk.ops import prefill
    from pagedvk.kernels.catalogue import PrefillSpec
    if not specialized:   # no head-size specialization: the pipelines are made without the constant
        monkeypatch.setattr(prefill, "head_size_constant", lambda spec_id, head_size: {})
    case = PrefillCase(rng, q_len=5, head_size=head_size, shared_prefix_blocks=1)
    check_prefill(case, "glsl")
    check(case, rng, "glsl")
    constants = ((PrefillSpec.HEAD_SIZE, head_size),) if specialized else ()
    made = {key.op for key, _, own in pagedvk.default_device().pipelines
            if not key.matrix and key.backend == "glsl"
            and tuple(c for c in own if c[0] == PrefillSpec.HEAD_SIZE) == constants}
    assert {"paged_prefill", "paged_backward_dq", "paged_backward_dkdv"} <= made


@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_shared_blocks_add_up(rng, backend, layout):
    case = PrefillCase(rng, q_len=4, layout=layout, seq_lens=[70, 40, 33, 100], shared_prefix_blocks=2)
    case.block_tables[2] = case.block_tables[3]   # two sequences on the same blocks, different lengths
    case.block_tables[1, 2] = case.block_tables[1, 1]   # and one block read twice by one sequence
    check(case, rng, backend)


def test_unread_blocks_and_slots_get_zero(rng, backend):
    case = PrefillCase(rng, q_len=3, seq_lens=[3, 21])
    dq, dk, dv = check(case, rng, backend)
    read = set(case.block_tables[case.block_tables >= 0].tolist())
    unread = sorted(set(range(case.key_cache.shape[0])) - read)
    assert unread and (dk[unread] == 0).all() and (dv[unread] == 0).all()
    last = case.block_tables[1, 1]                 # tokens 16..20 of sequence 1: slots 5.. are past its end
    assert (dk[last, 5:] == 0).all() and (dv[last, 5:] == 0).all()


def test_empty_sequence(rng, backend):
    dq, _, _ = check(PrefillCase(rng, q_len=2, seq_lens=[0, 30, 0]), rng, backend)
    assert (dq[[0, 2]] == 0).all()


def test_query_seeing_one_key_has_zero_dq(rng, backend):
    # softmax over one key is constant: dq is exactly 0 in float64, and must not become float32 noise (the
    # kernels sum D = rowsum(dout * out) in the order they sum dP, and out == v there).
    case = PrefillCase(rng, q_len=3, seq_lens=[3, 1 + 2, 40])
    case.query = case.query[:, :, :1].copy()
    case.seq_lens[:] = [1, 1, 40]
    dq, _, _ = check(case, rng, backend)
    assert (dq[:2] == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ragged", [False, True], ids=["fixed_q_len", "ragged"])
def test_delta_is_rowsum_of_dout_times_out(rng, backend, ragged, dtype):
    # The backward's first dispatch (catalogue.PAGED_BACKWARD_DELTA) writes D = rowsum(dout * out) of every row, in lse's
    # shape, into a scratch buffer the launch owns, which dq and dk/dv read in place of out. The scratch starts as
    # NaN (poisoned_prefill_outputs), so a row left unwritten shows.
    import ml_dtypes
    from pagedvk.ops.prefill import Recorded
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    case = PrefillCase(rng, q_lens=[5, 0, 9, 1], shared_prefix_blocks=1) if ragged else PrefillCase(rng, q_len=7)
    out, lse = case.reference()
    out, dout = out.astype(dt), rng.standard_normal(case.query.shape).astype(dt)
    rec = Recorded.backward(dout, case.query.astype(dt), *case.args()[1:5], out, lse.astype(np.float32),
                            backend=backend, **dict(dict(query_start_loc=None), **case.loc()), **case.options())
    try:
        rec.launch.submit()
        delta = rec.scratch["delta"].numpy()
    finally:
        rec.close()
    ref = np.sum(dout.astype(np.float64) * out.astype(np.float64), axis=-1)
    assert delta.shape == lse.shape and rel_error(delta, ref) <= 1e-6


def test_dq_and_dkdv_run_side_by_side_after_one_barrier(rng, backend, monkeypatch):
    # dq and dk/dv both read the delta dispatch's D and nothing of each other's outputs: one barrier after delta, none
    # between them (their workgroups share the device; a barrier made dk/dv wait for dq's last wave). Gradients
    # still match float64.
    barriers, recorded = record_launches(monkeypatch)
    check(PrefillCase(rng, q_lens=[5, 0, 9, 1], shared_prefix_blocks=1), rng, backend)
    names, independent = recorded[-1]
    modules = [n.split(".")[0] for n in names]
    assert modules == ["paged_backward_delta", "paged_backward_dq", "paged_backward_dkdv"], names
    assert independent == {2} and len(barriers) == 1


def test_custom_scale_and_long_context(rng, backend):
    check(PrefillCase(rng, q_len=24, seq_lens=[300, 24], block_size=32, num_heads=2, num_kv_heads=1), rng, backend,
          scale=0.21)


def test_deterministic(rng, backend):
    case = PrefillCase(rng, q_len=8, seq_lens=[40, 60, 50], shared_prefix_blocks=2)
    out, lse = (a.astype(np.float32) for a in case.reference())
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    first = pagedvk.paged_attention_backward(dout, *case.args(), out, lse, backend=backend, **case.options())
    again = pagedvk.paged_attention_backward(dout, *case.args(), out, lse, backend=backend, **case.options())
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_forward_then_backward_on_device(rng, backend, layout, device):
    # A training step's shape: device arrays in, device arrays out, the backward fed the kernel's own out/lse.
    case = PrefillCase(rng, q_len=16, layout=layout, shared_prefix_blocks=1)
    dev = [pagedvk.asarray(a) for a in case.args()]
    out, lse = pagedvk.paged_attention_prefill(*dev, layout=layout, backend=backend)
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    grads = pagedvk.paged_attention_backward(pagedvk.asarray(dout), *dev, out, lse, layout=layout, backend=backend)
    refs = pagedvk.testing.reference.paged_attention_backward(dout, *case.args(), layout=layout)
    for name, g, ref in zip(NAMES, grads, refs):
        assert isinstance(g, pagedvk.DeviceArray) and g.device is device, name
        assert rel_error(g.numpy(), ref) <= TOL, name


# -- ragged batches ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,layout", tiered([(b, layout) for b in RAGGED_BATCHES for layout in PREFILL_LAYOUTS],
                                                default=[("mixed", "vllm"), ("empty_at_both_ends", "nhd")]))
def test_ragged_batches(rng, backend, layout, batch):
    check(PrefillCase(rng, q_lens=RAGGED_BATCHES[batch], layout=layout, shared_prefix_blocks=1), rng, backend)


@pytest.mark.parametrize("causal,num_heads,num_kv_heads", tiered(
    [(c, h, kv) for c in (True, False) for h, kv in ((16, 1), (12, 4))], default=[(True, 16, 1), (False, 12, 4)]))
def test_ragged_gqa_groups_and_causal(rng, backend, num_heads, num_kv_heads, causal):
    check(PrefillCase(rng, q_lens=[3, 0, 6, 1], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                      causal=causal, block_size=8, shared_prefix_blocks=1), rng, backend)


def test_batch_without_queries_has_zero_gradients(rng, backend):
    case = PrefillCase(rng, q_lens=[0, 0], seq_lens=[5, 20])
    empty = np.zeros((0, 4), np.float32)
    dq, dk, dv = pagedvk.paged_attention_backward(case.query, *case.args()[:5], case.query, empty,
                                                  case.query_start_loc, backend=backend, **case.options())
    assert dq.shape == case.query.shape and (dk == 0).all() and (dv == 0).all()
    assert dk.shape == case.key_cache.shape and dv.shape == case.value_cache.shape


def test_ragged_forward_then_backward_on_device(rng, backend, device):
    case = PrefillCase(rng, q_lens=[6, 1, 0, 2], layout="vllm", shared_prefix_blocks=1)
    dev = [pagedvk.asarray(a) for a in case.args()]
    out, lse = pagedvk.paged_attention_prefill(*dev, layout="vllm", backend=backend)
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    grads = pagedvk.paged_attention_backward(pagedvk.asarray(dout), *dev[:5], out, lse, dev[5], layout="vllm",
                                             backend=backend)
    refs = pagedvk.testing.reference.paged_attention_backward(dout, *case.args(), layout="vllm")
    for name, g, ref in zip(NAMES, grads, refs):
        assert isinstance(g, pagedvk.DeviceArray) and g.device is device, name
        assert rel_error(g.numpy(), ref) <= TOL, name


# -- rejected inputs -------------------------------------------------------------------------------------

@pytest.fixture
def case(rng):
    return PrefillCase(rng, q_len=4, seq_lens=[10, 30, 4])


def rejects_backward(case, exc, match, **changes):
    """paged_attention_backward on the case (dout ones, out and lse the reference forward's) with `changes` raises."""
    out, lse = (a.astype(np.float32) for a in case.reference())
    arguments = dict(tensors_by_name(case), dout=np.ones_like(case.query), out=out, lse=lse, **case.loc(),
                     **case.options())
    rejects(pagedvk.paged_attention_backward, arguments, exc, match, **changes)


def test_rejects_bad_gradient_arguments(case):
    q = case.query
    rejects_backward(case, ValueError, r"dout must have shape \(3, 4, 4, 64\)", dout=q[:, :, :2].copy())
    rejects_backward(case, TypeError, "dout must have dtype float32", dout=q.astype(np.float64))
    rejects_backward(case, ValueError, r"out must have 4 dimensions", out=q[0])
    rejects_backward(case, ValueError, r"lse must have shape \(3, 4, 4\)", lse=np.zeros((3, 4, 5), np.float32))
    rejects_backward(case, TypeError, "lse must be a numpy array", lse=0.0)


def test_takes_strided_numpy_arrays(rng):
    # dout, the query and out as views of larger arrays, the caches and lse Fortran-ordered: the contiguous
    # arrays' gradients, bit for bit (the sums run in a fixed order).
    case = PrefillCase(rng, q_len=4, seq_lens=[10, 30, 4])
    out, lse = (a.astype(np.float32) for a in case.reference())
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    want = pagedvk.paged_attention_backward(dout, *case.args()[:5], out, lse, **case.options())

    def strided(a):
        return np.concatenate([a, a], axis=-1)[..., :a.shape[-1]]
    got = pagedvk.paged_attention_backward(strided(dout), strided(case.query), np.asfortranarray(case.key_cache),
                                           np.asfortranarray(case.value_cache), case.block_tables, case.seq_lens,
                                           strided(out), np.asfortranarray(lse), **case.options())
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_rejects_what_the_forward_rejects(case):
    rejects_backward(case, ValueError, "layout must be one of", layout="HND")
    case.seq_lens[0] = 2
    rejects_backward(case, ValueError, r"seq_lens\[0\] = 2 is less than q_len")


def test_rejects_bad_ragged_arguments(rng):
    case = PrefillCase(rng, q_lens=[3, 0, 5], seq_lens=[3, 10, 20])
    q = case.query
    rejects_backward(case, ValueError, r"lse must have shape \(8, 4\)", lse=np.zeros((8, 3), np.float32))
    rejects_backward(case, ValueError, r"dout must have shape \(8, 4, 64\)", dout=q[:7].copy())
    rejects_backward(case, ValueError, r"query_start_loc\[-1\] must be num_tokens",
            query_start_loc=np.array([0, 3, 3, 6], np.int32))
    case.seq_lens[0] = 2
    rejects_backward(case, ValueError, r"seq_lens\[0\] = 2 is less than q_len_s")
