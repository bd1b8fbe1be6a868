#version 450
// Merges the partitions of a split decode (paged_decode.comp with num_partitions > 1): each partition i
// left its normalized output o_i, its max m_i and its sum l_i; the result is
//     sum_i w_i o_i / sum_i w_i,   w_i = l_i exp(m_i - max_j m_j).
// One workgroup per (query head, sequence); threads own head dims. Only the partitions that hold tokens
// of the sequence are read.

const uint WG = 128u;
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer SeqLens { int seq_lens[]; };              // [seqs]
layout(std430, set = 0, binding = 1) readonly buffer PartialOut { float partial_out[]; };     // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 2) readonly buffer PartialStats { vec2 partial_stats[]; };  // [seqs, heads, partitions]
layout(std430, set = 0, binding = 3) writeonly buffer Out { float out_[]; };                  // [seqs, heads, head_size]

layout(push_constant) uniform Params {
    uint num_heads;
    uint head_size;
    uint partition_size;
    uint num_partitions;
} pc;

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint head = gl_WorkGroupID.x;
    const uint seq = gl_WorkGroupID.y;
    const uint hs = pc.head_size;
    const uint o = (seq * pc.num_heads + head) * hs;
    const uint slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > uint(out_.length()) || slot0 + pc.num_partitions > uint(partial_stats.length())
        || (slot0 + pc.num_partitions) * hs > uint(partial_out.length())) return;
    const uint seq_len = seq < uint(seq_lens.length()) ? uint(max(seq_lens[seq], 0)) : 0u;
    const uint parts = min(pc.num_partitions, (seq_len + pc.partition_size - 1u) / pc.partition_size);

    float m = NEG_INF;
    for (uint i = 0u; i < parts; i++) m = max(m, partial_stats[slot0 + i].x);
    float acc0 = 0.0, acc1 = 0.0, total = 0.0;
    const uint d0 = tid, d1 = tid + WG;
    for (uint i = 0u; i < parts; i++) {
        const vec2 ml = partial_stats[slot0 + i];
        if (ml.y <= 0.0) continue;            // a partition with no valid token
        const float w = ml.y * exp(ml.x - m);
        total += w;
        if (d0 < hs) acc0 += w * partial_out[(slot0 + i) * hs + d0];
        if (d1 < hs) acc1 += w * partial_out[(slot0 + i) * hs + d1];
    }
    const float inv = total > 0.0 ? 1.0 / total : 0.0;
    if (d0 < hs) out_[o + d0] = acc0 * inv;
    if (d1 < hs) out_[o + d1] = acc1 * inv;
}
