#version 450
// Paged-attention prefill forward on cooperative matrices (VK_KHR_cooperative_matrix): the op of
// paged_prefill.comp, with its bindings, push constants and results (PAGED_PREFILL in pagedvk/abi.py), for
// float16 queries and caches and a head size fixed at build time (HEAD_SIZE). Q.K^T and P.V are 16x16x16
// float16 products accumulated in float32, the shape every device that reports one is asked for
// (pagedvk.prefill chooses this module only where the device lists it, with 32-lane subgroups).
//
// One workgroup of four subgroups per (tile of BR = 64 query rows of one sequence, kv head), from the tile
// table (PREFILL_INPUTS in pagedvk/abi.py: ragged batches); rows are (query, head) pairs of the heads sharing
// the kv head, query-major, as in paged_prefill.comp. Each subgroup owns 16 rows:
// their queries stay in registers as matrices, their output accumulates in registers as matrices. The
// context is walked in steps of BC = 64 keys (FlashAttention-2's loop, online softmax):
//   1. the workgroup stages the step's keys in shared memory (float16, 16-byte chunks from the paged cache
//      through kv_storage.glsl's key_load, so every cache layout and segmented caches read as in the scalar
//      kernel); they were loaded into registers during the step before, so the loads' latency hides behind
//      that step's softmax and P.V;
//   2. the workgroup loads the step's values and the next step's keys into registers, their blocks found in a
//      window of block ids (prefill_matrix.glsl's block_window); issued before the products, the loads have
//      both the products and the softmax to arrive in (on the H200 1.13x faster than issuing them after Q.K^T);
//   3. each subgroup multiplies its queries by the keys (S = Q.K^T) and stores S to shared memory; its lanes
//      (two per row) mask and scale S, update the row's running max, and write P = exp(S - max) as float16;
//      then the values go to the same shared memory as the keys;
//   4. each subgroup rescales its accumulators row by row and adds P.V.
// Loops over arrays of matrices are unrolled wherever an index comes from the loop: an array indexed by a
// variable goes to local memory (NVIDIA's driver put the output accumulators there, and the forward took 1.45x
// the time).
// Which row of a 16x16 matrix an invocation's elements belong to is not specified by Vulkan, but it is the
// same for every matrix of one type (element-wise arithmetic between matrices depends on it): loading a
// matrix whose elements hold their own row number tells each invocation its rows (ROWS_OF below), so the
// rescaling needs no trip through shared memory.
//
// The attention variants go through paged_prefill.comp's hooks (attention_variants.glsl): key_visible()
// (causal and sliding window) and logit() (softcap, then ALiBi) on each element of S as a row's lanes read it
// in 3, the sink in the denominator and the lse at the end (softmax_finish), and the window's first block
// as the first step.
//
// Tokens past the workgroup's last visible key are staged as zeros (slots past a sequence's length may hold
// NaN, and 0 * NaN is NaN). Block ids outside the caches (tables not checked: validate=False) are read as
// zero keys and values: wrong rows for that sequence, never a read outside a buffer.
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
#error "paged_prefill_coopmat is built for float16 or bfloat16 caches and queries with HEAD_SIZE fixed"
#endif

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };         // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Tiles { int tiles[]; };            // [tiles, 2]
layout(std430, set = 0, binding = 7) writeonly buffer Out { OUT_PAIR out_[]; };         // like query
layout(std430, set = 0, binding = 8) writeonly buffer Lse { float lse[]; };             // [tokens, heads]
layout(std430, set = 0, binding = 9) readonly buffer AlibiSlopes { float alibi_slopes[]; }; // [heads] (VARIANT_ALIBI)
layout(std430, set = 0, binding = 10) readonly buffer Sinks { float sinks[]; };            // [heads] (VARIANT_SINKS)

#include "attention_common.glsl"
#include "attention_variants.glsl"
#define PREFILL_TILES
#include "prefill_common.glsl"

