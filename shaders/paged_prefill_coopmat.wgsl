// Paged-attention prefill forward on cooperative matrices, WGSL (naga's `enable wgpu_cooperative_matrix;`): the
// kernel of shaders/paged_prefill_coopmat.comp, which explains it, with its bindings, push constants, grid and
// tiles (PAGED_PREFILL in pagedvk/abi.py), for float16 queries and caches and a head size fixed at build time
// (HEAD_SIZE, an `override` build_shaders.py fixes). One workgroup of four subgroups per 64 query rows and kv
// head; the context in steps of BC = 64 keys staged in shared memory (loaded into registers a step ahead);
// Q.K^T and P.V as 16x16x16 float16 products accumulated in float32 (coopMultiplyAdd); the softmax by two lanes
// per row. Where WGSL (naga 30) differs from the GLSL:
//   - a matrix's elements cannot be read or written one by one (naga refuses the access), and matrices multiply
//     element-wise only by a scalar. The GLSL rescales its accumulators per row in registers where a row's
//     running max grew (which is most steps for some row of a subgroup: a max keeps growing now and then); here
//     a row keeps the max it exponentiates against until the step's max exceeds it by more than RESCALE_ABOVE
//     (FlashAttention-4's conditional rescaling: the weights exp(s - m) stay below e^RESCALE_ABOVE, which
//     float16 holds, and the output and the denominator share the stale m, so the result is the same); where a
//     row of the workgroup has to (its first step with keys aside: the accumulators are still zero there), every
//     subgroup rescales its accumulators through shared memory, 64 head dims at a time. The output's final factor
//     is applied as lanes copy their rows out of shared memory, so no element is reached in registers;
//   - naga wants the matrix operations in control flow its uniformity analysis proves workgroup-uniform, and
//     counts values read through functions (the tile, the sequence's bounds) or exchanged in a subgroup as
//     varying: the steps' bounds and the rescale test go through workgroupUniformLoad;
//   - loops over arrays of matrices and of chunks are written out (structs of matrices and of chunks, and
//     functions over them): naga has no unroll hint, and an array indexed by a variable goes to local memory on
//     the H200's driver;
//   - the staged float16 values are made from the loaded 32-bit words by unpack2x16float and a conversion back
//     (exact: naga 30's bitcast to float16 vectors gives float32 ones);
//   - naga's subgroupBarrier() orders subgroup memory only; build_shaders.py (subgroup_barriers_order_shared)
//     makes it order workgroup memory, as GLSL's subgroupMemoryBarrierShared() + subgroupBarrier() do.
// Shared memory: 46,080 bytes at head size 128 (the GLSL module's, less its row factors).
// The caches are bound as 16-byte chunks (kv_chunk_access.wgsl; array<vec4<u32>>), so no 16-bit storage.

enable f16;
enable wgpu_cooperative_matrix;

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include attention_variants.wgsl
//!include kv_chunk_access.wgsl
//!include prefill_common.wgsl
//!include prefill_tiles.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;              // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<vec4<u32>>;      // 16-byte chunks: key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<vec4<u32>>;    // 16-byte chunks: value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;         // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;             // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;      // [seqs + 1]
@group(0) @binding(6) var<storage, read> tiles: array<i32>;                // [tiles, 2]
@group(0) @binding(7) var<storage, read_write> out: array<OutPair>;        // like query
@group(0) @binding(8) var<storage, read_write> lse: array<f32>;            // [tokens, heads]
@group(0) @binding(9) var<storage, read> alibi_slopes: array<f32>;       // [heads] (VARIANT_ALIBI)
@group(0) @binding(10) var<storage, read> sinks: array<f32>;             // [heads] (VARIANT_SINKS)
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;  // the first of a segmented cache's extra bindings (pagedvk/abi.py)

