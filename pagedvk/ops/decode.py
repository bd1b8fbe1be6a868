"""Paged-attention decode in one call: ``paged_attention``, vLLM's paged_attention_v1 as a function. It runs a
``DecodePlan`` (pagedvk/ops/decode_plan.py); calls that repeat a signature reuse one, with the host arguments staged in
and the result staged out in the same submission.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

from .. import config
from ..dtypes import QUERY_TYPES, storage_type
from ..runtime.array import Array, DeviceArray, empty
from ..runtime.owned import Owned
from ..runtime.pipeline import Transfers
from ..runtime.recording import kept_launches, refuse_recording
from ..runtime.selection import get_device
from . import checks
from .decode_plan import DecodePlan, argument_signature
from .opargs import device_of


def paged_attention(query: Array, key_cache: Array, value_cache: Array, block_tables: Array, seq_lens: Array, *,
                    scale: float | None = None, out: Array | None = None, layout: str = "vllm",
                    kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                    backend: str | None = None, validate: bool = True, alibi_slopes: Array | None = None,
                    logits_soft_cap: float | None = None, sinks: Array | None = None, window_left: int = -1,
                    return_lse: bool = False) -> Array | tuple[Array, Array]:
    """Decode attention over a paged KV cache: each sequence's one query token over its cached tokens.

    vLLM's paged_attention_v1 as a function. For many layers with the same block tables, make one `DecodePlan`
    and call its `run` per layer. Calls that repeat a signature (shapes, dtypes, options, longest context) with
    numpy block tables reuse a plan the device keeps, with staging for the numpy arguments: the tables and
    lengths are still copied in every call (``pagedvk.ops.decode.release_cached_plans`` frees what is kept).

    Parameters
    ----------
    query : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads, head_size)
        float32, float16 or bfloat16. num_heads is a multiple of num_kv_heads (MHA, GQA, MQA). A DeviceArray view
        whose rows lie apart (a fused QKV projection's query columns, ``qkv[:, :q_size].reshape(...)``) is read
        where it is.
    key_cache : DeviceArray or numpy.ndarray
        Layout "vllm": shape (num_blocks, num_kv_heads, head_size // x, block_size, x), x = 16 // itemsize;
        "nhd": (num_blocks, block_size, num_kv_heads, head_size); "hnd": (num_blocks, num_kv_heads, block_size,
        head_size) (FlashInfer's HND). float32, float16, bfloat16 (ml_dtypes), float8_e4m3fn or float8_e5m2; or
        uint8 with `kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2" (vLLM's), scaled by `k_scale` / `v_scale`.
        block_size 8, 16 or 32; "nhd" and "hnd" also 1, 2 or 4 (pagedvk.ops.layouts).
    value_cache : DeviceArray or numpy.ndarray
        "vllm": shape (num_blocks, num_kv_heads, head_size, block_size); "nhd", "hnd": key_cache's shape.
        key_cache's dtype.
    block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
        Physical block ids.
    seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        Cached tokens per sequence (0 gives zeros).
    scale : float, optional
        Softmax scale; None means 1 / sqrt(head_size). Accumulation is float32.
    out : DeviceArray or numpy.ndarray, optional
        An array of the query's shape and dtype to write the result into (and return); None allocates it. A
        DeviceArray view whose rows lie apart is written in place.
    layout : {"vllm", "nhd", "hnd"}, default "vllm"
        The caches' layout.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}, default "auto"
        How a uint8 cache is read (vLLM's names); "auto" reads the caches' own dtype.
    k_scale, v_scale : float, default 1.0
        fp8 caches hold key / k_scale and value / v_scale, and the kernel multiplies back; other caches ignore them.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        False skips the checks of the block tables' values (see `DecodePlan`).
    alibi_slopes : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
        ALiBi slopes (vLLM's); None is no ALiBi.
    logits_soft_cap : float, optional
        Logit soft cap c > 0 (logit = c * tanh(logit / c)); None or 0 is off.
    sinks : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
        One more logit per head in the softmax denominator (gpt-oss); None is none.
    window_left : int, default -1
        A query at position p sees keys p - window_left .. p; -1 is no window. The variants (alibi_slopes,
        logits_soft_cap, sinks, window_left; pagedvk.ops.variants) compose with each other.
    return_lse : bool, default False
        True returns (out, lse).

    Returns
    -------
    out : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads, head_size)
        In the query's dtype: numpy for a numpy query, a DeviceArray for a DeviceArray query (`out` itself when given).
    lse : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads), float32
        With return_lse only: each head's natural-log log-sum-exp (the sink included; -inf where no key is
        visible), for `merge_attention_states`.

    Raises
    ------
    ValueError, TypeError
        An argument of the wrong shape, dtype, kind or value; the message names it.
    UnsupportedFeatureError
        The device lacks a Vulkan feature the kernel for these arguments needs.

    Examples
    --------
    >>> out = pagedvk.paged_attention(q, key_cache, value_cache, block_tables, seq_lens)
    """
    block_tables, seq_lens = checks.ints("block_tables", block_tables), checks.ints("seq_lens", seq_lens)
    checks.kind("query", query, strided=True)
    checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
    query_type = storage_type("query", query, QUERY_TYPES)
    if out is not None:   # before a plan is made for the call (which uploads its tables)
        checks.kind("out", out, strided=True)
        checks.writable("out", out)
    device = device_of(query, key_cache, value_cache, block_tables, seq_lens, out, alibi_slopes, sinks)
    refuse_recording("paged_attention (record a DecodePlan's run instead)", device)
    options = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, layout=layout, kv_cache_dtype=kv_cache_dtype,
                   backend=backend, logits_soft_cap=logits_soft_cap, window_left=window_left)
    # Kept plans serve scalar options only: per-head arrays and an lse output take a plan of their own.
    key = (_oneshot_key(query, key_cache, value_cache, block_tables, seq_lens, out, options)
           if alibi_slopes is None and sinks is None and return_lse is False else None)
    if key is not None:
        plans = oneshot_plans(device)
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, _OneShot.make(query, key_cache, value_cache, block_tables, seq_lens, out,
                                                 options, query_type, validate, device))
        elif validate:   # a hit has this call's shapes checked already, not its tables' values
            checks.block_table_values(block_tables, seq_lens, entry.plan.block_size, entry.plan.num_blocks)
        result = entry(query, key_cache, value_cache, block_tables, seq_lens, out)
        if result is not None:
            return result
        # Evicted by another thread between the look-up and the call: run uncached.
    with DecodePlan.for_caches(key_cache, value_cache, block_tables, seq_lens, query.shape[1], layout=layout,
                               kv_cache_dtype=kv_cache_dtype, query_dtype=query_type.dtype, scale=scale,
                               k_scale=k_scale, v_scale=v_scale, backend=backend, validate=validate,
                               device=device, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                               sinks=sinks, window_left=window_left) as plan:
        return plan.run(query, key_cache, value_cache, out=out, return_lse=return_lse)


# One-shot calls repeat shapes (a model's layers, a benchmark's loop): each device keeps the plans of its last
# few call signatures, each with device arrays and a staging buffer for the numpy arguments.
ONESHOT_PLANS = 8                  # per device
ONESHOT_HOST_BYTES = 16 << 20      # calls with more bytes of numpy arguments are not cached (nor their staging)


def _oneshot_key(query, key_cache, value_cache, block_tables, seq_lens, out, options) -> tuple | None:
    """What a cached plan serves: every argument's kind, shape, dtype and contiguity (so a hit passes the checks a
    first call ran), the longest context (the split-K rule reads it) and the options, each with its type (1 and
    True are equal, but True is refused). None when the call is not cached: device tables (their values
    would be read back), a DeviceArray result made for the caller, a large numpy argument, or an argument the
    checks will refuse."""
    signature = argument_signature((query, key_cache, value_cache, out, block_tables, seq_lens))
    if (signature is None or type(block_tables) is not np.ndarray or type(seq_lens) is not np.ndarray
            or (out is None and type(query) is DeviceArray) or seq_lens.ndim != 1 or seq_lens.dtype != np.int32):
        return None
    host = sum(a.nbytes for a in (query, key_cache, value_cache, out, block_tables, seq_lens)
               if isinstance(a, np.ndarray))
    if host > ONESHOT_HOST_BYTES:
        return None
    if options["backend"] is None:   # then PAGEDVK_BACKEND picks it, which may change between calls
        options = dict(options, backend=(None, config.backend()))
    # PAGEDVK_DECODE_KERNEL too may change between calls
    key = (signature, int(seq_lens.max(initial=0)), tuple((k, type(v), v) for k, v in options.items()),
           config.decode_kernel())
    try:
        hash(key)
    except TypeError:
        return None
    return key


class OneShotPlans:
    """A device's cached one-shot entries, least recently used first; an evicted one is closed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries = OrderedDict()

    def get(self, key):
        with self.lock:
            entry = self.entries.get(key)
            if entry is None or entry.closed:   # closed: its device was
                return None
            self.entries.move_to_end(key)
            return entry

    def add(self, key, entry):
        with self.lock:
            evicted = [e for e in [self.entries.pop(key, None)] if e is not None]
            self.entries[key] = entry
            while len(self.entries) > ONESHOT_PLANS:
                evicted.append(self.entries.popitem(last=False)[1])
        for e in evicted:   # outside the lock: closing waits for a call still using it
            e.close()
        return entry

    def clear(self) -> None:
        with self.lock:
            entries, self.entries = list(self.entries.values()), OrderedDict()
        for e in entries:
            e.close()

    def plans(self) -> list:
        with self.lock:
            return [e.plan for e in self.entries.values()]


_ONESHOT = weakref.WeakKeyDictionary()   # device -> OneShotPlans
_ONESHOT_LOCK = threading.Lock()


def release_cached_plans(device=None) -> None:
    """Close the plans, arrays and staging that paged_attention keeps for repeated shapes on a device
    (default: the default device), and the launches other ops keep (pagedvk.runtime.recording.KeptLaunches); later
    calls make them again."""
    device = get_device(device)
    with _ONESHOT_LOCK:
        plans = _ONESHOT.pop(device, None)
    if plans is not None:
        plans.clear()
    kept_launches(device).clear()


def oneshot_plans(device) -> OneShotPlans:
    """The device's kept one-shot plans (made empty on first use): what paged_attention reuses for repeated call
    signatures. For inspecting or clearing them; release_cached_plans drops them all."""
    with _ONESHOT_LOCK:
        plans = _ONESHOT.get(device)
        if plans is None:
            plans = _ONESHOT[device] = OneShotPlans()
        return plans


def _stage(staged: list, array: DeviceArray, offset: int) -> int:
    """Lay the array's segments out in a staging buffer from `offset`: append (segment, its offset) for each
    non-empty one (Vulkan has no empty copies) and return the next 16-byte-aligned offset."""
    for b in array.buffers:
        if b.nbytes:
            staged.append((b, offset))
        offset += b.nbytes
    return (offset + 15) // 16 * 16


class _OneShot(Owned):
    """A plan kept for the one-shot calls of one key, with device arrays for the numpy query, caches and output,
    and a host-visible staging buffer. A call writes its numpy arguments into the staging (the block tables
    and lengths every time: a kept plan never serves earlier tables) and submits one recorded launch that
    copies them in, runs the decode and copies the output out."""

    IN = ("block_tables", "seq_lens", "query", "key_cache", "value_cache")

    @classmethod
    def make(cls, query, key_cache, value_cache, block_tables, seq_lens, out, options, query_type, validate,
             device) -> "_OneShot":
        plan = DecodePlan.for_caches(key_cache, value_cache, block_tables, seq_lens, query.shape[1],
                                     query_dtype=query_type.dtype, validate=validate, device=device, **options)
        try:
            plan.check_run(query, key_cache, value_cache, out)
            return cls(plan, dict(zip(cls.IN, (block_tables, seq_lens, query, key_cache, value_cache))), out)
        except BaseException:
            plan.close()
            raise

    def __init__(self, plan: DecodePlan, args: dict, out):
        self.plan, self.lock, dev = plan, threading.Lock(), plan.device
        self.staging = None
        # The arrays the launch binds in place of numpy arguments (the plan's own tables among them).
        self.arrays = {"block_tables": plan.block_tables, "seq_lens": plan.seq_lens}
        self._owned = []
        try:
            for name in ("query", "key_cache", "value_cache"):
                if isinstance(args[name], np.ndarray):
                    self.arrays[name] = empty(args[name].shape, args[name].dtype, dev)
                    self._owned.append(self.arrays[name])
            # The output comes back through the staging unless the caller gave a DeviceArray for it.
            self.out = None if type(out) is DeviceArray else empty(args["query"].shape, plan.query_dtype, dev)
            if self.out is not None:
                self._owned.append(self.out)
            self.inputs, staged_in, offset = [], [], 0   # staged: (segment buffer, staging offset)
            for name in self.IN:
                if isinstance(args[name], np.ndarray):
                    self.inputs.append((name, offset))
                    offset = _stage(staged_in, self.arrays[name], offset)
            self.out_offset, staged_out = offset, []
            if self.out is not None:
                offset = _stage(staged_out, self.out, offset)
            self.staging = dev.host_buffer(offset)
            self.transfers = Transfers([(self.staging, b, [(at, 0, b.nbytes)]) for b, at in staged_in],
                                       [(b, self.staging, [(0, at, b.nbytes)]) for b, at in staged_out])
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self.staging is None or self.staging.closed or self.plan.closed or self.plan.block_tables.closed

    def __call__(self, query, key_cache, value_cache, block_tables, seq_lens, out):
        """The call's result, or None when this entry was closed (evicted) first."""
        args = dict(zip(self.IN, (block_tables, seq_lens, query, key_cache, value_cache)))
        dev, plan = self.plan.device, self.plan
        with self.lock:   # one call at a time writes the staging
            if self.closed:
                return None
            for name, offset in self.inputs:
                dev.upload(self.staging, args[name], offset)
            bound = [self.arrays.get(name, args[name]) for name in ("query", "key_cache", "value_cache")]
            o = out if self.out is None else self.out
            plan.run_staged(*bound, o, self.transfers)
            if self.out is None:
                return out
            result = dev.download(self.staging, self.out.nbytes, self.out_offset)
        result = result.view(self.out.dtype).reshape(self.out.shape)
        if out is None:
            return result
        out[...] = result
        return out

    def close(self) -> None:
        with self.lock:
            self.plan.close()
            for a in self._owned:
                a.close()
            if self.staging is not None:
                self.staging.close()
