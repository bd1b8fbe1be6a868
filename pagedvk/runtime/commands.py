"""Commands: command buffers (recorded once, submitted any number of times, each with its fence),
barriers, GPU timestamps, and the descriptor sets launches bind."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

import vulkan as vk

from ..config import spin_ns, timeout_ns
from ..errors import ClosedError, GPUTimeoutError
from .memory import raise_vk
from .owned import Owned

DESCRIPTORS_PER_POOL = 4096

# The binding's raw cffi entry points for the per-submission calls: its wrappers convert every list
# argument into a new cffi array (microseconds each), while a CommandBuffer keeps its own arrays. They
# return the VkResult; call them through this module's names (tests put simulated drivers there).
# VkResult vkQueueSubmit(VkQueue, uint32_t submitCount, const VkSubmitInfo*, VkFence)
queue_submit = vk.lib.vkQueueSubmit
# VkResult vkWaitForFences(VkDevice, uint32_t fenceCount, const VkFence*, VkBool32 waitAll, uint64_t timeout)
wait_for_fences = vk.lib.vkWaitForFences
# VkResult vkResetFences(VkDevice, uint32_t fenceCount, const VkFence*)
reset_fences = vk.lib.vkResetFences
# VkResult vkGetFenceStatus(VkDevice, VkFence)
get_fence_status = vk.lib.vkGetFenceStatus


# The binding (vulkan 1.3.275) gives a few extension error codes a positive value, VK_ERROR_OUT_OF_POOL_MEMORY among
# them (1000069000 for -1000069000), so that a driver's real code raised KeyError from its wrappers, not the error:
# a descriptor pool filling up (a model's recorded steps on the H100) crashed instead of opening the next pool.
for _code, _error in list(vk.exception_codes.items()):
    if isinstance(_code, int) and _code > 0 and _error.__name__.startswith("VkError"):
        vk.exception_codes.setdefault(-_code, _error)


def vk_error(result: int) -> Exception:
    """The binding's exception for a VkResult error code (what its wrappers raise)."""
    return vk.exception_codes.get(result, vk.VkError)()


class DeviceCommands:
    """The command half of Device: command buffers and descriptor sets from its pools, which Vulkan
    requires the host to serialize (all under device.lock). Mixed into Device."""

    def command_buffer(self, name: str = "commands") -> "CommandBuffer":
        """name: what it runs (an op, "upload"), which validation messages call it by."""
        self.require_open()
        return CommandBuffer(self, name)

    def run_once(self, record, name: str = "commands") -> None:
        """Record `record(cmd)` into a fresh command buffer (named `name`), submit it and wait: after the work
        every stream has queued (submit's wait), as host copies and fills must be."""
        cmd = self.command_buffer(name)
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
            sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                             descriptorCount=DESCRIPTORS_PER_POOL),
                     vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER,   # Binding.texels
                                             descriptorCount=DESCRIPTORS_PER_POOL // 4)]
            pool = vk.vkCreateDescriptorPool(self.handle, vk.VkDescriptorPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
                maxSets=DESCRIPTORS_PER_POOL // 4, poolSizeCount=len(sizes), pPoolSizes=sizes), None)
            self._descriptor_pools.append(pool)
            return self._allocate_set(pool, layout), pool

    def _allocate_set(self, pool, layout):
        return vk.vkAllocateDescriptorSets(self.handle, vk.VkDescriptorSetAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=pool,
            descriptorSetCount=1, pSetLayouts=[layout]))[0]


