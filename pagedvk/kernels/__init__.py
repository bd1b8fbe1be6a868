"""Layer 2, the kernels as data: the ABI mechanism (abi: bindings, push constants, module keys), the SPIR-V toolkit
(spirv, spirv_passes) that the build and the reflection tests share, the rules for a device's matrix units
(matrix) and the loading of built modules into pipelines (modules). Above the runtime, below the ops.

This package's __init__ imports nothing: build_shaders.py loads abi, spirv and spirv_passes by path without the
run-time dependencies (vulkan, numpy), which `pip install .` may not have yet."""
