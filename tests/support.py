"""Helpers the tests share: the tiers' parametrization, the error measures, random paged caches in vLLM's layout,
poisoned outputs, sentinel-fenced buffers, threads that cannot hang CI, and the checks several test files run.
Import them with `from support import ...` (pyproject.toml puts tests/ on the path); fixtures and pytest's
configuration live in tests/conftest.py."""

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

import pagedvk
import pagedvk.kernels.modules
import pagedvk.ops.layouts
import pagedvk.testing.reference

# The checkout's root (this file is tests/support.py): where benchmarks/, shaders/ and docs/ are.
REPO = Path(__file__).resolve().parent.parent

def tiered(values, default):
    """parametrize's argvalues: `values`, those not in `default` marked `full` (the exhaustive tier)."""
    def param(v):
        return pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.full)
    return [v if v in default else param(v) for v in values]


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all(), "output has NaN or inf (unwritten, or poisoned and never overwritten)"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def lse_error(lse, ref) -> float:
    """lse's relative error against the reference's over the rows that see keys; rows that see none (-inf in the
    reference) must be -inf too."""
    empty = np.isneginf(ref)
    assert np.array_equal(np.isneginf(lse), empty), "lse is not -inf exactly where the reference's is"
    return rel_error(lse[~empty], ref[~empty])


def run_python(code: str, argv=(), **env) -> subprocess.CompletedProcess:
    # `import pagedvk` there must find the package these tests import (installed, or a checkout on the path).
    package_root = str(Path(pagedvk.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path, **env), timeout=300, cwd=tempfile.gettempdir())


# A small decode problem for subprocess programs (run_python): the device, its pipeline and objects exist before
# the part under test; attend() runs it, right(out) checks an output against the float64 reference.
PROBLEM = """
    import numpy as np, pagedvk
    import pagedvk.testing.reference
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 2, 8, 16, 4)).astype(np.float32)
    v = rng.standard_normal((6, 2, 32, 16)).astype(np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    bt = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    sl = np.array([40, 17], np.int32)
    def attend():
        return pagedvk.paged_attention(q, k, v, bt, sl)
    def right(out):
        ref = pagedvk.testing.reference.paged_attention(q, k, v, bt, sl)
        return np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
"""


def program(*parts) -> str:
    """One program from parts each indented its own way."""
    return "\n".join(textwrap.dedent(p) for p in parts)


# -- threads: every join has a timeout, so a hang fails the test instead of hanging CI --

THREADS = 8
JOIN_S = 120


def run_threads(body, n=THREADS):
    """body(i) in n threads started together; re-raises the first failure."""
    start = threading.Barrier(n)
    errors = []

    def main(i):
        try:
            start.wait()
            body(i)
        except BaseException as e:   # noqa: BLE001 - handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=main, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


