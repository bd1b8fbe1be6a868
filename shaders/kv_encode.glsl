// Write-side twin of kv_storage.glsl: a float converted to a cache element's bits (KV_F32 | KV_F16 |
// KV_BF16 | KV_E4M3 | KV_E5M2), and one element of a query-typed input read (Q_F32 | Q_F16 | Q_BF16).
// The WGSL twins are shaders/kv_write_<type>.wgsl and token_<type>.wgsl.
//
// Conversions are integer code with round-to-nearest-even, not packHalf2x16 (whose rounding and overflow
// Vulkan leaves to the implementation), so every device writes the bits numpy and ml_dtypes write. fp8
// saturates to its largest finite value, as vLLM's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) does;
// float16 and bfloat16 overflow to infinity, as numpy's casts do.
#ifndef KV_ENCODE_GLSL
#define KV_ENCODE_GLSL

// v as a float with M mantissa bits and exponent bias BIAS, its bits without sign; largest: the bits of
// its largest finite value, overflow: what values beyond it become (largest to saturate, else infinity).
uint encode_small_float(float v, uint M, uint BIAS, uint largest, uint overflow, uint nan_bits) {
    uint a = floatBitsToUint(v) & 0x7fffffffu;
    if (a > 0x7f800000u) return nan_bits;
    uint bits;
    if (a < ((128u - BIAS) << 23)) {   // below the smallest normal: a multiple of 2^(1 - BIAS - M), exactly
        bits = uint(roundEven(uintBitsToFloat(a) * uintBitsToFloat((BIAS + M - 1u + 127u) << 23)));
    } else {                           // round the mantissa to M bits (a carry moves up the exponent)
        uint shift = 23u - M;
        bits = ((a + (1u << (shift - 1u)) - 1u + ((a >> shift) & 1u)) >> shift) - ((127u - BIAS) << M);
    }
    return bits > largest ? overflow : bits;
}

#if defined(KV_F32)
#define KV_BITS 32u
uint kv_encode(float v) { return floatBitsToUint(v); }
#elif defined(KV_F16)
#define KV_BITS 16u
uint kv_encode(float v) {
    return (floatBitsToUint(v) >> 16 & 0x8000u) | encode_small_float(v, 10u, 15u, 0x7bffu, 0x7c00u, 0x7e00u);
}
#elif defined(KV_BF16)
#define KV_BITS 16u
uint kv_encode(float v) { return pack_bf16x2(vec2(v, 0.0)) & 0xffffu; }
#elif defined(KV_E4M3)
#define KV_BITS 8u
uint kv_encode(float v) {   // e4m3fn: largest 448 (0x7e); 0x7f is NaN
    return (floatBitsToUint(v) >> 24 & 0x80u) | encode_small_float(v, 3u, 7u, 0x7eu, 0x7eu, 0x7fu);
}
#elif defined(KV_E5M2)
#define KV_BITS 8u
uint kv_encode(float v) {   // e5m2: largest 57344 (0x7b)
    return (floatBitsToUint(v) >> 24 & 0x80u) | encode_small_float(v, 2u, 15u, 0x7bu, 0x7bu, 0x7eu);
}
#endif

// Element i of an input of the push constants' token_type (abi.q_type_code: 0 float32, 1 float16, 2 bfloat16),
// read as 32-bit words.
#define TOKEN_ELEMENT(words, i) (pc.token_type == 0u ? uintBitsToFloat(words[i]) \
    : pc.token_type == 1u ? unpackHalf2x16(words[(i) >> 1])[(i) & 1u] : bf16x2(words[(i) >> 1])[(i) & 1u])

#endif
