// Paged-attention backward, the query gradient, WGSL: shaders/paged_backward_dq.comp translated
// statement for statement, with the same interface (PAGED_BACKWARD_DQ in pagedvk/abi.py). The algorithm
// is explained there and in attention_common.glsl; build_shaders.py pastes the storage files, the cache
// access and the common parts.

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl
//!include prefill_tiles.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;           // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;      // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;    // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;       // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;           // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;   // [seqs + 1]
@group(0) @binding(6) var<storage, read> tiles: array<i32>;             // [tiles, 2]
@group(0) @binding(7) var<storage, read> dout: array<QQuad>;            // like query
@group(0) @binding(8) var<storage, read> out: array<QQuad>;             // like query
@group(0) @binding(9) var<storage, read> lse: array<f32>;                // [tokens, heads]
@group(0) @binding(10) var<storage, read_write> dq: array<f32>;          // like query
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

const ROWS: u32 = 8u;               // as two vec4s: rows 0-3 (_a) and 4-7 (_b)
const TILE: u32 = 128u;             // == WG
const MAX_TILE_BLOCKS: u32 = 16u;   // TILE / MIN_BLOCK_SIZE

var<workgroup> s_ds: array<vec4<f32>, 256>;   // TILE * 2: [token][rows 0-3 | rows 4-7], dS
var<workgroup> s_phys: array<i32, MAX_TILE_BLOCKS>;

fn Q(i: u32) -> vec4<f32> {    // quad i of query, dout, out
    return q_quad(query[i]);
}

fn DO(i: u32) -> vec4<f32> {
    return q_quad(dout[i]);
}

fn O(i: u32) -> vec4<f32> {
    return q_quad(out[i]);
}

fn dots(x: vec4<f32>, rows: vec4<u32>) -> vec4<f32> {        // x . query quad of four rows
    return vec4<f32>(dot(x, Q(rows.x)), dot(x, Q(rows.y)), dot(x, Q(rows.z)), dot(x, Q(rows.w)));
}

fn dout_dots(x: vec4<f32>, rows: vec4<u32>) -> vec4<f32> {   // x . dout quad of four rows
    return vec4<f32>(dot(x, DO(rows.x)), dot(x, DO(rows.y)), dot(x, DO(rows.z)), dot(x, DO(rows.w)));
}

fn delta_terms(rows: vec4<u32>) -> vec4<f32> {   // out . dout quad of four rows, operands in dout_dots' order
    return vec4<f32>(dot(O(rows.x), DO(rows.x)), dot(O(rows.y), DO(rows.y)), dot(O(rows.z), DO(rows.z)),
                     dot(O(rows.w), DO(rows.w)));
}

