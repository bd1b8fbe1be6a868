#version 450
// Paged-attention backward, the key and value gradients, on cooperative matrices (VK_KHR_cooperative_matrix):
// the op of paged_backward_dkdv.comp, with its bindings, push constants, grid and results (PAGED_BACKWARD_DKDV
// in pagedvk/abi.py), for float16 queries and caches at a head size fixed at build time (HEAD_SIZE):
//   dV = P^T dout,  dK = scale * dS^T q,  P = exp(scale q.k - lse),  dS = P * (dout.v - D),  D = rowsum(dout * out).
// Q.K^T, dout.V^T, P^T.dout and dS^T.Q are 16x16x16 float16 products accumulated in float32 (P and dS rounded
// to float16, as FlashAttention-2 rounds them), chosen as paged_prefill_coopmat.comp is chosen (pagedvk.prefill).
//
// As in the scalar kernel, gradients are gathered per physical block (several sequences may read one): one
// workgroup of four subgroups per (physical block, kv head, KEYS = 16 tokens of the block; an 8-token block's
// other 8 are absent) walks the (sequence, block-table slot) pairs that read the block (block_readers) and,
// for each, the query rows that see its tokens, BR = 64 at a time, in a fixed order (deterministic, no float
// atomics). The block's keys and values stay in registers as the B matrices K^T and V^T. Per 64 rows:
//   1. the workgroup stages the rows' queries and dout in shared memory (float16, zeros for rows not there);
//      each row's lanes read its lse and D (delta, which paged_backward_delta.comp sums once per row);
//   2. each subgroup multiplies S = Q.K^T and dP = dout.V^T for its 16 rows (in one loop), through shared memory
//      to the row's lanes, which write P and dS (zero where the row does not see the key) as float16;
//   3. each subgroup adds P^T.dout and dS^T.Q to its share of dV and dK: head dims 16 w .. (D / 64 tiles of 16
//      head dims each, w the subgroup), over the 64 rows.
// Every element of dk_cache and dv_cache is written exactly once: blocks and slots nobody reads get 0.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#define KV_CHUNKS   // the caches' bindings hold 16-byte chunks: 8 float16 elements a load
#include "kv_storage.glsl"

// bfloat16 modules (KV_BF16, Q_BF16) are this source compiled with float16_t matrices, given the bfloat16
// encoding by build_shaders.py (bfloat16_matrices; glslang 13 has no GL_EXT_bfloat16): nothing here computes in
// float16, it only loads, stores, converts from float32 and multiplies matrices.
#if !(defined(KV_F16) && defined(Q_F16) || defined(KV_BF16) && defined(Q_BF16)) || !defined(HEAD_SIZE)
#error "paged_backward_dkdv_coopmat is built for float16 or bfloat16 caches and queries with HEAD_SIZE fixed"
#endif

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { uvec4 query[]; };             // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS
layout(std430, set = 0, binding = 3) readonly buffer BlockReaders { int block_readers[]; }; // see PAGED_BACKWARD_DKDV
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };          // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Dout { uvec4 dout[]; };               // like query
layout(std430, set = 0, binding = 7) readonly buffer Delta { float delta_[]; };            // like lse: D of each row
// (query and dout are float16, read 8 elements a load: a row's D elements start on a 16-byte boundary)
layout(std430, set = 0, binding = 8) readonly buffer Lse { float lse[]; };                 // [tokens, heads]
layout(std430, set = 0, binding = 9) writeonly buffer DkCache { float dk_cache[]; };       // float32, key_cache's shape
layout(std430, set = 0, binding = 10) writeonly buffer DvCache { float dv_cache[]; };      // float32, like value_cache

#include "attention_common.glsl"
#include "prefill_common.glsl"

