// Elements of the layer ops (embedding, rms_norm, silu_and_mul, rotary_embedding): activations, weights and tables
// of the float type a push constant names (abi.QUERY_TYPES' codes: 0 float32, 1 float16, 2 bfloat16), bound as
// 32-bit words so that no type needs a 16-bit storage feature. The ops read and write PAIRS, two consecutive
// elements starting at an even one: pair p is words 2p and 2p + 1 in float32 and word p in the 16-bit types, so no
// two threads ever share a word of a 16-bit output (the ops require even row lengths and pitches). Compute is in
// float32. The WGSL twin is layer_elements.wgsl.
#ifndef LAYER_ELEMENTS_GLSL
#define LAYER_ELEMENTS_GLSL

const uint T_F32 = 0u, T_F16 = 1u, T_BF16 = 2u;
const uint WG = 128u;   // every layer op's workgroup size (catalogue: LAYER_WORKGROUP)

// Words of one pair; any code other than 1 and 2 reads float32, bounds included, so a wrong code stays in bounds.
uint pair_words(uint type) { return type == T_F16 || type == T_BF16 ? 1u : 2u; }

// bfloat16 is the top half of a float32; packing rounds to nearest even and keeps NaN a NaN (as kv_storage.glsl's
// pack_bf16x2, which this file does not include: it brings the attention kernels' storage machinery).
vec2 layer_bf16x2(uint w) { return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xffff0000u)); }
uint layer_pack_bf16x2(vec2 v) {
    uvec2 b = floatBitsToUint(v);
    uvec2 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = mix(r, uvec2(0x7fc0u), isnan(v));
    return r.x | (r.y << 16);
}
vec2 unpack_16bit_pair(uint w, uint type) { return type == T_F16 ? unpackHalf2x16(w) : layer_bf16x2(w); }
uint pack_16bit_pair(vec2 v, uint type) { return type == T_F16 ? packHalf2x16(v) : layer_pack_bf16x2(v); }

// v rounded to the type, as storing and loading it again would give (fused_add_rms_norm normalizes the residual
// it stores, rounded).
vec2 rounded_to(vec2 v, uint type) { return pair_words(type) == 2u ? v : unpack_16bit_pair(pack_16bit_pair(v, type), type); }

// GLSL passes no buffer to a function: these take the bound array by name.
// Whole pairs in a bound array of words.
#define PAIRS_IN(words, type) (uint(words.length()) / pair_words(type))
// Pair p of `words`, as floats.
#define LOAD_PAIR(words, p, type) (pair_words(type) == 2u                                     \
    ? uintBitsToFloat(uvec2(words[2u * (p)], words[2u * (p) + 1u])) : unpack_16bit_pair(words[p], type))
// Pair p of `words` := v.
#define STORE_PAIR(words, p, type, v) {                                                        \
    const vec2 v_ = (v); const uint p_ = (p);                                                  \
    if (pair_words(type) == 2u) { words[2u * p_] = floatBitsToUint(v_.x); words[2u * p_ + 1u] = floatBitsToUint(v_.y); } \
    else { words[p_] = pack_16bit_pair(v_, type); } }

// The workgroup's number in a grid folded to the device's limits (pagedvk.runtime.pipeline.fold_grid).
uint layer_workgroup() {
    return gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
}

// Index i of an int32 array (words 1) or an int64 one (words 2, low word first): its value where it lies in
// [0, limit), else `limit`, which every caller treats as out of range. A negative int32 reads as 2^31 or more
// unsigned, past any limit (the ops keep limits below 2^31); an int64 is in range only if its high word is 0.
// The caller has checked that element i lies in the array (the high word's index is clamped all the same).
#define INDEX_BELOW(ints, i, words, limit) index_below((ints)[(i) * (words)],                 \
    (words) == 2u ? (ints)[min((i) * 2u + 1u, uint((ints).length()) - 1u)] : 0, limit)
uint index_below(int lo, int hi, uint limit) {
    return hi != 0 || uint(lo) >= limit ? limit : uint(lo);
}

#endif
