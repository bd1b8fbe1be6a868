"""What the cooperative-matrix kernels (shaders/*_coopmat.comp: the prefill forward and backward, and the decode)
need of a device: one multiply shape of float16 (or, for the bfloat16 modules, bfloat16) operands with float32
accumulation, 32-invocation subgroups, shuffles, and the features their modules declare (abi.VariantKey.requires)."""

from __future__ import annotations

import dataclasses

from ..runtime.instance import DeviceInfo, MatrixShape
from .abi import VariantKey

# The multiply the matrix kernels are written with, and the subgroup size they assume (the prefill softmax's two
# lanes for each of a subgroup's 16 rows; the decode's 16 lanes for a block's 16 tokens).
MATRIX_SHAPE = MatrixShape(16, 16, 16, "f16", "f16", "f32", "f32", "subgroup")
MATRIX_SUBGROUP = 32
MATRIX_KIND = "coopmat"


def operand_type(kv: str, q: str) -> str:
    """The matrices' operand type for a module's cache and query storage: bfloat16 for bfloat16 caches and
    queries, float16 otherwise (float16 caches; fp8 caches are widened to float16)."""
    return "bf16" if kv == q == "bf16" else "f16"


def with_operands(shape: MatrixShape, operand: str) -> MatrixShape:
    """The same multiply with A and B of `operand`."""
    return dataclasses.replace(shape, a=operand, b=operand)


def offers(info: DeviceInfo, shape: MatrixShape) -> bool:
    """Whether the device lists this multiply (saturation aside: it concerns integer types only)."""
    key = lambda s: (s.m, s.n, s.k, s.a, s.b, s.c, s.result, s.scope)
    return any(key(s) == key(shape) for s in info.matrix_shapes)


def matrix_unavailable(info: DeviceInfo, features=None, operand: str = "f16", backend: str = "glsl") -> str:
    """Why the device cannot run the cooperative-matrix kernels of this operand type ("f16" or "bf16") in this
    backend, or "" if it can. `features`: the Vulkan features a Device enabled (pagedvk.Device.features), where one
    is open; they are checked against what the backend's modules require (WGSL's: 16-bit storage too)."""
    shape = with_operands(MATRIX_SHAPE, operand)
    if not offers(info, shape):
        return f"it lists no {shape} cooperative-matrix multiply (VK_KHR_cooperative_matrix)"
    if info.subgroup_size != MATRIX_SUBGROUP:
        return f"its subgroup size is {info.subgroup_size}, not {MATRIX_SUBGROUP}"
    if not info.subgroup_shuffle:   # lanes meet through subgroupShuffleXor
        return "it has no subgroup shuffles in compute shaders (VK_SUBGROUP_FEATURE_SHUFFLE_BIT)"
    needs = VariantKey("", backend, kv=operand, q=operand, matrix=MATRIX_KIND).requires()
    missing = [f for f in needs if f not in features] if features is not None else []
    return (f"pagedvk did not enable the Vulkan feature(s) {', '.join(missing)} on it (the device lacks them, or "
            f"a validation layer older than Vulkan 1.3.255 is on)") if missing else ""