const uint D = HEAD_SIZE;        // a multiple of 64 (pagedvk/abi.py builds 64 and 128)
const uint BR = 64u;             // query rows per step: 16 per subgroup
const uint BC = 16u;             // KEYS: block tokens per workgroup (pagedvk.prefill.DKDV_KEYS)
const uint DQ = D / 4u;          // float16 quads per key or query row
const uint DC = D / 8u;          // 16-byte chunks per key row
const uint KS = DQ + 2u;         // row stride of staged queries, dout, keys and [key][dim] values, in quads
const uint TS = BC / 4u + 2u;    // row stride of staged [dim][key] values and of P, dS [row][key], in quads
const uint SS = BC / 4u + 1u;    // row stride of S and dP [row][key] (vec4)
const uint TILES = D / 64u;      // 16-head-dim column tiles of dK and dV per subgroup
const uint ROW_LOADS = BR * DC / WG;   // 16-byte chunks of a step's rows each thread loads from each row buffer
#include "prefill_matrix.glsl"

shared f16vec4 s_q[BR * KS];     // the step's queries; the block's keys at the start
shared f16vec4 s_g[max(BR * KS, D * TS)];   // the step's dout; the block's values at the start
shared vec4 s_s[BR * SS];        // each subgroup's 16 x 16 S, then dP; output passes
shared f16vec4 s_p[BR * TS];     // P [row][key]
shared f16vec4 s_ds[BR * TS];    // dS [row][key]

