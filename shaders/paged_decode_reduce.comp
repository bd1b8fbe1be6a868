#version 450
// Merges the partitions of a split decode (paged_decode.comp with num_partitions > 1): each partition i
// left its normalized output o_i, its max m_i and its sum l_i; the result is
//     v_scale * sum_i w_i o_i / (sum_i w_i + exp(sink - max_j m_j)),   w_i = l_i exp(m_i - max_j m_j),
// the sink (attention sinks, VARIANT_SINKS) added here once, not per partition; lse is written where
// VARIANT_LSE is set.
// One workgroup per (query head, sequence). Only the partitions that hold tokens of the sequence are read (the
// last partition takes every token past its start; with a sliding window the first starts at the window's
// first block, as in the decode). Every step is spread over the partitions, not walked one partition after
// another: a loop with one load in flight per step took 0.45 us a partition on the H200 (114 us for 256
// partitions, more than the decode it merged; BENCHMARKS.md, "Small decode shapes"):
//   1. the max, each thread over every WG-th partition, then across the workgroup;
//   2. per CHUNK partitions, their weights into shared memory (and the threads' shares of their sum);
//   3. threads own a pair of head dims and a lane of partitions (WG / (head_size / 2) lanes), and load
//      UNROLL partitions' outputs before they use any; the lanes' sums meet in shared memory at the end.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
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

const uint CHUNK = 512u;    // partitions whose weights shared memory holds at a time
const uint UNROLL = 8u;     // partial outputs a thread loads before it uses any
shared float s_w[CHUNK];
shared float s_red[WG];
shared vec2 s_acc[WG];

// Max (is_max) or sum of every thread's x; every thread gets the result. Barriers on both sides.
float workgroup_reduce(float x, bool is_max) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    s_red[tid] = x;
    barrier();
    for (uint half_ = WG / 2u; half_ > 0u; half_ >>= 1) {
        if (tid < half_) s_red[tid] = is_max ? max(s_red[tid], s_red[tid + half_]) : s_red[tid] + s_red[tid + half_];
        barrier();
    }
    return s_red[0];
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint wg = workgroup_index();
    const uint head = wg % pc.num_heads;
    const uint seq = wg / pc.num_heads;
    const uint hs = pc.head_size;
    // Uniform over the workgroup, so that every thread reaches the barriers below.
    if (seq >= pc.num_seqs || pc.partition_size == 0u) return;
    const uint o = (seq * pc.num_heads + head) * hs;
    const uint slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > 2u * uint(out_.length()) || slot0 + pc.num_partitions > uint(partial_stats.length())
        || (slot0 + pc.num_partitions) * hs > 2u * uint(partial_out.length()) || hs > 2u * WG) return;
    const uint seq_len = seq < uint(seq_lens.length()) ? uint(max(seq_lens[seq], 0)) : 0u;
    const uint seq_keys = min(seq_len, pc.max_blocks_per_seq * pc.block_size);   // as the decode bounds it
    const uint first = min(window_first_key(seq_keys - 1u), seq_keys) & ~(pc.block_size - 1u);
    const uint parts = min(pc.num_partitions, (seq_keys - first + pc.partition_size - 1u) / pc.partition_size);

    float m = NEG_INF;
    for (uint i = tid; i < parts; i += WG) m = max(m, partial_stats[slot0 + i].x);
    m = workgroup_reduce(m, true);

    const uint pairs = hs / 2u, lanes = WG / pairs;
    const uint pair = tid % pairs, lane = tid / pairs;
    vec2 acc = vec2(0.0);
    float total = 0.0;
    for (uint c0 = 0u; c0 < parts; c0 += CHUNK) {
        const uint n = min(CHUNK, parts - c0);
        barrier();   // the previous chunk's weights are read
        for (uint j = tid; j < n; j += WG) {
            const vec2 ml = partial_stats[slot0 + c0 + j];
            const float w = ml.y > 0.0 ? ml.y * exp(ml.x - m) : 0.0;   // a partition with no valid token: none
            s_w[j] = w;
            total += w;
        }
        barrier();
        for (uint j = lane; lane < lanes && j < n; j += UNROLL * lanes) {
            vec2 x[UNROLL];
            [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
                const uint k = j + u * lanes;
                // an empty partition's output was never written: not read
                x[u] = k < n && s_w[k] > 0.0 ? partial_out[(slot0 + c0 + k) * pairs + pair] : vec2(0.0);
            }
            [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
                const uint k = j + u * lanes;
                if (k < n) acc += s_w[k] * x[u];
            }
        }
    }
    total = workgroup_reduce(total, false);
    s_acc[tid] = acc;
    barrier();
    if (lane == 0u) for (uint l = 1u; l < lanes; l++) acc += s_acc[l * pairs + pair];

    const float sink = variant_on(VARIANT_SINKS) && head < uint(sinks.length()) ? sinks[head] : NEG_INF;
    const vec2 fin = softmax_finish(m, total, sink);
    if (lane == 0u) out_[(o >> 1) + pair] = out_pair(acc * (fin.x * pc.v_scale));
    const uint row = seq * pc.num_heads + head;
    if (tid == 0u && variant_on(VARIANT_LSE) && row < uint(lse.length())) lse[row] = fin.y;
}
