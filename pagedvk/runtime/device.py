"""A logical device: its compute queue, memory, buffers, command buffers, descriptor sets and timestamps.

Knows nothing of attention. Every object it creates is destroyed by close(), which also runs at exit.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import vulkan as vk

from ..errors import ClosedError, DeviceLostError, OutOfMemoryError, GPUTimeoutError, VulkanError
from .instance import DeviceInfo, get_instance, query_features, register_closer

DEFAULT_TIMEOUT_S = 60.0
DESCRIPTORS_PER_POOL = 4096


def timeout_ns() -> int:
    """Fences are waited on with a timeout (PAGEDVK_TIMEOUT seconds), never forever."""
    return int(float(os.environ.get("PAGEDVK_TIMEOUT", DEFAULT_TIMEOUT_S)) * 1e9)


MEMORY_BUDGET_EXTENSION = "VK_EXT_memory_budget"
# Vulkan 1.2 buffer device addresses (the binding leaves these two constants None, so their values are here).
BUFFER_USAGE_SHADER_DEVICE_ADDRESS = 0x00020000
MEMORY_ALLOCATE_DEVICE_ADDRESS = 0x00000002


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class HeapBudget:
    """What one memory heap can still give. With VK_EXT_memory_budget (source "VK_EXT_memory_budget")
    `budget` is the driver's estimate of what this process may use and `usage` what it uses now; without
    it (source "heap size") `budget` is the heap's whole size and `usage` is unknown (None)."""

    heap: int
    size: int
    budget: int
    usage: int | None
    source: str

    def __str__(self) -> str:
        if self.usage is None:
            return (f"heap {self.heap} holds {gib(self.size)} ({self.size} bytes; the heap size: the device has no "
                    f"{MEMORY_BUDGET_EXTENSION}, so what is still free is not known)")
        return (f"heap {self.heap} budget {gib(self.budget)} ({self.budget} bytes), {gib(self.usage)} of it in use "
                f"({MEMORY_BUDGET_EXTENSION}; heap size {gib(self.size)})")


def raise_vk(e: Exception, what: str, nbytes: int | None = None, budget: HeapBudget | None = None,
             device: "Device | None" = None):
    """Raise the pagedvk error for a failed Vulkan call (a vk.VkError or vk.VkException)."""
    if isinstance(e, (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory)):
        kind = "device" if isinstance(e, vk.VkErrorOutOfDeviceMemory) else "host"
        asked = f" asking for {gib(nbytes)} ({nbytes} bytes)" if nbytes is not None else ""
        raise OutOfMemoryError(f"{what}: out of {kind} memory (VK_ERROR_OUT_OF_{kind.upper()}_MEMORY){asked}"
                               + (f"; {budget}" if budget is not None else ""), nbytes, budget) from e
    if isinstance(e, vk.VkErrorDeviceLost):
        message = (f"{what}: the Vulkan device was lost (VK_ERROR_DEVICE_LOST): the driver stopped it (a crash, "
                   "a hang reset, or the GPU went away); everything made on it is gone. Close it and open a new one "
                   "(device.close(), then pagedvk.default_device())")
        if device is not None:
            device.lost = message
        raise DeviceLostError(message) from e
    raise VulkanError(f"{what} failed: {type(e).__name__}") from e


