"""Compute pipelines built from a SPIR-V module and its declared interface (pagedvk.kernels.abi.KernelABI)."""

from __future__ import annotations

import functools
import weakref

import numpy as np
import vulkan as vk

from ..config import compile_timeout_ns
from ..errors import ClosedError
from .commands import memory_barrier
from .device import Device
from .memory import raise_vk, record_copies
from .owned import Owned, closes
from .stream import check_stream

STAGE = vk.VK_SHADER_STAGE_COMPUTE_BIT


def fold_grid(workgroups: int, limits: tuple) -> tuple:
    """A grid of at least `workgroups` workgroups within the device's per-dimension limits
    (maxComputeWorkGroupCount), filled x first. Kernels number their workgroups linearly
    (attention_common.glsl's workgroup_index()) and return from those past the count, so any launch size
    runs: one rule for every op."""
    if workgroups < 1:
        return (0, 0, 0)
    x = min(workgroups, limits[0])
    y = min(-(-workgroups // x), limits[1])
    z = -(-workgroups // (x * y))
    if z > limits[2]:
        raise ValueError(f"{workgroups} workgroups exceed the device's grid of {limits[0]} x {limits[1]} x {limits[2]}")
    return (x, y, z)


class Pipeline(Owned):
    """A compute pipeline, its descriptor-set layout (one storage buffer per declared binding, or a storage texel
    buffer of 16-byte texels where the binding says `texels`) and its pipeline layout (one push-constant range of
    the declared size)."""

    def __init__(self, device: Device, abi, spirv: bytes, name: str, bindings: tuple | None = None,
                 specialization: dict | None = None):
        """specialization: {constant id: bool or 32-bit int} for the module's specialization constants."""
        self.device, self.abi, self.name = device, abi, name
        self.specialization = dict(specialization or {})
        self.bindings = abi.bindings if bindings is None else bindings   # the module's, in binding order
        self.handle = self.layout = self.set_layout = self.module = None
        with device.creating() as d:   # no close() of the device meanwhile (Device.creating)
            try:
                bindings = [vk.VkDescriptorSetLayoutBinding(
                    binding=i, descriptorType=descriptor_type(b), descriptorCount=1,
                    stageFlags=STAGE) for i, b in enumerate(self.bindings)]
                self.set_layout = vk.vkCreateDescriptorSetLayout(d, vk.VkDescriptorSetLayoutCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=len(bindings),
                    pBindings=bindings), None)
                ranges = [vk.VkPushConstantRange(stageFlags=STAGE, offset=0, size=abi.push_size)] if abi.push else []
                self.layout = vk.vkCreatePipelineLayout(d, vk.VkPipelineLayoutCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1,
                    pSetLayouts=[self.set_layout], pushConstantRangeCount=len(ranges),
                    pPushConstantRanges=ranges or None), None)
                self.module = vk.vkCreateShaderModule(d, vk.VkShaderModuleCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv), pCode=spirv), None)
                stage = vk.VkPipelineShaderStageCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=STAGE, module=self.module,
                    pName="main", pSpecializationInfo=specialization_info(self.specialization))
                self.handle = vk.vkCreateComputePipelines(d, device.pipeline_cache, 1, [vk.VkComputePipelineCreateInfo(
                    sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, stage=stage, layout=self.layout)], None)[0]
            except vk.VkError as e:
                _destroy_pipeline(d, self.handle, self.module, self.layout, self.set_layout)
                raise_vk(e, f"creating the pipeline of {name}")
            self._finalizer = device.own(self, functools.partial(
                _destroy_pipeline, d, self.handle, self.module, self.layout, self.set_layout))
            if device.debug_names:   # the module's variant name, as kernels.pipeline gives it
                for object_type, handle in ((vk.VK_OBJECT_TYPE_PIPELINE, self.handle),
                                            (vk.VK_OBJECT_TYPE_SHADER_MODULE, self.module),
                                            (vk.VK_OBJECT_TYPE_PIPELINE_LAYOUT, self.layout)):
                    device.set_name(object_type, handle, name)
        device.check()
        self._compile_now()

    def _compile_now(self) -> None:
        """Make the driver compile the pipeline now, within PAGEDVK_COMPILE_TIMEOUT: some drivers compile at
        the first dispatch (lavapipe: up to seconds), which would otherwise count against the first launch's
        PAGEDVK_TIMEOUT. A dispatch of no workgroups does it and runs nothing; every binding gets a 16-byte
        placeholder."""
        placeholder = self.device.buffer(16)
        try:
            launch = Launch(self.device, [(self, [placeholder] * len(self.bindings), bytes(self.abi.push_size),
                                           (0, 0, 0))])
            try:
                launch.submit(timeout=compile_timeout_ns())
            finally:
                launch.close()
        finally:
            placeholder.close()

    def _drop_handles(self) -> None:
        self.handle = self.module = self.layout = self.set_layout = None

    def descriptor_set(self, buffers) -> "DescriptorSet":
        return DescriptorSet(self, buffers)

    def launch(self, buffers, push: bytes, grid: tuple, timestamps: bool = False) -> "Launch":
        """A dispatch over these buffers, recorded once; submit it as often as needed."""
        return Launch(self.device, [(self, buffers, push, grid)], timestamps)

    def record_dispatch(self, cmd, descriptor_set: "DescriptorSet", push: bytes, grid: tuple) -> None:
        vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.handle)
        vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1,
                                   [descriptor_set.handle], 0, None)
        if push:
            vk.vkCmdPushConstants(cmd, self.layout, STAGE, 0, len(push), vk.ffi.new("char[]", push))
        vk.vkCmdDispatch(cmd, *grid)