override HEAD_SIZE: u32 = 128u;  // fixed by build_shaders.py: 64 or 128
const D: u32 = HEAD_SIZE;
const BR: u32 = 64u;             // query rows per workgroup: 16 per subgroup
const BC: u32 = 64u;             // keys per step
const DQ: u32 = D / 4u;          // float16 quads per key or query row
const DC: u32 = D / 8u;          // 16-byte chunks per key row
const LOADS: u32 = BC * DC / WG; // chunks of keys (and of values) each thread stages per step: 4 or 8
const KS: u32 = DQ + 2u;         // row stride of staged keys, queries and [key][dim] values, in quads
const TS: u32 = BC / 4u + 2u;    // row stride of staged [dim][key] values, of S and of P, in quads
// The growth of a row's max past the one its weights are taken against that makes the subgroup rescale (see the
// top): weights stay below e^8 ~ 2981.
const RESCALE_ABOVE: f32 = 8.0;

alias MatA = coop_mat16x16<f16, A>;
alias MatB = coop_mat16x16<f16, B>;
alias MatC = coop_mat16x16<f32, C>;

var<workgroup> s_kv: array<vec4<f16>, max(max(BR, BC) * KS, D * TS)>;  // the step's keys, then its values; the queries
var<workgroup> s_s: array<vec4<f32>, BR * TS>;   // each subgroup's 16 x BC logits; its rows on the way out or rescaled
var<workgroup> s_p: array<vec4<f16>, BR * TS>;   // each subgroup's 16 x BC weights
var<workgroup> s_bounds: vec4<u32>;   // (first key, end of the keys, whether the workgroup has rows, 0)
var<workgroup> s_rescale: u32;        // base + 1 where a row must rescale at the step from key base (0 at first)

// The subgroup and lane (main() sets them from its built-ins).
var<private> warp: u32;
var<private> lane: u32;

// Four accumulators (64 head dims of a subgroup's 16 rows): the output is one (head size 64) or two of them.
struct Acc {
    m0: MatC,
    m1: MatC,
    m2: MatC,
    m3: MatC,
}

// The subgroup's queries as matrices, 16 head dims each (q4 .. q7 unused at head size 64).
struct Queries {
    q0: MatA,
    q1: MatA,
    q2: MatA,
    q3: MatA,
    q4: MatA,
    q5: MatA,
    q6: MatA,
    q7: MatA,
}

// A thread's chunks of a step's keys or values (c4 .. c7 unused at head size 64).
struct Chunks {
    c0: vec4<u32>,
    c1: vec4<u32>,
    c2: vec4<u32>,
    c3: vec4<u32>,
    c4: vec4<u32>,
    c5: vec4<u32>,
    c6: vec4<u32>,
    c7: vec4<u32>,
}

struct Seq {
    start: u32,
    q_len: u32,
    len: u32,
}

// prefill_matrix.glsl's Row: where row gr starts in query, out (elements) and lse (/ D), its head, position and
// the keys it sees (0 where it is not a row).
struct Row {
    base: u32,
    head: u32,
    pos: u32,
    keys: u32,
    valid: bool,
}

fn query_row(q: Seq, kv_head: u32, gr: u32, row_end: u32, row_floats: u32) -> Row {
    let group = pc.num_heads / pc.num_kv_heads;
    var r: Row;
    r.base = row_base(q.start, kv_head, gr);
    r.head = kv_head * group + gr % group;
    r.pos = query_position(gr / group, q.q_len, q.len);
    r.valid = gr < row_end && r.base + D <= row_floats;
    r.keys = select(0u, visible_keys(gr / group, q.q_len, q.len), r.valid);
    return r;
}

// Four float16 values from two words (see the top).
fn half4(w: vec2<u32>) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)));
}

fn block_shift() -> u32 {
    return firstTrailingBit(pc.block_size);
}

// prefill_matrix.glsl's block window: lane l holds the physical block of the sequence's block w0 + l (-1: none).
fn token_block(bt_row: u32, token: u32, kv_end: u32) -> i32 {
    if (token >= kv_end) {
        return -1;
    }
    let b = block_tables[bt_row + (token >> block_shift())];
    return select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
}

fn block_window(bt_row: u32, w0: u32, kv_end: u32) -> i32 {
    return token_block(bt_row, (w0 + lane) << block_shift(), kv_end);
}