class Buffer:
    """A storage buffer in device memory. `nbytes` is what was asked for; at least 16 bytes are allocated
    because Vulkan has no empty buffers and kernels read in 16-byte chunks. Freed by close(), when garbage
    collected, or when its device closes, whichever comes first."""

    def __init__(self, device: "Device", nbytes: int, host_visible: bool = False):
        self.device = device
        self.nbytes = nbytes
        self.size = max(16, (nbytes + 15) // 16 * 16)
        self.handle = self.memory = self.mapped = None
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        addressable = device.buffer_device_address and not host_visible
        if addressable:   # kernels may reach it through its address (caches larger than one binding)
            usage |= BUFFER_USAGE_SHADER_DEVICE_ADDRESS
        d = device.handle
        try:
            self.handle = vk.vkCreateBuffer(d, vk.VkBufferCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=self.size, usage=usage,
                sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
            req = vk.vkGetBufferMemoryRequirements(d, self.handle)
            type_index, mappable = device.memory_type(req.memoryTypeBits, host_visible)
            heap = device.memory_properties.memoryTypes[type_index].heapIndex
            if req.size > device.memory_properties.memoryHeaps[heap].size:
                # Asking Vulkan for more than the heap is invalid usage (VUID-vkAllocateMemory-pAllocateInfo-01713),
                # not an error code: refuse it here as the out-of-memory it is.
                vk.vkDestroyBuffer(d, self.handle, None)
                self.handle = None
                budget = device.memory_budget(heap)
                raise OutOfMemoryError(f"allocating a buffer: {gib(nbytes)} ({nbytes} bytes) is more than the "
                                       f"whole memory heap; {budget}", nbytes, budget)
            flags = vk.VkMemoryAllocateFlagsInfo(sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO,
                                                 flags=MEMORY_ALLOCATE_DEVICE_ADDRESS) if addressable else None
            self.memory = vk.vkAllocateMemory(d, vk.VkMemoryAllocateInfo(
                sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, pNext=flags or vk.ffi.NULL,
                allocationSize=req.size, memoryTypeIndex=type_index), None)
            vk.vkBindBufferMemory(d, self.handle, self.memory, 0)
            if mappable:
                self.mapped = vk.vkMapMemory(d, self.memory, 0, self.size, 0)
        except vk.VkError as e:
            _free_buffer(d, self.handle, self.memory)
            raise_vk(e, "allocating a buffer", nbytes, _budget_or_none(device, host_visible), device)
        self._finalizer = device.own(self, functools.partial(_free_buffer, d, self.handle, self.memory))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def device_address(self) -> int:
        """The buffer's address for kernels that read through buffer references (Vulkan 1.2)."""
        if not self.device.buffer_device_address:
            raise VulkanError(f"{self.device.info.name} has no bufferDeviceAddress feature")
        info = vk.ffi.new("VkBufferDeviceAddressInfo*", dict(sType=vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO,
                                                             buffer=self.handle))
        # Called raw: the binding's wrapper drops the returned address.
        return int(vk.lib.vkGetBufferDeviceAddress(self.device.handle, info))

    def close(self) -> None:
        self._finalizer()
        self.handle = self.memory = self.mapped = None


def _budget_or_none(device, host_visible: bool) -> HeapBudget | None:
    try:   # the figure for the error message; never let it hide the error itself
        return device.memory_budget(device.heap_of(host_visible))
    except Exception:
        return None


def _free_buffer(d, handle, memory) -> None:
    # Freeing mapped memory unmaps it.
    if handle is not None:
        vk.vkDestroyBuffer(d, handle, None)
    if memory is not None:
        vk.vkFreeMemory(d, memory, None)


class Device:
    """One Vulkan logical device with one compute queue.

    Thread-safe: `lock` serializes every use of the queue, the command pool and the descriptor pools
    (Vulkan requires that of the host), and each submission holds it until its fence is signalled.
    A submission whose wait timed out (PAGEDVK_TIMEOUT) is still running: it stays in `_in_flight`, and
    until it finishes, objects dropped meanwhile are destroyed later rather than under it, and every
    later submission or host copy first waits for it."""

    def __init__(self, info: DeviceInfo):
        self.info = info
        self.instance = get_instance()
        self.lock = threading.RLock()
        self._live = {}  # key -> weakref.finalize that destroys one object made on this device
        self._keys = itertools.count()
        self._in_flight = []   # fences of timed-out submissions that may still be running
        self._deferred = []    # destroy() calls waiting for those submissions to finish
        self.lost = None       # the message of the VK_ERROR_DEVICE_LOST that ended this device, if one did
        self.handle = None
        pd = info.handle
        families = list(vk.vkGetPhysicalDeviceQueueFamilyProperties(pd))
        # A compute family; prefer one without graphics (a dedicated compute queue), with timestamps.
        candidates = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not candidates:
            raise VulkanError(f"{info.name} has no compute queue")
        candidates.sort(key=lambda i: (families[i].timestampValidBits == 0,
                                       bool(families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT)))
        self.queue_family = candidates[0]
        self.timestamp_bits = families[self.queue_family].timestampValidBits
        self.timestamp_period_ns = vk.vkGetPhysicalDeviceProperties(pd).limits.timestampPeriod

        # Turn on the optional features the kernels may use, where the device has them.
        have11, have12 = query_features(pd)
        # Buffer device addresses (with 64-bit integers) let GLSL kernels read caches larger than one binding.
        self.buffer_device_address = bool(have12.bufferDeviceAddress and vk.vkGetPhysicalDeviceFeatures(pd).shaderInt64)
        f12 = vk.VkPhysicalDeviceVulkan12Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
            shaderFloat16=have12.shaderFloat16, shaderInt8=have12.shaderInt8,
            storageBuffer8BitAccess=have12.storageBuffer8BitAccess,
            bufferDeviceAddress=self.buffer_device_address)
        f11 = vk.VkPhysicalDeviceVulkan11Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, pNext=f12,
            storageBuffer16BitAccess=have11.storageBuffer16BitAccess)
        base = vk.vkGetPhysicalDeviceFeatures(pd)
        features = vk.VkPhysicalDeviceFeatures(shaderInt16=base.shaderInt16, shaderInt64=base.shaderInt64)
        # VK_EXT_memory_budget: what each heap can still give, for out-of-memory errors (memory_budget()).
        extensions = [e for e in ("VK_KHR_portability_subset", MEMORY_BUDGET_EXTENSION) if e in info.extensions]
        self.has_memory_budget = MEMORY_BUDGET_EXTENSION in extensions
        queue_info = vk.VkDeviceQueueCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=self.queue_family,
            queueCount=1, pQueuePriorities=[1.0])
        try:
            self.handle = vk.vkCreateDevice(pd, vk.VkDeviceCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=f11, queueCreateInfoCount=1,
                pQueueCreateInfos=[queue_info], enabledExtensionCount=len(extensions),
                ppEnabledExtensionNames=extensions, pEnabledFeatures=features), None)
        except vk.VkError as e:
            raise_vk(e, f"creating a logical device on {info.name}")
        self.queue = vk.vkGetDeviceQueue(self.handle, self.queue_family, 0)
        self.memory_properties = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        self.command_pool = vk.vkCreateCommandPool(self.handle, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.queue_family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.pipeline_cache = vk.vkCreatePipelineCache(self.handle, vk.VkPipelineCacheCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO), None)
        self._descriptor_pools = []
        self._staging = None
        self._pipelines = {}
        # Where device memory is the host's (CPU drivers, integrated GPUs), buffers are mapped directly
        # and need no staging copy.
        self.unified_memory = info.type in ("cpu", "integrated")
        register_closer(self.close)
        self.check()

    # -- bookkeeping ---------------------------------------------------------------------------------

    def own(self, obj, destroy) -> weakref.finalize:
        """Tie destroy() (which must not refer to obj) to obj: it runs once, at the first of the returned
        finalizer being called (obj.close()), obj being garbage collected, or this device closing."""
        key = next(self._keys)
        finalizer = weakref.finalize(obj, self._release, key, destroy)
        finalizer.atexit = False  # the device's own close at exit runs it, before the device goes
        with self.lock:
            self._live[key] = finalizer
        return finalizer

    def _release(self, key, destroy) -> None:
        with self.lock:
            self._live.pop(key, None)
            if self.handle is None:
                return
            if self._in_flight and not self._settle(wait=False):
                self._deferred.append(destroy)   # a timed-out submission may still use it
            else:
                destroy()

    def _settle(self, wait: bool) -> bool:
        """Whether every timed-out submission has finished (with wait, after waiting up to PAGEDVK_TIMEOUT
        for them, raising GPUTimeoutError if they still run). When all have, the destroys they held back
        run. Callers hold self.lock."""
        if self._in_flight:
            try:
                if wait:
                    vk.vkWaitForFences(self.handle, len(self._in_flight), self._in_flight, vk.VK_TRUE, timeout_ns())
                else:
                    for fence in self._in_flight:
                        vk.vkGetFenceStatus(self.handle, fence)
            except (vk.VkTimeout, vk.VkNotReady):
                if not wait:
                    return False
                raise GPUTimeoutError(f"{self.info.name}: work submitted earlier (whose wait timed out) is still "
                                    f"running after another PAGEDVK_TIMEOUT={timeout_ns() / 1e9:g} s") from None
            except vk.VkError as e:
                # A lost device runs nothing more: its objects may go. (This also runs inside finalizers,
                # which must not raise: without wait the loss is only recorded.)
                self._in_flight.clear()
                self._run_deferred()
                try:
                    raise_vk(e, "waiting for earlier work", device=self)
                except DeviceLostError:
                    if wait:
                        raise
                    return True
            self._in_flight.clear()
        self._run_deferred()
        return True

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for destroy in deferred:
            destroy()

    @property
    def closed(self) -> bool:
        return self.handle is None

    def require_open(self) -> None:
        if self.handle is None:
            raise ClosedError(f"device {self.info.name} is closed")
        if self.lost is not None:
            raise DeviceLostError(f"device {self.info.name} was lost earlier: {self.lost}")

    def check(self) -> None:
        """Raise any validation message the calls so far produced."""
        self.instance.raise_validation_messages()

    def live_objects(self) -> int:
        """How many Vulkan objects made through this device are alive (buffers, pipelines, ...), counting
        those dropped while a timed-out submission still runs, which are destroyed once it finishes."""
        with self.lock:
            if self._in_flight and self.handle is not None:
                self._settle(wait=False)
            return len(self._live) + len(self._deferred)

    def heap_of(self, host_visible: bool = False) -> int:
        """The memory heap buffers are allocated from (device arrays: host_visible=False)."""
        type_index, _ = self.memory_type((1 << self.memory_properties.memoryTypeCount) - 1, host_visible)
        return self.memory_properties.memoryTypes[type_index].heapIndex

    def memory_budget(self, heap: int | None = None) -> HeapBudget:
        """What a memory heap (default: the one device arrays use) can still give: the driver's budget and
        this process's usage with VK_EXT_memory_budget, else the heap's size (see HeapBudget)."""
        heap = self.heap_of() if heap is None else heap
        size = self.memory_properties.memoryHeaps[heap].size
        if not self.has_memory_budget:
            return HeapBudget(heap, size, size, None, "heap size")
        budget = vk.VkPhysicalDeviceMemoryBudgetPropertiesEXT(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT)
        vk.vkGetPhysicalDeviceMemoryProperties2(self.info.handle, vk.VkPhysicalDeviceMemoryProperties2(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2, pNext=budget))
        return HeapBudget(heap, size, budget.heapBudget[heap], budget.heapUsage[heap], MEMORY_BUDGET_EXTENSION)

    def close(self) -> None:
        """Destroy everything made on this device. Safe to call twice."""
        with self.lock:
            if self.handle is None:
                return
            try:
                vk.vkDeviceWaitIdle(self.handle)   # timed-out submissions too: nothing is destroyed under them
            except vk.VkError:
                pass   # a lost device runs nothing: destroying its objects is allowed
            self._in_flight.clear()
            self._run_deferred()
            for finalizer in list(self._live.values()):
                finalizer()
            for pool in self._descriptor_pools:
                vk.vkDestroyDescriptorPool(self.handle, pool, None)
            self._descriptor_pools.clear()
            vk.vkDestroyPipelineCache(self.handle, self.pipeline_cache, None)
            vk.vkDestroyCommandPool(self.handle, self.command_pool, None)
            vk.vkDestroyDevice(self.handle, None)
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- memory --------------------------------------------------------------------------------------

    def memory_type(self, type_bits: int, host_visible: bool) -> tuple:
        """(memory type index, whether to map it) for a buffer; device-local unless host_visible."""
        mp = self.memory_properties
        local = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
        mappable = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        if host_visible:
            wants = [mappable | vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, mappable]
        elif self.unified_memory:
            wants = [local | mappable, local]
        else:
            wants = [local]
        for want in wants:
            for i in range(mp.memoryTypeCount):
                if type_bits & (1 << i) and (mp.memoryTypes[i].propertyFlags & want) == want:
                    return i, (want & mappable) == mappable
        raise VulkanError(f"{self.info.name}: no memory type with flags {wants[-1]:#x} for bits {type_bits:#x}")

    def buffer(self, nbytes: int) -> Buffer:
        self.require_open()
        return Buffer(self, nbytes)

    def _staging_buffer(self, nbytes: int) -> Buffer:
        # One staging buffer, grown as needed and reused; callers hold self.lock.
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self._staging.close()
            self._staging = Buffer(self, max(nbytes, 1 << 20), host_visible=True)
        return self._staging

    def upload(self, buf: Buffer, data: np.ndarray, offset: int = 0) -> None:
        src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset + src.nbytes > buf.size:
            raise ValueError(f"upload of {src.nbytes} bytes at {offset} overflows a {buf.size}-byte buffer")
        if src.nbytes == 0:
            return
        with self.lock:
            self.require_open()
            self._settle(wait=True)   # the host must not write memory that timed-out work may still use
            if buf.mapped is not None:
                np.frombuffer(buf.mapped, np.uint8)[offset:offset + src.nbytes] = src
                return
            staging = self._staging_buffer(src.nbytes)
            np.frombuffer(staging.mapped, np.uint8)[:src.nbytes] = src
            self.copy(staging, buf, src.nbytes, dst_offset=offset)

    def download(self, buf: Buffer, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """The buffer's bytes as a new uint8 array."""
        nbytes = buf.nbytes - offset if nbytes is None else nbytes
        with self.lock:
            self.require_open()
            self._settle(wait=True)   # nor read what it may still write
            if buf.mapped is not None:
                return np.frombuffer(buf.mapped, np.uint8)[offset:offset + nbytes].copy()
            staging = self._staging_buffer(nbytes)
            if nbytes:
                self.copy(buf, staging, nbytes, src_offset=offset)
            return np.frombuffer(staging.mapped, np.uint8)[:nbytes].copy()

    def copy(self, src: Buffer, dst: Buffer, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> None:
        region = vk.VkBufferCopy(srcOffset=src_offset, dstOffset=dst_offset, size=nbytes)
        self.run_once(lambda cmd: vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [region]))

    def copy_regions(self, copies) -> None:
        """Many buffer-to-buffer copies in one submission: copies is [(src, dst, [(src_offset, dst_offset,
        nbytes), ...])], one vkCmdCopyBuffer each (regions of one copy must not overlap)."""
        def record(cmd):
            for src, dst, regions in copies:
                if regions:
                    vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, len(regions), [
                        vk.VkBufferCopy(srcOffset=s, dstOffset=d, size=n) for s, d, n in regions])
        self.run_once(record)

    def upload_regions(self, data: np.ndarray, targets) -> None:
        """Host bytes into many places of many buffers in one submission, through the reused staging buffer:
        targets is [(dst, [(offset in data, dst_offset, nbytes), ...])]."""
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if data.nbytes == 0:
            return
        with self.lock:
            self.require_open()
            self._settle(wait=True)   # the staging buffer may still be read by timed-out work
            staging = self._staging_buffer(data.nbytes)
            np.frombuffer(staging.mapped, np.uint8)[:data.nbytes] = data
            self.copy_regions([(staging, dst, regions) for dst, regions in targets])

    def download_regions(self, nbytes: int, sources) -> np.ndarray:
        """Many places of many buffers gathered into one new uint8 array of nbytes in one submission, through the
        reused staging buffer: sources is [(src, [(src_offset, offset in the result, nbytes), ...])]."""
        if nbytes == 0:
            return np.zeros(0, np.uint8)
        with self.lock:
            self.require_open()
            self._settle(wait=True)
            staging = self._staging_buffer(nbytes)
            self.copy_regions([(src, staging, regions) for src, regions in sources])
            return np.frombuffer(staging.mapped, np.uint8)[:nbytes].copy()

    def fill(self, buf: Buffer, value: int = 0) -> None:
        """Set every 32-bit word of the buffer to `value`."""
        self.run_once(lambda cmd: vk.vkCmdFillBuffer(cmd, buf.handle, 0, buf.size, value))

    # -- commands ------------------------------------------------------------------------------------

    def command_buffer(self) -> "CommandBuffer":
        self.require_open()
        return CommandBuffer(self)

    def run_once(self, record) -> None:
        """Record `record(cmd)` into a fresh command buffer, submit it and wait."""
        cmd = self.command_buffer()
        try:
            cmd.record(record)
            cmd.submit()
        finally:
            cmd.close()

    # -- descriptor sets -----------------------------------------------------------------------------

    def allocate_descriptor_set(self, layout) -> tuple:
        """(set, pool) from the first pool with room; a new pool when all are full."""
        with self.lock:
            self.require_open()
            for pool in reversed(self._descriptor_pools):
                try:
                    return self._allocate_set(pool, layout), pool
                except (vk.VkErrorOutOfPoolMemory, vk.VkErrorFragmentedPool):
                    continue
            size = vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                           descriptorCount=DESCRIPTORS_PER_POOL)
            pool = vk.vkCreateDescriptorPool(self.handle, vk.VkDescriptorPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
                maxSets=DESCRIPTORS_PER_POOL // 4, poolSizeCount=1, pPoolSizes=[size]), None)
            self._descriptor_pools.append(pool)
            return self._allocate_set(pool, layout), pool

    def _allocate_set(self, pool, layout):
        return vk.vkAllocateDescriptorSets(self.handle, vk.VkDescriptorSetAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=pool,
            descriptorSetCount=1, pSetLayouts=[layout]))[0]


