"""What every op resolves the same way from its arguments: the device, the kernel language, the softmax
scale. Below the ops, so no op imports another op's helpers."""

from __future__ import annotations

import math

import numpy as np

from .. import config
from ..dtypes import FLOAT32_MAX
from ..runtime.array import DeviceArray
from ..runtime.selection import get_device


def device_of(*arrays, device=None):
    """The one device of the given device arrays (and `device`), else the default device; ValueError
    naming each device when they differ (two Device objects on one GPU are told apart by their serials)."""
    devices = {id(a.device): a.device for a in arrays if isinstance(a, DeviceArray)}
    if device is not None:
        devices.setdefault(id(get_device(device)), get_device(device))
    if len(devices) > 1:
        raise ValueError("all device arrays (and device=) must be on one device, got "
                         + ", ".join(map(repr, devices.values())))
    return next(iter(devices.values())) if devices else get_device(None)


def backend_name(backend: str | None) -> str:
    """The kernel language: `backend` if given, else PAGEDVK_BACKEND, else glsl (see config.backend)."""
    return config.backend(backend)


def check_scale(scale) -> None:
    """A softmax scale argument: None or a real number float32 holds (the kernels' precision)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, not {type(scale).__name__} ({scale!r})")
    if not (math.isfinite(float(scale)) and abs(float(scale)) <= FLOAT32_MAX):
        raise ValueError(f"scale must be finite and representable as float32 (|scale| <= {FLOAT32_MAX:.4g}), "
                         f"got {scale}")


def softmax_scale(scale, head_size: int) -> float:
    """The softmax scale: `scale` (checked), or 1 / sqrt(head_size) when it is None."""
    check_scale(scale)
    return 1.0 / math.sqrt(head_size) if scale is None else float(scale)
