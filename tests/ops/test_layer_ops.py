"""The layer ops (embedding, rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, rope_cos_sin_cache) against
the float64 reference: both backends, every activation dtype, odd sizes (576-wide rows, 17 tokens, partial rotary),
numpy and device arrays, views of a fused projection, recorded steps, kernels bounded by sentinels, and every
rejected input leaving its arrays as they were.

Tolerances: float32 1e-5 relative (DESIGN.md). 16-bit outputs are checked twice: every element within half a unit in
the last place of the float64 result (the output's own rounding; float32 compute adds ~1e-7), and the relative error
within 2e-3 for float16 and 4e-3 for bfloat16 (bfloat16 keeps 8 significant bits: its rounding of the output alone
measures 1.1-1.7e-3 relative on these data, close to DESIGN.md's 2e-3 for 16-bit types, so it is held to its unit
roundoff 2^-8 instead).
"""

import math

import ml_dtypes
import numpy as np
import pytest

import pagedvk
from pagedvk.testing import reference
from support import assert_untouched, fenced, record_launches, rel_error, tiered

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
DTYPE_IDS = ["f32", "f16", "bf16"]
REL_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 4e-3}
HALF_ULP = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}   # unit roundoff: rounding to nearest is within it
TOKENS = 17
EPS = 1e-5


def random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype)


def check(out, ref, dtype=None):
    """out (any float type) against the float64 reference, as the module docstring says."""
    out = np.asarray(out.numpy() if isinstance(out, pagedvk.DeviceArray) else out)
    dtype = np.dtype(dtype or out.dtype)
    assert out.shape == ref.shape
    assert rel_error(out, ref) <= REL_TOLERANCE[dtype.name], rel_error(out, ref)
    if dtype.name in HALF_ULP:
        slack = 1e-5 * np.abs(ref).max()   # float32 compute, where rope's differences cancel
        err = np.abs(out.astype(np.float64) - ref) - (HALF_ULP[dtype.name] * np.abs(ref) + slack)
        assert (err <= 0).all(), f"{int((err > 0).sum())} elements past half an ulp, worst by {err.max():.3g}"


def host(a):
    return a.numpy() if isinstance(a, pagedvk.DeviceArray) else a


# -- embedding ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_type", ["weight", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding(rng, device, backend, dtype, out_type):
    weight = random(rng, (1000, 576), dtype)
    ids = rng.integers(0, 1000, TOKENS).astype(np.int32)
    ids[:2] = (0, 999)   # the table's first and last rows
    out = pagedvk.asarray(poisoned((TOKENS, 576), dtype if out_type == "weight" else np.float32), device)
    given = pagedvk.embedding(pagedvk.asarray(ids, device), pagedvk.asarray(weight, device), out=out, backend=backend)
    assert given is out
    # a float32 out holds the 16-bit types exactly: the rows are copied, not approximated
    assert np.array_equal(out.numpy().astype(np.float64), reference.embedding(ids, weight))


@pytest.mark.parametrize("ids_kind", ["int64 numpy", "list", "int32 device"])
def test_embedding_ids_of_any_shape_and_kind(rng, device, backend, ids_kind):
    weight = random(rng, (50, 64), np.float16)
    ids = rng.integers(0, 50, (3, 5))
    given = {"int64 numpy": ids.astype(np.int64), "list": ids.tolist(),
             "int32 device": pagedvk.asarray(ids.astype(np.int32), device)}[ids_kind]
    out = pagedvk.embedding(given, weight, backend=backend)
    # numpy when every array is a host array, a DeviceArray when one is on the device
    assert isinstance(out, pagedvk.DeviceArray) == (ids_kind == "int32 device")
    assert host(out).dtype == np.float16 and host(out).shape == (3, 5, 64)
    assert np.array_equal(host(out).astype(np.float64), reference.embedding(ids, weight))


