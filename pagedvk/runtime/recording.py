"""Recorded steps (CUDA graphs): ops recorded once inside ``with pagedvk.record() as step:`` and replayed by
``step.replay()`` in one submission.

Inside the block an op runs nothing: it adds its dispatches, bound to the device arrays it was given, to the step.
Between replays the caller may change the contents of those arrays in place (queries, keys and values, slot
mappings), and update the DecodePlans the step ran (`DecodePlan.update`: new block tables and lengths). A plan whose
update changed its kernel, split or table arrays bumps its `generation`, and the next replay records the step again
from the same calls. Every array a recorded op binds is kept alive by the step until it is closed.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager

from ..errors import ClosedError, PagedVKError
from .array import DeviceArray
from .owned import Owned
from .pipeline import Launch, RecordedInto
from .selection import DeviceLike, get_device

_active = threading.local()
# record() blocks open in any thread: while there are none, no op is being recorded, found without reading the
# thread's stack (every op asks, once or twice a call).
_recording = 0
_recording_lock = threading.Lock()


class RecordedStep(Owned):
    """Ops recorded by ``pagedvk.record()``, replayed in one submission by `replay`.

    Attributes
    ----------
    device : Device
    ops : list of str
        The recorded ops' names, in order.
    """

    def __init__(self, device) -> None:
        self.device = device
        self.ops = []
        self._entries = []           # (make_dispatches, objects whose `generation` it depends on)
        self._launch, self._generations = None, None
        self._recording, self._closed = True, False

    def add(self, name: str, make_dispatches, depends_on=()) -> None:
        """Record an op: `make_dispatches()` gives its (pipeline, buffers, push, grid) dispatches, called again
        whenever one of `depends_on`'s `generation` changes. Ops call this; users call ops."""
        if not self._recording:
            raise PagedVKError("the step's recording has ended: record ops inside its `with pagedvk.record()` block")
        make_dispatches()   # recorded at once too: a bad argument fails in the block, where its op was called
        self.ops.append(name)
        self._entries.append((make_dispatches, tuple(depends_on)))

    def _current_generations(self) -> tuple:
        return tuple(obj.generation for _, depends in self._entries for obj in depends)

    def replay(self, stream=None) -> None:
        """Queue every recorded op, in order, in one submission on `stream` (None: the current stream), and return at
        once. Each op sees the arrays' contents at the time it runs.

        Raises
        ------
        ClosedError
            The step, or an array or plan it recorded, was closed.
        """
        if self._closed:
            raise ClosedError("the recorded step is closed")
        if self._recording:
            raise PagedVKError("replay() runs after the `with pagedvk.record()` block has ended")
        if not self._entries:
            return
        generations = self._current_generations()
        if self._launch is None or generations != self._generations or self._launch.stale:
            dispatches = self.dispatches()
            old, self._launch = self._launch, None
            if old is not None:
                old.close()   # a replay still queued keeps what it binds (Device._release)
            self._launch, self._generations = Launch(self.device, dispatches), generations
        self._launch.enqueue(stream)

    def record_into(self, command_buffer) -> RecordedInto:
        """Record the step's ops into a caller's command buffer (between its begin and end), with a barrier before
        them (after every earlier command's writes) and one after (before every later command's reads and writes).

        The returned object holds the descriptor sets they bind: keep it until that command buffer has finished
        running, then close it. The arrays and plans the step recorded must stay open as long; a plan update that
        changes its `generation` needs a new recording.
        """
        if self._closed:
            raise ClosedError("the recorded step is closed")
        return RecordedInto(self.device, self.dispatches(), command_buffer)

    def dispatches(self) -> list:
        """The recorded ops' (pipeline, buffers, push constants, grid) dispatches as they stand now (benchmarks time
        them with per-op timestamps)."""
        return [d for make, _ in self._entries for d in make()]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the recorded command buffer and let go of the arrays and plans it bound; safe to call twice."""
        self._closed = True
        self._entries = []
        if self._launch is not None:
            self._launch.close()
            self._launch = None

    def __repr__(self) -> str:
        return f"RecordedStep(ops={len(self.ops)}, device={self.device.info.name!r}{', closed' if self._closed else ''})"


@contextmanager
def record(device: DeviceLike = None):
    """Record the ops called in the block (on this thread, for `device`) into a `RecordedStep`, running none of them.

    Recordable: `DecodePlan.run`, `reshape_and_cache`, `merge_attention_states`, the layer ops (`embedding`,
    `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`), `linear` and `sample` over
    DeviceArrays. Other ops raise inside the block, as does an op given a host array (it would be copied once,
    at recording).

    Parameters
    ----------
    device : Device, DeviceInfo, int or str, optional
        None means the default device.

    Yields
    ------
    RecordedStep

    Examples
    --------
    >>> with pagedvk.record() as step:
    ...     for layer in range(num_layers):
    ...         pagedvk.reshape_and_cache(k[layer], v[layer], cache.key[layer], cache.value[layer], slots)
    ...         plan.run(q[layer], cache.key[layer], cache.value[layer], out=out[layer])
    >>> step.replay()            # every layer, one submission
    """
    global _recording
    step = RecordedStep(get_device(device))
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(step)
    with _recording_lock:
        _recording += 1
    try:
        yield step
    finally:
        stack.remove(step)
        step._recording = False
        with _recording_lock:
            _recording -= 1


def active_recording(device) -> RecordedStep | None:
    """The step the calling thread is recording for `device`, or None."""
    if not _recording:
        return None
    for step in reversed(getattr(_active, "stack", ())):
        if step.device is device:
            return step
    return None


def require_device_arrays(op: str, **arrays) -> None:
    """Every array argument given must be a DeviceArray (inside a recording, and for ops that take nothing else):
    TypeError naming the first that is not. `op` names the op and where, as the message starts."""
    for name, a in arrays.items():
        if a is not None and not isinstance(a, DeviceArray):
            raise TypeError(f"{op}: {name} must be a DeviceArray, got {type(a).__name__} (a host array would be "
                            "copied once, when the op is recorded, and every later run would reuse that copy)")


def refuse_recording(op: str, device) -> None:
    """Ops that cannot be recorded raise inside a recording for their device."""
    if active_recording(device) is not None:
        raise PagedVKError(f"{op} cannot be recorded in pagedvk.record() (recordable: DecodePlan.run, "
                           "reshape_and_cache, merge_attention_states, the layer ops, linear, sample); call it outside the block")


KEPT_LAUNCHES = 256   # per device: a cache write per layer of the largest models, and some


class KeptLaunches:
    """A device's recorded launches of ops without a plan of their own (reshape_and_cache, merges), keyed by their
    dispatches: a call with the same pipelines, buffers, push constants and grid resubmits the command buffer
    recorded the first time (recording one costs far more than queuing it). Buffer uids are never reused, so a key
    never meets another call's buffers; a launch whose buffer was closed is recorded anew."""

    def __init__(self):
        self.lock = threading.Lock()
        self.launches = OrderedDict()

    def enqueue_kept(self, signature) -> bool:
        """Queue the launch kept for a caller's `signature` (what its op checked: the arrays' buffers, shapes and
        dtypes, and its options); False when there is none, or it binds a closed buffer (the caller then checks
        and dispatches, which records it again)."""
        with self.lock:
            launch = self.launches.get(signature)
            if launch is None:
                return False
            try:
                launch.enqueue()   # checks its bindings are open
            except ClosedError:
                self.launches.pop(signature).close()
                return False
            self.launches.move_to_end(signature)
            return True

    def enqueue(self, device, dispatches, signature=None) -> None:
        key = signature if signature is not None else tuple(
            (id(pipeline), tuple(b.uid for b in buffers), push, grid) for pipeline, buffers, push, grid in dispatches)
        with self.lock:
            launch = self.launches.get(key)
            if launch is not None and (launch.closed or launch.stale):
                self.launches.pop(key).close()
                launch = None
            if launch is None:
                launch = self.launches[key] = Launch(device, dispatches)
                while len(self.launches) > KEPT_LAUNCHES:
                    self.launches.popitem(last=False)[1].close()
            else:
                self.launches.move_to_end(key)
            launch.enqueue()

    def clear(self) -> None:
        with self.lock:
            launches, self.launches = list(self.launches.values()), OrderedDict()
        for launch in launches:
            launch.close()


_kept = weakref.WeakKeyDictionary()   # device -> KeptLaunches
_kept_lock = threading.Lock()


def kept_launches(device) -> KeptLaunches:
    with _kept_lock:
        kept = _kept.get(device)
        if kept is None:
            kept = _kept[device] = KeptLaunches()
        return kept


def dispatch(op: str, device, make_dispatches, depends_on=(), signature=None) -> None:
    """Run an op's dispatches: added to the recording when one is active, else queued on the current stream (through
    the device's kept launches, under `signature` where the op gives one: see KeptLaunches.enqueue_kept)."""
    step = active_recording(device)
    if step is not None:
        step.add(op, make_dispatches, depends_on)
        return
    kept_launches(device).enqueue(device, make_dispatches(), signature)


def array_signature(arrays, options: tuple) -> tuple | None:
    """A call's signature for KeptLaunches when every array is a DeviceArray: their devices, buffers (a view's is its
    own range of its base's buffer), shapes, dtypes and row pitches (a view's, which the launch pushes), then
    `options`; None otherwise."""
    if any(type(a) is not DeviceArray for a in arrays):
        return None
    return tuple([(a.device, a.binding) for a in arrays]) + options
