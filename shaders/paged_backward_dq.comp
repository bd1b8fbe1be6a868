#version 450
// Paged-attention backward, the query gradient: dq = scale * dS K with dS = P * (dP - D), P = exp(scale
// q.k - lse), dP = dout.v and D = rowsum(dout * out) (FlashAttention-2's backward; the forward's lse
// saves recomputing the softmax normalisation). The key and value gradients are paged_backward_dkdv.comp.
//
// One workgroup per (tile of ROWS query rows of one sequence, kv head), from the tile table, rows packed as
// in paged_prefill.comp; the batch is ragged as the forward's (PREFILL_INPUTS in pagedvk/abi.py).
// Each thread computes the rows' D itself, summed in the order A sums dP: where a query sees a single key,
// out == v, so dP - D is exactly 0 as in float64 (a reduction across threads would leave rounding noise,
// which would then be all of dq). Then the context is walked in tiles of TILE tokens:
//   A. each thread takes one token of the tile: its logit and dP for every row (key and value read once),
//      and from them dS;
//   C. each thread accumulates dS times the keys for the head dims it owns, for every row.
// Bounds are kept as in paged_prefill.comp.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };          // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11   // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Tiles { int tiles[]; };             // [tiles, 2]
layout(std430, set = 0, binding = 7) readonly buffer Dout { Q_QUAD dout[]; };            // like query
layout(std430, set = 0, binding = 8) readonly buffer Out { Q_QUAD out_[]; };             // like query
layout(std430, set = 0, binding = 9) readonly buffer Lse { float lse[]; };               // [tokens, heads]
layout(std430, set = 0, binding = 10) writeonly buffer Dq { float dq[]; };               // like query

#include "attention_common.glsl"
#define PREFILL_TILES
#include "prefill_common.glsl"

const uint ROWS = 8u;                          // query rows per workgroup: two vec4s (_a, _b)
const uint TILE = WG;                          // tokens per tile: one per thread in A
const uint MAX_TILE_BLOCKS = TILE / MIN_BLOCK_SIZE;

shared vec4 s_ds[TILE * 2u];         // [token][rows 0-3 | rows 4-7]: dS
shared int s_phys[MAX_TILE_BLOCKS];  // the tile's physical block ids, -1 where out of range

vec4 Q(uint i) { return q_quad(query[i]); }    // quad i of query, dout, out
vec4 DO(uint i) { return q_quad(dout[i]); }
vec4 O(uint i) { return q_quad(out_[i]); }

vec4 dots(vec4 x, uvec4 rows) {       // x . query quad of four rows (their quad indices)
    return vec4(dot(x, Q(rows.x)), dot(x, Q(rows.y)), dot(x, Q(rows.z)), dot(x, Q(rows.w)));
}

vec4 dout_dots(vec4 x, uvec4 rows) {  // x . dout quad of four rows
    return vec4(dot(x, DO(rows.x)), dot(x, DO(rows.y)), dot(x, DO(rows.z)), dot(x, DO(rows.w)));
}

