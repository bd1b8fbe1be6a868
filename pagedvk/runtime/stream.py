"""Streams: ordered queues of GPU work that return to the caller at once (CUDA's streams and events).

An op over device arrays is recorded into a command buffer and queued on the current stream without waiting.
Work on one stream runs in submission order: every command buffer starts with a barrier after all earlier work of
its queue (CommandBuffer.record).

Batching: a stream keeps at most two submissions running. An op queued while two are still running waits on the host,
in the stream's batch, and the batch goes in one vkQueueSubmit when one of them has finished (seen by the next op
queued), when it holds PAGEDVK_BATCH ops, or at anything that waits for or asks about the stream's work
(`synchronize`, `query`, events, host access, `flush`). Each submission costs NVIDIA's driver about 8.6 us of idle
GPU, so an engine's one-by-one ops pay that once a batch instead of once an op; a GPU that has caught up gets the next
op at once. A stream made with `Stream()` gets a queue of its own where the device's compute
family has one to spare, so its work runs beside the default stream's; elsewhere it shares the device's queue and
runs in order with it.

What waits: `Stream.synchronize()`, `Event.synchronize()`, `Device.synchronize()`, and every host access to device
memory (`DeviceArray.numpy()`, writes, fills, copies), which waits for all streams of its device first. Every wait
has the limit PAGEDVK_TIMEOUT. A fault or timeout of queued work is raised by the wait that finds it, naming the op
(its command buffer's name).

Nothing a queued op binds is destroyed before the op completes: objects closed or collected meanwhile are destroyed
once every submission made before their release has finished (Device._release).
"""

from __future__ import annotations

import threading
from collections import deque

import vulkan as vk

from ..config import batch as batch_size
from ..errors import PagedVKError
from . import commands
from .commands import vk_error
from .memory import raise_vk
from .selection import DeviceLike, get_device


class Submission:
    """One queued command buffer and its device ticket. What it binds is not referenced: objects released while it
    runs are destroyed after it (Device._release)."""

    __slots__ = ("ticket", "command_buffer")

    def __init__(self, ticket: int, command_buffer):
        self.ticket, self.command_buffer = ticket, command_buffer

    @property
    def done_elsewhere(self) -> bool:
        """Its command buffer was waited on since (by a resubmission, which waits first, or a timed-out wait)."""
        cb = self.command_buffer
        return cb.ticket != self.ticket or not cb.pending


