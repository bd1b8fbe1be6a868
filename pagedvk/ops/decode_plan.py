"""The decode plan: FlashInfer's plan/run split. A decode step runs the same attention for every layer with the same
block tables, so ``DecodePlan`` does the per-step work once (checks, block tables and lengths on the device, the
choice of kernel and split, the pipeline) and ``run`` does the per-layer work: bind that layer's cache and submit a
command buffer recorded the first time those buffers were seen.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from .. import config
from ..dtypes import CACHE_TYPES, KV_CACHE_DTYPES, QUERY_TYPES, fp8_scale, is_fp8, scaled, storage_type
from ..errors import ClosedError
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import PAGED_DECODE, PAGED_DECODE_REDUCE
from ..kernels.matrix import MATRIX_KIND
from ..runtime.array import Array, DeviceArray, asarray, empty, zeros
from ..runtime.owned import Owned
from ..runtime.pipeline import Launch, RecordedInto, Transfers, fold_grid
from ..runtime.recording import active_recording, record, require_device_arrays
from ..runtime.selection import DeviceLike
from . import checks
from .cache_ops import check_slots, reshape_and_cache
from .decode_rules import DecodeChoice, decode_choice, decode_matrix, plan_arguments
from .layouts import CacheSpec, bind_caches, cache_spec
from .opargs import backend_name, device_of, softmax_scale
from .variants import Variants, in_use as variants_in_use, per_head

# (a numpy query's dtype, the plan's query_dtype) that run() converts, each exact: every float16 and bfloat16 value
# is a float32 value.
EXACT_QUERY_CASTS = frozenset({(np.dtype(np.float16), np.dtype(np.float32)),
                               (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))})
RECORDED_LAUNCHES = 32                       # per plan: enough for every layer of most models
CHECKED_SIGNATURES = 64                      # per plan: run() argument signatures that passed the checks


def argument_signature(arrays) -> tuple | None:
    """What the run checks read of these arrays (None stays None): kind, contiguity, writability, shape, dtype, and a
    device array's row pitch and offset (a view's rows and where it is bound; with shape and dtype, its strides); None
    when one is not an array (the checks reject it). Not the buffers: every layer's arrays of one shape share it."""
    signature = []
    for a in arrays:
        if a is None or type(a) is DeviceArray:
            signature.append(a if a is None else (DeviceArray, a.shape, a.dtype, a.pitch, a.offset))
        elif isinstance(a, np.ndarray):
            signature.append((type(a), a.shape, a.dtype, a.flags.c_contiguous, a.flags.writeable))
        else:
            return None
    return tuple(signature)