fn window_block(win: i32, w0: u32, t: u32, kv_end: u32) -> i32 {
    let b = subgroupShuffle(win, (t >> block_shift()) - w0);
    return select(-1, b, t < kv_end);
}

// Chunk i of a step's keys from `base` on (token i / DC); zeros for tokens that are not there.
fn key_chunk(win: i32, w0: u32, kv_head: u32, base: u32, i: u32, kv_end: u32) -> vec4<u32> {
    let t = base + i / DC;
    let b = window_block(win, w0, t, kv_end);
    if (b < 0) {
        return vec4<u32>(0u);
    }
    return key_load(u32(b), key_offset(kv_head, t & (pc.block_size - 1u), 2u * (i % DC)) >> 1u);
}

// Chunk i of a step's values, as chunk_slot() places it: by_dim (nhd) head dims of one token, else (vLLM) one head
// dim of 8 tokens, of which those at or past kv_end are zeros (they may hold NaN, and 0 * NaN is NaN).
fn value_chunk(win: i32, w0: u32, kv_head: u32, base: u32, i: u32, kv_end: u32, by_dim: bool) -> vec4<u32> {
    let t = base + select(8u * (i % (BC / 8u)), i / DC, by_dim);
    let d = select(i / (BC / 8u), 8u * (i % DC), by_dim);
    let b = window_block(win, w0, t, kv_end);
    let live = select(0u, kv_end - t, kv_end > t);
    if (b < 0 || live == 0u) {
        return vec4<u32>(0u);
    }
    var w = value_load(u32(b), value_offset(kv_head, t & (pc.block_size - 1u), d) >> 3u);
    if (!by_dim && live < 8u) {   // word j holds slots t + 2j, t + 2j + 1
        let lo = vec4<u32>(0u, 2u, 4u, 6u);
        let keep = select(vec4<u32>(0u), vec4<u32>(0xffffu), lo < vec4<u32>(live))
                 | select(vec4<u32>(0u), vec4<u32>(0xffff0000u), lo + vec4<u32>(1u) < vec4<u32>(live));
        w &= keep;
    }
    return w;
}

fn key_chunks(win: i32, w0: u32, kv_head: u32, base: u32, tid: u32, kv_end: u32) -> Chunks {
    var c: Chunks;
    c.c0 = key_chunk(win, w0, kv_head, base, tid, kv_end);
    c.c1 = key_chunk(win, w0, kv_head, base, tid + WG, kv_end);
    c.c2 = key_chunk(win, w0, kv_head, base, tid + 2u * WG, kv_end);
    c.c3 = key_chunk(win, w0, kv_head, base, tid + 3u * WG, kv_end);
    if (LOADS > 4u) {
        c.c4 = key_chunk(win, w0, kv_head, base, tid + 4u * WG, kv_end);
        c.c5 = key_chunk(win, w0, kv_head, base, tid + 5u * WG, kv_end);
        c.c6 = key_chunk(win, w0, kv_head, base, tid + 6u * WG, kv_end);
        c.c7 = key_chunk(win, w0, kv_head, base, tid + 7u * WG, kv_end);
    }
    return c;
}

fn value_chunks(win: i32, w0: u32, kv_head: u32, base: u32, tid: u32, kv_end: u32, by_dim: bool) -> Chunks {
    var c: Chunks;
    c.c0 = value_chunk(win, w0, kv_head, base, tid, kv_end, by_dim);
    c.c1 = value_chunk(win, w0, kv_head, base, tid + WG, kv_end, by_dim);
    c.c2 = value_chunk(win, w0, kv_head, base, tid + 2u * WG, kv_end, by_dim);
    c.c3 = value_chunk(win, w0, kv_head, base, tid + 3u * WG, kv_end, by_dim);
    if (LOADS > 4u) {
        c.c4 = value_chunk(win, w0, kv_head, base, tid + 4u * WG, kv_end, by_dim);
        c.c5 = value_chunk(win, w0, kv_head, base, tid + 5u * WG, kv_end, by_dim);
        c.c6 = value_chunk(win, w0, kv_head, base, tid + 6u * WG, kv_end, by_dim);
        c.c7 = value_chunk(win, w0, kv_head, base, tid + 7u * WG, kv_end, by_dim);
    }
    return c;
}

