#version 450
// Merges the partitions of a split decode (paged_decode.comp, paged_decode_coopmat.comp with num_partitions > 1,
// where the plan does not merge them in the decode dispatch itself): one workgroup per (query head, sequence), the
// merge of decode_merge.glsl (its formula, and how threads share the loads).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer SeqLens { int seq_lens[]; };              // [seqs]
layout(std430, set = 0, binding = 1) readonly buffer PartialOut { vec2 partial_out[]; };      // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 2) readonly buffer PartialStats { uvec2 partial_stats[]; }; // [seqs, heads, partitions]: float bits
layout(std430, set = 0, binding = 3) writeonly buffer Out { Q_WORD out_[]; };               // [seqs, heads, head_size]
layout(std430, set = 0, binding = 4) readonly buffer Sinks { float sinks[]; };                // [heads] (VARIANT_SINKS)
layout(std430, set = 0, binding = 5) writeonly buffer Lse { float lse[]; };                   // [seqs, heads] (VARIANT_LSE)

#ifndef KV_CHUNK_QUADS
#define KV_CHUNK_QUADS 1u   // no cache here: attention_common.glsl's key addressing goes unused
#endif
#include "attention_common.glsl"

#include "decode_merge.glsl"

void main() {
    const uint wg = workgroup_index();
    const uint head = wg % pc.num_heads;
    const uint seq = wg / pc.num_heads;
    const uint hs = pc.head_size;
    // Uniform over the workgroup, so that every thread reaches the barriers of the merge.
    if (seq >= pc.num_seqs || pc.partition_size == 0u || hs > 4u * WG) return;
    const uint seq_len = seq < uint(seq_lens.length()) ? uint(max(seq_lens[seq], 0)) : 0u;
    const uint seq_keys = min(seq_len, pc.max_blocks_per_seq * pc.block_size);   // as the decode bounds it
    const uint first = min(window_first_key(seq_keys - 1u), seq_keys) & ~(pc.block_size - 1u);
    merge_partitions(seq, head, 1u, partitions_holding(first, seq_keys));
}
