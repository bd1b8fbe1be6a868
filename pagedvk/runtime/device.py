"""A logical device: its compute queue, the features turned on, and ownership of everything made on it
(memory.py and commands.py hold its memory and command halves).

Knows nothing of attention. Every object it creates is destroyed by close(), which also runs at exit.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import vulkan as vk

from ..config import DEFAULT_TIMEOUT_S, compile_timeout_ns, timeout_ns
from ..errors import ClosedError, DeviceLostError, GPUTimeoutError, PagedVKError, VulkanError
from .commands import DeviceCommands
from .instance import (BFLOAT16_EXTENSION, COOPERATIVE_MATRIX_EXTENSION, Bfloat16Features, DeviceInfo, get_instance,
                       layer_knows_bfloat16, layer_knows_cooperative_matrix, query_features, register_closer)
from .memory import MEMORY_BUDGET_EXTENSION, DeviceMemory, raise_vk
from .owned import Owned, count_close

_serials = itertools.count(1)   # tells apart Device objects opened on one GPU
MAX_QUEUES = 4                  # compute queues asked for: the default stream's and three for Stream()s


class Device(DeviceMemory, DeviceCommands, Owned):
    """One Vulkan logical device with one compute queue, and owner of everything made on it.

    `pagedvk.get_device` and `pagedvk.default_device` open one and share it, one Device per physical device.
    Every object it creates is destroyed by close(), which also runs at exit.

    Thread-safe: `lock` serializes every use of the queue, the command pool and the descriptor pools (Vulkan
    requires that of the host), and each submission holds it until its fence is signalled. A submission whose
    wait timed out (PAGEDVK_TIMEOUT) is still running: it stays in `_in_flight`, and until it finishes, objects
    dropped meanwhile are destroyed later rather than under it, and every later submission or host copy first
    waits for it.

    Parameters
    ----------
    info : DeviceInfo
        The physical device to open.

    Attributes
    ----------
    info : DeviceInfo
    features : set of str
        The Vulkan features turned on, by their Vulkan names ("shaderFloat16", "cooperativeMatrix", ...).
    cooperative_matrix, bfloat16_matrix, buffer_device_address, unified_memory : bool
    lost : str or None
        The message of the VK_ERROR_DEVICE_LOST that ended this device, if one did.

    Raises
    ------
    VulkanError
        The device has no compute queue, or the logical device could not be created.
    """

    def __init__(self, info: DeviceInfo) -> None:
        self._begin(info)
        family_queues = self._choose_family(info)
        self._create(info, family_queues)
        self._finish_open(info)

    @classmethod
    def from_handles(cls, physical_device, device, queue_family_index: int, queue_index: int = 0, *,
                     features=(), instance=None) -> "Device":
        """Run pagedvk on a Vulkan device the caller made (llama.cpp-style engines, game engines, Kompute users).

        pagedvk makes its own command pool, descriptor pools, pipelines and buffers on it and destroys them at
        close(), but never the device itself. Its work goes to the one queue given: the caller must not submit to that
        queue from another thread while pagedvk may (Vulkan requires queues to be externally synchronized); give it a
        queue of its own where the family has one. `pagedvk.Stream()`s on it share that queue.

        Parameters
        ----------
        physical_device, device : VkPhysicalDevice, VkDevice
            The `vulkan` package's handles, or their addresses as ints (a C or C++ caller's).
        queue_family_index, queue_index : int
            The queue pagedvk submits to; its family must support compute.
        features : iterable of str
            The Vulkan features (their Vulkan names: "shaderFloat16", "storageBuffer16BitAccess",
            "storageBuffer8BitAccess", "shaderInt8", "shaderInt16", "shaderInt64", "bufferDeviceAddress",
            "vulkanMemoryModel", "cooperativeMatrix", ...) and extensions the device was created with. Kernels that
            need one not listed are not used (the others are chosen, or the op is refused by name).
        instance : VkInstance, optional
            The instance the physical device came from, for the queries that go through it (the cooperative-matrix
            shapes it lists); None leaves the matrix kernels out.

        Returns
        -------
        Device
            Not shared through `get_device`: pass it as `device=` to plans, arrays and caches.
        """
        pd, handle = _handle("VkPhysicalDevice", physical_device), _handle("VkDevice", device)
        from .instance import describe
        self = cls.__new__(cls)
        info = describe(-1, pd, None if instance is None else _handle("VkInstance", instance))
        self._begin(info)
        families = list(vk.vkGetPhysicalDeviceQueueFamilyProperties(pd))
        if not 0 <= queue_family_index < len(families):
            raise ValueError(f"queue_family_index must be in [0, {len(families)}), got {queue_family_index}")
        family = families[queue_family_index]
        if not family.queueFlags & vk.VK_QUEUE_COMPUTE_BIT:
            raise ValueError(f"queue family {queue_family_index} of {info.name} has no compute queues")
        if not 0 <= queue_index < family.queueCount:
            raise ValueError(f"queue_index must be in [0, {family.queueCount}) for family {queue_family_index}, got "
                             f"{queue_index}")
        self.queue_family, self.timestamp_bits = queue_family_index, int(family.timestampValidBits)
        self.timestamp_period_ns = vk.vkGetPhysicalDeviceProperties(pd).limits.timestampPeriod
        self.features = frozenset(features)
        self.buffer_device_address = "bufferDeviceAddress" in self.features and "shaderInt64" in self.features
        self.cooperative_matrix = "cooperativeMatrix" in self.features and "vulkanMemoryModel" in self.features
        self.bfloat16_matrix = self.cooperative_matrix and "shaderBFloat16CooperativeMatrix" in self.features
        self.has_memory_budget = MEMORY_BUDGET_EXTENSION in self.features
        self.owns_handle = False
        self.handle = handle
        self.queues = [vk.vkGetDeviceQueue(handle, queue_family_index, queue_index)]
        self._finish_open(info, debug_names=False)
        return self

    def _begin(self, info: DeviceInfo) -> None:
        """The bookkeeping every Device starts with."""
        self.info = info
        self.name = info.name
        self.serial = next(_serials)
        self.instance = get_instance()
        self.lock = threading.RLock()
        # Threads creating objects outside the lock (creating()); close() waits for them to finish.
        self._creators, self._closing = 0, False
        self._idle = threading.Condition(self.lock)
        self._live = {}  # key -> (weakref.finalize, destroy) of one object made on this device
        self._keys = itertools.count()
        self._in_flight = []   # fences of timed-out submissions that may still be running
        # (ticket, destroy) of objects released while work queued up to that ticket, or timed-out work, may still
        # use them: destroyed once it has finished (run_deferred)
        self._deferred = []
        self._reserved = {}    # heap -> bytes its live buffers hold (DeviceMemory.reserve)
        self.abandoned = False  # closed with work still running: its objects were left, not destroyed
        self.lost = None       # the message of the VK_ERROR_DEVICE_LOST that ended this device, if one did
        self.handle = None
        self.owns_handle = True   # False for a caller's device (from_handles): close() leaves it

    def _choose_family(self, info: DeviceInfo) -> int:
        """The compute queue family to open; its queue count."""
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
        # Read now: the binding's struct array may be freed once `families` is the only reference left.
        family_queues = int(families[self.queue_family].queueCount)
        self.timestamp_period_ns = vk.vkGetPhysicalDeviceProperties(pd).limits.timestampPeriod
        return family_queues

    def _create(self, info: DeviceInfo, family_queues: int) -> None:
        """Create the logical device with the optional features the kernels may use, and its queues."""
        pd = info.handle
        # Turn on the optional features the kernels may use, where the device has them.
        coop = None
        # Cooperative matrices only where the device lists multiplies (the extension is there), and not under a
        # validation layer that predates the extension (instance.MATRIX_AWARE_LAYER).
        layer_allows = not self.instance.validation or layer_knows_cooperative_matrix(self.instance.layer_version)
        bf16 = None   # VK_KHR_shader_bfloat16's features, asked for beside the matrices' (the layer permitting)
        if info.matrix_shapes and layer_allows:
            if BFLOAT16_EXTENSION in info.extensions and (
                    not self.instance.validation or layer_knows_bfloat16(self.instance.layer_version)):
                bf16 = Bfloat16Features()
            coop = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
                pNext=bf16.pointer if bf16 else vk.ffi.NULL)
        have11, have12 = query_features(pd, chain=coop)
        base = vk.vkGetPhysicalDeviceFeatures(pd)
        # Buffer device addresses (with 64-bit integers) let GLSL kernels read caches larger than one binding.
        self.buffer_device_address = bool(have12.bufferDeviceAddress and base.shaderInt64)
        # Cooperative matrices (the prefill's matrix kernel), turned on only with their extension, and with them
        # the Vulkan memory model their SPIR-V declares: only then, since with the model on, the other kernels'
        # Device-scope atomics need vulkanMemoryModelDeviceScope too (VUID-RuntimeSpirv-vulkanMemoryModel-06265).
        self.cooperative_matrix = bool(coop is not None and coop.cooperativeMatrix and have12.vulkanMemoryModel
                                       and have12.vulkanMemoryModelDeviceScope)
        # bfloat16 matrices (the bfloat16 matrix modules, abi.BFLOAT16_MATRIX_FEATURES): with the matrices only
        self.bfloat16_matrix = bool(self.cooperative_matrix and bf16 is not None and bf16.type and bf16.matrix)
        self._bf16_features = Bfloat16Features(type_=True, matrix=True) if self.bfloat16_matrix else None
        self._coop_features = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
            pNext=self._bf16_features.pointer if self._bf16_features else vk.ffi.NULL,
            cooperativeMatrix=True) if self.cooperative_matrix else None
        memory_model = self.cooperative_matrix
        f12 = vk.VkPhysicalDeviceVulkan12Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, pNext=self._coop_features,
            shaderFloat16=have12.shaderFloat16, shaderInt8=have12.shaderInt8,
            storageBuffer8BitAccess=have12.storageBuffer8BitAccess,
            bufferDeviceAddress=self.buffer_device_address, vulkanMemoryModel=memory_model,
            vulkanMemoryModelDeviceScope=memory_model)
        f11 = vk.VkPhysicalDeviceVulkan11Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, pNext=f12,
            storageBuffer16BitAccess=have11.storageBuffer16BitAccess)
        features = vk.VkPhysicalDeviceFeatures(shaderInt16=base.shaderInt16, shaderInt64=base.shaderInt64)
        # What was enabled, by Vulkan's feature names: kernels that need one check it (pagedvk.kernels.modules).
        self.features = {name for name, on in (
            ("shaderInt16", base.shaderInt16), ("shaderInt64", base.shaderInt64),
            ("shaderFloat16", have12.shaderFloat16), ("shaderInt8", have12.shaderInt8),
            ("storageBuffer8BitAccess", have12.storageBuffer8BitAccess),
            ("storageBuffer16BitAccess", have11.storageBuffer16BitAccess),
            ("bufferDeviceAddress", self.buffer_device_address), ("vulkanMemoryModel", memory_model),
            ("cooperativeMatrix", self.cooperative_matrix), ("shaderBFloat16Type", self.bfloat16_matrix),
            ("shaderBFloat16CooperativeMatrix", self.bfloat16_matrix)) if on}
        # VK_EXT_memory_budget: what each heap can still give, for out-of-memory errors (memory_budget()).
        extensions = [e for e in ("VK_KHR_portability_subset", MEMORY_BUDGET_EXTENSION) if e in info.extensions]
        extensions += [COOPERATIVE_MATRIX_EXTENSION] if self.cooperative_matrix else []
        extensions += [BFLOAT16_EXTENSION] if self.bfloat16_matrix else []
        self.has_memory_budget = MEMORY_BUDGET_EXTENSION in extensions
        # Queues for streams (pagedvk.runtime.stream): the first is the default stream's, the others go to
        # Stream()s in turn, so that their work runs beside it.
        queue_count = max(1, min(family_queues, MAX_QUEUES))
        queue_info = vk.VkDeviceQueueCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=self.queue_family,
            queueCount=queue_count, pQueuePriorities=[1.0] * queue_count)
        try:
            self.handle = vk.vkCreateDevice(pd, vk.VkDeviceCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=f11, queueCreateInfoCount=1,
                pQueueCreateInfos=[queue_info], enabledExtensionCount=len(extensions),
                ppEnabledExtensionNames=extensions, pEnabledFeatures=features), None)
        except vk.VkError as e:
            raise_vk(e, f"creating a logical device on {info.name}")
        self.queues = [vk.vkGetDeviceQueue(self.handle, self.queue_family, i) for i in range(queue_count)]

    def _finish_open(self, info: DeviceInfo, debug_names: bool | None = None) -> None:
        """What every Device makes on its VkDevice: streams' bookkeeping, the command pool, the pipeline cache."""
        pd = info.handle
        self.queue = self.queues[0]
        self._streams = weakref.WeakSet()   # every Stream made on it (synchronize() waits for each)
        self._default_stream = None
        self._next_queue = itertools.count()
        self._tickets = 0   # submissions queued on streams so far (Stream.enqueue numbers them)
        # With validation on, objects carry debug-utils names (set_name), so that a message names what it is about.
        # Without it nothing is named: callers test `debug_names` first and build no name.
        self.debug_names = self.instance.validation if debug_names is None else debug_names
        # vkSetDebugUtilsObjectNameEXT, looked up only with validation on (set_name calls it); None without.
        self.object_namer = (vk.vkGetInstanceProcAddr(self.instance.handle, "vkSetDebugUtilsObjectNameEXT")
                                 if self.debug_names else None)
        self.memory_properties = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        self.command_pool = vk.vkCreateCommandPool(self.handle, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.queue_family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.pipeline_cache = vk.vkCreatePipelineCache(self.handle, vk.VkPipelineCacheCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO), None)
        self._descriptor_pools = []
        self._staging = None
        self.pipelines = {}   # pagedvk.kernels.modules.pipeline's, by its cache key: made once, closed with the device
        # Where device memory is the host's (CPU drivers, integrated GPUs), buffers are mapped directly
        # and need no staging copy.
        self.unified_memory = info.type in ("cpu", "integrated")
        register_closer(self.close)
        self.check()

    # -- bookkeeping ---------------------------------------------------------------------------------

    @contextmanager
    def creating(self) -> Iterator:
        """Make Vulkan objects on this device without holding its lock (a pipeline may compile for seconds).

        A context manager yielding the VkDevice handle: ClosedError if the device is closed, and close() waits until
        the block is left, so nothing is made on a device being destroyed (that aborted the process in the driver).
        """
        with self.lock:
            self.require_open()
            self._creators += 1
        try:
            yield self.handle
        finally:
            with self.lock:
                self._creators -= 1
                if not self._creators:
                    self._idle.notify_all()

    def own(self, obj: object, destroy: Callable[[], None]) -> weakref.finalize:
        """Tie destroy() to obj: it runs once, at the first of the finalizer being called, obj being collected, or
        this device closing.

        Parameters
        ----------
        obj : object
            The Python object whose lifetime the Vulkan object follows (obj.close() calls the returned finalizer).
        destroy : callable
            Destroys the Vulkan object; must not refer to obj.

        Returns
        -------
        weakref.finalize
        """
        key = next(self._keys)
        finalizer = weakref.finalize(obj, self._release, key, destroy)
        finalizer.atexit = False  # the device's own close at exit runs it, before the device goes
        with self.lock:
            self._live[key] = (finalizer, destroy)
        return finalizer

    def _release(self, key, destroy) -> None:
        with self.lock:
            count_close()   # first: a launch binding this buffer checks its bindings again (Launch.submit)
            if self._live.pop(key, None) is None or self.handle is None:
                return   # close() destroyed it already
            if (self._in_flight and not self._settle(wait=False)) or self._queued_work():
                self._deferred.append((self._tickets, destroy))   # queued or timed-out work may still use it
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
                self._run_all_deferred()
                try:
                    raise_vk(e, "waiting for earlier work", device=self)
                except DeviceLostError:
                    if wait:
                        raise
                    return True
            self._in_flight.clear()
        self._run_deferred()
        return True

    # What a command buffer (pagedvk.runtime.commands) tells its device about its submissions. Callers hold self.lock.

    def settle_timed_out(self) -> None:
        """Before a submission: wait for the submissions whose wait timed out and run the destroys they held back, so
        that their work goes first, as it did on the queue. Callers hold `lock`.
        """
        if self._in_flight or self._deferred:
            self._settle(wait=True)

    def keep_in_flight(self, fence) -> None:
        """Record that a submission whose wait timed out or failed may still run: nothing is destroyed under it until
        its fence signals. Callers hold `lock`.

        Parameters
        ----------
        fence : VkFence
        """
        if not any(f == fence for f in self._in_flight):
            self._in_flight.append(fence)

    def finished(self, fence) -> None:
        """Record that a submission's fence was waited on and reset: nothing of it is left to wait for. Callers hold
        `lock`.

        Parameters
        ----------
        fence : VkFence
        """
        if self._in_flight:
            self._in_flight[:] = [f for f in self._in_flight if f != fence]

    def _run_deferred(self) -> None:
        """Destroy what was released under work that has now all finished. Callers hold `lock`."""
        if not self._deferred or self._in_flight:
            return
        first = self._first_pending()
        ready = [d for t, d in self._deferred if first is None or t < first]
        if ready:
            self._deferred = [(t, d) for t, d in self._deferred if not (first is None or t < first)]
            for destroy in ready:
                destroy()

    run_deferred = _run_deferred

    def _run_all_deferred(self) -> None:
        """Destroy everything held back (the device is lost, or every submission was waited for)."""
        deferred, self._deferred = self._deferred, []
        for _, destroy in deferred:
            destroy()

    # -- streams (pagedvk.runtime.stream) -------------------------------------------------------------

    def stream_queue(self):
        """A queue for a new Stream: the device's queues after the first in turn, or the first where it has one."""
        if len(self.queues) == 1:
            return self.queue
        return self.queues[1 + next(self._next_queue) % (len(self.queues) - 1)]

    def add_stream(self, stream) -> None:
        with self.lock:
            self.require_open()
            self._streams.add(stream)

    def next_ticket(self) -> int:
        """Number a submission queued on a stream (callers hold `lock`)."""
        self._tickets += 1
        return self._tickets

    def _first_pending(self) -> int | None:
        """The lowest ticket of queued work not yet seen finished (after retiring what has), or None."""
        firsts = [t for t in (stream.first_pending for stream in list(self._streams)) if t is not None]
        return min(firsts) if firsts else None

    def _queued_work(self) -> bool:
        return self._tickets > 0 and self._first_pending() is not None

    def synchronize(self, timeout: int | None = None) -> None:
        """Wait for the work queued on every stream of this device (each op at most `timeout` ns, default
        PAGEDVK_TIMEOUT).

        Raises
        ------
        GPUTimeoutError, DeviceLostError
            Naming the op that did not finish or faulted.
        """
        with self.lock:
            if self.handle is None:
                return
            for stream in list(self._streams):
                stream.synchronize(timeout)
            self._run_deferred()

    @property
    def closed(self) -> bool:
        """Whether close() has destroyed the device."""
        return self.handle is None

    def __repr__(self) -> str:
        state = ", closed" if self.handle is None else ", lost" if self.lost is not None else ""
        return f"Device({self.name!r}, index={self.info.index}, serial={self.serial}{state})"

    def set_name(self, object_type: int, handle, name: str) -> None:
        """Give a Vulkan object the name validation messages call it by (vkSetDebugUtilsObjectNameEXT).

        Only with validation on: callers test `debug_names` first.

        Parameters
        ----------
        object_type : int
            VK_OBJECT_TYPE_*.
        handle
            The object's handle.
        name : str
        """
        # void vkSetDebugUtilsObjectNameEXT(VkDevice, const VkDebugUtilsObjectNameInfoEXT*)
        self.object_namer(self.handle, vk.VkDebugUtilsObjectNameInfoEXT(
            sType=vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_OBJECT_NAME_INFO_EXT, objectType=object_type,
            objectHandle=int(vk.ffi.cast("uint64_t", handle)), pObjectName=name))

    def require_open(self) -> None:
        """Raise unless the device can be used.

        Raises
        ------
        ClosedError
            The device is closed (or closing).
        DeviceLostError
            The device was lost earlier.
        """
        if self.handle is None or self._closing:
            raise ClosedError(f"device {self.info.name} is closed")
        if self.lost is not None:
            raise DeviceLostError(f"device {self.info.name} was lost earlier: {self.lost}")

    def check(self) -> None:
        """Raise any validation message the calls so far produced.

        Raises
        ------
        ValidationError
            With PAGEDVK_VALIDATION=1, the layer reported something.
        """
        self.instance.raise_validation_messages()

    def live_objects(self) -> int:
        """How many Vulkan objects made through this device are alive (buffers, pipelines, ...).

        Those dropped while a timed-out submission still runs count too: they are destroyed once it finishes.

        Returns
        -------
        int
        """
        with self.lock:
            if self._in_flight and self.handle is not None:
                self._settle(wait=False)
            return len(self._live) + len(self._deferred)

    def close(self) -> None:
        """Destroy everything made on this device. Safe to call twice.

        Objects still being made in other threads are waited for; timed-out submissions are waited for up to
        PAGEDVK_TIMEOUT, never without a limit.

        Raises
        ------
        GPUTimeoutError
            Timed-out work still runs: nothing is destroyed under it (the objects are left to the process's end), the
            device being closed all the same.
        PagedVKError
            Objects were still being made after PAGEDVK_COMPILE_TIMEOUT; the device stays open.
        """
        with self.lock:
            self._idle.wait_for(lambda: not self._closing)   # another thread's close() finishes first
            if self.handle is None:
                return
            self._closing = True
            try:
                if not self._idle.wait_for(lambda: not self._creators, timeout=_seconds(compile_timeout_ns)):
                    raise PagedVKError(f"{self.info.name}: objects were still being made after "
                                       "PAGEDVK_COMPILE_TIMEOUT; the device stays open")
                self._destroy()
            finally:
                self._closing = False
                self._idle.notify_all()

    def _destroy(self) -> None:
        """close()'s work, under the lock with no object being made."""
        running = self._wait_in_flight()
        handle, self.handle = self.handle, None
        live, self._live = self._live, {}
        for finalizer, _ in live.values():
            finalizer.detach()   # closed now: `closed` is true, and nothing runs it again
        if running:
            self.abandoned = True   # the instance must outlive it too (its atexit shutdown)
            raise GPUTimeoutError(f"{self.info.name}: work whose wait timed out still runs after another "
                                  f"PAGEDVK_TIMEOUT={_seconds(timeout_ns):g} s; the device is closed and its "
                                  "objects are left to the end of the process, not destroyed under it")
        # Destroyed here, not through the finalizers: at interpreter exit Python's weakref.finalize hook may
        # have run first, after which calling a finalizer does nothing (VUID-vkDestroyDevice-device-00378).
        self._run_all_deferred()
        for _, destroy in live.values():
            destroy()
        for pool in self._descriptor_pools:
            vk.vkDestroyDescriptorPool(handle, pool, None)
        self._descriptor_pools.clear()
        vk.vkDestroyPipelineCache(handle, self.pipeline_cache, None)
        vk.vkDestroyCommandPool(handle, self.command_pool, None)
        if self.owns_handle:
            vk.vkDestroyDevice(handle, None)

    def _wait_in_flight(self) -> bool:
        """Wait up to PAGEDVK_TIMEOUT for the submissions whose wait timed out (every other submission finished
        under the lock close() holds). Whether some still run. Never vkDeviceWaitIdle: it has no limit."""
        for stream in list(self._streams):   # queued ops not submitted yet: they go, as a wait would send them
            try:
                stream.flush()
            except PagedVKError:
                pass   # refused by the queue: nothing of them runs (flush forgets them)
        queued = [s.command_buffer.carrier.fence for stream in list(self._streams) for s in stream._pending
                  if not s.done_elsewhere]
        fences = list(self._in_flight) + queued
        if not fences:
            return False
        try:
            vk.vkWaitForFences(self.handle, len(fences), fences, vk.VK_TRUE, _ns(timeout_ns))
        except vk.VkTimeout:
            return True
        except vk.VkError:
            pass   # a lost device runs nothing: destroying its objects is allowed
        self._in_flight.clear()
        for stream in list(self._streams):
            stream._pending.clear()
        return False


def _ns(setting) -> int:
    """A PAGEDVK_* wait in ns; its default where the variable went bad after start-up (close must not fail on it)."""
    try:
        return setting()
    except ValueError:
        return int(DEFAULT_TIMEOUT_S * 1e9)


def _seconds(setting) -> float:
    return _ns(setting) / 1e9


def _handle(kind: str, handle):
    """A Vulkan handle of `kind` from the `vulkan` package's cdata or an int address."""
    if isinstance(handle, int) and not isinstance(handle, bool):
        return vk.ffi.cast(kind, handle)
    if isinstance(handle, vk.ffi.CData):
        return handle
    raise TypeError(f"a {kind} must be the vulkan package's handle or an int, got {type(handle).__name__}")
