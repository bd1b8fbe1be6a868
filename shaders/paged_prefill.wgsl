// Paged-attention prefill forward, WGSL: shaders/paged_prefill.comp translated statement for statement,
// with the same interface (PAGED_PREFILL in pagedvk/abi.py). The algorithm, the cache addressing by
// strides and the bounds rules are explained in the GLSL sources (paged_prefill.comp and
// attention_common.glsl). build_shaders.py pastes the module's storage files (kv_<type>.wgsl,
// q_<type>.wgsl), its cache access (kv_bound.wgsl or kv_segmented.wgsl) and the common parts.

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

const ROWS: u32 = 8u;               // as two vec4s: rows 0-3 (_a) and 4-7 (_b)
const TILE: u32 = 128u;             // == WG
const LANES: u32 = 16u;             // WG / ROWS
const MAX_TILE_BLOCKS: u32 = 16u;   // TILE / MIN_BLOCK_SIZE

var<workgroup> s_p: array<vec4<f32>, 256>;   // TILE * 2: [token][rows 0-3 | rows 4-7], logits then weights
var<workgroup> s_red: array<f32, WG>;
var<workgroup> s_row: array<f32, ROWS>;
var<workgroup> s_m: array<f32, ROWS>;
var<workgroup> s_alpha: array<f32, ROWS>;
var<workgroup> s_phys: array<i32, MAX_TILE_BLOCKS>;

fn row_reduce(take_max: bool, tid: u32) {
    let r = tid / LANES;
    let lane = tid % LANES;
    var v = select(0.0, neg_inf(), take_max);
    for (var t = lane; t < TILE; t += LANES) {
        let x = s_p[t * 2u + r / 4u][r % 4u];
        v = select(v + x, max(v, x), take_max);
    }
    s_red[tid] = v;
    workgroupBarrier();
    if (tid < ROWS) {
        var w = select(0.0, neg_inf(), take_max);
        for (var i = 0u; i < LANES; i++) {
            let x = s_red[tid * LANES + i];
            w = select(w + x, max(w, x), take_max);
        }
        s_row[tid] = w;
    }
    workgroupBarrier();
}

fn Q(i: u32) -> vec4<f32> {   // query quad i
    return q_quad(query[i]);
}

fn m4(first: u32) -> vec4<f32> {
    return vec4<f32>(s_m[first], s_m[first + 1u], s_m[first + 2u], s_m[first + 3u]);
}

fn alpha4(first: u32) -> vec4<f32> {
    return vec4<f32>(s_alpha[first], s_alpha[first + 1u], s_alpha[first + 2u], s_alpha[first + 3u]);
}