class CommandBuffer(Owned):
    """A primary command buffer with its own fence, recorded once and submitted any number of times.

    Allocating, recording and freeing it use the device's command pool, which Vulkan requires the host to
    serialize: all three hold device.lock. A submission holds it until its fence is signalled, so two
    threads submitting one command buffer (a DecodePlan's cached launch) take turns."""

    def __init__(self, device: Device, name: str = "commands"):
        self.device, self.name = device, name
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
        # What every submission passes, made once (see queue_submit).
        self._handles = vk.ffi.new("VkCommandBuffer[1]", [self.handle])
        self._submit_info = vk.ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                          "commandBufferCount": 1, "pCommandBuffers": self._handles})
        self._fences = vk.ffi.new("VkFence[1]", [self.fence])
        self.pending = False    # submitted, and its fence not yet seen signalled and reset
        # A stream submits several queued command buffers at once (Stream.flush) with the last one's fence: the
        # others' `carrier` is that one, which lists them as `riders` and marks them finished with itself.
        self.carrier, self.riders = self, []
        self.batched = None     # the Stream whose unsubmitted batch holds it (submitted at its next flush)
        self.ticket = 0         # the device's number for its latest submission (pagedvk.runtime.stream)
        self.query_pool, self.queries = None, 0
        self._query_pools = []  # the finalizer's view of the query pools made by timed records
        self._elapsed = threading.local()  # each submitting thread's own timestamps (timestamps_ns)
        self._finalizer = device.own(self, functools.partial(
            _free_command_buffer, d, device.command_pool, self.handle, self.fence, self._query_pools))
        if device.debug_names:
            device.set_name(vk.VK_OBJECT_TYPE_COMMAND_BUFFER, self.handle, name)

    def _require_idle(self) -> None:
        """Open, and not still running an earlier submission. Callers hold device.lock."""
        self.device.require_open()
        if self.closed:
            raise ClosedError("the command buffer is closed")
        if self.pending or self.batched is not None:
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

    def submit(self, wait: bool = True, timeout: int | None = None, queue=None) -> None:
        """Submit to `queue` (default: the device's first); with wait, first wait for the work every stream has
        queued, then for this, at most `timeout` ns (default PAGEDVK_TIMEOUT). Without wait, the caller tracks it
        (pagedvk.runtime.stream.Stream)."""
        dev = self.device
        # A bad PAGEDVK_TIMEOUT or PAGEDVK_SPIN_US is refused before anything is submitted: raised by the wait,
        # it left the work running untracked, and freeing its command buffer segfaulted.
        if wait:   # a queued submission's waits read them when they come (and handle a bad value then)
            timeout = timeout_ns() if timeout is None else timeout
            spin = spin_ns(dev.info.type == "cpu")
        with dev.lock:
            self._require_idle()
            dev.settle_timed_out()
            if wait:
                dev.synchronize(timeout)   # what it reads may come from another stream's queue
            result = queue_submit(dev.queue if queue is None else queue, 1, self._submit_info, self.fence)
            if result != vk.VK_SUCCESS:
                raise_vk(vk_error(result), f"submitting {self.name} (vkQueueSubmit)", device=dev)
            self.pending = True
            if wait:
                self.wait(timeout, spin)
        dev.check()

    def _spin(self, ns: int) -> None:
        """Poll the fence for at most ns: the blocking wait that follows then returns at once if it has
        signalled (or reports what polling found, a lost device included)."""
        if ns <= 0:
            return
        deadline = time.perf_counter_ns() + ns
        handle, fence = self.device.handle, self.fence
        while get_fence_status(handle, fence) == vk.VK_NOT_READY and time.perf_counter_ns() < deadline:
            pass

    def wait(self, timeout: int | None = None, spin: int | None = None) -> None:
        """Wait for the last submission, at most PAGEDVK_TIMEOUT seconds; GPUTimeoutError past that (the
        submission then stays pending: nothing it uses is freed or reused until it has finished)."""
        dev = self.device
        with dev.lock:
            if self.batched is not None:
                self.batched.flush()   # queued on a stream, not submitted yet: it goes now
            if self.carrier is not self:
                return self.carrier.wait(timeout, spin)   # submitted with others: the last one's fence tells
            if not self.pending:
                return
            try:
                timeout = timeout_ns() if timeout is None else timeout
                spin = spin_ns(dev.info.type == "cpu") if spin is None else spin
            except ValueError:
                self._keep_in_flight()   # a variable gone bad: the work is still tracked, freed only once done
                raise
            self._spin(min(spin, timeout))
            result = wait_for_fences(dev.handle, 1, self._fences, vk.VK_TRUE, timeout)
            if result == vk.VK_TIMEOUT:
                self._keep_in_flight()
                raise GPUTimeoutError(f"{dev.info.name}: the GPU did not finish {self.name} within PAGEDVK_TIMEOUT="
                                    f"{timeout / 1e9:g} s; the work goes on, and later calls wait for it first")
            if result != vk.VK_SUCCESS:
                self._keep_in_flight()   # it may still run: free nothing under it
                raise_vk(vk_error(result), f"waiting for {self.name} (vkWaitForFences)", device=dev)
            self.finish()

    def finish(self) -> None:
        """Its submission was seen finished (its fence signalled): reset the fence for the next one. Callers hold
        device.lock."""
        result = reset_fences(self.device.handle, 1, self._fences)
        if result != vk.VK_SUCCESS:   # still pending: the next use waits on the signalled fence again
            raise_vk(vk_error(result), "vkResetFences", device=self.device)
        self.device.finished(self.fence)
        for cb in (*self.riders, self):
            cb.pending, cb.carrier = False, cb
            if cb.query_pool is not None:
                cb._elapsed.stamps = cb._read_timestamps()
        self.riders = []

    def _keep_in_flight(self) -> None:
        self.device.keep_in_flight(self.fence)

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

    def _drop_handles(self) -> None:
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
