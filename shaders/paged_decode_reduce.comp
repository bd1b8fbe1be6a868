#version 450
// Merges the partitions of a split decode (paged_decode.comp with num_partitions > 1): each partition i
// left its normalized output o_i, its max m_i and its sum l_i; the result is
//     v_scale * sum_i w_i o_i / (sum_i w_i + exp(sink - max_j m_j)),   w_i = l_i exp(m_i - max_j m_j),
// the sink (attention sinks, VARIANT_SINKS) added here once, not per partition; lse is written where
// VARIANT_LSE is set.
// One workgroup per (query head, sequence); threads own pairs of head dims. Only the partitions that hold
// tokens of the sequence are read (the last partition takes every token past its start; with a sliding
// window the first starts at the window's first block, as in the decode).
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer SeqLens { int seq_lens[]; };              // [seqs]
layout(std430, set = 0, binding = 1) readonly buffer PartialOut { vec2 partial_out[]; };      // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 2) readonly buffer PartialStats { vec2 partial_stats[]; };  // [seqs, heads, partitions]
layout(std430, set = 0, binding = 3) writeonly buffer Out { OUT_PAIR out_[]; };               // [seqs, heads, head_size]
layout(std430, set = 0, binding = 4) readonly buffer Sinks { float sinks[]; };                // [heads] (VARIANT_SINKS)
layout(std430, set = 0, binding = 5) writeonly buffer Lse { float lse[]; };                   // [seqs, heads] (VARIANT_LSE)

#ifndef KV_CHUNK_QUADS
#define KV_CHUNK_QUADS 1u   // no cache here: attention_common.glsl's key addressing goes unused
#endif
#include "attention_common.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint wg = workgroup_index();
    const uint head = wg % pc.num_heads;
    const uint seq = wg / pc.num_heads;
    const uint hs = pc.head_size;
    if (seq >= pc.num_seqs || pc.partition_size == 0u) return;
    const uint o = (seq * pc.num_heads + head) * hs;
    const uint slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > 2u * uint(out_.length()) || slot0 + pc.num_partitions > uint(partial_stats.length())
        || (slot0 + pc.num_partitions) * hs > 2u * uint(partial_out.length())) return;
    const uint seq_len = seq < uint(seq_lens.length()) ? uint(max(seq_lens[seq], 0)) : 0u;
    const uint seq_keys = min(seq_len, pc.max_blocks_per_seq * pc.block_size);   // as the decode bounds it
    const uint first = min(window_first_key(seq_keys - 1u), seq_keys) & ~(pc.block_size - 1u);
    const uint parts = min(pc.num_partitions, (seq_keys - first + pc.partition_size - 1u) / pc.partition_size);

    float m = NEG_INF;
    for (uint i = 0u; i < parts; i++) m = max(m, partial_stats[slot0 + i].x);
    vec2 acc = vec2(0.0);
    float total = 0.0;
    const uint d0 = 2u * tid;
    for (uint i = 0u; i < parts; i++) {
        const vec2 ml = partial_stats[slot0 + i];
        if (ml.y <= 0.0) continue;            // a partition with no valid token
        const float w = ml.y * exp(ml.x - m);
        total += w;
        if (d0 < hs) acc += w * partial_out[((slot0 + i) * hs + d0) >> 1];
    }
    const float sink = (pc.variants & VARIANT_SINKS) != 0u && head < uint(sinks.length()) ? sinks[head] : NEG_INF;
    const vec2 fin = softmax_finish(m, total, sink);
    if (d0 < hs) out_[(o + d0) >> 1] = out_pair(acc * (fin.x * pc.v_scale));
    const uint row = seq * pc.num_heads + head;
    if (tid == 0u && (pc.variants & VARIANT_LSE) != 0u && row < uint(lse.length())) lse[row] = fin.y;
}
