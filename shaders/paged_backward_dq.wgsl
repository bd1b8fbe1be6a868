// Paged-attention backward, the query gradient, WGSL: shaders/paged_backward_dq.comp translated
// statement for statement, with the same interface (PAGED_BACKWARD_DQ in pagedvk/abi.py). The algorithm
// (the forward's tiles, logits and dP as 4 x 4 register blocks, dS staged in shared memory, dq as rows by head
// quads) is explained there and in paged_prefill.comp; build_shaders.py pastes the storage files, the cache
// access and the common parts. query and dout are of the type pc.q_type names, bound as 32-bit words
// (q_any.wgsl); dq is float32.

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include q_rows.wgsl
//!include attention_common.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl
//!include prefill_tiles.wgsl

@group(0) @binding(0) var<storage, read> query: array<u32>;             // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;      // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;    // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;       // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;           // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;   // [seqs + 1]
@group(0) @binding(6) var<storage, read> tiles: array<i32>;             // [tiles, 2]
@group(0) @binding(7) var<storage, read> dout: array<u32>;              // like query
@group(0) @binding(8) var<storage, read> delta: array<f32>;             // like lse: D of each row
@group(0) @binding(9) var<storage, read> lse: array<f32>;                // [tokens, heads]
@group(0) @binding(10) var<storage, read_write> dq: array<f32>;          // like query
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

// Shared memory in vec4s, as paged_backward_dq.comp lays it out: query (dout) and key (value) chunks, then dS
// and the key sub-tile.
const S_MEM: u32 = 1008u;
const DS_QUADS: u32 = 512u;
const K_QUADS: u32 = 496u;           // S_MEM - DS_QUADS
// A tile's block ids, staged where blocks hold STAGED_BLOCK_SIZE tokens or more; smaller blocks' are read from the
// table where used (as prefill_common.glsl's TILE_BLOCK_IDS does, and for the same reason).
const STAGED_BLOCK_SIZE: u32 = 8u;
const MAX_TILE_BLOCKS: u32 = 32u;    // 256 keys / STAGED_BLOCK_SIZE
const NO_ROW: u32 = 0xffffffffu;

var<workgroup> s_mem: array<vec4<f32>, S_MEM>;
var<workgroup> s_phys: array<i32, MAX_TILE_BLOCKS>;

// Entry i of block_tables, -1 where it names no block of the caches.
fn table_block(i: u32) -> i32 {
    let b = block_tables[i];
    return select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
}

// The physical block of key k of the tile at key `base` of the sequence whose table row starts at bt_row.
fn tile_block(bt_row: u32, base: u32, k: u32) -> i32 {
    let bs_log2 = firstLeadingBit(pc.block_size);
    if (pc.block_size >= STAGED_BLOCK_SIZE) {
        return s_phys[k >> bs_log2];
    }
    return table_block(bt_row + ((base + k) >> bs_log2));
}