const uint D = HEAD_SIZE;        // a multiple of 64 (pagedvk/abi.py builds 64 and 128)
const uint BR = 64u;             // query rows per workgroup: 16 per subgroup
#ifndef BLOCK_KEYS
#define BLOCK_KEYS 64
#endif
const uint BC = BLOCK_KEYS;      // keys per step, 32 or 64 (on the H200 64 is 1.1x faster: fewer barriers)
const uint DQ = D / 4u;          // float16 quads per key or query row
const uint DC = D / 8u;          // 16-byte chunks per key row
const uint LOADS = BC * DC / WG; // chunks of keys (and of values) each thread stages per step
const uint KS = DQ + 2u;         // row stride of staged keys, queries and [key][dim] values, in quads (padded
                                 // against bank conflicts; a multiple of 16 bytes as matrix loads need)
const uint TS = BC / 4u + 2u;    // row stride of staged [dim][key] values, of S (vec4) and of P, in quads
#define MATRIX_WALKS_TABLES
#include "prefill_matrix.glsl"

shared f16vec4 s_kv[max(max(BR, BC) * KS, D * TS)];   // the step's keys, then its values; the queries at the start
shared vec4 s_s[BR * TS];                    // each subgroup's 16 x BC logits; row numbers; output passes
shared f16vec4 s_p[BR * TS];                 // each subgroup's 16 x BC weights
shared float s_row[BR];                      // a per-row factor handed from a row's lanes to its subgroup

