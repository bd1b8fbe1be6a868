#version 450
// Paged-attention decode: one query token per sequence attends over that sequence's cached keys and
// values, found through its block-table row, in either cache layout and any storage type
// (kv_storage.glsl). Grown from the seed decode kernel.
//
// One workgroup per (group of query heads sharing one kv head, sequence, partition of the context):
//   * GQA: the workgroup serves every query head of its group, so each key and value is read once for
//     all of them instead of once per head;
//   * split-K: a long context is cut into partitions of partition_size tokens that run in parallel, and
//     paged_decode_reduce.comp merges their partial results (with one partition the result is written to
//     `out` directly and no reduce runs). The last partition takes every token from its start to the
//     sequence's end, so lengths that grew after the plan chose its partitions are still covered whole.
// A partition is walked in tiles of partition_size tokens with an online softmax:
//   A. each thread computes the logits of whole tokens (key quads; in vLLM's layout neighbouring threads
//      read neighbouring 16-byte chunks of one block, so the reads coalesce) into shared memory, and the
//      workgroup takes each head's tile max;
//   B. the running max, sum and accumulators are rescaled, logits become weights;
//   C. each thread accumulates the weighted values of the two head dims it owns, for every head.
// The softmax denominator is summed per thread and reduced once at the end; no epsilon is added, so a
// sequence of length 0 gives zeros and any other matches float64 to float32 rounding.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the cache, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };           // [seqs, heads, head_size]
#define KV_SEGMENT_BINDING 8   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { OUT_PAIR out_[]; };         // [seqs, heads, head_size]
layout(std430, set = 0, binding = 6) writeonly buffer PartialOut { vec2 partial_out[]; }; // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 7) writeonly buffer PartialStats { vec2 partial_stats[]; }; // [seqs, heads, partitions]: (max, sum)

#include "attention_common.glsl"

const uint MAX_GROUP = 8u;          // query heads per workgroup
const uint LOGIT_SLOTS = 4096u;     // group_size * partition_size must fit

shared vec4 s_q[MAX_GROUP * MAX_HEAD_SIZE / 4];      // the group's queries * scale, [group][quad]
shared vec4 s_p[LOGIT_SLOTS / 4];                    // logits, then weights, [group][token] (4 tokens a vec4)
shared float s_red[MAX_GROUP * WG];                  // reduction scratch, [group][thread]
shared int s_phys[LOGIT_SLOTS / MIN_BLOCK_SIZE];     // the tile's physical blocks, -1 where invalid

// Reduce v[g] over the workgroup for every g < group; max when is_max, else sum.
void workgroup_reduce(inout float v[MAX_GROUP], uint group, bool is_max) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint g = 0u; g < MAX_GROUP; g++) if (g < group) s_red[g * WG + tid] = v[g];
    barrier();
    for (uint stride = WG / 2u; stride > 0u; stride >>= 1) {
        if (tid < stride) {
            for (uint g = 0u; g < MAX_GROUP; g++) {
                if (g < group) {
                    float a = s_red[g * WG + tid], b = s_red[g * WG + tid + stride];
                    s_red[g * WG + tid] = is_max ? max(a, b) : a + b;
                }
            }
        }
        barrier();
    }
    for (uint g = 0u; g < MAX_GROUP; g++) if (g < group) v[g] = s_red[g * WG];
    barrier();
}