// Where chunk i goes in shared memory: keys and nhd values [key][dim] (row stride KS), vLLM values [dim][key]
// (row stride TS).
fn chunk_slot(i: u32, by_dim: bool) -> u32 {
    return select((i / (BC / 8u)) * TS + 2u * (i % (BC / 8u)), (i / DC) * KS + 2u * (i % DC), by_dim);
}

fn stage_chunk(i: u32, by_dim: bool, w: vec4<u32>) {
    let at = chunk_slot(i, by_dim);
    s_kv[at] = half4(w.xy);
    s_kv[at + 1u] = half4(w.zw);
}

fn stage(c: Chunks, tid: u32, by_dim: bool) {
    stage_chunk(tid, by_dim, c.c0);
    stage_chunk(tid + WG, by_dim, c.c1);
    stage_chunk(tid + 2u * WG, by_dim, c.c2);
    stage_chunk(tid + 3u * WG, by_dim, c.c3);
    if (LOADS > 4u) {
        stage_chunk(tid + 4u * WG, by_dim, c.c4);
        stage_chunk(tid + 5u * WG, by_dim, c.c5);
        stage_chunk(tid + 6u * WG, by_dim, c.c6);
        stage_chunk(tid + 7u * WG, by_dim, c.c7);
    }
}

// The subgroup's queries (staged [row][dim] in s_kv) as matrices.
fn load_queries() -> Queries {
    let r = warp * 16u * KS;
    var q: Queries;
    q.q0 = coopLoadT<MatA>(&s_kv[r], KS);
    q.q1 = coopLoadT<MatA>(&s_kv[r + 4u], KS);
    q.q2 = coopLoadT<MatA>(&s_kv[r + 8u], KS);
    q.q3 = coopLoadT<MatA>(&s_kv[r + 12u], KS);
    if (D > 64u) {
        q.q4 = coopLoadT<MatA>(&s_kv[r + 16u], KS);
        q.q5 = coopLoadT<MatA>(&s_kv[r + 20u], KS);
        q.q6 = coopLoadT<MatA>(&s_kv[r + 24u], KS);
        q.q7 = coopLoadT<MatA>(&s_kv[r + 28u], KS);
    }
    return q;
}

// Head dims 16 k .. 16 k + 15 of staged keys 16 n .. 16 n + 15, as K^T (the staged [key][dim] read column-major).
fn key_t(n: u32, k: u32) -> MatB {
    return coopLoad<MatB>(&s_kv[n * 16u * KS + k * 4u], KS);
}

// S for the subgroup's rows and staged keys 16 n .. 16 n + 15.
fn logits(q: Queries, n: u32) -> MatC {
    var s = MatC();
    s = coopMultiplyAdd(q.q0, key_t(n, 0u), s);
    s = coopMultiplyAdd(q.q1, key_t(n, 1u), s);
    s = coopMultiplyAdd(q.q2, key_t(n, 2u), s);
    s = coopMultiplyAdd(q.q3, key_t(n, 3u), s);
    if (D > 64u) {
        s = coopMultiplyAdd(q.q4, key_t(n, 4u), s);
        s = coopMultiplyAdd(q.q5, key_t(n, 5u), s);
        s = coopMultiplyAdd(q.q6, key_t(n, 6u), s);
        s = coopMultiplyAdd(q.q7, key_t(n, 7u), s);
    }
    return s;
}

// Staged values of keys 16 k .. 16 k + 15, head dims 16 j .. 16 j + 15, by their staging: the test reads the push
// constant here, where naga's uniformity analysis sees it uniform (a function's arguments are not).
fn value_mat(k: u32, j: u32) -> MatB {
    if (pc.v_dim_stride == 1u) {
        return coopLoadT<MatB>(&s_kv[k * 16u * KS + j * 4u], KS);
    }
    return coopLoad<MatB>(&s_kv[j * 16u * TS + k * 4u], TS);
}

