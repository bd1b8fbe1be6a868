#version 450
// Merges the partitions of a split decode (paged_decode.comp with num_partitions > 1): each partition i
// left its normalized output o_i, its max m_i and its sum l_i; the result is
//     v_scale * sum_i w_i o_i / (sum_i w_i + exp(sink - max_j m_j)),   w_i = l_i exp(m_i - max_j m_j),
// the sink (attention sinks, VARIANT_SINKS) added here once, not per partition; lse is written where
// VARIANT_LSE is set.
// One workgroup per (query head, sequence). Only the partitions that hold tokens of the sequence are used (the
// last partition takes every token past its start; with a sliding window the first starts at the window's
// first block, as in the decode). Threads own a pair of head dims and a lane of partitions (WG / (head_size / 2)
// lanes). Each thread loads UNROLL of its partitions' (max, sum) and outputs before it uses any, and keeps a
// running max of its own (an online softmax over its partitions); the lanes meet once, through shared memory.
// A merge is a chain of round trips, not of arithmetic: a loop with one load in flight per step took 0.45 us a
// partition on the H200 (BENCHMARKS.md, "Small decode shapes"), and a max over the workgroup before the weights
// and the outputs were loaded cost two round trips and 18 barriers more than this. The first loads do not wait
// for the sequence's length: they take any partition of the launch, and those past the sequence's are dropped
// after.
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

const uint UNROLL = 16u;    // partitions a thread loads before it uses any
shared vec2 s_ml[WG];       // each thread's (max, sum)
shared vec2 s_acc[WG];      // and its weighted sum of outputs, scaled to its max

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

    const float sink = variant_on(VARIANT_SINKS) && head < uint(sinks.length()) ? sinks[head] : NEG_INF;
    const uint pairs = hs / 2u, lanes = WG / pairs;
    const uint pair = tid % pairs, lane = tid / pairs;
    float m = NEG_INF, total = 0.0;   // this thread's max, and its sum of weights scaled to it
    vec2 acc = vec2(0.0);
    uint j = lane;
    do {
        vec2 ml[UNROLL], x[UNROLL];
        [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
            const uint k = j + u * lanes;
            const bool load = lane < lanes && k < pc.num_partitions;
            ml[u] = load ? partial_stats[slot0 + k] : vec2(NEG_INF, 0.0);
            x[u] = load ? partial_out[(slot0 + k) * pairs + pair] : vec2(0.0);
        }
        // A partition past the sequence's, or with no valid token (sum 0: its output was never written), is none.
        float top = m;
        [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
            if (j + u * lanes >= parts || !(ml[u].y > 0.0)) ml[u] = vec2(NEG_INF, 0.0);
            top = max(top, ml[u].x);
        }
        if (top > m) {
            const float alpha = m == NEG_INF ? 0.0 : exp(m - top);
            total *= alpha;
            acc *= alpha;
            m = top;
        }
        [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
            if (ml[u].y > 0.0) {
                const float w = ml[u].y * exp(ml[u].x - m);
                total += w;
                acc += w * x[u];
            }
        }
        j += UNROLL * lanes;
    } while (lane < lanes && j < parts);

    // The lanes meet: each pair's lane 0 sums the others', scaled to their common max.
    s_ml[tid] = vec2(m, total);
    s_acc[tid] = acc;
    barrier();
    if (lane == 0u) {
        for (uint l = 1u; l < lanes; l++) {
            const vec2 ml = s_ml[l * pairs + pair];
            const float top = max(m, ml.x);
            if (top == NEG_INF) continue;
            const float a = m == NEG_INF ? 0.0 : exp(m - top), b = ml.x == NEG_INF ? 0.0 : exp(ml.x - top);
            total = total * a + ml.y * b;
            acc = acc * a + s_acc[l * pairs + pair] * b;
            m = top;
        }
    }

    const vec2 fin = softmax_finish(m, total, sink);
    if (lane == 0u) out_[(o >> 1) + pair] = out_pair(acc * (fin.x * pc.v_scale));
    const uint row = seq * pc.num_heads + head;
    if (tid == 0u && variant_on(VARIANT_LSE) && row < uint(lse.length())) lse[row] = fin.y;
}
