"""The layer's other ops, under vLLM's names and signatures (``vllm._custom_ops``): the embedding lookup, rms_norm and
fused_add_rms_norm, silu_and_mul and rotary_embedding, and rope_cos_sin_cache, which builds rotary_embedding's table.

Each op checks every argument (an error names it) before anything reaches the device, then queues one dispatch on the
current stream through the path every op takes (pagedvk.runtime.recording.dispatch: a kept launch, or the active
``pagedvk.record()`` step) and returns. A call over DeviceArrays alone that repeats a checked call's arrays and options
(an engine's per-layer call, every step) queues that call's kept launch at once, as reshape_and_cache with
validate=False does; ops that read ids or positions back take that path only with validate=False. Arrays are numpy arrays or DeviceArrays, as for reshape_and_cache: numpy inputs
are copied to the device for the call, and a numpy array an op writes is written back in place (through the caller's
view) once the op has run; DeviceArrays are read and written where they are, views whose rows lie apart included (a
fused QKV projection's query and key columns). Activations are float32, float16 or bfloat16 and are computed in
float32. Rows have an even number of elements: the kernels read and write pairs of elements, so that no two threads
share a 32-bit word of a 16-bit array (shaders/layer_elements.glsl).

A later option, not taken here: rotating the keys inside reshape_and_cache's cache write (one pass over key less).
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import FLOAT32_MAX, QUERY_TYPES, storage_type
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import (EMBEDDING, RMS_ADD_RESIDUAL, RMS_NORM, RMS_WRITE_INPUT, ROTARY_EMBEDDING,
                                 SILU_AND_MUL)
from ..runtime.array import Array, DeviceArray, asarray, empty
from ..runtime.pipeline import fold_grid
from ..runtime.recording import (active_recording, array_signature, dispatch, kept_launches,
                                 require_device_arrays)
from . import checks
from .opargs import backend_name, device_of

INDEX_DTYPES = (np.int32, np.int64)
INDEX_LIMIT = 2 ** 31        # vocab_size and max_position: int32 ids and positions reach them
ELEMENT_LIMIT = 2 ** 32      # the kernels count elements in uint32
WORKGROUP = EMBEDDING.workgroup_size[0]


def embedding(token_ids: Array, weight: Array, out: Array | None = None, *, backend: str | None = None,
              validate: bool = True) -> Array:
    """The rows of `weight` that `token_ids` name (torch's F.embedding, vLLM's VocabParallelEmbedding lookup).

    Parameters
    ----------
    token_ids : DeviceArray, numpy.ndarray or sequence of ints, any shape, int32 or int64
    weight : DeviceArray or numpy.ndarray, shape (vocab_size, hidden_size)
        float32, float16 or bfloat16; hidden_size even, the table within one binding (a DeviceArray split into
        segments is refused).
    out : DeviceArray or numpy.ndarray, shape token_ids.shape + (hidden_size,), optional
        weight's dtype or float32 (which holds the 16-bit types exactly): written and returned. A 2-D DeviceArray
        view whose rows lie apart is written in place. None allocates it in weight's dtype.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        Check every id against vocab_size (reading device ids back, as reshape_and_cache's slots). False leaves it
        to the kernel, which writes a row of zeros for an id outside [0, vocab_size) and never reads past the table.

    Returns
    -------
    DeviceArray or numpy.ndarray
        `out` when given; else numpy when token_ids and weight are both host arrays, a DeviceArray otherwise (and
        inside ``pagedvk.record()``).

    Raises
    ------
    ValueError, TypeError
        A bad argument, or (validate) an id outside [0, vocab_size).

    Examples
    --------
    >>> hidden = pagedvk.embedding(np.array([1, 15043, 3186]), embed_tokens)   # embed_tokens a DeviceArray
    """
    signature = None
    if out is not None and validate is False:
        signature, queued = _queued_again("embedding", (token_ids, weight, out), (), backend)
        if queued:
            return out
    token_ids = _indices("token_ids", token_ids)
    checks.kind("weight", weight)
    checks.ndim("weight", weight, 2, "[vocab_size, hidden_size]")
    weight_type = _type_code("weight", weight)
    vocab_size, hidden_size = weight.shape
    _even_rows("weight.shape[1] (hidden_size)", hidden_size)
    if not 0 < vocab_size < INDEX_LIMIT:
        raise ValueError(f"weight.shape[0] (vocab_size) must be in [1, 2^31), got {vocab_size}")
    _one_binding("weight", weight)
    shape = tuple(token_ids.shape) + (hidden_size,)
    if out is not None:
        checks.kind("out", out, strided=True)
        checks.writable("out", out)
        _shape("out", out, shape, "token_ids.shape + (hidden_size,)")
        checks.dtype("out", out, [weight.dtype, np.float32])
    out_rows, out_pitch = _rows("out", out, hidden_size) if out is not None else (math.prod(shape[:-1]), hidden_size)
    if validate:
        _indices_below("token_ids", token_ids, vocab_size, "vocab_size, weight.shape[0]")
    name = backend_name(backend)
    device = device_of(token_ids, weight, out)
    recording = active_recording(device) is not None
    result = out if out is not None else empty(shape, weight.dtype, device)
    push = EMBEDDING.pack_push(num_tokens=out_rows, hidden_size=hidden_size, vocab_size=vocab_size,
                               id_words=np.dtype(token_ids.dtype).itemsize // 4, weight_type=weight_type,
                               out_type=_type_code("out", result), out_pitch=out_pitch)
    try:
        _launch("embedding", EMBEDDING, name, device, dict(token_ids=token_ids, weight=weight, out=result), push,
                out_rows * hidden_size // 2, written=("out",), fresh=("out",), signature=signature)
    except BaseException:
        if result is not out:
            result.close()
        raise
    if out is None and not recording and not any(isinstance(a, DeviceArray) for a in (token_ids, weight)):
        host = result.numpy()
        result.close()
        return host
    return result


def rms_norm(out: Array, input: Array, weight: Array, epsilon: float, *, backend: str | None = None) -> None:
    """out = input / sqrt(mean(input^2) + epsilon) * weight, over each row's last axis (vLLM's rms_norm).

    Parameters
    ----------
    out : DeviceArray or numpy.ndarray, input's shape and dtype
        Written in place (numpy through the caller's view). `out` may be `input` itself (the same array).
    input : DeviceArray or numpy.ndarray, shape (..., hidden_size)
        float32, float16 or bfloat16; hidden_size even. The sum of squares is float32.
    weight : DeviceArray or numpy.ndarray, shape (hidden_size,)
        float32, float16 or bfloat16 (need not be input's).
    epsilon : float
        Positive, finite and not zero as float32.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Raises
    ------
    ValueError, TypeError
        A bad argument; nothing is written then.

    Examples
    --------
    >>> pagedvk.rms_norm(normed, hidden, input_layernorm_weight, 1e-5)
    """
    signature, queued = _queued_again("rms_norm", (out, input, weight), (type(epsilon), epsilon), backend)
    if queued:
        return
    checks.kind("input", input, strided=True)
    x_type = _type_code("input", input)
    hidden_size = _hidden("input", input)
    checks.kind("out", out, strided=True)
    checks.writable("out", out)
    _shape("out", out, tuple(input.shape), "input's")
    checks.dtype("out", out, [input.dtype])
    weight_type = _norm_weight(weight, hidden_size)
    eps = _epsilon(epsilon)
    rows, x_pitch = _rows("input", input, hidden_size)
    out_pitch = _rows("out", out, hidden_size)[1]
    in_place = _same_or_apart("out", out, "input", input)
    target = input if in_place else out
    push = RMS_NORM.pack_push(num_tokens=rows, hidden_size=hidden_size, epsilon=eps, x_type=x_type,
                              weight_type=weight_type, flags=RMS_WRITE_INPUT if in_place else 0, x_pitch=x_pitch,
                              residual_pitch=out_pitch, out_pitch=out_pitch)
    # The residual binding is unused: it holds the array written anyway.
    _launch("rms_norm", RMS_NORM, backend_name(backend), device_of(out, input, weight),
            dict(x=input, residual=target, weight=weight, out=target), push, rows, per_workgroup=1,
            written=("out",) if not in_place else ("x",), fresh=() if in_place else ("out",),
            given=dict(out=out, input=input, weight=weight), signature=signature)


def fused_add_rms_norm(input: Array, residual: Array, weight: Array, epsilon: float, *,
                       backend: str | None = None) -> None:
    """residual += input, then input = residual / sqrt(mean(residual^2) + epsilon) * weight, both in place (vLLM's
    fused_add_rms_norm: the residual stream is updated and the layer's normalized input written over `input`).

    Parameters
    ----------
    input : DeviceArray or numpy.ndarray, shape (..., hidden_size)
        float32, float16 or bfloat16; hidden_size even. Overwritten with the normalized rows.
    residual : DeviceArray or numpy.ndarray, input's shape and dtype
        Overwritten with input + residual, rounded to its dtype; that rounded sum is what is normalized (as vLLM
        stores it and normalizes what it stored). Must not share memory with input.
    weight : DeviceArray or numpy.ndarray, shape (hidden_size,)
        float32, float16 or bfloat16.
    epsilon : float
        Positive, finite and not zero as float32.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Raises
    ------
    ValueError, TypeError
        A bad argument; nothing is written then.

    Examples
    --------
    >>> pagedvk.fused_add_rms_norm(attn_out, hidden, post_attention_layernorm_weight, 1e-5)
    """
    signature, queued = _queued_again("fused_add_rms_norm", (input, residual, weight), (type(epsilon), epsilon),
                                      backend)
    if queued:
        return
    checks.kind("input", input, strided=True)
    checks.writable("input", input)
    x_type = _type_code("input", input)
    hidden_size = _hidden("input", input)
    checks.kind("residual", residual, strided=True)
    checks.writable("residual", residual)
    _shape("residual", residual, tuple(input.shape), "input's")
    checks.dtype("residual", residual, [input.dtype])
    weight_type = _norm_weight(weight, hidden_size)
    eps = _epsilon(epsilon)
    rows, x_pitch = _rows("input", input, hidden_size)
    residual_pitch = _rows("residual", residual, hidden_size)[1]
    if _same_or_apart("residual", residual, "input", input):
        raise ValueError("residual and input must be different arrays (residual += input, then input is overwritten)")
    push = RMS_NORM.pack_push(num_tokens=rows, hidden_size=hidden_size, epsilon=eps, x_type=x_type,
                              weight_type=weight_type, flags=RMS_ADD_RESIDUAL | RMS_WRITE_INPUT, x_pitch=x_pitch,
                              residual_pitch=residual_pitch, out_pitch=x_pitch)
    # The out binding is unused (the result goes into input): it holds input.
    _launch("fused_add_rms_norm", RMS_NORM, backend_name(backend), device_of(input, residual, weight),
            dict(x=input, residual=residual, weight=weight, out=input), push, rows, per_workgroup=1,
            written=("x", "residual"), given=dict(input=input, residual=residual, weight=weight), signature=signature)


def silu_and_mul(out: Array, x: Array, *, backend: str | None = None) -> None:
    """out = silu(x[..., :d]) * x[..., d:], silu(a) = a * sigmoid(a) (vLLM's silu_and_mul: SwiGLU's gate).

    Parameters
    ----------
    out : DeviceArray or numpy.ndarray, shape (..., d), x's dtype
        Written in place (numpy through the caller's view); must not share memory with x.
    x : DeviceArray or numpy.ndarray, shape (..., 2 * d)
        float32, float16 or bfloat16; d even (x's last axis a multiple of 4).
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".

    Raises
    ------
    ValueError, TypeError
        A bad argument; nothing is written then.

    Examples
    --------
    >>> pagedvk.silu_and_mul(act, gate_up)   # gate_up [num_tokens, 2 * intermediate_size]
    """
    signature, queued = _queued_again("silu_and_mul", (out, x), (), backend)
    if queued:
        return
    checks.kind("x", x, strided=True)
    x_type = _type_code("x", x)
    if len(x.shape) < 1 or x.shape[-1] < 4 or x.shape[-1] % 4:
        raise ValueError(f"x's last axis (2 * d) must be a positive multiple of 4 (d even: the kernel writes pairs of "
                         f"elements), got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    checks.kind("out", out, strided=True)
    checks.writable("out", out)
    _shape("out", out, tuple(x.shape[:-1]) + (d,), "x's with the last axis halved")
    checks.dtype("out", out, [x.dtype])
    rows, x_pitch = _rows("x", x, 2 * d)
    out_pitch = _rows("out", out, d)[1]
    if _same_or_apart("out", out, "x", x):
        raise ValueError("out must not be x (out is half x's width)")
    push = SILU_AND_MUL.pack_push(num_rows=rows, d=d, x_type=x_type, x_pitch=x_pitch, out_pitch=out_pitch)
    _launch("silu_and_mul", SILU_AND_MUL, backend_name(backend), device_of(out, x), dict(x=x, out=out), push,
            rows * d // 2, written=("out",), fresh=("out",), signature=signature)


def rotary_embedding(positions: Array, query: Array, key: Array | None, head_size: int, cos_sin_cache: Array,
                     is_neox: bool, *, backend: str | None = None, validate: bool = True) -> None:
    """Rotary position embedding of query and key, in place (vLLM's rotary_embedding).

    Rotation i (i < rot_dim / 2) of a head at position p turns its dims (x1, x2) into (x1 cos - x2 sin,
    x2 cos + x1 sin), cos = cos_sin_cache[p, i], sin = cos_sin_cache[p, rot_dim / 2 + i]; x1, x2 are dims i and
    i + rot_dim / 2 with is_neox (NeoX style), 2i and 2i + 1 without (GPT-J style, llama.cpp's rope type 0). The dims
    from rot_dim to head_size are left as they are (partial rotary, as vLLM's rotary_dim < head_size).

    Parameters
    ----------
    positions : DeviceArray, numpy.ndarray or sequence of ints, shape (num_tokens,), int32 or int64
    query : DeviceArray or numpy.ndarray, shape (num_tokens, num_heads * head_size) or (num_tokens, num_heads,
            head_size)
        float32, float16 or bfloat16, rotated in place (numpy through the caller's view). A DeviceArray view whose
        rows lie apart (``qkv[:, :q_size]`` of a fused QKV projection) is rotated where it is.
    key : DeviceArray or numpy.ndarray or None
        As query, with num_kv_heads heads, query's dtype; must not share memory with query. None rotates query only.
    head_size : int
        Even.
    cos_sin_cache : DeviceArray or numpy.ndarray, shape (max_position, rot_dim)
        float32, float16 or bfloat16: cos in the first rot_dim / 2 columns, sin in the rest (`rope_cos_sin_cache`
        builds it); rot_dim a multiple of 4, at most head_size.
    is_neox : bool
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        Check every position against max_position (reading device positions back). False leaves it to the kernel,
        which leaves a token at a position outside [0, max_position) as it is and never reads past the table.

    Raises
    ------
    ValueError, TypeError
        A bad argument, or (validate) a position outside [0, max_position); nothing is written then.

    Examples
    --------
    >>> cos_sin = pagedvk.asarray(pagedvk.rope_cos_sin_cache(4096, 128, 500000.0))
    >>> pagedvk.rotary_embedding(positions, q, k, 128, cos_sin, is_neox=True)
    """
    signature = None
    if validate is False:
        arrays = (positions, query, cos_sin_cache) + ((key,) if key is not None else ())
        signature, queued = _queued_again("rotary_embedding", arrays, (type(head_size), head_size, type(is_neox),
                                                                       is_neox, key is None), backend)
        if queued:
            return
    head_size = checks.integer("head_size", head_size, 2)
    if head_size % 2:
        raise ValueError(f"head_size must be even, got {head_size}")
    num_heads = _heads("query", query, head_size)
    x_type = _type_code("query", query)
    num_tokens = query.shape[0]
    num_kv_heads = 0
    if key is not None:
        num_kv_heads = _heads("key", key, head_size)
        checks.dtype("key", key, [query.dtype])
        checks.dim("key", key, 0, num_tokens, "num_tokens, from query")
        if _same_or_apart("key", key, "query", query):
            raise ValueError("key and query must be different arrays")
    checks.kind("cos_sin_cache", cos_sin_cache)
    checks.ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]")
    cache_type = _type_code("cos_sin_cache", cos_sin_cache)
    max_position, rot_dim = cos_sin_cache.shape
    if rot_dim < 4 or rot_dim % 4 or rot_dim > head_size:
        raise ValueError(f"cos_sin_cache.shape[1] (rot_dim) must be a positive multiple of 4 (each thread takes two "
                         f"rotations) at most head_size {head_size}, got {rot_dim}")
    if not 0 < max_position < INDEX_LIMIT:
        raise ValueError(f"cos_sin_cache.shape[0] (max_position) must be in [1, 2^31), got {max_position}")
    _one_binding("cos_sin_cache", cos_sin_cache)
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox must be a bool, not {type(is_neox).__name__} ({is_neox!r})")
    positions = _indices("positions", positions)
    checks.ndim("positions", positions, 1, "[num_tokens]")
    checks.dim("positions", positions, 0, num_tokens, "num_tokens, from query")
    query_pitch = _rows("query", query, num_heads * head_size)[1]
    key_pitch = _rows("key", key, num_kv_heads * head_size)[1] if key is not None else 0
    if validate:
        _indices_below("positions", positions, max_position, "max_position, cos_sin_cache.shape[0]")
    push = ROTARY_EMBEDDING.pack_push(
        num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, rot_dim=rot_dim,
        max_position=max_position, is_neox=int(bool(is_neox)), position_words=np.dtype(positions.dtype).itemsize // 4,
        x_type=x_type, cache_type=cache_type, query_pitch=query_pitch, key_pitch=key_pitch)
    # Without a key its binding holds query, which the kernel then never reaches through it (num_kv_heads 0).
    _launch("rotary_embedding", ROTARY_EMBEDDING, backend_name(backend),
            device_of(positions, query, key, cos_sin_cache),
            dict(positions=positions, query=query, key=key if key is not None else query, cos_sin_cache=cos_sin_cache),
            push, num_tokens * (num_heads + num_kv_heads) * rot_dim // 4, written=("query", "key"),
            given=dict(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache), signature=signature)


def rope_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0, dtype=np.float32) -> np.ndarray:
    """rotary_embedding's table for a base theta: row p is cos(p * theta_i) for i < rot_dim / 2, then sin(p * theta_i),
    theta_i = base^(-2i / rot_dim) (vLLM's RotaryEmbedding._compute_cos_sin_cache), computed in float64 and cast.

    Parameters
    ----------
    max_position : int
        Rows: positions 0 .. max_position - 1.
    rot_dim : int
        Even (rotary_embedding takes multiples of 4).
    base : float, default 10000.0
        Positive and finite (Llama 3: 500000).
    dtype : numpy dtype, default float32
        float32, float16 or bfloat16.

    Returns
    -------
    numpy.ndarray, shape (max_position, rot_dim)
        Host memory; ``pagedvk.asarray`` puts it on the device once.
    """
    max_position = checks.integer("max_position", max_position, 1, INDEX_LIMIT - 1)
    rot_dim = checks.integer("rot_dim", rot_dim, 2)
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)) or not (
            math.isfinite(float(base)) and float(base) > 0):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    if np.dtype(dtype) not in QUERY_TYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {np.dtype(dtype)}")
    theta = float(base) ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * theta[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(dtype)


# -- checks ---------------------------------------------------------------------------------------------------------

def _type_code(name: str, a) -> int:
    """The kernels' code for an activation's float type (abi.QUERY_TYPES); TypeError naming the argument."""
    return q_type_code(storage_type(name, a, QUERY_TYPES).tag)


def _shape(name: str, a, shape: tuple, what: str) -> None:
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}), got {tuple(a.shape)}")


def _even_rows(what: str, n: int) -> None:
    if n < 2 or n % 2:
        raise ValueError(f"{what} must be a positive even number (the kernels read and write pairs of elements), "
                         f"got {n}")


def _hidden(name: str, a) -> int:
    """The last axis's length of an activation [..., hidden_size], checked even."""
    if len(a.shape) < 1:
        raise ValueError(f"{name} must have a hidden axis ([..., hidden_size]), got shape {tuple(a.shape)}")
    _even_rows(f"{name}.shape[-1] (hidden_size)", a.shape[-1])
    return a.shape[-1]


def _norm_weight(weight, hidden_size: int) -> int:
    checks.kind("weight", weight)
    checks.ndim("weight", weight, 1, "[hidden_size]")
    checks.dim("weight", weight, 0, hidden_size, "hidden_size, from input")
    return _type_code("weight", weight)


def _epsilon(epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
        raise TypeError(f"epsilon must be a real number, not {type(epsilon).__name__} ({epsilon!r})")
    eps = float(epsilon)
    if not (math.isfinite(eps) and 0 < eps <= FLOAT32_MAX and np.float32(eps) > 0):
        raise ValueError(f"epsilon must be positive, finite and representable as float32 (not 0 there), got {epsilon}")
    return eps


def _heads(name: str, a, head_size: int) -> int:
    """The heads of rotary_embedding's query or key, [num_tokens, num_heads * head_size] or [num_tokens, num_heads,
    head_size], checked writable."""
    checks.kind(name, a, strided=True)
    checks.writable(name, a)
    shape = tuple(a.shape)
    if len(shape) == 3 and shape[2] == head_size:
        return shape[1]
    if len(shape) == 2 and shape[1] % head_size == 0:
        return shape[1] // head_size
    raise ValueError(f"{name} must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size] with "
                     f"head_size {head_size}, got shape {shape}")


def _indices(name: str, a):
    """token_ids or positions: a sequence of ints (as int32), or an int32 / int64 numpy or device array."""
    a = checks.ints(name, a)
    checks.kind(name, a)
    checks.dtype(name, a, INDEX_DTYPES)
    return a


def _indices_below(name: str, a, limit: int, what: str) -> None:
    """ValueError naming the first element of `a` outside [0, limit) (reads device arrays back)."""
    values = np.asarray(checks.host(a)).reshape(-1)
    bad = np.flatnonzero((values < 0) | (values >= limit))
    if bad.size:
        at = np.unravel_index(int(bad[0]), tuple(a.shape))
        index = ", ".join(map(str, at))
        raise ValueError(f"{name}[{index}] = {int(values[bad[0]])} is outside [0, {limit}) ({what})")


def _one_binding(name: str, a) -> None:
    if isinstance(a, DeviceArray) and not a.closed and len(a.buffers) > 1:
        raise ValueError(f"{name} is split into {len(a.buffers)} segments (it is larger than one binding of "
                         f"{a.device.info.name}): the layer ops read it through one binding")


def _rows(name: str, a, width: int) -> tuple:
    """(rows, pitch) of `a` taken as rows of `width` elements (its trailing axes): a contiguous array (numpy ones are
    copied contiguous) has size / width rows `width` apart; a DeviceArray view whose first-axis rows lie apart needs
    exactly one row per first-axis index, at its pitch. ValueError where the rows reach past 2^32 elements."""
    if isinstance(a, DeviceArray) and not a.is_contiguous:
        if math.prod(a.shape[1:]) != width:
            raise ValueError(f"{name} is a view whose rows lie {a.pitch} elements apart (shape {tuple(a.shape)}): such "
                             f"a view must hold one row of {width} elements per index of its first axis")
        rows, pitch = a.shape[0], a.pitch
    else:
        rows, pitch = (math.prod(a.shape) // width if width else 0), width
    if rows and (rows - 1) * pitch + width >= ELEMENT_LIMIT:
        raise ValueError(f"{name} reaches past 2^32 elements ({rows} rows {pitch} apart): split it into several calls")
    return rows, pitch


def _rows_in_memory(a: DeviceArray) -> tuple:
    """(the root array, first byte, bytes from one row to the next, bytes of a row, rows) of a DeviceArray's elements in
    its root's memory: rows of its first axis, everything inside a row contiguous; a contiguous array is one row."""
    root = a.base if a.base is not None else a
    item = a.dtype.itemsize
    if a.is_contiguous:
        return root, a.offset, a.size * item, a.size * item, 1
    return root, a.offset, a.pitch * item, math.prod(a.shape[1:]) * item, a.shape[0]


def _share_memory(a: DeviceArray, b: DeviceArray) -> bool:
    """Whether two DeviceArrays have an element's bytes in common (views of one array, as a fused projection's
    columns: rows at one pitch interleave without overlapping)."""
    (root_a, start_a, pitch_a, width_a, rows_a), (root_b, start_b, pitch_b, width_b, rows_b) = map(_rows_in_memory,
                                                                                                   (a, b))
    if root_a is not root_b or not a.size or not b.size:
        return False
    # A single row's pitch means nothing: it takes the other's (the test below holds for any pitch where k is 0).
    pitch_a, pitch_b = (pitch_b, pitch_b) if rows_a == 1 else (pitch_a, pitch_a if rows_b == 1 else pitch_b)
    if pitch_a != pitch_b:   # views of one array at two pitches (one reshaped first): their whole spans, conservatively
        return (start_a < start_b + (rows_b - 1) * pitch_b + width_b
                and start_b < start_a + (rows_a - 1) * pitch_a + width_a)
    # Row ra of a meets row rb of b where -width_b < d + k * pitch < width_a, d = start_b - start_a, k = rb - ra.
    d = start_b - start_a
    k_low = max((-width_b - d) // pitch_a + 1, -(rows_a - 1))
    k_high = min(-(-(width_a - d) // pitch_a) - 1, rows_b - 1)
    return k_low <= k_high


def _same_or_apart(name_a: str, a, name_b: str, b) -> bool:
    """True where a and b are one array (the same elements of the same memory), False where they share no memory;
    ValueError naming both where they overlap otherwise (the kernels read and write them at once)."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if not np.shares_memory(a, b):
            return False
        if a.__array_interface__ == b.__array_interface__:
            return True
    elif isinstance(a, DeviceArray) and isinstance(b, DeviceArray):
        if not _share_memory(a, b):
            return False
        if (_rows_in_memory(a), a.shape, a.dtype) == (_rows_in_memory(b), b.shape, b.dtype):
            return True
    else:
        return False
    raise ValueError(f"{name_a} and {name_b} overlap: give them apart, or (where allowed) as the same array")


# -- the launch ----------------------------------------------------------------------------------------------------

def _queued_again(op: str, arrays: tuple, options: tuple, backend: str | None) -> tuple:
    """(signature, queued) of a call: its signature where every array is a DeviceArray (recording.array_signature:
    devices, buffers, shapes, dtypes and row pitches, then the op, its options and the kernel language), else None;
    queued is True where a launch kept for that signature (by a call that passed every check) was queued again."""
    signature = array_signature(arrays, (op, *options, backend_name(backend)))
    if signature is None or active_recording(arrays[0].device) is not None:
        return signature, False
    return signature, kept_launches(arrays[0].device).enqueue_kept(signature)


def _launch(op: str, kernel, backend: str, device, bindings: dict, push: bytes, threads: int, *,
            per_workgroup: int = WORKGROUP, written: tuple = (), fresh: tuple = (), given: dict | None = None,
            signature: tuple | None = None) -> None:
    """Queue one dispatch of `kernel` over `bindings` ({binding name: array}, in the kernel's order; one array may
    fill several bindings) through recording.dispatch: ceil(threads / per_workgroup) workgroups on a folded grid.

    `given` (default: `bindings`) are the caller's arguments by name, which inside a recording must be DeviceArrays.
    Numpy arrays are copied to the device first, those of the `fresh` bindings (outputs only) allocated instead, and
    those of the `written` bindings copied back into the caller's array once the dispatch has run. `signature`
    (`_queued_again`'s) keys the kept launch where the call copied nothing."""
    if active_recording(device) is not None:
        require_device_arrays(f"{op} inside pagedvk.record()", **(given if given is not None else bindings))
    if threads == 0:
        return
    on_device, temporaries = {}, []
    try:
        for name, a in bindings.items():
            if id(a) in on_device:
                continue
            d = (empty(a.shape, a.dtype, device) if name in fresh and isinstance(a, np.ndarray)
                 else asarray(a, device=device))
            on_device[id(a)] = d
            if d is not a:
                temporaries.append(d)
        pipeline = modules.pipeline(device, kernel, kernel.key(backend))
        buffers = [on_device[id(a)].buffer for a in bindings.values()]
        grid = fold_grid(-(-threads // per_workgroup), device.info.max_workgroup_count)
        dispatch(op, device, lambda: [(pipeline, buffers, push, grid)], signature=None if temporaries else signature)
        for a in {id(bindings[name]): bindings[name] for name in written}.values():
            if isinstance(a, np.ndarray):
                a[...] = on_device[id(a)].numpy()
    finally:
        for d in temporaries:
            d.close()
