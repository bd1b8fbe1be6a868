"""A linear layer, y = x @ weight.T (+ bias), on the device: a matrix-vector kernel for the decode's few tokens, which
reads each weight once for up to eight tokens, and a tiled matrix product for prefill (shaders/linear_gemv.comp,
linear_gemm.comp and their WGSL twins). Quantized GGUF weights are turned into float16 or float32 when loaded
(pagedvk.ops.quant.dequantize)."""

from __future__ import annotations

import numpy as np

from ..dtypes import QUERY_TYPES, storage_type
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import (LINEAR_GEMM, LINEAR_GEMM_TILE, LINEAR_GEMV, LINEAR_GEMV_CPU_HELD, LINEAR_GEMV_CPU_ROWS,
                                  LINEAR_GEMV_ROWS, LINEAR_GEMV_TOKENS, LinearSpec)
from ..kernels.matrix import MATRIX_KIND, matrix_unavailable
from ..runtime.array import Array, DeviceArray, asarray, empty, segment_limit
from ..runtime.pipeline import TEXEL_BYTES, fold_grid
from ..runtime.recording import active_recording, dispatch, require_device_arrays
from . import checks
from .opargs import backend_name, device_of

LINEAR_KERNELS = ("auto", "gemv", "gemm", "coopmat", "gemv-cpu", "gemv-gpu")
MIN_CPU_LANES = 4   # shaders/linear_gemv_cpu.comp's MIN_LANES


def linear_kernel(tokens: int) -> str:
    """The kernel "auto" picks: the matrix-vector one while its weights, read once per LINEAR_GEMV_TOKENS tokens, are
    read once in all (a decode step's batch); the tiled product beyond, which reads them once per 64 tokens."""
    return "gemv" if tokens <= LINEAR_GEMV_TOKENS else "gemm"


def coopmat_unavailable(device, backend: str, weight_tag: str, in_features: int) -> str:
    """Why shaders/linear_gemm_coopmat.comp cannot run this call, or "": it is GLSL, for float16 weights whose rows
    are whole 16-byte chunks (in_features a multiple of 8), on devices with kernels/matrix.py's multiply."""
    if backend != "glsl":
        return "the cooperative-matrix linear kernel is GLSL only"
    if weight_tag != "f16":
        return f"the cooperative-matrix linear kernel takes float16 weights, not {weight_tag}"
    if in_features % 8:
        return f"the cooperative-matrix linear kernel takes in_features a multiple of 8, not {in_features}"
    return matrix_unavailable(device.info, device.features)


def linear_target(info, backend: str, kernel: str = "gemv") -> str:
    """The matrix-vector kernel's abi.TARGETS tag: "cpu" (shaders/linear_gemv_cpu.comp) on CPU devices
    (info.type "cpu") or where `kernel` is "gemv-cpu"; "" (shaders/linear_gemv.comp, the one GPUs run) otherwise, or
    "gemv-gpu" forced. lavapipe loads memory lane by lane and reads shared memory likewise, and linear_gemv.comp
    moved weights at 42-48 MB/s there (BENCHMARKS.md, "Linear layers on lavapipe"). The CPU kernel is GLSL only and
    needs subgroup arithmetic with subgroups of at least 4 invocations; elsewhere the generic kernel runs, forced or
    not."""
    wanted = info.type == "cpu" if kernel in ("gemv", "auto") else kernel == "gemv-cpu"
    able = backend == "glsl" and info.subgroup_arithmetic and info.subgroup_size >= MIN_CPU_LANES
    return "cpu" if wanted and able else ""


def describe_linear_kernel(info) -> str:
    """Which matrix-vector kernel (up to 8 tokens) a device's GLSL calls of pagedvk.linear run by default."""
    if linear_target(info, "glsl") == "cpu":
        return "cpu (shaders/linear_gemv_cpu.comp; WGSL calls run the gpu kernel)"
    return "gpu (shaders/linear_gemv.comp)"


