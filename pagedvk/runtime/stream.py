"""Streams: ordered queues of GPU work that return to the caller at once (CUDA's streams and events).

An op over device arrays is recorded into a command buffer and submitted to the current stream without waiting.
Work on one stream runs in submission order: every command buffer starts with a barrier after all earlier work of
its queue (CommandBuffer.record). A stream made with `Stream()` gets a queue of its own where the device's compute
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
        self._pending = deque()
        self.device.add_stream(self)

    # -- queueing ------------------------------------------------------------------------------------

    def enqueue(self, command_buffer) -> int:
        """Submit a recorded command buffer without waiting; the device ticket of the submission."""
        dev = self.device
        with dev.lock:
            command_buffer.submit(wait=False, queue=self.queue)
            ticket = command_buffer.ticket = dev.next_ticket()
            self._pending.append(Submission(ticket, command_buffer))
            self.retire()
            dev.run_deferred()
            return ticket

    def retire(self) -> None:
        """Forget the submissions at the front that have finished (resetting their fences), without waiting.
        A fault found here is raised, naming the op. Callers may hold the device lock."""
        dev = self.device
        with dev.lock:
            pending = self._pending
            while pending:
                s = pending[0]
                if not s.done_elsewhere:
                    result = commands.get_fence_status(dev.handle, s.command_buffer.fence)
                    if result == vk.VK_NOT_READY:
                        break
                    if result != vk.VK_SUCCESS:   # it stays queued: later waits meet the fault again
                        raise_vk(vk_error(result), f"running {s.command_buffer.name}", device=dev)
                    s.command_buffer.finish()   # signalled: resets the fence for its next submission
                pending.popleft()

    @property
    def first_pending(self) -> int | None:
        """The ticket of the oldest submission not yet seen finished, or None."""
        self.retire()
        return self._pending[0].ticket if self._pending else None

    def query(self) -> bool:
        """Whether everything queued on the stream has finished (without waiting)."""
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
            while self._pending and (upto is None or self._pending[0].ticket <= upto):
                s = self._pending[0]
                if not s.done_elsewhere:
                    s.command_buffer.wait(timeout)   # raises naming the op; a timed-out one stays queued
                self._pending.popleft()
            dev.run_deferred()

    def record_event(self) -> "Event":
        """An event marking everything queued on the stream so far."""
        with self.device.lock:
            return Event(self, self._pending[-1].ticket if self._pending else 0)

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
        _current.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc) -> None:
        _current.stack.pop()

    def __repr__(self) -> str:
        return f"Stream(device={self.device.info.name!r}, pending={len(self._pending)})"


class Event:
    """A point in a stream's work (CUDA's event): what was queued on the stream when it was recorded."""

    def __init__(self, stream: Stream, ticket: int):
        self.stream, self.ticket = stream, ticket

    def query(self) -> bool:
        """Whether its work has finished (without waiting)."""
        first = self.stream.first_pending
        return first is None or first > self.ticket

    def synchronize(self, timeout: int | None = None) -> None:
        """Wait for its work (at most `timeout` ns per op, default PAGEDVK_TIMEOUT)."""
        self.stream.synchronize(timeout, upto=self.ticket)


_current = threading.local()


def current_stream(device) -> Stream:
    """The calling thread's current stream on `device`: the innermost ``with stream:`` of that device, else the
    device's default stream."""
    for stream in reversed(getattr(_current, "stack", ())):
        if stream.device is device:
            return stream
    return default_stream(device)


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