class Case:
    """A random decode problem: caches, a shuffled block table, lengths, queries."""

    def __init__(self, rng, *, num_seqs=3, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                 seq_lens=None, max_len=300, spare_blocks=3, shared_prefix_blocks=0, dtype=np.float32):
        x = 16 // np.dtype(dtype).itemsize
        if seq_lens is None:
            seq_lens = rng.integers(1, max_len + 1, size=num_seqs)
        self.seq_lens = np.asarray(seq_lens, dtype=np.int32)
        num_seqs = len(self.seq_lens)
        blocks_per_seq = [-(-int(n) // block_size) for n in self.seq_lens]
        max_blocks = max(blocks_per_seq + [1]) + 2     # padding columns the kernel must not read
        own = [max(b - shared_prefix_blocks, 0) for b in blocks_per_seq]
        num_blocks = shared_prefix_blocks + sum(own) + spare_blocks
        ids = rng.permutation(num_blocks).astype(np.int32)           # shuffled physical blocks
        shared, pool = ids[:shared_prefix_blocks], list(ids[shared_prefix_blocks:])
        self.block_tables = np.full((num_seqs, max_blocks), -1, np.int32)  # unused entries: invalid ids
        for s, b in enumerate(blocks_per_seq):
            row = list(shared[:min(b, shared_prefix_blocks)]) + [pool.pop() for _ in range(own[s])]
            self.block_tables[s, :b] = row
        self.key_cache = rng.standard_normal((num_blocks, num_kv_heads, head_size // x, block_size, x)).astype(dtype)
        self.value_cache = rng.standard_normal((num_blocks, num_kv_heads, head_size, block_size)).astype(dtype)
        self.query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
        self.num_kv_heads, self.block_size = num_kv_heads, block_size

    def args(self):
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens

    def reference(self, scale=None):
        return pagedvk.testing.reference.paged_attention(*self.args(), scale=scale)

    def poisoned_out(self):
        return np.full(self.query.shape, np.nan, self.query.dtype)


def in_layout(case, layout, dtype):
    """The case's caches (vLLM layout, already of `dtype`) in `layout`: "vllm", "nhd" or "hnd"."""
    if layout == "vllm":
        return case.key_cache, case.value_cache
    k, v = pagedvk.testing.reference.nhd_views(case.key_cache, case.value_cache, "vllm")
    k, v = pagedvk.testing.reference.nhd_as_cache(k, v, layout, None)
    return np.ascontiguousarray(k, dtype), np.ascontiguousarray(v, dtype)


# -- rejected inputs: a call with one argument broken at a time --

TENSOR_NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")


def tensors_by_name(case) -> dict:
    """The case's query, caches, block tables and lengths by their argument names."""
    return dict(zip(TENSOR_NAMES, case.args()))


def rejects(call, arguments: dict, exc, match, **changes) -> dict:
    """call(**arguments), each of `changes` replacing (or adding) the argument of its name, raises `exc` with a message
    that matches `match`. Returns the arguments of the call, for the caller to check what it left unwritten."""
    called = {**arguments, **changes}
    with pytest.raises(exc, match=match):
        call(**called)
    return called


# -- decode through a plan: unsplit and split, against float64 --

class DecodeRun(NamedTuple):
    """What a run of a DecodePlan gave (its outputs) and took (the plan's module key, partitions, where they merge)."""
    out: np.ndarray
    lse: np.ndarray
    key: object
    num_partitions: int
    merge_in_decode: bool


def run_decode_plan(case, query=None, partition_size=None, *, layout="vllm", key_cache=None, value_cache=None,
                    constants=None, **options) -> DecodeRun:
    """A DecodePlan for the case's tables and caches stored in `layout`, run on `query` (the case's unless given) into
    NaN-poisoned out and lse, on the case's caches or on `key_cache` and `value_cache` (views of them: the plan is made
    for the case's dtype). `options`: the plan's (kernel, backend, device, attention variants, ...); `constants`:
    specialization constants set on the plan after it chose them."""
    query = case.query if query is None else query
    stored_keys, stored_values = in_layout(case, layout, case.key_cache.dtype)
    out = np.full(query.shape, np.nan, query.dtype)
    lse = np.full(query.shape[:2], np.nan, np.float32)
    with pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=query.shape[1], num_kv_heads=case.num_kv_heads,
                            head_size=query.shape[2], block_size=case.block_size, num_blocks=case.key_cache.shape[0],
                            dtype=case.key_cache.dtype, query_dtype=query.dtype, layout=layout,
                            partition_size=partition_size, **options) as plan:
        plan.constants.update(constants or {})
        plan.run(query, stored_keys if key_cache is None else key_cache,
                 stored_values if value_cache is None else value_cache, out=out, lse=lse)
        return DecodeRun(out, lse, plan.key, plan.num_partitions, plan.merge_in_decode)


def check_split_and_unsplit(case, query=None, *, tol, lse_tol=1e-5, layout="vllm",
                            partitionings=((4096, None), (32, None)), check_run=None, variants=None, **options):
    """Decode of the case (run_decode_plan) once per (partition_size, constants) of `partitionings`, by default one
    partition and then 32-token ones: each run's out within `tol` of float64's and its lse within `lse_tol` (a sequence
    with no keys: zeros and -inf), and the runs' outputs within `tol` of one another (the partitions' sums only add in
    another order). check_run(index, run) checks what else the index-th run should show (its module, its partition
    count). `variants`: the attention variants the plan and the reference both take; `options`: the plan's."""
    query = case.query if query is None else query
    variants = variants or {}
    ref_out, ref_lse = pagedvk.testing.reference.paged_attention(query, *case.args()[1:], return_lse=True, **variants)
    outs = []
    for index, (partition_size, constants) in enumerate(partitionings):
        run = run_decode_plan(case, query, partition_size, layout=layout, constants=constants, **variants, **options)
        if check_run is not None:
            check_run(index, run)
        err = rel_error(run.out, ref_out)
        # pytest shows it with a failure (and with -rA, for a run that passes)
        print(f"{run.key.name} partitions {run.num_partitions} constants {constants}: rel error {err:.3g}")
        assert err <= tol
        assert (run.out[np.isneginf(ref_lse)] == 0).all()
        assert lse_error(run.lse, ref_lse) <= lse_tol
        outs.append(run.out.astype(np.float32))
    for other in outs[1:]:
        np.testing.assert_allclose(outs[0], other, rtol=0, atol=tol)


# -- sentinels: arrays laid out in one buffer between sentinel ranges, so a stray access lands in a sentinel --

SENTINEL = np.float32(-1234.5)   # a pattern no kernel writes by chance
GUARD_BYTES = 16384


def fenced(device, *host_arrays):
    """Device copies of host_arrays laid out in ONE buffer as [sentinel | copy | sentinel | copy | ... |
    sentinel]: (copies, sentinels). Each copy binds only its own range, so an access past it lands in the
    sentinel beside it (separate allocations need not be neighbours). Each copy starts at the device's
    minStorageBufferOffsetAlignment; the sentinel before it fills the gap from the previous copy's end."""
    align = max(16, device.info.min_storage_buffer_offset_alignment)
    up = lambda n, to: -(-n // to) * to
    guards, copies, end = [], [], 0   # (offset, nbytes) of each sentinel and copy, in buffer order
    for a in host_arrays:
        start = up(end + GUARD_BYTES, align)
        guards.append((end, start - end))
        copies.append(start)
        end = start + up(max(a.nbytes, 1), 16)   # a copy binds its bytes rounded up to 16, like a buffer
    guards.append((end, GUARD_BYTES))
    buffer = device.buffer(end + GUARD_BYTES)   # kept alive by the arrays over it, freed when they close
    over = pagedvk.DeviceArray.over_buffer
    guards = [over(buffer, off, n // 4, np.float32).write(np.full(n // 4, SENTINEL)) for off, n in guards]
    copies = [over(buffer, off, a.shape, a.dtype).write(a) for off, a in zip(copies, host_arrays)]
    return copies, guards


def assert_untouched(*sentinels):
    for a in sentinels:
        assert (a.numpy() == SENTINEL).all(), "a kernel wrote outside its own buffers"


def poison_unread_slots(case, block_size: int) -> None:
    """NaN in every cache slot no sequence reads (vLLM layout): slots past each sequence's length in its
    last block, and the blocks nobody uses. A kernel that weights them by zero instead of skipping them
    turns its output into NaN."""
    for s, n in enumerate(case.seq_lens):
        if n % block_size == 0:   # a full last block (or none): every slot is read
            continue
        last = case.block_tables[s, (n - 1) // block_size]
        case.key_cache[last, :, :, n % block_size:] = np.nan
        case.value_cache[last, :, :, n % block_size:] = np.nan
    used = set(case.block_tables[case.block_tables >= 0].tolist())
    for b in set(range(case.key_cache.shape[0])) - used:
        case.key_cache[b] = np.nan
        case.value_cache[b] = np.nan


def check_unchecked_tables(device, case, kernel: str, tol: float, backend: str = "glsl") -> list:
    """Decode over tables no host check passed, on a Case of seq_lens [0, 50, 0, 70, 33, 9, 100], 8 / 2 heads,
    head size 64, 16-token blocks: ids at and past num_blocks, negative ids, a length past its row, sequences of
    length 0 between valid ones; unsplit and in 32-token partitions, `kernel` forced. The sentinels around the
    caches keep their pattern, a sequence with no key in range gives zeros, the valid ones their attention.
    The plans' module keys (`backend`'s modules)."""
    num_blocks = case.key_cache.shape[0]
    bt, sl = case.block_tables.copy(), case.seq_lens.copy()
    bt[4, 0], bt[4, 1] = num_blocks, -3            # sequence 4: its first block out of range, its second negative
    bt[5, :] = 2**31 - 1                           # sequence 5: no block in range
    sl[6] = bt.shape[1] * 16 + 5                   # sequence 6: a length past its row, whose padding ids are -1
    seen = case.seq_lens.copy()                    # so it sees its 7 blocks whole: 112 keys
    seen[6] = 112
    expect = pagedvk.testing.reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, seen)
    (k, v), guards = fenced(device, case.key_cache, case.value_cache)
    keys = []
    for partition_size in (4096, 32):
        out = pagedvk.asarray(case.poisoned_out())
        with pagedvk.DecodePlan(pagedvk.asarray(bt), pagedvk.asarray(sl), num_heads=8, num_kv_heads=2, head_size=64,
                                block_size=16, num_blocks=num_blocks, dtype=case.key_cache.dtype,
                                partition_size=partition_size, validate=False, kernel=kernel, backend=backend) as plan:
            keys.append(plan.key)
            result = plan.run(pagedvk.asarray(case.query), k, v, out=out).numpy().astype(np.float32)
        assert np.isfinite(result).all()
        assert (result[[0, 2, 5]] == 0).all()
        np.testing.assert_allclose(result[[1, 3, 6]], expect[[1, 3, 6]], rtol=tol, atol=tol)
    assert_untouched(*guards)
    return keys


# -- prefill: the random problem, the check and the matrices the forward's and the backward's tests share --

PREFILL_HEAD_SIZES = (32, 64, 80, 128, 256)
PREFILL_QUERY_LENGTHS = (1, 3, 16, 64)
PREFILL_LAYOUTS = ("nhd", "vllm")
ALL_PREFILL_LAYOUTS = PREFILL_LAYOUTS + ("hnd",)   # FlashInfer's HND: its own cases, then the full tier's matrices
PREFILL_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)   # below 8 in the token-major layouts only (pagedvk.layouts)


class PrefillCase:
    """A random prefill problem: Case's shuffled paged cache (shared prefix blocks, padding
    columns of -1 in the block table) in either layout, and either q_len queries per sequence (query
    [num_seqs, num_heads, q_len, head_size]) or, with q_lens, a ragged batch (query [num_tokens, num_heads,
    head_size] and query_start_loc)."""

    def __init__(self, rng, *, q_len=None, q_lens=None, layout="nhd", causal=True, num_heads=4, num_kv_heads=2,
                 head_size=64, block_size=16, seq_lens=None, shared_prefix_blocks=0):
        self.ragged = q_lens is not None
        if seq_lens is None and self.ragged:   # each sequence with some cached context before its queries
            seq_lens = [n + int(rng.integers(0, 40)) for n in q_lens]
        if seq_lens is None:   # one sequence that is all query, others with cached context before it
            seq_lens = [q_len, q_len + 150, q_len + int(rng.integers(1, 40))]
        case = Case(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                    block_size=block_size, seq_lens=seq_lens, shared_prefix_blocks=shared_prefix_blocks)
        self.block_tables, self.seq_lens = case.block_tables, case.seq_lens
        self.key_cache, self.value_cache = in_layout(case, layout, np.float32)
        if self.ragged:
            self.query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            shape = (int(self.query_start_loc[-1]), num_heads, head_size)
        else:
            shape = (len(self.seq_lens), num_heads, q_len, head_size)
        self.query = rng.standard_normal(shape).astype(np.float32)
        self.layout, self.causal = layout, causal

    def args(self):
        tables = (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens)
        return tables + ((self.query_start_loc,) if self.ragged else ())

    def options(self, **kw):
        return dict(dict(layout=self.layout, causal=self.causal), **kw)

    def loc(self) -> dict:
        """query_start_loc as a keyword (the backward takes it after out and lse), or nothing."""
        return dict(query_start_loc=self.query_start_loc) if self.ragged else {}

    def reference(self, scale=None):
        return pagedvk.testing.reference.paged_attention_prefill(*self.args(), scale=scale, **self.options())


def check_prefill(case, backend, **kw):
    """paged_attention_prefill of the case on `backend`: out and lse of the right shapes and float32, each against
    float64 within float32 storage's tolerance."""
    out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend, **case.options(**kw))
    ref_out, ref_lse = case.reference(kw.get("scale"))
    assert isinstance(out, np.ndarray) and out.shape == case.query.shape and out.dtype == np.float32
    assert isinstance(lse, np.ndarray) and lse.shape == case.query.shape[:-1] and lse.dtype == np.float32
    assert rel_error(out, ref_out) <= 1e-5
    assert rel_error(lse, ref_lse) <= 1e-5
    return out, lse


# Forward and backward, default tier: each layout, head size and query length once.
HEAD_SIZES_AND_QUERY_LENGTHS = tiered(
    [(layout, h, q) for layout in ALL_PREFILL_LAYOUTS for h in PREFILL_HEAD_SIZES for q in PREFILL_QUERY_LENGTHS],
    default=[("nhd", 32, 1), ("vllm", 64, 3), ("nhd", 80, 16), ("vllm", 128, 64), ("nhd", 256, 3)])


# Forward and backward, default tier: each block size of vLLM's layout once, and FlashInfer's HND with 16-token blocks and with 1-token blocks
# (the kernels' ids then read from the table, and dk/dv's workgroups masked past the block).
BLOCK_SIZES_CAUSAL_OR_NOT = tiered(
    [(b, layout, c) for b in PREFILL_BLOCK_SIZES for layout in ALL_PREFILL_LAYOUTS for c in (True, False)
     if b in pagedvk.ops.layouts.block_sizes(layout)],
    default=[(8, "nhd", True), (16, "vllm", False), (32, "vllm", True), (16, "hnd", False), (1, "hnd", True)])


RAGGED_BATCHES = {   # q_len per sequence
    "mixed": [5, 1, 0, 17, 1, 3],     # prefill chunks, decode tokens and an empty sequence together
    "decode_tokens": [1, 1, 1, 1],
    "empty_at_both_ends": [0, 9, 0],
    "one_long": [70],
}


def modules_used(monkeypatch) -> list:
    """The (op, backend) of every pipeline the ops ask for from now on."""
    used, pipeline = [], pagedvk.kernels.modules.pipeline
    monkeypatch.setattr(pagedvk.kernels.modules, "pipeline",
                        lambda device, abi, key, *args: used.append((abi.op, key.backend)) or pipeline(device, abi, key,
                                                                                                      *args))
    return used


def record_launches(monkeypatch) -> tuple:
    """(barriers, launches): lists that fill as launches are recorded, the arguments of each barrier recorded and,
    for each Launch, (its steps' module names, its independent step indices)."""
    import pagedvk.runtime.pipeline as pipeline
    barriers, recorded = [], []
    barrier = pipeline.memory_barrier
    monkeypatch.setattr(pipeline, "memory_barrier", lambda *a: (barriers.append(a), barrier(*a)))
    launch = pipeline.Launch.__init__

    def spy(self, device, steps, *a, **kw):
        recorded.append(([step[0].name for step in steps], kw.get("independent", frozenset())))
        return launch(self, device, steps, *a, **kw)
    monkeypatch.setattr(pipeline.Launch, "__init__", spy)
    return barriers, recorded


# -- attention variants: decode's and prefill's tests run each of them --

def variant_args(rng, num_heads, names):
    """The named variants' arguments, random where they are arrays: ALiBi slopes of either sign (a bias that
    also grows with distance), sinks around the logits' size, a cap the logits reach, a window shorter than
    the contexts."""
    every = dict(alibi_slopes=(rng.uniform(-0.2, 0.2, num_heads)).astype(np.float32),
                 logits_soft_cap=1.5, sinks=rng.standard_normal(num_heads).astype(np.float32), window_left=40)
    return {name: every[name] for name in names}


VARIANTS = {"alibi": ("alibi_slopes",), "softcap": ("logits_soft_cap",), "sinks": ("sinks",),
            "window": ("window_left",), "all": ("alibi_slopes", "logits_soft_cap", "sinks", "window_left")}
