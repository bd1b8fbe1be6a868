#version 450
// Paged-attention backward, the query gradient: dq = scale * dS K with dS = P * (dP - D), P = exp(scale
// q.k - lse), dP = dout.v and D = rowsum(dout * out) (FlashAttention-2's backward; the forward's lse
// saves recomputing the softmax normalisation). The key and value gradients are paged_backward_dkdv.comp.
//
// Laid out as the scalar forward (paged_prefill.comp, which explains the tiles and staging): one workgroup per
// (tile of ROWS query rows of one sequence, kv head) from the tile table (ROWS from tile_rows(), 8 to 64), the
// context walked in tiles of KT = 2048 / ROWS keys; thread (rg, cg) holds rows 4rg .. 4rg+3 by keys cg + G*j:
//   S. logits and dP: the rows' queries and the tile's keys are staged CQ head quads at a time and multiplied
//      into a 4 x 4 block (st), then the rows' dout and the tile's values likewise (dp); each thread turns its
//      blocks into dS and writes it to shared memory (key-major, a vec4 per key and row group);
//   C. dq: the keys are staged VK at a time; thread (rg, cg) accumulates rows 4rg .. 4rg+3 by head quads
//      cg + G*j (mat4s dq0 .. dq3), five vec4 reads per key feeding 64 multiply-adds.
// D = rowsum(dout * out) comes from paged_backward_delta.comp (the backward's first dispatch), summed there as
// the same vector-times-matrix products that accumulate dP here, in the same order: where a query sees a single key
// out == v, so dP - D is exactly 0 as in float64 (a sum in another order would leave rounding noise, which would
// then be all of dq).
// Shared memory stays under 16 KiB as the forward's; bounds are kept as there.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_IN query[]; };          // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Tiles { int tiles[]; };             // [tiles, 2]
layout(std430, set = 0, binding = 7) readonly buffer Dout { Q_IN dout[]; };            // like query
layout(std430, set = 0, binding = 8) readonly buffer Delta { float delta_[]; };          // like lse: D of each row
layout(std430, set = 0, binding = 9) readonly buffer Lse { float lse[]; };               // [tokens, heads]
layout(std430, set = 0, binding = 10) writeonly buffer Dq { float dq[]; };               // like query

#include "attention_common.glsl"
#define PREFILL_TILES
#define TILE_BLOCK_IDS
#include "prefill_common.glsl"

// Shared memory, in vec4s: [0, ROWS * (CQ + 1)) a query (or dout) chunk, then KT * (CQ + 1) a key (or value)
// chunk (at most 864); later [0, DS_QUADS) dS (KT keys x ROWS / 4 row groups = 512) and from DS_QUADS the key
// sub-tile (VK keys x head quads).
const uint S_MEM = 1008u;
const uint DS_QUADS = 512u;
const uint K_QUADS = S_MEM - DS_QUADS;
const uint NO_ROW = 0xffffffffu;