// Keys row gr sees; 0 for rows past the end (or past the query buffer).
fn row_keys(q_start: u32, q_len: u32, kv_head: u32, gr: u32, row_end: u32, seq_len: u32) -> u32 {
    let group = pc.num_heads / pc.num_kv_heads;
    let valid = gr < row_end && row_base(q_start, kv_head, gr) + pc.head_size <= arrayLength(&query) * 4u;
    return select(0u, visible_keys(gr / group, q_len, seq_len), valid);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = pc.head_size;
    let hc = hs / 4u;                    // head quads
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    if (work.w == 0u || hs > MAX_HEAD_SIZE) {
        return;
    }
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    let queries = sequence_queries(seq, arrayLength(&query) * 4u / (hs * pc.num_heads));
    let q_start = queries.x;
    let q_len = queries.y;
    let rows = group * q_len;
    if (row0 >= rows) {
        return;
    }
    let row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > arrayLength(&query) * 4u) {
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

    let keys_a = vec4<u32>(row_keys(q_start, q_len, kv_head, row0, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 1u, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 2u, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 3u, row_end, seq_len));
    let keys_b = vec4<u32>(row_keys(q_start, q_len, kv_head, row0 + 4u, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 5u, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 6u, row_end, seq_len),
                           row_keys(q_start, q_len, kv_head, row0 + 7u, row_end, seq_len));
    // Each row's query head and sequence position, for the logit hooks.
    var head_a = vec4<u32>(0u);
    var head_b = vec4<u32>(0u);
    var qpos_a = vec4<u32>(0u);
    var qpos_b = vec4<u32>(0u);
    for (var r = 0u; r < 4u; r++) {
        head_a[r] = kv_head * group + (row0 + r) % group;
        head_b[r] = kv_head * group + (row0 + 4u + r) % group;
        qpos_a[r] = query_position((row0 + r) / group, q_len, seq_len);
        qpos_b[r] = query_position((row0 + 4u + r) / group, q_len, seq_len);
    }
    // Each row's first query quad; rows that see nothing read row 0's (in bounds) and are masked.
    var qb_a = vec4<u32>(0u);
    var qb_b = vec4<u32>(0u);
    for (var r = 0u; r < 4u; r++) {
        qb_a[r] = row_base(q_start, kv_head, select(row0, row0 + r, keys_a[r] > 0u)) / 4u;
        qb_b[r] = row_base(q_start, kv_head, select(row0, row0 + 4u + r, keys_b[r] > 0u)) / 4u;
    }
    if (tid < ROWS) {
        s_m[tid] = neg_inf();
    }

    var l_a = vec4<f32>(0.0);    // this thread's share of each row's softmax denominator
    var l_b = vec4<f32>(0.0);
    var o0_a = vec4<f32>(0.0);   // weighted values of head dim d0, per row
    var o0_b = vec4<f32>(0.0);
    var o1_a = vec4<f32>(0.0);   // and of head dim d1
    var o1_b = vec4<f32>(0.0);
    let d0 = 2u * tid;           // this thread's head dims
    let ninf4 = vec4<f32>(neg_inf());

    // Variant: tiles start at the block of the first key the sliding window lets the first row see.
    let kv_start = min(window_first_key(query_position(row0 / group, q_len, seq_len)), kv_end) & ~(bs - 1u);
    for (var base = kv_start; base < kv_end; base += TILE) {
        let tile_len = min(TILE, kv_end - base);
        let tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            let b = block_tables[bt_row + base / bs + tid];
            s_phys[tid] = select(-1, b, b >= 0 && u32(b) < num_blocks);
        }
        workgroupBarrier();

        // A: token base + tid's logit for every row, -inf where masked.
        let token = base + tid;
        var phys = -1;
        if (tid < tile_len) {
            phys = s_phys[tid / bs];
        }
        var x_a = vec4<f32>(0.0);
        var x_b = vec4<f32>(0.0);
        if (phys >= 0) {
            for (var c = 0u; c < hc; c++) {
                let k = kv_quad(key_load(u32(phys), key_offset(kv_head, token % bs, c)));
                x_a += vec4<f32>(dot(k, Q(qb_a.x + c)), dot(k, Q(qb_a.y + c)), dot(k, Q(qb_a.z + c)),
                                 dot(k, Q(qb_a.w + c)));
                x_b += vec4<f32>(dot(k, Q(qb_b.x + c)), dot(k, Q(qb_b.y + c)), dot(k, Q(qb_b.z + c)),
                                 dot(k, Q(qb_b.w + c)));
            }
        }
        // A token outside the cache is visible to no row.
        x_a = logits4(x_a * pc.scale, head_a, token, qpos_a, select(vec4<u32>(0u), keys_a, phys >= 0));
        x_b = logits4(x_b * pc.scale, head_b, token, qpos_b, select(vec4<u32>(0u), keys_b, phys >= 0));
        s_p[tid * 2u] = x_a;
        s_p[tid * 2u + 1u] = x_b;
        workgroupBarrier();

        // B: online softmax across tiles, per row.
        row_reduce(true, tid);
        if (tid < ROWS) {
            let m_old = s_m[tid];
            let m_new = max(m_old, s_row[tid]);
            s_alpha[tid] = select(exp(m_old - m_new), 1.0, m_new == neg_inf());
            s_m[tid] = m_new;
        }
        workgroupBarrier();
        let alpha_a = alpha4(0u);
        let alpha_b = alpha4(4u);
        let p_a = select(exp(x_a - m4(0u)), vec4<f32>(0.0), x_a == ninf4);
        let p_b = select(exp(x_b - m4(4u)), vec4<f32>(0.0), x_b == ninf4);
        l_a = l_a * alpha_a + p_a;
        l_b = l_b * alpha_b + p_b;
        o0_a *= alpha_a;
        o0_b *= alpha_b;
        o1_a *= alpha_a;
        o1_b *= alpha_b;
        s_p[tid * 2u] = p_a;
        s_p[tid * 2u + 1u] = p_b;
        workgroupBarrier();

        // C: weighted values of this thread's head dims; tokens past kv_end are never read.
        for (var t = 0u; t < tile_len; t++) {
            let b = s_phys[t / bs];
            if (b < 0) {
                continue;
            }
            if (d0 >= hs) {
                break;   // threads past the head have no dims
            }
            let v = value_offset(kv_head, (base + t) % bs, d0);
            let v0 = value_at(u32(b), v);
            let v1 = value_at(u32(b), v + pc.v_dim_stride);
            let w_a = s_p[t * 2u];
            let w_b = s_p[t * 2u + 1u];
            o0_a += w_a * v0;
            o0_b += w_b * v0;
            o1_a += w_a * v1;
            o1_b += w_b * v1;
        }
        workgroupBarrier();   // s_p and s_phys are rewritten by the next tile
    }

    // Each row's denominator, summed over the threads once at the end.
    s_p[tid * 2u] = l_a;
    s_p[tid * 2u + 1u] = l_b;
    workgroupBarrier();
    row_reduce(false, tid);
    for (var r = 0u; r < ROWS; r++) {
        let q = row_base(q_start, kv_head, row0 + r);
        if (row0 + r >= row_end || q + hs > 2u * arrayLength(&out)) {
            continue;
        }
        // A row that sees no key gives zeros; the sink (a variant) joins the denominator and the lse.
        let lo = r < 4u;
        let fin = softmax_finish(s_m[r], s_row[r], sink_logit(select(head_b[r % 4u], head_a[r % 4u], lo)));
        let o = vec2<f32>(select(o0_b[r % 4u], o0_a[r % 4u], lo), select(o1_b[r % 4u], o1_a[r % 4u], lo))
            * (fin.x * pc.v_scale);
        if (d0 < hs) {
            out[(q + d0) >> 1u] = out_pair(o);
        }
        if (tid == 0u && q / hs < arrayLength(&lse)) {
            lse[q / hs] = fin.y;
        }
    }
}
