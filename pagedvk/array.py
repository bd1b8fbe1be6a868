"""Device arrays: a shape and dtype over one device buffer, so data such as a KV cache stays on the GPU."""

from __future__ import annotations

import numpy as np

from .errors import ClosedError
from .runtime.owned import Owned
from .selection import get_device

DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float16, np.int32, np.uint32, np.int8, np.uint8))


def _dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported on the device (supported: {', '.join(map(str, DTYPES))})")
    return dt


def _shape(shape) -> tuple:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(n, (int, np.integer)) or n < 0 for n in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape}")
    return tuple(int(n) for n in shape)


class DeviceArray(Owned):
    """A C-contiguous array in device memory. `numpy()` copies it back to the host."""

    def __init__(self, shape, dtype, device=None):
        self.shape = _shape(shape)
        self.dtype = _dtype(dtype)
        self.device = get_device(device)
        nbytes = self.nbytes
        limit = self.device.info.max_storage_buffer_range
        if nbytes > limit:
            raise ValueError(
                f"an array of {nbytes} bytes (shape {self.shape}, {self.dtype}) exceeds {self.device.info.name}'s "
                f"maxStorageBufferRange of {limit} bytes: one kernel binding cannot address it")
        self._buffer = self.device.buffer(nbytes)

    @property
    def buffer(self):
        """The device buffer; ClosedError once the array is closed, so a closed array can never be bound to
        a kernel (it would reach the GPU as a null descriptor)."""
        self._require_open()
        return self._buffer

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def closed(self) -> bool:
        buffer = getattr(self, "_buffer", None)   # none when __init__ failed
        return buffer is None or buffer.closed

    def _require_open(self) -> None:
        if self.closed:
            raise ClosedError(f"{self!r} is closed"
                              + (f" (its device {self.device.info.name} was closed)" if self.device.closed else ""))

    def numpy(self) -> np.ndarray:
        self._require_open()
        return self.device.download(self.buffer, self.nbytes).view(self.dtype).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        # numpy's protocol: copy=False asks for a view, which device memory cannot give.
        if copy is False:
            raise ValueError("a DeviceArray lives in device memory: numpy cannot view it without a copy "
                             "(copy=False); use np.asarray(a) or a.numpy(), which copy it")
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def write(self, array) -> "DeviceArray":
        """Copy a host array of the same shape and dtype into this one."""
        self._require_open()
        a = np.asarray(array)
        if a.shape != self.shape or a.dtype != self.dtype:
            raise ValueError(f"array must have shape {self.shape} and dtype {self.dtype}, got {a.shape} {a.dtype}")
        self.device.upload(self.buffer, a)
        return self

    def close(self) -> None:
        """Free the device memory now; safe to call twice."""
        self._buffer.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device.info.name!r}{state})"


def empty(shape, dtype=np.float32, device=None) -> DeviceArray:
    """An uninitialised device array."""
    return DeviceArray(shape, dtype, device)


def zeros(shape, dtype=np.float32, device=None) -> DeviceArray:
    a = DeviceArray(shape, dtype, device)
    a.device.fill(a.buffer, 0)
    return a


def asarray(array, device=None, dtype=None) -> DeviceArray:
    """A device copy of a host array (a DeviceArray on the same device is returned as it is)."""
    if isinstance(array, DeviceArray):
        if (device is None or get_device(device) is array.device) and (dtype is None or np.dtype(dtype) == array.dtype):
            return array
        array = array.numpy()
    host = np.ascontiguousarray(array, dtype=dtype)
    out = DeviceArray(host.shape, host.dtype, device)
    out.device.upload(out.buffer, host)
    return out
