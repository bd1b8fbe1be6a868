"""Which Vulkan device pagedvk runs on: PAGEDVK_DEVICE, or the best kind of device there is."""

from __future__ import annotations

import threading
from typing import Union

from .. import config
from ..errors import DeviceNotFoundError
from .device import Device
from .instance import TYPE_PREFERENCE, DeviceInfo, get_instance

# What a `device` argument takes (get_device): None (the default device), a Device, a DeviceInfo, an index or a
# case-insensitive name substring.
DeviceLike = Union[Device, DeviceInfo, int, str, None]

_open: dict = {}  # device index -> Device
_lock = threading.Lock()


def devices() -> list[DeviceInfo]:
    """Every Vulkan physical device.

    Returns
    -------
    list of DeviceInfo
        One per device, in Vulkan's order (DeviceInfo.index).
    """
    return list(get_instance().physical_devices())


def _listing(infos) -> str:
    return "\n".join(f"  {info}" for info in infos) or "  (none: is a Vulkan driver installed?)"


def select(spec: str | int | None = None) -> tuple[DeviceInfo, str]:
    """The device a spec names, and why it was chosen.

    Parameters
    ----------
    spec : int or str, optional
        A device index or a case-insensitive name substring. None means the PAGEDVK_DEVICE variable, else the
        first device of the most preferred type (discrete > integrated > virtual > cpu > other).

    Returns
    -------
    info : DeviceInfo
    reason : str
        How it was chosen ("argument index 0", "PAGEDVK_DEVICE name match 'nvidia'", "most preferred type ...").

    Raises
    ------
    DeviceNotFoundError
        No device matches, or there are no Vulkan devices at all; the message lists the devices.
    """
    infos = devices()
    source = "argument"
    if spec is None and config.device() is not None:
        spec, source = config.device(), "PAGEDVK_DEVICE"
    if spec is None:
        if not infos:
            raise DeviceNotFoundError("no Vulkan devices found: install a Vulkan driver "
                                      "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1)")
        best = min(infos, key=lambda i: (TYPE_PREFERENCE.index(i.type), i.index))
        return best, f"most preferred type ({' > '.join(TYPE_PREFERENCE)})"
    text = str(spec).strip()
    if text.isascii() and text.isdigit():   # '²' is a digit to str.isdigit, and int() refuses it
        index = int(text)
        if index < len(infos):
            return infos[index], f"{source} index {index}"
        raise DeviceNotFoundError(f"{source}={text!r}: no device with index {text}; devices:\n{_listing(infos)}")
    matches = [i for i in infos if text.lower() in i.name.lower()]
    if not matches:
        raise DeviceNotFoundError(f"{source}={text!r} matches no device name; devices:\n{_listing(infos)}")
    return matches[0], f"{source} name match {text!r}"


def open_device(info: DeviceInfo) -> Device:
    """The process's open Device for a physical device, opened on first use (and again after a loss or close)."""
    with _lock:
        device = _open.get(info.index)
        if device is not None and device.lost is not None:
            device.close()   # a lost device runs nothing more: the next user gets a new one
        if device is None or device.closed:
            device = _open[info.index] = Device(info)
        return device


def open_devices() -> list[Device]:
    """The Devices open_device() has opened in this process and keeps (closed ones included, until reopened),
    one per physical device index; a copy, for closing them all or checking that none was opened."""
    with _lock:
        return list(_open.values())


def default_device() -> Device:
    """The device pagedvk uses when none is given: the one `select()` picks, opened once and shared.

    Returns
    -------
    Device
    """
    return open_device(select()[0])


def get_device(device: DeviceLike = None) -> Device:
    """A Device from any of the forms a `device` argument takes.

    Parameters
    ----------
    device : Device, DeviceInfo, int or str, optional
        None means the default device; a Device is returned as it is (ClosedError if closed); a DeviceInfo, an
        index or a name substring is opened (or its open Device returned).

    Returns
    -------
    Device

    Raises
    ------
    TypeError
        Any other kind of argument.
    DeviceNotFoundError
        No device matches an index or name.
    """
    if device is None:
        return default_device()
    if isinstance(device, Device):
        device.require_open()
        return device
    if isinstance(device, DeviceInfo):
        return open_device(device)
    if isinstance(device, (int, str)) and not isinstance(device, bool):
        return open_device(select(device)[0])
    raise TypeError(f"device must be None, a Device, an index or a name, not {type(device).__name__}")