// This lane's half of row `row` of the step's S (quads half_, half_ + 2, ...: the row's two lanes on different
// banks) as logits, -inf where the row does not see the key (`masked` false: it sees them all); their max.
float row_logits(out vec4 x[BC / 8u], uint row, uint half_, uint base, Row me, bool masked) {
    float mx = NEG_INF;
    [[unroll]] for (uint j = 0u; j < BC / 8u; j++) {
        const uint cq = 2u * j + half_;
        const vec4 dots = s_s[row * TS + cq] * pc.scale;
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            const uint key = base + 4u * cq + e;
            x[j][e] = !masked || (key < me.keys && key_visible(key, me.pos)) ? logit(dots[e], me.head, key, me.pos) : NEG_INF;
        }
        mx = max(mx, max(max(x[j].x, x[j].y), max(x[j].z, x[j].w)));
    }
    return mx;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint warp = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || pc.head_size != D) return;
    // The bound on row_base() + D of the rows the query binding holds at its pitch (rows_held, attention_common.glsl).
    const uint query_rows = rows_held(uint(query.length()) * 4u, pc.q_pitch);
    const uvec2 queries = sequence_queries(seq, query_rows / (D * pc.num_heads));
    const uint rows = group * queries.y;
    if (row0 >= rows) return;
    const uint row_end = min(row0 + BR, rows);

    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const Seq sq = Seq(queries.x, queries.y, seq_len);
    // Rows are query-major, so the last row sees the most keys.
    const uint kv_end = visible_keys((row_end - 1u) / group, sq.q_len, seq_len);

    // This lane's row for the softmax and the output (two lanes per row, each half of the columns).
    const uint my_row = warp * 16u + lane / 2u, half_ = lane & 1u;
    const Row me = query_row(sq, kv_head, row0 + my_row, row_end, query_rows);

    // The queries, staged as float16 and loaded into each subgroup's matrices; rows that are not there are zeros.
    for (uint i = tid; i < BR * DQ; i += WG) {
        const Row q = query_row(sq, kv_head, row0 + i / DQ, row_end, query_rows);
        s_kv[(i / DQ) * KS + i % DQ] = q.valid ? half4(query[pitched(q.base, pc.q_pitch) / 4u + i % DQ]) : f16vec4(0.0);
    }
    // Each element's row number, for ROWS_OF (see the top).
    if (lane < 16u) {
        for (uint c = 0u; c < 4u; c++) s_s[(warp * 16u + lane) * TS + c] = vec4(float(lane));
    }
    barrier();
    MAT_A q[D / 16u];
    [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
        coopMatLoad(q[k], s_kv, warp * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
    }
    MAT_C rows_of;
    coopMatLoad(rows_of, s_s, warp * 16u * TS, TS, gl_CooperativeMatrixLayoutRowMajor);
#define ROWS_OF(i) (warp * 16u + uint(rows_of[i]))   // the workgroup row of an invocation's element i

    MAT_C o[D / 16u];
    [[unroll]] for (uint j = 0u; j < D / 16u; j++) o[j] = MAT_C(0.0);
    float m = NEG_INF, l = 0.0;   // the row's running max; this lane's share of its denominator
    const bool values_by_dim = pc.v_dim_stride == 1u;   // nhd: a token's head dims are contiguous
    // Variant: steps start at the block of the first key the sliding window lets the tile's first row see
    // (rows are query-major: it sees the earliest keys), so blocks wholly before every row's window are not
    // read. A block start keeps the vLLM layout's 8-token value chunks inside one block.
    const uint kv_start = min(window_first_key(query_position(row0 / group, sq.q_len, seq_len)), kv_end) & ~(bs - 1u);
    uvec4 keys[LOADS], values[LOADS];
    {
        const uint w0 = kv_start >> block_shift();
        const int win = block_window(bt_row, w0, kv_end);
        [[unroll]] for (uint r = 0u; r < LOADS; r++) keys[r] = key_chunk(win, w0, kv_head, kv_start, tid + r * WG, kv_end);
    }

    for (uint base = kv_start; base < kv_end; base += BC) {
        barrier();   // every subgroup is done with the last step's values (and, first, the queries)
        // 1. Keys, [key][dim].
        [[unroll]] for (uint r = 0u; r < LOADS; r++) {
            const uint at = chunk_slot(tid + r * WG, true);
            s_kv[at] = half4(keys[r].xy);
            s_kv[at + 1u] = half4(keys[r].zw);
        }
        barrier();

        // 2. This step's values and the next step's keys, into registers (2 BC tokens: 16 blocks at most).
        {
            const uint w0 = base >> block_shift();
            const int win = block_window(bt_row, w0, kv_end);
            [[unroll]] for (uint r = 0u; r < LOADS; r++) {
                values[r] = value_chunk(win, w0, kv_head, base, tid + r * WG, kv_end, values_by_dim);
                keys[r] = key_chunk(win, w0, kv_head, base + BC, tid + r * WG, kv_end);
            }
        }

        // 3. S = Q.K^T for this subgroup's rows: K^T is the staged keys read column-major.
        MAT_C s[BC / 16u];
        [[unroll]] for (uint n = 0u; n < BC / 16u; n++) s[n] = MAT_C(0.0);
        [[unroll]] for (uint k = 0u; k < D / 16u; k++) {
            [[unroll]] for (uint n = 0u; n < BC / 16u; n++) {
                MAT_B kt;
                coopMatLoad(kt, s_kv, n * 16u * KS + k * 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
                s[n] = coopMatMulAdd(q[k], kt, s[n]);
            }
        }
        [[unroll]] for (uint n = 0u; n < BC / 16u; n++) {
            coopMatStore(s[n], s_s, warp * 16u * TS + n * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();   // this subgroup's S is in s_s

        // Where the row sees every key of the step (most steps), without a test per key (this and p's form below: 1.09x
        // faster on the H200).
        const bool whole = base + BC <= me.keys && key_visible(base, me.pos) && key_visible(base + BC - 1u, me.pos);
        vec4 x[BC / 8u];
        float mx;
        if (whole) mx = row_logits(x, my_row, half_, base, me, false);
        else mx = row_logits(x, my_row, half_, base, me, true);
        mx = max(mx, subgroupShuffleXor(mx, 1u));
        const float m_new = max(m, mx);
        const float alpha = m_new == NEG_INF ? 1.0 : exp(m - m_new);
        m = m_new;
        float sum = 0.0;
        [[unroll]] for (uint j = 0u; j < BC / 8u; j++) {
            const vec4 p = m == NEG_INF ? vec4(0.0) : exp(x[j] - m);
            sum += dot(p, vec4(1.0));
            s_p[my_row * TS + 2u * j + half_] = f16vec4(p);
        }
        l = l * alpha + sum;
        if (half_ == 0u) s_row[my_row] = alpha;
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        // Skipped where no row of the subgroup moved its running max (most steps, once the maxima settle):
        // multiplying by 1 changes nothing.
        float moved = alpha == 1.0 ? 0.0 : 1.0;
        [[unroll]] for (uint mask = 16u; mask > 0u; mask >>= 1) moved = max(moved, subgroupShuffleXor(moved, mask));
        if (moved != 0.0) {   // uniform in the subgroup
            [[unroll]] for (int i = 0; i < o[0].length(); i++) {
                const float a = s_row[ROWS_OF(i)];
                [[unroll]] for (uint j = 0u; j < D / 16u; j++) o[j][i] *= a;
            }
        }
        barrier();   // every subgroup is done with the keys
        [[unroll]] for (uint r = 0u; r < LOADS; r++) {
            const uint at = chunk_slot(tid + r * WG, values_by_dim);
            s_kv[at] = half4(values[r].xy);
            s_kv[at + 1u] = half4(values[r].zw);
        }
        barrier();

        // 4. O += P.V
        [[unroll]] for (uint k = 0u; k < BC / 16u; k++) {
            MAT_A p;
            coopMatLoad(p, s_p, warp * 16u * TS + k * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
            if (values_by_dim) {
                [[unroll]] for (uint j = 0u; j < D / 16u; j++) {
                    MAT_B v;
                    coopMatLoad(v, s_kv, k * 16u * KS + j * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
                    o[j] = coopMatMulAdd(p, v, o[j]);
                }
            } else {
                [[unroll]] for (uint j = 0u; j < D / 16u; j++) {
                    MAT_B v;
                    coopMatLoad(v, s_kv, j * 16u * TS + k * 4u, TS, gl_CooperativeMatrixLayoutColumnMajor);
                    o[j] = coopMatMulAdd(p, v, o[j]);
                }
            }
        }
    }

    // The rows' denominators; a row that sees no key gives zeros and lse -inf (or the sink's logit: a
    // variant, joining the denominator and the lse).
    l += subgroupShuffleXor(l, 1u);
    const vec2 fin = softmax_finish(m, l, sink_logit(me.head));
    if (half_ == 0u) s_row[my_row] = fin.x * pc.v_scale;
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    [[unroll]] for (int i = 0; i < o[0].length(); i++) {
        const float a = s_row[ROWS_OF(i)];
        [[unroll]] for (uint j = 0u; j < D / 16u; j++) o[j][i] *= a;
    }
    // Out through shared memory, BC head dims at a time: rows of a workgroup are not evenly spaced in `out`.
    const bool write = me.valid && me.base + D <= rows_held(2u * uint(out_.length()), pc.out_pitch);
    const uint out_base = pitched(me.base, pc.out_pitch);
    [[unroll]] for (uint pass = 0u; pass < D / BC; pass++) {
        [[unroll]] for (uint j = 0u; j < BC / 16u; j++) {
            coopMatStore(o[pass * (BC / 16u) + j], s_s, warp * 16u * TS + j * 4u, TS, gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        if (write) {
            for (uint j = 0u; j < BC / 8u; j++) {
                const uint cq = (BC / 8u) * half_ + j;
                const vec4 v = s_s[my_row * TS + cq];
                const uint d = out_base + pass * BC + 4u * cq;
                out_[d >> 1] = out_pair(v.xy);
                out_[(d >> 1) + 1u] = out_pair(v.zw);
            }
        }
        subgroupBarrier();   // read before the next pass overwrites
    }
    if (write && half_ == 0u && me.base / D < uint(lse.length())) lse[me.base / D] = fin.y;
}
