"""Shared test helpers: random paged caches in vLLM's layout, poisoned outputs, the error measure."""

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

import pagedvk

# Outputs the library allocates itself (numpy in, numpy out) start as NaN too, as the tests' own outputs do.
import pagedvk.config
import pagedvk.runtime.array
import pagedvk.testing.reference
pagedvk.runtime.array.POISON_EMPTY = True


# -- tiers: the default run covers every op, cache type, layout, backend, kernel and variant and every rejected input;
# the rest of each matrix (every head size, block size, group width...) is marked `full` and runs with
# `pytest -m "full or not full"` (pyproject.toml deselects it by default). Which value goes where is said where
# the test is parametrized.

# Property tests draw fewer examples in the default tier: `--hypothesis-profile=full` draws the exhaustive tier's.
settings.register_profile("default-tier", max_examples=12, deadline=None)
settings.register_profile("full", max_examples=40, deadline=None)
settings.load_profile("default-tier")   # the plugin loads --hypothesis-profile's after this, where it is given


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


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test: seeded from the test's name.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def device():
    return pagedvk.default_device()


# -- validation in CI: `PAGEDVK_VALIDATION=1 pytest` fails any test after which the layer said anything --

VALIDATING = pagedvk.config.validation()


def pytest_configure(config):
    config.addinivalue_line("markers", "provokes_validation: the test causes validation messages on purpose "
                                       "(and checks them itself); the validation fixture ignores them")


@pytest.fixture(autouse=True)
def no_validation_messages(request):
    """With PAGEDVK_VALIDATION=1, every message the layer reported during a test (warnings included, and
    synchronization validation's) fails that test, even where no device.check() raised it."""
    from pagedvk.runtime import instance
    if VALIDATING and instance._instance is not None:
        instance._instance.take_messages()   # anything left by a test that already failed, or its setup
    yield
    if not VALIDATING or instance._instance is None:
        return
    messages = instance._instance.take_messages()
    if messages and request.node.get_closest_marker("provokes_validation") is None:
        pytest.fail(f"{len(messages)} Vulkan validation message(s) during this test:\n" + "\n\n".join(messages),
                    pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def no_validation_messages_at_close():
    """With PAGEDVK_VALIDATION=1, close the devices the tests opened before the session ends and fail
    on what the layer says then (objects destroyed while in use, say), which no test's teardown sees."""
    yield
    from pagedvk.runtime import selection
    from pagedvk.runtime import instance
    if not VALIDATING or instance._instance is None:
        return
    for device in list(selection._open.values()):
        device.close()
    messages = instance._instance.take_messages()
    if messages:
        pytest.fail(f"{len(messages)} Vulkan validation message(s) when the devices closed:\n" + "\n\n".join(messages),
                    pytrace=False)