class DecodePlan(Owned):
    """The per-step part of decode attention (FlashInfer's plan), reused by every layer's `run`.

    A decode step runs the same attention for every layer with the same block tables: the plan does the checks,
    puts the tables and lengths on the device, chooses the kernel and split and makes the pipeline once; `run`
    binds one layer's caches and submits a command buffer recorded the first time those buffers were seen.
    Close it (or use it in a ``with`` block) to free its device arrays and recorded launches.

    Parameters
    ----------
    block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
        Physical block ids; only each sequence's first ceil(seq_len / block_size) entries are read.
    seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        Tokens cached per sequence (0 gives an output of zeros). Lengths may grow after the plan is made (the
        last partition takes every token past its start), up to the block-table row.
    num_heads, num_kv_heads, head_size, block_size, num_blocks : int
        The model's and the caches' dims; the caches passed to `run` must match them and hold at least
        num_blocks blocks.
    dtype : numpy dtype, default float32
        The caches' dtype: float32, float16, ml_dtypes.bfloat16, float8_e4m3fn or float8_e5m2.
    query_dtype : numpy dtype, optional
        float32, float16 or bfloat16; the output has it too. None means `dtype` where it is one of those, else
        float16 (fp8 caches serve 16-bit models).
    layout : {"vllm", "nhd", "hnd"}, default "vllm"
        The caches' layout (see pagedvk.ops.layouts).
    scale : float, optional
        Softmax scale; None means 1 / sqrt(head_size).
    k_scale, v_scale : float, default 1.0
        fp8 caches hold key / scale and value / scale (vLLM's): the kernels multiply back. Other caches ignore
        them, as vLLM does.
    device : Device, DeviceInfo, int or str, optional
        Where the plan runs; None means the device of the arrays given, else the default device.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        False skips the checks of the tables' values (ids, lengths), which read device-resident tables back to
        the host. The kernel bounds every index itself, so bad values then give wrong attention for the
        sequences that hold them, never a read outside the caches.
    partition_size : int, optional
        Tokens per partition, overriding the split-K rule (``partitioning``; ``matrix_partitioning`` for the
        cooperative-matrix kernel); a multiple of block_size. None applies the rule.
    alibi_slopes : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
    logits_soft_cap : float, optional
    sinks : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
    window_left : int, default -1
        The attention variants (pagedvk.ops.variants), the same for every run of the plan; None (-1 for
        window_left) turns each off. With a window, the partitions cover each sequence's window only.
    kernel : {"cpu", "gpu", "coopmat"}, optional
        "cpu" or "gpu": the decode kernel shaped for CPU devices or the scalar one for GPUs, whatever the device;
        "coopmat": the cooperative-matrix kernel (ValueError where it cannot run). None means
        PAGEDVK_DECODE_KERNEL, else by the device's type, with the cooperative-matrix kernel where the device has
        it and the plan suits it (see ``decode_target`` and ``decode_matrix``). WGSL plans run the WGSL matrix
        kernel (float16 caches and queries) or the scalar GPU kernel, never "cpu".

    Raises
    ------
    ValueError, TypeError
        A bad argument (dims, dtype, layout, table values with validate); the message names it.

    Examples
    --------
    >>> plan = pagedvk.DecodePlan(block_tables, seq_lens, num_heads=32, num_kv_heads=8, head_size=64,
    ...                           block_size=16, num_blocks=256)
    >>> out = plan.run(q, key_cache[layer], value_cache[layer])
    """

    def __init__(self, block_tables: Array, seq_lens: Array, *, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, num_blocks: int, dtype: DTypeLike = np.float32, query_dtype: DTypeLike | None = None,
                 layout: str = "vllm", scale: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                 device: DeviceLike = None, backend: str | None = None, validate: bool = True,
                 partition_size: int | None = None, alibi_slopes: Array | None = None,
                 logits_soft_cap: float | None = None, sinks: Array | None = None, window_left: int = -1,
                 kernel: str | None = None) -> None:
        self._closed, self._lock = True, threading.Lock()   # until constructed: close() works on a half-made plan
        block_tables, seq_lens = checks.ints("block_tables", block_tables), checks.ints("seq_lens", seq_lens)
        checks.tables(block_tables, seq_lens)
        dtype = plan_arguments(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                               block_size=block_size, num_blocks=num_blocks, dtype=dtype, scale=scale,
                               layout=layout)
        if validate:  # reads device-resident tables back; engines that trust their tables can skip it
            checks.block_table_values(block_tables, seq_lens, block_size, num_blocks)
        self.backend = backend_name(backend)
        self.device = device_of(block_tables, seq_lens, alibi_slopes, sinks, device=device)
        self.num_seqs = block_tables.shape[0]
        self.num_heads, self.num_kv_heads, self.head_size = int(num_heads), int(num_kv_heads), int(head_size)
        self.block_size, self.num_blocks = int(block_size), int(num_blocks)
        self.layout = layout
        self.spec = CacheSpec(layout, CACHE_TYPES[dtype], self.num_blocks, self.num_kv_heads, self.head_size,
                              self.block_size)
        self.query_type = (storage_type("query_dtype", np.empty(0, query_dtype), QUERY_TYPES)
                           if query_dtype is not None else QUERY_TYPES.get(dtype, QUERY_TYPES[np.dtype(np.float16)]))
        self.dtype, self.query_dtype = dtype, self.query_type.dtype
        self.scale = softmax_scale(scale, head_size)
        k_scale, v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
        # Other caches ignore the scales, as vLLM does (kv_cache_dtype "auto"): applied, they gave wrong answers.
        self.k_scale, self.v_scale = (k_scale, v_scale) if is_fp8(self.spec.storage) else (1.0, 1.0)
        self.logit_scale = scaled("k_scale", self.scale, self.k_scale)
        if config.decode_kernel(kernel) == MATRIX_KIND:   # refused before anything is made for the plan
            decode_matrix(self.device.info, self.device.features, self.backend, self.spec.storage.tag,
                          self.query_type.tag, self.head_size, layout, self.block_size, 0, kernel)
        self.block_tables = asarray(block_tables, device=self.device)
        self.seq_lens = asarray(seq_lens, device=self.device)
        self._owned = [a for a, given in ((self.block_tables, block_tables), (self.seq_lens, seq_lens))
                       if a is not given]
        self.variants = Variants(self.num_heads, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                                 sinks=sinks, window_left=window_left)
        self.variant_arrays = {name: asarray(a, device=self.device) for name, a in self.variants.inputs.items()}
        self._owned += [a for name, a in self.variant_arrays.items() if a is not self.variants.inputs[name]]
        self._no_lse = empty((4,), np.float32, self.device)   # the lse binding of runs that return none
        self._owned.append(self._no_lse)
        self._rule_arguments = dict(partition_size=partition_size, kernel=kernel)
        self.choice = self.partial_out = self._stats_and_counters = None   # _take_choice makes the scratch
        # Bumped whenever what the plan's dispatches bind or push changes (a new choice, table arrays or closing):
        # a recorded step (pagedvk.record) that ran the plan records it again.
        self.generation = 0
        self._launches = OrderedDict()  # buffer uids -> recorded Launch, least recently used first
        self._fused = OrderedDict()     # append_and_run's buffer uids -> (its recorded step, the output)
        self._checked = set()           # argument signatures _check_run has passed
        self._take_choice(self._rule(int(checks.host(seq_lens).max(initial=0))))
        self._closed = False

    def _rule(self, longest: int) -> DecodeChoice:
        """The kernel and split for sequences of at most `longest` tokens (decode_rules)."""
        # Tokens the partitions cover: the longest context, or the window where it is shorter.
        max_seq_len = self.variants.span(min(longest, self.block_tables.shape[1] * self.block_size), self.block_size)
        return decode_choice(self.device.info, self.device.features, self.backend,
                             storage=self.spec.storage.tag, query=self.query_type.tag, num_seqs=self.num_seqs,
                             num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_size=self.head_size, layout=self.layout, block_size=self.block_size,
                             max_seq_len=max_seq_len, **self._rule_arguments)

    def _take_choice(self, choice: DecodeChoice) -> None:
        """The pipeline and scratch of a choice (the constructor and update()). Where it is the one the plan holds,
        nothing is made: a steady decode step's update allocates nothing."""
        if choice == self.choice:
            return
        # The pipeline for the plan's variants is made now; a run that adds lse or sinks, or reads segmented caches,
        # gets its own at first use (modules.pipeline keeps them).
        modules.pipeline(self.device, PAGED_DECODE, choice.module(), variants_in_use(self.variants.push()),
                         choice.spec_constants)
        # Launches recorded for the old choice carry its split in their push constants and bind its scratch.
        self._forget_launches()
        old_scratch = [a for a in (self.partial_out, self._stats_and_counters) if a is not None]
        self.choice = choice
        num_seqs, num_heads = self.num_seqs, self.num_heads
        limits = self.device.info.max_workgroup_count
        self.grid = fold_grid(num_heads // choice.group_size * num_seqs * choice.num_partitions, limits)
        # Scratch for split contexts; 16-byte placeholders keep the bindings valid when there is no split. A merge
        # in the decode counts on the uint32 pairs after partial_stats' (catalogue.PAGED_DECODE), zeroed here once.
        split = choice.split
        self.partial_out = empty((num_seqs, num_heads, choice.num_partitions, self.head_size) if split else (4,),
                                 np.float32, self.device)
        stats_shape = (num_seqs, num_heads, choice.num_partitions, 2) if split else (4,)
        units = num_seqs * (num_heads // choice.group_size) if choice.merge_in_decode else 0
        # Two spare pairs: the counters' view (read by tests) covers its 16-byte-rounded range, which may end past
        # the last counter (a plan with an odd number of stats pairs and of counters failed to make it).
        self._stats_and_counters = zeros((math.prod(stats_shape) // 2 + units + 2, 2), np.float32, self.device)
        self.partial_stats = DeviceArray.over_buffer(self._stats_and_counters.buffer, 0, stats_shape, np.float32)
        self.merge_counters = (DeviceArray.over_buffer(self._stats_and_counters.buffer, self.partial_stats.nbytes,
                                                       (units, 2), np.uint32) if units else None)
        self._owned += [self.partial_out, self._stats_and_counters]
        self.reduce_grid = fold_grid(num_heads * num_seqs, limits)
        for a in old_scratch:
            self._owned.remove(a)
            a.close()

    def update(self, block_tables: Array, seq_lens: Array, *, max_seq_len: int | None = None,
               validate: bool = True) -> None:
        """Prepare the plan for the next decode step: new block tables and lengths, in the plan's own buffers.

        FlashInfer's plan() for a step after the first: an engine keeps one plan for a batch shape (padding its
        batch to it, as CUDA-graph engines do) and updates it every step instead of making a new one. Numpy tables
        are written into the plan's device tables in place, so the launches `run` recorded stay valid; device
        tables given here become the plan's (the same arrays, updated in place by the caller, cost nothing). The
        kernel and split are chosen again for the new longest sequence; only where that choice changes are the
        scratch arrays made anew and the launches recorded again, so a steady decode step allocates nothing.

        Parameters
        ----------
        block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
            The plan's shape: a batch of another shape needs a plan of its own.
        seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        max_seq_len : int, optional
            The longest of seq_lens, for the choice of split; None reads it from seq_lens (reading device-resident
            lengths back to the host). An engine knows it without that read.
        validate : bool, default True
            As for `DecodePlan`: False skips the checks of the tables' values.

        Raises
        ------
        ClosedError
            The plan was closed.
        ValueError, TypeError
            Tables of another kind, shape or dtype than the plan's, values outside the caches (with validate), or a
            max_seq_len outside [0, max_blocks_per_seq * block_size]. Nothing is changed then.
        """
        self._require_open()
        block_tables, seq_lens = checks.ints("block_tables", block_tables), checks.ints("seq_lens", seq_lens)
        checks.tables(block_tables, seq_lens)
        for name, given, planned in (("block_tables", block_tables, self.block_tables),
                                     ("seq_lens", seq_lens, self.seq_lens)):
            if given.shape != planned.shape:
                raise ValueError(f"{name} has shape {tuple(given.shape)}, the plan's is {tuple(planned.shape)}: a "
                                 "batch of another shape needs a plan of its own (or pad the batch to the plan's)")
        device_of(block_tables, seq_lens, device=self.device)
        if max_seq_len is not None:   # at most the tables' capacity, max_blocks_per_seq x block_size
            max_seq_len = checks.integer("max_seq_len", max_seq_len, 0, self.block_tables.shape[1] * self.block_size)
        if validate:
            checks.block_table_values(block_tables, seq_lens, self.block_size, self.num_blocks)
        longest = max_seq_len if max_seq_len is not None else int(checks.host(seq_lens).max(initial=0))
        choice = self._rule(longest)   # before anything changes: a refusal leaves the plan as it was
        with self._lock:
            self._require_open()
            for name, given in (("block_tables", block_tables), ("seq_lens", seq_lens)):
                self._take_table(name, given)
            self._take_choice(choice)

    def _take_table(self, name: str, given: Array) -> None:
        """update()'s step for one table: written in place, or the caller's device array taken as the plan's."""
        current = getattr(self, name)
        if given is current:
            return   # the caller's own device array, updated in place
        if isinstance(given, DeviceArray):
            replaced = given
        elif current in self._owned:
            current.write(given)   # in place: the recorded launches bind this buffer
            return
        else:   # the plan ran on the caller's device array until now: it takes its own, once
            replaced = asarray(np.ascontiguousarray(given), device=self.device)
            self._owned.append(replaced)
        self._forget_launches()   # they bind the old table's buffer
        if current in self._owned:
            self._owned.remove(current)
            current.close()
        setattr(self, name, replaced)

    # The choice's parts, as a plan's attributes (pagedvk.ops.decode_rules.DecodeChoice).
    target = property(lambda self: self.choice.target, doc='The decode kernel\'s target: "cpu" or "" (the GPU kernel).')
    matrix = property(lambda self: self.choice.matrix, doc='"coopmat" for the matrix kernel, else "".')
    group_size = property(lambda self: self.choice.group_size, doc='Query heads one workgroup serves.')
    partition_size = property(lambda self: self.choice.partition_size, doc='Tokens per split-K partition.')
    num_partitions = property(lambda self: self.choice.num_partitions, doc='Split-K partitions per sequence.')
    merge_in_decode = property(lambda self: self.choice.merge_in_decode, doc='Whether the decode merges its own split.')
    constants = property(lambda self: self.choice.spec_constants, doc="The pipeline's specialization constants.")
    key = property(lambda self: self.choice.module(), doc="The decode module's variant key.")

    @classmethod
    def for_caches(cls, key_cache: Array, value_cache: Array, block_tables: Array, seq_lens: Array, num_heads: int, *,
                   layout: str = "vllm", kv_cache_dtype: str = "auto", query_dtype: DTypeLike | None = None,
                   **kw) -> DecodePlan:
        """A plan whose dims, dtype and device are read from the caches it will run over.

        Parameters
        ----------
        key_cache, value_cache : DeviceArray or numpy.ndarray
            Caches in `layout` (see `paged_attention` for their shapes and dtypes); num_kv_heads, head_size,
            block_size, num_blocks and dtype come from them.
        block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
        seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        num_heads : int
            Query heads, a multiple of num_kv_heads.
        layout : {"vllm", "nhd", "hnd"}, default "vllm"
        kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}, default "auto"
            How uint8 caches are read (vLLM's names).
        query_dtype : numpy dtype, optional
            As for `DecodePlan`.
        **kw
            The other `DecodePlan` arguments (scale, k_scale, v_scale, device, backend, validate, ...).

        Returns
        -------
        DecodePlan
        """
        spec = cache_spec(key_cache, value_cache, layout, kv_cache_dtype)
        device = device_of(key_cache, value_cache, block_tables, seq_lens, device=kw.pop("device", None))
        return cls(block_tables, seq_lens, num_heads=num_heads, num_kv_heads=spec.num_kv_heads,
                   head_size=spec.head_size, block_size=spec.block_size, num_blocks=spec.num_blocks,
                   dtype=spec.storage.dtype, query_dtype=query_dtype, layout=layout, device=device, **kw)

    def _check_lse(self, lse, out) -> None:
        checks.kind("lse", lse)
        checks.writable("lse", lse)
        checks.dtype("lse", lse, [np.float32])
        if tuple(lse.shape) != (self.num_seqs, self.num_heads):
            raise ValueError(f"lse must have shape [num_seqs, num_heads] = {(self.num_seqs, self.num_heads)}, "
                             f"got {tuple(lse.shape)}")
        if out is None or type(lse) is not type(out):
            raise TypeError("lse must be given with out, and be the same kind of array (numpy or DeviceArray)")
        device_of(lse, device=self.device)

    def check_run(self, query: Array, key_cache: Array, value_cache: Array, out: Array | None) -> None:
        """Check `run`'s arguments against the plan, raising what `run` would.

        The checks read only kinds, shapes and dtypes, so arguments that look like ones already passed pass again
        without them (a layer's run repeats the last layer's shapes).

        Parameters
        ----------
        query : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads, head_size)
        key_cache, value_cache : DeviceArray or numpy.ndarray
        out : DeviceArray or numpy.ndarray or None

        Raises
        ------
        ValueError, TypeError
            An argument that does not match the plan.
        """
        signature = argument_signature((query, key_cache, value_cache, out))
        if signature is not None and signature in self._checked:
            return
        self._check_run_arguments(query, key_cache, value_cache, out)
        if signature is not None:
            if len(self._checked) >= CHECKED_SIGNATURES:
                self._checked.clear()
            self._checked.add(signature)

    def _check_run_arguments(self, query, key_cache, value_cache, out) -> None:
        checks.kind("query", query, strided=True)   # a view of a fused QKV projection, say
        checks.ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
        # A uint8 cache (vLLM's fp8) is read as the plan's storage type.
        spec = cache_spec(key_cache, value_cache, self.layout, self._kv_cache_dtype(key_cache))
        for name in ("num_kv_heads", "head_size", "block_size", "storage"):
            if getattr(spec, name) != getattr(self.spec, name):
                raise ValueError(f"key_cache {name} is {getattr(spec, name)} but the plan was made for "
                                 f"{getattr(self.spec, name)}")
        if spec.num_blocks < self.num_blocks:
            raise ValueError(f"key_cache num_blocks is {spec.num_blocks}, but the plan's block_tables "
                             f"were checked against {self.num_blocks} blocks")
        if np.dtype(query.dtype) != self.query_dtype:
            hint = (f": make the plan with query_dtype={np.dtype(query.dtype).name} for such queries"
                    if np.dtype(query.dtype) in QUERY_TYPES else "")
            raise TypeError(f"query must have dtype {self.query_dtype} (the plan's query_dtype), got {query.dtype}"
                            f"{hint}")
        for axis, (n, what) in enumerate([(self.num_seqs, "num_seqs"), (self.num_heads, "num_heads"),
                                          (self.head_size, "head_size")]):
            checks.dim("query", query, axis, n, what)
        if out is not None:
            checks.kind("out", out, strided=True)
            checks.writable("out", out)
            checks.dtype("out", out, [self.query_dtype])
            if tuple(out.shape) != tuple(query.shape):
                raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")

    def run(self, query: Array, key_cache: Array, value_cache: Array, out: Array | None = None,
            lse: Array | None = None, return_lse: bool = False,
            sinks: Array | None = None) -> Array | tuple[Array, Array]:
        """Attention of each sequence's query over its cached tokens, for one layer's caches.

        Parameters
        ----------
        query : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads, head_size)
            The plan's query_dtype; a numpy query of float16 or bfloat16 for a float32 plan is converted (exactly).
            A DeviceArray view whose rows lie apart, such as ``qkv[:, :q_size].reshape(num_seqs, num_heads,
            head_size)`` of a fused QKV projection, is read where it is (no copy).
        key_cache, value_cache : DeviceArray or numpy.ndarray
            One layer's caches, in the plan's layout and dtype, with at least num_blocks blocks.
        out : DeviceArray or numpy.ndarray, optional
            The query's shape and query_dtype: written and returned. None allocates the result. A DeviceArray view
            whose rows lie apart (columns of a wider array) is written in place, nothing between its rows.
        lse : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads), float32, optional
            Written with each head's log-sum-exp; given with `out`, and the same kind of array.
        return_lse : bool, default False
            True (or an `lse` given) returns (out, lse).
        sinks : DeviceArray or numpy.ndarray, shape (num_heads,), float32, optional
            Stand in for the plan's sinks for this run: models whose layers have their own sinks (gpt-oss) share one
            plan. Give them as a DeviceArray: a numpy one is copied at every run.

        Returns
        -------
        out : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads, head_size)
            numpy for a numpy query, a DeviceArray for a DeviceArray query (`out` itself when given).
        lse : DeviceArray or numpy.ndarray, shape (num_seqs, num_heads), float32
            With return_lse or lse only: the natural-log log-sum-exp of each head's logits (the sink's included),
            -inf for a sequence with no visible key; `pagedvk.merge_attention_states` merges such results.

        Raises
        ------
        ClosedError
            The plan was closed.
        ValueError, TypeError
            Arguments that do not match the plan.
        """
        self._require_open()
        if active_recording(self.device) is not None:
            require_device_arrays("DecodePlan.run inside pagedvk.record()", query=query, key_cache=key_cache,
                                  value_cache=value_cache, out=out, lse=lse, sinks=sinks)
        query = self._exact_query(query)
        self.check_run(query, key_cache, value_cache, out)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, not {type(return_lse).__name__}")
        if lse is not None:
            self._check_lse(lse, out)
        if sinks is not None:
            per_head("sinks", sinks, self.num_heads)
            device_of(sinks, device=self.device)
        sinks_d = asarray(sinks, device=self.device) if sinks is not None else None
        try:
            # A copied sinks array is the run's own: its launch is not kept.
            return self._run(query, key_cache, value_cache, out, lse, return_lse, sinks_d, sinks_d is sinks)
        finally:
            if sinks_d is not None and sinks_d is not sinks:
                sinks_d.close()

    def _exact_query(self, query):
        """A numpy query of a type the plan's query_dtype holds exactly (float16 or bfloat16 for a float32 plan),
        converted to it: it is copied to the device anyway. Any other query is returned as it is, for the checks."""
        if isinstance(query, np.ndarray) and (np.dtype(query.dtype), self.query_dtype) in EXACT_QUERY_CASTS:
            return query.astype(self.query_dtype)
        return query

    def _run(self, query, key_cache, value_cache, out, lse, return_lse, sinks, keep: bool):
        step = active_recording(self.device)
        if step is not None:
            return self._record(step, query, key_cache, value_cache, out, lse, return_lse, sinks)
        if return_lse or lse is not None:
            return self._run_with_lse(query, key_cache, value_cache, out, lse, sinks, keep)
        dev = self.device
        if (type(query) is type(key_cache) is type(value_cache) is type(out) is DeviceArray
                and query.device is key_cache.device is value_cache.device is out.device is dev):
            # A decode step's per-layer call: nothing to copy, the launch is recorded once.
            self._launch(query, key_cache, value_cache, out, num_blocks=key_cache.shape[0], cache=keep, sinks=sinks)
            return out
        return self._run_copied(query, key_cache, value_cache, out, None, sinks, keep)

    def _record(self, step, query, key_cache, value_cache, out, lse, return_lse, sinks):
        """run() inside pagedvk.record(): the dispatches join the step; the results are device arrays the replays
        write."""
        if return_lse and lse is None:
            raise TypeError("DecodePlan.run inside pagedvk.record(): give lse (a DeviceArray) to get it, not "
                            "return_lse alone")
        if out is None:
            out = empty(query.shape, self.query_dtype, self.device)
        step.add("DecodePlan.run", lambda: self.steps(query, key_cache, value_cache, out, key_cache.shape[0], lse,
                                                      sinks), depends_on=(self,))
        return (out, lse) if lse is not None else out

    def _run_with_lse(self, query, key_cache, value_cache, out, lse, sinks, keep: bool) -> tuple:
        """run() returning (out, lse): lse as given, else numpy for a numpy result, a DeviceArray for a DeviceArray."""
        lse_d = lse if isinstance(lse, DeviceArray) else empty((self.num_seqs, self.num_heads), np.float32, self.device)
        try:
            result = self._run_copied(query, key_cache, value_cache, out, lse_d, sinks, keep)
            if isinstance(lse, np.ndarray):
                lse[...] = lse_d.numpy()
                return result, lse
            if lse is None and not isinstance(result, DeviceArray):
                return result, lse_d.numpy()
            handed, lse_d = lse_d, None
            return result, handed
        finally:
            if lse_d is not None and lse_d is not lse:
                lse_d.close()

    def _run_copied(self, query, key_cache, value_cache, out, lse, sinks, keep: bool):
        dev = self.device
        device_of(query, key_cache, value_cache, out, device=dev)
        temporaries = []

        def on_device(a):
            d = asarray(a, device=self.device)
            if d is not a:
                temporaries.append(d)
            return d

        try:
            q, k, v = on_device(query), on_device(key_cache), on_device(value_cache)
            o = out if isinstance(out, DeviceArray) else empty(query.shape, self.query_dtype, self.device)
            if o is not out:
                temporaries.append(o)
            self._launch(q, k, v, o, num_blocks=key_cache.shape[0], cache=keep and not temporaries, lse=lse,
                         sinks=sinks)
            if isinstance(out, np.ndarray):
                out[...] = o.numpy()
                return out
            if out is not None:
                return out
            if isinstance(query, np.ndarray):
                return o.numpy()
            temporaries.remove(o)
            return o
        finally:
            for a in temporaries:
                a.close()

    def _launch(self, q, k, v, o, num_blocks: int, cache: bool, timed: bool = False,
                transfers: Transfers | None = None, lse: DeviceArray | None = None, sinks: DeviceArray | None = None):
        # One thread at a time per plan: its recorded launches are looked up, evicted and submitted under
        # the lock, so no thread submits a launch another has just evicted (the device serializes
        # submissions anyway), and close(), which frees the plan's arrays under the same lock, either
        # waits for a run or makes it raise.
        with self._lock:
            self._require_open()
            return self._launch_locked(q, k, v, o, num_blocks, cache, timed, transfers, lse, sinks)

    @property
    def closed(self) -> bool:
        """Whether close() has run (or construction failed)."""
        return self._closed

    @property
    def recorded_launches(self) -> tuple:
        """The launches this plan keeps recorded (at most RECORDED_LAUNCHES), least recently used first: one per
        set of caller buffers seen, for inspection (which recordings were reused, freed or made again)."""
        return tuple(self._launches.values())

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

    def _launch_locked(self, q, k, v, o, num_blocks: int, cache: bool, timed: bool, transfers, lse, sinks):
        # The plan's own tables and scratch are the same in every launch: the key holds the callers' buffers.
        key = (q.binding, k.binding, v.binding, o.binding, timed, transfers.uids if transfers is not None else (),
               lse.binding if lse is not None else None, sinks.binding if sinks is not None else None)
        # Timed runs wait for their timestamps, and staged ones (transfers) for the host copies they make; the
        # rest are queued on the current stream.
        run = Launch.submit if timed or transfers is not None else Launch.enqueue
        launch = self._launches.get(key)
        if launch is not None:
            self._launches.move_to_end(key)
            try:
                return run(launch)
            except ClosedError:
                # A buffer it binds was closed or collected (its uid is never reused, so only a plan
                # table given by the caller can be): record anew, which raises if one still is.
                self._forget(key)
        launch = Launch(self.device, self.steps(q, k, v, o, num_blocks, lse, sinks), timestamps=timed,
                        transfers=transfers)
        if cache:
            self._launches[key] = launch
            while len(self._launches) > RECORDED_LAUNCHES:
                self._forget(next(iter(self._launches)))
        try:
            return run(launch)
        finally:
            if not cache:
                launch.close()

    def steps(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, o: DeviceArray, num_blocks: int,
              lse: DeviceArray | None = None,
              sinks: DeviceArray | None = None) -> list:
        """The dispatches of one run over device arrays, for a caller recording them into its own submission.

        For pagedvk.runtime.pipeline.Launch: decode, and the reduce of its partitions when split (unless the decode
        kernel merges them in its own dispatch: merge_in_decode). Both take the same push constants. The arrays must
        outlive the launch.

        Parameters
        ----------
        q : DeviceArray, shape (num_seqs, num_heads, head_size)
            A view whose rows lie apart (a fused QKV projection's query columns) is read at its pitch.
        k, v : DeviceArray
            One layer's caches.
        o : DeviceArray, shape (num_seqs, num_heads, head_size)
            The output; a view whose rows lie apart is written at its pitch, nothing between its rows.
        num_blocks : int
            Blocks the caches hold (their shape[0]).
        lse : DeviceArray, shape (num_seqs, num_heads), float32, optional
            Written when given.
        sinks : DeviceArray, shape (num_heads,), float32, optional
            Stand in for the plan's when given.

        Returns
        -------
        list of tuple
            (pipeline, buffers, push constants, grid) per dispatch.
        """
        tables = (self.block_tables.buffer, self.seq_lens.buffer)
        partials = (self.partial_out.buffer, self._stats_and_counters.buffer)
        spec = CacheSpec(self.layout, self.spec.storage, num_blocks, self.num_kv_heads, self.head_size,
                         self.block_size)
        caches = bind_caches(k, v, self.backend)
        key = self.choice.module(caches.access)
        variant_push = self.variants.push(lse=lse is not None, sinks=sinks is not None)
        variants = variants_in_use(variant_push)
        row = self.num_heads * self.head_size   # a contiguous query's (and out's) pitch; views have their own
        push = PAGED_DECODE.pack_push(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_size=self.block_size, max_blocks_per_seq=self.block_tables.shape[1],
            num_blocks=spec.blocks_held(caches.key_bytes, caches.value_bytes), num_seqs=self.num_seqs,
            q_token_stride=self.num_heads, q_head_stride=1, causal=0, scale=self.logit_scale,
            q_pitch=checks.token_pitch(q, row), out_pitch=checks.token_pitch(o, row),
            v_scale=self.v_scale, group_size=self.group_size, partition_size=self.partition_size,
            num_partitions=self.num_partitions, blocks_per_segment=caches.blocks_per_segment, **spec.strides(),
            q_type=q_type_code(self.query_type.tag), **variant_push)
        lse_buffer = (lse if lse is not None else self._no_lse).buffer
        decode = (modules.pipeline(self.device, PAGED_DECODE, key, variants, self.choice.spec_constants),
                  (q.buffer, caches.key, caches.value, *tables, o.buffer, *partials, *self._variant_buffers(sinks),
                   lse_buffer, *caches.extra), push, self.grid)
        if self.choice.reduce_module is None:
            return [decode]
        reduce = (modules.pipeline(self.device, PAGED_DECODE_REDUCE, self.choice.reduce_module, variants,
                                   PAGED_DECODE_REDUCE.q_type_constant(self.query_type.tag)),
                  (self.seq_lens.buffer, *partials, o.buffer, self._variant_buffers(sinks)[1], lse_buffer), push,
                  self.reduce_grid)
        return [decode, reduce]

    def _variant_buffers(self, sinks: DeviceArray | None) -> tuple:
        """The alibi_slopes and sinks bindings (ATTENTION_VARIANT_INPUTS' order); `sinks` in place of the plan's."""
        return (self.variant_arrays["alibi_slopes"].buffer,
                (sinks if sinks is not None else self.variant_arrays["sinks"]).buffer)

    def run_staged(self, q: DeviceArray, k: DeviceArray, v: DeviceArray, o: DeviceArray,
                   transfers: Transfers) -> None:
        """A run over device arrays whose recorded submission also makes `transfers`' copies.

        The host arguments staged in and the result staged out (pagedvk.ops.decode's one-call path); the launch is
        kept for the next call.

        Parameters
        ----------
        q, k, v, o : DeviceArray
            Query, caches and output, as for `run`.
        transfers : pagedvk.runtime.pipeline.Transfers
            The copies recorded before and after the dispatches.
        """
        return self._launch(q, k, v, o, num_blocks=k.shape[0], cache=True, transfers=transfers)

    def record_into(self, command_buffer, query: DeviceArray, key_cache: DeviceArray, value_cache: DeviceArray,
                    out: DeviceArray) -> RecordedInto:
        """Record one run into a caller's VkCommandBuffer (between its begin and end), for an engine that submits
        its own command buffers.

        The dispatches are recorded after a barrier that makes every earlier command's writes visible to them, and
        followed by one that makes their writes visible to every later command: the caller needs no barrier of its
        own around them.

        Parameters
        ----------
        command_buffer : VkCommandBuffer
            In the recording state, on the plan's device (`Device.from_handles` for a caller's device); the `vulkan`
            package's handle or its address as an int.
        query, key_cache, value_cache, out : DeviceArray
            As for `run` (`DeviceArray.from_buffer` wraps a caller's buffers).

        Returns
        -------
        pagedvk.runtime.pipeline.RecordedInto
            Holds the descriptor sets the dispatches bind: keep it, the plan and the arrays until the command buffer
            has finished running, then close it. A plan `update` that changes its `generation` needs a new recording.
        """
        self._require_open()
        require_device_arrays("DecodePlan.record_into", query=query, key_cache=key_cache, value_cache=value_cache,
                              out=out)
        self.check_run(query, key_cache, value_cache, out)
        return RecordedInto(self.device, self.steps(query, key_cache, value_cache, out, key_cache.shape[0]),
                            command_buffer)

    def append_and_run(self, key: DeviceArray, value: DeviceArray, slot_mapping: DeviceArray, query: DeviceArray,
                       key_cache: DeviceArray, value_cache: DeviceArray, out: DeviceArray | None = None, *,
                       validate: bool = True) -> DeviceArray:
        """Write the step's new keys and values into the caches and attend, in one submission (FlashInfer's
        append_paged_kv_cache followed by decode's run).

        The write is `reshape_and_cache` with the plan's layout, scales and backend; the attention is `run`, which
        sees the tokens just written. Both are recorded once per set of arrays (a `pagedvk.record` step the plan
        keeps) and queued together at every later call; inside a `pagedvk.record()` block they join that step.

        Parameters
        ----------
        key, value : DeviceArray, shape (num_tokens, num_kv_heads, head_size)
            float32, float16 or bfloat16; views whose rows lie apart (a fused QKV projection's key and value
            columns) are read at their pitch.
        slot_mapping : DeviceArray, shape (num_tokens,), int32 or int64
            Each token's cache slot (block * block_size + offset); negative slots are skipped.
        query, key_cache, value_cache, out : DeviceArray
            As for `run`; out None allocates it at the first call with these arrays and returns that one after.
        validate : bool, default True
            Check every slot against the caches (reading slot_mapping back to the host); False leaves it to the
            kernel, which skips slots outside the caches.

        Returns
        -------
        DeviceArray
            The attention's output.
        """
        self._require_open()
        require_device_arrays("DecodePlan.append_and_run", key=key, value=value, slot_mapping=slot_mapping,
                              query=query, key_cache=key_cache, value_cache=value_cache, out=out)
        write = dict(kv_cache_dtype=self._kv_cache_dtype(key_cache), k_scale=self.k_scale, v_scale=self.v_scale,
                     layout=self.layout, backend=self.backend)
        if active_recording(self.device) is not None:   # both ops join the step being recorded
            reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, validate=validate, **write)
            return self.run(query, key_cache, value_cache, out)
        if validate:
            check_slots(slot_mapping, cache_spec(key_cache, value_cache, self.layout, write["kv_cache_dtype"]))
        signature = tuple((a.buffer.uid, a.strides) if a is not None else None
                          for a in (key, value, slot_mapping, query, out)) + \
            tuple(b.uid for a in (key_cache, value_cache) for b in a.buffers)
        with self._lock:
            kept = self._fused.get(signature)
        if kept is None:
            with record(self.device) as step:
                reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, validate=False, **write)
                result = self.run(query, key_cache, value_cache, out)
            with self._lock:
                self._require_open()
                kept = self._fused[signature] = (step, result)
                while len(self._fused) > RECORDED_LAUNCHES:
                    self._fused.popitem(last=False)[1][0].close()
        kept[0].replay()
        return kept[1]

    def _kv_cache_dtype(self, key_cache) -> str:
        """vLLM's kv_cache_dtype name for a cache: a uint8 (fp8) cache is read as the plan's storage type."""
        if np.dtype(key_cache.dtype) != np.dtype(np.uint8):
            return "auto"
        return next((name for name, t in KV_CACHE_DTYPES.items() if t == self.spec.storage), "auto")

    def time_ns(self, query: DeviceArray, key_cache: DeviceArray, value_cache: DeviceArray, out: DeviceArray) -> float:
        """One launch, timed on the GPU by timestamp queries.

        Parameters
        ----------
        query, key_cache, value_cache, out : DeviceArray
            As for `run`; device arrays only, so that no copy enters the timing.

        Returns
        -------
        float
            GPU time of the launch in nanoseconds.

        Raises
        ------
        TypeError
            An argument is not a DeviceArray.
        """
        self._require_open()
        self.check_run(query, key_cache, value_cache, out)
        if not all(isinstance(a, DeviceArray) for a in (query, key_cache, value_cache, out)):
            raise TypeError("time_ns takes device arrays only")
        return self._launch(query, key_cache, value_cache, out, key_cache.shape[0], cache=True, timed=True)

    def _forget(self, key) -> None:
        self._launches.pop(key).close()

    def _forget_launches(self) -> None:
        self.generation += 1
        for key in list(self._launches):
            self._forget(key)

    def close(self) -> None:
        """Free the plan's recorded launches and device arrays; a run after (or racing) it raises ClosedError.

        Safe to call twice.
        """
        with self._lock:
            self._closed = True
            if hasattr(self, "_launches"):   # a plan whose construction failed early has none
                self._forget_launches()
                for step, _ in self._fused.values():
                    step.close()
                self._fused.clear()
            for a in getattr(self, "_owned", ()):
                a.close()
            self._owned = []

    def __repr__(self) -> str:
        if not hasattr(self, "device"):
            return "DecodePlan(<not constructed>)"
        state = ", closed" if self._closed else ""
        return (f"DecodePlan(num_seqs={self.num_seqs}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, block_size={self.block_size}, dtype={self.dtype}, "
                f"backend={self.backend!r}, partitions={self.num_partitions}, device={self.device!r}{state})")
