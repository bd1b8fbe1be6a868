#version 450
// rotary_embedding (ROTARY_EMBEDDING in pagedvk/kernels/catalogue.py): vLLM's rotary position embedding, in place on
// the first rot_dim dims of every head of query [tokens, num_heads * head_size] and key [tokens, num_kv_heads *
// head_size] (rows query_pitch / key_pitch elements apart; x_type). cos_sin_cache [max_position, rot_dim] (cache_type)
// holds cos(pos * theta_i) in its first rot_dim / 2 columns and sin in the rest. Rotation i (i < rot_dim / 2) turns
//     (x1, x2) -> (x1 cos_i - x2 sin_i, x2 cos_i + x1 sin_i)
// with x1, x2 the head's dims i and i + rot_dim / 2 (is_neox: NeoX style) or 2i and 2i + 1 (GPT-J style,
// llama.cpp's rope type 0). Each thread takes rotations 2k and 2k + 1 of one head: two pairs of the head
// (layer_elements.glsl), which it alone reads and writes (rot_dim is a multiple of 4). A position outside
// [0, max_position) (possible only with validate=False) leaves its token as it is: the table is never read outside.
#extension GL_GOOGLE_include_directive : require
#include "layer_elements.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Positions { int positions[]; };   // int32, or int64 as 2 words
layout(std430, set = 0, binding = 1) buffer Query { uint query[]; };
layout(std430, set = 0, binding = 2) buffer Key { uint key[]; };   // unused (num_kv_heads 0) without a key
layout(std430, set = 0, binding = 3) readonly buffer CosSinCache { uint cos_sin_cache[]; };

layout(push_constant) uniform Params {
    uint num_tokens;
    uint num_heads;
    uint num_kv_heads;    // 0: no key
    uint head_size;       // even
    uint rot_dim;         // a multiple of 4, at most head_size
    uint max_position;
    uint is_neox;
    uint position_words;  // 1: int32 positions, 2: int64
    uint x_type;          // query's and key's
    uint cache_type;
    uint query_pitch;     // even
    uint key_pitch;       // even
} pc;

// The two pairs a thread takes, rotated by the pairs c = (cos_2k, cos_2k+1), s = (sin_2k, sin_2k+1). NeoX: a holds
// x1 of rotations 2k, 2k + 1 and b their x2; GPT-J: a holds rotation 2k's (x1, x2), b rotation 2k + 1's.
void rotate(inout vec2 a, inout vec2 b, vec2 c, vec2 s) {
    if (pc.is_neox != 0u) {
        const vec2 x1 = a, x2 = b;
        a = x1 * c - x2 * s;
        b = x2 * c + x1 * s;
    } else {
        const vec2 x1 = vec2(a.x, b.x), x2 = vec2(a.y, b.y);
        const vec2 y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        a = vec2(y1.x, y2.x);
        b = vec2(y1.y, y2.y);
    }
}

void main() {
    const uint quads = pc.rot_dim / 4u, heads = pc.num_heads + pc.num_kv_heads;
    const uint i = layer_workgroup() * WG + gl_LocalInvocationID.x;   // (token, head, k), flattened
    if (quads == 0u || i >= pc.num_tokens * heads * quads) return;
    const uint t = i / (heads * quads), h = i / quads % heads, k = i % quads;
    if (t * pc.position_words + pc.position_words > uint(positions.length())) return;
    const uint pos = INDEX_BELOW(positions, t, pc.position_words, pc.max_position);
    const uint half_pairs = pc.rot_dim / 4u;   // pairs in rot_dim / 2 columns
    const uint c = pos * (pc.rot_dim / 2u) + k;   // the cos pair; the sin pair is half_pairs after it
    if (pos >= pc.max_position || c + half_pairs >= PAIRS_IN(cos_sin_cache, pc.cache_type)) return;
    const vec2 cs = LOAD_PAIR(cos_sin_cache, c, pc.cache_type), sn = LOAD_PAIR(cos_sin_cache, c + half_pairs, pc.cache_type);

    // the head's first pair, and the pairs a and b a rotation step reads (in pairs from it)
    const bool is_query = h < pc.num_heads;
    const uint head = is_query ? h : h - pc.num_heads;
    const uint first = (t * (is_query ? pc.query_pitch : pc.key_pitch) + head * pc.head_size) / 2u;
    const uint a = first + (pc.is_neox != 0u ? k : 2u * k), b = pc.is_neox != 0u ? a + half_pairs : a + 1u;
    if (is_query) {
        if (b >= PAIRS_IN(query, pc.x_type)) return;
        vec2 x1 = LOAD_PAIR(query, a, pc.x_type), x2 = LOAD_PAIR(query, b, pc.x_type);
        rotate(x1, x2, cs, sn);
        STORE_PAIR(query, a, pc.x_type, x1)
        STORE_PAIR(query, b, pc.x_type, x2)
    } else {
        if (b >= PAIRS_IN(key, pc.x_type)) return;
        vec2 x1 = LOAD_PAIR(key, a, pc.x_type), x2 = LOAD_PAIR(key, b, pc.x_type);
        rotate(x1, x2, cs, sn);
        STORE_PAIR(key, a, pc.x_type, x1)
        STORE_PAIR(key, b, pc.x_type, x2)
    }
}
