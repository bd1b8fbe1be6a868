"""Exceptions raised by pagedvk. Bad arguments raise the built-in ValueError / TypeError."""


class PagedVKError(RuntimeError):
    """Base of the errors that come from Vulkan or the library's own state, not from an argument."""


class VulkanError(PagedVKError):
    """A Vulkan call returned an error code."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class DeviceLostError(VulkanError):
    """VK_ERROR_DEVICE_LOST: the device (or its driver) stopped; everything created on it is gone. Every
    later use of that Device raises it too; close it and open a new one."""


class GPUTimeoutError(PagedVKError, TimeoutError):
    """A fence was not signalled within PAGEDVK_TIMEOUT seconds."""


class OutOfMemoryError(PagedVKError, MemoryError):
    """A device or host allocation failed; nothing was allocated. `nbytes` is the size asked for and
    `budget` what the heap could give (a pagedvk.runtime.memory.HeapBudget: the driver's budget with
    VK_EXT_memory_budget, else the heap's size), where known; the message states both."""

    def __init__(self, message: str, nbytes: int | None = None, budget=None):
        super().__init__(message)
        self.nbytes, self.budget = nbytes, budget


class ValidationError(PagedVKError):
    """The Khronos validation layer reported a problem (PAGEDVK_VALIDATION=1)."""


class ShaderModuleError(PagedVKError):
    """A SPIR-V module is missing, or was built from older shader sources."""


class ClosedError(PagedVKError):
    """A device or array was used after close()."""


class DeviceNotFoundError(PagedVKError, LookupError):
    """PAGEDVK_DEVICE (or a device argument) matched no Vulkan device."""


class UnsupportedFeatureError(PagedVKError):
    """A kernel needs a Vulkan feature the device lacks; the message names it."""


class NoFreeBlocksError(PagedVKError):
    """A KV cache block manager has too few free blocks (device, or host for swap_out) for the call; the call
    changed nothing. A scheduler handles it by preempting a sequence (swap_out or free) and retrying."""