vec4 delta_terms(uvec4 rows) {         // out . dout quad of four rows, operands in dout_dots' order
    return vec4(dot(O(rows.x), DO(rows.x)), dot(O(rows.y), DO(rows.y)), dot(O(rows.z), DO(rows.z)),
                dot(O(rows.w), DO(rows.w)));
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = pc.head_size;
    const uint hc = hs / 4u;
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || hs > MAX_HEAD_SIZE) return;
    // query, dout and out share one shape: a row is in all three or the launch is malformed.
    const uint row_floats = min(min(uint(query.length()), uint(dout.length())), uint(out_.length())) * 4u;
    const uvec2 queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
    const uint q_start = queries.x, q_len = queries.y;
    const uint rows = group * q_len;
    if (row0 >= rows) return;
    const uint row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > row_floats) return;

    const uint num_blocks = pc.num_blocks;
    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // Keys each row sees (0 past the end), its first chunk (row 0's where it sees none) and its lse.
    uint keys[ROWS], qb[ROWS];
    float row_lse[ROWS];
    for (uint r = 0u; r < ROWS; r++) {
        uint q = row_base(q_start, kv_head, row0 + r);
        bool valid = row0 + r < row_end && q + hs <= row_floats && q / hs < uint(lse.length());
        keys[r] = valid ? visible_keys((row0 + r) / group, q_len, seq_len) : 0u;
        qb[r] = (keys[r] > 0u ? q : row_base(q_start, kv_head, row0)) / 4u;
        row_lse[r] = keys[r] > 0u ? lse[q / hs] : 0.0;
    }
    const uvec4 keys_a = uvec4(keys[0], keys[1], keys[2], keys[3]), keys_b = uvec4(keys[4], keys[5], keys[6], keys[7]);
    const uvec4 qb_a = uvec4(qb[0], qb[1], qb[2], qb[3]), qb_b = uvec4(qb[4], qb[5], qb[6], qb[7]);
    const vec4 lse_a = vec4(row_lse[0], row_lse[1], row_lse[2], row_lse[3]);
    const vec4 lse_b = vec4(row_lse[4], row_lse[5], row_lse[6], row_lse[7]);

    // D = rowsum(dout * out), in the order A sums dP.
    vec4 delta_a = vec4(0.0), delta_b = vec4(0.0);
    for (uint c = 0u; c < hc; c++) {
        delta_a += delta_terms(qb_a + c);
        delta_b += delta_terms(qb_b + c);
    }

    vec4 dq0_a = vec4(0.0), dq0_b = vec4(0.0);   // head dim tid, per row
    vec4 dq1_a = vec4(0.0), dq1_b = vec4(0.0);   // head dim tid + WG
    const uint d0 = tid, d1 = tid + WG;

    for (uint base = 0u; base < kv_end; base += TILE) {
        const uint tile_len = min(TILE, kv_end - base);
        const uint tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            int b = block_tables[bt_row + base / bs + tid];
            s_phys[tid] = (b >= 0 && uint(b) < num_blocks) ? b : -1;
        }
        barrier();

        // A: dS of token base + tid for every row, 0 where masked.
        const uint token = base + tid;
        const int phys = tid < tile_len ? s_phys[tid / bs] : -1;
        vec4 x_a = vec4(0.0), x_b = vec4(0.0), dp_a = vec4(0.0), dp_b = vec4(0.0);
        if (phys >= 0) {
            const uint v0 = value_offset(kv_head, token % bs, 0u);
            const uint vs = pc.v_dim_stride;
            for (uint c = 0u; c < hc; c++) {
                vec4 k = kv_quad(key_load(uint(phys), key_offset(kv_head, token % bs, c)));
                uint vi = v0 + 4u * c * vs;
                const uint p = uint(phys);
                vec4 v = vec4(VALUE_AT(p, vi), VALUE_AT(p, vi + vs), VALUE_AT(p, vi + 2u * vs), VALUE_AT(p, vi + 3u * vs));
                x_a += dots(k, qb_a + c);
                x_b += dots(k, qb_b + c);
                dp_a += dout_dots(v, qb_a + c);
                dp_b += dout_dots(v, qb_b + c);
            }
        }
        const bvec4 seen_a = lessThan(uvec4(token), phys >= 0 ? keys_a : uvec4(0u));
        const bvec4 seen_b = lessThan(uvec4(token), phys >= 0 ? keys_b : uvec4(0u));
        s_ds[tid * 2u] = mix(vec4(0.0), exp(x_a * pc.scale - lse_a) * (dp_a - delta_a), seen_a);
        s_ds[tid * 2u + 1u] = mix(vec4(0.0), exp(x_b * pc.scale - lse_b) * (dp_b - delta_b), seen_b);
        barrier();

        // C: dS times the keys, for this thread's head dims.
        for (uint t = 0u; t < tile_len; t++) {
            int b = s_phys[t / bs];
            if (b < 0) continue;
            const vec4 ds_a = s_ds[t * 2u], ds_b = s_ds[t * 2u + 1u];
            if (d0 < hs) {
                float kd = KEY_AT(uint(b), kv_head, (base + t) % bs, d0);
                dq0_a += ds_a * kd; dq0_b += ds_b * kd;
            }
            if (d1 < hs) {
                float kd = KEY_AT(uint(b), kv_head, (base + t) % bs, d1);
                dq1_a += ds_a * kd; dq1_b += ds_b * kd;
            }
        }
        barrier();   // s_ds and s_phys are rewritten by the next tile
    }

    for (uint r = 0u; r < ROWS; r++) {
        uint q = row_base(q_start, kv_head, row0 + r);
        if (row0 + r >= row_end || q + hs > uint(dq.length())) continue;
        if (d0 < hs) dq[q + d0] = pc.scale * (r < 4u ? dq0_a[r] : dq0_b[r - 4u]);
        if (d1 < hs) dq[q + d1] = pc.scale * (r < 4u ? dq1_a[r] : dq1_b[r - 4u]);
    }
}
