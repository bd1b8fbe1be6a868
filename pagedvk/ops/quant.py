"""GGUF's quantized weights (ggml's Q4_0, Q4_1 and Q8_0 blocks) turned into float arrays when a model is loaded,
so that `pagedvk.linear` reads them as float16 or float32 weights. Plain numpy; no kernel.

ggml's blocks (ggml-common.h), 32 weights each, little-endian, packed one after another along a row:

- Q4_0, 18 bytes: float16 d, then 16 bytes of 4-bit q; byte j holds weight j (low nibble) and weight j + 16 (high
  nibble); weight = (q - 8) * d.
- Q4_1, 20 bytes: float16 d, float16 m, then the 16 bytes of nibbles as Q4_0's; weight = q * d + m.
- Q8_0, 34 bytes: float16 d, then 32 int8 q; weight = q * d.

ggml's own dequantizers compute in float32, as `dequantize` does by default; float16 rounds that result once.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32   # weights per block, in all three types
# type name -> (ggml type id, bytes per block)
GGUF_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


def quant_type(qtype) -> str:
    """The type's name from a name ("Q4_0", any case) or ggml's type id (2, 3, 8; gguf.GGMLQuantizationType)."""
    if isinstance(qtype, str) and qtype.upper() in GGUF_TYPES:
        return qtype.upper()
    if not isinstance(qtype, (bool, str)) and isinstance(qtype, (int, np.integer)):
        for name, (type_id, _) in GGUF_TYPES.items():
            if int(qtype) == type_id:
                return name
    raise ValueError(f"qtype must be one of {', '.join(GGUF_TYPES)} or their ggml type ids "
                     f"({', '.join(str(t) for t, _ in GGUF_TYPES.values())}), got {qtype!r}")


def dequantize(data, qtype, shape, dtype=np.float32) -> np.ndarray:
    """GGUF block-quantized weights as a float array.

    Parameters
    ----------
    data : bytes, bytearray, memoryview or numpy.ndarray (any dtype; its bytes are read)
        The tensor's raw blocks as stored in the GGUF file: rows of shape[-1] // 32 blocks each.
    qtype : {"Q4_0", "Q4_1", "Q8_0"} or int
        The block type, by name or ggml type id (2, 3, 8).
    shape : tuple of int
        The float array's shape, numpy order ((out_features, in_features) for a linear layer's weight: GGUF lists
        the dimensions innermost first, so reverse its ne). shape[-1] must be a multiple of 32.
    dtype : float32 or float16, default float32
        float32 holds every weight exactly as ggml computes it; float16 rounds it (to nearest even).

    Returns
    -------
    numpy.ndarray
        `shape`, `dtype`.

    Raises
    ------
    ValueError, TypeError
        An unknown type, a shape whose rows are not whole blocks, or data of the wrong length.

    Examples
    --------
    >>> w = dequantize(reader.tensors[i].data, "Q4_0", (4096, 4096), np.float16)
    >>> y = pagedvk.linear(x, w)
    """
    name = quant_type(qtype)
    _, block_bytes = GGUF_TYPES[name]
    shape = tuple(int(n) for n in shape)
    if not shape or min(shape) < 0 or shape[-1] % BLOCK:
        raise ValueError(f"shape must be non-negative with shape[-1] a multiple of {BLOCK} (whole {name} blocks per "
                         f"row), got {shape}")
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise TypeError(f"dtype must be float32 or float16, got {np.dtype(dtype)}")
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    blocks = int(np.prod(shape)) // BLOCK
    if raw.size != blocks * block_bytes:
        raise ValueError(f"data must hold {blocks} {name} blocks of {block_bytes} bytes ({blocks * block_bytes} bytes "
                         f"for shape {shape}), got {raw.size} bytes")
    raw = raw.reshape(blocks, block_bytes)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)          # [blocks, 1]
    if name == "Q8_0":
        q = raw[:, 2:].view(np.int8).astype(np.float32)
        values = q * d
    else:
        packed = raw[:, -16:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)   # weights 0..15, then 16..31
        if name == "Q4_0":
            values = (q - 8.0) * d
        else:
            m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
            values = q * d + m
    return values.astype(dtype).reshape(shape)
