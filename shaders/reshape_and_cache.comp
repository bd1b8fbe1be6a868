#version 450
// reshape_and_cache: writes each token's keys and values into the cache slot slot_mapping gives it
// (RESHAPE_AND_CACHE in pagedvk/abi.py). One thread per (token, kv head, head dim) converts that key element
// and that value element to the cache's type (kv_encode.glsl; fp8 divided by its scale first, as vLLM does)
// and stores them.
//
// Race-free sub-word writes: an element narrower than 32 bits shares its word with other elements, written
// by other threads (in vLLM's value layout, the same head dim of neighbouring tokens). Each thread clears
// its own bits with atomicAnd and sets them with atomicOr: the two commute with every other thread's pair,
// which touch other bits, so no write is lost whatever the order (core Vulkan: 32-bit storage-buffer
// atomics need no feature). Two tokens given one slot leave one of them, as in vLLM.
//
// Slots below 0 are padding; slots at or past num_blocks * block_size (possible only with validate=False)
// are skipped too, so the kernel never writes outside the caches.
#extension GL_GOOGLE_include_directive : require
#define NO_QUERY_STORAGE   // its inputs' type is token_type (kv_encode.glsl), not the attention kernels' q_type
#include "kv_storage.glsl"
#include "kv_encode.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Key { uint key[]; };      // [tokens, kv_heads, head_size], rows key_pitch apart
layout(std430, set = 0, binding = 1) readonly buffer Value { uint value[]; };  // [tokens, kv_heads, head_size], rows value_pitch apart
layout(std430, set = 0, binding = 2) readonly buffer Slots { int slot_mapping[]; };  // int32, or int64 as 2 words
#if defined(KV_ADDRESSED)   // each cache binding holds its segments' device addresses (low, high word)
layout(std430, set = 0, binding = 3) buffer KeyCache { uvec2 key_cache[]; };      // writable as declared
layout(std430, set = 0, binding = 4) buffer ValueCache { uvec2 value_cache[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer Words { uint w[]; };
#else
layout(std430, set = 0, binding = 3) buffer KeyCache { uint key_cache[]; };
layout(std430, set = 0, binding = 4) buffer ValueCache { uint value_cache[]; };
#endif
#if defined(KV_SEGMENTED)   // segments 1-3 of each cache (pagedvk/abi.py's bindings_for)
layout(std430, set = 0, binding = 5) buffer KeyCache1 { uint key_cache_1[]; };
layout(std430, set = 0, binding = 6) buffer KeyCache2 { uint key_cache_2[]; };
layout(std430, set = 0, binding = 7) buffer KeyCache3 { uint key_cache_3[]; };
layout(std430, set = 0, binding = 8) buffer ValueCache1 { uint value_cache_1[]; };
layout(std430, set = 0, binding = 9) buffer ValueCache2 { uint value_cache_2[]; };
layout(std430, set = 0, binding = 10) buffer ValueCache3 { uint value_cache_3[]; };
#endif

layout(push_constant) uniform Params {
    uint num_tokens;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint num_blocks;
    uint slot_words;
    float k_scale;
    float v_scale;
    uint k_block_stride;
    uint k_head_stride;
    uint k_token_stride;
    uint k_chunk_stride;
    uint v_block_stride;
    uint v_head_stride;
    uint v_token_stride;
    uint v_dim_stride;
    uint blocks_per_segment;
    uint token_type;   // key and value storage: 0 float32, 1 float16, 2 bfloat16 (kv_encode.glsl's TOKEN_ELEMENT)
    uint key_pitch;    // elements from one token's keys to the next: num_kv_heads * head_size where contiguous,
    uint value_pitch;  // more in a strided view (a fused QKV projection's key or value columns)
} pc;

const uint X = 128u / KV_BITS;                 // vLLM's x: elements per 16-byte key chunk
const uint MASK = KV_BITS == 32u ? 0xffffffffu : (1u << KV_BITS) - 1u;

// Store `bits` as element e (counted in elements from the start of the bound array) of `words`.
#define STORE(words, e, bits) {                                                  \
    const uint i_ = (e) * KV_BITS / 32u, shift_ = (e) * KV_BITS % 32u;           \
    if (KV_BITS == 32u) { words[i_] = (bits); }                                  \
    else { atomicAnd(words[i_], ~(MASK << shift_)); atomicOr(words[i_], (bits) << shift_); } }

// Element e of block b of a cache, where the cache is split into segments of blocks_per_segment blocks.
#if defined(KV_ADDRESSED)
#define STORE_IN(cache, b, e, block_stride, bits) {                              \
    const uint s_ = (b) / pc.blocks_per_segment;                                 \
    Words seg_ = Words(cache[s_]);                                               \
    STORE(seg_.w, ((b) - s_ * pc.blocks_per_segment) * (block_stride) + (e), bits) }
#elif defined(KV_SEGMENTED)
#define STORE_IN(cache, b, e, block_stride, bits) {                              \
    const uint s_ = (b) / pc.blocks_per_segment;                                 \
    const uint o_ = ((b) - s_ * pc.blocks_per_segment) * (block_stride) + (e);   \
    switch (s_) {                                                                \
        case 0u: STORE(cache, o_, bits) break;                                   \
        case 1u: STORE(cache##_1, o_, bits) break;                               \
        case 2u: STORE(cache##_2, o_, bits) break;                               \
        default: STORE(cache##_3, o_, bits) break; } }
#else
#define STORE_IN(cache, b, e, block_stride, bits) STORE(cache, (b) * (block_stride) + (e), bits)
#endif

void main() {
    const uint per_token = pc.num_kv_heads * pc.head_size;
    const uint wg = gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
    const uint i = wg * 128u + gl_LocalInvocationID.x;   // element (token, kv head, head dim), flattened
    if (i >= pc.num_tokens * per_token) return;
    const uint token = i / per_token, h = (i % per_token) / pc.head_size, d = i % pc.head_size;

    const int lo = slot_mapping[token * pc.slot_words];
    // An int64 slot is in range only if its high word is 0 (its low word is then read unsigned).
    const bool nonnegative = pc.slot_words == 1u ? lo >= 0 : slot_mapping[token * 2u + 1u] == 0;
    const uint slot = uint(lo);
    if (!nonnegative || slot / pc.block_size >= pc.num_blocks) return;
    const uint b = slot / pc.block_size, t = slot % pc.block_size;

    const uint e = i - token * per_token;   // (kv head, head dim) in the token's row
    float k = TOKEN_ELEMENT(key, token * pc.key_pitch + e), v = TOKEN_ELEMENT(value, token * pc.value_pitch + e);
#if defined(KV_E4M3) || defined(KV_E5M2)
    k /= pc.k_scale;
    v /= pc.v_scale;
#endif
    const uint ke = h * pc.k_head_stride + t * pc.k_token_stride + (d / X) * pc.k_chunk_stride + d % X;
    const uint ve = h * pc.v_head_stride + t * pc.v_token_stride + d * pc.v_dim_stride;
    STORE_IN(key_cache, b, ke, pc.k_block_stride, kv_encode(k))
    STORE_IN(value_cache, b, ve, pc.v_block_stride, kv_encode(v))
}
