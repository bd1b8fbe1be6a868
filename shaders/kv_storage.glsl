// Element storage of caches, queries and outputs. The caches' type is one define of the module's variant key
// (pagedvk/abi.py): KV_F32 | KV_F16 | KV_BF16 | KV_E4M3 | KV_E5M2. The queries' and outputs' type is read from the
// push constants (q_type) by every kernel but the cooperative-matrix ones, which are built for one (Q_F32 | Q_F16 |
// Q_BF16). The WGSL twins are shaders/kv_<type>.wgsl, q_any.wgsl and q_<type>.wgsl.
//
// Every buffer is read through 32-bit words and converted here, so no storage type needs a 16-bit or 8-bit
// storage feature. Caches are bound as arrays of "quads", 4 consecutive elements (16, 8 or 4 bytes);
// kv_quad() turns one into floats. KV_CHUNK_QUADS quads make one 16-byte chunk: vLLM's key packing
// x = 16 / itemsize.
#ifndef KV_STORAGE_GLSL
#define KV_STORAGE_GLSL

#if defined(KV_ADDRESSED)   // before any code: caches reached through buffer device addresses
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_buffer_reference_uvec2 : require
#endif

// bfloat16 is the top half of a float32.
vec2 bf16x2(uint w) { return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xffff0000u)); }

// Two floats as bfloat16, rounded to nearest even (NaN stays NaN).
uint pack_bf16x2(vec2 v) {
    uvec2 b = floatBitsToUint(v);
    uvec2 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = mix(r, uvec2(0x7fc0u), isnan(v));
    return r.x | (r.y << 16);
}

