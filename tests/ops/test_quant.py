"""GGUF's Q4_0, Q4_1 and Q8_0 blocks dequantized (pagedvk.ops.quant) against a float64 decoding written from ggml's
documented block layouts, one weight at a time, and against blocks worked out by hand. (The `gguf` package is not a
dependency of the test environment; these layouts are ggml-common.h's.)"""

import struct

import numpy as np
import pytest

from pagedvk.ops import quant


def reference_values(raw: bytes, qtype: str, count: int) -> np.ndarray:
    """float64, weight by weight: block b's weight j from its scale(s) and its quant, as ggml-common.h lays them out."""
    size = quant.GGUF_TYPES[qtype][1]
    out = np.empty(count, np.float64)
    for i in range(count):
        b, j = divmod(i, 32)
        block = raw[b * size:(b + 1) * size]
        d = float(np.frombuffer(block[0:2], np.float16)[0])
        if qtype == "Q8_0":
            out[i] = d * struct.unpack("b", block[2 + j:3 + j])[0]
            continue
        byte = block[size - 16 + j % 16]
        q = byte & 0x0F if j < 16 else byte >> 4
        if qtype == "Q4_0":
            out[i] = (q - 8) * d
        else:
            out[i] = q * d + float(np.frombuffer(block[2:4], np.float16)[0])
    return out


def random_blocks(rng, qtype: str, blocks: int) -> bytes:
    """Random quants with finite, varied float16 scales (and Q4_1 minimums)."""
    size = quant.GGUF_TYPES[qtype][1]
    raw = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    scales = (rng.standard_normal((blocks, 2)) * 0.05).astype(np.float16)
    raw[:, 0:4 if qtype == "Q4_1" else 2] = scales.view(np.uint8)[:, :4 if qtype == "Q4_1" else 2]
    return raw.tobytes()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dequantize_against_layout(rng, qtype, dtype):
    shape = (7, 96)   # three blocks a row
    raw = random_blocks(rng, qtype, 7 * 3)
    out = quant.dequantize(raw, qtype, shape, dtype)
    assert out.shape == shape and out.dtype == np.dtype(dtype)
    ref = reference_values(raw, qtype, 7 * 96).reshape(shape)
    if dtype == np.float32:   # every product (and Q4_1's sum) is float32's, as ggml computes them
        np.testing.assert_array_equal(out, ref.astype(np.float32))
    else:
        np.testing.assert_array_equal(out, ref.astype(np.float32).astype(np.float16))


def test_blocks_worked_by_hand():
    # Q4_0: d = 0.5; byte j = (j + 1) << 4 | j: weight j is (j - 8) * 0.5, weight 16 + j is ((j + 1) % 16 - 8) * 0.5
    nibbles = bytes(((j + 1) % 16) << 4 | j for j in range(16))
    q4_0 = np.float16(0.5).tobytes() + nibbles
    expected = [(j - 8) * 0.5 for j in range(16)] + [((j + 1) % 16 - 8) * 0.5 for j in range(16)]
    np.testing.assert_array_equal(quant.dequantize(q4_0, "Q4_0", (1, 32))[0], expected)
    # Q4_1: d = 0.25, m = -1: weight = q / 4 - 1
    q4_1 = np.float16(0.25).tobytes() + np.float16(-1).tobytes() + nibbles
    expected = [j / 4 - 1 for j in range(16)] + [(j + 1) % 16 / 4 - 1 for j in range(16)]
    np.testing.assert_array_equal(quant.dequantize(q4_1, 3, (32,))[0:32], expected)
    # Q8_0: d = 2; quants -16..15
    q8_0 = np.float16(2).tobytes() + np.arange(-16, 16, dtype=np.int8).tobytes()
    np.testing.assert_array_equal(quant.dequantize(np.frombuffer(q8_0, np.uint8), "q8_0", (32,)),
                                  np.arange(-16, 16) * 2.0)


@pytest.mark.parametrize("qtype,shape,dtype,match", [
    ("Q5_0", (1, 32), np.float32, "qtype must be one of"),
    (7, (1, 32), np.float32, "qtype must be one of"),
    ("Q4_0", (1, 48), np.float32, "multiple of 32"),
    ("Q4_0", (2, 32), np.float32, "data must hold 2 Q4_0 blocks"),
    ("Q4_0", (1, 32), np.int8, "dtype must be float32 or float16"),
])
def test_rejected(qtype, shape, dtype, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quant.dequantize(bytes(18), qtype, shape, dtype)
