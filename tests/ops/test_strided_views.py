"""Issue 38, "strided inputs, and no round trips": the ops take DeviceArray views whose rows lie apart where they take
a query, a cache write's keys and values, or an output, as an engine keeps them: the slices of one fused QKV
projection on the device, and an output inside a wider device array. Each is read or written where it is, at its
row pitch: against the float64 reference, outputs NaN-poisoned first, the bytes around an output view untouched,
no buffer allocated and nothing copied. Every view the kernels cannot take is refused naming the argument."""

import numpy as np
import pytest

import pagedvk
import pagedvk.runtime.memory
from pagedvk.testing import reference
from support import RAGGED_BATCHES, Case, PrefillCase, in_layout, record_launches, rel_error

H, KV, D = 8, 2, 64
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}
DTYPES = [np.float32, np.float16]
SENTINEL = -1234.5


def fused(device, rng, q, k=None, v=None, extra=0):
    """A fused QKV projection's output [tokens, (H + 2 KV) D + extra] on the device holding q (and k, v where given),
    and its q, k and v views [tokens, heads, D]."""
    t, dt = q.shape[0], q.dtype
    heads, kv = q.shape[1], KV
    host = rng.standard_normal((t, (heads + 2 * kv) * D + extra)).astype(dt)
    host[:, :heads * D] = q.reshape(t, -1)
    for i, part in enumerate((k, v)):
        if part is not None:
            host[:, (heads + i * kv) * D:(heads + (i + 1) * kv) * D] = part.reshape(t, -1)
    qkv = pagedvk.asarray(host, device)
    views = (qkv[:, :heads * D].reshape(t, heads, D), qkv[:, heads * D:(heads + kv) * D].reshape(t, kv, D),
             qkv[:, (heads + kv) * D:(heads + 2 * kv) * D].reshape(t, kv, D))
    return qkv, views


class Fenced:
    """An output view [tokens, heads, D] inside a wider device array [tokens, pad + heads D + pad] whose other
    columns hold a sentinel; the view itself NaN-poisoned."""

    def __init__(self, device, shape, dtype):
        t, heads, d = shape
        self.pad = max(16, device.info.min_storage_buffer_offset_alignment) // np.dtype(dtype).itemsize
        self.width = heads * d
        self.wide = pagedvk.asarray(np.full((t, self.width + 2 * self.pad), SENTINEL, dtype), device)
        self.out = self.wide[:, self.pad:self.pad + self.width].reshape(shape)
        self.out.write(np.full(shape, np.nan, dtype))
        self.sentinel = np.array(SENTINEL, dtype)

    def check_fence(self):
        w = self.wide.numpy()
        assert (w[:, :self.pad] == self.sentinel).all() and (w[:, self.pad + self.width:] == self.sentinel).all(), \
            "a kernel wrote outside the output view"


