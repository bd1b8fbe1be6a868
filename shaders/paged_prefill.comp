#version 450
// Paged-attention prefill forward over a ragged batch: each sequence's q_len_s new tokens (its last q_len_s
// positions) attend over its cached keys and values (causal or not), giving the output and the log-sum-exp
// (natural log) the backward pass needs. The batch's layout (query_start_loc, the host-built tile table,
// the query strides) is PREFILL_INPUTS in pagedvk/abi.py; decode tokens (q_len_s = 1) are ordinary rows.
// Grown from the seed's WGSL forward, which ran one thread per query row over the whole context with a
// 512-float array per thread.
//
// One workgroup per (tile of ROWS query rows of one sequence, kv head), from the tile table. The rows are
// (query, head) pairs of the heads that share the kv head (GQA), query-major, so each key and value read
// serves ROWS rows. The
// context is walked in tiles of TILE tokens with an online softmax, as in paged_decode.comp:
//   A. each thread computes the logits of one token of the tile for every row (its key read once, in
//      16-byte chunks; the query rows are read straight from their buffer: every thread reads the same
//      address at once, which GPUs serve as one broadcast, and staging them in shared memory made
//      lavapipe's compile of the WGSL module take seconds);
//   B. the workgroup takes each row's tile max, rescales what it has accumulated, and turns logits into
//      weights;
//   C. each thread accumulates the weighted values of the head dims it owns, for every row.
// Shared memory stays under 16 KiB, the least a Vulkan device may offer.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the caches, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };         // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
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

// The eight rows of a workgroup travel as two vec4s (rows 0-3, rows 4-7) rather than as float[8]: loops
// over a local array defeat some compilers (WGSL's guarded loops are not unrolled, and an array indexed
// in a loop then becomes a chain of selects), vector arithmetic does not.
const uint ROWS = 8u;                          // query rows per workgroup
const uint TILE = WG;                          // tokens per tile: one per thread in A
const uint LANES = WG / ROWS;                  // threads reducing one row in B
const uint MAX_TILE_BLOCKS = TILE / MIN_BLOCK_SIZE;

shared vec4 s_p[TILE * 2u];                  // [token][rows 0-3 | rows 4-7]: logits, then weights
shared float s_red[WG];                      // per-lane partial results of a row reduction
shared float s_row[ROWS];                    // a row reduction's result
shared float s_m[ROWS];                      // running max of each row's logits
shared float s_alpha[ROWS];                  // this tile's rescaling of each row's accumulators
shared int s_phys[MAX_TILE_BLOCKS];          // the tile's physical block ids, -1 where out of range

// Max or sum of each row of s_p (TILE values) into s_row: LANES threads per row, then one.
void row_reduce(bool take_max) {
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid / LANES, lane = tid % LANES;
    float v = take_max ? NEG_INF : 0.0;
    for (uint t = lane; t < TILE; t += LANES) {
        float x = s_p[t * 2u + r / 4u][r % 4u];
        v = take_max ? max(v, x) : v + x;
    }
    s_red[tid] = v;
    barrier();
    if (tid < ROWS) {
        float w = take_max ? NEG_INF : 0.0;
        for (uint i = 0u; i < LANES; i++) {
            float x = s_red[tid * LANES + i];
            w = take_max ? max(w, x) : w + x;
        }
        s_row[tid] = w;
    }
    barrier();
}

vec4 Q(uint i) { return q_quad(query[i]); }   // query quad i