def test_embedding_unchecked_ids_give_zero_rows_inside_the_table(rng, device, backend):
    weight = random(rng, (40, 64), np.float32)
    ids = np.array([3, -1, 40, 2 ** 31 - 1, 39, -(2 ** 31)], np.int32)
    (d_weight, d_out), guards = fenced(device, weight, poisoned((6, 64), np.float32))
    pagedvk.embedding(pagedvk.asarray(ids, device), d_weight, out=d_out, backend=backend, validate=False)
    expected = np.zeros((6, 64))
    expected[[0, 4]] = weight[[3, 39]]
    assert np.array_equal(d_out.numpy(), expected)
    wide = np.array([5, 2 ** 32 + 5, -5], np.int64)   # int64: the high word counts
    out = pagedvk.embedding(wide, d_weight, backend=backend, validate=False)
    assert np.array_equal(out.numpy(), np.stack([weight[5], np.zeros(64), np.zeros(64)]))
    assert_untouched(*guards)


# -- rms_norm and fused_add_rms_norm -------------------------------------------------------------------------------

HIDDEN = tiered([576, 2048, 4096, 8192, 10240], default=[576, 8192])


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(rng, device, backend, dtype, hidden):
    x = random(rng, (TOKENS, hidden), dtype, scale=3.0)
    weight = random(rng, hidden, dtype)
    out = poisoned(x.shape, dtype)
    assert pagedvk.rms_norm(out, x, weight, EPS, backend=backend) is None
    check(out, reference.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm(rng, device, backend, dtype, hidden):
    x, residual = random(rng, (TOKENS, hidden), dtype), random(rng, (TOKENS, hidden), dtype, scale=4.0)
    weight = random(rng, hidden, np.float32)   # a float32 weight beside 16-bit activations (GGUF's norms)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    d_x, d_residual = pagedvk.asarray(x, device), pagedvk.asarray(residual, device)
    pagedvk.fused_add_rms_norm(d_x, d_residual, pagedvk.asarray(weight, device), EPS, backend=backend)
    check(d_x, ref_out)
    check(d_residual, ref_residual)


def test_more_rows_than_one_grid_axis_holds(rng, device, backend):
    # One workgroup per row: 66000 rows pass maxComputeWorkGroupCount[0] (65535 on lavapipe and NVIDIA), and the
    # grid folds into a second axis (fold_grid) that the kernel numbers through.
    x, weight = random(rng, (66000, 8), np.float16), random(rng, 8, np.float16)
    out = poisoned(x.shape, np.float16)
    pagedvk.rms_norm(out, x, weight, EPS, backend=backend)
    check(out, reference.rms_norm(x, weight, EPS))


def test_norms_of_numpy_arrays_are_written_in_place_through_views(rng, device, backend):
    x = random(rng, (2, 5, 64), np.float16)   # any leading axes
    weight = random(rng, 64, ml_dtypes.bfloat16)
    wide = poisoned((2, 5, 80), np.float16)
    pagedvk.rms_norm(wide[..., 8:72], x, weight, 1e-6, backend=backend)   # out: a numpy view
    check(wide[..., 8:72], reference.rms_norm(x, weight, 1e-6))
    assert np.isnan(wide[..., :8]).all() and np.isnan(wide[..., 72:]).all()
    residual = random(rng, x.shape, np.float16)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    pagedvk.fused_add_rms_norm(x, residual, weight, 1e-6, backend=backend)
    check(x, ref_out)
    check(residual, ref_residual)


@pytest.mark.parametrize("kind", ["numpy", "device"])
def test_rms_norm_with_out_as_input_is_in_place(rng, device, backend, kind):
    x = random(rng, (TOKENS, 576), np.float32)
    weight = random(rng, 576, np.float32)
    ref = reference.rms_norm(x, weight, EPS)
    a = x.copy() if kind == "numpy" else pagedvk.asarray(x, device)
    pagedvk.rms_norm(a, a, weight, EPS, backend=backend)
    check(a, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_views_of_device_arrays_are_read_and_written_where_they_lie(rng, device, backend, dtype):
    # Columns of wider arrays (rows apart): the ops read and write them in place, and nothing between their rows.
    hidden = 576
    wide = random(rng, (TOKENS, hidden + 64), dtype)
    d_wide = pagedvk.asarray(wide, device)
    x = d_wide[:, 64:]
    weight = random(rng, hidden, dtype)
    d_out = pagedvk.asarray(poisoned((TOKENS, hidden + 128), dtype), device)
    pagedvk.rms_norm(d_out[:, 128:], x, weight, EPS, backend=backend)
    check(d_out.numpy()[:, 128:], reference.rms_norm(wide[:, 64:], weight, EPS), dtype)
    assert np.isnan(d_out.numpy()[:, :128].astype(np.float32)).all()

    residual = random(rng, (TOKENS, hidden), dtype)
    d_residual_wide = pagedvk.asarray(np.concatenate([residual, residual[:, :64]], axis=1), device)
    ref_out, ref_residual = reference.fused_add_rms_norm(wide[:, 64:], residual, weight, EPS)
    pagedvk.fused_add_rms_norm(x, d_residual_wide[:, :hidden], weight, EPS, backend=backend)
    after, residual_after = d_wide.numpy(), d_residual_wide.numpy()
    check(after[:, 64:], ref_out, dtype)
    check(residual_after[:, :hidden], ref_residual, dtype)
    assert np.array_equal(after[:, :64], wide[:, :64]) and np.array_equal(residual_after[:, hidden:], residual[:, :64])

    gate_up = random(rng, (TOKENS, 2 * 256 + 64), dtype)
    d_act = pagedvk.asarray(poisoned((TOKENS, 256 + 64), dtype), device)
    pagedvk.silu_and_mul(d_act[:, 64:], pagedvk.asarray(gate_up, device)[:, 64:], backend=backend)
    check(d_act.numpy()[:, 64:], reference.silu_and_mul(gate_up[:, 64:]), dtype)

    table, ids = random(rng, (30, 256), dtype), rng.integers(0, 30, TOKENS).astype(np.int32)
    d_emb = pagedvk.asarray(poisoned((TOKENS, 256 + 64), np.float32), device)
    assert pagedvk.embedding(ids, table, out=d_emb[:, 64:], backend=backend).shape == (TOKENS, 256)
    assert np.array_equal(d_emb.numpy()[:, 64:], reference.embedding(ids, table))
    assert np.isnan(d_emb.numpy()[:, :64]).all()


# -- silu_and_mul ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(TOKENS, 2 * 1376), (2, 5, 2 * 36)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul(rng, device, backend, dtype, shape):
    x = random(rng, shape, dtype, scale=4.0)
    x.reshape(-1)[:4] = (-200.0, 200.0, 0.0, -0.0)   # exp overflow and zeros: silu's limits, no NaN
    out = pagedvk.asarray(poisoned(shape[:-1] + (shape[-1] // 2,), dtype), device)
    pagedvk.silu_and_mul(out, pagedvk.asarray(x, device), backend=backend)
    check(out, reference.silu_and_mul(x))


# -- rotary_embedding -----------------------------------------------------------------------------------------------

ROPE_CASES = tiered(
    [(h, r, neox) for h in (64, 128, 80) for r in (h, h // 2) for neox in (True, False)],
    default=[(64, 64, True), (64, 64, False), (128, 128, True), (128, 64, False), (80, 40, True)])


@pytest.mark.parametrize("head_size,rot_dim,is_neox", ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding(rng, device, backend, dtype, head_size, rot_dim, is_neox):
    num_heads, num_kv_heads = 4, 2
    cache = pagedvk.rope_cos_sin_cache(300, rot_dim, 500000.0, dtype=dtype if dtype.itemsize == 2 else np.float32)
    positions = rng.integers(0, 300, TOKENS).astype(np.int64)   # vLLM's positions are int64
    query = random(rng, (TOKENS, num_heads, head_size), dtype)          # [tokens, heads, head_size]
    key = random(rng, (TOKENS, num_kv_heads * head_size), dtype)        # [tokens, heads * head_size]
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    d_query, d_key = pagedvk.asarray(query, device), pagedvk.asarray(key, device)
    pagedvk.rotary_embedding(pagedvk.asarray(positions, device), d_query, d_key, head_size,
                             pagedvk.asarray(cache, device), is_neox, backend=backend)
    check(d_query, ref_q)
    check(d_key, ref_k)
    if rot_dim < head_size:   # partial rotary: the dims past rot_dim are left exactly as they were
        assert np.array_equal(d_query.numpy()[..., rot_dim:], query[..., rot_dim:])


def test_rotary_embedding_of_numpy_arrays_and_no_key(rng, device, backend):
    cache = pagedvk.rope_cos_sin_cache(64, 32)
    positions = list(range(5, 5 + TOKENS))   # a Python sequence
    query = random(rng, (TOKENS, 3 * 64), np.float32)
    ref_q, _ = reference.rotary_embedding(positions, query, None, 64, cache, False)
    assert pagedvk.rotary_embedding(positions, query, None, 64, cache, False, backend=backend) is None
    check(query, ref_q)


def test_rotary_embedding_on_a_fused_qkv_projection_in_place(rng, device, backend):
    # vLLM rotates q and k as column slices of the qkv projection's output: the views are rotated where they lie and
    # the value columns between nothing touches.
    num_heads, num_kv_heads, head_size = 4, 2, 64
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = random(rng, (TOKENS, q_size + 2 * kv_size), ml_dtypes.bfloat16)
    cache = pagedvk.rope_cos_sin_cache(100, head_size)
    positions = rng.integers(0, 100, TOKENS).astype(np.int32)
    ref_q, ref_k = reference.rotary_embedding(positions, qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], head_size,
                                              cache, True)
    d_qkv = pagedvk.asarray(qkv, device)
    query = d_qkv[:, :q_size].reshape(TOKENS, num_heads, head_size)
    key = d_qkv[:, q_size:q_size + kv_size]
    pagedvk.rotary_embedding(positions, query, key, head_size, cache, True, backend=backend)
    after = d_qkv.numpy()
    check(after[:, :q_size], ref_q.reshape(TOKENS, q_size), ml_dtypes.bfloat16)
    check(after[:, q_size:q_size + kv_size], ref_k, ml_dtypes.bfloat16)
    assert np.array_equal(after[:, q_size + kv_size:], qkv[:, q_size + kv_size:])


def test_unchecked_positions_leave_their_tokens_and_stay_inside_the_table(rng, device, backend):
    cache = pagedvk.rope_cos_sin_cache(32, 64)
    positions = np.array([0, 31, 32, -1, 2 ** 31 - 1, 7], np.int32)
    query = random(rng, (6, 2 * 64), np.float32)
    (d_cache, d_query), guards = fenced(device, cache, query)
    pagedvk.rotary_embedding(positions, d_query, None, 64, d_cache, True, backend=backend, validate=False)
    ref_q, _ = reference.rotary_embedding(np.array([0, 31, 7]), query[[0, 1, 5]], None, 64, cache, True)
    out = d_query.numpy()
    check(out[[0, 1, 5]], ref_q)
    assert np.array_equal(out[2:5], query[2:5])
    assert_untouched(*guards)


def test_rope_cos_sin_cache_is_vllms_table():
    cache = pagedvk.rope_cos_sin_cache(2048, 128, 10000.0, dtype=np.float32)
    assert cache.shape == (2048, 128) and cache.dtype == np.float32
    for p, i in ((0, 0), (1, 0), (1, 63), (2047, 5), (1000, 40)):
        angle = p * 10000.0 ** (-2 * i / 128)
        assert cache[p, i] == np.float32(math.cos(angle)) and cache[p, 64 + i] == np.float32(math.sin(angle))
    assert pagedvk.rope_cos_sin_cache(4, 8, dtype=ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16


# -- the launch path: kernels bounded, recorded steps --------------------------------------------------------------

def test_kernels_stay_inside_their_buffers(rng, device, backend):
    # 17 rows of 576: every launch ends in a partial workgroup. Each array sits between sentinels in one buffer.
    x, residual, weight = (random(rng, (TOKENS, 576), np.float16), random(rng, (TOKENS, 576), np.float16),
                           random(rng, 576, np.float16))
    table, ids = random(rng, (30, 576), np.float16), rng.integers(0, 30, TOKENS).astype(np.int32)
    (d_x, d_residual, d_weight, d_out, d_table, d_ids, d_gate, d_act), guards = fenced(
        device, x, residual, weight, poisoned(x.shape, np.float16), table, ids, random(rng, (TOKENS, 1152), np.float16),
        poisoned((TOKENS, 576), np.float16))
    pagedvk.embedding(d_ids, d_table, out=d_out, backend=backend)
    pagedvk.rms_norm(d_out, d_x, d_weight, EPS, backend=backend)
    pagedvk.fused_add_rms_norm(d_x, d_residual, d_weight, EPS, backend=backend)
    pagedvk.silu_and_mul(d_act, d_gate, backend=backend)
    cache = pagedvk.rope_cos_sin_cache(30, 64, dtype=np.float16)
    (d_cache,), more_guards = fenced(device, cache)
    pagedvk.rotary_embedding(d_ids, d_x[:, :512], d_residual[:, :128], 64, d_cache, False, backend=backend)
    assert_untouched(*guards, *more_guards)
    assert np.isfinite(d_act.numpy().astype(np.float32)).all()


def test_a_layer_recorded_once_replays_on_new_inputs(rng, device, backend):
    hidden, num_heads, head_size = 128, 2, 64
    table, weight = random(rng, (60, hidden), np.float32), random(rng, hidden, np.float32)
    cache = pagedvk.asarray(pagedvk.rope_cos_sin_cache(64, head_size), device)
    d_table, d_weight = pagedvk.asarray(table, device), pagedvk.asarray(weight, device)
    ids, positions = pagedvk.zeros(TOKENS, np.int32, device), pagedvk.zeros(TOKENS, np.int32, device)
    residual = pagedvk.zeros((TOKENS, hidden), np.float32, device)
    normed = pagedvk.empty((TOKENS, hidden), np.float32, device)
    act = pagedvk.empty((TOKENS, hidden // 2), np.float32, device)
    with pagedvk.record(device) as step:
        hidden_states = pagedvk.embedding(ids, d_table, backend=backend)
        pagedvk.fused_add_rms_norm(hidden_states, residual, d_weight, EPS, backend=backend)
        pagedvk.rms_norm(normed, hidden_states, d_weight, EPS, backend=backend)
        pagedvk.rotary_embedding(positions, normed, None, head_size, cache, True, backend=backend)
        pagedvk.silu_and_mul(act, normed, backend=backend)
    assert step.ops == ["embedding", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]
    assert isinstance(hidden_states, pagedvk.DeviceArray)
    for _ in range(2):   # new ids and positions written in place before each replay; the residual carries over
        i, p = rng.integers(0, 60, TOKENS).astype(np.int32), rng.integers(0, 64, TOKENS).astype(np.int32)
        ids.write(i)
        positions.write(p)
        before = residual.numpy()
        step.replay()
        x, res = reference.fused_add_rms_norm(reference.embedding(i, table).astype(np.float32), before, weight, EPS)
        n = reference.rms_norm(x.astype(np.float32), weight, EPS).astype(np.float32)
        q, _ = reference.rotary_embedding(p, n, None, head_size, cache.numpy(), True)
        check(residual, res)
        check(act, reference.silu_and_mul(q.astype(np.float32)))
    step.close()


def test_a_repeated_device_call_queues_its_kept_launch_without_checks(rng, device, backend, monkeypatch):
    # An engine calls each op per layer with the same arrays every step: after one checked call, the same arrays and
    # options queue the launch kept for them (no checks, no recording); other options are checked and recorded anew.
    import pagedvk.ops.layer_ops as layer_ops
    _, launches = record_launches(monkeypatch)
    checked = []
    rows = layer_ops._rows
    monkeypatch.setattr(layer_ops, "_rows", lambda *a: (checked.append(a[0]), rows(*a))[1])
    x, weight = pagedvk.asarray(random(rng, (TOKENS, 576), np.float32), device), random(rng, 576, np.float32)
    d_weight, out = pagedvk.asarray(weight, device), pagedvk.empty((TOKENS, 576), np.float32, device)
    cache = pagedvk.asarray(pagedvk.rope_cos_sin_cache(64, 64), device)
    positions = pagedvk.asarray(rng.integers(0, 64, TOKENS).astype(np.int32), device)
    for step in range(3):
        new = random(rng, (TOKENS, 576), np.float32)
        x.write(new)
        pagedvk.rms_norm(out, x, d_weight, EPS, backend=backend)
        check(out, reference.rms_norm(new, weight, EPS))
        pagedvk.rotary_embedding(positions, out, None, 64, cache, True, backend=backend, validate=False)
        check(out, reference.rotary_embedding(positions.numpy(), reference.rms_norm(new, weight, EPS), None, 64,
                                              cache.numpy(), True)[0])
    assert len(launches) == 2 and checked == ["input", "out", "query"]
    pagedvk.rms_norm(out, x, d_weight, 1e-3, backend=backend)   # another epsilon: checked, recorded, right
    check(out, reference.rms_norm(x.numpy(), weight, 1e-3))
    assert len(launches) == 3 and checked[3:] == ["input", "out"]
    with pytest.raises(ValueError, match="epsilon must be positive"):
        pagedvk.rms_norm(out, x, d_weight, float("nan"), backend=backend)


def test_host_arrays_are_refused_inside_a_recording_by_name(rng, device):
    x = pagedvk.asarray(random(rng, (4, 64), np.float32), device)
    with pagedvk.record(device):
        with pytest.raises(TypeError, match=r"rms_norm inside pagedvk.record\(\): weight must be a DeviceArray"):
            pagedvk.rms_norm(x, x, np.ones(64, np.float32), EPS)
        with pytest.raises(TypeError, match=r"embedding inside pagedvk.record\(\): token_ids must be a DeviceArray"):
            pagedvk.embedding([1, 2], pagedvk.asarray(np.ones((4, 64), np.float32), device))


# -- rejected inputs ------------------------------------------------------------------------------------------------

def _arrays(rng, device):
    """Device arrays every rejection case starts from (the written ones are checked untouched)."""
    f32 = np.float32
    a = dict(
        x=random(rng, (5, 64), f32), residual=random(rng, (5, 64), f32), weight=random(rng, 64, f32),
        out=random(rng, (5, 64), f32), table=random(rng, (10, 64), f32), ids=np.arange(5, dtype=np.int32),
        gate=random(rng, (5, 128), f32), query=random(rng, (5, 128), f32), key=random(rng, (5, 64), f32),
        cache=pagedvk.rope_cos_sin_cache(16, 32))
    return a, {name: pagedvk.asarray(v, device) for name, v in a.items()}


class On:
    """A case's argument taken from the test's device arrays: On(lambda d: d["x"][1:4])."""

    def __init__(self, pick):
        self.pick = pick


def _resolve(arguments: dict, d: dict) -> dict:
    return {name: d[v] if isinstance(v, str) and v in d else v.pick(d) if isinstance(v, On) else v
            for name, v in arguments.items()}


def _cases():
    """(op, arguments, changes, error, pattern); a string argument names one of _arrays' device arrays."""
    d = {name: name for name in ("x", "residual", "weight", "out", "table", "ids", "gate", "query", "key", "cache")}
    readonly = np.zeros((5, 64), np.float32)
    readonly.setflags(write=False)
    emb = ("embedding", dict(token_ids=d["ids"], weight=d["table"], out=d["out"]))
    rms = ("rms_norm", dict(out=d["out"], input=d["x"], weight=d["weight"], epsilon=EPS))
    fused = ("fused_add_rms_norm", dict(input=d["x"], residual=d["residual"], weight=d["weight"], epsilon=EPS))
    silu = ("silu_and_mul", dict(out=d["out"], x=d["gate"]))
    rope = ("rotary_embedding", dict(positions=d["ids"], query=d["query"], key=d["key"], head_size=64,
                                     cos_sin_cache=d["cache"], is_neox=True))
    f16 = np.zeros((5, 64), np.float16)
    return [
        (*emb, dict(token_ids=[1.5, 2.0]), TypeError, "token_ids must be an int32 array or a sequence of ints"),
        (*emb, dict(token_ids=np.arange(5, dtype=np.int16)), TypeError, "token_ids must have dtype int32 or int64"),
        (*emb, dict(token_ids=np.array([0, 1, 10, 2, 3], np.int32)), ValueError,
         r"token_ids\[2\] = 10 is outside \[0, 10\) \(vocab_size"),
        (*emb, dict(token_ids=np.array([0, -1, 2, 3, 4])), ValueError, r"token_ids\[1\] = -1 is outside"),
        (*emb, dict(token_ids=On(lambda d: pagedvk.asarray(np.array([0, 1, 2, 12, 3], np.int32), d["x"].device))),
         ValueError, r"token_ids\[3\] = 12 is outside \[0, 10\)"),   # device ids are read back
        (*emb, dict(weight=np.zeros(64, np.float32)), ValueError, r"weight must have 2 dimensions \[vocab_size"),
        (*emb, dict(weight=np.zeros((10, 64), np.float64)), TypeError, "weight must have dtype float32"),
        (*emb, dict(weight=np.zeros((10, 63), np.float32)), ValueError, r"weight.shape\[1\] \(hidden_size\) must be a "
                                                                        "positive even number"),
        (*emb, dict(out=np.zeros((5, 32), np.float32)), ValueError, r"out must have shape \(5, 64\)"),
        (*emb, dict(weight=np.zeros((10, 64), np.float16), out=np.zeros((5, 64), ml_dtypes.bfloat16)), TypeError,
         "out must have dtype float16 or float32"),
        (*emb, dict(out=readonly), ValueError, "out must be writable"),
        (*emb, dict(backend="cuda"), ValueError, "backend must be one of"),
        (*rms, dict(input=np.zeros((5, 64), np.int32)), TypeError, "input must have dtype float32, float16, bfloat16"),
        (*rms, dict(input=np.zeros((5, 63), np.float32)), ValueError, r"input.shape\[-1\] \(hidden_size\) must be a "
                                                                       "positive even"),
        (*rms, dict(out=np.zeros((5, 64), np.float16)), TypeError, "out must have dtype float32"),
        (*rms, dict(out=np.zeros((4, 64), np.float32)), ValueError, r"out must have shape \(5, 64\) \(input's\)"),
        (*rms, dict(weight=np.zeros(32, np.float32)), ValueError, r"weight.shape\[0\] \(hidden_size, from input\)"),
        (*rms, dict(weight=np.zeros((1, 64), np.float32)), ValueError, "weight must have 1 dimensions"),
        (*rms, dict(epsilon=0.0), ValueError, "epsilon must be positive"),
        (*rms, dict(epsilon=-1e-6), ValueError, "epsilon must be positive"),
        (*rms, dict(epsilon=float("nan")), ValueError, "epsilon must be positive, finite"),
        (*rms, dict(epsilon=1e-60), ValueError, "not 0 there"),
        (*rms, dict(epsilon="1e-5"), TypeError, "epsilon must be a real number"),
        (*rms, dict(out=On(lambda d: d["x"][1:4])), ValueError, r"out must have shape"),
        (*fused, dict(residual="x"), ValueError, "residual and input must be different arrays"),
        (*fused, dict(residual=f16), TypeError, "residual must have dtype float32"),
        (*fused, dict(residual=np.zeros((5, 66), np.float32)), ValueError, r"residual must have shape \(5, 64\)"),
        (*fused, dict(epsilon=True), TypeError, "epsilon must be a real number"),
        (*silu, dict(x=np.zeros((5, 130), np.float32)), ValueError, r"x's last axis \(2 \* d\) must be a positive "
                                                                     "multiple of 4"),
        (*silu, dict(out=np.zeros((5, 128), np.float32)), ValueError, r"out must have shape \(5, 64\)"),
        (*silu, dict(out=f16), TypeError, "out must have dtype float32"),
        (*silu, dict(x=On(lambda d: d["gate"].reshape(5, 2, 64))), ValueError, r"out must have shape \(5, 2, 32\)"),
        (*rope, dict(head_size=63), ValueError, "head_size must be even"),
        (*rope, dict(head_size=64.0), TypeError, "head_size must be an int"),
        (*rope, dict(query=np.zeros((5, 100), np.float32)), ValueError, r"query must be \[num_tokens, num_heads \* "
                                                                         r"head_size\]"),
        (*rope, dict(key=f16), TypeError, "key must have dtype float32"),
        (*rope, dict(key=np.zeros((4, 64), np.float32)), ValueError, r"key.shape\[0\] \(num_tokens, from query\)"),
        (*rope, dict(key="query"), ValueError, "key and query must be different arrays"),
        (*rope, dict(key=On(lambda d: d["query"][:, 64:])), ValueError, "key and query overlap"),
        (*rope, dict(positions=np.arange(4)), ValueError, r"positions.shape\[0\] \(num_tokens, from query\)"),
        (*rope, dict(positions=np.array([0, 1, 16, 2, 3])), ValueError,
         r"positions\[2\] = 16 is outside \[0, 16\) \(max_position"),
        (*rope, dict(positions=np.arange(5, dtype=np.uint32)), TypeError, "positions must have dtype int32 or int64"),
        (*rope, dict(cos_sin_cache=np.zeros((16, 30), np.float32)), ValueError,
         r"cos_sin_cache.shape\[1\] \(rot_dim\) must be a positive multiple of 4"),
        (*rope, dict(cos_sin_cache=np.zeros((16, 128), np.float32)), ValueError, "at most head_size 64"),
        (*rope, dict(cos_sin_cache=np.zeros(16, np.float32)), ValueError, "cos_sin_cache must have 2 dimensions"),
        (*rope, dict(cos_sin_cache=np.zeros((16, 32), np.float64)), TypeError, "cos_sin_cache must have dtype"),
        (*rope, dict(is_neox=1), TypeError, "is_neox must be a bool"),
    ]


CASES = _cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rejected_inputs_write_nothing(rng, device, case):
    originals, d = _arrays(rng, device)
    op, arguments, changes, error, pattern = CASES[case]
    with pytest.raises(error, match=pattern):
        getattr(pagedvk, op)(**_resolve({**arguments, **changes}, d))
    for name, a in d.items():
        assert np.array_equal(a.numpy(), originals[name], equal_nan=True), f"{name} was written"


def test_rope_cos_sin_cache_rejects_by_name():
    with pytest.raises(ValueError, match="rot_dim must be even"):
        pagedvk.rope_cos_sin_cache(8, 7)
    with pytest.raises(ValueError, match="base must be a positive finite number"):
        pagedvk.rope_cos_sin_cache(8, 8, base=0.0)
    with pytest.raises(ValueError, match=r"max_position must be in \[1, "):
        pagedvk.rope_cos_sin_cache(0, 8)
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        pagedvk.rope_cos_sin_cache(8, 8, dtype=np.float64)


def test_overlap_of_device_views_is_found_exactly(device):
    # The ops refuse arrays that overlap (and take one array given twice as in place): views of one array, as a fused
    # projection's columns, interleave their rows without sharing an element, which must pass.
    from pagedvk.ops.layer_ops import _share_memory
    h = np.zeros((6, 16), np.float32)
    d = pagedvk.asarray(h, device)
    views = [(d[r0:r1], h[r0:r1]) for r0 in range(6) for r1 in range(r0 + 1, 7)]
    views += [(d[r0:r1, c0:c1], h[r0:r1, c0:c1]) for r0 in range(0, 6, 2) for r1 in (r0 + 1, 6)
              for c0 in range(0, 16, 4) for c1 in range(c0 + 4, 17, 4)]
    views += [(a.reshape(-1, 4), b.reshape(-1, 4)) for a, b in views if a.is_contiguous and a.size % 4 == 0][:20]
    for a, ha in views:
        for b, hb in views:
            assert _share_memory(a, b) == np.shares_memory(ha, hb), (a, b)


def test_an_id_out_of_range_is_named_by_its_index(rng):
    with pytest.raises(ValueError, match=r"token_ids\[1, 1\] = 99 is outside \[0, 30\)"):
        pagedvk.embedding([[0, 1], [2, 99]], random(rng, (30, 8), np.float32))
