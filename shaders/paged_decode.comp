#version 450
// Paged-attention decode: one query token per sequence attends over that sequence's cached keys and
// values, found through its block-table row (vLLM's cache layout). Grown from the seed decode kernel.
//
// One workgroup per (group of query heads sharing one kv head, sequence, partition of the context):
//   * GQA: the workgroup serves every query head of its group, so each key and value is read once for
//     all of them instead of once per head;
//   * split-K: a long context is cut into partitions of partition_size tokens that run in parallel, and
//     paged_decode_reduce.comp merges their partial results (when there is one partition the result is
//     written to `out` directly and no reduce runs).
// Inside a partition, as in vLLM's kernel:
//   A. each thread computes the logits of whole tokens (16-byte key chunks; neighbouring threads read
//      neighbouring chunks of one block, so the reads coalesce), keeping them in shared memory;
//   B. one workgroup max per head, then the weights exp(logit - max);
//   C. each thread accumulates the weighted values of the head dims it owns, for every head of the group.
// The softmax denominator is summed per thread and reduced once at the end; no epsilon is added, so a
// sequence of length 0 gives zeros and any other matches float64 to float32 rounding.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the cache, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

const uint WG = 128u;               // == local_size_x
const uint MAX_GROUP = 8u;          // query heads per workgroup
const uint MAX_HEAD_SIZE = 256u;    // two head dims per thread in phase C
const uint LOGIT_SLOTS = 4096u;     // group_size * partition_size must fit
const uint MIN_BLOCK_SIZE = 8u;
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { vec4 query[]; };             // [seqs, heads, head_size]
layout(std430, set = 0, binding = 1) readonly buffer KeyCache { uvec4 key_cache[]; };     // [blocks, kv_heads, head_size/x, block_size, x]
layout(std430, set = 0, binding = 2) readonly buffer ValueCache { uvec4 value_cache[]; }; // [blocks, kv_heads, head_size, block_size]
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { float out_[]; };            // [seqs, heads, head_size]
layout(std430, set = 0, binding = 6) writeonly buffer PartialOut { float partial_out[]; }; // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 7) writeonly buffer PartialStats { vec2 partial_stats[]; }; // [seqs, heads, partitions]: (max, sum)

layout(push_constant) uniform Params {
    uint num_heads;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint max_blocks_per_seq;
    uint num_blocks;         // set by the launcher from the bound caches' real size
    float scale;
    uint group_size;         // query heads per workgroup: a divisor of num_heads / num_kv_heads, <= MAX_GROUP
    uint partition_size;     // tokens per partition: a multiple of block_size and of CHUNK
    uint num_partitions;     // 1: write out directly
} pc;

shared vec4 s_q[MAX_GROUP * MAX_HEAD_SIZE / 4];      // the group's queries * scale, [group][chunk]
shared vec4 s_p[LOGIT_SLOTS / 4];                    // logits, then weights, [group][token] (4 tokens a vec4)
shared float s_red[MAX_GROUP * WG];                  // reduction scratch, [group][thread]
shared int s_phys[LOGIT_SLOTS / MIN_BLOCK_SIZE];     // the partition's physical blocks, -1 where invalid

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

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint seq = gl_WorkGroupID.y;
    const uint part = gl_WorkGroupID.z;
#ifdef HEAD_SIZE
    const uint hs = HEAD_SIZE;          // a compile-time head size lets the dot-product loops unroll
#else
    const uint hs = pc.head_size;
