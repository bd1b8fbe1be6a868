"""The element types pagedvk stores on the device, and what each is called in numpy, the kernels and vLLM.

bfloat16 and the fp8 types come from ml_dtypes (the numpy extension JAX uses). Every type is read by the
kernels through 32-bit words and converted there (shaders/kv_storage.glsl), so no device feature is needed
for any of them: every Vulkan device runs every type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class StorageType:
    """One element type: `tag` names its kernel variants (pagedvk.kernels.abi.STORAGE_TYPES), `dtype` is numpy's."""

    tag: str
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def x(self) -> int:
        """vLLM's key packing: elements per 16-byte chunk."""
        return 16 // self.itemsize

    def __str__(self) -> str:
        return str(self.dtype)


FLOAT32 = StorageType("f32", np.dtype(np.float32))
FLOAT16 = StorageType("f16", np.dtype(np.float16))
BFLOAT16 = StorageType("bf16", np.dtype(ml_dtypes.bfloat16))
FP8_E4M3 = StorageType("e4m3", np.dtype(ml_dtypes.float8_e4m3fn))
FP8_E5M2 = StorageType("e5m2", np.dtype(ml_dtypes.float8_e5m2))

CACHE_TYPES = {t.dtype: t for t in (FLOAT32, FLOAT16, BFLOAT16, FP8_E4M3, FP8_E5M2)}
QUERY_TYPES = {t.dtype: t for t in (FLOAT32, FLOAT16, BFLOAT16)}
GRADIENT_CACHE_TYPES = {t.dtype: t for t in (FLOAT32, FLOAT16, BFLOAT16)}

# vLLM's kv_cache_dtype strings, for caches that arrive as uint8 (as vLLM allocates fp8 caches).
KV_CACHE_DTYPES = {"fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2}


def _names(table) -> str:
    return ", ".join(str(d) for d in table)


def storage_type(name: str, a, table=CACHE_TYPES) -> StorageType:
    """The storage type of array argument `name`; TypeError naming the argument and the types allowed."""
    dtype = np.dtype(a.dtype)
    if dtype not in table:
        raise TypeError(f"{name} must have dtype {_names(table)}; got {dtype}")
    return table[dtype]


def cache_type(name: str, a, kv_cache_dtype: str = "auto", table=CACHE_TYPES) -> StorageType:
    """A cache's storage type: its dtype's, or with vLLM's kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" a
    uint8 (or matching fp8) cache read as that fp8 type."""
    if kv_cache_dtype == "auto":
        return storage_type(name, a, table)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    stype = KV_CACHE_DTYPES[kv_cache_dtype]
    if stype.dtype not in table:
        raise TypeError(f"{name}: kv_cache_dtype={kv_cache_dtype!r} is not supported here")
    if np.dtype(a.dtype) not in (np.dtype(np.uint8), stype.dtype):
        raise TypeError(f"{name} must be uint8 (or {stype.dtype}) with kv_cache_dtype={kv_cache_dtype!r}, "
                        f"got {a.dtype}")
    return stype


# The kernels compute in float32: a scale or cap is checked there, not in float64, where 1e39 is finite and 1e-300
# is not zero. Normal numbers only: GPUs may flush subnormals to zero.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_fp8(storage: StorageType) -> bool:
    """Whether a cache stores fp8, whose k_scale / v_scale the kernels apply; other caches ignore them (vLLM)."""
    return storage.itemsize == 1


def fp8_scale(name: str, value) -> float:
    """vLLM's k_scale / v_scale: one positive number (a 1-element array is taken too) that float32 holds as a
    normal number, as the kernels use it."""
    v = np.asarray(value, dtype=np.float64) if not isinstance(value, (str, bytes)) and value is not None else None
    if v is None or v.dtype == object or v.size != 1:
        raise ValueError(f"{name} must be one positive finite number, got {value!r}")
    x = float(v.reshape(()))
    if not (math.isfinite(x) and FLOAT32_TINY <= x <= FLOAT32_MAX):
        raise ValueError(f"{name} must be one positive finite number within float32's normal range "
                         f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (the kernels compute in float32), got {value!r}")
    return x


def scaled(name: str, scale: float, factor: float) -> float:
    """scale * factor as the kernels take it (the softmax scale times k_scale): ValueError naming `name` when the
    product overflows float32."""
    product = scale * factor
    if not abs(product) <= FLOAT32_MAX:
        raise ValueError(f"{name} ({factor:g}) times the softmax scale ({scale:g}) is {product:g}, more than float32 "
                         f"holds ({FLOAT32_MAX:.4g}); the kernels multiply the logits by it")
    return product


def device_dtypes(info) -> list:
    """The cache dtypes a device runs (`pagedvk devices` lists them). Every type is read through 32-bit
    words, so every Vulkan device runs all of them; the function is where a type that needs a device feature
    would be filtered out."""
    return [str(t) for t in CACHE_TYPES.values()]
