#version 450
// Paged-attention backward, the key and value gradients, written in the caches' layout:
//   dV = P^T dout,  dK = scale * dS^T q,  with P = exp(scale q.k - lse), dS = P * (dout.v - D),
//   D = rowsum(dout * out) (FlashAttention-2's backward).
//
// A physical block may be read by several sequences (shared prefixes), so gradients are gathered per
// block rather than scattered per sequence: one workgroup per (physical block, kv head, KEYS tokens of the
// block) walks the (sequence, block-table slot) pairs that read the block (block_readers, built on the
// host) and, for each, the query rows that see its tokens, ROWS at a time:
//   S. (once per block) the workgroup stages the KEYS tokens' keys and values in shared memory, converted
//      to float: every reader and every row step reuses them (read from the cache, each key and value was
//      read once per row of every step);
//   A. each thread computes P and dP - D of one (row, key) pair of the 16 x 8 (q, dout and out read from
//      their buffers, keys and values from shared memory);
//   C. each thread accumulates dV and dK of its head dims for the KEYS tokens.
// The sum runs in a fixed order, so it is deterministic and needs no float atomics (not core Vulkan).
// Every element of dk_cache and dv_cache is written exactly once: blocks and slots nobody reads get 0.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };            // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockReaders { int block_readers[]; }; // see PAGED_BACKWARD_DKDV
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };          // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Dout { Q_QUAD dout[]; };              // like query
layout(std430, set = 0, binding = 7) readonly buffer Out { Q_QUAD out_[]; };               // like query
layout(std430, set = 0, binding = 8) readonly buffer Lse { float lse[]; };                 // [tokens, heads]
layout(std430, set = 0, binding = 9) writeonly buffer DkCache { float dk_cache[]; };       // float32, key_cache's shape
layout(std430, set = 0, binding = 10) writeonly buffer DvCache { float dv_cache[]; };      // float32, like value_cache

#include "attention_common.glsl"
#include "prefill_common.glsl"

const uint KEYS = 8u;               // block tokens per workgroup, two vec4s (_a, _b) in the accumulators
const uint ROWS = 16u;              // query rows per step: one (row, key) pair per thread in A, so each step's
const uint PAIRS = ROWS * KEYS;     // two barriers serve 128 pairs (== WG)

shared float s_p[PAIRS];            // [row][key]: P
shared float s_dd[PAIRS];           // [row][key]: dP - D
// S's keys and values as float quads, [token][head quad]. With s_p and s_dd they fill 16 KiB, the least
// shared memory a Vulkan device offers, at head size STAGED_HEAD_SIZE; larger heads (256) read the cache in A.
const uint STAGED_HEAD_SIZE = 240u;
shared vec4 s_k[KEYS * STAGED_HEAD_SIZE / 4u];
shared vec4 s_v[KEYS * STAGED_HEAD_SIZE / 4u];