// o += P.V for keys 16 k .. 16 k + 15 and head dims 64 h .. 64 h + 63.
fn add_pv(o: Acc, p: MatA, k: u32, h: u32) -> Acc {
    var r: Acc;
    r.m0 = coopMultiplyAdd(p, value_mat(k, 4u * h), o.m0);
    r.m1 = coopMultiplyAdd(p, value_mat(k, 4u * h + 1u), o.m1);
    r.m2 = coopMultiplyAdd(p, value_mat(k, 4u * h + 2u), o.m2);
    r.m3 = coopMultiplyAdd(p, value_mat(k, 4u * h + 3u), o.m3);
    return r;
}

// Four accumulators to the subgroup's rows of s_s (16 x 64, row-major), and back.
fn acc_out(o: Acc) {
    let r = warp * 16u * TS;
    coopStoreT(o.m0, &s_s[r], TS);
    coopStoreT(o.m1, &s_s[r + 4u], TS);
    coopStoreT(o.m2, &s_s[r + 8u], TS);
    coopStoreT(o.m3, &s_s[r + 12u], TS);
}

fn acc_in() -> Acc {
    let r = warp * 16u * TS;
    var o: Acc;
    o.m0 = coopLoadT<MatC>(&s_s[r], TS);
    o.m1 = coopLoadT<MatC>(&s_s[r + 4u], TS);
    o.m2 = coopLoadT<MatC>(&s_s[r + 8u], TS);
    o.m3 = coopLoadT<MatC>(&s_s[r + 12u], TS);
    return o;
}

// The accumulators with each row times its lane's factor a (both lanes of a row hold it), through shared memory.
// Called by the whole subgroup, after it is done with its S in s_s.
fn rescale(o: Acc, my_row: u32, half_: u32, a: f32) -> Acc {
    acc_out(o);
    subgroupBarrier();
    let at = my_row * TS + 8u * half_;
    for (var j = 0u; j < 8u; j++) {
        s_s[at + j] *= a;
    }
    subgroupBarrier();
    let r = acc_in();
    subgroupBarrier();   // read before s_s is written again
    return r;
}

// The logit of key `key` (its scaled dot product given), -inf where the row does not see it (`masked` false: it
// sees the whole step).
fn logit_at(dot: f32, key: u32, me: Row, masked: bool) -> f32 {
    if (masked && !(key < me.keys && key_visible(key, me.pos))) {
        return neg_inf();
    }
    return logit(dot, me.head, key, me.pos);
}

fn row_logits4(dots: vec4<f32>, key: u32, me: Row, masked: bool) -> vec4<f32> {
    return vec4<f32>(logit_at(dots.x, key, me, masked), logit_at(dots.y, key + 1u, me, masked),
                     logit_at(dots.z, key + 2u, me, masked), logit_at(dots.w, key + 3u, me, masked));
}

// The max of this lane's half of row `row` of the step's S (quads half_, half_ + 2, ...) as logits.
fn row_max(row: u32, half_: u32, base: u32, me: Row, masked: bool) -> f32 {
    var mx = neg_inf();
    for (var j = 0u; j < BC / 8u; j++) {
        let cq = 2u * j + half_;
        let x = row_logits4(s_s[row * TS + cq] * pc.scale, base + 4u * cq, me, masked);
        mx = max(mx, max(max(x.x, x.y), max(x.z, x.w)));
    }
    return mx;
}

// The weights exp(logit - m) of this lane's half of the row (to s_p, float16) and their sum; zeros where m is -inf
// (the row has seen no key).
fn row_weights(row: u32, half_: u32, base: u32, me: Row, masked: bool, m: f32) -> f32 {
    var sum = 0.0;
    for (var j = 0u; j < BC / 8u; j++) {
        let cq = 2u * j + half_;
        let x = row_logits4(s_s[row * TS + cq] * pc.scale, base + 4u * cq, me, masked);
        let p = select(exp(x - vec4<f32>(m)), vec4<f32>(0.0), m == neg_inf());
        sum += dot(p, vec4<f32>(1.0));
        s_p[row * TS + cq] = vec4<f16>(p);
    }
    return sum;
}