TEXEL_FORMAT = vk.VK_FORMAT_R32G32B32A32_UINT   # a texel binding's 16-byte texels (GLSL rgba32ui)
TEXEL_BYTES = 16


def descriptor_type(binding) -> int:
    """A declared binding's descriptor type: a storage buffer, or a storage texel buffer (abi.Binding.texels)."""
    return (vk.VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER if getattr(binding, "texels", False)
            else vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER)


def specialization_info(values: dict):
    """VkSpecializationInfo for {constant id: value}, each value 4 bytes (VkBool32 or a 32-bit int)."""
    if not values:
        return None
    ids = sorted(values)
    entries = [vk.VkSpecializationMapEntry(constantID=c, offset=4 * i, size=4) for i, c in enumerate(ids)]
    data = np.array([int(values[c]) for c in ids], np.uint32).tobytes()
    return vk.VkSpecializationInfo(mapEntryCount=len(entries), pMapEntries=entries, dataSize=len(data),
                                   pData=vk.ffi.from_buffer(data))


def _destroy_pipeline(d, pipeline, module, layout, set_layout) -> None:
    for obj, destroy in ((pipeline, vk.vkDestroyPipeline), (module, vk.vkDestroyShaderModule),
                         (layout, vk.vkDestroyPipelineLayout), (set_layout, vk.vkDestroyDescriptorSetLayout)):
        if obj is not None:
            destroy(d, obj, None)


class DescriptorSet(Owned):
    """The buffers of one launch, bound in the order the op declares them.

    It holds them weakly: a recorded launch kept for reuse must not keep a dropped array's memory alive.
    Launch.submit checks they are all still open (under the device lock, which their freeing also takes)."""

    def __init__(self, pipeline: Pipeline, buffers):
        device = pipeline.device
        if len(buffers) != len(pipeline.bindings):
            raise ValueError(f"{pipeline.name} takes {len(pipeline.bindings)} buffers, got {len(buffers)}")
        info = device.info
        for i, (b, binding) in enumerate(zip(buffers, pipeline.bindings)):
            texels = getattr(binding, "texels", False)
            align, limit = ((info.min_texel_buffer_offset_alignment, "minTexelBufferOffsetAlignment") if texels else
                            (info.min_storage_buffer_offset_alignment, "minStorageBufferOffsetAlignment"))
            if b.offset % align:
                raise ValueError(f"binding {i} of {pipeline.name}: a buffer range must start at a multiple of "
                                 f"{align} bytes ({limit} of {info.name}), got offset {b.offset}")
            if texels and b.size > info.max_texel_buffer_elements * TEXEL_BYTES:
                raise ValueError(f"binding {i} of {pipeline.name}: {b.size // TEXEL_BYTES} texels of "
                                 f"{TEXEL_BYTES} bytes, more than {info.name} binds as a texel buffer "
                                 f"(maxTexelBufferElements {info.max_texel_buffer_elements})")
        self.device = device
        self._buffers = tuple(weakref.ref(b) for b in buffers)
        if device.debug_names:   # each buffer by the role it is bound in ("k_cache of paged_decode...")
            for b, binding in zip(buffers, pipeline.bindings):
                b.name_role(f"{binding.name} of {pipeline.name}")
        with device.lock:   # the pool, and no close() between the allocation and the write
            views = []
            try:
                for b, binding in zip(buffers, pipeline.bindings):   # a texel binding's view of its range
                    views.append(vk.vkCreateBufferView(device.handle, vk.VkBufferViewCreateInfo(
                        sType=vk.VK_STRUCTURE_TYPE_BUFFER_VIEW_CREATE_INFO, buffer=b.handle, format=TEXEL_FORMAT,
                        offset=b.offset, range=b.size), None) if getattr(binding, "texels", False) else None)
                self.handle, self.pool = device.allocate_descriptor_set(pipeline.set_layout)
            except vk.VkError as e:
                _free_set(device.handle, None, None, views)
                raise_vk(e, f"binding the buffers of {pipeline.name}")
            writes = [vk.VkWriteDescriptorSet(
                sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=self.handle, dstBinding=i, descriptorCount=1,
                descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER, pTexelBufferView=[view])
                if view is not None else vk.VkWriteDescriptorSet(
                sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=self.handle, dstBinding=i, descriptorCount=1,
                descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                pBufferInfo=[vk.VkDescriptorBufferInfo(buffer=b.handle, offset=b.offset, range=b.size)])
                for i, (b, view) in enumerate(zip(buffers, views))]
            vk.vkUpdateDescriptorSets(device.handle, len(writes), writes, 0, None)
            self._finalizer = device.own(self, functools.partial(_free_set, device.handle, self.pool, self.handle,
                                                                  views))

    @property
    def buffers(self) -> tuple:
        """The bound buffers; None for one already garbage collected."""
        return tuple(ref() for ref in self._buffers)

    def _drop_handles(self) -> None:
        self.handle = None