// The first n (<= 4) elements of v, the rest zero: slots past a sequence's end may hold anything, NaN
// included, and 0 * NaN is NaN.
vec4 first(vec4 v, uint n) {
    return vec4(v.x, n > 1u ? v.y : 0.0, n > 2u ? v.z : 0.0, n > 3u ? v.w : 0.0);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
#ifdef HEAD_SIZE
    const uint hs = HEAD_SIZE;          // a compile-time head size lets the dot-product loops unroll
#else
    const uint hs = pc.head_size;
#endif
    const uint bs = pc.block_size;
    const uint group = pc.group_size;
    const uint P = pc.partition_size;
    const uint head_groups = pc.num_heads / max(group, 1u);
    const uint wg = workgroup_index();
    const uint seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    const uint part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || group * P > LOGIT_SLOTS || P == 0u || hs > MAX_HEAD_SIZE
        || part >= pc.num_partitions) return;
    const uint head0 = (wg % head_groups) * group;               // first query head of this workgroup
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint hq = hs / 4u;                                     // quads of one head
    const uint q_quad0 = (seq * pc.num_heads + head0) * hq;
    if (q_quad0 + group * hq > uint(query.length())) return;

    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint start = part * P;                                  // first token of the partition
    const uint end = part + 1u == pc.num_partitions ? seq_len : min(seq_len, start + P);

    for (uint i = tid; i < group * hq; i += WG) s_q[i] = q_quad(query[q_quad0 + i]) * pc.scale;

    float m[MAX_GROUP], l[MAX_GROUP], acc0[MAX_GROUP], acc1[MAX_GROUP];
    for (uint g = 0u; g < MAX_GROUP; g++) { m[g] = NEG_INF; l[g] = 0.0; acc0[g] = 0.0; acc1[g] = 0.0; }
    const uint d0 = 2u * tid;                                    // this thread's head dims: d0, d0 + 1

    for (uint base = start; base < end; base += P) {
        const uint len = min(P, end - base);
        const uint blocks = (len + bs - 1u) / bs;
        barrier();   // the previous tile's s_p and s_phys are no longer read
        for (uint i = tid; i < blocks; i += WG) {
            int b = block_tables[row + base / bs + i];
            s_phys[i] = (b >= 0 && uint(b) < pc.num_blocks) ? b : -1;
        }
        barrier();

        // A: logits of whole tokens, and each thread's max per head.
        float mt[MAX_GROUP];
        for (uint g = 0u; g < MAX_GROUP; g++) mt[g] = NEG_INF;
        for (uint t = tid; t < len; t += WG) {
            float s[MAX_GROUP];
            for (uint g = 0u; g < MAX_GROUP; g++) s[g] = 0.0;
            const int phys = s_phys[t / bs];
            if (phys >= 0) {
                const uint k0 = key_offset(kv_head, t % bs, 0u);
                for (uint c = 0u; c < hq; c++) {
                    const vec4 kc = kv_quad(key_load(uint(phys), k0 + (c / KV_CHUNK_QUADS) * pc.k_chunk_stride
                                                       + c % KV_CHUNK_QUADS));
                    for (uint g = 0u; g < MAX_GROUP; g++) if (g < group) s[g] += dot(kc, s_q[g * hq + c]);
                }
            }
            for (uint g = 0u; g < MAX_GROUP; g++) {
                if (g < group) {
                    const uint key = base + t, last = seq_len - 1u;   // the query is the sequence's last token
                    const float l = phys >= 0 && key_visible(key, last) ? logit(s[g], head0 + g, key, last) : NEG_INF;
                    s_p[(g * P + t) >> 2][t & 3u] = l;
                    mt[g] = max(mt[g], l);
                }
            }
        }
        workgroup_reduce(mt, group, true);

        // B: rescale what earlier tiles accumulated to the new max; weights, each thread summing its own.
        for (uint g = 0u; g < MAX_GROUP; g++) {
            if (g < group) {
                const float m_new = max(m[g], mt[g]);
                const float alpha = m_new == NEG_INF ? 1.0 : exp(m[g] - m_new);
                m[g] = m_new;
                l[g] *= alpha; acc0[g] *= alpha; acc1[g] *= alpha;
            }
        }
        for (uint t = tid; t < len; t += WG) {
            for (uint g = 0u; g < MAX_GROUP; g++) {
                if (g < group) {
                    const float logit = s_p[(g * P + t) >> 2][t & 3u];
                    const float p = logit == NEG_INF ? 0.0 : exp(logit - m[g]);
                    s_p[(g * P + t) >> 2][t & 3u] = p;
                    l[g] += p;
                }
            }
        }
        barrier();

        // C: weighted values of head dims d0 and d0 + 1, four tokens at a time (tiles start on a block, and
        // blocks hold a multiple of 4 tokens, so four tokens never straddle two blocks).
        if (d0 < hs) {
            for (uint t0 = 0u; t0 < len; t0 += 4u) {
                const int phys = s_phys[t0 / bs];
                if (phys < 0) continue;
                const uint n = min(4u, len - t0);
                const uint v0 = value_offset(kv_head, t0 % bs, d0);
                vec4 va, vb;   // dims d0 and d0 + 1 of the four tokens
                if (pc.v_token_stride == 1u) {   // vLLM's layout: a quad is four tokens of one dim
                    va = first(kv_quad(value_load(uint(phys), v0 >> 2)), n);
                    vb = first(kv_quad(value_load(uint(phys), (v0 + pc.v_dim_stride) >> 2)), n);
                } else {                         // nhd: a quad is four dims of one token
                    va = vec4(0.0); vb = vec4(0.0);
                    for (uint i = 0u; i < n; i++) {
                        const uint vi = v0 + i * pc.v_token_stride;
                        const vec4 v = kv_quad(value_load(uint(phys), vi >> 2));
                        va[i] = v[vi & 3u];
                        vb[i] = v[(vi & 3u) + 1u];
                    }
                }
                for (uint g = 0u; g < MAX_GROUP; g++) {
                    if (g < group) {
                        const vec4 p = first(s_p[(g * P + t0) >> 2], n);
                        acc0[g] += dot(va, p);
                        acc1[g] += dot(vb, p);
                    }
                }
            }
        }
    }
    workgroup_reduce(l, group, false);

    for (uint g = 0u; g < MAX_GROUP; g++) {
        if (g >= group) break;
        const uint head = head0 + g;
        const float inv = l[g] > 0.0 ? 1.0 / l[g] : 0.0;
        const vec2 o = vec2(acc0[g], acc1[g]) * inv;
        if (pc.num_partitions == 1u) {
            const uint pair = ((seq * pc.num_heads + head) * hs + d0) >> 1;
            if (d0 < hs && pair < uint(out_.length())) out_[pair] = out_pair(o * pc.v_scale);
        } else {
            const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= uint(partial_stats.length()) || (slot + 1u) * hs > 2u * uint(partial_out.length())) break;
            if (d0 < hs) partial_out[(slot * hs + d0) >> 1] = o;
            if (tid == 0u) partial_stats[slot] = vec2(m[g], l[g]);
        }
    }
}
