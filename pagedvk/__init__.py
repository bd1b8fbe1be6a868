"""pagedvk: vLLM-style paged attention on any Vulkan GPU."""

from .kernels import abi
from . import config, dtypes
from .ops import layouts, prefill, variants, vllm
from .testing import reference
from .runtime.array import DeviceArray, asarray, empty, zeros
from .engine.cache import KVCache
from .ops.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from .ops.decode import paged_attention
from .ops.decode_plan import DecodePlan
from .ops.merge import merge_attention_states, merge_states
from .errors import (ClosedError, DeviceLostError, DeviceNotFoundError, GPUTimeoutError, NoFreeBlocksError,
                     OutOfMemoryError, PagedVKError, ShaderModuleError, UnsupportedFeatureError, ValidationError,
                     VulkanError)
from .ops.prefill import paged_attention_backward, paged_attention_prefill
from .runtime.device import Device
from .runtime.instance import DeviceInfo
from .runtime.selection import default_device, devices, get_device, select

__version__ = "0.1.0"

__all__ = [
    "ClosedError", "DecodePlan", "Device", "DeviceArray", "DeviceInfo", "DeviceLostError",
    "DeviceNotFoundError", "GPUTimeoutError", "KVCache", "NoFreeBlocksError", "OutOfMemoryError", "PagedVKError",
    "ShaderModuleError", "UnsupportedFeatureError", "ValidationError", "VulkanError", "abi", "asarray",
    "config", "copy_blocks", "default_device", "devices", "dtypes", "empty", "get_device", "kernels", "layouts",
    "merge_attention_states", "merge_states", "ops", "paged_attention", "paged_attention_backward", "paged_attention_prefill",
    "prefill", "reference",
    "reshape_and_cache", "select", "swap_blocks", "zeros",
]
