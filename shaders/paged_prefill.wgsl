// Paged-attention prefill forward, WGSL: the interface (PAGED_PREFILL in pagedvk/abi.py), the tiles (8 to 64 rows
// of one sequence and kv head, key tiles of KT = 2048 / rows keys), the 4 x 4 register blocks and the bounds rules
// of shaders/paged_prefill.comp, which explains them, with the staging pipelined, since naga's SPIR-V has no
// specialization constants (the head size is a run-time value here) and the plain tile loop left every global
// load's latency and two barriers per chunk in the way of the arithmetic:
//   - each staged chunk (the rows' and keys' head quads CQ at a time, then the tile's values) is loaded from
//     global memory into registers while the previous chunk is multiplied from shared memory, and stored after;
//     two chunk buffers alternate, so one barrier per chunk;
//   - the values of a tile are loaded during its last key chunk and staged whole (at head sizes up to 128 and 64
//     rows), and the next tile's first chunk is loaded during P.V: three barriers a tile besides
//     one a chunk, the row maxes' reduction included (7 a tile at the issue's shape, head size 128; 18 before);
//   - a thread's 4 rows are rg, rg + RG, rg + 2 RG, rg + 3 RG (not 4rg .. 4rg + 3), so that the row groups of a
//     subgroup read their query quads from different banks;
//   - whole chunks and value tiles are multiplied in loops of constant trip counts, which the driver can unroll
//     (the head size is a run-time value in WGSL);
//   - the blocks of the keys a thread stages or tests are read from the block table by that thread (no shared
//     table, no barrier for it);
//   - values a thread holds per element (rows, keys) are vectors indexed by constants and its loads separate
//     variables: a vector or matrix indexed by a variable is a local-memory array on some drivers;
//   - the products are fused multiply-adds written out: the logits as outer products of one head dim at a time
//     (64 a head quad, where a vector times a matrix made 80 operations), P.V as weight times value quad;
//   - tiles of head size 128 and 64 rows (issue 12's shape, and vLLM's commonest) run attend() with those sizes
//     as constants (the driver inlines the call and folds them into addresses, loop bounds and divisions), and
//     there a thread stages the values of its own logit keys from the blocks it read for them;
//   - a tile every row of a thread sees whole, without softcap, ALiBi or window, takes the scale alone (no logit
//     hooks), and outputs are rescaled only where a row's max grew.
// Shared memory: 29.7 KB (lavapipe, the CI device, offers 32 KB; the H200 48 KB).
// query and out are of the type pc.q_type names, bound as 32-bit words (q_any.wgsl): a staged query quad is held as
// its words until it is stored, converted, in shared memory. build_shaders.py pastes the module's cache storage file
// (kv_<type>.wgsl), q_any.wgsl, its cache access (kv_bound.wgsl or kv_segmented.wgsl) and the common parts.

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include q_output.wgsl
//!include attention_common.wgsl
//!include attention_variants.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl
//!include prefill_tiles.wgsl

@group(0) @binding(0) var<storage, read> query: array<u32>;              // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;       // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;     // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;       // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;           // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;    // [seqs + 1]
@group(0) @binding(6) var<storage, read> tiles: array<i32>;              // [tiles, 2]
@group(0) @binding(7) var<storage, read_write> out: array<u32>;          // like query
@group(0) @binding(8) var<storage, read_write> lse: array<f32>;          // [tokens, heads]
@group(0) @binding(9) var<storage, read> alibi_slopes: array<f32>;     // [heads] (VARIANT_ALIBI)
@group(0) @binding(10) var<storage, read> sinks: array<f32>;           // [heads] (VARIANT_SINKS)
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;  // the first of a segmented cache's extra bindings (pagedvk/abi.py)

// Shared memory in vec4s. [0, RED): the row groups' partial maxes (and at the end sums), G per row group. From RED,
// while the logits are computed, two chunk buffers of CHUNK_QUADS each: rows then keys, (ROWS + KT) * (CQ + 1) <=
// 864 (CQ quads a row and one of padding against bank conflicts); while P.V runs, the weights P (KT keys x ROWS / 4
// row groups = 512) and then the values, V_QUADS (VK keys x head quads). Each use is fenced from the next by a
// barrier; the reductions' slots are apart because a row group's partial maxes are written while other threads
// still read the last chunk.
const RED: u32 = 128u;               // WG threads, one vec4 each
const CHUNK_QUADS: u32 = 864u;
const CQ_MAX: u32 = 8u;              // head quads per chunk, at most
const P_OFF: u32 = RED;
const V_OFF: u32 = RED + 512u;
const V_QUADS: u32 = 1024u;          // 8 a thread (v0 .. v7)
const S_MEM: u32 = RED + 2u * CHUNK_QUADS;   // 1856 vec4s: 29,696 bytes
const NO_ROW: u32 = 0xffffffffu;

var<workgroup> s_mem: array<vec4<f32>, S_MEM>;

