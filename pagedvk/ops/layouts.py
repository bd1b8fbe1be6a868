"""What a paged KV cache looks like in each layout and storage type: the one place cache shapes are read.

Layouts (vLLM's names; x = 16 // itemsize elements make one 16-byte key chunk):
  "vllm"  key   [num_blocks, num_kv_heads, head_size // x, block_size, x]
          value [num_blocks, num_kv_heads, head_size, block_size]
  "nhd"   key and value [num_blocks, block_size, num_kv_heads, head_size] (FlashInfer's NHD, vLLM's flash layout)
  "hnd"   key and value [num_blocks, num_kv_heads, block_size, head_size] (FlashInfer's HND)
In every layout a token's four consecutive key dims are contiguous; in "nhd" and "hnd" its value dims are too, in
"vllm" a value dim's tokens. The kernels read all three through CacheSpec.strides().

Block sizes: powers of two up to 32. vLLM's layout takes 8, 16 and 32 (vLLM's own): its values are read four
tokens a load, so a block holds 4 tokens at least, and vLLM has no smaller block. The token-major layouts also take
1, 2 and 4 (FlashInfer's page size 1 among them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import CACHE_TYPES, StorageType, cache_type
from ..kernels.abi import KV_SEGMENTS
from . import checks

LAYOUTS = ("vllm", "nhd", "hnd")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32)      # "nhd" and "hnd"
VLLM_BLOCK_SIZES = (8, 16, 32)          # "vllm"
# The kernels address a block in 16-byte chunks (the decode's and every WGSL module's loads): one block of one cache
# must be a whole number of them, which blocks of 8 tokens and more always are (head sizes are multiples of 4).
BLOCK_ALIGN = 16
MAX_HEAD_SIZE = 256

SHAPES = {
    "vllm": ("[num_blocks, num_kv_heads, head_size // x, block_size, x]",
             "[num_blocks, num_kv_heads, head_size, block_size]"),
    "nhd": ("[num_blocks, block_size, num_kv_heads, head_size]",) * 2,
    "hnd": ("[num_blocks, num_kv_heads, block_size, head_size]",) * 2,
}

VALUE_AXES = {"vllm": ("num_blocks", "num_kv_heads", "head_size", "block_size"),
              "nhd": ("num_blocks", "block_size", "num_kv_heads", "head_size"),
              "hnd": ("num_blocks", "num_kv_heads", "block_size", "head_size")}


def block_sizes(layout: str) -> tuple:
    """The block sizes a layout takes."""
    return VLLM_BLOCK_SIZES if layout == "vllm" else BLOCK_SIZES


def check_block_size(name: str, block_size: int, layout: str, num_kv_heads: int, head_size: int, itemsize: int):
    """block_size one the layout takes, with blocks of whole 16-byte chunks (BLOCK_ALIGN); errors name `name`."""
    allowed = block_sizes(layout)
    if block_size not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))} in layout {layout!r}, got {block_size}")
    block_bytes = num_kv_heads * head_size * block_size * itemsize
    if block_bytes % BLOCK_ALIGN:
        raise ValueError(f"{name} {block_size} makes blocks of {num_kv_heads} kv heads x {head_size} dims x "
                         f"{block_size} tokens x {itemsize} bytes = {block_bytes} bytes, not a multiple of "
                         f"{BLOCK_ALIGN}: the kernels address blocks in {BLOCK_ALIGN}-byte chunks (use a larger "
                         "block size)")


@dataclass(frozen=True)
class CacheSpec:
    """A checked pair of caches: layout, storage type and dims."""

    layout: str
    storage: StorageType
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int

    @property
    def key_shape(self) -> tuple:
        if self.layout == "nhd":
            return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        if self.layout == "hnd":
            return (self.num_blocks, self.num_kv_heads, self.block_size, self.head_size)
        x = self.storage.x
        return (self.num_blocks, self.num_kv_heads, self.head_size // x, self.block_size, x)

    @property
    def value_shape(self) -> tuple:
        if self.layout != "vllm":
            return self.key_shape
        return (self.num_blocks, self.num_kv_heads, self.head_size, self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one cache (keys or values)."""
        return self.num_kv_heads * self.head_size * self.block_size * self.storage.itemsize

    def strides(self) -> dict:
        """The kernels' cache addressing (ATTENTION_PUSH in pagedvk/kernels/abi.py): key strides in quads of 4
        elements, value strides in elements."""
        block = self.num_kv_heads * self.head_size * self.block_size
        hs, bs, x = self.head_size, self.block_size, self.storage.x
        if self.layout != "vllm":   # a token's head dims contiguous; "nhd" puts tokens outside heads, "hnd" inside
            token, head = (self.num_kv_heads * hs, hs) if self.layout == "nhd" else (hs, bs * hs)
            keys = dict(k_block_stride=block // 4, k_head_stride=head // 4, k_token_stride=token // 4,
                        k_chunk_stride=x // 4)
            values = dict(v_block_stride=block, v_head_stride=head, v_token_stride=token, v_dim_stride=1)
        else:
            keys = dict(k_block_stride=block // 4, k_head_stride=hs * bs // 4, k_token_stride=x // 4,
                        k_chunk_stride=bs * x // 4)
            values = dict(v_block_stride=block, v_head_stride=hs * bs, v_token_stride=1, v_dim_stride=bs)
        return {**keys, **values}

    def blocks_held(self, key_buffer_bytes: int, value_buffer_bytes: int) -> int:
        """The kernels' bound on block ids: whole blocks the bound buffers really hold, whatever the shapes
        claim."""
        return min(self.num_blocks, key_buffer_bytes // self.block_bytes, value_buffer_bytes // self.block_bytes)


def cache_spec(key_cache, value_cache, layout: str = "vllm", kv_cache_dtype: str = "auto",
               types=CACHE_TYPES) -> CacheSpec:
    """Check a key and a value cache against each other and the layout; their CacheSpec. Every error names
    the argument and what is allowed."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    key_layout, value_layout = SHAPES[layout]
    checks.kind("key_cache", key_cache)
    checks.kind("value_cache", value_cache)
    checks.ndim("key_cache", key_cache, 5 if layout == "vllm" else 4, f"{key_layout} (layout={layout!r})")
    checks.ndim("value_cache", value_cache, 4, f"{value_layout} (layout={layout!r})")
    storage = cache_type("key_cache", key_cache, kv_cache_dtype, types)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache must have dtype {key_cache.dtype} (key_cache's), got {value_cache.dtype}")
    if layout == "vllm":
        num_blocks, num_kv_heads, head_chunks, block_size, x = key_cache.shape
        if x != storage.x:
            raise ValueError(f"key_cache.shape[4] (x) must be 16 // itemsize = {storage.x} for {storage}, got {x}")
        head_size, where = head_chunks * x, "key_cache.shape[2] * x"
        block_axis, heads_axis = 3, 1
    elif layout == "nhd":
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        where, block_axis, heads_axis = "key_cache.shape[3]", 1, 2
    else:
        num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
        where, block_axis, heads_axis = "key_cache.shape[3]", 2, 1
    if head_size % 4 or not 0 < head_size <= MAX_HEAD_SIZE:   # the kernels read 4 head dims at a time
        raise ValueError(f"head_size ({where}) must be a multiple of 4 in [4, {MAX_HEAD_SIZE}], got {head_size}")
    if num_kv_heads < 1:
        raise ValueError(f"key_cache.shape[{heads_axis}] (num_kv_heads) must be at least 1, got {num_kv_heads}")
    check_block_size(f"block_size (key_cache.shape[{block_axis}])", block_size, layout, num_kv_heads, head_size,
                     storage.itemsize)
    spec = CacheSpec(layout, storage, num_blocks, num_kv_heads, head_size, block_size)
    axes = VALUE_AXES[layout]
    for axis, (expected, what) in enumerate(zip(spec.value_shape, axes)):
        checks.dim("value_cache", value_cache, axis, expected, what)
    return spec


@dataclass(frozen=True)
class CacheBinding:
    """How one launch binds a pair of device caches (shaders/attention_common.glsl's key_load()).

    access              pagedvk.kernels.abi.CACHE_ACCESS: "" one binding each, "seg" up to KV_SEGMENTS bindings each,
                        "bda" each cache's binding holds its segments' device addresses
    key, value          the buffers bound as key_cache and value_cache
    extra               with "seg": key segments 1 .. KV_SEGMENTS - 1, then value segments 1 .. (unused
                        slots repeat segment 0, which the kernel never reads through them)
    blocks_per_segment  whole blocks per segment
    key_bytes, value_bytes  what the segments hold in all (the kernels' bound on block ids)
    """

    access: str
    key: object
    value: object
    extra: tuple
    blocks_per_segment: int
    key_bytes: int
    value_bytes: int

    @property
    def buffers(self) -> tuple:
        return (self.key, self.value) + self.extra


def bind_caches(key_cache, value_cache, backend: str) -> CacheBinding:
    """The binding of two DeviceArray caches for `backend`: one buffer each when they fit one binding; else
    buffer device addresses (GLSL on a device with bufferDeviceAddress), else up to KV_SEGMENTS bindings."""
    keys, values = key_cache.buffers, value_cache.buffers
    sizes = (sum(b.size for b in keys), sum(b.size for b in values))
    rows = max(key_cache.segment_rows, 1)
    if len(keys) == 1 and len(values) == 1:
        return CacheBinding("", keys[0], values[0], (), max(key_cache.shape[0], 1), *sizes)
    if key_cache.segment_rows != value_cache.segment_rows:
        raise ValueError(f"key_cache and value_cache are split into segments of {key_cache.segment_rows} and "
                         f"{value_cache.segment_rows} blocks: allocate them with the same block size")
    if backend == "glsl" and key_cache.device.buffer_device_address:
        return CacheBinding("bda", key_cache.address_table().buffer, value_cache.address_table().buffer, (),
                            rows, *sizes)
    if max(len(keys), len(values)) > KV_SEGMENTS:
        raise ValueError(f"key_cache spans {len(keys)} buffers of {rows} blocks, more than the {KV_SEGMENTS} bindings "
                         f"per cache the {backend} kernels take on {key_cache.device.info.name} (GLSL on a device "
                         "with bufferDeviceAddress takes any number)")
    pad = lambda segs: tuple(segs[1:]) + (segs[0],) * (KV_SEGMENTS - len(segs))
    return CacheBinding("seg", keys[0], values[0], pad(keys) + pad(values), rows, *sizes)
