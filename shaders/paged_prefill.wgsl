// Paged-attention prefill forward, WGSL: shaders/paged_prefill.comp translated statement for statement,
// with the same interface (PAGED_PREFILL in pagedvk/abi.py). The algorithm (tiles of 8 to 64 rows, keys and
// values staged in shared memory, 4 x 4 register blocks), the cache addressing by strides and the bounds
// rules are explained in the GLSL sources (paged_prefill.comp and attention_common.glsl). build_shaders.py
// pastes the module's storage files (kv_<type>.wgsl, q_<type>.wgsl), its cache access (kv_bound.wgsl or
// kv_segmented.wgsl) and the common parts.

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include attention_variants.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl
//!include prefill_tiles.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;            // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;       // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;     // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;       // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;           // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;    // [seqs + 1]
@group(0) @binding(6) var<storage, read> tiles: array<i32>;              // [tiles, 2]
@group(0) @binding(7) var<storage, read_write> out: array<OutPair>;      // like query
@group(0) @binding(8) var<storage, read_write> lse: array<f32>;          // [tokens, heads]
@group(0) @binding(9) var<storage, read> alibi_slopes: array<f32>;     // [heads] (VARIANT_ALIBI)
@group(0) @binding(10) var<storage, read> sinks: array<f32>;           // [heads] (VARIANT_SINKS)
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;  // the first of a segmented cache's extra bindings (pagedvk/abi.py)

// Shared memory in vec4s, as paged_prefill.comp lays it out: query and key chunks, then P, row reductions
// and the value sub-tile.
const S_MEM: u32 = 1008u;
const P_QUADS: u32 = 512u;
const V_QUADS: u32 = 496u;           // S_MEM - P_QUADS
const MAX_TILE_BLOCKS: u32 = 32u;    // 256 keys / MIN_BLOCK_SIZE
const NO_ROW: u32 = 0xffffffffu;

var<workgroup> s_mem: array<vec4<f32>, S_MEM>;
var<workgroup> s_phys: array<i32, MAX_TILE_BLOCKS>;

// Max (or sum) of v over the g_count threads of each row group, through s_mem at P_QUADS.
fn row_group_reduce(v: vec4<f32>, rg: u32, cg: u32, row_groups: u32, g_count: u32, take_max: bool) -> vec4<f32> {
    s_mem[P_QUADS + cg * row_groups + rg] = v;
    workgroupBarrier();
    var w = select(vec4<f32>(0.0), vec4<f32>(neg_inf()), take_max);
    for (var g = 0u; g < g_count; g++) {
        let x = s_mem[P_QUADS + g * row_groups + rg];
        w = select(w + x, max(w, x), take_max);
    }
    workgroupBarrier();
    return w;
}

fn key_logits(dots: vec4<f32>, k: u32, tile_len: u32, base: u32, heads: vec4<u32>, qpos: vec4<u32>,
              keys: vec4<u32>) -> vec4<f32> {
    let seen = select(vec4<u32>(0u), keys, tile_phys(k, tile_len) >= 0);
    return logits4(dots * pc.scale, heads, base + k, qpos, seen);
}

fn weights(x: vec4<f32>, m: vec4<f32>) -> vec4<f32> {
    return select(exp(x - m), vec4<f32>(0.0), x == vec4<f32>(neg_inf()));
}

// Whether row gr of the sequence is there: before row_end and inside the query buffer.
fn row_valid(q_start: u32, kv_head: u32, gr: u32, row_end: u32) -> bool {
    return gr < row_end && row_base(q_start, kv_head, gr) + pc.head_size <= arrayLength(&query) * 4u;
}