// Rows 64 h .. 64 h + 63 of the output: the accumulators through s_s, each row times its factor a, written by the
// row's two lanes (32 head dims each).
fn write_out(o: Acc, h: u32, my_row: u32, half_: u32, a: f32, me: Row, write: bool) {
    acc_out(o);
    subgroupBarrier();
    if (write) {
        let base = pitched(me.base, pc.out_pitch);
        for (var j = 0u; j < BC / 8u; j++) {
            let cq = (BC / 8u) * half_ + j;
            let v = s_s[my_row * TS + cq] * a;
            let d = base + h * BC + 4u * cq;
            out[d >> 1u] = out_pair(v.xy);
            out[(d >> 1u) + 1u] = out_pair(v.zw);
        }
    }
    subgroupBarrier();   // read before the next pass overwrites
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) subgroup: u32,
        @builtin(subgroup_invocation_id) subgroup_lane: u32) {
    warp = subgroup;
    lane = subgroup_lane;
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let work = tile_work(workgroup_index(wid, nwg));
    let kv_head = work.x;
    let seq = work.y;
    let row0 = work.z;
    let row_floats = rows_held(arrayLength(&query) * 4u, pc.q_pitch);   // the bound on row_base() + D (rows_held)
    let queries = sequence_queries(seq, row_floats / (D * pc.num_heads));
    let rows = group * queries.y;
    let row_end = min(row0 + BR, rows);

    let bt_row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(bt_row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let sq = Seq(queries.x, queries.y, seq_len);
    // Rows are query-major, so the last row sees the most keys.
    let kv_end = visible_keys((row_end - 1u) / group, sq.q_len, seq_len);
    // Steps start at the block of the first key the window lets the tile's first row see.
    let kv_start = min(window_first_key(query_position(row0 / group, sq.q_len, seq_len)), kv_end) & ~(bs - 1u);
    // Whether the workgroup has rows, and its steps' bounds, through workgroupUniformLoad: naga wants the matrix
    // operations in control flow it can prove uniform, and counts what the thread computed from the tables (through
    // functions) as varying.
    if (tid == 0u) {
        let go = work.w != 0u && pc.head_size == D && row0 < rows;
        s_bounds = vec4<u32>(kv_start, kv_end, select(0u, 1u, go), 0u);
        s_rescale = 0u;
    }
    let bounds = workgroupUniformLoad(&s_bounds);
    if (bounds.z == 0u) {
        return;
    }

    // This lane's row for the softmax and the output (two lanes per row, each half of the columns).
    let my_row = warp * 16u + lane / 2u;
    let half_ = lane & 1u;
    let me = query_row(sq, kv_head, row0 + my_row, row_end, row_floats);

    // The queries, staged as float16; rows that are not there are zeros.
    for (var i = tid; i < BR * DQ; i += WG) {
        let q = query_row(sq, kv_head, row0 + i / DQ, row_end, row_floats);
        var v = vec4<f16>(0.0);
        if (q.valid) {
            v = vec4<f16>(q_quad(query[pitched(q.base, pc.q_pitch) / 4u + i % DQ]));
        }
        s_kv[(i / DQ) * KS + i % DQ] = v;
    }
    workgroupBarrier();
    let qm = load_queries();

    var o_lo = Acc(MatC(), MatC(), MatC(), MatC());   // head dims 0 .. 63
    var o_hi = Acc(MatC(), MatC(), MatC(), MatC());   // 64 .. 127 (head size 128)
    var m = neg_inf();   // the max the row's weights are taken against (see the top)
    var l = 0.0;         // this lane's share of the row's denominator
    let by_dim = pc.v_dim_stride == 1u;   // nhd: a token's head dims are contiguous
    var keys = key_chunks(block_window(bt_row, kv_start >> block_shift(), kv_end), kv_start >> block_shift(),
                          kv_head, kv_start, tid, kv_end);

    for (var base = bounds.x; base < bounds.y; base += BC) {
        workgroupBarrier();   // every subgroup is done with the last step's values (and, first, the queries)
        // 1. Keys, [key][dim].
        stage(keys, tid, true);
        workgroupBarrier();

        // 2. This step's values and the next step's keys, into registers.
        let w0 = base >> block_shift();
        let win = block_window(bt_row, w0, kv_end);
        let values = value_chunks(win, w0, kv_head, base, tid, kv_end, by_dim);
        keys = key_chunks(win, w0, kv_head, base + BC, tid, kv_end);

        // 3. S = Q.K^T for this subgroup's rows, its four key matrices written out (independent products the
        // driver can interleave).
        let s0 = logits(qm, 0u);
        let s1 = logits(qm, 1u);
        let s2 = logits(qm, 2u);
        let s3 = logits(qm, 3u);
        coopStoreT(s0, &s_s[warp * 16u * TS], TS);
        coopStoreT(s1, &s_s[warp * 16u * TS + 4u], TS);
        coopStoreT(s2, &s_s[warp * 16u * TS + 8u], TS);
        coopStoreT(s3, &s_s[warp * 16u * TS + 12u], TS);
        subgroupBarrier();   // this subgroup's S is in s_s

        let whole = base + BC <= me.keys && key_visible(base, me.pos) && key_visible(base + BC - 1u, me.pos);
        var mx = row_max(my_row, half_, base, me, !whole);
        mx = max(mx, subgroupShuffleXor(mx, 1u));
        var alpha = 1.0;
        if (mx > m + RESCALE_ABOVE) {   // a row's first keys too (m = -inf); alpha stays 1 there, o and l being 0
            if (m != neg_inf()) {
                alpha = exp(m - mx);
            }
            m = mx;
        }
        l = l * alpha + row_weights(my_row, half_, base, me, !whole, m);
        if (alpha != 1.0) {
            s_rescale = base + 1u;   // this step's mark (see s_rescale)
        }
        // Every subgroup is done with the keys (its P is in s_p, its lanes have read their S); a rescale where a row
        // of the workgroup needs it (in every subgroup: rare, and naga wants the matrix operations uniform in the
        // workgroup; the rows that do not need it are multiplied by 1).
        if (workgroupUniformLoad(&s_rescale) == base + 1u) {
            o_lo = rescale(o_lo, my_row, half_, alpha);
            if (D > 64u) {
                o_hi = rescale(o_hi, my_row, half_, alpha);
            }
        }
        stage(values, tid, by_dim);
        workgroupBarrier();

        // 4. O += P.V, the step's four key matrices written out.
        let p0 = coopLoadT<MatA>(&s_p[warp * 16u * TS], TS);
        let p1 = coopLoadT<MatA>(&s_p[warp * 16u * TS + 4u], TS);
        let p2 = coopLoadT<MatA>(&s_p[warp * 16u * TS + 8u], TS);
        let p3 = coopLoadT<MatA>(&s_p[warp * 16u * TS + 12u], TS);
        o_lo = add_pv(add_pv(add_pv(add_pv(o_lo, p0, 0u, 0u), p1, 1u, 0u), p2, 2u, 0u), p3, 3u, 0u);
        if (D > 64u) {
            o_hi = add_pv(add_pv(add_pv(add_pv(o_hi, p0, 0u, 1u), p1, 1u, 1u), p2, 2u, 1u), p3, 3u, 1u);
        }
    }

    // The rows' denominators; a row that sees no key gives zeros and lse -inf (or the sink's logit).
    l += subgroupShuffleXor(l, 1u);
    let fin = softmax_finish(m, l, sink_logit(me.head));
    let write = me.valid && me.base + D <= rows_held(2u * arrayLength(&out), pc.out_pitch);
    write_out(o_lo, 0u, my_row, half_, fin.x * pc.v_scale, me, write);
    if (D > 64u) {
        write_out(o_hi, 1u, my_row, half_, fin.x * pc.v_scale, me, write);
    }
    if (write && half_ == 0u && me.base / D < arrayLength(&lse)) {
        lse[me.base / D] = fin.y;
    }
}
