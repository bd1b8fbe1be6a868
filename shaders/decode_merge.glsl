// The merge of a split decode's partitions, in one place for the two ways it runs: paged_decode_reduce.comp (a
// workgroup a query head, dispatched after the decode) and the GLSL decode kernels themselves (MERGE_IN_DECODE:
// the last workgroup of each (sequence, head group) to finish merges the group's heads in the decode dispatch).
// Each partition i left its normalized output o_i, its max m_i and its sum l_i; the result is
//     v_scale * sum_i w_i o_i / (sum_i w_i + exp(sink - max_j m_j)),   w_i = l_i exp(m_i - max_j m_j),
// the sink (attention sinks, VARIANT_SINKS) added here once, not per partition; lse is written where VARIANT_LSE
// is set. Only the partitions that hold tokens of the sequence count (`parts`: the last partition takes every
// token past its start; with a sliding window the first starts at the window's first block, as in the decode), and
// a partition with no valid token (sum 0: its output was never written) is none.
//
// Threads own a quad of head dims of one head (an item) and a lane of partitions (WG / items lanes, where the items
// are fewer than the threads). Each thread loads MERGE_UNROLL of its partitions' (max, sum) and outputs before it
// uses any, and keeps a running max of its own (an online softmax over its partitions); the lanes meet once,
// through shared memory. A merge is a chain of round trips, not of arithmetic: a loop with one load in flight per
// step took 0.45 us a partition on the H200, and a max over the workgroup before the weights and the outputs were
// loaded cost two round trips and 18 barriers more than this (BENCHMARKS.md). The first loads do not wait for the
// sequence's length: they take any partition of the launch, and those past `parts` are dropped after.
//
// Included after attention_common.glsl by kernels that bind partial_out (vec2 pairs), partial_stats ((max, sum) as
// uvec2 float bits: the decode kernels count on the same buffer with atomics), out_, sinks and lse.
#ifndef DECODE_MERGE_GLSL
#define DECODE_MERGE_GLSL

// Partitions a thread loads before it uses any: 8 quads, as many bytes as the 16 pairs of the pair-a-thread merge
// before it, which kept the reduce's registers low enough for its large grids (64 x 4096 on the scalar kernel: 2048
// workgroups, 11.3 us; 16 quads took 14.4 us, the H200).
const uint MERGE_UNROLL = 8u;
// Where lanes meet, six floats a thread: (max, sum, weighted sum of outputs scaled to the max). The decode kernels
// lend the shared array of their output sums (MERGE_SCRATCH), done with by the time they merge: the scalar kernel
// stays within the 32 KiB of shared memory that lavapipe and many devices allow.
#ifndef MERGE_SCRATCH
shared float s_merge[6u * WG];
#define MERGE_SCRATCH s_merge
#endif

// How many partitions hold keys of a sequence whose keys run from `first` (the first block of a sliding window, else
// 0) to `keys`: the last partition takes every key past its start. Each caller passes what it bounds the keys by.
uint partitions_holding(uint first, uint keys) {
    return min(pc.num_partitions, (keys - first + pc.partition_size - 1u) / pc.partition_size);
}

// (m, total, acc) and (m2, total2, acc2), two online-softmax states, as one.
void merge_states(inout float m, inout float total, inout vec4 acc, float m2, float total2, vec4 acc2) {
    const float top = max(m, m2);
    if (top == NEG_INF) {   // no key on either side: sums are 0, or NaN that must carry
        total += total2;
        acc += acc2;
        return;
    }
    const float a = m == NEG_INF ? 0.0 : exp(m - top), b = m2 == NEG_INF ? 0.0 : exp(m2 - top);
    total = total * a + total2 * b;
    acc = acc * a + acc2 * b;
    m = top;
}