// Where key element (b, h, t, d) sits in an array of key_cache's shape (dk_cache).
uint key_element(uint b, uint h, uint t, uint d) {
    return (b * pc.k_block_stride + key_offset(h, t, d >> 2)) * 4u + (d & 3u);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint warp = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint kv_head = gl_WorkGroupID.y;
    const uint sub = gl_WorkGroupID.z;          // tokens sub * BC .. of the block
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    const uint max_blocks = pc.max_blocks_per_seq;
    const uint keys_here = min(bs, BC);         // the block's tokens this workgroup owns (8 in 8-token blocks)
    if (pc.head_size != D || sub * BC >= bs) return;
    const uint row_floats = min(uint(query.length()), uint(dout.length())) * 8u;
    const uint first_entry = pc.num_blocks + 1u;   // block_readers: num_blocks + 1 offsets, then the pairs
    const uint entries = uint(max(int(block_readers.length()) - int(first_entry), 0));
    const bool values_by_dim = pc.v_dim_stride == 1u;   // nhd: a token's head dims are contiguous
    // This lane's row of a step (two lanes per row, each half of the keys).
    const uint my_row = warp * 16u + lane / 2u, half_ = lane & 1u;

    for (uint b = gl_WorkGroupID.x; b < pc.num_blocks; b += gl_NumWorkGroups.x) {
        // The block's keys and values, [key][dim] (vLLM's values [dim][key]), loaded as K^T and V^T.
        barrier();   // the last block's output passes are done with s_s; s_q and s_g are free
        for (uint i = tid; i < BC * DC; i += WG) {
            const uint n = i / DC, at = chunk_slot(i, true);
            const uvec4 w = key_chunk_at(n < keys_here ? int(b) : -1, kv_head, sub * BC + n, i % DC);
            s_q[at] = half4(w.xy);
            s_q[at + 1u] = half4(w.zw);
            const uint t = values_by_dim ? n : 8u * (i % (BC / 8u));
            const uint d = values_by_dim ? 8u * (i % DC) : i / (BC / 8u);
            const uvec4 v = value_chunk_at(int(b), kv_head, sub * BC + t, d, values_by_dim,
                                           keys_here > t ? keys_here - t : 0u);
            const uint vat = chunk_slot(i, values_by_dim);
            s_g[vat] = half4(v.xy);
            s_g[vat + 1u] = half4(v.zw);
        }
        barrier();
        MAT_B kt[D / 16u];   // one declaration each: glslang 13 drops the use of a second declarator
        MAT_B vt[D / 16u];
        [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
            coopMatLoad(kt[k], s_q, k * 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
            if (values_by_dim) coopMatLoad(vt[k], s_g, k * 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
            else coopMatLoad(vt[k], s_g, k * 16u * TS, TS, gl_CooperativeMatrixLayoutRowMajor);
        }
        MAT_C dk[TILES];
        MAT_C dv[TILES];
        [[unroll]] for (uint j = 0u; j < TILES; j++) {
            dk[j] = MAT_C(0.0);
            dv[j] = MAT_C(0.0);
        }

        const bool listed = b + 1u < uint(block_readers.length());
        const uint e_begin = listed ? min(uint(max(block_readers[b], 0)), entries) : 0u;
        const uint e_end = listed ? min(uint(max(block_readers[b + 1u], 0)), entries) : 0u;
        for (uint e = e_begin; e < e_end; e++) {
            const int reader = block_readers[first_entry + e];
            if (reader < 0 || max_blocks == 0u) continue;
            const uint seq = uint(reader) / max_blocks, slot = uint(reader) % max_blocks;
            const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), max_blocks * bs) : 0u;
            const uint p0 = slot * bs + sub * BC;   // position of the workgroup's first token in the sequence
            const uvec2 queries = sequence_queries(seq, row_floats / (D * pc.num_heads));
            const Seq sq = Seq(queries.x, queries.y, seq_len);
            const uint rows = group * sq.q_len;
            if (p0 >= seq_len) continue;
            // Queries before i_first see none of these tokens (causal): their rows are skipped.
            const uint i_first = pc.causal == 0u ? 0u
                : uint(clamp(int(p0) - (int(seq_len) - int(sq.q_len)), 0, int(sq.q_len)));

            for (uint r0 = i_first * group; r0 < rows; r0 += BR) {
                // 1. The rows' queries and dout; this lane's row's lse and D.
                barrier();   // every subgroup is done with the last step's (or the block's) staging
                // All of a thread's loads are issued before any is used (one at a time, each waited for, the step took
                // 2.8x as long on the H200).
                uvec4 qw[ROW_LOADS], gw[ROW_LOADS];
                [[unroll]] for (uint k = 0u; k < ROW_LOADS; k++) {
                    const uint i = tid + k * WG;
                    const Row r = query_row(sq, kv_head, r0 + i / DC, rows, row_floats);
                    const uint at = r.base / 8u + i % DC;
                    qw[k] = r.valid ? query[at] : uvec4(0u);
                    gw[k] = r.valid ? dout[at] : uvec4(0u);
                }
                [[unroll]] for (uint k = 0u; k < ROW_LOADS; k++) {
                    const uint i = tid + k * WG, to = chunk_slot(i, true);
                    s_q[to] = half4(qw[k].xy);
                    s_q[to + 1u] = half4(qw[k].zw);
                    s_g[to] = half4(gw[k].xy);
                    s_g[to + 1u] = half4(gw[k].zw);
                }
                const Row me = query_row(sq, kv_head, r0 + my_row, rows, row_floats);
                const bool has_lse = me.valid && me.base / D < uint(lse.length());
                const float row_lse = has_lse ? lse[me.base / D] : 0.0;
                const float delta = me.valid && me.base / D < uint(delta_.length()) ? delta_[me.base / D] : 0.0;
                barrier();

                // 2. S and dP for this subgroup's rows, multiplied in one loop (two independent chains of products in
                //    flight, not S's D / 16 and then dP's, each waiting for the one before: dk/dv 2516 against 2555 us
                //    on the H200, docs/benchmarks-log.md, 2026-12-02); then, pass by pass, to this lane's keys
                //    8 half_ .. 8 half_ + 7.
                MAT_C s_acc = MAT_C(0.0);   // one declaration each: glslang 13 drops the use of a second declarator
                MAT_C dp_acc = MAT_C(0.0);
                [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
                    MAT_A qa;
                    MAT_A ga;
                    coopMatLoad(qa, s_q, warp * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
                    coopMatLoad(ga, s_g, warp * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
                    s_acc = coopMatMulAdd(qa, kt[k], s_acc);
                    dp_acc = coopMatMulAdd(ga, vt[k], dp_acc);
                }
                vec4 p[2];
                [[unroll]] for (uint pass = 0u; pass < 2u; pass++) {   // unrolled: 1.13x faster on the H200
                    if (pass == 0u) coopMatStore(s_acc, s_s, warp * 16u * SS, SS, gl_CooperativeMatrixLayoutRowMajor);
                    else coopMatStore(dp_acc, s_s, warp * 16u * SS, SS, gl_CooperativeMatrixLayoutRowMajor);
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    [[unroll]] for (uint j = 0u; j < 2u; j++) {
                        const uint cq = 2u * half_ + j;
                        const vec4 x = s_s[my_row * SS + cq];
                        vec4 out4;
                        [[unroll]] for (uint el = 0u; el < 4u; el++) {
                            const uint n = 4u * cq + el;
                            const bool seen = has_lse && n < keys_here && p0 + n < me.keys;
                            if (pass == 0u) {
                                p[j][el] = seen ? exp(x[el] * pc.scale - row_lse) : 0.0;
                            } else {
                                out4[el] = seen ? p[j][el] * (x[el] - delta) : 0.0;
                            }
                        }
                        if (pass == 0u) s_p[my_row * TS + cq] = f16vec4(p[j]);
                        else s_ds[my_row * TS + cq] = f16vec4(out4);
                    }
                    subgroupBarrier();   // S read before dP overwrites it
                }
                barrier();   // every row's P and dS are written

                // 3. dV += P^T.dout, dK += dS^T.Q over the 64 rows (P^T, dS^T: [row][key] read column-major).
                [[unroll]] for (uint k = 0u; k < BR / 16u; k++) {
                    MAT_A pt;
                    MAT_A dst;
                    coopMatLoad(pt, s_p, k * 16u * TS, TS, gl_CooperativeMatrixLayoutColumnMajor);
                    coopMatLoad(dst, s_ds, k * 16u * TS, TS, gl_CooperativeMatrixLayoutColumnMajor);
                    [[unroll]] for (uint j = 0u; j < TILES; j++) {
                        const uint col = (warp * TILES + j) * 4u;
                        MAT_B gb;
                        MAT_B qb;
                        coopMatLoad(gb, s_g, k * 16u * KS + col, KS, gl_CooperativeMatrixLayoutRowMajor);
                        coopMatLoad(qb, s_q, k * 16u * KS + col, KS, gl_CooperativeMatrixLayoutRowMajor);
                        dv[j] = coopMatMulAdd(pt, gb, dv[j]);
                        dk[j] = coopMatMulAdd(dst, qb, dk[j]);
                    }
                }
            }
        }

        // Out, a 16 x 16 tile at a time through this subgroup's part of s_s: lane l writes key l / 2, head dims
        // 8 (l % 2) .. 8 (l % 2) + 7 of the tile; dK first, then dV.
        barrier();   // every subgroup is done with s_s
        const uint n = lane / 2u, t = sub * BC + n;
        [[unroll]] for (uint j = 0u; j < 2u * TILES; j++) {
            const bool is_k = j < TILES;
            if (is_k) coopMatStore(dk[j % TILES], s_s, warp * 16u * SS, SS, gl_CooperativeMatrixLayoutRowMajor);
            else coopMatStore(dv[j % TILES], s_s, warp * 16u * SS, SS, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            if (n < keys_here) {
                const uint d0 = (warp * TILES + j % TILES) * 16u + 8u * half_;
                [[unroll]] for (uint c = 0u; c < 2u; c++) {
                    const vec4 v = s_s[(warp * 16u + n) * SS + 2u * half_ + c];
                    [[unroll]] for (uint el = 0u; el < 4u; el++) {
                        const uint d = d0 + 4u * c + el;
                        if (is_k) dk_cache[key_element(b, kv_head, t, d)] = v[el] * pc.scale;
                        else dv_cache[b * pc.v_block_stride + value_offset(kv_head, t, d)] = v[el];
                    }
                }
            }
            subgroupBarrier();   // read before the next tile overwrites
        }
    }
}