class CommandBuffer:
    """A primary command buffer with its own fence, recorded once and submitted any number of times.

    Allocating, recording and freeing it use the device's command pool, which Vulkan requires the host to
    serialize: all three hold device.lock. A submission holds it until its fence is signalled, so two
    threads submitting one command buffer (a DecodePlan's cached launch) take turns."""

    def __init__(self, device: Device):
        self.device = device
        d = device.handle
        with device.lock:
            device.require_open()
            self.handle = vk.vkAllocateCommandBuffers(d, vk.VkCommandBufferAllocateInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=device.command_pool,
                level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
            try:
                self.fence = vk.vkCreateFence(d, vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO),
                                              None)
            except vk.VkError as e:
                vk.vkFreeCommandBuffers(d, device.command_pool, 1, [self.handle])
                raise_vk(e, "creating a fence", device=device)
        self._submit_info = vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                                            pCommandBuffers=[self.handle])
        self.pending = False    # submitted, and its fence not yet seen signalled and reset
        self.query_pool, self.queries = None, 0
        self._query_pools = []  # the finalizer's view of the query pools made by timed records
        self._elapsed = threading.local()  # each submitting thread's own timestamps (timestamps_ns)
        self._finalizer = device.own(self, functools.partial(
            _free_command_buffer, d, device.command_pool, self.handle, self.fence, self._query_pools))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _require_idle(self) -> None:
        """Open, and not still running an earlier submission. Callers hold device.lock."""
        self.device.require_open()
        if self.closed:
            raise ClosedError("the command buffer is closed")
        if self.pending:
            self.wait()   # its last wait timed out: it must finish before it is submitted or recorded again

    def record(self, body, timestamps: int = 0) -> None:
        """Record body(cmd) between barriers that order it after earlier submissions and before host
        reads. With timestamps=n (n >= 2), a GPU timestamp is written before body and one after it, and
        body may write the n - 2 between by calling stamp(cmd); read them with timestamps_ns()."""
        with self.device.lock:
            self._require_idle()
            self._record(body, timestamps)
        self.device.check()

    def _record(self, body, timestamps: int) -> None:
        cmd = self.handle
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        memory_barrier(cmd, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_WRITE_BIT,
                       vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT,
                       vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT)
        self.queries, self._stamped = int(timestamps), 0
        if self.queries:
            if self.queries < 2:
                raise ValueError("timestamps must be 0 or at least 2")
            self.query_pool = vk.vkCreateQueryPool(self.device.handle, vk.VkQueryPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
                queryCount=self.queries), None)
            self._query_pools.append(self.query_pool)
            vk.vkCmdResetQueryPool(cmd, self.query_pool, 0, self.queries)
            vk.vkCmdWriteTimestamp(cmd, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self.query_pool, 0)
            self._stamped = 1
        body(cmd)
        if self.queries:
            self.stamp(cmd)
            if self._stamped != self.queries:
                raise ValueError(f"recorded {self._stamped} timestamps of the {self.queries} asked for")
        memory_barrier(cmd, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_WRITE_BIT,
                       vk.VK_PIPELINE_STAGE_HOST_BIT, vk.VK_ACCESS_HOST_READ_BIT)
        vk.vkEndCommandBuffer(cmd)

    def stamp(self, cmd) -> None:
        """Write the next timestamp once everything recorded before it has finished."""
        vk.vkCmdWriteTimestamp(cmd, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.query_pool, self._stamped)
        self._stamped += 1

    def submit(self, wait: bool = True) -> None:
        dev = self.device
        with dev.lock:
            self._require_idle()
            dev._settle(wait=True)   # work whose wait timed out goes first, as it did on the queue
            try:
                vk.vkQueueSubmit(dev.queue, 1, [self._submit_info], self.fence)
            except vk.VkError as e:
                raise_vk(e, "vkQueueSubmit", device=dev)
            self.pending = True
            if wait:
                self.wait()
        dev.check()

    def wait(self) -> None:
        """Wait for the last submission, at most PAGEDVK_TIMEOUT seconds; GPUTimeoutError past that (the
        submission then stays pending: nothing it uses is freed or reused until it has finished)."""
        dev = self.device
        with dev.lock:
            if not self.pending:
                return
            try:
                result = vk.vkWaitForFences(dev.handle, 1, [self.fence], vk.VK_TRUE, timeout_ns())
            except vk.VkTimeout:   # the binding raises VK_TIMEOUT (a success code) as an exception
                result = vk.VK_TIMEOUT
            except vk.VkError as e:
                self._keep_in_flight()   # it may still run: free nothing under it
                raise_vk(e, "vkWaitForFences", device=dev)
            if result == vk.VK_TIMEOUT:
                self._keep_in_flight()
                raise GPUTimeoutError(f"{dev.info.name}: the GPU did not finish within PAGEDVK_TIMEOUT="
                                    f"{timeout_ns() / 1e9:g} s; the work goes on, and later calls wait for it first")
            vk.vkResetFences(dev.handle, 1, [self.fence])
            self.pending = False
            dev._in_flight[:] = [f for f in dev._in_flight if f != self.fence]   # reset: nothing to wait for
            if self.query_pool is not None:
                self._elapsed.stamps = self._read_timestamps()

    def _keep_in_flight(self) -> None:
        if not any(f == self.fence for f in self.device._in_flight):
            self.device._in_flight.append(self.fence)

    def _read_timestamps(self) -> np.ndarray:
        data = vk.ffi.new(f"uint64_t[{self.queries}]")
        vk.vkGetQueryPoolResults(self.device.handle, self.query_pool, 0, self.queries, vk.ffi.sizeof(data), data,
                                 8, vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
        bits = self.device.timestamp_bits
        mask = (1 << bits) - 1 if bits < 64 else (1 << 64) - 1
        return np.array([((data[i] - data[0]) & mask) * self.device.timestamp_period_ns
                         for i in range(self.queries)])

    def timestamps_ns(self) -> np.ndarray:
        """This thread's last submission's timestamps, in ns from the first (read when it finished, so
        another thread's submission of the same command buffer does not change them)."""
        stamps = getattr(self._elapsed, "stamps", None)
        return self._read_timestamps() if stamps is None else stamps

    def elapsed_ns(self) -> float:
        """GPU time from the first to the last timestamp of this thread's last submission."""
        return float(self.timestamps_ns()[-1])

    def close(self) -> None:
        self._finalizer()
        self.handle = None


def _free_command_buffer(d, pool, handle, fence, query_pools) -> None:
    for query_pool in query_pools:
        vk.vkDestroyQueryPool(d, query_pool, None)
    vk.vkDestroyFence(d, fence, None)
    vk.vkFreeCommandBuffers(d, pool, 1, [handle])


def memory_barrier(cmd, src_stage, src_access, dst_stage, dst_access) -> None:
    barrier = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=src_access,
                                 dstAccessMask=dst_access)
    vk.vkCmdPipelineBarrier(cmd, src_stage, dst_stage, 0, 1, [barrier], 0, None, 0, None)
