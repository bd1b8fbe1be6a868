// What the linear layer's kernels share (LINEAR_KERNEL in pagedvk/kernels/catalogue.py): bindings, push constants,
// element loads and the output store. Every buffer is bound as 32-bit words (weight as 16-byte chunks) and each
// one's element type is a push constant (abi.QUERY_TYPES: 0 float32, 1 float16, 2 bfloat16), so one module takes
// every combination of types without a 16-bit storage feature; the branches on the types are uniform. The WGSL
// twin is shaders/linear_common.wgsl.
#ifndef LINEAR_COMMON_GLSL
#define LINEAR_COMMON_GLSL

layout(std430, set = 0, binding = 0) readonly buffer X { uint x[]; };       // [tokens, in_features]
// x's buffer again, read a quad of elements per load (x_quad): one 16-byte load of float32, one 8-byte load of the
// 16-bit types, where four 4-byte loads were (on the H200 the matrix-vector kernel's loads of x, four to eight per
// weight chunk, held it to 0.67 TB/s)
layout(std430, set = 0, binding = 0) readonly buffer XQuads { uvec4 x_quads[]; };
layout(std430, set = 0, binding = 0) readonly buffer XPairs { uvec2 x_pairs[]; };
#ifndef WEIGHT_TEXELS   // the kernel declares binding 1 itself (linear_gemv_cpu.comp: a texel buffer)
layout(std430, set = 0, binding = 1) readonly buffer W { uvec4 weight[]; };     // [out_features, in_features]
#endif
layout(std430, set = 0, binding = 2) readonly buffer B { uint bias[]; };    // [out_features]
layout(std430, set = 0, binding = 3) buffer Y { uint y[]; };                // [tokens, out_features]

layout(push_constant) uniform Params {
    uint tokens;
    uint in_features;
    uint out_features;
    uint x_type;
    uint weight_type;
    uint bias_type;
    uint y_type;
    uint has_bias;
} pc;

const uint T_F32 = 0u, T_F16 = 1u, T_BF16 = 2u;

// Element i of a word array of `type`: word i in float32, half of word i / 2 in the 16-bit types (bfloat16 is the
// top half of a float32).
uint word_index(uint i, uint type) { return type == T_F32 ? i : i >> 1; }
float from_word(uint w, uint i, uint type) {
    if (type == T_F16) return unpackHalf2x16(w)[i & 1u];
    if (type == T_BF16) return uintBitsToFloat((i & 1u) == 1u ? (w & 0xffff0000u) : (w << 16));
    return uintBitsToFloat(w);
}
#define ELEMENT(words, i, type) from_word(words[word_index(i, type)], i, type)

// Elements i .. i + 3 of x, i a multiple of 4.
vec4 x_quad(uint i) {
    if (pc.x_type == T_F32) return uintBitsToFloat(x_quads[i >> 2]);
    const uvec2 w = x_pairs[i >> 2];
    const uint w0 = w.x, w1 = w.y;
    if (pc.x_type == T_F16) return vec4(unpackHalf2x16(w0), unpackHalf2x16(w1));
    return vec4(uintBitsToFloat(w0 << 16), uintBitsToFloat(w0 & 0xffff0000u),
                uintBitsToFloat(w1 << 16), uintBitsToFloat(w1 & 0xffff0000u));
}

// Weight elements per 16-byte chunk.
uint chunk_elements() { return pc.weight_type == T_F32 ? 4u : 8u; }

// A chunk's elements: v[0 .. chunk_elements() - 1].
void unpack_chunk(uvec4 c, out float v[8]) {
    if (pc.weight_type == T_F32) {
        for (uint j = 0u; j < 4u; ++j) { v[j] = uintBitsToFloat(c[j]); v[j + 4u] = 0.0; }
    } else if (pc.weight_type == T_F16) {
        for (uint j = 0u; j < 4u; ++j) { const vec2 p = unpackHalf2x16(c[j]); v[2u * j] = p.x; v[2u * j + 1u] = p.y; }
    } else {
        for (uint j = 0u; j < 4u; ++j) {
            v[2u * j] = uintBitsToFloat(c[j] << 16);
            v[2u * j + 1u] = uintBitsToFloat(c[j] & 0xffff0000u);
        }
    }
}

#ifndef WEIGHT_TEXELS
// Weight element g (counted over the whole [out_features, in_features] array).
float weight_element(uint g) {
    const uint per = chunk_elements(), e = g % per;
    const uvec4 c = weight[g / per];
    if (pc.weight_type == T_F32) return uintBitsToFloat(c[e]);
    return from_word(c[e >> 1], e, pc.weight_type);
}
#endif

// The bias of output feature n (0 without one).
float bias_of(uint n) { return pc.has_bias != 0u ? ELEMENT(bias, n, pc.bias_type) : 0.0; }

// Store v as y's element i, rounded to nearest even. A 16-bit element shares its word with a neighbour that another
// workgroup may write at the same time (the next row of a tile, the first of the next token's): atomicAnd clears
// this element's bits and atomicOr sets them, and these commute with the neighbour's pair, so neither write is lost.
void store_y(uint i, float v) {
    if (pc.y_type == T_F32) {
        y[i] = floatBitsToUint(v);
        return;
    }
    uint bits;
    if (pc.y_type == T_F16) {
        bits = packHalf2x16(vec2(v, 0.0)) & 0xffffu;
    } else {
        const uint b = floatBitsToUint(v);
        bits = isnan(v) ? 0x7fc0u : (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    }
    const uint shift = (i & 1u) * 16u;
    atomicAnd(y[i >> 1], ~(0xffffu << shift));
    atomicOr(y[i >> 1], bits << shift);
}

uint workgroup_index() {
    return gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
}

#endif