class Stream:
    """An ordered queue of GPU work on one device.

    Ops over device arrays queue their work on the current stream and return at once: the device's default stream,
    or the stream of the innermost ``with stream:`` block of the calling thread.

    Parameters
    ----------
    device : Device, DeviceInfo, int or str, optional
        None means the default device.

    Examples
    --------
    >>> side = pagedvk.Stream()
    >>> with side:
    ...     out = plan.run(q, cache.key[0], cache.value[0])   # queued on `side`
    >>> side.synchronize()
    """

    def __init__(self, device: DeviceLike = None, *, _queue=None):
        self.device = get_device(device)
        self.queue = self.device.stream_queue() if _queue is None else _queue
        self._pending = deque()   # submitted, not yet seen finished
        self._batch = []          # queued, not yet submitted (flush)
        self.device.add_stream(self)

    # -- queueing ------------------------------------------------------------------------------------

    IN_FLIGHT = 2   # submissions kept running: the GPU has the next one while the host hears of the first's end

    def enqueue(self, command_buffer) -> int:
        """Queue a recorded command buffer without waiting (submitted at once, or with the next batch: see the
        module's docstring); the device ticket of the submission."""
        dev = self.device
        with dev.lock:
            command_buffer._require_idle()   # a command buffer runs once at a time: an earlier run is waited for
            self.retire()
            ticket = command_buffer.ticket = dev.next_ticket()
            self._batch.append(Submission(ticket, command_buffer))
            command_buffer.batched = self
            if len(self._pending) < self.IN_FLIGHT or len(self._batch) >= batch_size():
                self.flush()
            dev.run_deferred()
            return ticket

    def flush(self) -> None:
        """Submit the ops queued on the stream and not yet submitted, in one vkQueueSubmit, without waiting."""
        dev = self.device
        with dev.lock:
            batch = self._batch
            if not batch:
                return
            dev.settle_timed_out()
            buffers = [s.command_buffer for s in batch]
            carrier = buffers[-1]
            if len(buffers) == 1:
                info = carrier._submit_info
            else:
                handles = vk.ffi.new("VkCommandBuffer[]", [cb._handles[0] for cb in buffers])
                info = vk.ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                   "commandBufferCount": len(buffers), "pCommandBuffers": handles})
            self._batch = []
            for cb in buffers:
                cb.batched = None
            result = commands.queue_submit(self.queue, 1, info, carrier.fence)
            if result != vk.VK_SUCCESS:   # nothing of the batch runs: its ops are forgotten, and said so
                raise_vk(vk_error(result), f"submitting {', '.join(dict.fromkeys(cb.name for cb in buffers))} "
                         "(vkQueueSubmit)", device=dev)
            for cb in buffers:
                cb.pending, cb.carrier = True, carrier
            carrier.riders = buffers[:-1]
            self._pending.extend(batch)

    def retire(self) -> None:
        """Forget the submissions at the front that have finished (resetting their fences), without waiting.
        A fault found here is raised, naming the op. Callers may hold the device lock."""
        dev = self.device
        with dev.lock:
            pending = self._pending
            while pending:
                s = pending[0]
                if not s.done_elsewhere:
                    carrier = s.command_buffer.carrier
                    result = commands.get_fence_status(dev.handle, carrier.fence)
                    if result == vk.VK_NOT_READY:
                        break
                    if result != vk.VK_SUCCESS:   # it stays queued: later waits meet the fault again
                        raise_vk(vk_error(result), f"running {s.command_buffer.name}", device=dev)
                    carrier.finish()   # signalled: resets the fence for its next submission, and its riders'
                pending.popleft()

    @property
    def first_pending(self) -> int | None:
        """The ticket of the oldest op queued and not yet seen finished (submitted or not), or None."""
        self.retire()
        return self._pending[0].ticket if self._pending else self._batch[0].ticket if self._batch else None

    def query(self) -> bool:
        """Whether everything queued on the stream has finished (without waiting; what is not submitted yet goes
        now)."""
        self.flush()
        return self.first_pending is None

    def synchronize(self, timeout: int | None = None, upto: int | None = None) -> None:
        """Wait for everything queued on the stream (with `upto`, the submissions with tickets up to it), each wait
        at most `timeout` ns (default PAGEDVK_TIMEOUT).

        Raises
        ------
        GPUTimeoutError, DeviceLostError
            Naming the op that did not finish or faulted; a timed-out op stays queued.
        """
        dev = self.device
        with dev.lock:
            self.flush()
            while self._pending and (upto is None or self._pending[0].ticket <= upto):
                s = self._pending[0]
                if not s.done_elsewhere:
                    s.command_buffer.wait(timeout)   # raises naming the op; a timed-out one stays queued
                self._pending.popleft()
            dev.run_deferred()

    def record_event(self) -> "Event":
        """An event marking everything queued on the stream so far."""
        with self.device.lock:
            last = self._batch or self._pending
            return Event(self, last[-1].ticket if last else 0)

    def wait_event(self, event: "Event") -> None:
        """Make work queued on this stream after now start after `event`'s work.

        On a shared queue that order holds already; across queues the calling thread waits for the event (a
        GPU-side wait through timeline semaphores is not built yet)."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be a pagedvk Event, got {type(event).__name__}")
        if event.stream.device is not self.device:
            raise ValueError("event must come from a stream of this stream's device")
        if event.stream.queue != self.queue:
            event.synchronize()

    # -- the calling thread's current stream ----------------------------------------------------------

    def __enter__(self) -> "Stream":
        global _entered
        _current.__dict__.setdefault("stack", []).append(self)
        with _entered_lock:
            _entered += 1
        return self

    def __exit__(self, *exc) -> None:
        global _entered
        _current.stack.pop()
        with _entered_lock:
            _entered -= 1

    def __repr__(self) -> str:
        return f"Stream(device={self.device.info.name!r}, pending={len(self._pending) + len(self._batch)})"


class Event:
    """A point in a stream's work (CUDA's event): what was queued on the stream when it was recorded."""

    def __init__(self, stream: Stream, ticket: int):
        self.stream, self.ticket = stream, ticket

    def query(self) -> bool:
        """Whether its work has finished (without waiting; what is not submitted yet goes now)."""
        self.stream.flush()
        first = self.stream.first_pending
        return first is None or first > self.ticket

    def synchronize(self, timeout: int | None = None) -> None:
        """Wait for its work (at most `timeout` ns per op, default PAGEDVK_TIMEOUT)."""
        self.stream.synchronize(timeout, upto=self.ticket)


_current = threading.local()
# `with stream:` blocks open in any thread: while there are none, every op's stream is its device's default one, found
# without reading the thread's stack (a thread-local lookup was half a microsecond of each queued op's Python).
_entered = 0
_entered_lock = threading.Lock()


def current_stream(device) -> Stream:
    """The calling thread's current stream on `device`: the innermost ``with stream:`` of that device, else the
    device's default stream."""
    if _entered:
        for stream in reversed(getattr(_current, "stack", ())):
            if stream.device is device:
                return stream
    return device._default_stream or default_stream(device)


def default_stream(device) -> Stream:
    """The stream a device's ops queue on outside any ``with stream:`` block; it uses the device's first queue."""
    if device._default_stream is None:
        with device.lock:
            if device._default_stream is None:
                device._default_stream = Stream(device, _queue=device.queue)
    return device._default_stream


def check_stream(stream, device) -> Stream:
    """`stream` (None: the current one) as a Stream of `device`, or a clear error naming the argument."""
    if stream is None:
        return current_stream(device)
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be a pagedvk Stream, got {type(stream).__name__}")
    if stream.device is not device:
        raise PagedVKError(f"stream is on {stream.device.info.name}, the work on {device.info.name}")
    return stream


def synchronize(device: DeviceLike = None, timeout: int | None = None) -> None:
    """Wait for the work queued on every stream of `device` (None: the default device); see Device.synchronize."""
    get_device(device).synchronize(timeout)