def _free_set(d, pool, handle, views) -> None:
    """A descriptor set's, and its texel bindings' buffer views (None where a binding has none)."""
    if handle is not None:
        vk.vkFreeDescriptorSets(d, pool, 1, [handle])
    for view in views:
        if view is not None:
            vk.vkDestroyBufferView(d, view, None)


def require_open_buffers(buffers) -> None:
    """ClosedError if any buffer (None: collected) is closed. Callers hold the device lock: a buffer is
    freed under that lock, so one found open here stays open until the lock is released."""
    if any(b is None or b.closed for b in buffers):
        raise ClosedError("an array bound to this launch was closed (or dropped) before it ran")


class Transfers:
    """Copies a Launch records around its dispatches, so that staging host data, the dispatches and
    reading results back take one submission: `before` runs first, `after` last; each is
    [(src, dst, [(src_offset, dst_offset, nbytes), ...])] as in Device.copy_regions. `uids` (of every
    buffer copied) tells launches recorded with other copies apart."""

    def __init__(self, before=(), after=()):
        self.before, self.after = tuple(before), tuple(after)
        self.uids = tuple(b.uid for src, dst, _ in self.before + self.after for b in (src, dst))

    @property
    def buffers(self) -> tuple:
        return tuple(b for src, dst, _ in self.before + self.after for b in (src, dst))


def record_steps(cmd, steps, descriptor_sets, independent=frozenset(), before_barrier=None) -> None:
    """Record dispatches in order, each after a barrier that makes the one before's writes visible to it (except the
    `independent` ones); `before_barrier(i)` runs after the barrier before step i (Launch's timestamps)."""
    for i, ((pipeline, _, push, grid), dset) in enumerate(zip(steps, descriptor_sets)):
        if i and i not in independent:
            memory_barrier(cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_ACCESS_SHADER_WRITE_BIT,
                           vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_ACCESS_SHADER_READ_BIT)
            if before_barrier is not None:
                before_barrier(i)
        pipeline.record_dispatch(cmd, dset, push, grid)