// Key (phase 0) or value (phase 1) quad c of token t of block b.
fn key_quad(phase: u32, b: u32, h: u32, t: u32, c: u32) -> vec4<f32> {
    if (phase == 0u) {
        return kv_quad(key_load(b, key_offset(h, t, c)));
    }
    return value_quad(b, h, t, c);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = pc.head_size;
    let hq = hs / 4u;
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    if (work.w == 0u || hs > MAX_HEAD_SIZE || hq == 0u) {
        return;
    }
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    let row_floats = min(q_quads(arrayLength(&query)), q_quads(arrayLength(&dout))) * 4u;
    let queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
    let q_start = queries.x;
    let q_len = queries.y;
    let rows = group * q_len;
    if (row0 >= rows) {
        return;
    }
    let n_rows = tile_rows(rows, hs);
    let row_groups = n_rows / 4u;
    let g_count = WG / row_groups;
    let kt = 4u * g_count;
    let cq = min(8u, 512u / kt);
    let qk_stride = cq + 1u;
    let rg = tid / g_count;
    let cg = tid % g_count;
    let row_end = min(row0 + n_rows, rows);
    if (row_base(q_start, kv_head, row0) + hs > row_floats) {
        return;
    }

    let bt_row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(bt_row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // This thread's rows: keys seen (0 past the end or a buffer), lse and D (paged_backward_delta.wgsl's).
    var keys = vec4<u32>(0u);
    var row_lse = vec4<f32>(0.0);
    var row_delta = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let gr = row0 + 4u * rg + i;
        let q = row_base(q_start, kv_head, gr);
        if (gr < row_end && q + hs <= row_floats && q / hs < min(arrayLength(&lse), arrayLength(&delta))) {
            keys[i] = visible_keys(gr / group, q_len, seq_len);
            row_lse[i] = lse[q / hs];
            row_delta[i] = delta[q / hs];
        }
    }

    let cols = vec4<u32>(cg) + g_count * vec4<u32>(0u, 1u, 2u, 3u);   // keys of S, head quads of C
    let kcols = min(cols, vec4<u32>(hq - 1u));
    let k_off = n_rows * qk_stride;
    let vk = min(kt, K_QUADS / hq);

    // What this thread stages (paged_backward_dq.comp explains).
    let cl = tid & (cq - 1u);
    let lane_row = tid >> firstLeadingBit(cq);
    let row_step = WG / cq;
    var q_src = vec4<u32>(NO_ROW);
    var k_k = vec4<u32>(0u);
    var k_c = vec4<u32>(0u);
    for (var n = 0u; n < 4u; n++) {
        let r = lane_row + n * row_step;
        let q = row_base(q_start, kv_head, row0 + r);
        if (r < n_rows && row0 + r < row_end && q + hs <= row_floats) {
            q_src[n] = q / 4u + cl;
        }
        k_k[n] = (tid + WG * n) / hq;
        k_c[n] = (tid + WG * n) % hq;
    }

    var dq0 = mat4x4<f32>();
    var dq1 = mat4x4<f32>();
    var dq2 = mat4x4<f32>();
    var dq3 = mat4x4<f32>();

    for (var base = 0u; base < kv_end; base += kt) {
        let tile_len = min(kt, kv_end - base);
        if (bs >= STAGED_BLOCK_SIZE && tid < (tile_len + bs - 1u) / bs) {
            s_phys[tid] = table_block(bt_row + base / bs + tid);
        }
        workgroupBarrier();

        // S: phase 0 the logits' dot products, phase 1 dP.
        var k_phys = vec4<i32>(-1);
        for (var n = 0u; n < 4u; n++) {
            let k = lane_row + n * row_step;
            if (k < tile_len) {
                k_phys[n] = tile_block(bt_row, base, k);
            }
        }
        var st = mat4x4<f32>();
        var dp = mat4x4<f32>();
        for (var phase = 0u; phase < 2u; phase++) {
            var acc = mat4x4<f32>();
            for (var c0 = 0u; c0 < hq; c0 += cq) {
                let in_head = c0 + cl < hq;
                for (var n = 0u; n < 4u; n++) {
                    let r = lane_row + n * row_step;
                    if (r >= n_rows) {
                        break;
                    }
                    var x = vec4<f32>(0.0);
                    if (q_src[n] != NO_ROW && in_head) {
                        x = row_quad(phase, q_src[n] + c0);
                    }
                    s_mem[r * qk_stride + cl] = x;
                }
                for (var n = 0u; n < 4u; n++) {
                    let k = lane_row + n * row_step;
                    if (k >= kt) {
                        break;
                    }
                    var x = vec4<f32>(0.0);
                    if (k_phys[n] >= 0 && in_head) {
                        x = key_quad(phase, u32(k_phys[n]), kv_head, k & (bs - 1u), c0 + cl);
                    }
                    s_mem[k_off + k * qk_stride + cl] = x;
                }
                workgroupBarrier();
                let n = min(cq, hq - c0);
                for (var c = 0u; c < n; c++) {
                    let qr = 4u * rg * qk_stride + c;
                    let kr = k_off + cg * qk_stride + c;
                    let q = mat4x4<f32>(s_mem[qr], s_mem[qr + qk_stride], s_mem[qr + 2u * qk_stride],
                                        s_mem[qr + 3u * qk_stride]);
                    acc[0] += s_mem[kr] * q;
                    acc[1] += s_mem[kr + g_count * qk_stride] * q;
                    acc[2] += s_mem[kr + 2u * g_count * qk_stride] * q;
                    acc[3] += s_mem[kr + 3u * g_count * qk_stride] * q;
                }
                workgroupBarrier();
            }
            if (phase == 0u) {
                st = acc;
            } else {
                dp = acc;
            }
        }
        // dS of key cols[j] for the rows, 0 where a row does not see the key.
        for (var j = 0u; j < 4u; j++) {
            let k = cols[j];
            var seen_by = vec4<u32>(0u);
            if (k < tile_len && tile_block(bt_row, base, k) >= 0) {
                seen_by = keys;
            }
            let ds = exp(st[j] * pc.scale - row_lse) * (dp[j] - row_delta);
            s_mem[k * row_groups + rg] = select(vec4<f32>(0.0), ds, vec4<u32>(base + k) < seen_by);
        }
        workgroupBarrier();

        // C: dS times the keys, vk keys at a time.
        for (var sub = 0u; sub < tile_len; sub += vk) {
            for (var n = 0u; n < 4u; n++) {
                if (tid + WG * n >= vk * hq) {
                    break;
                }
                let k = sub + k_k[n];
                var x = vec4<f32>(0.0);
                if (k < tile_len) {
                    let phys = tile_block(bt_row, base, k);
                    if (phys >= 0) {
                        x = kv_quad(key_load(u32(phys), key_offset(kv_head, k & (bs - 1u), k_c[n])));
                    }
                }
                s_mem[DS_QUADS + tid + WG * n] = x;
            }
            workgroupBarrier();
            let n = min(vk, tile_len - sub);
            for (var k = 0u; k < n; k++) {
                let ds = s_mem[(sub + k) * row_groups + rg];
                let kr = DS_QUADS + k * hq;
                let kq = mat4x4<f32>(s_mem[kr + kcols.x], s_mem[kr + kcols.y], s_mem[kr + kcols.z], s_mem[kr + kcols.w]);
                dq0 += ds.x * kq;
                dq1 += ds.y * kq;
                dq2 += ds.z * kq;
                dq3 += ds.w * kq;
            }
            workgroupBarrier();   // s_mem and s_phys are rewritten next
        }
    }

    for (var i = 0u; i < 4u; i++) {
        let gr = row0 + 4u * rg + i;
        let q = row_base(q_start, kv_head, gr);
        if (gr >= row_end || q + hs > arrayLength(&dq)) {
            continue;
        }
        var d = dq3;
        if (i == 0u) {
            d = dq0;
        } else if (i == 1u) {
            d = dq1;
        } else if (i == 2u) {
            d = dq2;
        }
        d *= pc.scale;
        for (var j = 0u; j < 4u; j++) {
            if (cols[j] >= hq) {
                break;
            }
            for (var e = 0u; e < 4u; e++) {
                dq[q + 4u * cols[j] + e] = d[j][e];
            }
        }
    }
}
