#version 450
// embedding: out[t] = weight[token_ids[t]], one thread per pair of a row's elements (EMBEDDING in
// pagedvk/kernels/catalogue.py). weight [vocab_size, hidden_size] and out [num_tokens, hidden_size] are of the
// types weight_type and out_type (layer_elements.glsl); out rows lie out_pitch elements apart. An id outside
// [0, vocab_size) (possible only with validate=False) gives a row of zeros: the table is never read outside.
#extension GL_GOOGLE_include_directive : require
#include "layer_elements.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer TokenIds { int token_ids[]; };   // int32, or int64 as 2 words
layout(std430, set = 0, binding = 1) readonly buffer Weight { uint weight[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Out { uint out_[]; };

layout(push_constant) uniform Params {
    uint num_tokens;
    uint hidden_size;   // even
    uint vocab_size;
    uint id_words;      // 1: int32 ids, 2: int64
    uint weight_type;
    uint out_type;
    uint out_pitch;     // even
} pc;

void main() {
    const uint pairs = pc.hidden_size / 2u;
    const uint i = layer_workgroup() * WG + gl_LocalInvocationID.x;   // pair i of the rows, flattened
    if (pairs == 0u || i >= pc.num_tokens * pairs) return;
    const uint t = i / pairs, j = i % pairs;
    const uint o = t * (pc.out_pitch / 2u) + j;
    if (o >= PAIRS_IN(out_, pc.out_type) || t * pc.id_words + pc.id_words > uint(token_ids.length())) return;
    const uint id = INDEX_BELOW(token_ids, t, pc.id_words, pc.vocab_size);
    const uint w = id * pairs + j;
    vec2 v = vec2(0.0);
    if (id < pc.vocab_size && w < PAIRS_IN(weight, pc.weight_type)) v = LOAD_PAIR(weight, w, pc.weight_type);
    STORE_PAIR(out_, o, pc.out_type, v)
}