class RecordedInto(Owned):
    """Dispatches recorded into a caller's command buffer (`record_into`): the descriptor sets they bind, which must
    live until the caller's command buffer has finished running (close it then, or let it go with the object that
    recorded it)."""

    def __init__(self, device, steps, command_buffer):
        cmd = _command_buffer_handle(command_buffer)
        bound = [b for _, buffers, _, _ in steps for b in buffers]
        with device.lock:
            require_open_buffers(bound)
            self.descriptor_sets = [pipeline.descriptor_set(buffers) for pipeline, buffers, _, _ in steps]
            # Before: every earlier command's writes (transfers, the caller's shaders) visible to the dispatches.
            # After: the dispatches' writes visible to every later command of the caller's.
            memory_barrier(cmd, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_WRITE_BIT,
                           vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                           vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT)
            record_steps(cmd, steps, self.descriptor_sets)
            memory_barrier(cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_ACCESS_SHADER_WRITE_BIT,
                           vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT,
                           vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the descriptor sets; only once the caller's command buffer will not run again."""
        self._closed = True
        for dset in self.descriptor_sets:
            dset.close()


def _command_buffer_handle(command_buffer):
    if isinstance(command_buffer, int) and not isinstance(command_buffer, bool):
        return vk.ffi.cast("VkCommandBuffer", command_buffer)
    if isinstance(command_buffer, vk.ffi.CData):
        return command_buffer
    raise TypeError(f"command_buffer must be a VkCommandBuffer (the vulkan package's handle or an int), got "
                    f"{type(command_buffer).__name__}")


class Launch(Owned):
    """Dispatches recorded once into one command buffer, each ordered after the one before, and their
    descriptor sets.

    steps: (pipeline, buffers, push constants, grid) per dispatch.
    timestamps: False, or True for the GPU time of all steps (submit() returns it), or an int k to also
    stamp after every k steps (submit() then returns each group's time: many runs in one submission
    keep the GPU busy between them, as a model's layers do).
    transfers: copies recorded before and after the dispatches (Transfers); timestamps count them too.
    independent: indices of steps recorded with no barrier before them, so that they run beside the step
    before them: each reads nothing an earlier step of the launch writes and writes nothing such a step
    touches. With timestamps=k, a step stamped before (index a multiple of k) cannot be one: ValueError.
    """

    def __init__(self, device, steps, timestamps: bool | int = False, transfers: Transfers | None = None,
                 independent=frozenset()):
        transfers = transfers or Transfers()
        self.group = len(steps) if timestamps is True else int(timestamps)
        self.per_group = self.group and timestamps is not True
        groups = len(steps) // self.group if self.group else 0
        if self.group and len(steps) % self.group:
            raise ValueError(f"{len(steps)} steps do not make groups of {self.group}")
        if self.per_group and any(i % self.group == 0 for i in independent):
            raise ValueError("a step stamped before cannot be independent (timestamps and independent)")
        # Under the device lock from the check to the end of recording: no buffer is freed in between.
        bound = [b for _, buffers, _, _ in steps for b in buffers] + list(transfers.buffers)
        with device.lock:
            require_open_buffers(bound)
            self.descriptor_sets = [pipeline.descriptor_set(buffers) for pipeline, buffers, _, _ in steps]
            self.command_buffer = cmd_buffer = device.command_buffer(
                " + ".join(dict.fromkeys(pipeline.name for pipeline, _, _, _ in steps)) or "copies")

            def record(cmd):
                if transfers.before:
                    record_copies(cmd, transfers.before)
                    memory_barrier(cmd, vk.VK_PIPELINE_STAGE_TRANSFER_BIT, vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                   vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                                   vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT)
                stamp = (lambda i: cmd_buffer.stamp(cmd) if i % self.group == 0 else None) if self.group else None
                record_steps(cmd, steps, self.descriptor_sets, independent, stamp)
                if transfers.after:
                    memory_barrier(cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_ACCESS_SHADER_WRITE_BIT,
                                   vk.VK_PIPELINE_STAGE_TRANSFER_BIT, vk.VK_ACCESS_TRANSFER_READ_BIT)
                    record_copies(cmd, transfers.after)

            cmd_buffer.record(record, timestamps=groups + 1 if groups else 0)
        # Each bound buffer once (steps share tables, scratch, outputs): what submit() checks every time.
        self._refs = tuple({id(b): weakref.ref(b) for b in bound}.values())
        self._checked_at = -1   # owned.closes() when the bindings were last found open

    @property
    def buffers(self) -> tuple:
        """The bound buffers, each once; None for one already garbage collected."""
        return tuple(ref() for ref in self._refs)

    @property
    def stale(self) -> bool:
        """Whether a buffer it binds was closed or collected: it can never run again."""
        return any(b is None or b.closed for b in self.buffers)

    def submit(self, timeout: int | None = None):
        """Run it and wait (at most `timeout` ns, default PAGEDVK_TIMEOUT). Returns the GPU time in ns when
        recorded with timestamps=True, each group's times (an array) with timestamps=k, else None.
        ClosedError if a buffer it binds was closed."""
        with self.command_buffer.device.lock:   # held until the fence: nothing it binds is freed under it
            self._open_buffers()
            self.command_buffer.submit(timeout=timeout)
        if not self.group:
            return None
        stamps = self.command_buffer.timestamps_ns()
        return np.diff(stamps) if self.per_group else float(stamps[-1])

    def enqueue(self, stream=None) -> int:
        """Queue it on `stream` (None: the calling thread's current stream) and return at once; the submission's
        ticket. What it binds is destroyed only after it has run, even if closed meanwhile (pagedvk.runtime.stream).
        ClosedError if a buffer it binds was closed."""
        device = self.command_buffer.device
        stream = check_stream(stream, device)
        with device.lock:
            self._open_buffers()
            return stream.enqueue(self.command_buffer)

    def _open_buffers(self) -> tuple:
        """ClosedError if a bound buffer was closed or collected. Callers hold the device lock (under which buffers
        are freed)."""
        # Each binding's `closed` is checked again only when something was closed or collected since the last check
        # (every close and every collection counts, owned.count_close): 12 property reads were a third of
        # DecodePlan.run's Python.
        seen = closes()
        if seen == self._checked_at:
            return ()
        buffers = self.buffers
        require_open_buffers(buffers)
        self._checked_at = seen
        return buffers

    @property
    def closed(self) -> bool:
        return self.command_buffer.closed

    def close(self) -> None:
        self.command_buffer.close()
        for dset in self.descriptor_sets:
            dset.close()