shared vec4 s_mem[S_MEM];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = head_size();   // a constant where the plan specialized it (prefill_common.glsl)
    const uint hq = hs / 4u;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || hs > MAX_HEAD_SIZE || hq == 0u
        || hs != pc.head_size) return;
    // query and dout share one shape: a row is in both or the launch is malformed.
    const uint row_floats = min(Q_QUADS(query), Q_QUADS(dout)) * 4u;
    const uvec2 queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
    const uint q_start = queries.x, q_len = queries.y;
    const uint rows = group * q_len;
    if (row0 >= rows) return;
    const uint ROWS = tile_rows(rows, hs);
    const uint RG = ROWS / 4u, G = WG / RG, KT = 4u * G;
    const uint CQ = min(8u, 512u / KT);
    const uint QK_STRIDE = CQ + 1u;
    const uint rg = tid / G, cg = tid % G;
    const uint row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > row_floats) return;

    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // This thread's rows: the keys each sees (0 past the end or a buffer), lse and D.
    uvec4 keys;
    vec4 row_lse = vec4(0.0), delta = vec4(0.0);
    for (uint i = 0u; i < 4u; i++) {
        const uint gr = row0 + 4u * rg + i, q = row_base(q_start, kv_head, gr);
        const bool valid = gr < row_end && q + hs <= row_floats && q / hs < min(uint(lse.length()), uint(delta_.length()));
        keys[i] = valid ? visible_keys(gr / group, q_len, seq_len) : 0u;
        if (valid) {
            row_lse[i] = lse[q / hs];
            delta[i] = delta_[q / hs];
        }
    }

    const uvec4 cols = cg + G * uvec4(0u, 1u, 2u, 3u);   // keys of S, head quads of C
    const uvec4 kcols = min(cols, uvec4(hq - 1u));
    const uint k_off = ROWS * QK_STRIDE;
    const uint VK = min(KT, K_QUADS / hq);

    // What this thread stages (paged_prefill.comp explains): rows or keys lane_row + n * row_step, head quad
    // c0 + cl of the chunk at c0; in C, key k_k[n] of the sub-tile, head quad k_c[n].
    const uint cl = tid & (CQ - 1u), lane_row = tid >> findMSB(CQ), row_step = WG / CQ;
    uvec4 q_src;                               // query (dout) quad of element n at c0 = 0, or NO_ROW
    uvec4 k_k, k_c;
    for (uint n = 0u; n < 4u; n++) {
        const uint r = lane_row + n * row_step, gr = row0 + r, q = row_base(q_start, kv_head, gr);
        q_src[n] = r < ROWS && gr < row_end && q + hs <= row_floats ? q / 4u + cl : NO_ROW;
        k_k[n] = (tid + WG * n) / hq;
        k_c[n] = (tid + WG * n) % hq;
    }

    mat4 dq0 = mat4(0.0), dq1 = mat4(0.0), dq2 = mat4(0.0), dq3 = mat4(0.0);   // row i: column j = head quad cols[j]

    for (uint base = 0u; base < kv_end; base += KT) {
        const uint tile_len = min(KT, kv_end - base);
        stage_tile_blocks(bt_row, base, tile_len);
        barrier();

        // S: phase 0 the logits' dot products (query . key), phase 1 dP (dout . value); keys outside the cache
        // or past the tile staged as zeros.
        ivec4 k_phys;
        for (uint n = 0u; n < 4u; n++) {
            const uint k = lane_row + n * row_step;
            k_phys[n] = k < tile_len ? tile_block(bt_row, base, k) : -1;
        }
        mat4 st, dp;
        for (uint phase = 0u; phase < 2u; phase++) {
            mat4 acc = mat4(0.0);
            for (uint c0 = 0u; c0 < hq; c0 += CQ) {
                const bool in_head = c0 + cl < hq;
                // Every load of the chunk is issued before any is stored (stored as each came, each was waited
                // for in turn: paged_prefill.comp measured 14% of its time in that).
                vec4 rv[4], kv[4];
                [[unroll]] for (uint n = 0u; n < 4u; n++) {
                    const uint r = lane_row + n * row_step, b = uint(k_phys[n]), t = r & (bs - 1u);
                    const bool there = r < ROWS && q_src[n] != NO_ROW && in_head;
                    rv[n] = !there ? vec4(0.0)
                        : phase == 0u ? Q_QUAD_AT(query, q_src[n] + c0) : Q_QUAD_AT(dout, q_src[n] + c0);
                    kv[n] = k_phys[n] < 0 || !in_head ? vec4(0.0)   // k_phys is -1 past the tile
                        : phase == 0u ? kv_quad(key_load(b, key_offset(kv_head, t, c0 + cl)))
                        : value_quad(b, kv_head, t, c0 + cl);
                }
                [[unroll]] for (uint n = 0u; n < 4u; n++) {
                    const uint r = lane_row + n * row_step;
                    if (r < ROWS) s_mem[r * QK_STRIDE + cl] = rv[n];
                    if (r < KT) s_mem[k_off + r * QK_STRIDE + cl] = kv[n];
                }
                barrier();
                const uint n = min(CQ, hq - c0);
                for (uint c = 0u; c < n; c++) {
                    const uint qr = 4u * rg * QK_STRIDE + c, kr = k_off + cg * QK_STRIDE + c;
                    const mat4 q = mat4(s_mem[qr], s_mem[qr + QK_STRIDE], s_mem[qr + 2u * QK_STRIDE], s_mem[qr + 3u * QK_STRIDE]);
                    acc[0] += s_mem[kr] * q;   // vector * matrix: the key's dot product with each row
                    acc[1] += s_mem[kr + G * QK_STRIDE] * q;
                    acc[2] += s_mem[kr + 2u * G * QK_STRIDE] * q;
                    acc[3] += s_mem[kr + 3u * G * QK_STRIDE] * q;
                }
                barrier();
            }
            if (phase == 0u) st = acc; else dp = acc;
        }
        // dS of key cols[j] for the rows, 0 where a row does not see the key.
        for (uint j = 0u; j < 4u; j++) {
            const uint k = cols[j];
            const bool there = k < tile_len && tile_block(bt_row, base, k) >= 0;
            const bvec4 seen = lessThan(uvec4(base + k), there ? keys : uvec4(0u));
            s_mem[k * RG + rg] = mix(vec4(0.0), exp(st[j] * pc.scale - row_lse) * (dp[j] - delta), seen);
        }
        barrier();

        // C: dS times the keys, VK keys at a time (key quads are contiguous along head dims in both layouts).
        for (uint sub = 0u; sub < tile_len; sub += VK) {
            vec4 kv[4];   // every load issued before any is stored, as in S
            [[unroll]] for (uint n = 0u; n < 4u; n++) {
                const uint k = sub + k_k[n];
                const int phys = k < tile_len && tid + WG * n < VK * hq ? tile_block(bt_row, base, k) : -1;
                kv[n] = phys >= 0 ? kv_quad(key_load(uint(phys), key_offset(kv_head, k & (bs - 1u), k_c[n]))) : vec4(0.0);
            }
            [[unroll]] for (uint n = 0u; n < 4u; n++) {
                if (tid + WG * n < VK * hq) s_mem[DS_QUADS + tid + WG * n] = kv[n];
            }
            barrier();
            const uint n = min(VK, tile_len - sub);
            for (uint k = 0u; k < n; k++) {
                const vec4 ds = s_mem[(sub + k) * RG + rg];
                const uint kr = DS_QUADS + k * hq;
                const mat4 kq = mat4(s_mem[kr + kcols.x], s_mem[kr + kcols.y], s_mem[kr + kcols.z], s_mem[kr + kcols.w]);
                dq0 += ds.x * kq; dq1 += ds.y * kq; dq2 += ds.z * kq; dq3 += ds.w * kq;
            }
            barrier();   // s_mem and s_phys are rewritten next
        }
    }

    for (uint i = 0u; i < 4u; i++) {
        const uint gr = row0 + 4u * rg + i;
        const uint q = row_base(q_start, kv_head, gr);
        if (gr >= row_end || q + hs > uint(dq.length())) continue;
        const mat4 d = (i == 0u ? dq0 : i == 1u ? dq1 : i == 2u ? dq2 : dq3) * pc.scale;
        for (uint j = 0u; j < 4u; j++) {
            if (cols[j] >= hq) break;
            for (uint e = 0u; e < 4u; e++) dq[q + 4u * cols[j] + e] = d[j][e];
        }
    }
}