// What a thread needs of its tile that does not change from one key tile to the next.
struct Tile {
    bt_row: u32,        // the sequence's row of block_tables
    bs_log2: u32,
    kv_head: u32,
    hq: u32,            // head quads
    cq: u32,            // head quads per chunk
    qk_stride: u32,     // cq + 1
    cl: u32,            // the head quad this thread stages of each chunk
    lane_row: u32,      // the first row and key it stages, and the step to the next
    row_step: u32,
    n_rows: u32,
    kt: u32,
    vk: u32,            // keys per value sub-tile
}

// The physical block of the sequence's key k, -1 where k >= end or the table names no block of the caches.
fn key_block(t: Tile, k: u32, end: u32) -> i32 {
    if (k >= end) {
        return -1;
    }
    let b = block_tables[t.bt_row + (k >> t.bs_log2)];
    return select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
}

// Staged element n of a chunk, as stored (converted when staged): query quad c0 of row n's source quad q_src
// (NO_ROW: none) as its words (q_any.wgsl: .zw unread in the 16-bit types), key quad c0 + cl of a key in block phys
// (-1: none) at quad k_tok of the block.
fn q_load(q_src: u32, c0: u32, in_head: bool) -> vec4<u32> {
    var x = vec4<u32>(0u);
    if (q_src != NO_ROW && in_head) {
        let n = q_quad_words();
        let w = n * (q_src + c0);
        x.x = query[w];
        x.y = query[w + 1u];
        if (n == 4u) {
            x.z = query[w + 2u];
            x.w = query[w + 3u];
        }
    }
    return x;
}

fn k_load(phys: i32, k_tok: u32, c: u32, in_head: bool) -> KvQuad {
    if (phys >= 0 && in_head) {
        return key_load(u32(phys), k_tok + key_offset(0u, 0u, c));
    }
    return KvQuad();
}

// A chunk's staged elements as loaded, in flight: 4 rows' query quads and 4 keys' key quads.
struct Staged {
    qa: vec4<u32>,
    qb: vec4<u32>,
    qc: vec4<u32>,
    qd: vec4<u32>,
    ka: KvQuad,
    kb: KvQuad,
    kc: KvQuad,
    kd: KvQuad,
}

// The chunk at head quad c0 of the rows at q_src and the keys in blocks k_phys (quad 0 at k_tok).
fn chunk_loads(q_src: vec4<u32>, k_phys: vec4<i32>, k_tok: vec4<u32>, c0: u32, cl: u32, hq: u32) -> Staged {
    let in_head = c0 + cl < hq;
    return Staged(q_load(q_src.x, c0, in_head), q_load(q_src.y, c0, in_head), q_load(q_src.z, c0, in_head),
                  q_load(q_src.w, c0, in_head), k_load(k_phys.x, k_tok.x, c0 + cl, in_head),
                  k_load(k_phys.y, k_tok.y, c0 + cl, in_head), k_load(k_phys.z, k_tok.z, c0 + cl, in_head),
                  k_load(k_phys.w, k_tok.w, c0 + cl, in_head));
}

// The blocks of keys base + k_row of the tile at base (-1 past kv_end).
fn staged_blocks(t: Tile, base: u32, kv_end: u32, k_row: vec4<u32>) -> vec4<i32> {
    let end = min(base + t.kt, kv_end);
    return vec4<i32>(key_block(t, base + k_row.x, end), key_block(t, base + k_row.y, end),
                     key_block(t, base + k_row.z, end), key_block(t, base + k_row.w, end));
}

// Value element i (< V_QUADS) of the sub-tile of keys sub .. sub + t.vk - 1 of the tile at base: quad of head dims
// of one key (nhd), or of 4 keys' one head dim (vLLM's layout: values are read along the contiguous axis, and a
// tile and its sub-tiles start on quads of tokens). v_load loads it (zeros where there is none), v_store stages it.
fn v_key(t: Tile, i: u32, dims_contiguous: bool) -> u32 {
    return select(4u * (i / (4u * t.hq)), i / t.hq, dims_contiguous);
}

fn v_dim(t: Tile, i: u32, dims_contiguous: bool) -> u32 {
    return select(i % (4u * t.hq), 4u * (i % t.hq), dims_contiguous);
}

// Element i's key in the sub-tile (vkey, v_key()) and head dim (d, v_dim()) are worked out once per thread: divisions
// by the run-time head size would otherwise cost as much as a tile's staging.
fn v_load(t: Tile, i: u32, vkey: u32, d: u32, sub: u32, base: u32, tile_len: u32) -> KvQuad {
    let k = sub + vkey;
    if (i >= t.vk * t.hq || k >= tile_len) {
        return KvQuad();
    }
    let phys = key_block(t, base + k, base + tile_len);
    if (phys < 0) {
        return KvQuad();
    }
    return value_load(u32(phys), value_offset(t.kv_head, k & ((1u << t.bs_log2) - 1u), d) >> 2u);
}