// Keys row gr sees (0 past the end or past a buffer).
fn row_keys(q_start: u32, q_len: u32, kv_head: u32, gr: u32, row_end: u32, seq_len: u32, row_floats: u32) -> u32 {
    let group = pc.num_heads / pc.num_kv_heads;
    let q = row_base(q_start, kv_head, gr);
    let valid = gr < row_end && q + pc.head_size <= row_floats && q / pc.head_size < arrayLength(&lse);
    return select(0u, visible_keys(gr / group, q_len, seq_len), valid);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = pc.head_size;
    let hc = hs / 4u;
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    if (work.w == 0u || hs > MAX_HEAD_SIZE) {
        return;
    }
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    let row_floats = min(min(arrayLength(&query), arrayLength(&dout)), arrayLength(&out)) * 4u;
    let queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
    let q_start = queries.x;
    let q_len = queries.y;
    let rows = group * q_len;
    if (row0 >= rows) {
        return;
    }
    let row_end = min(row0 + ROWS, rows);
    if (row_base(q_start, kv_head, row0) + hs > row_floats) {
        return;
    }

    let num_blocks = pc.num_blocks;   // see attention_common.glsl
    let bt_row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(bt_row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    // Keys each row sees, its first chunk (row 0's where it sees none) and its lse.
    var keys_a = vec4<u32>(0u);
    var keys_b = vec4<u32>(0u);
    var qb_a = vec4<u32>(0u);
    var qb_b = vec4<u32>(0u);
    var lse_a = vec4<f32>(0.0);
    var lse_b = vec4<f32>(0.0);
    for (var r = 0u; r < 4u; r++) {
        keys_a[r] = row_keys(q_start, q_len, kv_head, row0 + r, row_end, seq_len, row_floats);
        keys_b[r] = row_keys(q_start, q_len, kv_head, row0 + 4u + r, row_end, seq_len, row_floats);
        let qa = row_base(q_start, kv_head, row0 + r);
        let qb = row_base(q_start, kv_head, row0 + 4u + r);
        qb_a[r] = select(row_base(q_start, kv_head, row0), qa, keys_a[r] > 0u) / 4u;
        qb_b[r] = select(row_base(q_start, kv_head, row0), qb, keys_b[r] > 0u) / 4u;
        if (keys_a[r] > 0u) {
            lse_a[r] = lse[qa / hs];
        }
        if (keys_b[r] > 0u) {
            lse_b[r] = lse[qb / hs];
        }
    }

    // D = rowsum(dout * out), per thread, in the order A sums dP (see the GLSL source).
    var delta_a = vec4<f32>(0.0);
    var delta_b = vec4<f32>(0.0);
    for (var c = 0u; c < hc; c++) {
        delta_a += delta_terms(qb_a + c);
        delta_b += delta_terms(qb_b + c);
    }

    var dq0_a = vec4<f32>(0.0);
    var dq0_b = vec4<f32>(0.0);
    var dq1_a = vec4<f32>(0.0);
    var dq1_b = vec4<f32>(0.0);
    let d0 = tid;
    let d1 = tid + WG;

    for (var base = 0u; base < kv_end; base += TILE) {
        let tile_len = min(TILE, kv_end - base);
        let tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            let b = block_tables[bt_row + base / bs + tid];
            s_phys[tid] = select(-1, b, b >= 0 && u32(b) < num_blocks);
        }
        workgroupBarrier();

        // A: dS of token base + tid for every row, 0 where masked.
        let token = base + tid;
        var phys = -1;
        if (tid < tile_len) {
            phys = s_phys[tid / bs];
        }
        var x_a = vec4<f32>(0.0);
        var x_b = vec4<f32>(0.0);
        var dp_a = vec4<f32>(0.0);
        var dp_b = vec4<f32>(0.0);
        if (phys >= 0) {
            let v0 = value_offset(kv_head, token % bs, 0u);
            let vs = pc.v_dim_stride;
            let p = u32(phys);
            for (var c = 0u; c < hc; c++) {
                let k = kv_quad(key_load(p, key_offset(kv_head, token % bs, c)));
                let vi = v0 + 4u * c * vs;
                let v = vec4<f32>(value_at(p, vi), value_at(p, vi + vs), value_at(p, vi + 2u * vs),
                                  value_at(p, vi + 3u * vs));
                x_a += dots(k, qb_a + c);
                x_b += dots(k, qb_b + c);
                dp_a += dout_dots(v, qb_a + c);
                dp_b += dout_dots(v, qb_b + c);
            }
        }
        let seen_a = vec4<u32>(token) < select(vec4<u32>(0u), keys_a, phys >= 0);
        let seen_b = vec4<u32>(token) < select(vec4<u32>(0u), keys_b, phys >= 0);
        s_ds[tid * 2u] = select(vec4<f32>(0.0), exp(x_a * pc.scale - lse_a) * (dp_a - delta_a), seen_a);
        s_ds[tid * 2u + 1u] = select(vec4<f32>(0.0), exp(x_b * pc.scale - lse_b) * (dp_b - delta_b), seen_b);
        workgroupBarrier();

        // C: dS times the keys, for this thread's head dims.
        for (var t = 0u; t < tile_len; t++) {
            let b = s_phys[t / bs];
            if (b < 0) {
                continue;
            }
            let ds_a = s_ds[t * 2u];
            let ds_b = s_ds[t * 2u + 1u];
            if (d0 < hs) {
                let kd = key_at(u32(b), kv_head, (base + t) % bs, d0);
                dq0_a += ds_a * kd;
                dq0_b += ds_b * kd;
            }
            if (d1 < hs) {
                let kd = key_at(u32(b), kv_head, (base + t) % bs, d1);
                dq1_a += ds_a * kd;
                dq1_b += ds_b * kd;
            }
        }
        workgroupBarrier();
    }

    for (var r = 0u; r < ROWS; r++) {
        let q = row_base(q_start, kv_head, row0 + r);
        if (row0 + r >= row_end || q + hs > arrayLength(&dq)) {
            continue;
        }
        let lo = r < 4u;
        if (d0 < hs) {
            dq[q + d0] = pc.scale * select(dq0_b[r % 4u], dq0_a[r % 4u], lo);
        }
        if (d1 < hs) {
            dq[q + d1] = pc.scale * select(dq1_b[r % 4u], dq1_a[r % 4u], lo);
        }
    }
}