// The physical block of key k of the tile (-1: none, or past the tile).
fn tile_phys(k: u32, tile_len: u32) -> i32 {
    if (k < tile_len) {
        return s_phys[k / pc.block_size];
    }
    return -1;
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = pc.head_size;
    let hq = hs / 4u;                    // head quads
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    if (work.w == 0u || hs > MAX_HEAD_SIZE || hq == 0u) {
        return;
    }
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    let query_elems = arrayLength(&query) * 4u;
    let queries = sequence_queries(seq, query_elems / (hs * pc.num_heads));
    let q_start = queries.x;
    let q_len = queries.y;
    let rows = group * q_len;
    if (row0 >= rows) {
        return;
    }
    let n_rows = tile_rows(rows, hs);
    let row_groups = n_rows / 4u;
    let g_count = WG / row_groups;       // threads per row group
    let kt = 4u * g_count;               // keys per tile
    let cq = min(8u, 512u / kt);         // head quads per staged chunk
    let qk_stride = cq + 1u;
    let rg = tid / g_count;
    let cg = tid % g_count;
    let row_end = min(row0 + n_rows, rows);
    if (row_base(q_start, kv_head, row0) + hs > query_elems) {
        return;
    }

    let num_blocks = pc.num_blocks;   // see attention_common.glsl
    let bt_row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(bt_row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    // Rows are query-major, so the last row sees the most keys.
    let kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // This thread's rows 4rg .. 4rg+3: keys seen, query head, sequence position.
    var keys = vec4<u32>(0u);
    var heads = vec4<u32>(0u);
    var qpos = vec4<u32>(0u);
    for (var i = 0u; i < 4u; i++) {
        let gr = row0 + 4u * rg + i;
        keys[i] = select(0u, visible_keys(gr / group, q_len, seq_len), row_valid(q_start, kv_head, gr, row_end));
        heads[i] = kv_head * group + gr % group;
        qpos[i] = query_position(gr / group, q_len, seq_len);
    }
    let cols = vec4<u32>(cg) + g_count * vec4<u32>(0u, 1u, 2u, 3u);
    let vcols = min(cols, vec4<u32>(hq - 1u));
    let k_off = n_rows * qk_stride;
    let vk = min(kt, (V_QUADS / hq) & ~3u);
    let ninf4 = vec4<f32>(neg_inf());
    let bs_log2 = firstLeadingBit(bs);

    // What this thread stages, worked out once (paged_prefill.comp explains).
    let cl = tid & (cq - 1u);
    let lane_row = tid >> firstLeadingBit(cq);
    let row_step = WG / cq;
    let dims_contiguous = pc.v_dim_stride == 1u;
    var q_src = vec4<u32>(NO_ROW);
    var v_k = vec4<u32>(0u);
    var v_c = vec4<u32>(0u);
    for (var n = 0u; n < 4u; n++) {
        let r = lane_row + n * row_step;
        if (r < n_rows && row_valid(q_start, kv_head, row0 + r, row_end)) {
            q_src[n] = row_base(q_start, kv_head, row0 + r) / 4u + cl;
        }
        let i = tid + WG * n;
        v_k[n] = select(4u * (i / hs), i / hq, dims_contiguous);
        v_c[n] = select(i % hs, i % hq, dims_contiguous);
    }

    var m = ninf4;
    var l = vec4<f32>(0.0);
    var o0 = mat4x4<f32>();
    var o1 = mat4x4<f32>();
    var o2 = mat4x4<f32>();
    var o3 = mat4x4<f32>();

    let kv_start = min(window_first_key(query_position(row0 / group, q_len, seq_len)), kv_end) & ~(bs - 1u);
    for (var base = kv_start; base < kv_end; base += kt) {
        let tile_len = min(kt, kv_end - base);
        let tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            let b = block_tables[bt_row + base / bs + tid];
            s_phys[tid] = select(-1, b, b >= 0 && u32(b) < num_blocks);
        }
        workgroupBarrier();

        // S: logits a chunk of head dims at a time; keys outside the cache or past the tile staged as zeros.
        var k_phys = vec4<i32>(-1);
        var k_tok = vec4<u32>(0u);
        for (var n = 0u; n < 4u; n++) {
            let k = lane_row + n * row_step;
            if (k < tile_len) {
                k_phys[n] = s_phys[k >> bs_log2];
            }
            k_tok[n] = key_offset(kv_head, k & (bs - 1u), 0u);
        }
        var st = mat4x4<f32>();
        for (var c0 = 0u; c0 < hq; c0 += cq) {
            let in_head = c0 + cl < hq;
            for (var n = 0u; n < 4u; n++) {
                let r = lane_row + n * row_step;
                if (r >= n_rows) {
                    break;
                }
                var q = vec4<f32>(0.0);
                if (q_src[n] != NO_ROW && in_head) {
                    q = q_quad(query[q_src[n] + c0]);
                }
                s_mem[r * qk_stride + cl] = q;
            }
            for (var n = 0u; n < 4u; n++) {
                let k = lane_row + n * row_step;
                if (k >= kt) {
                    break;
                }
                var kq = vec4<f32>(0.0);
                if (k_phys[n] >= 0 && in_head) {
                    kq = kv_quad(key_load(u32(k_phys[n]), k_tok[n] + key_offset(0u, 0u, c0 + cl)));
                }
                s_mem[k_off + k * qk_stride + cl] = kq;
            }
            workgroupBarrier();
            let n = min(cq, hq - c0);
            for (var c = 0u; c < n; c++) {
                let qr = 4u * rg * qk_stride + c;
                let kr = k_off + cg * qk_stride + c;
                let q = mat4x4<f32>(s_mem[qr], s_mem[qr + qk_stride], s_mem[qr + 2u * qk_stride],
                                    s_mem[qr + 3u * qk_stride]);
                st[0] += s_mem[kr] * q;
                st[1] += s_mem[kr + g_count * qk_stride] * q;
                st[2] += s_mem[kr + 2u * g_count * qk_stride] * q;
                st[3] += s_mem[kr + 3u * g_count * qk_stride] * q;
            }
            workgroupBarrier();
        }
        // The logit hooks, -inf where masked; written out so that st stays in registers.
        st[0] = key_logits(st[0], cols.x, tile_len, base, heads, qpos, keys);
        st[1] = key_logits(st[1], cols.y, tile_len, base, heads, qpos, keys);
        st[2] = key_logits(st[2], cols.z, tile_len, base, heads, qpos, keys);
        st[3] = key_logits(st[3], cols.w, tile_len, base, heads, qpos, keys);

        // Online softmax across tiles, per row.
        let m_new = max(m, row_group_reduce(max(max(st[0], st[1]), max(st[2], st[3])), rg, cg, row_groups, g_count,
                                            true));
        let alpha = select(exp(m - m_new), vec4<f32>(1.0), m_new == ninf4);
        m = m_new;
        l *= alpha;
        o0 *= alpha.x;
        o1 *= alpha.y;
        o2 *= alpha.z;
        o3 *= alpha.w;
        let p0 = weights(st[0], m);
        let p1 = weights(st[1], m);
        let p2 = weights(st[2], m);
        let p3 = weights(st[3], m);
        l += p0 + p1 + p2 + p3;
        s_mem[cols.x * row_groups + rg] = p0;
        s_mem[cols.y * row_groups + rg] = p1;
        s_mem[cols.z * row_groups + rg] = p2;
        s_mem[cols.w * row_groups + rg] = p3;
        workgroupBarrier();

        // PV: the values vk keys at a time, along the cache's contiguous axis.
        for (var sub = 0u; sub < tile_len; sub += vk) {
            for (var n = 0u; n < 4u; n++) {
                if (tid + WG * n >= vk * hq) {
                    break;
                }
                let k = sub + v_k[n];
                var phys = -1;
                if (k < tile_len) {
                    phys = s_phys[k >> bs_log2];
                }
                let d = select(v_c[n], 4u * v_c[n], dims_contiguous);
                var v = vec4<f32>(0.0);
                if (phys >= 0) {
                    v = kv_quad(value_load(u32(phys), value_offset(kv_head, k & (bs - 1u), d) >> 2u));
                }
                if (dims_contiguous) {
                    s_mem[P_QUADS + tid + WG * n] = v;
                } else {
                    let at = P_QUADS + v_k[n] * hq + (d >> 2u);
                    for (var e = 0u; e < 4u; e++) {
                        s_mem[at + e * hq][d & 3u] = select(0.0, v[e], k + e < tile_len);
                    }
                }
            }
            workgroupBarrier();
            let n = min(vk, tile_len - sub);
            for (var k = 0u; k < n; k++) {
                let p = s_mem[(sub + k) * row_groups + rg];
                let vr = P_QUADS + k * hq;
                let v = mat4x4<f32>(s_mem[vr + vcols.x], s_mem[vr + vcols.y], s_mem[vr + vcols.z], s_mem[vr + vcols.w]);
                o0 += p.x * v;
                o1 += p.y * v;
                o2 += p.z * v;
                o3 += p.w * v;
            }
            workgroupBarrier();   // s_mem and s_phys are rewritten next
        }
    }

    // Each row's denominator, summed over its row group once at the end.
    l = row_group_reduce(l, rg, cg, row_groups, g_count, false);
    for (var i = 0u; i < 4u; i++) {
        let gr = row0 + 4u * rg + i;
        let q = row_base(q_start, kv_head, gr);
        if (gr >= row_end || q + hs > 2u * arrayLength(&out)) {
            continue;
        }
        // A row that sees no key gives zeros; the sink (a variant) joins the denominator and the lse.
        let fin = softmax_finish(m[i], l[i], sink_logit(heads[i]));
        var o = o3;
        if (i == 0u) {
            o = o0;
        } else if (i == 1u) {
            o = o1;
        } else if (i == 2u) {
            o = o2;
        }
        o *= fin.x * pc.v_scale;
        for (var j = 0u; j < 4u; j++) {
            if (cols[j] >= hq) {
                break;
            }
            let at = (q + 4u * cols[j]) >> 1u;
            out[at] = out_pair(o[j].xy);
            out[at + 1u] = out_pair(o[j].zw);
        }
        if (cg == 0u && q / hs < arrayLength(&lse)) {
            lse[q / hs] = fin.y;
        }
    }
}