fn v_store(t: Tile, i: u32, vkey: u32, d: u32, sub: u32, tile_len: u32, w: KvQuad) {
    if (i >= t.vk * t.hq) {
        return;
    }
    let v = kv_quad(w);
    if (pc.v_dim_stride == 1u) {
        s_mem[V_OFF + i] = v;
        return;
    }
    // Four keys of one head dim: tokens past the tile may hold anything (NaN too) and get weight 0, so zeros.
    let k = sub + vkey;
    let at = V_OFF + vkey * t.hq + (d >> 2u);
    let e = d & 3u;
    s_mem[at][e] = select(0.0, v.x, k < tile_len);
    s_mem[at + t.hq][e] = select(0.0, v.y, k + 1u < tile_len);
    s_mem[at + 2u * t.hq][e] = select(0.0, v.z, k + 2u < tile_len);
    s_mem[at + 3u * t.hq][e] = select(0.0, v.w, k + 3u < tile_len);
}

// Values where the tile's keys are a thread's logit keys (own_values in attend): head quad c of key k of the tile,
// in block phys (-1: none, zeros), loaded and staged.
fn v_own_load(t: Tile, phys: i32, k: u32, c: u32) -> KvQuad {
    if (phys < 0) {
        return KvQuad();
    }
    return value_load(u32(phys), value_offset(t.kv_head, k & ((1u << t.bs_log2) - 1u), 4u * c) >> 2u);
}

fn v_own_store(t: Tile, k: u32, c: u32, w: KvQuad) {
    s_mem[V_OFF + k * t.hq + c] = kv_quad(w);
}

// The logits of key k of the tile (block phys) for a thread's rows from their dot products: the hooks, -inf where
// masked. A token outside the cache (or past the tile) is visible to no row.
fn key_logits(dots: vec4<f32>, k: u32, phys: i32, base: u32, heads: vec4<u32>, qpos: vec4<u32>,
              keys: vec4<u32>) -> vec4<f32> {
    let seen = select(vec4<u32>(0u), keys, phys >= 0);
    return logits4(dots * pc.scale, heads, base + k, qpos, seen);
}

// One head quad c of a chunk: the dot products of a thread's 4 keys (kr, kr + kstep, ...) with its 4 rows (qr,
// qr + rstep, ...) accumulated into st, as outer products of one head dim at a time: each key's element times the
// rows' (a vector per head dim, its components chosen from the rows' quads) in fused multiply-adds, 64 of them. A
// vector times a matrix would be four dot products then an add each (80 operations: the add is not fused).
fn s_step(st: ptr<function, mat4x4<f32>>, qr: u32, kr: u32, rstep: u32, kstep: u32) {
    let q0 = s_mem[qr];
    let q1 = s_mem[qr + rstep];
    let q2 = s_mem[qr + 2u * rstep];
    let q3 = s_mem[qr + 3u * rstep];
    let qx = vec4<f32>(q0.x, q1.x, q2.x, q3.x);
    let qy = vec4<f32>(q0.y, q1.y, q2.y, q3.y);
    let qz = vec4<f32>(q0.z, q1.z, q2.z, q3.z);
    let qw = vec4<f32>(q0.w, q1.w, q2.w, q3.w);
    (*st)[0] = key_dots(s_mem[kr], qx, qy, qz, qw, (*st)[0]);
    (*st)[1] = key_dots(s_mem[kr + kstep], qx, qy, qz, qw, (*st)[1]);
    (*st)[2] = key_dots(s_mem[kr + 2u * kstep], qx, qy, qz, qw, (*st)[2]);
    (*st)[3] = key_dots(s_mem[kr + 3u * kstep], qx, qy, qz, qw, (*st)[3]);
}

// acc + key k's dot products with 4 rows over one head quad, the rows' elements by head dim (qx .. qw).
fn key_dots(k: vec4<f32>, qx: vec4<f32>, qy: vec4<f32>, qz: vec4<f32>, qw: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    return fma(vec4<f32>(k.w), qw, fma(vec4<f32>(k.z), qz, fma(vec4<f32>(k.y), qy, fma(vec4<f32>(k.x), qx, acc))));
}

// One key of P.V: its weights for the thread's rows (at pr) times its values at the thread's head quads (vr + vcols),
// in fused multiply-adds.
fn pv_step(o0: ptr<function, mat4x4<f32>>, o1: ptr<function, mat4x4<f32>>, o2: ptr<function, mat4x4<f32>>,
           o3: ptr<function, mat4x4<f32>>, pr: u32, vr: u32, vcols: vec4<u32>) {
    let p = s_mem[pr];
    let va = s_mem[vr + vcols.x];
    let vb = s_mem[vr + vcols.y];
    let vc = s_mem[vr + vcols.z];
    let vd = s_mem[vr + vcols.w];
    *o0 = weighted(p.x, va, vb, vc, vd, *o0);
    *o1 = weighted(p.y, va, vb, vc, vd, *o1);
    *o2 = weighted(p.z, va, vb, vc, vd, *o2);
    *o3 = weighted(p.w, va, vb, vc, vd, *o3);
}

