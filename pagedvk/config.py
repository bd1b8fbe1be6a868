"""The PAGEDVK_* environment variables, each parsed in one place and checked before any work is submitted.

A bad value raises ValueError naming the variable and what it may hold; it must never surface later as an
error from deep inside a submission (a timeout that does not convert once left GPU work untracked).

Stdlib-only: build_shaders.py loads pagedvk.kernels.abi, which reads BACKENDS here, without the run-time
dependencies.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_COMPILE_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = (2**64 - 1) / 1e9 / 2   # the nanosecond value must fit vkWaitForFences's uint64, with room
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


@functools.lru_cache(maxsize=64)   # read at every launch: parse each text once (a bad one raises each time)
def _parse_ns(name: str, text: str | None, default: float, unit: str, unit_ns: float, low_open: bool,
              high: float, high_text: str) -> int:
    """A PAGEDVK_* number in `unit` (unit_ns nanoseconds each), in (0, high] or [0, high], as nanoseconds."""
    if not text:
        return int(default * unit_ns)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if low_open else value >= 0) and value <= high):
        raise ValueError(f"{name} must be a number of {unit} in {'(' if low_open else '['}0, {high_text}], "
                         f"got {text!r}")
    ns = int(value * unit_ns)
    return max(1, ns) if low_open else ns


def _seconds_ns(name: str, default: float) -> int:
    return _parse_ns(name, _get(name), default, "seconds", 1e9, True, MAX_TIMEOUT_S, f"{MAX_TIMEOUT_S:.3g}")


def timeout_ns() -> int:
    """PAGEDVK_TIMEOUT (seconds, default 60) in nanoseconds: how long any fence is waited on."""
    return _seconds_ns("PAGEDVK_TIMEOUT", DEFAULT_TIMEOUT_S)


def compile_timeout_ns() -> int:
    """PAGEDVK_COMPILE_TIMEOUT (seconds, default 600) in nanoseconds: how long a new pipeline's driver compile
    may take. Drivers that compile at the first dispatch (lavapipe) are given this, never PAGEDVK_TIMEOUT
    (pagedvk.runtime.pipeline.Pipeline)."""
    return _seconds_ns("PAGEDVK_COMPILE_TIMEOUT", DEFAULT_COMPILE_TIMEOUT_S)


# GPUs; CPU devices (lavapipe) default to 0: a spinning thread takes a core from the kernel. 20 us catches short work
# at once and leaves long waits to the driver, which sleeps: on an H100 a 32-layer decode step's wait cost the
# waiting thread 3.7% of the wait with 20 us, 51% with 1000 us (benchmarks/step.py, 2026-12-06).
DEFAULT_SPIN_US = 20.0
MAX_SPIN_US = 1e6


def spin_ns(cpu_device: bool) -> int:
    """PAGEDVK_SPIN_US (microseconds; default 20 on GPUs, 0 on CPU devices) in nanoseconds: how long a wait
    polls its fence before it sleeps in the driver. A driver's blocking wait wakes the thread tens of
    microseconds after the GPU finished (NVIDIA, measured: BENCHMARKS.md, host time); polling sees it at once,
    at the price of a busy core while the GPU works, as CUDA's default spin-then-block scheduling does."""
    return _parse_ns("PAGEDVK_SPIN_US", _get("PAGEDVK_SPIN_US"), 0.0 if cpu_device else DEFAULT_SPIN_US,
                     "microseconds", 1e3, False, MAX_SPIN_US, f"{MAX_SPIN_US:g}")


# The kernel languages, PAGEDVK_BACKEND's values, the first the default. Declared here, in the bottom layer, because
# this module checks the variable; pagedvk.kernels.abi (which build_shaders.py loads without the package) reads it.
BACKENDS = ("glsl", "wgsl")
DECODE_KERNELS = ("cpu", "gpu", "coopmat")


