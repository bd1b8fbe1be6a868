"""Decode benchmarks timed on the GPU, against the device's own read bandwidth measured in the same run.

Times come from timestamp queries (ticks x timestampPeriod), after warm-up, as medians of many launches.
Several layers' caches are rotated so that one layer's cache is not simply re-read from the GPU's cache,
and the result of the first layer is checked against the float64 reference before anything is timed.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from .. import config
from ..dtypes import CACHE_TYPES, QUERY_TYPES
from ..kernels import modules
from ..kernels.abi import VariantKey
from ..kernels.catalogue import PAGED_DECODE, PAGED_DECODE_REDUCE, READ_BANDWIDTH
from ..ops.decode_plan import DecodePlan
from ..runtime.array import asarray, empty
from ..runtime.pipeline import Launch
from ..runtime.selection import get_device
from . import reference

# Issue 9's decode shapes (batch, context): 32 query heads, 8 KV heads, head 128, block 16 (DecodeShape's
# defaults); and a sweep lavapipe finishes in a minute or two.
SWEEP = [(1, 4096), (8, 4096), (64, 4096), (256, 2048), (32, 16384), (1, 32768), (8, 32768)]
SMALL_SWEEP = [(1, 1024), (8, 512), (32, 256)]


def parse_shapes(text: str) -> list:
    """Shapes written as comma-separated BATCHxCONTEXT ("64x4096,8x32768") -> [(64, 4096), (8, 32768)]."""
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"shapes must be comma-separated BATCHxCONTEXT of positive ints, got {text!r}")
    return shapes


# Cache dtypes by numpy name or by their kernels' tag (f32, f16, bf16, e4m3, e5m2), in the sweep's order.
DTYPE_NAMES = {**{t.tag: str(t) for t in CACHE_TYPES.values()}, **{str(t): str(t) for t in CACHE_TYPES.values()}}


def parse_dtypes(text: str) -> list:
    """Cache dtypes written as comma-separated names or tags ("f16,bfloat16") -> ["float16", "bfloat16"]."""
    items = text.split(",")
    if any(item not in DTYPE_NAMES for item in items):
        raise ValueError(f"dtypes must be comma-separated names from {', '.join(DTYPE_NAMES)}, got {text!r}")
    return [DTYPE_NAMES[item] for item in items]


def parse_backends(text: str) -> list:
    """Kernel languages written as comma-separated names ("glsl,wgsl")."""
    items = text.split(",")
    if any(item.strip().lower() not in config.BACKENDS for item in items):
        raise ValueError(f"backends must be comma-separated names from {', '.join(config.BACKENDS)}, got {text!r}")
    return [item.strip().lower() for item in items]


# rel. error allowed against float64: float32 storage, or 16-bit (and fp8, read into 16-bit queries) outputs;
# bfloat16's matrix decode rounds its weights to bfloat16 (2^-8), hence the tests' tolerance for it
# (tests/ops/test_decode_coopmat.py BF16_TOL), where 2e-3 flagged every correct bfloat16 matrix row (3.7e-3 on the H200)
TOLERANCE = {str(dtype): 1e-5 if dtype == np.float32 else 2e-3 for dtype in CACHE_TYPES} | {"bfloat16": 1.6e-2}

# GPUs drop their shader clock within a second of idling (the H200: 1980 -> 345 MHz; its memory clock
# stays) and raise it again only after some busy time, so a short timing run that follows host work (making
# the next shape's caches) measures the idle clock: 4-5x slower for the same kernel and buffers. Every timing
# first keeps the GPU busy this long. See BENCHMARKS.md, "the slow shapes".
WARMUP_SECONDS = 0.5

ROTATE_BYTES = 512 << 20  # caches rotated per timing loop: several times any GPU's last-level cache
CHECKED_SEQS = 4          # sequences checked against the float64 reference (it is slow on long contexts)


@dataclass
class DecodeShape:
    num_seqs: int = 8
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    context: int = 1024
    dtype: str = "float32"
    window_left: int = -1   # a sliding window (pagedvk.ops.variants): each query sees its last window_left + 1 keys

    @property
    def tokens(self) -> int:
        """Keys each sequence's query sees: the context, or the window where it is shorter."""
        return self.context if self.window_left < 0 else min(self.context, self.window_left + 1)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one decode launch must read (a window's: blocks before it are not read)."""
        return 2 * self.num_seqs * self.tokens * self.num_kv_heads * self.head_size * np.dtype(self.dtype).itemsize


class Progress:
    """A one-line progress bar on stderr (no dependency for a bar)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and total > 0 and sys.stderr.isatty()
        self._last = 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def warm_up(launch, submissions: int = 1) -> None:
    """Submit `launch` at least `submissions` times and until WARMUP_SECONDS have passed: the GPU's clocks
    are up when the timed submissions start."""
    deadline = time.monotonic() + WARMUP_SECONDS
    for _ in range(max(1, submissions)):
        launch.submit()
    while time.monotonic() < deadline:
        launch.submit()


def percentiles(ns) -> dict:
    a = np.asarray(ns, dtype=np.float64)
    return {"median_us": float(np.median(a)) / 1e3, "p10_us": float(np.percentile(a, 10)) / 1e3,
            "p90_us": float(np.percentile(a, 90)) / 1e3}


READ_THREADS = 256 * 1024   # the read kernel's grid: 1024 workgroups of 256 threads


def read_step(device, src, dst, nbytes: int, workgroups: int = READ_THREADS // 256) -> tuple:
    """A Launch step of the read kernel over the first nbytes of src (device arrays), one word a thread into dst
    (READ_THREADS uint32s)."""
    pipeline = modules.pipeline(device, READ_BANDWIDTH, READ_BANDWIDTH.key("glsl"))
    return (pipeline, (src.buffer, dst.buffer), READ_BANDWIDTH.pack_push(num_chunks=nbytes // 16), (workgroups, 1, 1))


def time_steps(device, steps, per_run: int, repeats: int, warmup: int = 1, bar: Progress | None = None) -> list:
    """GPU time (ns) of each run of `steps` recorded back to back in one command buffer, a run being per_run
    consecutive steps with a timestamp after them: warmed up (`warm_up`), then submitted `repeats` times."""
    launch = Launch(device, steps, timestamps=per_run)
    try:
        warm_up(launch, warmup)
        times = []
        for _ in range(repeats):
            times.extend(launch.submit())
            if bar is not None:
                bar.step()
    finally:
        launch.close()
    return times


def read_bandwidth(device=None, nbytes: int = 1 << 30, iters: int = 20, progress: bool = False) -> dict:
    """Bytes per second one plain read kernel achieves over a buffer of nbytes (capped by the binding
    limit): the median of 2 x iters runs, each submission running iters of them back to back."""
    device = get_device(device)
    nbytes = min(nbytes, device.info.max_storage_buffer_range) // 16 * 16
    src = empty((nbytes // 4,), np.uint32, device)
    dst = empty((READ_THREADS,), np.uint32, device)
    try:
        device.fill(src.buffer, 0x3F800000)
        times = time_steps(device, [read_step(device, src, dst, nbytes)] * iters, 1, 2,
                           bar=Progress(2, "read bandwidth", progress))
    finally:
        src.close()
        dst.close()
    median = float(np.median(times))
    return {"bytes": nbytes, "GBps": nbytes / median, **percentiles(times)}


class DecodeInputs:
    """One shape's decode inputs on the device, made once and timed by any number of plans: `layers` random
    K/V caches (rotated while timing), random block tables, full-length sequences, a query and an output.
    Layer 0's caches stay on the host too, for the reference check."""

    def __init__(self, shape: DecodeShape, layers: int | None = None, device=None, seed: int = 0,
                 progress: bool = False):
        self.shape, self.device = shape, get_device(device)
        rng = np.random.default_rng(seed)
        self.dtype = dtype = np.dtype(shape.dtype)
        x = 16 // dtype.itemsize
        blocks_per_seq = math.ceil(shape.context / shape.block_size)
        self.num_blocks = shape.num_seqs * blocks_per_seq
        if layers is None:
            layers = max(1, min(8, math.ceil(ROTATE_BYTES / max(shape.kv_bytes, 1))))
        self.layers = layers
        self.block_tables = rng.permutation(self.num_blocks).astype(np.int32).reshape(shape.num_seqs, blocks_per_seq)
        self.seq_lens = np.full(shape.num_seqs, shape.context, np.int32)
        bar = Progress(layers, "caches", progress)
        self.caches = []
        # One random K/V, uploaded into every layer's buffers: the rotation is there so that no run finds its
        # caches in the GPU's L2, which distinct buffers ensure; drawing every layer (8 for a short window over
        # a long context) took minutes of the host's time.
        k = rng.standard_normal((self.num_blocks, shape.num_kv_heads, shape.head_size // x, shape.block_size, x),
                                dtype=np.float32).astype(dtype, copy=False)
        v = rng.standard_normal((self.num_blocks, shape.num_kv_heads, shape.head_size, shape.block_size),
                                dtype=np.float32).astype(dtype, copy=False)
        self.host_caches = (k, v)
        try:
            for _ in range(layers):
                self.caches.append((asarray(k, self.device), asarray(v, self.device)))
                bar.step()
            # fp8 caches serve 16-bit models: their queries are float16.
            self.query_dtype = dtype if dtype in QUERY_TYPES else np.dtype(np.float16)
            self.query_host = rng.standard_normal((shape.num_seqs, shape.num_heads, shape.head_size),
                                                  dtype=np.float32).astype(self.query_dtype)
            self.query = asarray(self.query_host, self.device)
            self.out = empty(self.query_host.shape, self.query_dtype, self.device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for array in [a for pair in self.caches for a in pair] + [getattr(self, n, None) for n in ("query", "out")]:
            if array is not None:
                array.close()
        self.caches = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DecodeModules:
    """While in use, plans load their decode and merge-dispatch modules from `folder` (set by `use`; None: the
    package's own) where it holds one of that name, else the package's: how benchmarks/decode_ab.py times builds
    against each other and benchmarks/decode_ablations.py its edited kernels, in one process. Each `use` drops the
    device's pipelines of those modules, so that the next plan builds them from the folder's."""

    KERNELS = (PAGED_DECODE, PAGED_DECODE_REDUCE)

    def __init__(self, device):
        self.device, self.folder, self._load = device, None, modules.load_spirv
        self._sources = {key.source for kernel in self.KERNELS for key in kernel.keys()}
        # (module name, whether the folder served it) for each decode module loaded since `use`: a comparison whose
        # modules all came from the package compares nothing, so decode_ab.py prints these
        self.loaded: list = []

    def __enter__(self):
        modules.load_spirv = self._load_from_folder
        return self

    def __exit__(self, *exc):
        modules.load_spirv = self._load
        self.use(None)

    def _load_from_folder(self, kernel, key):
        if kernel not in self.KERNELS:
            return self._load(kernel, key)
        spv = self.folder / f"{key.name}.spv" if self.folder is not None else None
        served = spv is not None and spv.is_file()
        self.loaded.append((key.name, served))
        return spv.read_bytes() if served else self._load(kernel, key)

    def use(self, folder) -> None:
        self.folder, self.loaded = folder, []
        pipelines = self.device.pipelines
        for cached in [c for c in pipelines
                       if isinstance(c, tuple) and isinstance(c[0], VariantKey) and c[0].source in self._sources]:
            pipelines.pop(cached).close()


def decode_plan(inputs: DecodeInputs, backend: str | None = None, partition_size: int | None = None,
                kernel: str | None = None) -> DecodePlan:
    """The plan time_decode times for these inputs and arguments (experiments that swap its pipeline make it too,
    to read the module and specialization it runs)."""
    shape = inputs.shape
    return DecodePlan(inputs.block_tables, inputs.seq_lens, num_heads=shape.num_heads,
                      num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, block_size=shape.block_size,
                      num_blocks=inputs.num_blocks, dtype=inputs.dtype, query_dtype=inputs.query_dtype,
                      device=inputs.device, backend=backend, partition_size=partition_size,
                      window_left=shape.window_left, kernel=kernel)


def time_decode(inputs: DecodeInputs, backend: str | None = None, iters: int = 50, warmup: int = 1,
                repeats: int = 3, progress: bool = False, partition_size: int | None = None,
                kernel: str | None = None) -> dict:
    """Check one plan's result against float64, then time it: `iters` runs back to back in one submission,
    rotating over the inputs' caches, warmed up (`warm_up`: at least `warmup` submissions) and then submitted
    `repeats` times; the figures are over the repeats' runs. `kernel`: DecodePlan's (None: the plan's choice)."""
    shape, device = inputs.shape, inputs.device
    query, out = inputs.query, inputs.out
    bar = Progress(repeats, "decode", progress)
    plan = decode_plan(inputs, backend, partition_size, kernel)
    try:
        dk, dv = inputs.caches[0]
        # poisoned: a plan that writes nothing must not pass on the previous plan's output
        out.write(np.full(out.shape, np.nan, inputs.query_dtype))
        plan.run(query, dk, dv, out=out)
        n = min(CHECKED_SEQS, shape.num_seqs)
        k, v = inputs.host_caches
        ref = reference.paged_attention(inputs.query_host[:n], k, v, inputs.block_tables[:n], inputs.seq_lens[:n],
                                        window_left=shape.window_left)
        got = out.numpy()[:n].astype(np.float64)
        error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        # All timed runs go into one command buffer, a timestamp after each, as a model's layers follow
        # one another: the GPU stays busy (and clocked up) between runs, and host overhead stays out.
        steps = []
        for i in range(iters):
            dk, dv = inputs.caches[i % inputs.layers]
            steps += plan.steps(query, dk, dv, out, inputs.num_blocks)
        times = time_steps(device, steps, len(steps) // iters, repeats, warmup, bar)
    finally:
        plan.close()
    stats = percentiles(times)
    return {**asdict(shape), "backend": plan.backend, "kernel": plan.matrix or plan.target or "gpu", "device": device.info.name,
            "layers": inputs.layers,
            "iters": iters * repeats, "partitions": plan.num_partitions, "partition_size": plan.partition_size,
            "rel_error": error, "checked_seqs": n, "ok": error <= TOLERANCE[shape.dtype], "kv_bytes": shape.kv_bytes,
            "GBps": shape.kv_bytes / (stats["median_us"] * 1e3), **stats}


def decode(shape: DecodeShape, iters: int = 50, warmup: int = 1, repeats: int = 3, layers: int | None = None,
           device=None, backend: str | None = None, seed: int = 0, progress: bool = False) -> dict:
    """Time decode attention for one shape on fresh inputs (see DecodeInputs and time_decode)."""
    with DecodeInputs(shape, layers, device, seed, progress) as inputs:
        return time_decode(inputs, backend, iters, warmup, repeats, progress)
