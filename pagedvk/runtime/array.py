"""Device arrays: a shape and dtype over one device buffer, so data such as a KV cache stays on the GPU."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Union

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ..errors import ClosedError
from .memory import Buffer, BufferRange
from .owned import Owned
from .selection import DeviceLike, get_device

DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                      ml_dtypes.float8_e5m2, np.int32, np.uint32, np.int64, np.int8, np.uint8))


def _dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported on the device (supported: {', '.join(map(str, DTYPES))})")
    return dt


MAX_BYTES = 2**63 - 1   # numpy's sizes are int64


def _shape(shape) -> tuple:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(n, (int, np.integer)) or n < 0 for n in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape}")
    return tuple(int(n) for n in shape)


class DeviceArray(Owned):
    """An array in device memory, so that data such as a KV cache stays on the GPU.

    `numpy()` copies it back to the host. An array made here is C-contiguous; indexing it (``a[:, start:stop]``,
    ``a[i:j]``, ``a[i]``) and `reshape` give views of the same memory without a copy: rows of the first axis at a
    fixed pitch (`pitch` elements, `strides[0]` bytes apart), everything inside a row contiguous, as a fused QKV
    projection's query, key and value slices are (see `__getitem__`). An array larger than one kernel binding can address
    (maxStorageBufferRange) or one allocation can hold (maxMemoryAllocationSize), such as a KV cache of tens of GB,
    is split along its first axis into segments of whole rows, one buffer each (`buffers`); ops read such caches
    through several bindings or buffer device addresses. Everything else lives in one buffer (`buffer`).

    Parameters
    ----------
    shape : int or tuple of int
        Non-negative sizes.
    dtype : numpy dtype
        float32, float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, int32, uint32,
        int64, int8 or uint8 (`DTYPES`).
    device : Device, DeviceInfo, int or str, optional
        None means the default device.
    host_visible : bool, default False
        Place it in host memory the device reads and writes (mapped): `write` and `numpy` are then a copy on the
        host, with no transfer submitted, as CUDA's pinned host memory. For a step's small inputs and outputs
        (token ids, positions, slots, block tables, sampled ids) rewritten every step: on a discrete GPU each
        write of device-local memory is a staging copy and a wait (NVIDIA's H200: about 0.8 ms a step for the six
        a model's decode step made). Kernels read it over the bus: not for anything large or read often. At most
        one binding's bytes.

    Raises
    ------
    TypeError
        A dtype the device arrays do not support.
    ValueError
        A bad shape, or rows too large for one binding.
    OutOfMemoryError
        The device's heap cannot give the array's bytes.
    """

    def __init__(self, shape: int | tuple[int, ...], dtype: DTypeLike, device: DeviceLike = None, *,
                 host_visible: bool = False) -> None:
        self.shape = _shape(shape)
        self.dtype = _dtype(dtype)
        nbytes = self.nbytes
        if nbytes > MAX_BYTES:   # numpy's int64 sizes wrapped: (2**33, 2**31) was 0 bytes, (2**63,) negative
            raise ValueError(f"shape {self.shape} of {self.dtype} is {nbytes} bytes, more than any array can hold "
                             f"({MAX_BYTES}, 2^63 - 1)")
        self.device = get_device(device)
        # The whole array, before the first segment: a lazily committed 256 GiB array was accepted on a 24 GiB host.
        self.device.require_room(nbytes, what=f"allocating an array of shape {self.shape} ({self.dtype})")
        limit = segment_limit(self.device)
        rows = self.shape[0] if self.shape else 1
        self.segment_rows = rows   # rows of axis 0 per buffer
        if nbytes > limit:
            row_bytes = nbytes // rows
            if row_bytes > limit:
                raise ValueError(
                    f"an array of shape {self.shape} ({self.dtype}) has {row_bytes}-byte rows, more than "
                    f"{self.device.info.name} can bind or allocate at once ({limit} bytes): split its first axis "
                    "finer")
            self.segment_rows = limit // row_bytes
        if host_visible and nbytes > limit:
            raise ValueError(f"a host-visible array is one binding: shape {self.shape} ({self.dtype}) is {nbytes} "
                             f"bytes, more than {self.device.info.name} binds at once ({limit} bytes)")
        row_bytes = nbytes // rows if rows else 0
        self._host_visible = bool(host_visible)
        self._buffers = []
        try:
            if host_visible:
                self._buffers.append(self.device.host_buffer(nbytes, name=(
                    f"host array {self.shape} {np.dtype(self.dtype).name}" if self.device.debug_names else None)))
            for first in range(0, max(rows, 1) if not host_visible else 0, max(self.segment_rows, 1)):
                n = min(self.segment_rows, rows - first) if rows else 0
                self._buffers.append(self.device.buffer(n * row_bytes if self.shape else nbytes, name=(
                    f"array {self.shape} {np.dtype(self.dtype).name}" if self.device.debug_names else None)))
        except BaseException:
            for b in self._buffers:
                b.close()
            raise
        self._address_table = None
        self._init_layout()

    _host_visible = False   # arrays made by over_buffer and from_buffer wrap memory they do not choose

    @property
    def host_visible(self) -> bool:
        """Whether it was made in mapped host memory (host_visible=True; a view: its base)."""
        return (self._base if self._base is not None else self)._host_visible

    def _init_layout(self) -> None:
        """An array owning its layout: contiguous, starting at its buffer's first byte."""
        self._base, self._offset, self._view_closed = None, 0, False
        self._pitch = math.prod(self.shape[1:])
        self._view_ranges = None   # (offset, nbytes) -> BufferRange of the views made of it (views share one)

    @classmethod
    def over_buffer(cls, buffer: Buffer, offset: int, shape: int | tuple[int, ...],
                    dtype: DTypeLike) -> DeviceArray:
        """An array over bytes [offset, offset + nbytes) of an existing runtime Buffer, allocating nothing.

        It binds only its own range (a BufferRange), and does not own the buffer. The decode plan keeps its split's
        counters after partial_stats this way; tests use it to put sentinels right beside the arrays they guard.

        Parameters
        ----------
        buffer : pagedvk.runtime.memory.Buffer
        offset : int
            Byte offset of the array in the buffer.
        shape : int or tuple of int
        dtype : numpy dtype
            One of `DTYPES`.

        Returns
        -------
        DeviceArray
        """
        self = cls.__new__(cls)
        self.shape, self.dtype, self.device = _shape(shape), _dtype(dtype), buffer.device
        self.segment_rows = self.shape[0] if self.shape else 1
        self._buffers = [BufferRange(buffer, offset, self.nbytes)]
        self._address_table = None
        self._init_layout()
        return self

    @classmethod
    def from_buffer(cls, buffer, offset: int, shape: int | tuple[int, ...], dtype: DTypeLike, *, buffer_size: int,
                    device: DeviceLike = None) -> DeviceArray:
        """An array over bytes [offset, offset + nbytes) of a VkBuffer the caller made and owns, without a copy.

        pagedvk binds the range to its kernels and copies through it (numpy(), write()); it never frees the buffer,
        and close() only ends its own use. The buffer needs VK_BUFFER_USAGE_STORAGE_BUFFER_BIT (and TRANSFER_SRC /
        TRANSFER_DST for numpy() and write()), and must stay alive while work that binds it is queued.

        Parameters
        ----------
        buffer : VkBuffer
            The `vulkan` package's handle, or its address as an int (a C or C++ caller's).
        offset : int
            Byte offset of the array in the buffer: a multiple of 4, and of the device's
            minStorageBufferOffsetAlignment for the array to be bound.
        shape : int or tuple of int
        dtype : numpy dtype
            One of `DTYPES`.
        buffer_size : int
            The buffer's size in bytes: the array's range, rounded up to 16 bytes (kernels read 16-byte chunks),
            must lie inside it.
        device : Device, optional
            The device the buffer was made on (`Device.from_handles` for a caller's device); None means the default.

        Returns
        -------
        DeviceArray
        """
        from .device import _handle
        from .memory import ForeignBuffer
        device = get_device(device)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 16:
            raise ValueError(f"buffer_size must be an int of at least 16 bytes, got {buffer_size!r}")
        return cls.over_buffer(ForeignBuffer(device, _handle("VkBuffer", buffer), int(buffer_size)), offset, shape,
                               dtype)

    @property
    def buffer(self) -> Buffer | BufferRange:
        """The array's one device buffer.

        Raises
        ------
        ClosedError
            The array is closed, so a closed array can never be bound to a kernel (it would reach the GPU as a null
            descriptor).
        ValueError
            The array is split into segments: it has no one buffer.
        """
        self._require_open()
        if len(self._buffers) > 1:
            raise ValueError(f"{self!r} spans {len(self._buffers)} buffers of {self.segment_rows} rows (it is larger "
                             f"than one binding): this argument must fit one binding")
        return self._buffers[0]

    @property
    def buffers(self) -> tuple:
        """The buffers holding consecutive segments of `segment_rows` rows (ClosedError once closed)."""
        self._require_open()
        return tuple(self._buffers)

    def address_table(self) -> DeviceArray:
        """A uint32 array of each segment buffer's device address (low word, high word).

        For kernels that reach the segments through buffer references; made once, freed with this array.

        Returns
        -------
        DeviceArray, shape (2 * len(buffers),), uint32
        """
        self._require_open()
        if self._address_table is None:
            addresses = np.array([b.device_address() for b in self._buffers], np.uint64)
            self._address_table = asarray(addresses.view(np.uint32), self.device)
        return self._address_table

    @property
    def size(self) -> int:
        """The number of elements (a Python int: numpy's int64 product wraps)."""
        return math.prod(self.shape)   # Python ints: numpy's int64 product wraps

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The array's size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def closed(self) -> bool:
        """Whether the array's memory was freed (close(), or its device closed)."""
        buffers = getattr(self, "_buffers", None)   # none when __init__ failed
        return not buffers or buffers[0].closed or getattr(self, "_view_closed", False)

    def _require_open(self) -> None:
        if self.closed:
            raise ClosedError(f"{self!r} is closed"
                              + (f" (its device {self.device.info.name} was closed)" if self.device.closed else ""))

    def numpy(self) -> np.ndarray:
        """A host copy of the array.

        Returns
        -------
        numpy.ndarray
            The array's shape and dtype.

        Raises
        ------
        ClosedError
            The array is closed.
        """
        self._require_open()
        if not self.is_contiguous:   # one submission gathers the rows
            rows, row_bytes = self._rows()
            b = self._buffers[0]
            data = self.device.download_regions(rows * row_bytes, [(b, [(r * self.strides[0], r * row_bytes,
                                                                        row_bytes) for r in range(rows)])])
            return data.view(self.dtype).reshape(self.shape)
        data = [self.device.download(b, b.nbytes) for b in self._buffers]
        return (data[0] if len(data) == 1 else np.concatenate(data)).view(self.dtype).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        # numpy's protocol: copy=False asks for a view, which device memory cannot give.
        if copy is False:
            raise ValueError("a DeviceArray lives in device memory: numpy cannot view it without a copy "
                             "(copy=False); use np.asarray(a) or a.numpy(), which copy it")
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def write(self, array: ArrayLike) -> DeviceArray:
        """Copy a host array of the same shape and dtype into this one.

        Parameters
        ----------
        array : array_like
            The array's shape and dtype.

        Returns
        -------
        DeviceArray
            This array.

        Raises
        ------
        ValueError
            A shape or dtype other than the array's.
        ClosedError
            The array is closed.
        """
        self._require_open()
        a = np.asarray(array)
        if a.shape != self.shape or a.dtype != self.dtype:
            raise ValueError(f"array must have shape {self.shape} and dtype {self.dtype}, got {a.shape} {a.dtype}")
        flat, offset = np.ascontiguousarray(a).view(np.uint8).reshape(-1), 0
        if not self.is_contiguous:   # each row into its place, in one submission; the bytes between rows untouched
            rows, row_bytes = self._rows()
            self.device.upload_regions(flat, [(self._buffers[0], [(r * row_bytes, r * self.strides[0], row_bytes)
                                                                  for r in range(rows)])])
            return self
        for b in self._buffers:
            self.device.upload(b, flat[offset:offset + b.nbytes])
            offset += b.nbytes
        return self

    def close(self) -> None:
        """Free the device memory now; safe to call twice. A view's close() ends only its own use (the memory is
        its base's)."""
        if getattr(self, "_base", None) is not None:
            self._view_closed = True
            return
        for b in self._buffers:
            b.close()
        if self._address_table is not None:
            self._address_table.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        view = (f", view at byte {self._offset} of {self._base.shape}, pitch {self._pitch}"
                if getattr(self, "_base", None) is not None else "")
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device.info.name!r}{view}{state})"

    # -- Views ---------------------------------------------------------------------------------------------------

    @property
    def base(self) -> DeviceArray | None:
        """The array whose memory a view is (None for an array that is not a view), as numpy's `base`."""
        return self._base

    @property
    def offset(self) -> int:
        """Where the array's first element lies, in bytes from the start of its base's buffer (0 unless a view)."""
        return self._offset

    @property
    def binding(self) -> tuple:
        """What a launch recorded over this array depends on: its buffers' uids (a view's own range), shape, dtype and
        row pitch. Fixed for the array's life, and made once: ops key their kept launches and passed checks by it at
        every call. A closed array keeps it (the launch found by it refuses to run)."""
        binding = self.__dict__.get("_binding")
        if binding is None:
            binding = self._binding = (tuple(b.uid for b in self._buffers), self.shape, self.dtype, self._pitch)
        return binding

    @property
    def pitch(self) -> int:
        """Elements from one row of the first axis to the next: prod(shape[1:]) where contiguous."""
        return self._pitch

    @property
    def strides(self) -> tuple:
        """Bytes from one element to the next along each axis (numpy's convention): the first axis `pitch`
        elements, the others C-contiguous."""
        item = self.dtype.itemsize
        inner = [item * math.prod(self.shape[i + 1:]) for i in range(1, self.ndim)]
        return (self._pitch * item, *inner) if self.ndim else ()

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements lie in C order without gaps (numpy's flags.c_contiguous): always for arrays made
        here, and for views whose rows are consecutive."""
        return self.ndim == 0 or self.shape[0] <= 1 or self._pitch == math.prod(self.shape[1:])

    @property
    def flags(self) -> dict:
        """numpy-like flags: c_contiguous, owndata (False for views and arrays over another's buffer), view."""
        return {"c_contiguous": self.is_contiguous, "owndata": self._base is None, "view": self._base is not None}

    def _rows(self) -> tuple:
        """(rows of the first axis, bytes of one row) of a non-contiguous view."""
        return self.shape[0], math.prod(self.shape[1:]) * self.dtype.itemsize

    def _root_for_views(self, what: str) -> DeviceArray:
        self._require_open()
        root = self._base if self._base is not None else self
        if len(root._buffers) > 1:
            raise ValueError(f"{what}: {root!r} spans {len(root._buffers)} buffers (it is larger than one binding); "
                             "arrays split into segments have no views")
        return root

    def _view(self, shape: tuple, offset_elems: int, pitch: int, what: str) -> DeviceArray:
        """A view of this array's memory: `shape`, starting `offset_elems` elements after this array's first,
        rows `pitch` elements apart."""
        root = self._root_for_views(what)
        item = self.dtype.itemsize
        offset = self._offset + offset_elems * item
        size = math.prod(shape)
        rows = shape[0] if shape else 1
        span = 0 if size == 0 else ((rows - 1) * pitch + size // max(rows, 1)) * item
        if offset % 4 and size:
            raise ValueError(f"{what} starts at byte {offset} of its buffer, not a multiple of 4: kernels read "
                             "arrays as 32-bit words, so a view must start on one")
        if size == 0:   # nothing is read or written through it: bound as the base's first bytes
            offset = root._offset
        key = (offset, span)
        with _VIEW_LOCK:   # threads may slice one array at once
            ranges = root._view_ranges
            if ranges is None:
                ranges = root._view_ranges = OrderedDict()
            # Views of the same bytes share one range, so that a launch recorded with one view is reused by the same
            # view made again (an engine slices its fused projection anew every step).
            rng = ranges.get(key)
            if rng is None or rng.closed:
                rng = ranges[key] = BufferRange(root._buffers[0], offset - root._offset, span, clamp=True)
                while len(ranges) > VIEW_RANGES:
                    ranges.popitem(last=False)
            else:
                ranges.move_to_end(key)
        view = DeviceArray.__new__(DeviceArray)
        view.shape, view.dtype, view.device = shape, self.dtype, self.device
        view.segment_rows = shape[0] if shape else 1
        view._buffers, view._address_table = [rng], None
        view._base, view._offset, view._pitch, view._view_closed = root, offset, pitch, False
        view._view_ranges = None
        return view

    def __getitem__(self, index) -> DeviceArray:
        """A view: basic slicing with step 1 and integer indices, as numpy's, where the result keeps every axis
        but the first contiguous inside a row (rows of the first axis at a fixed pitch).

        ``qkv[:, :q_size]`` (a fused projection's query columns), ``cache[layer]``, ``a[i:j]`` and ``a[..., :64]``
        are views; a step other than 1, None, a boolean or array index, or a slice that leaves a row's elements
        apart (``x[:, :, :2]`` of x [tokens, heads, head_size] with several heads) is refused with a ValueError
        or TypeError naming the axis. A view must start on a 4-byte boundary (kernels read 32-bit words); to be
        bound to a kernel, on a multiple of the device's minStorageBufferOffsetAlignment (the ops say so).

        Returns
        -------
        DeviceArray
            A view of this array's memory (its `base`); it keeps the base alive, and closing it frees nothing.
        """
        what = f"{self!r}[{_index_str(index)}]"
        index = index if isinstance(index, tuple) else (index,)
        if sum(i is Ellipsis for i in index) > 1:
            raise IndexError(f"{what}: an index can only have a single ellipsis ('...')")
        if Ellipsis in [i for i in index if i is Ellipsis]:
            at = next(n for n, i in enumerate(index) if i is Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1:]
        if len(index) > self.ndim:
            raise IndexError(f"{what}: too many indices for an array of {self.ndim} dimensions")
        index = index + (slice(None),) * (self.ndim - len(index))
        item_strides = [s // self.dtype.itemsize for s in self.strides]
        offset, shape, strides = 0, [], []
        for axis, (i, n, st) in enumerate(zip(index, self.shape, item_strides)):
            if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
                k = int(i) + n if i < 0 else int(i)
                if not 0 <= k < n:
                    raise IndexError(f"{what}: index {int(i)} is out of bounds for axis {axis} with size {n}")
                offset += k * st
            elif isinstance(i, slice):
                start, stop, step = i.indices(n)
                if step != 1:
                    raise ValueError(f"{what}: axis {axis} has step {i.step}; device views take step 1 only "
                                     "(rows at a fixed pitch, each row contiguous)")
                offset += start * st if stop > start else 0
                shape.append(max(stop - start, 0))
                strides.append(st)
            else:
                raise TypeError(f"{what}: axis {axis}'s index {i!r} is not an int or a slice; device arrays take "
                                "basic slicing only (no None, boolean or array indices)")
        return self._strided(tuple(shape), strides, offset, what)

    def _strided(self, shape: tuple, strides: list, offset: int, what: str) -> DeviceArray:
        """The view of `shape` with element `strides`, `offset` elements in, where rows of the first axis at a
        fixed pitch with every other axis contiguous hold it; ValueError naming the axis otherwise."""
        expected = 1
        for axis in range(len(shape) - 1, 0, -1):
            if shape[axis] != 1 and strides[axis] != expected and math.prod(shape) != 0:
                raise ValueError(
                    f"{what}: axis {axis} would step {strides[axis]} elements where a contiguous row steps "
                    f"{expected}: a device view keeps everything but its first axis contiguous (slice the first "
                    "or the last axis, or a middle one only where the axes before it have one element)")
            expected *= shape[axis]
        pitch = strides[0] if shape and shape[0] > 1 else expected
        if not shape or math.prod(shape) == 0:
            pitch = expected
        return self._view(shape, offset, pitch, what)

    def reshape(self, *shape) -> DeviceArray:
        """A view of the same elements in another shape (one -1 is inferred), as numpy's reshape where no copy is
        needed: any shape for a contiguous array; for one with rows apart (a view), shapes that keep the first
        axis and reshape inside a row, such as ``qkv[:, :q_size].reshape(tokens, num_heads, head_size)``.

        Raises
        ------
        ValueError
            A shape of another size, or one that would need a copy (splitting or merging rows that are apart).
        """
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = tuple(int(n) for n in shape)
        what = f"{self!r}.reshape{shape}"
        if sum(n == -1 for n in shape) > 1 or any(n < -1 for n in shape):
            raise ValueError(f"{what}: at most one dimension may be -1, the others non-negative")
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            if known == 0 or self.size % known:
                raise ValueError(f"{what}: cannot infer -1 for {self.size} elements")
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"{what}: {self.size} elements cannot take shape {shape}")
        if self.is_contiguous:
            return self._view(shape, 0, math.prod(shape[1:]), what)
        if not shape or shape[0] != self.shape[0]:
            raise ValueError(f"{what}: the array's {self.shape[0]} rows lie {self._pitch} elements apart (a view), "
                             f"so a reshape must keep its first axis ({self.shape[0]}) and reshape inside a row; "
                             "this one would need a copy")
        return self._view(shape, 0, self._pitch, what)


VIEW_RANGES = 64   # per array: the ranges its views bind, most recently used kept
_VIEW_LOCK = threading.Lock()


def _index_str(index) -> str:
    def one(i):
        if isinstance(i, slice):
            return ":".join("" if v is None else str(v) for v in (i.start, i.stop)) + (
                f":{i.step}" if i.step is not None else "")
        return "..." if i is Ellipsis else repr(i)
    return ", ".join(map(one, index if isinstance(index, tuple) else (index,)))


# What the ops take for an array argument: numpy arrays are copied to the device for the call, DeviceArrays are
# used where they are.
Array = Union[np.ndarray, "DeviceArray"]


def segment_limit(device) -> int:
    """The most bytes one buffer of a device array may hold: what one binding can address and one allocation
    can hold, whichever is less."""
    info = device.info
    limit = min(info.max_storage_buffer_range, info.max_allocation_bytes or info.max_storage_buffer_range)
    return limit // 16 * 16


# Set by the test suite (tests/conftest.py): empty() arrays then start with every bit set (NaN in every float
# type), so an output or scratch a kernel never wrote shows in the result instead of memory that may still hold
# an earlier run's right answer.
POISON_EMPTY = False


def empty(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32, device: DeviceLike = None, *,
          host_visible: bool = False) -> DeviceArray:
    """An uninitialised device array.

    Parameters
    ----------
    shape : int or tuple of int
    dtype : numpy dtype, default float32
        One of `DeviceArray`'s dtypes.
    device : Device, DeviceInfo, int or str, optional
        None means the default device.
    host_visible : bool, default False
        In mapped host memory (`DeviceArray`'s parameter): for small inputs rewritten every step.

    Returns
    -------
    DeviceArray
    """
    a = DeviceArray(shape, dtype, device, host_visible=host_visible)
    if POISON_EMPTY:
        for b in a.buffers:
            a.device.fill(b, 0xFFFFFFFF)
    return a


def zeros(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32, device: DeviceLike = None) -> DeviceArray:
    """A device array of zeros; the arguments are `empty`'s.

    Returns
    -------
    DeviceArray
    """
    a = DeviceArray(shape, dtype, device)
    for b in a.buffers:
        a.device.fill(b, 0)
    return a


def asarray(array: ArrayLike | DeviceArray, device: DeviceLike = None, dtype: DTypeLike | None = None) -> DeviceArray:
    """A device copy of a host array; a DeviceArray already on that device, of that dtype, is returned as it is.

    Parameters
    ----------
    array : array_like or DeviceArray
        Any shape; one of `DeviceArray`'s dtypes (after `dtype`).
    device : Device, DeviceInfo, int or str, optional
        None means the default device (a DeviceArray: its own).
    dtype : numpy dtype, optional
        Convert to it first; None keeps the array's dtype.

    Returns
    -------
    DeviceArray
    """
    if isinstance(array, DeviceArray):
        if (device is None or get_device(device) is array.device) and (dtype is None or np.dtype(dtype) == array.dtype):
            return array
        array = array.numpy()
    host = np.ascontiguousarray(array, dtype=dtype)
    return DeviceArray(host.shape, host.dtype, device).write(host)
