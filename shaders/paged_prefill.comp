#version 450
// Paged-attention prefill forward over a ragged batch: each sequence's q_len_s new tokens (its last q_len_s
// positions) attend over its cached keys and values (causal or not), giving the output and the log-sum-exp
// (natural log) the backward pass needs. The batch's layout (query_start_loc, the host-built tile table,
// the query strides) is PREFILL_INPUTS in pagedvk/abi.py; decode tokens (q_len_s = 1) are ordinary rows.
// This is the scalar forward: every device without cooperative matrices runs it, and WGSL has no other.
//
// One workgroup per (tile of ROWS query rows of one sequence, kv head), from the tile table. The rows are
// (query, head) pairs of the heads that share the kv head (GQA), query-major. ROWS (tile_rows()) is 64, or
// 32 above head size 128 so that what a thread accumulates stays 64 floats; a sequence with fewer rows (decode
// tokens, short chunks) gets the fewest of 8, 16 and 32 that hold them, wasting less of the workgroup.
// The context is walked in tiles of KT = 2048 / ROWS keys with an online softmax; every key and value of a
// tile is read from the paged cache once, converted to float32 into shared memory, and serves all ROWS rows:
//   S. logits: the tile's keys and the rows' queries are staged CQ head quads at a time; thread (rg, cg)
//      accumulates a 4 x 4 block, rows 4rg .. 4rg+3 by keys cg + G*j (G = 128 / (ROWS / 4) threads per
//      row group): per head quad, eight shared-memory vec4 reads feed 64 multiply-adds;
//   softmax: each row's tile max over its G threads through shared memory; every thread rescales what it
//      holds of its rows and writes its weights P (key-major, a vec4 per key and row group);
//   PV. the values are staged VK keys at a time; thread (rg, cg) accumulates rows 4rg .. 4rg+3 by head quads
//      cg + G*j (mat4s o0 .. o3): per key, five vec4 reads (the rows' weights, four value quads) feed 64.
// Shared memory stays under 16 KiB, the least a Vulkan device may offer: Q and K chunks, then P, then V
// share one array (S_MEM), each use separated from the next by a barrier.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the caches, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_IN query[]; };         // [tokens, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 6) readonly buffer Tiles { int tiles[]; };            // [tiles, 2]
layout(std430, set = 0, binding = 7) writeonly buffer Out { Q_WORD out_[]; };         // like query
layout(std430, set = 0, binding = 8) writeonly buffer Lse { float lse[]; };             // [tokens, heads]
layout(std430, set = 0, binding = 9) readonly buffer AlibiSlopes { float alibi_slopes[]; }; // [heads] (VARIANT_ALIBI)
layout(std430, set = 0, binding = 10) readonly buffer Sinks { float sinks[]; };            // [heads] (VARIANT_SINKS)

#include "attention_common.glsl"
#include "attention_variants.glsl"
#define PREFILL_TILES
#define TILE_BLOCK_IDS
#include "prefill_common.glsl"

// Shared memory, in vec4s: [0, ROWS * (CQ + 1)) query chunk, then KT * (CQ + 1) key chunk (at most 864);
// later [0, P_QUADS) the weights P (KT keys x ROWS / 4 row groups = 512), and from P_QUADS the row
// reductions (128), then the value sub-tile (VK keys x head quads, V_QUADS at most).
const uint S_MEM = 1008u;                    // 16128 bytes, with s_phys under 16 KiB
const uint P_QUADS = 512u;
const uint V_QUADS = S_MEM - P_QUADS;
const uint NO_ROW = 0xffffffffu;

shared vec4 s_mem[S_MEM];

// Max (or sum) of vec4 v over the G threads of each row group: through s_mem at P_QUADS, two barriers.
vec4 row_group_reduce(vec4 v, uint rg, uint cg, uint RG, uint G, bool take_max) {
    s_mem[P_QUADS + cg * RG + rg] = v;
    barrier();
    vec4 w = take_max ? vec4(NEG_INF) : vec4(0.0);
    for (uint g = 0u; g < G; g++) {
        const vec4 x = s_mem[P_QUADS + g * RG + rg];
        w = take_max ? max(w, x) : w + x;
    }
    barrier();
    return w;
}