// o + w times the value quads va .. vd (o's columns).
fn weighted(w: f32, va: vec4<f32>, vb: vec4<f32>, vc: vec4<f32>, vd: vec4<f32>, o: mat4x4<f32>) -> mat4x4<f32> {
    let s = vec4<f32>(w);
    return mat4x4<f32>(fma(s, va, o[0]), fma(s, vb, o[1]), fma(s, vc, o[2]), fma(s, vd, o[3]));
}

// Softmax weights of logits x under running maxes m; 0 where masked (exp(-inf - -inf) would be NaN).
fn weights(x: vec4<f32>, m: vec4<f32>) -> vec4<f32> {
    return select(exp(x - m), vec4<f32>(0.0), x == vec4<f32>(neg_inf()));
}

// Whether row gr of the sequence is there: before row_end and inside the query buffer.
fn row_valid(q_start: u32, kv_head: u32, gr: u32, row_end: u32) -> bool {
    return gr < row_end
        && row_base(q_start, kv_head, gr) + pc.head_size <= rows_held(q_quads(arrayLength(&query)) * 4u, pc.q_pitch);
}

// Row r of the tile's query quad c = 0 for the thread staging head quad cl, or NO_ROW.
fn q_source(q_start: u32, kv_head: u32, row0: u32, r: u32, n_rows: u32, row_end: u32, cl: u32) -> u32 {
    if (r < n_rows && row_valid(q_start, kv_head, row0 + r, row_end)) {
        return pitched(row_base(q_start, kv_head, row0 + r), pc.q_pitch) / 4u + cl;
    }
    return NO_ROW;
}

// Writes row gr's output (the rows' o, its max m and share of the denominator l summed) and its lse.
fn write_row(o: mat4x4<f32>, m: f32, l: f32, head: u32, q_start: u32, kv_head: u32, gr: u32, row_end: u32,
             cols: vec4<u32>, hq: u32, cg: u32) {
    let hs = pc.head_size;
    let q = row_base(q_start, kv_head, gr);
    if (gr >= row_end || q + hs > rows_held(2u * q_pairs(arrayLength(&out)), pc.out_pitch)) {
        return;
    }
    let q_out = pitched(q, pc.out_pitch);
    // A row that sees no key gives zeros; the sink (a variant) joins the denominator and the lse.
    let fin = softmax_finish(m, l, sink_logit(head));
    let f = fin.x * pc.v_scale;
    write_quad(q_out, cols.x, hq, o[0] * f);
    write_quad(q_out, cols.y, hq, o[1] * f);
    write_quad(q_out, cols.z, hq, o[2] * f);
    write_quad(q_out, cols.w, hq, o[3] * f);
    if (cg == 0u && q / hs < arrayLength(&lse)) {
        lse[q / hs] = fin.y;
    }
}

fn write_quad(q: u32, col: u32, hq: u32, v: vec4<f32>) {
    if (col < hq) {
        let at = (q + 4u * col) >> 1u;
        out_store(at, v.xy);
        out_store(at + 1u, v.zw);
    }
}


@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = pc.head_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    if (work.w == 0u || hs > MAX_HEAD_SIZE || hs < 4u) {
        return;
    }
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    // The bound on row_base() + hs of the rows the query binding holds at its pitch (rows_held).
    let query_elems = rows_held(q_quads(arrayLength(&query)) * 4u, pc.q_pitch);
    let queries = sequence_queries(seq, query_elems / (hs * pc.num_heads));
    let q_start = queries.x;
    let q_len = queries.y;
    let rows = group * q_len;
    if (row0 >= rows) {
        return;
    }
    let n_rows = tile_rows(rows, hs);
    if (row_base(q_start, kv_head, row0) + hs > query_elems) {
        return;
    }
    // The tile of issue 12's shape (head size 128, 64 rows, head dims contiguous) with its sizes as constants, which
    // the driver folds into the addresses and loop bounds (it inlines the call); every other tile with them as
    // run-time values.
    if (hs == 128u && n_rows == 64u && pc.v_dim_stride == 1u) {
        attend(tid, kv_head, seq, row0, q_start, q_len, 128u, 64u, true);
    } else {
        attend(tid, kv_head, seq, row0, q_start, q_len, hs, n_rows, false);
    }
}