def cpu_pass_tokens(tokens: int) -> int:
    """The CPU kernel's tokens a pass (LinearSpec.TOKENS): 1, 2, 4 or 8, the fewest at least min(tokens, 8), so that
    a decode's few tokens run no idle sums and a device builds at most four such pipelines per type pair."""
    n = min(max(tokens, 1), LINEAR_GEMV_TOKENS)
    return 1 << (n - 1).bit_length()


def cpu_texels_refused(info, weight) -> str | None:
    """Why the CPU kernel cannot bind `weight` as its texel buffer on this device (more texels than
    maxTexelBufferElements, or a view starting off minTexelBufferOffsetAlignment), or None where it can."""
    offset = weight.offset if isinstance(weight, DeviceArray) else 0
    texels = -(-weight.nbytes // TEXEL_BYTES)
    if texels > info.max_texel_buffer_elements:
        return (f"its {texels} texels of {TEXEL_BYTES} bytes are more than {info.name} binds as a texel buffer "
                f"(maxTexelBufferElements {info.max_texel_buffer_elements})")
    if offset % info.min_texel_buffer_offset_alignment:
        return (f"it starts {offset} bytes into its buffer, off {info.name}'s minTexelBufferOffsetAlignment "
                f"({info.min_texel_buffer_offset_alignment})")
    return None


def cpu_lanes(info) -> int:
    """The CPU kernel's workgroup size (LinearSpec.LANES): one subgroup, the device's."""
    return info.subgroup_size


def cpu_held_chunks(in_features: int, weight_tag: str, lanes: int, pass_tokens: int) -> int:
    """The x chunks a lane of the CPU kernel holds in registers a token (LinearSpec.HELD): enough for a row's chunks
    of 16 bytes of weights over the subgroup's lanes, or 0 (x read again every pass) where rows straddle chunks or
    the chunks times the pass's tokens exceed LINEAR_GEMV_CPU_HELD (the compile time grows with them)."""
    per = 4 if weight_tag == "f32" else 8
    if in_features % per:
        return 0
    held = -(-in_features // per // lanes)
    return held if held * pass_tokens <= LINEAR_GEMV_CPU_HELD else 0


def linear(x: Array, weight: Array, bias: Array | None = None, out: Array | None = None, *,
           kernel: str = "auto", backend: str | None = None) -> Array:
    """y = x @ weight.T + bias (PyTorch's and vLLM's linear layer), accumulated in float32.

    Parameters
    ----------
    x : DeviceArray or numpy.ndarray, shape (tokens, in_features)
        float32, float16 or bfloat16.
    weight : DeviceArray or numpy.ndarray, shape (out_features, in_features)
        float32, float16 or bfloat16, row-major (PyTorch's, GGUF's; ``pagedvk.ops.quant.dequantize`` turns GGUF's
        Q4_0, Q4_1 and Q8_0 blocks into such an array). At most one binding's bytes (maxStorageBufferRange; 4 GiB on
        NVIDIA, 128 MiB on lavapipe). Keep it a DeviceArray: a numpy weight is copied at every call.
    bias : DeviceArray or numpy.ndarray, shape (out_features,), optional
        float32, float16 or bfloat16; added in float32.
    out : DeviceArray or numpy.ndarray, shape (tokens, out_features), optional
        float32, float16 or bfloat16: written (rounded to nearest even) and returned. None allocates it, of x's dtype.
    kernel : {"auto", "gemv", "gemm", "coopmat", "gemv-cpu", "gemv-gpu"}, default "auto"
        "gemv" reads each weight once per 8 tokens (the decode's kernel), "gemm" tiles 64 tokens x 64 outputs
        through shared memory (prefill's), "coopmat" tiles them likewise on cooperative matrices (float16 products
        accumulated in float32 by the matrix units, a float32 x as two float16 parts; GLSL, float16 weights,
        in_features a multiple of 8, devices with VK_KHR_cooperative_matrix: `coopmat_unavailable` says why not);
        "auto" takes "gemv" up to 8 tokens (`linear_kernel`), beyond it "coopmat" for float16 and bfloat16 x where
        it can run, else "gemm" (float32 x: the matrix units' sums are not float32's). "gemv" runs in
        the device's shape (`linear_target`): shaders/linear_gemv_cpu.comp on CPU devices (lavapipe), where
        subgroup arithmetic (subgroups of at least 4) and the GLSL backend allow, else shaders/linear_gemv.comp;
        "gemv-cpu" and "gemv-gpu" force one shape, whatever the device (the CPU one where it can run). The CPU
        kernel binds the weight as a storage texel buffer: where the device's texel-buffer limits refuse it
        (`cpu_texels_refused`), "auto" and "gemv" run the other kernel and "gemv-cpu" raises.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Returns
    -------
    DeviceArray or numpy.ndarray, shape (tokens, out_features)
        `out` itself when given; else numpy for a numpy x, a DeviceArray for a DeviceArray x.

    Raises
    ------
    ValueError, TypeError
        A bad argument (named), before anything reaches the GPU.

    Examples
    --------
    >>> w = pagedvk.asarray(layer_weight.astype(np.float16))     # once, at load
    >>> y = pagedvk.linear(x, w)                                  # x [tokens, in_features] DeviceArray
    """
    checks.kind("x", x)
    checks.kind("weight", weight)
    checks.ndim("x", x, 2, "[tokens, in_features]")
    checks.ndim("weight", weight, 2, "[out_features, in_features]")
    types = {"x": storage_type("x", x, QUERY_TYPES), "weight": _weight_type(weight)}
    tokens, in_features = x.shape
    out_features = weight.shape[0]
    checks.dim("weight", weight, 1, in_features, "in_features, from x")
    if bias is not None:
        checks.kind("bias", bias)
        checks.ndim("bias", bias, 1, "[out_features]")
        checks.dim("bias", bias, 0, out_features, "out_features, from weight")
        types["bias"] = storage_type("bias", bias, QUERY_TYPES)
    if out is not None:
        checks.kind("out", out)
        checks.writable("out", out)
        checks.ndim("out", out, 2, "[tokens, out_features]")
        checks.dim("out", out, 0, tokens, "tokens, from x")
        checks.dim("out", out, 1, out_features, "out_features, from weight")
        types["out"] = storage_type("out", out, QUERY_TYPES)
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, LINEAR_KERNELS))}, got {kernel!r}")
    for name, count in (("x", tokens * in_features), ("weight", out_features * in_features),
                        ("out", tokens * out_features)):
        if count >= 2 ** 32:
            raise ValueError(f"{name} has {count} elements, more than the kernels index (2^32 - 1): split the call")
    device = device_of(x, weight, bias, out)
    limit = segment_limit(device)
    if weight.nbytes > limit:
        raise ValueError(f"weight is {weight.nbytes} bytes, more than {device.info.name} binds at once ({limit} bytes, "
                         "maxStorageBufferRange): split its output features over several calls")
    recording = active_recording(device) is not None
    if recording:
        require_device_arrays("linear inside pagedvk.record()", x=x, weight=weight, bias=bias, out=out)
    out_dtype = np.dtype(out.dtype) if out is not None else np.dtype(x.dtype)
    name = backend_name(backend)
    chosen = linear_kernel(tokens) if kernel == "auto" else kernel
    why_not_matrix = coopmat_unavailable(device, name, types["weight"].tag, in_features) \
        if chosen in ("gemm", "coopmat") else "not a tiled product"
    if kernel == "coopmat" and why_not_matrix:
        raise ValueError(f"kernel='coopmat' cannot run on {device.info.name}: {why_not_matrix}")
    # "auto" takes the matrix kernel for 16-bit x only: with float32 x its sums missed float32's tolerance on NVIDIA's
    # H100 and H200 (2026-12-06: the matrix units' float32 accumulation; the models' tests failed on GLSL, passed on
    # WGSL, which has no such kernel), so float32 activations keep the scalar tiled product unless "coopmat" is asked
    matrix = chosen == "coopmat" or (kernel == "auto" and chosen == "gemm" and not why_not_matrix
                                     and types["x"].tag != "f32")
    gemv = chosen not in ("gemm", "coopmat")
    target = linear_target(device.info, name, chosen) if gemv else ""
    refused = cpu_texels_refused(device.info, weight) if target == "cpu" else None
    if refused and chosen == "gemv-cpu":
        raise ValueError(f"weight cannot be read by kernel 'gemv-cpu', which binds it as a texel buffer: {refused}")
    if refused:
        target = ""   # the GPU-shaped kernel reads it as a storage buffer
    abi = LINEAR_GEMV if gemv else LINEAR_GEMM

    temporaries = []
    try:
        def on_device(a):
            d = asarray(a, device=device)
            if d is not a:
                temporaries.append(d)
            return d

        xd, wd = on_device(x), on_device(weight)
        bd = on_device(bias) if bias is not None else wd   # unread (has_bias 0): any read-only buffer binds
        yd = out if isinstance(out, DeviceArray) else empty((tokens, out_features), out_dtype, device)
        if yd is not out and not (out is None and isinstance(x, DeviceArray)):
            temporaries.append(yd)
        if tokens and out_features:
            constants = None
            if target == "cpu":
                pass_tokens = cpu_pass_tokens(tokens)
                groups = -(-out_features // LINEAR_GEMV_CPU_ROWS) * -(-tokens // pass_tokens)
                constants = {LinearSpec.TOKENS: pass_tokens, LinearSpec.WEIGHT_TYPE: q_type_code(types["weight"].tag),
                             LinearSpec.X_TYPE: q_type_code(types["x"].tag),
                             LinearSpec.HELD: cpu_held_chunks(in_features, types["weight"].tag,
                                                              cpu_lanes(device.info), pass_tokens),
                             LinearSpec.LANES: cpu_lanes(device.info)}
            elif gemv:
                groups = -(-out_features // LINEAR_GEMV_ROWS[name]) * -(-tokens // LINEAR_GEMV_TOKENS)
            else:
                groups = -(-out_features // LINEAR_GEMM_TILE) * -(-tokens // LINEAR_GEMM_TILE)
            push = abi.pack_push(
                tokens=tokens, in_features=in_features, out_features=out_features,
                x_type=q_type_code(types["x"].tag), weight_type=q_type_code(types["weight"].tag),
                bias_type=q_type_code(types["bias"].tag) if bias is not None else 0,
                y_type=q_type_code(QUERY_TYPES[out_dtype].tag), has_bias=int(bias is not None))
            key = abi.key(name, kv="f16", matrix=MATRIX_KIND) if matrix else abi.key(name, target=target)
            pipeline = modules.pipeline(device, abi, key, constants=constants)
            buffers = [xd.buffer, wd.buffer, bd.buffer, yd.buffer]
            grid = fold_grid(groups, device.info.max_workgroup_count)
            dispatch("linear", device, lambda: [(pipeline, buffers, push, grid)])
        if isinstance(out, np.ndarray):
            out[...] = yd.numpy()
            return out
        if out is not None:
            return out
        return yd.numpy() if isinstance(x, np.ndarray) else yd
    finally:
        for a in temporaries:
            a.close()


def _weight_type(weight):
    if np.dtype(weight.dtype) in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise TypeError(f"weight must have dtype float32, float16 or bfloat16, got {weight.dtype}: turn GGUF's "
                        "quantized blocks into float16 first (pagedvk.ops.quant.dequantize)")
    return storage_type("weight", weight, QUERY_TYPES)
