#version 450
// Paged-attention backward, the query gradient, on cooperative matrices (VK_KHR_cooperative_matrix): the op
// of paged_backward_dq.comp, with its bindings, push constants and result (PAGED_BACKWARD_DQ in
// pagedvk/abi.py), for float16 queries and caches at a head size fixed at build time (HEAD_SIZE):
//   dq = scale * dS K,  dS = P * (dP - D),  P = exp(scale q.k - lse),  dP = dout.v,  D = rowsum(dout * out).
// Q.K^T, dout.V^T and dS.K are 16x16x16 float16 products accumulated in float32 (dS rounded to float16 as
// FlashAttention-2 rounds it), chosen as paged_prefill_coopmat.comp is chosen (pagedvk.prefill).
//
// One workgroup of four subgroups per (tile of BR = 64 query rows of one sequence, kv head), from the tile
// table, rows as in paged_prefill_coopmat.comp. Each subgroup owns 16 rows: their queries and dout stay in
// registers as matrices, their dq accumulates in registers as matrices; the rows' D come from delta
// (paged_backward_delta.comp). The context is walked in steps of BC = 32 keys:
//   1. the workgroup stages the step's keys and values in shared memory (loaded into registers during the
//      step before, so the loads' latency hides behind that step's products);
//   2. each subgroup multiplies S = Q.K^T and dP = dout.V^T for its rows into shared memory;
//   3. each row's two lanes (half of the keys each) write dS, zero where the row does not see the key;
//   4. each subgroup adds dS.K to its dq.
// Keys past the tile's last visible key and blocks outside the caches are staged as zeros, as in the forward.
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
#error "paged_backward_dq_coopmat is built for float16 or bfloat16 caches and queries with HEAD_SIZE fixed"
#endif
#if HEAD_SIZE != 64 && HEAD_SIZE != 128
#error "paged_backward_dq_coopmat writes dq in passes for head sizes 64 and 128 only (dq_pass calls in main)"
#endif

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { uvec4 query[]; };           // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Tiles { int tiles[]; };             // [tiles, 2]
layout(std430, set = 0, binding = 7) readonly buffer Dout { uvec4 dout[]; };             // like query
layout(std430, set = 0, binding = 8) readonly buffer Delta { float delta_[]; };          // like lse: D of each row
// (query and dout are float16, read 8 elements a load: a row's D elements start on a 16-byte boundary)
layout(std430, set = 0, binding = 9) readonly buffer Lse { float lse[]; };               // [tokens, heads]
layout(std430, set = 0, binding = 10) writeonly buffer Dq { vec2 dq[]; };                // float32, like query

#include "attention_common.glsl"
#define PREFILL_TILES
#include "prefill_common.glsl"

const uint D = HEAD_SIZE;        // a multiple of 64 (pagedvk/abi.py builds 64 and 128)
const uint BR = 64u;             // query rows per workgroup: 16 per subgroup
const uint BC = 32u;             // keys per step (64 would hold four more matrices in registers per lane; dq_pass takes 32)
const uint DQ = D / 4u;          // float16 quads per key or query row
const uint DC = D / 8u;          // 16-byte chunks per key row
const uint LOADS = BC * DC / WG; // chunks of keys (and of values) each thread stages per step
const uint KS = DQ + 2u;         // row stride of staged queries, keys and [key][dim] values, in quads
const uint TS = BC / 4u + 2u;    // row stride of staged [dim][key] values, of S and dP (vec4) and of dS, in quads
const uint ROW_LOADS = BR * DC / WG;   // 16-byte chunks of the tile's rows each thread loads from each row buffer
#define MATRIX_WALKS_TABLES
#include "prefill_matrix.glsl"

const uint V_OFF = BC * KS;      // the values' place in s_kv, after the keys
shared f16vec4 s_kv[max(BR * KS, V_OFF + max(BC * KS, D * TS))];   // the queries and dout at the start; keys, values
shared vec4 s_s[BR * TS];        // each subgroup's 16 x BC logits; output passes
shared vec4 s_dp[BR * TS];       // each subgroup's 16 x BC dP
shared f16vec4 s_ds[BR * TS];    // each subgroup's 16 x BC dS