// One workgroup's tile of n_rows rows from row0 of sequence seq (its q_len queries from token q_start), kv head
// kv_head, at head size hs (pc.head_size): the kernel proper. fixed: the instance of constant sizes (head size 128,
// 64 rows, head dims contiguous), which alone stages values as own_values below says, and has no code for the other
// way (a constant folds the branches; lavapipe would run both sides of a branch its lanes agree on, masked).
fn attend(tid: u32, kv_head: u32, seq: u32, row0: u32, q_start: u32, q_len: u32, hs: u32, n_rows: u32,
          fixed: bool) {
    let hq = hs / 4u;                    // head quads
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let rows = group * q_len;
    let query_elems = q_quads(arrayLength(&query)) * 4u;
    let row_groups = n_rows / 4u;
    let g_count = WG / row_groups;       // threads per row group
    let kt = 4u * g_count;               // keys per tile
    let cq = min(CQ_MAX, 512u / kt);     // head quads per chunk: (n_rows + kt) * (cq + 1) <= CHUNK_QUADS
    let rg = tid / g_count;
    let cg = tid % g_count;
    let row_end = min(row0 + n_rows, rows);

    let bt_row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(bt_row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    // Rows are query-major, so the last row sees the most keys.
    let kv_end = visible_keys((row_end - 1u) / group, q_len, seq_len);

    let cl = tid & (cq - 1u);
    let t = Tile(bt_row, firstLeadingBit(bs), kv_head, hq, cq, cq + 1u, cl, tid >> firstLeadingBit(cq), WG / cq,
                 n_rows, kt, min(kt, (V_QUADS / hq) & ~3u));
    let qk_stride = t.qk_stride;
    let k_off = n_rows * qk_stride;      // the keys in a chunk buffer
    let row_next = row_groups;   // from one of a thread's rows to the next
    let q_first = rg * qk_stride;   // its first row in a chunk buffer
    let rstep = row_next * qk_stride;
    let kstep = g_count * qk_stride;     // and from one of its keys to the next

    // This thread's rows: keys seen (0 for rows past the end or the query buffer), query head and
    // sequence position, for the logit hooks.
    let gr = row0 + rg + row_next * vec4<u32>(0u, 1u, 2u, 3u);
    let valid = vec4<bool>(row_valid(q_start, kv_head, gr.x, row_end), row_valid(q_start, kv_head, gr.y, row_end),
                           row_valid(q_start, kv_head, gr.z, row_end), row_valid(q_start, kv_head, gr.w, row_end));
    let qi = gr / group;
    let keys = select(vec4<u32>(0u), vec4<u32>(visible_keys(qi.x, q_len, seq_len), visible_keys(qi.y, q_len, seq_len),
                      visible_keys(qi.z, q_len, seq_len), visible_keys(qi.w, q_len, seq_len)), valid);
    let heads = kv_head * group + gr % group;
    // The keys all four rows see (every key before), and whether the logits are the scaled products alone: no
    // softcap, ALiBi or window.
    let seen_by_all = min(min(keys.x, keys.y), min(keys.z, keys.w));
    let plain = !(pc.softcap > 0.0) && (pc.variants & VARIANT_ALIBI) == 0u && pc.window == 0u;
    let qpos = vec4<u32>(query_position(qi.x, q_len, seq_len), query_position(qi.y, q_len, seq_len),
                         query_position(qi.z, q_len, seq_len), query_position(qi.w, q_len, seq_len));
    // The head quads of this thread's output columns (columns past the head are never written; their values are
    // read clamped into it).
    let cols = vec4<u32>(cg) + g_count * vec4<u32>(0u, 1u, 2u, 3u);
    let vcols = min(cols, vec4<u32>(hq - 1u));
    let ninf4 = vec4<f32>(neg_inf());

    // The query quad (at c = 0) of each row this thread stages, or NO_ROW.
    let q_src = vec4<u32>(q_source(q_start, kv_head, row0, t.lane_row, n_rows, row_end, cl),
                          q_source(q_start, kv_head, row0, t.lane_row + t.row_step, n_rows, row_end, cl),
                          q_source(q_start, kv_head, row0, t.lane_row + 2u * t.row_step, n_rows, row_end, cl),
                          q_source(q_start, kv_head, row0, t.lane_row + 3u * t.row_step, n_rows, row_end, cl));
    // The keys this thread stages: their quad 0 in their block (tiles start on blocks).
    let k_row = t.lane_row + t.row_step * vec4<u32>(0u, 1u, 2u, 3u);
    let k_in = k_row < vec4<u32>(kt);
    let k_tok = vec4<u32>(key_offset(kv_head, k_row.x & (bs - 1u), 0u), key_offset(kv_head, k_row.y & (bs - 1u), 0u),
                          key_offset(kv_head, k_row.z & (bs - 1u), 0u), key_offset(kv_head, k_row.w & (bs - 1u), 0u));
    let q_in = k_row < vec4<u32>(n_rows);   // the rows staged are numbered as the keys
    // The chunk loop's bound, hq read from the push constants: a run-time trip count even where hq is a constant,
    // so that the driver keeps the loop (its body holds a whole chunk's products, unrolled) rather than unrolling
    // a tile's chunks into one stretch of code several times the size.
    let chunks_end = pc.head_size / 4u;
    // Head size 128, 64 rows, head dims contiguous (fixed): a thread stages the values of its own logit keys (cols),
    // head quads 2 rg and 2 rg + 1 of each, from the blocks it has already read (s_phys): no block-table reads of
    // its own for them, and the loads go out without waiting on any. Elsewhere the elements below.
    let dc = pc.v_dim_stride == 1u;
    let own_values = fixed;
    let vq = 2u * rg;
    // The value elements this thread stages, tid + WG * n (n < 8): their keys in the sub-tile and head dims.
    let vi_a = tid + WG * vec4<u32>(0u, 1u, 2u, 3u);
    let vi_b = vi_a + 4u * WG;
    let vkey_a = vec4<u32>(v_key(t, vi_a.x, dc), v_key(t, vi_a.y, dc), v_key(t, vi_a.z, dc), v_key(t, vi_a.w, dc));
    let vkey_b = vec4<u32>(v_key(t, vi_b.x, dc), v_key(t, vi_b.y, dc), v_key(t, vi_b.z, dc), v_key(t, vi_b.w, dc));
    let vdim_a = vec4<u32>(v_dim(t, vi_a.x, dc), v_dim(t, vi_a.y, dc), v_dim(t, vi_a.z, dc), v_dim(t, vi_a.w, dc));
    let vdim_b = vec4<u32>(v_dim(t, vi_b.x, dc), v_dim(t, vi_b.y, dc), v_dim(t, vi_b.z, dc), v_dim(t, vi_b.w, dc));

    var m = ninf4;
    var l = vec4<f32>(0.0);
    var o0 = mat4x4<f32>();
    var o1 = mat4x4<f32>();
    var o2 = mat4x4<f32>();
    var o3 = mat4x4<f32>();

    // Variant: tiles start at the block of the first key the sliding window lets the first row see (rows are
    // query-major: it sees the earliest keys). Tiles are whole blocks: kt is a multiple of the block size.
    let kv_start = min(window_first_key(query_position(row0 / group, q_len, seq_len)), kv_end) & ~(bs - 1u);

    // The staged loads in flight: a chunk's rows and keys, or a value sub-tile.
    var ld = Staged();
    var v0 = KvQuad();
    var v1 = KvQuad();
    var v2 = KvQuad();
    var v3 = KvQuad();
    var v4 = KvQuad();
    var v5 = KvQuad();
    var v6 = KvQuad();
    var v7 = KvQuad();

    var k_phys = vec4<i32>(-1);   // the blocks of the keys this thread stages
    for (var base = kv_start; base < kv_end; base += kt) {
        if (base == kv_start) {   // else loaded during the last tile's P.V
            k_phys = staged_blocks(t, base, kv_end, k_row);
            ld = chunk_loads(q_src, k_phys, k_tok, 0u, cl, hq);
        }
        let tile_len = min(kt, kv_end - base);
        let tile_end = base + tile_len;
        // The blocks of the keys whose logits this thread computes.
        let s_phys = vec4<i32>(key_block(t, base + cols.x, tile_end), key_block(t, base + cols.y, tile_end),
                               key_block(t, base + cols.z, tile_end), key_block(t, base + cols.w, tile_end));
        // The blocks of the keys it stages of the next tile (-1 past kv_end), read now: their chunk's loads, issued
        // just before the barrier that starts P.V, then wait on no block-table read there.
        let next_phys = staged_blocks(t, base + kt, kv_end, k_row);

        // S: st[j] = the logits of key cols[j] for the thread's rows, a chunk of head quads at a time.
        var st = mat4x4<f32>();
        var buf = RED;
        for (var c0 = 0u; c0 < chunks_end; c0 += cq) {
            // Keys outside the cache or past the tile are staged as zeros: slots past a sequence's length may hold
            // anything, NaN included.
            let rs = buf + cl;
            if (q_in.x) { s_mem[rs + k_row.x * qk_stride] = q_quad_of(ld.qa); }
            if (q_in.y) { s_mem[rs + k_row.y * qk_stride] = q_quad_of(ld.qb); }
            if (q_in.z) { s_mem[rs + k_row.z * qk_stride] = q_quad_of(ld.qc); }
            if (q_in.w) { s_mem[rs + k_row.w * qk_stride] = q_quad_of(ld.qd); }
            let ks = rs + k_off;
            if (k_in.x) { s_mem[ks + k_row.x * qk_stride] = kv_quad(ld.ka); }
            if (k_in.y) { s_mem[ks + k_row.y * qk_stride] = kv_quad(ld.kb); }
            if (k_in.z) { s_mem[ks + k_row.z * qk_stride] = kv_quad(ld.kc); }
            if (k_in.w) { s_mem[ks + k_row.w * qk_stride] = kv_quad(ld.kd); }
            workgroupBarrier();
            // The next chunk's loads, or after the last the values of the tile's first sub-tile, fly while this
            // chunk is multiplied.
            let c1 = c0 + cq;
            if (c1 < hq) {
                ld = chunk_loads(q_src, k_phys, k_tok, c1, cl, hq);
            } else if (own_values) {
                v0 = v_own_load(t, s_phys.x, cols.x, vq);
                v1 = v_own_load(t, s_phys.x, cols.x, vq + 1u);
                v2 = v_own_load(t, s_phys.y, cols.y, vq);
                v3 = v_own_load(t, s_phys.y, cols.y, vq + 1u);
                v4 = v_own_load(t, s_phys.z, cols.z, vq);
                v5 = v_own_load(t, s_phys.z, cols.z, vq + 1u);
                v6 = v_own_load(t, s_phys.w, cols.w, vq);
                v7 = v_own_load(t, s_phys.w, cols.w, vq + 1u);
            } else {
                v0 = v_load(t, tid, vkey_a.x, vdim_a.x, 0u, base, tile_len);
                v1 = v_load(t, tid + WG, vkey_a.y, vdim_a.y, 0u, base, tile_len);
                v2 = v_load(t, tid + 2u * WG, vkey_a.z, vdim_a.z, 0u, base, tile_len);
                v3 = v_load(t, tid + 3u * WG, vkey_a.w, vdim_a.w, 0u, base, tile_len);
                v4 = v_load(t, tid + 4u * WG, vkey_b.x, vdim_b.x, 0u, base, tile_len);
                v5 = v_load(t, tid + 5u * WG, vkey_b.y, vdim_b.y, 0u, base, tile_len);
                v6 = v_load(t, tid + 6u * WG, vkey_b.z, vdim_b.z, 0u, base, tile_len);
                v7 = v_load(t, tid + 7u * WG, vkey_b.w, vdim_b.w, 0u, base, tile_len);
            }
            let n = min(cq, hq - c0);
            let qr = buf + q_first;
            let kr = buf + k_off + cg * qk_stride;
            if (n == CQ_MAX) {
                for (var c = 0u; c < CQ_MAX; c++) {
                    s_step(&st, qr + c, kr + c, rstep, kstep);
                }
            } else {
                for (var c = 0u; c < n; c++) {
                    s_step(&st, qr + c, kr + c, rstep, kstep);
                }
            }
            buf = select(RED, RED + CHUNK_QUADS, buf == RED);
        }
        // The logit hooks, -inf where masked; written out so that st stays in registers. Where every row of the
        // thread sees every key of the tile and no hook changes a logit (most tiles), the scale alone.
        if (plain && base + kt <= seen_by_all && all(s_phys >= vec4<i32>(0))) {
            st *= pc.scale;
        } else {
            st[0] = key_logits(st[0], cols.x, s_phys.x, base, heads, qpos, keys);
            st[1] = key_logits(st[1], cols.y, s_phys.y, base, heads, qpos, keys);
            st[2] = key_logits(st[2], cols.z, s_phys.z, base, heads, qpos, keys);
            st[3] = key_logits(st[3], cols.w, s_phys.w, base, heads, qpos, keys);
        }

        // Online softmax across tiles, per row: each thread's max over its keys, then the row group's. The slots
        // are read after one barrier and written again only after the tile's last.
        s_mem[cg * row_groups + rg] = max(max(st[0], st[1]), max(st[2], st[3]));
        workgroupBarrier();   // also: every thread is done with the chunk buffers
        var tile_max = ninf4;
        for (var g = 0u; g < g_count; g++) {
            tile_max = max(tile_max, s_mem[g * row_groups + rg]);
        }
        let m_new = max(m, tile_max);
        // What a thread holds is rescaled only where a row's max grew (after the first tiles, rarely): alpha is
        // exactly 1 elsewhere.
        if (any(m_new != m)) {
            let alpha = select(exp(m - m_new), vec4<f32>(1.0), m_new == ninf4);
            m = m_new;
            l *= alpha;
            o0 *= alpha.x;
            o1 *= alpha.y;
            o2 *= alpha.z;
            o3 *= alpha.w;
        }
        let p0 = weights(st[0], m);
        let p1 = weights(st[1], m);
        let p2 = weights(st[2], m);
        let p3 = weights(st[3], m);
        l += p0 + p1 + p2 + p3;
        s_mem[P_OFF + cols.x * row_groups + rg] = p0;
        s_mem[P_OFF + cols.y * row_groups + rg] = p1;
        s_mem[P_OFF + cols.z * row_groups + rg] = p2;
        s_mem[P_OFF + cols.w * row_groups + rg] = p3;
        if (own_values) {
            v_own_store(t, cols.x, vq, v0);
            v_own_store(t, cols.x, vq + 1u, v1);
            v_own_store(t, cols.y, vq, v2);
            v_own_store(t, cols.y, vq + 1u, v3);
            v_own_store(t, cols.z, vq, v4);
            v_own_store(t, cols.z, vq + 1u, v5);
            v_own_store(t, cols.w, vq, v6);
            v_own_store(t, cols.w, vq + 1u, v7);
        } else {
            v_store(t, tid, vkey_a.x, vdim_a.x, 0u, tile_len, v0);
            v_store(t, tid + WG, vkey_a.y, vdim_a.y, 0u, tile_len, v1);
            v_store(t, tid + 2u * WG, vkey_a.z, vdim_a.z, 0u, tile_len, v2);
            v_store(t, tid + 3u * WG, vkey_a.w, vdim_a.w, 0u, tile_len, v3);
            v_store(t, tid + 4u * WG, vkey_b.x, vdim_b.x, 0u, tile_len, v4);
            v_store(t, tid + 5u * WG, vkey_b.y, vdim_b.y, 0u, tile_len, v5);
            v_store(t, tid + 6u * WG, vkey_b.z, vdim_b.z, 0u, tile_len, v6);
            v_store(t, tid + 7u * WG, vkey_b.w, vdim_b.w, 0u, tile_len, v7);
        }

        // The next tile's first chunk, in flight during P.V.
        if (base + kt < kv_end) {
            k_phys = next_phys;
            ld = chunk_loads(q_src, k_phys, k_tok, 0u, cl, hq);
        }
        workgroupBarrier();

        // PV: the values vk keys at a time (the whole tile at head sizes up to 128 and 64 rows).
        for (var sub = 0u; sub < tile_len; sub += t.vk) {
            if (sub > 0u && !own_values) {   // own values: the whole tile is one sub-tile (vk = kt)
                v0 = v_load(t, tid, vkey_a.x, vdim_a.x, sub, base, tile_len);
                v1 = v_load(t, tid + WG, vkey_a.y, vdim_a.y, sub, base, tile_len);
                v2 = v_load(t, tid + 2u * WG, vkey_a.z, vdim_a.z, sub, base, tile_len);
                v3 = v_load(t, tid + 3u * WG, vkey_a.w, vdim_a.w, sub, base, tile_len);
                v4 = v_load(t, tid + 4u * WG, vkey_b.x, vdim_b.x, sub, base, tile_len);
                v5 = v_load(t, tid + 5u * WG, vkey_b.y, vdim_b.y, sub, base, tile_len);
                v6 = v_load(t, tid + 6u * WG, vkey_b.z, vdim_b.z, sub, base, tile_len);
                v7 = v_load(t, tid + 7u * WG, vkey_b.w, vdim_b.w, sub, base, tile_len);
                workgroupBarrier();   // every thread is done with the previous sub-tile
                v_store(t, tid, vkey_a.x, vdim_a.x, sub, tile_len, v0);
                v_store(t, tid + WG, vkey_a.y, vdim_a.y, sub, tile_len, v1);
                v_store(t, tid + 2u * WG, vkey_a.z, vdim_a.z, sub, tile_len, v2);
                v_store(t, tid + 3u * WG, vkey_a.w, vdim_a.w, sub, tile_len, v3);
                v_store(t, tid + 4u * WG, vkey_b.x, vdim_b.x, sub, tile_len, v4);
                v_store(t, tid + 5u * WG, vkey_b.y, vdim_b.y, sub, tile_len, v5);
                v_store(t, tid + 6u * WG, vkey_b.z, vdim_b.z, sub, tile_len, v6);
                v_store(t, tid + 7u * WG, vkey_b.w, vdim_b.w, sub, tile_len, v7);
                workgroupBarrier();
            }
            let n = min(t.vk, tile_len - sub);
            let pr = P_OFF + sub * row_groups + rg;
            if (n == 32u) {   // a whole tile of 64 rows
                for (var k = 0u; k < 32u; k++) {
                    pv_step(&o0, &o1, &o2, &o3, pr + k * row_groups, V_OFF + k * hq, vcols);
                }
            } else {
                for (var k = 0u; k < n; k++) {
                    pv_step(&o0, &o1, &o2, &o3, pr + k * row_groups, V_OFF + k * hq, vcols);
                }
            }
        }
        workgroupBarrier();   // P and the values are overwritten by the next tile's chunks
    }

    // Each row's denominator, summed over its row group once at the end (the slots were last read before the last
    // tile's P.V).
    s_mem[cg * row_groups + rg] = l;
    workgroupBarrier();
    l = vec4<f32>(0.0);
    for (var g = 0u; g < g_count; g++) {
        l += s_mem[g * row_groups + rg];
    }
    write_row(o0, m.x, l.x, heads.x, q_start, kv_head, gr.x, row_end, cols, hq, cg);
    write_row(o1, m.y, l.y, heads.y, q_start, kv_head, gr.y, row_end, cols, hq, cg);
    write_row(o2, m.z, l.z, heads.z, q_start, kv_head, gr.z, row_end, cols, hq, cg);
    write_row(o3, m.w, l.w, heads.w, q_start, kv_head, gr.w, row_end, cols, hq, cg);
}
