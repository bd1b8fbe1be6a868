#version 450
// Paged-attention backward, the key and value gradients, written in the caches' layout:
//   dV = P^T dout,  dK = scale * dS^T q,  with P = exp(scale q.k - lse), dS = P * (dout.v - D),
//   D = rowsum(dout * out) (FlashAttention-2's backward), read from delta (paged_backward_delta.comp, the
//   backward's first dispatch, sums it once per row).
//
// A physical block may be read by several sequences (shared prefixes), so gradients are gathered per
// block rather than scattered per sequence: one workgroup per (physical block, kv head, KEYS tokens of the
// block; KEYS = the block size clamped to [8, 16], the keys past a shorter block masked) walks the (sequence,
// block-table slot) pairs that read the block (block_readers, built on the host) and, for each, the query rows
// that see its tokens, R = 512 / KEYS (32 or 64) at a time. The rows' operands are staged in shared memory and
// serve all KEYS keys:
//   D. thread r < R reads row r's lse and D into s_lse and s_delta;
//   S. logits and dP, as in paged_backward_dq.comp with the roles of rows and keys kept: the rows' queries and
//      the keys staged CQ head quads at a time, thread (rg, kg) accumulating rows 4rg .. 4rg+3 of key kg, then
//      dout and the values; each thread writes its rows' P and dS for its key (row-major, a vec4 per row and
//      key quad);
//   C. the rows' queries and dout are staged whole, VR rows at a time; thread (kq, cg) accumulates keys
//      4kq .. 4kq+3 by head quads cg and cg + CG of dV and dK (six vec4 reads per row feed 64 multiply-adds).
// The sum runs in a fixed order, so it is deterministic and needs no float atomics (not core Vulkan).
// Every element of dk_cache and dv_cache is written exactly once: blocks and slots nobody reads get 0.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_IN query[]; };            // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockReaders { int block_readers[]; }; // see PAGED_BACKWARD_DKDV
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };          // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Dout { Q_IN dout[]; };              // like query
layout(std430, set = 0, binding = 7) readonly buffer Delta { float delta_[]; };            // like lse: D of each row
layout(std430, set = 0, binding = 8) readonly buffer Lse { float lse[]; };                 // [tokens, heads]
layout(std430, set = 0, binding = 9) writeonly buffer DkCache { float dk_cache[]; };       // float32, key_cache's shape
layout(std430, set = 0, binding = 10) writeonly buffer DvCache { float dv_cache[]; };      // float32, like value_cache

#include "attention_common.glsl"
#include "prefill_common.glsl"

const uint MAX_KEYS = 16u;          // block tokens per workgroup (pagedvk.prefill.DKDV_KEYS)
// Keys a workgroup takes at least: blocks of 1 to 4 tokens take 8 keys' staging (R rows within MAX_ROWS, KEYS / 4
// key quads), the keys past the block masked out; their workgroups do 1/8 to 1/2 of the usual work.
const uint MIN_KEYS = 8u;
const uint MAX_ROWS = 64u;          // R = 512 / KEYS
// Shared memory, in vec4s: in S, [0, R * (CQ + 1)) a query (or dout) chunk, then KEYS * (CQ + 1) a key (or
// value) chunk (at most 648, in 8-token blocks); then [0, PD_QUADS) P and dS (R x KEYS / 4 quads each), and from
// PD_QUADS the rows' sub-tile, VR rows of queries then VR rows of dout. With s_lse and s_delta, 16128 bytes: under
// 16 KiB.
const uint S_MEM = 976u;
const uint PD_QUADS = 256u;
const uint CQ = 8u;                 // head quads per staged chunk
const uint QK_STRIDE = CQ + 1u;     // one vec4 of padding against bank conflicts
const uint NO_ROW = 0xffffffffu;
#define ABSENT uintBitsToFloat(0x7f800000u)   // s_lse of a row past the sequence or a buffer (+inf)

shared vec4 s_mem[S_MEM];
shared float s_lse[MAX_ROWS];       // the lse of the step's rows
shared float s_delta[MAX_ROWS];     // their D