// Head dims BC pass .. BC pass + 31 of this lane's dq row (matrices a and b: BC is 32), through this subgroup's part of
// s_s. Called once per pass with constant indices into dq_acc, not from a loop: NVIDIA's driver did not unroll
// that loop, [[unroll]] or not, and kept dq_acc in local memory for it (dq took 1.66x the time on the H200).
void dq_pass(uint pass, MAT_C a, MAT_C b, uint warp, uint my_row, uint half_, bool write, uint base) {
    coopMatStore(a, s_s, warp * 16u * TS, TS, gl_CooperativeMatrixLayoutRowMajor);
    coopMatStore(b, s_s, warp * 16u * TS + 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    if (write) {
        [[unroll]] for (uint j = 0u; j < BC / 8u; j++) {
            const uint cq = (BC / 8u) * half_ + j;
            const vec4 v = s_s[my_row * TS + cq] * pc.scale;
            const uint d = base + pass * BC + 4u * cq;
            dq[d >> 1] = v.xy;
            dq[(d >> 1) + 1u] = v.zw;
        }
    }
    subgroupBarrier();   // read before the next pass overwrites
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint warp = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || pc.head_size != D) return;
    // query and dout share one shape: a row is in both or the launch is malformed.
    const uint row_floats = min(uint(query.length()), uint(dout.length())) * 8u;
    const uvec2 queries = sequence_queries(seq, row_floats / (D * pc.num_heads));
    const uint rows = group * queries.y;
    if (row0 >= rows) return;
    const uint row_end = min(row0 + BR, rows);

    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const Seq sq = Seq(queries.x, queries.y, seq_len);
    const uint kv_end = visible_keys((row_end - 1u) / group, sq.q_len, seq_len);   // rows are query-major

    // This lane's row for dS and the output (two lanes per row, each half of the keys and head dims).
    const uint my_row = warp * 16u + lane / 2u, half_ = lane & 1u;
    const Row me = query_row(sq, kv_head, row0 + my_row, row_end, row_floats);
    const bool has_lse = me.valid && me.base / D < uint(lse.length());
    const float row_lse = has_lse ? lse[me.base / D] : 0.0;

    // The queries, then dout, staged as float16 and loaded into each subgroup's matrices; rows that are not
    // there are zeros. All loads are issued before any is used.
    uvec4 qw[ROW_LOADS], gw[ROW_LOADS];
    [[unroll]] for (uint k = 0u; k < ROW_LOADS; k++) {
        const uint i = tid + k * WG;
        const Row r = query_row(sq, kv_head, row0 + i / DC, row_end, row_floats);
        const uint at = r.base / 8u + i % DC;
        qw[k] = r.valid ? query[at] : uvec4(0u);
        gw[k] = r.valid ? dout[at] : uvec4(0u);
    }
    [[unroll]] for (uint k = 0u; k < ROW_LOADS; k++) {
        const uint i = tid + k * WG, to = chunk_slot(i, true);
        s_kv[to] = half4(qw[k].xy);
        s_kv[to + 1u] = half4(qw[k].zw);
    }
    barrier();
    MAT_A q[D / 16u];   // one declaration each: glslang 13 drops the use of a second declarator
    MAT_A g[D / 16u];
    [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
        coopMatLoad(q[k], s_kv, warp * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
    }
    const float delta = me.valid && me.base / D < uint(delta_.length()) ? delta_[me.base / D] : 0.0;
    barrier();
    [[unroll]] for (uint k = 0u; k < ROW_LOADS; k++) {
        const uint to = chunk_slot(tid + k * WG, true);
        s_kv[to] = half4(gw[k].xy);
        s_kv[to + 1u] = half4(gw[k].zw);
    }
    barrier();
    [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
        coopMatLoad(g[k], s_kv, warp * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
    }
    barrier();

    MAT_C dq_acc[D / 16u];
    [[unroll]] for (uint j = 0u; j < D / 16u; j++) dq_acc[j] = MAT_C(0.0);
    const bool values_by_dim = pc.v_dim_stride == 1u;   // nhd: a token's head dims are contiguous
    uvec4 keys[LOADS], values[LOADS];
    {
        const int win = block_window(bt_row, 0u, kv_end);
        [[unroll]] for (uint r = 0u; r < LOADS; r++) {
            keys[r] = key_chunk(win, 0u, kv_head, 0u, tid + r * WG, kv_end);
            values[r] = value_chunk(win, 0u, kv_head, 0u, tid + r * WG, kv_end, values_by_dim);
        }
    }

    for (uint base = 0u; base < kv_end; base += BC) {
        // 1. Keys [key][dim] at 0, values at V_OFF ([key][dim] or [dim][key]); then the next step's loads.
        [[unroll]] for (uint r = 0u; r < LOADS; r++) {
            const uint kat = chunk_slot(tid + r * WG, true), vat = V_OFF + chunk_slot(tid + r * WG, values_by_dim);
            s_kv[kat] = half4(keys[r].xy);
            s_kv[kat + 1u] = half4(keys[r].zw);
            s_kv[vat] = half4(values[r].xy);
            s_kv[vat + 1u] = half4(values[r].zw);
        }
        barrier();
        {
            const uint w0 = (base + BC) >> block_shift();
            const int win = block_window(bt_row, w0, kv_end);
            [[unroll]] for (uint r = 0u; r < LOADS; r++) {
                keys[r] = key_chunk(win, w0, kv_head, base + BC, tid + r * WG, kv_end);
                values[r] = value_chunk(win, w0, kv_head, base + BC, tid + r * WG, kv_end, values_by_dim);
            }
        }

        // 2. S = Q.K^T (K^T: the staged keys read column-major) and dP = dout.V^T.
        MAT_C s[BC / 16u];   // one declaration each: glslang 13 drops the use of a second declarator
        MAT_C dp[BC / 16u];
        [[unroll]] for (uint n = 0u; n < BC / 16u; n++) {
            s[n] = MAT_C(0.0);
            dp[n] = MAT_C(0.0);
        }
        [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
            [[unroll]] for (uint n = 0u; n < BC / 16u; n++) {
                MAT_B kt;
                MAT_B vt;
                coopMatLoad(kt, s_kv, n * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
                s[n] = coopMatMulAdd(q[k], kt, s[n]);
                if (values_by_dim) {
                    coopMatLoad(vt, s_kv, V_OFF + n * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
                } else {
                    coopMatLoad(vt, s_kv, V_OFF + k * 16u * TS + n * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
                }
                dp[n] = coopMatMulAdd(g[k], vt, dp[n]);
            }
        }
        [[unroll]] for (uint n = 0u; n < BC / 16u; n++) {
            coopMatStore(s[n], s_s, warp * 16u * TS + n * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
            coopMatStore(dp[n], s_dp, warp * 16u * TS + n * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        // 3. dS for this lane's half of its row: quads half_, half_ + 2, ...
        [[unroll]] for (uint j = 0u; j < BC / 8u; j++) {
            const uint cq = 2u * j + half_;
            const vec4 st = s_s[my_row * TS + cq], dpv = s_dp[my_row * TS + cq];
            vec4 ds;
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                const bool seen = has_lse && base + 4u * cq + e < me.keys;
                ds[e] = seen ? exp(st[e] * pc.scale - row_lse) * (dpv[e] - delta) : 0.0;
            }
            s_ds[my_row * TS + cq] = f16vec4(ds);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        // 4. dq += dS.K (K: the staged keys read row-major).
        [[unroll]] for (uint k = 0u; k < BC / 16u; k++) {
            MAT_A ds;
            coopMatLoad(ds, s_ds, warp * 16u * TS + k * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0u; j < D / 16u; j++) {
                MAT_B kb;
                coopMatLoad(kb, s_kv, k * 16u * KS + j * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
                dq_acc[j] = coopMatMulAdd(ds, kb, dq_acc[j]);
            }
        }
        barrier();   // every subgroup is done with this step's keys and values
    }

    // dq out through shared memory, BC head dims at a time (rows of a workgroup are not evenly spaced in dq); head
    // sizes 64 and 128 (pagedvk/abi.py).
    const bool write = me.valid && me.base + D <= 2u * uint(dq.length());
    dq_pass(0u, dq_acc[0], dq_acc[1], warp, my_row, half_, write, me.base);
    dq_pass(1u, dq_acc[2], dq_acc[3], warp, my_row, half_, write, me.base);
#if HEAD_SIZE > 64
    dq_pass(2u, dq_acc[4], dq_acc[5], warp, my_row, half_, write, me.base);
    dq_pass(3u, dq_acc[6], dq_acc[7], warp, my_row, half_, write, me.base);
#endif
}
