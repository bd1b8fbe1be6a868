"""Device memory: buffers, memory types, heap budgets, the staging copies between host and device, and
the pagedvk error for a failed Vulkan call."""

from __future__ import annotations

import functools
import gc
import itertools
import os
from dataclasses import dataclass

import numpy as np
import vulkan as vk

from ..errors import DeviceLostError, OutOfMemoryError, VulkanError
from .owned import Owned, count_close

MEMORY_BUDGET_EXTENSION = "VK_EXT_memory_budget"
# Vulkan 1.2 buffer device addresses (the binding leaves these two constants None, so their values are here).
BUFFER_USAGE_SHADER_DEVICE_ADDRESS = 0x00020000
MEMORY_ALLOCATE_DEVICE_ADDRESS = 0x00000002
# Buffers at least this large get an allocation of their own (VkMemoryDedicatedAllocateInfo, core in
# Vulkan 1.1); None: only where the driver asks for it. See BENCHMARKS.md, "allocation history".
DEDICATED_MIN_BYTES: int | None = None
_buffer_uids = itertools.count()  # never reused, unlike id(): a key for what was recorded with a buffer


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


class Buffer(Owned):
    """A storage buffer in device memory. `nbytes` is what was asked for; at least 16 bytes are allocated
    because Vulkan has no empty buffers and kernels read in 16-byte chunks. Freed by close(), when garbage
    collected, or when its device closes, whichever comes first."""

    offset = 0   # where its bytes start in `handle`'s memory (a BufferRange starts further in)

    def __init__(self, device: "Device", nbytes: int, host_visible: bool = False, name: str | None = None):
        """name: what it holds (an array's shape and dtype, "staging"), which validation messages call it by."""
        self.device = device
        self.name = name
        self.uid = next(_buffer_uids)
        self.nbytes = nbytes
        self.size = max(16, (nbytes + 15) // 16 * 16)
        self.handle = self.memory = self.mapped = None
        # storage texel buffer too: a kernel may bind any array as one (abi.Binding.texels)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_STORAGE_TEXEL_BUFFER_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        addressable = device.buffer_device_address and not host_visible
        if addressable:   # kernels may reach it through its address (caches larger than one binding)
            usage |= BUFFER_USAGE_SHADER_DEVICE_ADDRESS
        # Made while no close() of the device can run (Device.creating): made on a device being destroyed, the
        # buffer aborted the process in vkCreateBuffer, vkAllocateMemory, vkBindBufferMemory or vkMapMemory.
        with device.creating() as d:
            heap = device.heap_of(host_visible)
            device.reserve(heap, self.size, nbytes)   # OutOfMemoryError before anything is made
            try:
                self.handle = vk.vkCreateBuffer(d, vk.VkBufferCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=self.size, usage=usage,
                    sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
                req = vk.vkGetBufferMemoryRequirements(d, self.handle)
                type_index, mappable = device.memory_type(req.memoryTypeBits, host_visible)
                type_heap = device.memory_properties.memoryTypes[type_index].heapIndex
                if req.size > device.memory_properties.memoryHeaps[type_heap].size:
                    # Asking Vulkan for more than the heap is invalid usage
                    # (VUID-vkAllocateMemory-pAllocateInfo-01713), not an error code: refuse it as out-of-memory.
                    vk.vkDestroyBuffer(d, self.handle, None)
                    self.handle = None
                    budget = device.memory_budget(type_heap)
                    raise OutOfMemoryError(f"allocating a buffer: {gib(nbytes)} ({nbytes} bytes) is more than the "
                                           f"whole memory heap; {budget}", nbytes, budget)
                chain = None
                if DEDICATED_MIN_BYTES is not None and self.size >= DEDICATED_MIN_BYTES:
                    chain = vk.VkMemoryDedicatedAllocateInfo(
                        sType=vk.VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO, buffer=self.handle)
                if addressable:
                    chain = vk.VkMemoryAllocateFlagsInfo(
                        sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO, flags=MEMORY_ALLOCATE_DEVICE_ADDRESS,
                        pNext=chain or vk.ffi.NULL)
                self.memory = vk.vkAllocateMemory(d, vk.VkMemoryAllocateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, pNext=chain or vk.ffi.NULL,
                    allocationSize=req.size, memoryTypeIndex=type_index), None)
                vk.vkBindBufferMemory(d, self.handle, self.memory, 0)
                if mappable:
                    self.mapped = vk.vkMapMemory(d, self.memory, 0, self.size, 0)
            except BaseException as e:
                _free_buffer(d, self.handle, self.memory)
                device.unreserve(heap, self.size)
                if isinstance(e, vk.VkError):
                    raise_vk(e, "allocating a buffer", nbytes, _budget_or_none(device, host_visible), device)
                raise
            self._finalizer = device.own(self, functools.partial(_free_reserved, device, heap, self.size, d,
                                                                 self.handle, self.memory))
            if device.debug_names:
                self.name = name or f"{nbytes}-byte {'host ' if host_visible else ''}buffer"
                device.set_name(vk.VK_OBJECT_TYPE_BUFFER, self.handle, self.name)

    def name_role(self, role: str) -> None:
        """Name it by the role it is bound in now (Launch: "k_cache of paged_decode.glsl.f16"), beside what it
        holds. Only with validation on (device.debug_names)."""
        self.device.set_name(vk.VK_OBJECT_TYPE_BUFFER, self.handle, f"{role}: {self.name}")

    def device_address(self) -> int:
        """The buffer's address, for kernels that read through buffer references (Vulkan 1.2)."""
        if not self.device.buffer_device_address:
            raise VulkanError(f"{self.device.info.name} has no bufferDeviceAddress feature")
        info = vk.ffi.new("VkBufferDeviceAddressInfo*", dict(sType=vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO,
                                                             buffer=self.handle))
        # Called raw: the binding's wrapper drops the returned address.
        return int(vk.lib.vkGetBufferDeviceAddress(self.device.handle, info))

    def _drop_handles(self) -> None:
        self.handle = self.memory = self.mapped = None


class BufferRange:
    """Bytes [offset, offset + nbytes) of a Buffer, accepted wherever a Buffer is: uploads, downloads, fills
    and copies add `offset`, a descriptor binds [offset, offset + size) and nothing of the rest. Tests lay an
    array and the sentinels guarding it out in one buffer this way, so a stray access past the array's
    binding would land in a sentinel. It keeps its buffer alive until closed; closing it frees nothing else.
    Like a Buffer's, `size` is nbytes rounded up to 16 bytes (kernels read in 16-byte chunks); with `clamp`, no
    further than the buffer's end (a DeviceArray view ending at its base's last byte)."""

    def __init__(self, buffer: Buffer, offset: int, nbytes: int, clamp: bool = False):
        size = max(16, (nbytes + 15) // 16 * 16)
        if clamp:   # a view's range (DeviceArray views): rounded up only as far as the buffer goes
            size = max(min(size, buffer.size - offset), nbytes)
        if offset % 4 or not 0 <= offset <= buffer.size - size:
            raise ValueError(f"offset must be a multiple of 4 in [0, {buffer.size - size}] for a {nbytes}-byte "
                             f"range of a {buffer.size}-byte buffer, got {offset}")
        self.buffer, self.device = buffer, buffer.device
        self.offset, self.nbytes, self.size = buffer.offset + offset, nbytes, size
        self.uid = next(_buffer_uids)   # its own: what was recorded with a range is not the buffer's

    @property
    def handle(self):
        return None if self.buffer is None else self.buffer.handle

    @property
    def mapped(self):
        return None if self.buffer is None else self.buffer.mapped

    @property
    def closed(self) -> bool:
        return self.buffer is None or self.buffer.closed

    def close(self) -> None:
        self.buffer = None
        count_close()   # launches binding it check their bindings again (Launch.submit)

    def device_address(self) -> int:
        return self.buffer.device_address() + self.offset - self.buffer.offset

    def name_role(self, role: str) -> None:
        self.buffer.name_role(role)   # a range has no handle of its own


class ForeignBuffer:
    """A caller's VkBuffer, bound by pagedvk's ops but never freed by it (DeviceArray.from_buffer): `size` bytes from
    its start, which the caller vouches for. close() only stops pagedvk from using it."""

    offset = 0
    mapped = None

    def __init__(self, device: "Device", handle, size: int):
        self.device, self.handle, self.size, self.nbytes = device, handle, size, size
        self.uid = next(_buffer_uids)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self.device.closed

    def close(self) -> None:
        self._closed = True
        count_close()   # launches binding it check their bindings again

    def device_address(self) -> int:
        raise ValueError("a caller's buffer has no device address pagedvk knows: pass it as one binding")

    def name_role(self, role: str) -> None:
        pass   # the caller names its own objects


def _budget_or_none(device, host_visible: bool) -> HeapBudget | None:
    try:   # the figure for the error message; never let it hide the error itself
        return device.memory_budget(device.heap_of(host_visible))
    except Exception:
        return None


def host_memory() -> int:
    """The host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_reserved(device, heap: int, size: int, d, handle, memory) -> None:
    """A buffer's destroy (run under the device lock): free it and give its bytes back to the heap's count."""
    _free_buffer(d, handle, memory)
    device.unreserve(heap, size)


def _free_buffer(d, handle, memory) -> None:
    # Freeing mapped memory unmaps it.
    if handle is not None:
        vk.vkDestroyBuffer(d, handle, None)
    if memory is not None:
        vk.vkFreeMemory(d, memory, None)


def record_copies(cmd, copies) -> None:
    """Record buffer-to-buffer copies: copies is [(src, dst, [(src_offset, dst_offset, nbytes), ...])], one
    vkCmdCopyBuffer each; offsets count from each buffer's own start (a BufferRange's offset is added). Regions
    of 0 bytes are left out."""
    for src, dst, regions in copies:
        regions = [r for r in regions if r[2]]   # a copy of 0 bytes is invalid (VUID-VkBufferCopy-size-01988)
        if regions:
            vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, len(regions), [
                vk.VkBufferCopy(srcOffset=src.offset + s, dstOffset=dst.offset + d, size=n) for s, d, n in regions])


class DeviceMemory:
    """The memory half of Device: which memory type and heap buffers come from, what a heap can still
    give, buffers, and copies between host and device (mapped where the memory is the host's, else through
    one staging buffer). Mixed into Device, whose lock, handle and properties it uses."""

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
        # Under the lock, on an open device: the exit hook destroys the instance (and with it this physical
        # device) only after closing every device, so a daemon thread still allocating at exit gets a
        # ClosedError here instead of querying a destroyed instance.
        with self.lock:
            self.require_open()
            vk.vkGetPhysicalDeviceMemoryProperties2(self.info.handle, vk.VkPhysicalDeviceMemoryProperties2(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2, pNext=budget))
        return HeapBudget(heap, size, budget.heapBudget[heap], budget.heapUsage[heap], MEMORY_BUDGET_EXTENSION)

    def room(self, heap: int) -> tuple:
        """(bytes the heap can still give, its HeapBudget): the driver's budget less its usage with
        VK_EXT_memory_budget, else the heap's size less what this device's buffers hold (reserve()). A CPU
        device's heap is the host's memory: lavapipe reports 2 GiB whatever the host has, and runs caches past
        it, so there the host's physical memory counts where it is larger."""
        budget = self.memory_budget(heap)
        if budget.usage is not None:
            return budget.budget - budget.usage, budget
        size = max(budget.size, host_memory()) if self.info.type == "cpu" else budget.size
        return size - self._reserved.get(heap, 0), budget

    def require_room(self, nbytes: int, heap: int | None = None, what: str = "allocating a buffer") -> None:
        """OutOfMemoryError unless the heap (default: device arrays') can still give nbytes. Memory held by
        objects that are garbage but not yet collected counts as free: a collection runs before refusing."""
        heap = self.heap_of() if heap is None else heap
        free, budget = self.room(heap)
        if nbytes > free:
            gc.collect()
            free, budget = self.room(heap)
        if nbytes > free:
            held = ("" if budget.usage is not None
                    else f"; this device's buffers hold {self._reserved.get(heap, 0)} bytes")
            if budget.usage is None and self.info.type == "cpu":
                held += f" of the heap or the host's {host_memory()} bytes of memory, whichever is larger"
            raise OutOfMemoryError(f"{what}: out of device memory: {gib(nbytes)} ({nbytes} bytes) is more than heap "
                                   f"{heap} can still give, {gib(max(free, 0))} ({max(free, 0)} bytes){held}; {budget}",
                                   nbytes, budget)

    def reserve(self, heap: int, size: int, nbytes: int) -> None:
        """Count `size` bytes against the heap, or raise OutOfMemoryError (naming nbytes, the size asked for)
        when it cannot give them: lavapipe and others accept allocations past their heap (forty 1 GiB arrays
        on a 2 GiB heap), which then fail, or take the host down, when used."""
        with self.lock:
            free, _ = self.room(heap)
            if size > free:
                self.require_room(size, heap)
            self._reserved[heap] = self._reserved.get(heap, 0) + size

    def unreserve(self, heap: int, size: int) -> None:
        """Give back `size` bytes reserve() counted against the heap (a buffer was freed).

        Parameters
        ----------
        heap : int
        size : int
        """
        with self.lock:
            self._reserved[heap] -= size

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

    def buffer(self, nbytes: int, name: str | None = None) -> Buffer:
        """A device-local storage buffer of nbytes (at least 16 bytes are allocated).

        Parameters
        ----------
        nbytes : int
        name : str, optional
            What it holds, for validation messages (see Buffer); None names nothing.

        Returns
        -------
        Buffer
        """
        self.require_open()
        return Buffer(self, nbytes, name=name)

    def host_buffer(self, nbytes: int, name: str | None = None) -> Buffer:
        """A host-visible buffer, mapped (`mapped`): a staging area of the caller's own, written and read
        with upload() and download(), which copy in place."""
        self.require_open()
        return Buffer(self, nbytes, host_visible=True, name=name)

    def _staging_buffer(self, nbytes: int) -> Buffer:
        # One staging buffer, grown as needed and reused; callers hold self.lock.
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self._staging.close()
            self._staging = Buffer(self, max(nbytes, 1 << 20), host_visible=True, name="staging")
        return self._staging

    def host_access(self) -> None:
        """Before the host reads or writes device memory: wait for the work every stream has queued, and for
        timed-out work, which may still use it. Callers hold `lock`."""
        self._settle(wait=True)
        self.synchronize()

    def upload(self, buf: Buffer | BufferRange, data: np.ndarray, offset: int = 0) -> None:
        """Copy host data into a buffer, in place where its memory is mapped, else through the staging buffer.

        Parameters
        ----------
        buf : Buffer or BufferRange
        data : numpy.ndarray
            Any dtype; its bytes are copied.
        offset : int, default 0
            Byte offset in buf.

        Raises
        ------
        ValueError
            The data does not fit from `offset`.
        """
        src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset + src.nbytes > buf.size:
            raise ValueError(f"upload of {src.nbytes} bytes at {offset} overflows a {buf.size}-byte buffer")
        if src.nbytes == 0:
            return
        with self.lock:
            self.require_open()
            self.host_access()
            if buf.mapped is not None:
                start = buf.offset + offset
                np.frombuffer(buf.mapped, np.uint8)[start:start + src.nbytes] = src
                return
            staging = self._staging_buffer(src.nbytes)
            np.frombuffer(staging.mapped, np.uint8)[:src.nbytes] = src
            self.copy_regions([(staging, buf, [(0, offset, src.nbytes)])], "upload")

    def download(self, buf: Buffer | BufferRange, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """The buffer's bytes as a new uint8 array.

        Parameters
        ----------
        buf : Buffer or BufferRange
        nbytes : int, optional
            Bytes to read; None means the rest of the buffer from `offset`.
        offset : int, default 0

        Returns
        -------
        numpy.ndarray, shape (nbytes,), uint8
        """
        nbytes = buf.nbytes - offset if nbytes is None else nbytes
        with self.lock:
            self.require_open()
            self.host_access()
            if buf.mapped is not None:
                start = buf.offset + offset
                return np.frombuffer(buf.mapped, np.uint8)[start:start + nbytes].copy()
            staging = self._staging_buffer(nbytes)
            if nbytes:
                self.copy_regions([(buf, staging, [(offset, 0, nbytes)])], "download")
            return np.frombuffer(staging.mapped, np.uint8)[:nbytes].copy()

    def copy(self, src: Buffer | BufferRange, dst: Buffer | BufferRange, nbytes: int, src_offset: int = 0,
             dst_offset: int = 0) -> None:
        """Copy nbytes from src (from src_offset) to dst (from dst_offset) on the device, and wait.

        Parameters
        ----------
        src, dst : Buffer or BufferRange
        nbytes, src_offset, dst_offset : int
        """
        self.copy_regions([(src, dst, [(src_offset, dst_offset, nbytes)])])

    def copy_regions(self, copies, name: str = "copies") -> None:
        """Many buffer-to-buffer copies in one submission: copies is [(src, dst, [(src_offset, dst_offset,
        nbytes), ...])], one vkCmdCopyBuffer each (regions of one copy must not overlap). Offsets count from
        each buffer's own start (a BufferRange's offset is added here)."""
        self.run_once(lambda cmd: record_copies(cmd, copies), name)

    def upload_regions(self, data: np.ndarray, targets) -> None:
        """Host bytes into many places of many buffers in one submission, through the reused staging buffer:
        targets is [(dst, [(offset in data, dst_offset, nbytes), ...])]."""
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if data.nbytes == 0:
            return
        with self.lock:
            self.require_open()
            self.host_access()
            if all(dst.mapped is not None for dst, _ in targets):   # in place, as upload() does
                for dst, regions in targets:
                    memory = np.frombuffer(dst.mapped, np.uint8)
                    for src_offset, dst_offset, nbytes in regions:
                        start = dst.offset + dst_offset
                        memory[start:start + nbytes] = data[src_offset:src_offset + nbytes]
                return
            staging = self._staging_buffer(data.nbytes)
            np.frombuffer(staging.mapped, np.uint8)[:data.nbytes] = data
            self.copy_regions([(staging, dst, regions) for dst, regions in targets], "upload")

    def download_regions(self, nbytes: int, sources) -> np.ndarray:
        """Many places of many buffers gathered into one new uint8 array of nbytes in one submission, through the
        reused staging buffer: sources is [(src, [(src_offset, offset in the result, nbytes), ...])]."""
        if nbytes == 0:
            return np.zeros(0, np.uint8)
        with self.lock:
            self.require_open()
            self.host_access()
            if all(src.mapped is not None for src, _ in sources):   # in place, as download() does
                out = np.empty(nbytes, np.uint8)
                for src, regions in sources:
                    memory = np.frombuffer(src.mapped, np.uint8)
                    for src_offset, offset, n in regions:
                        out[offset:offset + n] = memory[src.offset + src_offset:src.offset + src_offset + n]
                return out
            staging = self._staging_buffer(nbytes)
            self.copy_regions([(src, staging, regions) for src, regions in sources], "download")
            return np.frombuffer(staging.mapped, np.uint8)[:nbytes].copy()

    def fill(self, buf: Buffer | BufferRange, value: int = 0) -> None:
        """Set every 32-bit word of the buffer to `value`, and wait.

        Parameters
        ----------
        buf : Buffer or BufferRange
        value : int, default 0
        """
        self.run_once(lambda cmd: vk.vkCmdFillBuffer(cmd, buf.handle, buf.offset, buf.size, value), "fill")