vec4 rows4(uint first, bool from_m) {   // s_m or s_alpha of rows first .. first + 3
    return from_m ? vec4(s_m[first], s_m[first + 1u], s_m[first + 2u], s_m[first + 3u])
                  : vec4(s_alpha[first], s_alpha[first + 1u], s_alpha[first + 2u], s_alpha[first + 3u]);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = pc.head_size;
    const uint hc = hs / 4u;                   // head quads
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || hs > MAX_HEAD_SIZE) return;
    const uvec2 queries = sequence_queries(seq, uint(query.length()) * 4u / (hs * pc.num_heads));
    const uint q_start = queries.x, q_len = queries.y;
    const uint rows = group * q_len;
    if (row0 >= rows) return;
    const uint row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > uint(query.length()) * 4u) return;

    const uint num_blocks = pc.num_blocks;
    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    // Rows are query-major, so the last row sees the most keys.
    const uint kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // Keys each row sees; 0 for rows past the end (or past the query buffer).
    uint keys[ROWS];
    for (uint r = 0u; r < ROWS; r++) {
        uint gr = row0 + r;
        bool valid = gr < row_end && row_base(q_start, kv_head, gr) + hs <= uint(query.length()) * 4u;
        keys[r] = valid ? visible_keys(gr / group, q_len, seq_len) : 0u;
    }
    const uvec4 keys_a = uvec4(keys[0], keys[1], keys[2], keys[3]);
    const uvec4 keys_b = uvec4(keys[4], keys[5], keys[6], keys[7]);
    // Each row's query head and sequence position, for the logit hooks.
    uvec4 head_a, head_b, qpos_a, qpos_b;
    for (uint r = 0u; r < 4u; r++) {
        head_a[r] = kv_head * group + (row0 + r) % group;
        head_b[r] = kv_head * group + (row0 + 4u + r) % group;
        qpos_a[r] = query_position((row0 + r) / group, q_len, seq_len);
        qpos_b[r] = query_position((row0 + 4u + r) / group, q_len, seq_len);
    }
    // Each row's first query chunk; rows that see nothing read row 0's (in bounds) and are masked.
    uint qb[ROWS];
    for (uint r = 0u; r < ROWS; r++) qb[r] = row_base(q_start, kv_head, keys[r] > 0u ? row0 + r : row0) / 4u;
    const uvec4 qb_a = uvec4(qb[0], qb[1], qb[2], qb[3]);
    const uvec4 qb_b = uvec4(qb[4], qb[5], qb[6], qb[7]);
    if (tid < ROWS) s_m[tid] = NEG_INF;

    vec4 l_a = vec4(0.0), l_b = vec4(0.0);     // this thread's share of each row's softmax denominator
    vec4 o0_a = vec4(0.0), o0_b = vec4(0.0);   // weighted values of head dim tid, per row
    vec4 o1_a = vec4(0.0), o1_b = vec4(0.0);   // and of head dim tid + WG
    const uint d0 = 2u * tid, d1 = d0 + 1u;   // this thread's head dims

    // Variant: tiles start at the block of the first key the sliding window lets the first row see (rows are
    // query-major: it sees the earliest keys).
    const uint kv_start = min(window_first_key(query_position(row0 / group, q_len, seq_len)), kv_end) & ~(bs - 1u);
    for (uint base = kv_start; base < kv_end; base += TILE) {
        const uint tile_len = min(TILE, kv_end - base);
        const uint tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            int b = block_tables[bt_row + base / bs + tid];
            s_phys[tid] = (b >= 0 && uint(b) < num_blocks) ? b : -1;
        }
        barrier();

        // A: token base + tid's logit for every row, -inf where masked.
        const uint token = base + tid;
        const int phys = tid < tile_len ? s_phys[tid / bs] : -1;
        vec4 x_a = vec4(0.0), x_b = vec4(0.0);
        if (phys >= 0) {
            for (uint c = 0u; c < hc; c++) {
                vec4 k = kv_quad(key_load(uint(phys), key_offset(kv_head, token % bs, c)));
                x_a += vec4(dot(k, Q(qb_a.x + c)), dot(k, Q(qb_a.y + c)), dot(k, Q(qb_a.z + c)), dot(k, Q(qb_a.w + c)));
                x_b += vec4(dot(k, Q(qb_b.x + c)), dot(k, Q(qb_b.y + c)), dot(k, Q(qb_b.z + c)), dot(k, Q(qb_b.w + c)));
            }
        }
        // A token outside the cache is visible to no row.
        x_a = logits4(x_a * pc.scale, head_a, token, qpos_a, phys >= 0 ? keys_a : uvec4(0u));
        x_b = logits4(x_b * pc.scale, head_b, token, qpos_b, phys >= 0 ? keys_b : uvec4(0u));
        s_p[tid * 2u] = x_a;
        s_p[tid * 2u + 1u] = x_b;
        barrier();

        // B: online softmax across tiles, per row.
        row_reduce(true);
        if (tid < ROWS) {
            float m_old = s_m[tid];
            float m_new = max(m_old, s_row[tid]);
            s_alpha[tid] = m_new == NEG_INF ? 1.0 : exp(m_old - m_new);
            s_m[tid] = m_new;
        }
        barrier();
        const vec4 alpha_a = rows4(0u, false), alpha_b = rows4(4u, false);
        const vec4 p_a = mix(exp(x_a - rows4(0u, true)), vec4(0.0), equal(x_a, vec4(NEG_INF)));
        const vec4 p_b = mix(exp(x_b - rows4(4u, true)), vec4(0.0), equal(x_b, vec4(NEG_INF)));
        l_a = l_a * alpha_a + p_a;
        l_b = l_b * alpha_b + p_b;
        o0_a *= alpha_a; o0_b *= alpha_b;
        o1_a *= alpha_a; o1_b *= alpha_b;
        s_p[tid * 2u] = p_a;
        s_p[tid * 2u + 1u] = p_b;
        barrier();

        // C: weighted values of this thread's head dims. Tokens past kv_end are never read: slots past a
        // sequence's length may hold anything, NaN included, and 0 * NaN is NaN.
        for (uint t = 0u; t < tile_len; t++) {
            int b = s_phys[t / bs];
            if (b < 0) continue;
            if (d0 >= hs) break;   // threads past the head have no dims
            uint v = value_offset(kv_head, (base + t) % bs, d0);
            float v0 = VALUE_AT(uint(b), v), v1 = VALUE_AT(uint(b), v + pc.v_dim_stride);
            vec4 w_a = s_p[t * 2u], w_b = s_p[t * 2u + 1u];
            o0_a += w_a * v0; o0_b += w_b * v0;
            o1_a += w_a * v1; o1_b += w_b * v1;
        }
        barrier();   // s_p and s_phys are rewritten by the next tile
    }

    // Each row's denominator, summed over the threads once at the end.
    s_p[tid * 2u] = l_a;
    s_p[tid * 2u + 1u] = l_b;
    barrier();
    row_reduce(false);
    for (uint r = 0u; r < ROWS; r++) {
        uint q = row_base(q_start, kv_head, row0 + r);
        if (row0 + r >= row_end || q + hs > 2u * uint(out_.length())) continue;
        // A row that sees no key gives zeros; the sink (a variant) joins the denominator and the lse.
        const vec2 fin = softmax_finish(s_m[r], s_row[r], sink_logit(r < 4u ? head_a[r] : head_b[r - 4u]));
        vec2 o = vec2(r < 4u ? o0_a[r] : o0_b[r - 4u], r < 4u ? o1_a[r] : o1_b[r - 4u]) * (fin.x * pc.v_scale);
        if (d0 < hs) out_[(q + d0) >> 1] = out_pair(o);
        if (tid == 0u && q / hs < uint(lse.length())) lse[q / hs] = fin.y;
    }
}