// The logits of key k of the tile for a thread's rows from their dot products: the hooks, -inf where masked. A
// token outside the cache (or past the tile) is visible to no row.
vec4 key_logits(vec4 dots, uint k, uint tile_len, uint bt_row, uint base, uvec4 heads, uvec4 qpos, uvec4 keys) {
    const int phys = k < tile_len ? tile_block(bt_row, base, k) : -1;
    return logits4(dots * pc.scale, heads, base + k, qpos, phys >= 0 ? keys : uvec4(0u));
}

// Softmax weights of logits x under running maxes m; 0 where masked (exp(-inf - -inf) would be NaN).
vec4 weights(vec4 x, vec4 m) { return mix(exp(x - m), vec4(0.0), equal(x, vec4(NEG_INF))); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = head_size();   // a constant where the plan specialized it (prefill_common.glsl)
    const uint hq = hs / 4u;                   // head quads
    const uint bs = pc.block_size;
    const uint group = pc.num_heads / pc.num_kv_heads;
    uint kv_head, seq, row0;
    if (!tile_work(workgroup_index(), kv_head, seq, row0) || hs > MAX_HEAD_SIZE || hq == 0u
        || hs != pc.head_size) return;
    // The bound on row_base() + hs of the rows the query binding holds at its pitch (rows_held, attention_common.glsl).
    const uint query_elems = rows_held(Q_QUADS(query) * 4u, pc.q_pitch);
    const uvec2 queries = sequence_queries(seq, query_elems / (hs * pc.num_heads));
    const uint q_start = queries.x, q_len = queries.y;
    const uint rows = group * q_len;
    if (row0 >= rows) return;
    const uint ROWS = tile_rows(rows, hs);
    const uint RG = ROWS / 4u;                 // row groups of 4 rows
    const uint G = WG / RG;                    // threads per row group: 8 .. 64
    const uint KT = 4u * G;                    // keys per tile: 32 .. 256
    const uint CQ = min(8u, 512u / KT);        // head quads per staged chunk: (ROWS + KT) * (CQ + 1) <= 864
    const uint QK_STRIDE = CQ + 1u;            // vec4s per staged row: one of padding against bank conflicts
    const uint rg = tid / G, cg = tid % G;
    const uint row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > query_elems) return;

    const uint bt_row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(bt_row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    // Rows are query-major, so the last row sees the most keys.
    const uint kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // This thread's rows 4rg .. 4rg+3: the keys each sees (0 for rows past the end or the query buffer), its
    // query head and sequence position, for the logit hooks.
    uvec4 keys, heads, qpos;
    for (uint i = 0u; i < 4u; i++) {
        const uint gr = row0 + 4u * rg + i;
        const bool valid = gr < row_end && row_base(q_start, kv_head, gr) + hs <= query_elems;
        keys[i] = valid ? visible_keys(gr / group, q_len, seq_len) : 0u;
        heads[i] = kv_head * group + gr % group;
        qpos[i] = query_position(gr / group, q_len, seq_len);
    }
    // The head quads of this thread's output columns, clamped into the head (columns past it are never written).
    const uvec4 cols = cg + G * uvec4(0u, 1u, 2u, 3u);
    const uvec4 vcols = min(cols, uvec4(hq - 1u));
    const uint k_off = ROWS * QK_STRIDE;       // the key chunk in s_mem
    const uint VK = min(KT, (V_QUADS / hq) & ~3u);   // keys per value sub-tile: whole quads of tokens

    // What this thread stages, worked out once: the divisions by run-time sizes would otherwise cost as much as
    // the arithmetic they feed. Element n < 4 of each staging loop is number tid + WG * n of its stage (each
    // stage has at most 512):
    //   a query or key chunk: row or key lane_row + n * row_step, head quad c0 + cl of the chunk at c0;
    //   a value sub-tile (VK * hq elements): key v_k[n] of the sub-tile and head quad v_c[n] (nhd), or keys
    //   v_k[n] .. v_k[n] + 3 and head dim v_c[n] (vLLM's layout: values are read along the contiguous axis,
    //   and a tile and its sub-tiles start on quads of tokens).
    const uint cl = tid & (CQ - 1u), lane_row = tid >> findMSB(CQ), row_step = WG / CQ;
    const bool dims_contiguous = pc.v_dim_stride == 1u;
    uvec4 q_src;                               // query quad of element n at c0 = 0, or NO_ROW
    uvec4 v_k, v_c;
    for (uint n = 0u; n < 4u; n++) {
        const uint r = lane_row + n * row_step, gr = row0 + r, q = row_base(q_start, kv_head, gr);
        q_src[n] = r < ROWS && gr < row_end && q + hs <= query_elems ? pitched(q, pc.q_pitch) / 4u + cl : NO_ROW;
        const uint i = tid + WG * n;
        v_k[n] = dims_contiguous ? i / hq : 4u * (i / hs);
        v_c[n] = dims_contiguous ? i % hq : i % hs;
    }

    vec4 m = vec4(NEG_INF);                    // running max of each row's logits
    vec4 l = vec4(0.0);                        // this thread's share of each row's softmax denominator
    mat4 o0 = mat4(0.0), o1 = mat4(0.0), o2 = mat4(0.0), o3 = mat4(0.0);   // row i: column j = head quad cols[j]

    // Variant: tiles start at the block of the first key the sliding window lets the first row see (rows are
    // query-major: it sees the earliest keys). Tiles are whole blocks: KT is a multiple of the block size.
    const uint kv_start = min(window_first_key(query_position(row0 / group, q_len, seq_len)), kv_end) & ~(bs - 1u);
    for (uint base = kv_start; base < kv_end; base += KT) {
        const uint tile_len = min(KT, kv_end - base);
        stage_tile_blocks(bt_row, base, tile_len);
        barrier();

        // S: st[j] = the logits of key cg + G*j for rows 0-3, accumulated a chunk of head dims at a time. Keys
        // outside the cache or past the tile are staged as zeros: slots past a sequence's length may hold
        // anything, NaN included.
        ivec4 k_phys;                          // the block of each key this thread stages (-1: none)
        uvec4 k_tok;                           // and its quad 0 in the block
        for (uint n = 0u; n < 4u; n++) {
            const uint k = lane_row + n * row_step;
            k_phys[n] = k < tile_len ? tile_block(bt_row, base, k) : -1;
            k_tok[n] = key_offset(kv_head, k & (bs - 1u), 0u);
        }
        mat4 st = mat4(0.0);
        for (uint c0 = 0u; c0 < hq; c0 += CQ) {
            const bool in_head = c0 + cl < hq;
            // Every load of the chunk is issued before any is stored (a loop storing each as it comes waits for
            // each in turn).
            vec4 qv[4], kv[4];
            [[unroll]] for (uint n = 0u; n < 4u; n++) {
                const uint r = lane_row + n * row_step;
                qv[n] = r < ROWS && q_src[n] != NO_ROW && in_head ? Q_QUAD_AT(query, q_src[n] + c0) : vec4(0.0);
                kv[n] = r < KT && k_phys[n] >= 0 && in_head
                    ? kv_quad(key_load(uint(k_phys[n]), k_tok[n] + key_offset(0u, 0u, c0 + cl))) : vec4(0.0);
            }
            [[unroll]] for (uint n = 0u; n < 4u; n++) {
                const uint r = lane_row + n * row_step;
                if (r < ROWS) s_mem[r * QK_STRIDE + cl] = qv[n];
                if (r < KT) s_mem[k_off + r * QK_STRIDE + cl] = kv[n];
            }
            barrier();
            const uint n = min(CQ, hq - c0);
            for (uint c = 0u; c < n; c++) {
                const uint qr = 4u * rg * QK_STRIDE + c, kr = k_off + cg * QK_STRIDE + c;
                const mat4 q = mat4(s_mem[qr], s_mem[qr + QK_STRIDE], s_mem[qr + 2u * QK_STRIDE], s_mem[qr + 3u * QK_STRIDE]);
                st[0] += s_mem[kr] * q;   // vector * matrix: the key's dot product with each row
                st[1] += s_mem[kr + G * QK_STRIDE] * q;
                st[2] += s_mem[kr + 2u * G * QK_STRIDE] * q;
                st[3] += s_mem[kr + 3u * G * QK_STRIDE] * q;
            }
            barrier();
        }
        // Written out rather than looped over j: st stays in registers on compilers that do not unroll.
        st[0] = key_logits(st[0], cols.x, tile_len, bt_row, base, heads, qpos, keys);
        st[1] = key_logits(st[1], cols.y, tile_len, bt_row, base, heads, qpos, keys);
        st[2] = key_logits(st[2], cols.z, tile_len, bt_row, base, heads, qpos, keys);
        st[3] = key_logits(st[3], cols.w, tile_len, bt_row, base, heads, qpos, keys);

        // Online softmax across tiles, per row: every thread of a row group keeps the same running max.
        const vec4 m_new = max(m, row_group_reduce(max(max(st[0], st[1]), max(st[2], st[3])), rg, cg, RG, G, true));
        const vec4 alpha = mix(exp(m - m_new), vec4(1.0), equal(m_new, vec4(NEG_INF)));
        m = m_new;
        l *= alpha;
        o0 *= alpha.x; o1 *= alpha.y; o2 *= alpha.z; o3 *= alpha.w;
        const vec4 p0 = weights(st[0], m), p1 = weights(st[1], m), p2 = weights(st[2], m), p3 = weights(st[3], m);
        l += p0 + p1 + p2 + p3;
        s_mem[cols.x * RG + rg] = p0;
        s_mem[cols.y * RG + rg] = p1;
        s_mem[cols.z * RG + rg] = p2;
        s_mem[cols.w * RG + rg] = p3;
        barrier();

        // PV: the values VK keys at a time, read along whichever axis of the cache is contiguous (quads of
        // head dims in nhd, of tokens in vLLM's layout: a tile and its sub-tiles start on quads of tokens).
        for (uint sub = 0u; sub < tile_len; sub += VK) {
            vec4 vv[4];   // as the keys: every load issued before any is stored
            [[unroll]] for (uint n = 0u; n < 4u; n++) {
                const uint k = sub + v_k[n];
                const int phys = k < tile_len && tid + WG * n < VK * hq ? tile_block(bt_row, base, k) : -1;
                const uint d = dims_contiguous ? 4u * v_c[n] : v_c[n];
                vv[n] = phys >= 0 ? kv_quad(value_load(uint(phys), value_offset(kv_head, k & (bs - 1u), d) >> 2)) : vec4(0.0);
            }
            for (uint n = 0u; n < 4u; n++) {
                if (tid + WG * n >= VK * hq) break;
                const uint k = sub + v_k[n];
                const uint d = dims_contiguous ? 4u * v_c[n] : v_c[n];
                const vec4 v = vv[n];
                if (dims_contiguous) {
                    s_mem[P_QUADS + tid + WG * n] = v;
                } else {
                    const uint at = P_QUADS + v_k[n] * hq + (d >> 2);
                    for (uint e = 0u; e < 4u; e++) s_mem[at + e * hq][d & 3u] = k + e < tile_len ? v[e] : 0.0;
                }
            }
            barrier();
            const uint n = min(VK, tile_len - sub);
            for (uint k = 0u; k < n; k++) {
                const vec4 p = s_mem[(sub + k) * RG + rg];
                const uint vr = P_QUADS + k * hq;
                const mat4 v = mat4(s_mem[vr + vcols.x], s_mem[vr + vcols.y], s_mem[vr + vcols.z], s_mem[vr + vcols.w]);
                o0 += p.x * v; o1 += p.y * v; o2 += p.z * v; o3 += p.w * v;
            }
            barrier();   // s_mem and s_phys are rewritten next
        }
    }

    // Each row's denominator, summed over its row group once at the end.
    l = row_group_reduce(l, rg, cg, RG, G, false);
    const uint out_elems = rows_held(2u * OUT_PAIRS(out_), pc.out_pitch);
    for (uint i = 0u; i < 4u; i++) {
        const uint gr = row0 + 4u * rg + i;
        const uint q = row_base(q_start, kv_head, gr);
        if (gr >= row_end || q + hs > out_elems) continue;
        const uint q_out = pitched(q, pc.out_pitch);
        // A row that sees no key gives zeros; the sink (a variant) joins the denominator and the lse.
        const vec2 fin = softmax_finish(m[i], l[i], sink_logit(heads[i]));
        const mat4 o = (i == 0u ? o0 : i == 1u ? o1 : i == 2u ? o2 : o3) * (fin.x * pc.v_scale);
        for (uint j = 0u; j < 4u; j++) {
            if (cols[j] >= hq) break;
            const uint at = (q_out + 4u * cols[j]) >> 1;
            STORE_OUT_PAIR(out_, at, o[j].xy)
            STORE_OUT_PAIR(out_, at + 1u, o[j].zw)
        }
        if (cg == 0u && q / hs < uint(lse.length())) lse[q / hs] = fin.y;
    }
}
