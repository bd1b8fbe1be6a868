"""pagedvk: vLLM-style paged attention on any Vulkan GPU.

What users call is named here (``__all__``). Everything else is reached by its path, one layer a sub-package
(docs/ARCHITECTURE.md): vLLM's spellings in pagedvk.ops.vllm, the float64 reference in pagedvk.testing.reference (a
model's in pagedvk.models.reference, its tokenizer in pagedvk.models.tokenizer), the PAGEDVK_* variables in
pagedvk.config, the kernels' declarations in pagedvk.kernels.catalogue.
"""

from .engine.cache import KVCache
from .errors import (ClosedError, DeviceLostError, DeviceNotFoundError, GPUTimeoutError, NoFreeBlocksError,
                     OutOfMemoryError, PagedVKError, ShaderModuleError, UnsupportedFeatureError, ValidationError,
                     VulkanError)
from .models.gguf_file import load_model
from .models.runner import ModelRunner
from .ops.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from .ops.decode import paged_attention
from .ops.decode_plan import DecodePlan
from .ops.layer_ops import (embedding, fused_add_rms_norm, rms_norm, rope_cos_sin_cache, rotary_embedding,
                            silu_and_mul)
from .ops.linear import linear
from .ops.merge import merge_attention_states, merge_states
from .ops.prefill import paged_attention_backward, paged_attention_prefill
from .ops.prefill_plan import PrefillPlan
from .ops.sampling import greedy_sample, sample
from .runtime.array import DeviceArray, asarray, empty, zeros
from .runtime.device import Device
from .runtime.instance import DeviceInfo
from .runtime.recording import RecordedStep, record
from .runtime.stream import Event, Stream, synchronize
from .runtime.selection import default_device, devices, get_device, select

__version__ = "0.1.0"

__all__ = [
    'ClosedError', 'DecodePlan', 'Device', 'DeviceArray', 'DeviceInfo', 'DeviceLostError', 'DeviceNotFoundError',
    'Event', 'GPUTimeoutError', 'KVCache', 'ModelRunner', 'NoFreeBlocksError', 'OutOfMemoryError', 'PagedVKError', 'PrefillPlan',
    'RecordedStep', 'ShaderModuleError', 'Stream', 'UnsupportedFeatureError', 'ValidationError', 'VulkanError',
    'asarray', 'copy_blocks', 'default_device', 'devices', 'embedding', 'empty', 'fused_add_rms_norm', 'get_device',
    'greedy_sample', 'linear', 'load_model', 'merge_attention_states', 'merge_states', 'paged_attention',
    'paged_attention_backward', 'paged_attention_prefill', 'record', 'reshape_and_cache', 'rms_norm',
    'rope_cos_sin_cache', 'rotary_embedding', 'sample', 'select', 'silu_and_mul', 'swap_blocks', 'synchronize',
    'zeros',
]