def decode_kernel(argument: str | None = None) -> str | None:
    """The decode kernel's shape: the `kernel` argument if given, else PAGEDVK_DECODE_KERNEL ("cpu": the kernel
    for CPU devices, shaders/paged_decode_cpu.comp; "gpu": shaders/paged_decode.comp; "coopmat":
    shaders/paged_decode_coopmat.comp; any case), else None: by the device and the plan
    (pagedvk.ops.decode_rules.decode_target, pagedvk.ops.decode_rules.decode_matrix)."""
    source, text = ("kernel", argument) if argument is not None else ("PAGEDVK_DECODE_KERNEL",
                                                                     _get("PAGEDVK_DECODE_KERNEL"))
    if not text and argument is None:
        return None
    if not isinstance(text, str) or text.strip().lower() not in DECODE_KERNELS:
        raise ValueError(f"{source} must be one of {', '.join(DECODE_KERNELS)} (any case), got {text!r}")
    return text.strip().lower()


def backend(argument: str | None = None) -> str:
    """The kernel language: the `backend` argument if given, else PAGEDVK_BACKEND, else glsl (any case)."""
    source, text = ("backend", argument) if argument is not None else ("PAGEDVK_BACKEND", _get("PAGEDVK_BACKEND"))
    if not text and argument is None:
        return BACKENDS[0]
    if not isinstance(text, str) or text.strip().lower() not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)} (any case), got {text!r}")
    return text.strip().lower()


def validation() -> bool:
    """PAGEDVK_VALIDATION: whether the Khronos validation layer checks every call."""
    text = (_get("PAGEDVK_VALIDATION") or "").lower()
    if text not in TRUE + FALSE:
        raise ValueError(f"PAGEDVK_VALIDATION must be one of {', '.join(TRUE + FALSE[:-1])} or empty (any case), "
                         f"got {os.environ['PAGEDVK_VALIDATION']!r}")
    return text in TRUE


def device() -> str | None:
    """PAGEDVK_DEVICE: a device index or name substring, or None when unset or blank."""
    return _get("PAGEDVK_DEVICE") or None


def spv_dir(default: Path) -> Path:
    """PAGEDVK_SPV_DIR: the folder of SPIR-V modules (build_shaders.py --out), `default` (the package's) when
    unset or blank. Read when pagedvk.kernels.modules is imported; a folder that is not there is refused by
    check_all()."""
    text = _get("PAGEDVK_SPV_DIR")
    return Path(text) if text else default


def check_spv_dir() -> None:
    text = _get("PAGEDVK_SPV_DIR")
    if text and not Path(text).is_dir():
        raise ValueError(f"PAGEDVK_SPV_DIR must be a folder of SPIR-V modules (build_shaders.py --out), got {text!r}, "
                         "which is not a folder")


# Command buffers a stream submits in one vkQueueSubmit at most. Each submission costs the GPU a gap of about 8.6 us
# on NVIDIA's driver (an H100, benchmarks/step.py, 2026-12-06), so ops queued while two submissions are still running
# wait on the host and go together (Stream.enqueue); 1 submits every op on its own.
DEFAULT_BATCH = 32
MAX_BATCH = 1024


def batch() -> int:
    """PAGEDVK_BATCH (an int in [1, 1024], default 32): how many queued ops a stream submits together at most."""
    return _parse_batch(_get("PAGEDVK_BATCH"))


@functools.lru_cache(maxsize=16)   # read at every queued op
def _parse_batch(text: str | None) -> int:
    if not text:
        return DEFAULT_BATCH
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_BATCH:
        raise ValueError(f"PAGEDVK_BATCH must be an int in [1, {MAX_BATCH}] (command buffers per submission), "
                         f"got {text!r}")
    return value


def check_all() -> None:
    """Parse every variable, so a bad one is reported before anything is made or submitted (a bad
    PAGEDVK_SPIN_US read at the first wait once segfaulted: the wait raised with the work still running)."""
    timeout_ns()
    compile_timeout_ns()
    spin_ns(cpu_device=False)
    batch()
    backend()
    validation()
    device()
    decode_kernel()
    check_spv_dir()
