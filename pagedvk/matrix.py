"""What the cooperative-matrix kernels (shaders/*_coopmat.comp: the prefill forward and backward, and the decode)
need of a device: one float16 multiply shape with float32 accumulation, 32-invocation subgroups, shuffles, and
the features their modules declare (abi.VariantKey.requires)."""

from __future__ import annotations

from .abi import VariantKey
from .runtime.instance import DeviceInfo, MatrixShape

# The multiply the matrix kernels are written with, and the subgroup size they assume (the prefill softmax's two
# lanes for each of a subgroup's 16 rows; the decode's 16 lanes for a block's 16 tokens).
MATRIX_SHAPE = MatrixShape(16, 16, 16, "f16", "f16", "f32", "f32", "subgroup")
MATRIX_SUBGROUP = 32
MATRIX_KIND = "coopmat"


def offers(info: DeviceInfo, shape: MatrixShape) -> bool:
    """Whether the device lists this multiply (saturation aside: it concerns integer types only)."""
    key = lambda s: (s.m, s.n, s.k, s.a, s.b, s.c, s.result, s.scope)
    return any(key(s) == key(shape) for s in info.matrix_shapes)


def matrix_unavailable(info: DeviceInfo, features=None) -> str:
    """Why the device cannot run the cooperative-matrix kernels, or "" if it can. `features`: the Vulkan
    features a Device enabled (pagedvk.Device.features), where one is open."""
    if not offers(info, MATRIX_SHAPE):
        return f"it lists no {MATRIX_SHAPE} cooperative-matrix multiply (VK_KHR_cooperative_matrix)"
    if info.subgroup_size != MATRIX_SUBGROUP:
        return f"its subgroup size is {info.subgroup_size}, not {MATRIX_SUBGROUP}"
    if not info.subgroup_shuffle:   # lanes meet through subgroupShuffleXor
        return "it has no subgroup shuffles in compute shaders (VK_SUBGROUP_FEATURE_SHUFFLE_BIT)"
    needs = VariantKey("", "glsl", matrix=MATRIX_KIND).requires()
    missing = [f for f in needs if f not in features] if features is not None else []
    return (f"pagedvk did not enable the Vulkan feature(s) {', '.join(missing)} on it (the device lacks them, or "
            f"a validation layer older than Vulkan 1.3.255 is on)") if missing else ""