def decode_case(rng, dtype, num_seqs=3, max_len=300):
    return Case(rng, num_seqs=num_seqs, num_heads=H, num_kv_heads=KV, head_size=D, max_len=max_len, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
@pytest.mark.parametrize("kernel", [None, "gpu"], ids=["default", "gpu"])
def test_decode_plan_run_reads_and_writes_views(rng, device, backend, dtype, kernel):
    # One partition, then a split (merged by the reduce or in the decode dispatch): every way `out` is written.
    case = decode_case(rng, dtype)
    _, (q, _, _) = fused(device, rng, case.query)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    ref, ref_lse = reference.paged_attention(*case.args(), return_lse=True)
    for partition_size in (4096, 32):
        fence = Fenced(device, case.query.shape, dtype)
        lse = pagedvk.asarray(np.full(case.query.shape[:2], np.nan, np.float32), device)
        with pagedvk.DecodePlan.for_caches(kc, vc, case.block_tables, case.seq_lens, H, backend=backend,
                                           partition_size=partition_size, kernel=kernel, device=device) as plan:
            result = plan.run(q, kc, vc, out=fence.out, lse=lse)
            assert result[0] is fence.out
            assert rel_error(fence.out.numpy(), ref) <= TOL[np.dtype(dtype)], (plan.key.name, plan.num_partitions)
            assert rel_error(lse.numpy(), ref_lse) <= 1e-5
            fence.check_fence()
            # Again, through the launch the plan kept for these arrays.
            fence.out.write(np.full(case.query.shape, np.nan, dtype))
            plan.run(q, kc, vc, out=fence.out)
            assert rel_error(fence.out.numpy(), ref) <= TOL[np.dtype(dtype)]
            fence.check_fence()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
def test_paged_attention_with_views(rng, device, backend, dtype):
    # The one-call op, twice: the second call runs the plan it kept for the signature.
    case = decode_case(rng, dtype)
    _, (q, _, _) = fused(device, rng, case.query)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    ref = case.reference()
    for _ in range(2):
        fence = Fenced(device, case.query.shape, dtype)
        out = pagedvk.paged_attention(q, kc, vc, case.block_tables, case.seq_lens, out=fence.out, backend=backend)
        assert out is fence.out
        assert rel_error(out.numpy(), ref) <= TOL[np.dtype(dtype)]
        fence.check_fence()
    # A view query with no out: a new contiguous result.
    out = pagedvk.paged_attention(q, kc, vc, case.block_tables, case.seq_lens, backend=backend)
    assert out.is_contiguous and rel_error(out.numpy(), ref) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("layout", ["vllm", "nhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
def test_reshape_and_cache_reads_key_and_value_views(rng, device, backend, dtype, layout):
    case = decode_case(rng, dtype, num_seqs=2, max_len=60)
    kc_host, vc_host = in_layout(case, layout, dtype)
    tokens = 7
    q = rng.standard_normal((tokens, H, D)).astype(dtype)
    qkv, (_, k, v) = fused(device, rng, q, extra=4)   # 4 more columns: the pitch is not (H + 2 KV) D
    num_slots = case.key_cache.shape[0] * case.block_size
    slots = rng.choice(num_slots, tokens, replace=False).astype(np.int32)
    slots[2] = -1   # padding
    expected = reference.reshape_and_cache(k.numpy(), v.numpy(), kc_host, vc_host, slots, layout=layout)
    kc, vc = pagedvk.asarray(kc_host, device), pagedvk.asarray(vc_host, device)
    before = qkv.numpy()
    pagedvk.reshape_and_cache(k, v, kc, vc, slots, layout=layout, backend=backend)
    np.testing.assert_array_equal(kc.numpy(), expected[0])
    np.testing.assert_array_equal(vc.numpy(), expected[1])
    np.testing.assert_array_equal(qkv.numpy(), before)   # read only
    # The kept launch of an unvalidated call with device slots, again (its signature holds the views' strides).
    kc2, vc2 = pagedvk.asarray(kc_host, device), pagedvk.asarray(vc_host, device)
    dslots = pagedvk.asarray(slots, device)
    for _ in range(2):
        pagedvk.reshape_and_cache(k, v, kc2, vc2, dslots, layout=layout, backend=backend, validate=False)
        np.testing.assert_array_equal(kc2.numpy(), expected[0])
        np.testing.assert_array_equal(vc2.numpy(), expected[1])


def test_kv_cache_write_takes_views(rng, device, backend):
    with pagedvk.KVCache(2, KV, D, block_size=16, dtype=np.float16, num_blocks=6, device=device,
                         backend=backend) as cache:
        for layer in range(2):
            cache.key[layer].write(np.zeros(cache.key[layer].shape, np.float16))
            cache.value[layer].write(np.zeros(cache.value[layer].shape, np.float16))
        tokens = 5
        q = rng.standard_normal((tokens, H, D)).astype(np.float16)
        _, (_, k, v) = fused(device, rng, q)
        slots = np.array([0, 17, 33, -1, 94], np.int32)
        cache.write(1, k, v, slots)
        expected = reference.reshape_and_cache(k.numpy(), v.numpy(), np.zeros(cache.key[1].shape, np.float16),
                                               np.zeros(cache.value[1].shape, np.float16), slots)
        np.testing.assert_array_equal(cache.key[1].numpy(), expected[0])
        np.testing.assert_array_equal(cache.value[1].numpy(), expected[1])
        assert not cache.key[0].numpy().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
def test_append_and_run_with_views(rng, device, backend, dtype):
    # A decode step: the new token's key and value written to its slot from the fused projection, and attended.
    case = decode_case(rng, dtype, num_seqs=3, max_len=80)
    lens = case.seq_lens.astype(np.int64)
    bs = case.block_size
    slots = (case.block_tables[np.arange(len(lens)), (lens - 1) // bs].astype(np.int64) * bs + (lens - 1) % bs)
    slots = pagedvk.asarray(slots.astype(np.int32), device)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    with pagedvk.DecodePlan.for_caches(kc, vc, case.block_tables, case.seq_lens, H, backend=backend,
                                       device=device) as plan:
        fence = Fenced(device, case.query.shape, dtype)
        for step in range(2):   # the second step replays the step kept for these arrays, on new values
            new_k = rng.standard_normal((len(lens), KV, D)).astype(dtype)
            new_v = rng.standard_normal((len(lens), KV, D)).astype(dtype)
            q = rng.standard_normal(case.query.shape).astype(dtype)
            if step == 0:
                qkv, (qv, kv_, vv) = fused(device, rng, q, new_k, new_v)
            else:
                host = qkv.numpy()
                host[:, :H * D], host[:, H * D:(H + KV) * D] = q.reshape(len(lens), -1), new_k.reshape(len(lens), -1)
                host[:, (H + KV) * D:] = new_v.reshape(len(lens), -1)
                qkv.write(host)
                fence.out.write(np.full(case.query.shape, np.nan, dtype))
            kh, vh = reference.reshape_and_cache(new_k, new_v, kc.numpy(), vc.numpy(), slots.numpy())
            out = plan.append_and_run(kv_, vv, slots, qv, kc, vc, out=fence.out)
            assert out is fence.out
            np.testing.assert_array_equal(kc.numpy(), kh)
            ref = reference.paged_attention(q, kh, vh, case.block_tables, case.seq_lens)
            assert rel_error(out.numpy(), ref) <= TOL[np.dtype(dtype)]
            fence.check_fence()


@pytest.mark.parametrize("batch", ["mixed", "decode_tokens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
def test_prefill_with_views(rng, device, backend, dtype, batch):
    # "mixed" runs prefill tiles and an empty sequence; "decode_tokens" the decode kernel inside the forward, on row
    # views of the query and out views.
    case = PrefillCase(rng, q_lens=RAGGED_BATCHES[batch], layout="nhd", num_heads=H, num_kv_heads=KV, head_size=D)
    case.query = case.query.astype(dtype)
    case.key_cache, case.value_cache = case.key_cache.astype(dtype), case.value_cache.astype(dtype)
    ref, ref_lse = case.reference()
    _, (q, _, _) = fused(device, rng, case.query)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    fence = Fenced(device, case.query.shape, dtype)
    out, lse = pagedvk.paged_attention_prefill(q, kc, vc, case.block_tables, case.seq_lens, case.query_start_loc,
                                               out=fence.out, backend=backend, **case.options())
    assert out is fence.out
    assert rel_error(out.numpy(), ref) <= TOL[np.dtype(dtype)]
    assert rel_error(lse.numpy(), ref_lse) <= 1e-5
    fence.check_fence()
    # Through a PrefillPlan, twice (the second run queues the launch it kept).
    with pagedvk.PrefillPlan(case.block_tables, case.seq_lens, case.query_start_loc, backend=backend, device=device,
                             **case.options()) as plan:
        for _ in range(2):
            fence.out.write(np.full(case.query.shape, np.nan, dtype))
            plan.run(q, kc, vc, out=fence.out)
            assert rel_error(fence.out.numpy(), ref) <= TOL[np.dtype(dtype)]
            fence.check_fence()


def test_views_cause_no_allocation_or_copy(rng, device, monkeypatch):
    # What a copy of a view would cost, counted: buffers allocated and buffer copies recorded (uploads, downloads and
    # copies all go through copy_regions where memory is not mapped; a mapped upload writes the buffer's memory:
    # counted too). The steady state of a decode step over views does none of them, and dispatches decode modules
    # only (no copy kernel).
    case = decode_case(rng, np.float16)
    _, (q, k, v) = fused(device, rng, case.query)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    fence = Fenced(device, case.query.shape, np.float16)
    slots = pagedvk.asarray(np.array([5, 40, -1], np.int32), device)
    plan = pagedvk.DecodePlan.for_caches(kc, vc, case.block_tables, case.seq_lens, H, device=device)

    def decode_step():
        pagedvk.reshape_and_cache(k, v, kc, vc, slots, validate=False)
        plan.run(q, kc, vc, out=fence.out)
        plan.append_and_run(k, v, slots, q, kc, vc, out=fence.out, validate=False)
    _, launches = record_launches(monkeypatch)
    decode_step()   # the first step makes what a plan keeps (a split decode's scratch, on a GPU with many cores)
    assert launches, "the first step records its launches"
    counts = {"buffers": 0, "copies": 0, "uploads": 0}
    buffer_init = pagedvk.runtime.memory.Buffer.__init__
    copies, upload = type(device).copy_regions, type(device).upload

    def counting(name, f):
        def spy(*a, **kw):
            counts[name] += 1
            return f(*a, **kw)
        return spy
    monkeypatch.setattr(pagedvk.runtime.memory.Buffer, "__init__", counting("buffers", buffer_init))
    monkeypatch.setattr(type(device), "copy_regions", counting("copies", copies))
    monkeypatch.setattr(type(device), "upload", counting("uploads", upload))
    for _ in range(3):
        decode_step()
    assert counts == {"buffers": 0, "copies": 0, "uploads": 0}
    modules = {name.split(".")[0] for names, _ in launches for name in names}
    assert modules <= {"paged_decode", "paged_decode_reduce", "reshape_and_cache"}, modules
    plan.close()
    monkeypatch.undo()
    ref = reference.paged_attention(q.numpy(), kc.numpy(), vc.numpy(), case.block_tables, case.seq_lens)
    assert rel_error(fence.out.numpy(), ref) <= 2e-3
    fence.check_fence()


# -- what the kernels cannot take: each refusal names the argument --

def test_unaligned_or_odd_pitched_views_are_refused(rng, device):
    align = device.info.min_storage_buffer_offset_alignment
    case = decode_case(rng, np.float32, num_seqs=2, max_len=40)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    args = (kc, vc, case.block_tables, case.seq_lens)
    host = rng.standard_normal((2, H * D + 8)).astype(np.float32)
    base = pagedvk.asarray(host, device)
    odd = pagedvk.asarray(rng.standard_normal((2, H * D + 2)).astype(np.float32), device)
    with pytest.raises(ValueError, match=r"query is a view whose rows lie 514 elements apart .* multiple of 4"):
        pagedvk.paged_attention(odd[:, :H * D].reshape(2, H, D), *args)
    if align > 4:
        shifted = base[:, 1:1 + H * D].reshape(2, H, D)   # starts 4 bytes in
        with pytest.raises(ValueError, match=rf"query is a view starting at byte 4 of its buffer, not a multiple of "
                                             rf"{align} \(minStorageBufferOffsetAlignment"):
            pagedvk.paged_attention(shifted, *args)
        with pytest.raises(ValueError, match=rf"out is a view starting at byte 4 .* multiple of {align}"):
            pagedvk.paged_attention(case.query, *args, out=shifted)
        kv = pagedvk.asarray(rng.standard_normal((3, KV * D + 1 + KV * D + 3)).astype(np.float32), device)
        with pytest.raises(ValueError, match=rf"value is a view starting at byte {4 * (KV * D + 1)}"):
            pagedvk.reshape_and_cache(kv[:, :KV * D].reshape(3, KV, D),
                                      kv[:, KV * D + 1:2 * KV * D + 1].reshape(3, KV, D), kc, vc, [0, 1, 2])


def test_views_with_rows_apart_are_refused_where_an_argument_must_be_contiguous(rng, device):
    case = decode_case(rng, np.float32, num_seqs=2, max_len=40)
    kc, vc = pagedvk.asarray(case.key_cache, device), pagedvk.asarray(case.value_cache, device)
    # A cache with its blocks apart: every other block of a cache twice as wide.
    nb = case.key_cache.shape[0]
    wide = pagedvk.zeros((nb, 2 * case.key_cache[0].size), np.float32, device)
    strided_cache = wide[:, :case.key_cache[0].size].reshape(case.key_cache.shape)
    with pytest.raises(ValueError, match="key_cache is a strided view .* must be contiguous"):
        pagedvk.paged_attention(case.query, strided_cache, vc, case.block_tables, case.seq_lens)
    with pytest.raises(ValueError, match="key_cache is a strided view"):
        pagedvk.reshape_and_cache(case.query[:, :KV], case.query[:, :KV], strided_cache, vc, [0, 1])
    tables = pagedvk.asarray(np.concatenate([case.block_tables, case.block_tables], axis=1), device)
    with pytest.raises(ValueError, match="block_tables is a strided view"):
        pagedvk.paged_attention(case.query, kc, vc, tables[:, :case.block_tables.shape[1]], case.seq_lens)
    _, (q, _, _) = fused(device, rng, case.query)
    wide_lse = pagedvk.zeros((2, 2 * H), np.float32, device)
    with pagedvk.DecodePlan.for_caches(kc, vc, case.block_tables, case.seq_lens, H, device=device) as plan:
        with pytest.raises(ValueError, match="lse is a strided view"):
            plan.run(q, kc, vc, out=pagedvk.empty(q.shape, np.float32, device), lse=wide_lse[:, :H])
    # The merges and the backward read contiguous arrays only.
    lse = pagedvk.zeros((2, H), np.float32, device)
    with pytest.raises(ValueError, match="out_a is a strided view"):
        pagedvk.merge_attention_states(q, lse, q, lse)
    pc = PrefillCase(rng, q_lens=[3, 2], layout="nhd", num_heads=H, num_kv_heads=KV, head_size=D)
    _, (pq, _, _) = fused(device, rng, pc.query)
    pkc, pvc = pagedvk.asarray(pc.key_cache, device), pagedvk.asarray(pc.value_cache, device)
    out, lse = pagedvk.paged_attention_prefill(pq, pkc, pvc, pc.block_tables, pc.seq_lens, pc.query_start_loc,
                                               **pc.options())
    with pytest.raises(ValueError, match="query is a strided view .* must be contiguous"):
        pagedvk.paged_attention_backward(out, pq, pkc, pvc, pc.block_tables, pc.seq_lens, out, lse,
                                         pc.query_start_loc, **pc.options())
    with pytest.raises(ValueError, match="dout is a strided view"):
        pagedvk.paged_attention_backward(pq, pagedvk.asarray(pc.query, device), pkc, pvc, pc.block_tables,
                                         pc.seq_lens, out, lse, pc.query_start_loc, **pc.options())
    # The fixed-q_len form [num_seqs, num_heads, q_len, head_size] is contiguous only.
    fixed = pagedvk.zeros((2, H * 3 * D + 16), np.float32, device)[:, :H * 3 * D].reshape(2, H, 3, D)
    with pytest.raises(ValueError, match="query is a strided view .* fixed-q_len form"):
        pagedvk.paged_attention_prefill(fixed, pkc, pvc, pc.block_tables, pc.seq_lens, **pc.options())