// Where key element (b, h, t, d) sits in an array of key_cache's shape (dk_cache).
uint key_element(uint b, uint h, uint t, uint d) {
    return (b * pc.k_block_stride + key_offset(h, t, d >> 2)) * 4u + (d & 3u);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint kv_head = gl_WorkGroupID.y;
    const uint sub = gl_WorkGroupID.z;          // tokens sub * KEYS .. of the block
    const uint hs = pc.head_size;
    const uint hc = hs / 4u;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    const uint max_blocks = pc.max_blocks_per_seq;
    if (hs > MAX_HEAD_SIZE || (sub + 1u) * KEYS > bs) return;

    const uint num_blocks = pc.num_blocks;   // held by the caches and by dk_cache, dv_cache (their shapes)
    const uint row_floats = min(min(uint(query.length()), uint(dout.length())), uint(out_.length())) * 4u;
    const uint first_entry = pc.num_blocks + 1u;   // block_readers: num_blocks + 1 offsets, then the pairs
    const uint entries = uint(max(int(block_readers.length()) - int(first_entry), 0));

    // Phase A's pair: row pr, key pk.
    const uint pr = tid / KEYS, pk = tid % KEYS;
    const uint d0 = tid, d1 = tid + WG;
    const bool staged = hs <= STAGED_HEAD_SIZE;

    for (uint b = gl_WorkGroupID.x; b < num_blocks; b += gl_NumWorkGroups.x) {
        vec4 dk0_a = vec4(0.0), dk0_b = vec4(0.0), dk1_a = vec4(0.0), dk1_b = vec4(0.0);   // [key] of dims d0, d1
        vec4 dv0_a = vec4(0.0), dv0_b = vec4(0.0), dv1_a = vec4(0.0), dv1_b = vec4(0.0);
        const bool listed = b + 1u < uint(block_readers.length());
        const uint e_begin = listed ? min(uint(max(block_readers[b], 0)), entries) : 0u;
        const uint e_end = listed ? min(uint(max(block_readers[b + 1u], 0)), entries) : 0u;
        if (staged && e_begin < e_end) {   // S (uniform: every thread has the same block and entries)
            barrier();   // the previous block's steps are done with s_k, s_v
            for (uint i = tid; i < KEYS * hc; i += WG) {
                const uint t = sub * KEYS + i / hc, c = i % hc;
                s_k[i] = kv_quad(key_load(b, key_offset(kv_head, t, c)));
                s_v[i] = value_quad(b, kv_head, t, c);
            }
            barrier();
        }

        for (uint e = e_begin; e < e_end; e++) {
            const int reader = block_readers[first_entry + e];
            if (reader < 0 || max_blocks == 0u) continue;
            const uint seq = uint(reader) / max_blocks, slot = uint(reader) % max_blocks;
            const uint seq_len = seq < uint(seq_lens.length())
                ? min(uint(max(seq_lens[seq], 0)), max_blocks * bs) : 0u;
            const uint p0 = slot * bs + sub * KEYS;   // position of the first token in the sequence
            const uvec2 queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
            const uint q_start = queries.x, q_len = queries.y, rows = group * q_len;
            if (p0 >= seq_len) continue;
            // Queries before i_first see none of these tokens (causal): their rows are skipped.
            const uint i_first = pc.causal == 0u ? 0u
                : uint(clamp(int(p0) - (int(seq_len) - int(q_len)), 0, int(q_len)));

            for (uint r0 = i_first * group; r0 < rows; r0 += ROWS) {
                // A: P and dP - D of pair (pr, pk), 0 where the query does not see the token.
                const uint gr = r0 + pr;
                const uint q = row_base(q_start, kv_head, gr);
                const uint token = sub * KEYS + pk;
                float p = 0.0, dd = 0.0;
                if (gr < rows && p0 + pk < visible_keys(gr / group, q_len, seq_len) && q + hs <= row_floats
                        && q / hs < uint(lse.length())) {
                    float x = 0.0, s = 0.0, t = 0.0;
                    for (uint c = 0u; c < hc; c++) {
                        vec4 k = staged ? s_k[pk * hc + c] : kv_quad(key_load(b, key_offset(kv_head, token, c)));
                        vec4 v = staged ? s_v[pk * hc + c] : value_quad(b, kv_head, token, c);
                        vec4 g = q_quad(dout[q / 4u + c]);
                        x += dot(q_quad(query[q / 4u + c]), k);
                        s += dot(g, v);
                        t += dot(g, q_quad(out_[q / 4u + c]));
                    }
                    p = exp(x * pc.scale - lse[q / hs]);
                    dd = s - t;
                }
                s_p[tid] = p;
                s_dd[tid] = dd;
                barrier();

                // C: this thread's head dims of dV and dK, for the KEYS tokens.
                for (uint r = 0u; r < ROWS; r++) {
                    const uint qr = row_base(q_start, kv_head, r0 + r);
                    if (r0 + r >= rows || qr + hs > row_floats) break;
                    const uint i = r * KEYS;
                    const vec4 p_a = vec4(s_p[i], s_p[i + 1u], s_p[i + 2u], s_p[i + 3u]);
                    const vec4 p_b = vec4(s_p[i + 4u], s_p[i + 5u], s_p[i + 6u], s_p[i + 7u]);
                    const vec4 ds_a = p_a * vec4(s_dd[i], s_dd[i + 1u], s_dd[i + 2u], s_dd[i + 3u]);
                    const vec4 ds_b = p_b * vec4(s_dd[i + 4u], s_dd[i + 5u], s_dd[i + 6u], s_dd[i + 7u]);
                    const uint c0 = qr / 4u + d0 / 4u, c1 = qr / 4u + d1 / 4u;
                    const float q0 = d0 < hs ? q_quad(query[c0])[d0 % 4u] : 0.0;
                    const float q1 = d1 < hs ? q_quad(query[c1])[d1 % 4u] : 0.0;
                    const float g0 = d0 < hs ? q_quad(dout[c0])[d0 % 4u] : 0.0;
                    const float g1 = d1 < hs ? q_quad(dout[c1])[d1 % 4u] : 0.0;
                    dv0_a += p_a * g0; dv0_b += p_b * g0;
                    dk0_a += ds_a * q0; dk0_b += ds_b * q0;
                    if (hs > WG) {   // uniform: head sizes up to 128 skip it
                        dv1_a += p_a * g1; dv1_b += p_b * g1;
                        dk1_a += ds_a * q1; dk1_b += ds_b * q1;
                    }
                }
                barrier();   // s_p and s_dd are rewritten by the next step
            }
        }

        for (uint k = 0u; k < KEYS; k++) {
            const uint token = sub * KEYS + k;
            if (d0 < hs) {
                dk_cache[key_element(b, kv_head, token, d0)] = pc.scale * (k < 4u ? dk0_a[k] : dk0_b[k - 4u]);
                dv_cache[b * pc.v_block_stride + value_offset(kv_head, token, d0)] = k < 4u ? dv0_a[k] : dv0_b[k - 4u];
            }
            if (d1 < hs) {
                dk_cache[key_element(b, kv_head, token, d1)] = pc.scale * (k < 4u ? dk1_a[k] : dk1_b[k - 4u]);
                dv_cache[b * pc.v_block_stride + value_offset(kv_head, token, d1)] = k < 4u ? dv1_a[k] : dv1_b[k - 4u];
            }
        }
    }
}