#endif
    const uint bs = pc.block_size;
    const uint group = pc.group_size;
    const uint P = pc.partition_size;
    const uint head0 = gl_WorkGroupID.x * group;                 // first query head of this workgroup
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint chunks_per_head = hs / CHUNK;                     // key chunks of one token
    const uint chunks_per_block = pc.num_kv_heads * hs * bs / CHUNK;
    const uint q_chunk0 = (seq * pc.num_heads + head0) * chunks_per_head;
    if (group > MAX_GROUP || group * P > LOGIT_SLOTS || hs > MAX_HEAD_SIZE
        || q_chunk0 + group * chunks_per_head > uint(query.length())) return;

    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint start = part * P;                                  // first token of the partition
    const uint part_len = start < seq_len ? min(P, seq_len - start) : 0u;
    const uint part_blocks = (part_len + bs - 1u) / bs;

    for (uint i = tid; i < group * chunks_per_head; i += WG) s_q[i] = query[q_chunk0 + i] * pc.scale;
    for (uint i = tid; i < part_blocks; i += WG) {
        int b = block_tables[row + start / bs + i];
        s_phys[i] = (b >= 0 && uint(b) < pc.num_blocks) ? b : -1;
    }
    barrier();

    // A: logits of whole tokens, and each thread's running max per head.
    float m[MAX_GROUP];
    for (uint g = 0u; g < MAX_GROUP; g++) m[g] = NEG_INF;
    const uint key_head = kv_head * chunks_per_head * bs;
    for (uint t = tid; t < part_len; t += WG) {
        float s[MAX_GROUP];
        for (uint g = 0u; g < MAX_GROUP; g++) s[g] = 0.0;
        const int phys = s_phys[t / bs];
        if (phys >= 0) {
            const uint k = uint(phys) * chunks_per_block + key_head + t % bs;
            for (uint c = 0u; c < chunks_per_head; c++) {
                const vec4 kc = CHUNK_VEC4(key_cache[k + c * bs]);
                for (uint g = 0u; g < MAX_GROUP; g++) if (g < group) s[g] += dot(kc, s_q[g * chunks_per_head + c]);
            }
        }
        for (uint g = 0u; g < MAX_GROUP; g++) {
            if (g < group) {
                const float logit = phys >= 0 ? s[g] : NEG_INF;
                s_p[(g * P + t) >> 2][t & 3u] = logit;
                m[g] = max(m[g], logit);
            }
        }
    }
    workgroup_reduce(m, group, true);

    // B: weights; each thread sums the ones it wrote.
    float l[MAX_GROUP];
    for (uint g = 0u; g < MAX_GROUP; g++) l[g] = 0.0;
    for (uint t = tid; t < part_len; t += WG) {
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

    // C: weighted values of head dims d0 and d1, one value chunk (CHUNK tokens of one dim) at a time.
    const uint d0 = tid, d1 = tid + WG;
    float acc0[MAX_GROUP], acc1[MAX_GROUP];
    for (uint g = 0u; g < MAX_GROUP; g++) { acc0[g] = 0.0; acc1[g] = 0.0; }
    const uint value_head = kv_head * hs * bs / CHUNK;
    const uint chunks_per_dim = bs / CHUNK;
    for (uint b = 0u; b < part_blocks; b++) {
        const int phys = s_phys[b];
        if (phys < 0) continue;
        const uint v_dim0 = uint(phys) * chunks_per_block + value_head;
        for (uint j = 0u; j < chunks_per_dim; j++) {
            const uint t0 = b * bs + j * CHUNK;
            if (t0 >= part_len) break;
            const uint n = min(CHUNK, part_len - t0);   // tokens past the end may hold anything, NaN too
            const vec4 v0 = d0 < hs ? CHUNK_VEC4_FIRST(value_cache[v_dim0 + d0 * chunks_per_dim + j], n) : vec4(0.0);
            const vec4 v1 = d1 < hs ? CHUNK_VEC4_FIRST(value_cache[v_dim0 + d1 * chunks_per_dim + j], n) : vec4(0.0);
            for (uint g = 0u; g < MAX_GROUP; g++) {
                if (g < group) {
                    const vec4 p = chunk_first(s_p[(g * P + t0) >> 2], n);
                    acc0[g] += dot(v0, p);
                    acc1[g] += dot(v1, p);
                }
            }
        }
    }
    workgroup_reduce(l, group, false);

    for (uint g = 0u; g < MAX_GROUP; g++) {
        if (g >= group) break;
        const uint head = head0 + g;
        const float inv = l[g] > 0.0 ? 1.0 / l[g] : 0.0;
        if (pc.num_partitions == 1u) {
            const uint o = (seq * pc.num_heads + head) * hs;
            if (o + hs > uint(out_.length())) break;
            if (d0 < hs) out_[o + d0] = acc0[g] * inv;
            if (d1 < hs) out_[o + d1] = acc1[g] * inv;
        } else {
            const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= uint(partial_stats.length()) || (slot + 1u) * hs > uint(partial_out.length())) break;
            if (d0 < hs) partial_out[slot * hs + d0] = acc0[g] * inv;
            if (d1 < hs) partial_out[slot * hs + d1] = acc1[g] * inv;
            if (tid == 0u) partial_stats[slot] = vec2(m[g], l[g]);
        }
    }
}