// Where key element (b, h, t, d) sits in an array of key_cache's shape (dk_cache).
uint key_element(uint b, uint h, uint t, uint d) {
    return (b * pc.k_block_stride + key_offset(h, t, d >> 2)) * 4u + (d & 3u);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint kv_head = gl_WorkGroupID.y;
    const uint sub = gl_WorkGroupID.z;          // tokens sub * KEYS .. of the block
    const uint hs = head_size();   // a constant where the plan specialized it (prefill_common.glsl)
    const uint hq = hs / 4u;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    const uint max_blocks = pc.max_blocks_per_seq;
    const uint KEYS = clamp(bs, MIN_KEYS, MAX_KEYS);
    if (hs > MAX_HEAD_SIZE || hs != pc.head_size || hq == 0u || bs == 0u || sub * KEYS >= bs) return;
    const uint R = 512u / KEYS;
    const uint kg = tid % KEYS, rg = tid / KEYS;            // S: key kg, rows 4rg .. 4rg+3
    const uint KQ = KEYS / 4u, CG = WG / KQ;
    const uint kq = tid / CG, cg = tid % CG;                  // C: keys 4kq .. 4kq+3, head quads cg, cg + CG
    const uint c0_ = min(cg, hq - 1u), c1_ = min(cg + CG, hq - 1u);
    // C's second head quads (dk1, dv1): only past 4 * WG / (MAX_KEYS / 4) = 128 dims (CG is at least 32), a
    // condition on the head size alone, which the driver folds where the plan specialized it. dk1 and dv1 then
    // hold no registers and their products go: 23.5 -> 20.6 ms at issue 12's float32 shape on the H200.
    const bool two_cols = hs > 4u * (WG / (MAX_KEYS / 4u)) && hq > CG;
    const uint VR = min(R, (S_MEM - PD_QUADS) / (2u * hq));   // rows per sub-tile of C
    const uint k_off = R * QK_STRIDE;

    const uint num_blocks = pc.num_blocks;   // held by the caches and by dk_cache, dv_cache (their shapes)
    const uint row_floats = min(Q_QUADS(query), Q_QUADS(dout)) * 4u;
    const uint first_entry = pc.num_blocks + 1u;   // block_readers: num_blocks + 1 offsets, then the pairs
    const uint entries = uint(max(int(block_readers.length()) - int(first_entry), 0));

    // What this thread stages: in S, row or key lane_row + n * row_step at head quad c0 + cl of the chunk at c0;
    // in C, element tid + WG * n of a sub-tile: row sr[n], head quad sc[n].
    const uint cl = tid & (CQ - 1u), lane_row = tid / CQ, row_step = WG / CQ;
    uvec4 sr, sc;
    for (uint n = 0u; n < 4u; n++) {
        sr[n] = (tid + WG * n) / hq;
        sc[n] = (tid + WG * n) % hq;
    }

    for (uint b = gl_WorkGroupID.x; b < num_blocks; b += gl_NumWorkGroups.x) {
        mat4 dk0 = mat4(0.0), dk1 = mat4(0.0), dv0 = mat4(0.0), dv1 = mat4(0.0);   // column e: key 4kq+e
        const bool listed = b + 1u < uint(block_readers.length());
        const uint e_begin = listed ? min(uint(max(block_readers[b], 0)), entries) : 0u;
        const uint e_end = listed ? min(uint(max(block_readers[b + 1u], 0)), entries) : 0u;

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

            for (uint r0 = i_first * group; r0 < rows; r0 += R) {
                // D: row r of the step is there when it is a row of the sequence inside every row buffer.
                if (tid < R) {
                    const uint gr = r0 + tid, q = row_base(q_start, kv_head, gr);
                    const bool there = gr < rows && q + hs <= row_floats
                        && q / hs < min(uint(lse.length()), uint(delta_.length()));
                    s_lse[tid] = there ? lse[q / hs] : ABSENT;
                    s_delta[tid] = there ? delta_[q / hs] : 0.0;
                }
                uvec4 q_src;   // the query (dout) quad of staged row n at c0 = 0, or NO_ROW
                for (uint n = 0u; n < 4u; n++) {
                    const uint r = lane_row + n * row_step, gr = r0 + r, q = row_base(q_start, kv_head, gr);
                    q_src[n] = r < R && gr < rows && q + hs <= row_floats ? q / 4u + cl : NO_ROW;
                }

                // S: phase 0 the logits' dot products, phase 1 dP; acc[i]: row 4rg+i with key kg.
                vec4 st, dp;
                for (uint phase = 0u; phase < 2u; phase++) {
                    vec4 acc = vec4(0.0);
                    // The chunk count comes from the push constant, not the specialized head size: with a single
                    // chunk known at compile time (head size 32) the H200's driver (580.159.04) built a kernel whose
                    // dK and dV were wrong (relative error 2-4; right on lavapipe, and right with either bound or
                    // the chunk's length read from the push constant, at the same speed; BENCHMARKS.md).
                    for (uint c0 = 0u; c0 < pc.head_size / 4u; c0 += CQ) {
                        const bool in_head = c0 + cl < hq;
                        vec4 rv[4];   // every load issued before any is stored
                        [[unroll]] for (uint n = 0u; n < 4u; n++) {
                            const uint r = lane_row + n * row_step;
                            const bool there = r < R && q_src[n] != NO_ROW && in_head;
                            rv[n] = !there ? vec4(0.0)
                                : phase == 0u ? Q_QUAD_AT(query, q_src[n] + c0) : Q_QUAD_AT(dout, q_src[n] + c0);
                        }
                        [[unroll]] for (uint n = 0u; n < 4u; n++) {
                            const uint r = lane_row + n * row_step;
                            if (r < R) s_mem[r * QK_STRIDE + cl] = rv[n];
                        }
                        if (lane_row < KEYS) {
                            const uint t = sub * KEYS + lane_row;
                            s_mem[k_off + lane_row * QK_STRIDE + cl] = !in_head || t >= bs ? vec4(0.0)
                                : phase == 0u ? kv_quad(key_load(b, key_offset(kv_head, t, c0 + cl)))
                                : value_quad(b, kv_head, t, c0 + cl);
                        }
                        barrier();
                        const uint n = min(CQ, hq - c0);
                        for (uint c = 0u; c < n; c++) {
                            const uint qr = 4u * rg * QK_STRIDE + c;
                            const mat4 q = mat4(s_mem[qr], s_mem[qr + QK_STRIDE], s_mem[qr + 2u * QK_STRIDE],
                                                s_mem[qr + 3u * QK_STRIDE]);
                            acc += s_mem[k_off + kg * QK_STRIDE + c] * q;
                        }
                        barrier();
                    }
                    if (phase == 0u) st = acc; else dp = acc;
                }
                // P and dS of rows 4rg .. 4rg+3 with key kg, 0 where the query does not see the token.
                for (uint i = 0u; i < 4u; i++) {
                    const uint r = 4u * rg + i, gr = r0 + r;
                    const float row_lse = s_lse[r];
                    const float delta = s_delta[r];
                    const bool seen = row_lse != ABSENT && sub * KEYS + kg < bs
                        && p0 + kg < visible_keys(gr / group, q_len, seq_len);
                    const float p = seen ? exp(st[i] * pc.scale - row_lse) : 0.0;
                    s_mem[r * KQ + kg / 4u][kg & 3u] = p;
                    s_mem[PD_QUADS / 2u + r * KQ + kg / 4u][kg & 3u] = seen ? p * (dp[i] - delta) : 0.0;
                }

                // C: dV and dK of keys 4kq .. 4kq+3, VR rows at a time.
                for (uint s0 = 0u; s0 < R && r0 + s0 < rows; s0 += VR) {
                    barrier();   // P and dS are written; the previous sub-tile is used
                    vec4 qv[4], gv[4];   // every load issued before any is stored
                    [[unroll]] for (uint n = 0u; n < 4u; n++) {
                        const uint gr = r0 + s0 + sr[n], q = row_base(q_start, kv_head, gr);
                        const bool there = tid + WG * n < VR * hq && s0 + sr[n] < R && gr < rows && q + hs <= row_floats;
                        qv[n] = there ? Q_QUAD_AT(query, q / 4u + sc[n]) : vec4(0.0);
                        gv[n] = there ? Q_QUAD_AT(dout, q / 4u + sc[n]) : vec4(0.0);
                    }
                    [[unroll]] for (uint n = 0u; n < 4u; n++) {
                        if (tid + WG * n >= VR * hq) break;
                        s_mem[PD_QUADS + tid + WG * n] = qv[n];
                        s_mem[PD_QUADS + VR * hq + tid + WG * n] = gv[n];
                    }
                    barrier();
                    const uint n = min(VR, R - s0);
                    for (uint r = 0u; r < n; r++) {
                        const vec4 p = s_mem[(s0 + r) * KQ + kq], ds = s_mem[PD_QUADS / 2u + (s0 + r) * KQ + kq];
                        const uint qr = PD_QUADS + r * hq, gr = PD_QUADS + (VR + r) * hq;
                        const vec4 q0 = s_mem[qr + c0_], g0 = s_mem[gr + c0_];
                        dv0 += outerProduct(g0, p);
                        dk0 += outerProduct(q0, ds);
                        if (two_cols) {
                            const vec4 q1 = s_mem[qr + c1_], g1 = s_mem[gr + c1_];
                            dv1 += outerProduct(g1, p);
                            dk1 += outerProduct(q1, ds);
                        }
                    }
                }
                barrier();   // s_mem and s_lse are rewritten by the next step
            }
        }

        for (uint e = 0u; e < 4u; e++) {
            const uint t = sub * KEYS + 4u * kq + e;
            if (t >= bs) break;   // past a block shorter than KEYS
            for (uint j = 0u; j < 2u; j++) {
                const uint c = cg + CG * j;
                if (c >= hq) break;
                const vec4 dk = (j == 0u ? dk0[e] : dk1[e]) * pc.scale, dv = j == 0u ? dv0[e] : dv1[e];
                for (uint d = 0u; d < 4u; d++) {
                    dk_cache[key_element(b, kv_head, t, 4u * c + d)] = dk[d];
                    dv_cache[b * pc.v_block_stride + value_offset(kv_head, t, 4u * c + d)] = dv[d];
                }
            }
        }
    }
}