#if defined(KV_F32)
#define KV_QUAD uvec4
#define KV_CHUNK_QUADS 1u
vec4 kv_quad(uvec4 w) { return uintBitsToFloat(w); }
#elif defined(KV_F16)
#define KV_QUAD uvec2
#define KV_CHUNK_QUADS 2u
vec4 kv_quad(uvec2 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
#elif defined(KV_BF16)
#define KV_QUAD uvec2
#define KV_CHUNK_QUADS 2u
vec4 kv_quad(uvec2 w) { return vec4(bf16x2(w.x), bf16x2(w.y)); }
#elif defined(KV_E4M3)
// fp8 e4m3fn (OCP, as ml_dtypes.float8_e4m3fn and vLLM's "fp8"): 4 exponent bits (bias 7), 3 mantissa bits,
// no infinities, 0x7f / 0xff NaN. Its exponent and mantissa put one bit below where e5m2 keeps them (the top
// byte of a float16) give a float16 of 2^-8 its value, subnormals included: a sign bit kept and a shift do it,
// no branch and no per-element select (those made e4m3 1.5-1.6x slower than e5m2 on the H200, BENCHMARKS.md).
// A NaN byte would read as +-480 that way (fp8_as_f16_fast); fp8_as_f16 also spreads its magnitude 0x7f plus one,
// which carries into the byte's top bit, over the float16's exponent (all ones: NaN). fp8_nan_bytes(w) says
// which words hold a NaN, so that a kernel can take the exact conversion only for blocks that do.
#define KV_QUAD uint
#define KV_CHUNK_QUADS 4u
#define FP8_NAN_SEPARATE 1   // fp8_as_f16_fast differs from fp8_as_f16 (NaN bytes)
uint e4m3_as_f16x2_fast(uint pair) {   // two bytes at e5m2's places (bits 8-15, 24-31) to float16 bits; NaN: 480
    return (pair & 0x80008000u) | ((pair >> 1) & 0x3f803f80u);
}
uint e4m3_as_f16x2(uint pair) {   // the same, NaN exactly
    const uint nan_exponents = (((pair & 0x7f007f00u) + 0x01000100u) & 0x80008000u) >> 5;   // bits 10, 26
    return e4m3_as_f16x2_fast(pair) | nan_exponents * 0x1fu;
}
// fp8_as_f16(w): a word's four elements (bytes 0-3) as float16 bits at 1 / FP8_F16_SCALE of their value, paired as
// the bytes lie at e5m2's places with one shift: .x holds bytes 0 (low half) and 2, .y bytes 1 and 3.
const float FP8_F16_SCALE = 256.0;
uvec2 fp8_as_f16(uint w) { return uvec2(e4m3_as_f16x2(w << 8), e4m3_as_f16x2(w)); }
uvec2 fp8_as_f16_fast(uint w) { return uvec2(e4m3_as_f16x2_fast(w << 8), e4m3_as_f16x2_fast(w)); }
// Nonzero where a byte of w is NaN: its 7 magnitude bits plus one carry into its top bit, no byte into the next.
// OR-ed over many words, then masked with 0x80808080 (fp8_any_nan).
uint fp8_nan_bytes(uint w) { return (w & 0x7f7f7f7fu) + 0x01010101u; }
bool fp8_any_nan(uint ored) { return (ored & 0x80808080u) != 0u; }
#elif defined(KV_E5M2)
// fp8 e5m2: the top byte of a float16. Paired as e4m3's: .x bytes 0 and 2, .y bytes 1 and 3, one mask each.
#define KV_QUAD uint
#define KV_CHUNK_QUADS 4u
#define FP8_NAN_SEPARATE 0
const float FP8_F16_SCALE = 1.0;
uvec2 fp8_as_f16(uint w) { return uvec2((w << 8) & 0xff00ff00u, w & 0xff00ff00u); }
uvec2 fp8_as_f16_fast(uint w) { return fp8_as_f16(w); }
uint fp8_nan_bytes(uint w) { return 0u; }
bool fp8_any_nan(uint ored) { return false; }
#endif
#if defined(KV_E4M3) || defined(KV_E5M2)
vec4 kv_quad(uint w) {
    const uvec2 h = fp8_as_f16(w);
    const vec2 a = unpackHalf2x16(h.x), b = unpackHalf2x16(h.y);   // bytes 0, 2 and 1, 3
    return vec4(a.x, b.x, a.y, b.y) * FP8_F16_SCALE;
}
#endif

// What the caches' bindings hold: quads, or (a module that defines KV_CHUNKS before including this file)
// whole 16-byte chunks, so that one load instruction reads 16 bytes whatever the storage type. Every cache's
// blocks start on a 16-byte boundary (a block is at least 32 elements of 4 consecutive head dims), so
// chunks never straddle blocks; chunk_quad() takes quad i (< KV_CHUNK_QUADS) out of a chunk.
#if defined(KV_CHUNKS)
#define KV_ELEM uvec4
#define KV_ELEM_QUADS KV_CHUNK_QUADS
#define KV_ELEM_ALIGN 16
#if defined(KV_F32)
vec4 chunk_quad(uvec4 w, uint i) { return kv_quad(w); }
#elif defined(KV_F16) || defined(KV_BF16)
vec4 chunk_quad(uvec4 w, uint i) { return kv_quad(i == 0u ? w.xy : w.zw); }
#else
vec4 chunk_quad(uvec4 w, uint i) { return kv_quad(w[i]); }
#endif
#else
#define KV_ELEM KV_QUAD
#define KV_ELEM_QUADS 1u
#define KV_ELEM_ALIGN 4
#endif

// The caches' bindings 1 and 2. KV_ADDRESSED: each holds the device addresses (low, high word) of the
// cache's segments; KV_SEGMENTED: segments 1-3 get bindings of their own after the kernel's others, from
// KV_SEGMENT_BINDING on (pagedvk/abi.py declares them).
#if defined(KV_ADDRESSED)
#define CACHE_BINDINGS \
    layout(std430, set = 0, binding = 1) readonly buffer KeyCache { uvec2 key_cache[]; }; \
    layout(std430, set = 0, binding = 2) readonly buffer ValueCache { uvec2 value_cache[]; };
#elif defined(KV_SEGMENTED)
#define CACHE_BINDINGS \
    layout(std430, set = 0, binding = 1) readonly buffer KeyCache { KV_ELEM key_cache[]; }; \
    layout(std430, set = 0, binding = 2) readonly buffer ValueCache { KV_ELEM value_cache[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING) readonly buffer KeyCache1 { KV_ELEM key_cache_1[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING + 1) readonly buffer KeyCache2 { KV_ELEM key_cache_2[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING + 2) readonly buffer KeyCache3 { KV_ELEM key_cache_3[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING + 3) readonly buffer ValueCache1 { KV_ELEM value_cache_1[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING + 4) readonly buffer ValueCache2 { KV_ELEM value_cache_2[]; }; \
    layout(std430, set = 0, binding = KV_SEGMENT_BINDING + 5) readonly buffer ValueCache3 { KV_ELEM value_cache_3[]; };
#else
#define CACHE_BINDINGS \
    layout(std430, set = 0, binding = 1) readonly buffer KeyCache { KV_ELEM key_cache[]; }; \
    layout(std430, set = 0, binding = 2) readonly buffer ValueCache { KV_ELEM value_cache[]; };
#endif

// Queries and outputs. Outputs are written two consecutive elements at a time (OUT_PAIR), so that no two
// threads share a 32-bit word of a 16-bit output.
#if defined(NO_QUERY_STORAGE)
#elif !defined(Q_F32) && !defined(Q_F16) && !defined(Q_BF16)
// The type from the push constants (q_type), or from the pipeline's specialization where it has one (Q_TYPE_SPEC, the
// code plus one, set per plan: abi.Q_TYPE_SPEC_ID), which folds the choice away. Query-typed inputs are arrays of
// 8-byte pairs of words (Q_IN: one 16-bit quad, half a float32 one, so a quad is still read with one or two vector
// loads), outputs arrays of words (Q_WORD): quad i is Q_IN elements 2i, 2i + 1 of float32, element i of a 16-bit
// type; output pair p is words 2p, 2p + 1 of float32, word p of a 16-bit type. Reading the type from the push
// constants with 4-byte loads made the H200's 1 x 4096 float16 decode 7% slower (BENCHMARKS.md, "Module count").
layout(constant_id = 8) const uint Q_TYPE_SPEC = 0u;
#define Q_TYPE (Q_TYPE_SPEC != 0u ? Q_TYPE_SPEC - 1u : pc.q_type)
#define Q_IN uvec2
#define Q_WORD uint
const uint Q_TYPE_F32 = 0u, Q_TYPE_F16 = 1u;   // abi.q_type_code; 2 is bfloat16
// Q_IN elements of one quad, words of one output pair.
#define Q_QUAD_UNITS (Q_TYPE == Q_TYPE_F32 ? 2u : 1u)
#define OUT_PAIR_WORDS (Q_TYPE == Q_TYPE_F32 ? 2u : 1u)
vec4 q_half_quad(uvec2 w, uint type) {   // a 16-bit type's quad
    return type == Q_TYPE_F16 ? vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)) : vec4(bf16x2(w.x), bf16x2(w.y));
}
// Quad i of a query-typed input `pairs` (an array of Q_IN).
#define Q_QUAD_AT(pairs, i) (Q_TYPE == Q_TYPE_F32 \
    ? uintBitsToFloat(uvec4(pairs[2u * (i)], pairs[2u * (i) + 1u])) : q_half_quad(pairs[i], Q_TYPE))
// Quads in a query-typed input, pairs in an output.
#define Q_QUADS(pairs) (uint(pairs.length()) / Q_QUAD_UNITS)
#define OUT_PAIRS(words) (uint(words.length()) / OUT_PAIR_WORDS)
// Output pair p of `words` := v.
#define STORE_OUT_PAIR(words, p, v) { \
    const vec2 v_ = (v); const uint p_ = (p); \
    if (Q_TYPE == Q_TYPE_F32) { words[2u * p_] = floatBitsToUint(v_.x); words[2u * p_ + 1u] = floatBitsToUint(v_.y); } \
    else words[p_] = Q_TYPE == Q_TYPE_F16 ? packHalf2x16(v_) : pack_bf16x2(v_); }
#elif defined(Q_F32)
#define Q_QUAD uvec4
#define OUT_PAIR uvec2
vec4 q_quad(uvec4 w) { return uintBitsToFloat(w); }
uvec2 out_pair(vec2 v) { return floatBitsToUint(v); }
#elif defined(Q_F16)
#define Q_QUAD uvec2
#define OUT_PAIR uint
vec4 q_quad(uvec2 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
uint out_pair(vec2 v) { return packHalf2x16(v); }
#elif defined(Q_BF16)
#define Q_QUAD uvec2
#define OUT_PAIR uint
vec4 q_quad(uvec2 w) { return vec4(bf16x2(w.x), bf16x2(w.y)); }
uint out_pair(vec2 v) { return pack_bf16x2(v); }
#endif
#if defined(Q_QUAD)   // a fixed type: the same accessors over arrays of Q_QUAD and OUT_PAIR
#define Q_QUAD_AT(quads, i) q_quad(quads[i])
#define Q_QUADS(quads) uint(quads.length())
#define OUT_PAIRS(pairs) uint(pairs.length())
#define STORE_OUT_PAIR(pairs, p, v) { pairs[p] = out_pair(v); }
#endif

#endif
