"""A model's paged KV cache on the device: per-layer key and value caches, host swap space, and the block manager
that hands out their blocks (pagedvk.engine.blocks), with the ops an engine runs between and inside attention calls.

    cache = pagedvk.KVCache(num_layers=2, num_kv_heads=2, head_size=64, block_size=16, dtype=np.float16,
                            memory_fraction=0.5)
    w = cache.blocks.add_sequence(0, prompt_tokens)           # slots for the prompt's keys and values
    cache.write(layer, k, v, w.slots)                         # reshape_and_cache, for each layer
    tables, seq_lens = cache.blocks.block_tables([0])          # what DecodePlan and prefill take
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .. import config
from ..dtypes import CACHE_TYPES, fp8_scale, storage_type
from ..ops import cache_ops, checks
from ..ops.decode_plan import DecodePlan
from ..ops.layouts import LAYOUTS, MAX_HEAD_SIZE, CacheSpec, check_block_size
from ..ops.opargs import device_of
from ..ops.prefill import paged_attention_prefill
from ..ops.prefill_plan import PrefillPlan
from ..runtime.array import DeviceArray, empty
from ..runtime.owned import Owned
from ..runtime.selection import DeviceLike
from .blocks import BlockManager


class KVCache(Owned):
    """A model's paged KV cache on one device: per-layer key and value caches, host swap space, and their blocks.

    `blocks` is the BlockManager (pagedvk.engine.blocks) that hands out the blocks: its block tables and lengths
    feed DecodePlan and prefill. Queries are computed in float32 whatever the cache's type (accumulation is
    float32 throughout).

    Parameters
    ----------
    num_layers, num_kv_heads : int
        At least 1.
    head_size : int
        A multiple of 4 (of x = 16 // itemsize in layout "vllm"), at most pagedvk.ops.layouts.MAX_HEAD_SIZE.
    block_size : int, default 16
        8, 16 or 32; "nhd" and "hnd" also 1, 2 or 4.
    dtype : numpy dtype, default float16
        float32, float16, ml_dtypes.bfloat16, float8_e4m3fn or float8_e5m2.
    layout : {"vllm", "nhd", "hnd"}, default "vllm"
    num_blocks : int, optional
        Blocks per cache. Give exactly one of num_blocks and memory_fraction.
    memory_fraction : float, optional
        In (0, 1]: as many blocks as this fraction of the device's free memory budget holds (all layers' keys
        and values; VK_EXT_memory_budget where the device has it, else the heap size).
    num_host_blocks : int, default 0
        Blocks of host memory to swap preempted sequences to.
    prefix_caching : bool, default True
        Share full prompt blocks by their token-prefix hash.
    device : Device, DeviceInfo, int or str, optional
        None means the default device.
    backend : {"glsl", "wgsl"}, optional
        The kernel language of its ops; None means PAGEDVK_BACKEND, else "glsl".
    k_scale, v_scale : float, default 1.0
        fp8 caches (float8_e4m3fn, float8_e5m2) hold key / k_scale and value / v_scale, saturated to the type's
        range, and attention multiplies back (vLLM's kv-cache scales): `write` and the plans made here use them.
        Positive and finite; other cache types ignore them.

    Attributes
    ----------
    key, value : list of DeviceArray
        One cache per layer, of shape spec.key_shape / spec.value_shape (see `paged_attention` for the layouts).
    host_key, host_value : list of numpy.ndarray
        The swap space, one per layer, num_host_blocks blocks each.
    blocks : pagedvk.engine.blocks.BlockManager

    Raises
    ------
    ValueError, TypeError
        A bad argument, checked by name before anything is allocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int = 16,
                 dtype: DTypeLike = np.float16, layout: str = "vllm", num_blocks: int | None = None,
                 memory_fraction: float | None = None, num_host_blocks: int = 0, prefix_caching: bool = True,
                 device: DeviceLike = None, backend: str | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        # Every argument is checked here, by name, before anything is allocated: bad ones were accepted and
        # failed at the first write.
        if (num_blocks is None) == (memory_fraction is None):
            raise ValueError("give exactly one of num_blocks and memory_fraction")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
        checks.integer("num_layers", num_layers, 1)
        # fp8 caches hold key / k_scale and value / v_scale (vLLM's per-layer scales, one pair for every layer here);
        # every write and plan of this cache uses them, and other cache types ignore them
        self.k_scale, self.v_scale = fp8_scale("k_scale", k_scale), fp8_scale("v_scale", v_scale)
        checks.integer("num_kv_heads", num_kv_heads, 1)
        checks.integer("block_size", block_size, 1)
        checks.integer("num_host_blocks", num_host_blocks, 0)
        if num_blocks is not None:
            checks.integer("num_blocks", num_blocks, 1)
        storage = storage_type("dtype", np.empty(0, dtype), CACHE_TYPES)
        checks.integer("head_size", head_size, 1, MAX_HEAD_SIZE)
        # the kernels read 4 head dims at a time; vLLM's key layout packs x = 16 // itemsize
        multiple = storage.x if layout == "vllm" else 4
        if head_size % multiple:
            raise ValueError(f"head_size must be a multiple of {multiple} in [{multiple}, {MAX_HEAD_SIZE}] for "
                             f"{storage} caches in layout {layout!r}, got {head_size}")
        check_block_size("block_size", block_size, layout, num_kv_heads, head_size, storage.itemsize)
        if backend is not None:
            backend = config.backend(backend)
        self.device = device_of(device=device)
        spec = CacheSpec(layout, storage, 1, num_kv_heads, head_size, block_size)
        if memory_fraction is not None:
            if (isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float, np.integer,
                                                                                     np.floating))
                    or not 0 < memory_fraction <= 1):
                raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
            budget = self.device.memory_budget()
            free = budget.budget - (budget.usage or 0)
            num_blocks = int(memory_fraction * free) // (2 * num_layers * spec.block_bytes)
            if num_blocks < 1:
                raise ValueError(f"memory_fraction {memory_fraction} of {budget} holds no block of "
                                 f"{2 * num_layers * spec.block_bytes} bytes (all layers' keys and values)")
        self.layout, self.dtype, self.backend = layout, storage.dtype, backend
        self.num_layers = int(num_layers)
        self.spec = CacheSpec(layout, storage, int(num_blocks), num_kv_heads, head_size, block_size)
        self.blocks = BlockManager(int(num_blocks), block_size, num_host_blocks, prefix_caching)
        self.key = [empty(self.spec.key_shape, self.dtype, self.device) for _ in range(num_layers)]
        self.value = [empty(self.spec.value_shape, self.dtype, self.device) for _ in range(num_layers)]
        host = CacheSpec(layout, storage, num_host_blocks, num_kv_heads, head_size, block_size)
        self.host_key = [np.zeros(host.key_shape, self.dtype) for _ in range(num_layers)]
        self.host_value = [np.zeros(host.value_shape, self.dtype) for _ in range(num_layers)]
        self._plan, self._plan_key = None, None

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks per layer's cache on the device."""
        return self.spec.num_blocks

    def write(self, layer: int, k: ArrayLike, v: ArrayLike, slots: ArrayLike) -> None:
        """Write new tokens' keys and values into one layer's caches (reshape_and_cache).

        Parameters
        ----------
        layer : int
        k, v : DeviceArray or array_like, shape (n, num_kv_heads, head_size)
            DeviceArrays (float32, float16 or bfloat16) are used where they are, never read back, views whose rows
            lie apart included (a fused QKV projection's key and value columns, ``qkv[:, q_size:q_size + kv_size]
            .reshape(n, num_kv_heads, head_size)``); anything else is converted to float32.
        slots : DeviceArray or array_like, shape (n,)
            Slot = block * block_size + offset, as the BlockManager gives them; negative slots are skipped. Host
            slots are checked against the cache; device slots are not read back (the kernel skips slots outside it).
        """
        k, v = (a if isinstance(a, DeviceArray) else np.asarray(a, np.float32) for a in (k, v))
        on_device = isinstance(slots, DeviceArray)
        slots = slots if on_device else np.asarray(slots, np.int32)
        cache_ops.reshape_and_cache(k, v, self.key[layer], self.value[layer], slots, layout=self.layout,
                                    k_scale=self.k_scale, v_scale=self.v_scale, backend=self.backend,
                                    validate=not on_device)

    def copy_blocks(self, pairs: ArrayLike) -> None:
        """Copy-on-write copies in every layer's caches, in one submission.

        Parameters
        ----------
        pairs : array_like, shape (num_pairs, 2)
            (src, dst) block pairs (BlockManager's `copies`); empty does nothing.
        """
        if len(pairs):
            cache_ops.copy_blocks(self.key, self.value, np.asarray(pairs, np.int64).reshape(-1, 2))

    def swap(self, pairs: ArrayLike, to_host: bool) -> None:
        """Preemption: move blocks between the device caches and the host swap space, every layer.

        Parameters
        ----------
        pairs : array_like, shape (num_pairs, 2)
            (device block, host block) pairs to copy out, or (host block, device block) pairs to copy back in;
            empty does nothing.
        to_host : bool
            True swaps out, False swaps in.
        """
        if not len(pairs):
            return
        mapping = np.asarray(pairs, np.int64).reshape(-1, 2)
        for layer in range(self.num_layers):
            for dev, host in ((self.key[layer], self.host_key[layer]), (self.value[layer], self.host_value[layer])):
                cache_ops.swap_blocks(dev, host, mapping) if to_host else cache_ops.swap_blocks(host, dev, mapping)

    def attend(self, layer: int, q: ArrayLike, batch) -> np.ndarray:
        """Attention of one step's new tokens over one layer's cache.

        Sequences with one new token go through one DecodePlan per step (made at the step's first layer, reused by
        the others), longer ones through one ragged paged_attention_prefill.

        Parameters
        ----------
        layer : int
        q : array_like, shape (sum of batch.q_lens, num_heads, head_size)
            Converted to float32.
        batch : pagedvk.demo.serve.Batch
            q_lens, block_tables, seq_lens (new tokens included).

        Returns
        -------
        numpy.ndarray, shape of q, float32
        """
        q = np.asarray(q, np.float32)
        out = np.empty(q.shape, np.float32)
        starts = np.cumsum([0] + list(batch.q_lens))
        decode = [i for i, n in enumerate(batch.q_lens) if n == 1]
        if decode:
            out[starts[decode]] = self._decode_plan(batch, decode, q.shape[1]).run(
                q[starts[decode]], self.key[layer], self.value[layer])
        prefill = [i for i, n in enumerate(batch.q_lens) if n > 1]
        if prefill:
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in prefill])
            loc = np.cumsum([0] + [batch.q_lens[i] for i in prefill]).astype(np.int32)
            out[rows], _ = paged_attention_prefill(
                np.ascontiguousarray(q[rows]), self.key[layer], self.value[layer],
                np.ascontiguousarray(batch.block_tables[prefill]), np.ascontiguousarray(batch.seq_lens[prefill]), loc,
                layout=self.layout, backend=self.backend, k_scale=self.k_scale, v_scale=self.v_scale)
        return out

    def _decode_plan(self, batch, rows, num_heads: int) -> DecodePlan:
        # Every layer's decode of a step uses the same block tables and lengths. Keyed on their values, not on the
        # Batch object: a Batch updated in place for the next step got the previous step's plan. A batch of the
        # plan's shape updates the plan (DecodePlan.update: its tables written in place, nothing allocated while
        # its split stays); another shape gets a new plan.
        tables = np.ascontiguousarray(batch.block_tables[rows], np.int32)
        lens = np.ascontiguousarray(batch.seq_lens[rows], np.int32)
        key = (num_heads, tables.shape, tables.tobytes(), lens.tobytes())
        if self._plan_key != key:
            if self._plan_key is not None and self._plan_key[:2] == key[:2]:   # same heads and table shape
                self._plan.update(tables, lens)
            else:
                self._close_plan()
                self._plan = self.decode_plan(tables, lens, num_heads=num_heads, query_dtype=np.float32)
            self._plan_key = key
        return self._plan

    @property
    def step_plan(self) -> DecodePlan | None:
        """The DecodePlan `attend`'s last decode ran (kept, and updated, while the batch keeps its shape), or None."""
        return self._plan

    def decode_plan(self, block_tables: ArrayLike, seq_lens: ArrayLike, *, num_heads: int,
                    query_dtype: DTypeLike | None = None, **options) -> DecodePlan:
        """A DecodePlan over this cache: its dims, dtype, layout, device and backend are the cache's.

        Parameters
        ----------
        block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
            As `blocks.block_tables(...)` gives them.
        seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        num_heads : int
            The model's query heads, a multiple of the cache's num_kv_heads.
        query_dtype : numpy dtype, optional
            As for DecodePlan: None means the cache's dtype where it is a query type, else float16.
        **options
            DecodePlan's other arguments (scale, validate, partition_size, the attention variants, kernel; k_scale and
            v_scale default to the cache's).

        Returns
        -------
        DecodePlan
            Run it on ``cache.key[layer], cache.value[layer]``; `update` it for the next step.
        """
        s = self.spec
        options = {"k_scale": self.k_scale, "v_scale": self.v_scale, **options}
        return DecodePlan(block_tables, seq_lens, num_heads=num_heads, num_kv_heads=s.num_kv_heads,
                          head_size=s.head_size, block_size=s.block_size, num_blocks=s.num_blocks, dtype=self.dtype,
                          query_dtype=query_dtype, layout=self.layout, device=self.device, backend=self.backend,
                          **options)

    def prefill_plan(self, block_tables: ArrayLike, seq_lens: ArrayLike, query_start_loc: ArrayLike | None = None,
                     **options) -> PrefillPlan:
        """A PrefillPlan over this cache: its layout, device and backend are the cache's.

        Parameters
        ----------
        block_tables, seq_lens, query_start_loc
            As for `PrefillPlan` (`blocks.block_tables(...)` gives the first two).
        **options
            PrefillPlan's other arguments (scale, causal, validate, the attention variants, kernel; k_scale and
            v_scale default to the cache's).

        Returns
        -------
        PrefillPlan
            Run it on ``cache.key[layer], cache.value[layer]``; `update` it for the next step.
        """
        options = {"k_scale": self.k_scale, "v_scale": self.v_scale, **options}
        return PrefillPlan(block_tables, seq_lens, query_start_loc, layout=self.layout, backend=self.backend,
                           device=self.device, **options)

    def _close_plan(self) -> None:
        if self._plan is not None:
            self._plan.close()
        self._plan, self._plan_key = None, None

    @property
    def closed(self) -> bool:
        """Whether every layer's cache was freed."""
        return all(a.closed for a in self.key + self.value)

    def close(self) -> None:
        """Free the caches and the step's decode plan; safe to call twice."""
        self._close_plan()
        for a in self.key + self.value:
            a.close()