// Partitions 0 .. parts - 1 of heads head0 .. head0 + heads - 1 of sequence seq, merged into out_ (and lse). The
// whole workgroup calls it (it has barriers).
void merge_partitions(uint seq, uint head0, uint heads, uint parts) {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = pc.head_size, NP = pc.num_partitions;
    const uint quads = hs / 4u, items = heads * quads;
    const uint span = min(items, WG);   // items a pass
    const uint lanes = WG / max(span, 1u), lane = tid / max(span, 1u);
    for (uint base = 0u; base < items; base += span) {
        const uint item = base + tid % span, head = head0 + item / quads, q = item % quads;
        const uint row = seq * pc.num_heads + head, slot0 = row * NP;
        const bool mine = lane < lanes && item < items && head < pc.num_heads && slot0 + NP <= uint(partial_stats.length())
                          && (slot0 + NP) * hs <= 2u * uint(partial_out.length());
        float m = NEG_INF, total = 0.0;   // this thread's max, and its sum of weights scaled to it
        vec4 acc = vec4(0.0);
        uint j = lane;
        do {
            vec2 ml[MERGE_UNROLL];
            vec4 x[MERGE_UNROLL];
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; u++) {
                const uint k = j + u * lanes, at = ((slot0 + k) * hs >> 1) + 2u * q;
                const bool load = mine && k < NP;
                ml[u] = load ? uintBitsToFloat(partial_stats[slot0 + k]) : vec2(NEG_INF, 0.0);
                x[u] = load ? vec4(partial_out[at], partial_out[at + 1u]) : vec4(0.0);
            }
            float top = m;
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; u++) {
                if (j + u * lanes >= parts || ml[u].y == 0.0) ml[u] = vec2(NEG_INF, 0.0);
                top = max(top, ml[u].x);
            }
            if (top > m) {
                const float alpha = m == NEG_INF ? 0.0 : exp(m - top);
                total *= alpha;
                acc *= alpha;
                m = top;
            }
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; u++) {
                if (ml[u].y != 0.0) {   // NaN included: it poisons the merge
                    const float w = ml[u].y * exp(ml[u].x - m);
                    total += w;
                    acc += w * x[u];
                }
            }
            j += MERGE_UNROLL * lanes;
        } while (mine && j < parts);

        if (lanes > 1u) {   // the lanes meet (one pass: span == items): each item's lane 0 takes the others'
            MERGE_SCRATCH[6u * tid] = m;
            MERGE_SCRATCH[6u * tid + 1u] = total;
            [[unroll]] for (uint e = 0u; e < 4u; e++) MERGE_SCRATCH[6u * tid + 2u + e] = acc[e];
            barrier();
            if (lane == 0u) {
                for (uint l = 1u; l < lanes; l++) {
                    const uint o = 6u * (l * span + tid);
                    const vec4 acc2 = vec4(MERGE_SCRATCH[o + 2u], MERGE_SCRATCH[o + 3u], MERGE_SCRATCH[o + 4u],
                                           MERGE_SCRATCH[o + 5u]);
                    merge_states(m, total, acc, MERGE_SCRATCH[o], MERGE_SCRATCH[o + 1u], acc2);
                }
            }
        }
        if (lane != 0u || !mine) continue;
        const float sink = variant_on(VARIANT_SINKS) && head < uint(sinks.length()) ? sinks[head] : NEG_INF;
        const vec2 fin = softmax_finish(m, total, sink);
        const uint at = ((out_token(seq) + head * hs) >> 1) + 2u * q;
        if (at + 1u < OUT_PAIRS(out_)) {
            STORE_OUT_PAIR(out_, at, acc.xy * (fin.x * pc.v_scale))
            STORE_OUT_PAIR(out_, at + 1u, acc.zw * (fin.x * pc.v_scale))
        }
        if (q == 0u && variant_on(VARIANT_LSE) && row < uint(lse.length())) lse[row] = fin.y;
    }
}

#ifdef DECODE_MERGE_IN_DISPATCH
// MERGE_IN_DECODE. A split's partitions merged in the decode dispatch: each workgroup, its partials written, counts
// itself in on its (sequence, head group)'s counter, and the one that finds itself last merges the group's
// partitions into out (the "last block" reduction of CUDA's threadFenceReduction sample), so no second dispatch and
// no barrier before it (a dispatch costs the H200 3.6 us at least; docs/benchmarks-log.md, 2026-12-02). The counters are
// uint32s after partial_stats' pairs (one a (sequence, head group), in .x), zeroed when the plan allocates them;
// the last workgroup takes its counter back down by num_partitions, so that it is zero again after every run.
// Ordering, in GLSL's memory model with coherent buffers: each invocation's partial writes are made visible by
// memoryBarrierBuffer() before the barrier and the workgroup's atomic; the last workgroup reads the partials after
// the atomic, a barrier and memoryBarrierBuffer(). A specialization constant (abi.DECODE_MERGE_SPEC_ID, set per
// plan: pagedvk/decode.py) keeps this code out of every other pipeline: merged into every module it made them all
// slower (BENCHMARKS.md, "Small decode shapes").
layout(constant_id = 3) const uint MERGE_IN_DECODE = 0u;
shared uint s_last;   // whether this workgroup merges

void merge_if_last(uint seq, uint head0, uint group, uint parts) {
    if (MERGE_IN_DECODE == 0u || pc.num_partitions <= 1u) return;
    const uint NP = pc.num_partitions;
    const uint counter = pc.num_seqs * pc.num_heads * NP + seq * (pc.num_heads / group) + head0 / group;
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0u) {
        bool last = false;
        if (counter < uint(partial_stats.length())) {
            last = atomicAdd(partial_stats[counter].x, 1u) % NP == NP - 1u;
            if (last) atomicAdd(partial_stats[counter].x, 0u - NP);
        }
        s_last = last ? 1u : 0u;
    }
    barrier();
    if (s_last == 0u) return;
    memoryBarrierBuffer();
    merge_partitions(seq, head0, group, parts);
}
#endif

#endif
