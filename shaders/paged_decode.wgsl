// Paged-attention decode, WGSL: shaders/paged_decode.comp translated statement for statement, with the
// same interface (PAGED_DECODE in pagedvk/abi.py) so one launcher runs either module. The algorithm and
// its bounds rules are explained in the GLSL source; comments here cover what WGSL changes:
//   * the caches are bound as 16-byte chunks (array<vec4<u32>>, kv_chunk_access.wgsl) and chunk_quad()
//     (kv_<type>.wgsl) takes a quad out of one, as kv_storage.glsl's KV_CHUNKS does;
//   * GLSL's `c ? a : b` evaluates one side, WGSL's select() both: where a side would read out of bounds
//     (a block id of -1, an s_phys slot past the tile) it is an `if`;
//   * WGSL zero-initializes every `var`: the load batch `w` is declared once, outside the tile loop;
//   * HEAD_SIZE is an override that build_shaders.py fixes at translation time; 0 means "from the push
//     constants". So are VALUE_ORDER and GROUP_LIMIT, the GLSL kernel's specialization constants (naga emits
//     none): modules of head sizes 64 and 128 (abi.FIXED_WGSL_HEAD_SIZES) are built once per layout and head-group
//     width (abi.DECODE_FIXED); every other head size runs the module with all three 0, read from the push
//     constants.
//   * query and out are of the type pc.q_type names, bound as 32-bit words (q_any.wgsl).

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include q_output.wgsl
//!include attention_common.wgsl
//!include attention_variants.wgsl
//!include kv_chunk_access.wgsl

@group(0) @binding(0) var<storage, read> query: array<vec2<u32>>;            // [seqs, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<vec4<u32>>;        // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<vec4<u32>>;      // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;           // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;               // [seqs]
@group(0) @binding(5) var<storage, read_write> out: array<u32>;              // [seqs, heads, head_size]
@group(0) @binding(6) var<storage, read_write> partial_out: array<vec2<f32>>; // [seqs, heads, partitions, head_size]
@group(0) @binding(7) var<storage, read_write> partial_stats: array<vec2<f32>>; // [seqs, heads, partitions]: (max, sum)
@group(0) @binding(8) var<storage, read> alibi_slopes: array<f32>;         // [heads] (VARIANT_ALIBI)
@group(0) @binding(9) var<storage, read> sinks: array<f32>;                // [heads] (VARIANT_SINKS)
@group(0) @binding(10) var<storage, read_write> lse: array<f32>;           // [seqs, heads] (VARIANT_LSE)
//!include decode_output.wgsl
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

override HEAD_SIZE: u32 = 0u;
override VALUE_ORDER: u32 = 0u;   // 1: vLLM's layout (a dim's tokens contiguous); 2: nhd; 0: from v_dim_stride
override GROUP_LIMIT: u32 = 0u;   // 4 or 8: the most query heads a workgroup takes; 0: from group_size

const MAX_GROUP: u32 = 8u;                      // query heads per workgroup: two vec4s
const TILE: u32 = WG;                           // tokens per tile: one key token per thread
const CQ: u32 = KV_CHUNK_QUADS;                 // quads per 16-byte chunk
const CHUNK_TOKENS: u32 = 4u * CQ;              // value tokens in one chunk of vLLM's layout
// Key and value chunks a thread loads before it uses any (see the GLSL): a 128-dim key and 64 tokens' values in
// float16 and float32 (CQ 1), float16's counts for fp8.
const K_BATCH: u32 = select(16u, 32u, CQ == 1u);
const V_BATCH: u32 = select(8u, 16u, CQ == 1u);
const TILE_BLOCKS: u32 = TILE / MIN_BLOCK_SIZE; // blocks of a tile at most (128 in 1-token blocks: see the GLSL)
const MAX_QUADS: u32 = MAX_HEAD_SIZE / 4u;

var<workgroup> s_q: array<vec4<f32>, 512>;     // MAX_QUADS * MAX_GROUP: queries * scale, [quad][head]
var<workgroup> s_w: array<vec4<f32>, 256>;     // TILE / 4 * MAX_GROUP: logits, then weights, [token quad][head]
var<workgroup> s_phys: array<i32, 256>;        // 2 * TILE_BLOCKS: blocks of this tile and the next, -1 where invalid
var<workgroup> s_o: array<f32, 4096>;          // 4 * MAX_HEAD_SIZE * MAX_GROUP / 2: sums at the end; reductions' scratch

// The subgroup of this invocation, for the reduction (main() sets them from its built-ins).
var<private> sg_id: u32;
var<private> sg_count: u32;
var<private> sg_lane: u32;

//!include decode_reduce.wgsl

// Blocks of the tile that starts at token `base` of a partition ending at `end` (0 past the end).
fn tile_blocks(base: u32, end: u32, bs_log2: u32) -> u32 {
    if (base >= end) {
        return 0u;
    }
    return (min(TILE, end - base) + (1u << bs_log2) - 1u) >> bs_log2;
}

// Query quad i, as q_any.wgsl lays them out (out's pairs: q_output.wgsl). The queries are read as pairs of words (8-byte loads, as the GLSL kernel's): one a 16-bit quad, two a float32 one.
fn query_quad(i: u32) -> vec4<f32> {
    if (q_half()) {
        return q_quad_of(vec4<u32>(query[i], 0u, 0u));
    }
    return q_quad_of(vec4<u32>(query[2u * i], query[2u * i + 1u]));
}

// A block-table entry, -1 where it is not a block of the caches.
fn physical_block(i: u32) -> i32 {
    let b = block_tables[i];
    return select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
}

// The first n (1 <= n, only the first 4 count) elements of v, the rest zero: slots past a sequence's end may
// hold anything, NaN included, and 0 * NaN is NaN.
fn first(v: vec4<f32>, n: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), v, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(n));
}

// The group's queries times one key quad: columns are heads (0-3 or 4-7 by h), rows head dims.
fn queries(c: u32, h: u32) -> mat4x4<f32> {
    let i = c * MAX_GROUP + 4u * h;
    return mat4x4<f32>(s_q[i], s_q[i + 1u], s_q[i + 2u], s_q[i + 3u]);
}

// The weights of tile tokens 4 tq .. 4 tq + 3 (rows) for heads 4h .. 4h + 3 (columns).
fn weights(tq: u32, h: u32) -> mat4x4<f32> {
    let i = tq * MAX_GROUP + 4u * h;
    return mat4x4<f32>(s_w[i], s_w[i + 1u], s_w[i + 2u], s_w[i + 3u]);
}

// The tile's block holding tile token t (cur: the tile's half of s_phys), -1 where t >= n.
fn tile_block(cur: u32, t: u32, n: u32, bs_log2: u32) -> i32 {
    if (t >= n) {
        return -1;
    }
    return s_phys[cur + (t >> bs_log2)];
}

// value_load(), zeros where the block is not there.
fn value_or_zero(ph: i32, i: u32) -> vec4<u32> {
    if (ph < 0) {
        return vec4<u32>(0u);
    }
    return value_load(u32(ph), i);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) subgroup: u32,
        @builtin(num_subgroups) subgroups: u32, @builtin(subgroup_invocation_id) subgroup_lane: u32) {
    let tid = lid.x;
    sg_id = subgroup;
    sg_count = subgroups;
    sg_lane = subgroup_lane;
    let hs = select(pc.head_size, HEAD_SIZE, HEAD_SIZE > 0u);   // a fixed head size lets loops unroll
    // Head dims a thread owns in vLLM's layout: one where the head size is fixed and at most WG (the GLSL twin's
    // SLOTS: a constant bound keeps acc_a/acc_b in registers).
    let slots = select(2u, (HEAD_SIZE + WG - 1u) / WG, HEAD_SIZE > 0u);
    let bs = pc.block_size;          // a power of two (1 to 32): divisions by it are shifts
    let bs_log2 = firstTrailingBit(bs);
    let bs_mask = bs - 1u;
    let group = pc.group_size;
    let wide = select(group > 4u, GROUP_LIMIT > 4u, GROUP_LIMIT != 0u);   // heads 4-7 in use
    let P = pc.partition_size;
    let head_groups = pc.num_heads / max(group, 1u);
    let wg = workgroup_index(wid, nwg);
    let seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    let part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || P == 0u || hs > MAX_HEAD_SIZE || bs < MIN_BLOCK_SIZE
        || bs > TILE || part >= pc.num_partitions) {
        return;
    }
    // A module fixed for other arguments than the push constants' writes nothing (the plan keeps them equal).
    if ((GROUP_LIMIT != 0u && group > GROUP_LIMIT)
        || (VALUE_ORDER != 0u && (pc.v_dim_stride == 1u) != (VALUE_ORDER == 2u))) {
        return;
    }
    let head0 = (wg % head_groups) * group;                   // first query head of this workgroup
    let kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    let hq = hs / 4u;                                         // quads of one head
    let q_quad0 = (query_token(seq) >> 2u) + head0 * hq;   // q_pitch: a multiple of 4
    if (q_quad0 + group * hq > 2u * arrayLength(&query) / q_quad_words()) {
        return;
    }

    let row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(row), 0)));
    // The first tile's block ids, fetched beside the sequence's length (see the GLSL).
    let early_block = ((part * P) >> bs_log2) + tid;
    var early_phys = -1;
    if (tid < TILE_BLOCKS && early_block < row_blocks) {
        early_phys = physical_block(row + early_block);
    }
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let last = seq_len - 1u;                                  // the query's position
    // Variant: the partitions cover the sliding window only, from the block of its first key.
    let window0 = min(window_first_key(last), seq_len) & ~bs_mask;
    let start = window0 + part * P;                           // first token of the partition
    let end = select(min(seq_len, start + P), seq_len, part + 1u == pc.num_partitions);

    for (var i = tid; i < MAX_GROUP * hq; i += WG) {
        let g = i % MAX_GROUP;
        let c = i / MAX_GROUP;
        var q = vec4<f32>(0.0);
        if (g < group) {
            q = query_quad(q_quad0 + g * hq + c) * pc.scale;
        }
        s_q[i] = q;
    }
    let heads_a = vec4<u32>(head0) + vec4<u32>(0u, 1u, 2u, 3u);
    let heads_b = heads_a + vec4<u32>(4u);
    let in_a = select(vec4<u32>(0u), vec4<u32>(1u), vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(group));
    let in_b = select(vec4<u32>(0u), vec4<u32>(1u), vec4<u32>(4u, 5u, 6u, 7u) < vec4<u32>(group));
    let ninf4 = vec4<f32>(neg_inf());

    // The V stage's share of the work (see the GLSL).
    let dims_contiguous = select(pc.v_dim_stride == 1u, VALUE_ORDER == 2u, VALUE_ORDER != 0u);
    let lanes = select(1u, WG / hq, dims_contiguous);
    let col = tid % hq;
    let lane = tid / hq;

    var m_a = ninf4;                  // running max per head
    var m_b = ninf4;
    var l_a = vec4<f32>(0.0);         // this thread's share of the softmax sum
    var l_b = vec4<f32>(0.0);
    var acc_a: array<vec4<f32>, 4>;   // [dim slot] of heads 0-3 / 4-7 (zero-initialized)
    var acc_b: array<vec4<f32>, 4>;
    var w: array<vec4<u32>, K_BATCH + V_BATCH>;   // key chunks, then value chunks in flight

    // Block ids are fetched a tile ahead into the other half of s_phys.
    var next_blocks = tile_blocks(start, end, bs_log2);
    if (tid < next_blocks) {
        if (window0 == 0u) {
            s_phys[tid] = early_phys;
        } else {
            s_phys[tid] = physical_block(row + (start >> bs_log2) + tid);
        }
    }
    workgroupBarrier();
    var tile = 0u;
    for (var base = start; base < end; base += TILE) {
        let len = min(TILE, end - base);
        let cur = (tile & 1u) * TILE_BLOCKS;
        let nxt = TILE_BLOCKS - cur;
        tile++;
        let nbase = base + TILE;
        next_blocks = tile_blocks(nbase, end, bs_log2);
        var next_phys = -1;
        if (tid < next_blocks) {
            next_phys = physical_block(row + (nbase >> bs_log2) + tid);
        }

        // Loads first: token tid's key, K_BATCH chunks at a time.
        let phys = tile_block(cur, tid, len, bs_log2);
        let t = tid & bs_mask;
        let kchunks = hq / CQ;             // whole chunks of a key
        let key_chunks = hq % CQ == 0u;
        if (phys >= 0 && key_chunks) {
            for (var k = 0u; k < K_BATCH; k++) {
                if (k < kchunks) {
                    w[k] = key_load(u32(phys), key_offset(kv_head, t, k * CQ) / CQ);
                }
            }
        }
        let vchunks = (len + CHUNK_TOKENS - 1u) / CHUNK_TOKENS;

        // K: the logits of token tid of the tile.
        var s_a = vec4<f32>(0.0);
        var s_b = vec4<f32>(0.0);
        if (phys >= 0) {
            if (key_chunks) {
                for (var c0 = 0u; c0 < kchunks; c0 += K_BATCH) {
                    if (c0 > 0u) {   // keys longer than one batch (float32 or head sizes over 128)
                        for (var k = 0u; k < K_BATCH; k++) {
                            if (c0 + k < kchunks) {
                                w[k] = key_load(u32(phys), key_offset(kv_head, t, (c0 + k) * CQ) / CQ);
                            }
                        }
                    }
                    for (var k = 0u; k < K_BATCH; k++) {
                        if (c0 + k < kchunks) {
                            for (var i = 0u; i < CQ; i++) {
                                s_a += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 0u);
                            }
                        }
                    }
                    if (wide) {
                        for (var k = 0u; k < K_BATCH; k++) {
                            if (c0 + k < kchunks) {
                                for (var i = 0u; i < CQ; i++) {
                                    s_b += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 1u);
                                }
                            }
                        }
                    }
                }
            } else {                 // nhd with a head of part chunks: quad by quad
                for (var c = 0u; c < hq; c++) {
                    let q = key_offset(kv_head, t, c);
                    let kq = chunk_quad(key_load(u32(phys), q / CQ), q % CQ);
                    s_a += kq * queries(c, 0u);
                    if (wide) {
                        s_b += kq * queries(c, 1u);
                    }
                }
            }
        }
        let key = base + tid;
        let valid = phys >= 0;
        let keys_a = select(vec4<u32>(0u), in_a * seq_len, valid);
        let keys_b = select(vec4<u32>(0u), in_b * seq_len, valid);
        let x_a = logits4(s_a, heads_a, key, vec4<u32>(last), keys_a);
        var x_b = ninf4;
        if (wide) {
            x_b = logits4(s_b, heads_b, key, vec4<u32>(last), keys_b);
        }

        // S: the tile's max per head, the rescale, this token's weights.
        var t_a = x_a;
        var t_b = x_b;
        workgroup_reduce(&t_a, &t_b, true, tid);
        let n_a = max(m_a, t_a);
        let n_b = max(m_b, t_b);
        // exp(-inf - -inf) would be NaN: a head with no visible key so far keeps weight 0.
        let alpha_a = select(exp(m_a - n_a), vec4<f32>(1.0), n_a == ninf4);
        let alpha_b = select(exp(m_b - n_b), vec4<f32>(1.0), n_b == ninf4);
        let p_a = select(exp(x_a - n_a), vec4<f32>(0.0), x_a == ninf4);
        let p_b = select(exp(x_b - n_b), vec4<f32>(0.0), x_b == ninf4);
        m_a = n_a;
        m_b = n_b;
        l_a = l_a * alpha_a + p_a;
        l_b = l_b * alpha_b + p_b;
        for (var i = 0u; i < 4u; i++) {
            acc_a[i] *= alpha_a;
            acc_b[i] *= alpha_b;
        }
        for (var g = 0u; g < 4u; g++) {
            s_w[(tid >> 2u) * MAX_GROUP + g][tid & 3u] = p_a[g];
            s_w[(tid >> 2u) * MAX_GROUP + 4u + g][tid & 3u] = p_b[g];
        }
        if (tid < next_blocks) {
            s_phys[nxt + tid] = next_phys;
        }
        workgroupBarrier();

        // V: weighted values.
        if (!dims_contiguous) {
            // vLLM's layout: a head dim's bs tokens of one block are contiguous, CHUNK_TOKENS a chunk.
            for (var slot = 0u; slot < slots; slot++) {
                let d = tid + slot * WG;
                if (d >= hs) {
                    continue;
                }
                let row_d = value_offset(kv_head, 0u, d);
                if (bs % CHUNK_TOKENS == 0u) {
                    for (var n0 = 0u; n0 < vchunks; n0 += V_BATCH) {
                        for (var k = 0u; k < V_BATCH; k++) {
                            let t0 = (n0 + k) * CHUNK_TOKENS;
                            let ph = tile_block(cur, t0, select(0u, len, n0 + k < vchunks), bs_log2);
                            w[K_BATCH + k] = value_or_zero(ph, (row_d + (t0 & bs_mask)) / CHUNK_TOKENS);
                        }
                        for (var k = 0u; k < V_BATCH; k++) {
                            for (var i = 0u; i < CQ; i++) {
                                let t0 = (n0 + k) * CHUNK_TOKENS + 4u * i;
                                if (t0 < len) {
                                    let v = first(chunk_quad(w[K_BATCH + k], i), len - t0);
                                    acc_a[slot] += v * weights(t0 >> 2u, 0u);
                                    if (wide) {
                                        acc_b[slot] += v * weights(t0 >> 2u, 1u);
                                    }
                                }
                            }
                        }
                    }
                } else {            // rows shorter than a chunk (fp8 with 8-token blocks): quad by quad
                    for (var t0 = 0u; t0 < len; t0 += 4u) {
                        let ph = s_phys[cur + (t0 >> bs_log2)];
                        if (ph < 0) {
                            continue;
                        }
                        let q = (row_d + (t0 & bs_mask)) >> 2u;
                        let v = first(chunk_quad(value_load(u32(ph), q / CQ), q % CQ), len - t0);
                        acc_a[slot] += v * weights(t0 >> 2u, 0u);
                        if (wide) {
                            acc_b[slot] += v * weights(t0 >> 2u, 1u);
                        }
                    }
                }
            }
        } else if (lane < lanes) {
            // nhd: four head dims of one token are one quad; this thread takes every lanes-th token.
            for (var t0 = lane; t0 < len; t0 += V_BATCH * lanes) {
                for (var k = 0u; k < V_BATCH; k++) {
                    let tk = t0 + k * lanes;
                    let ph = tile_block(cur, tk, len, bs_log2);
                    let q = value_offset(kv_head, tk & bs_mask, 4u * col) >> 2u;
                    w[K_BATCH + k] = value_or_zero(ph, q / CQ);
                }
                for (var k = 0u; k < V_BATCH; k++) {
                    let tk = t0 + k * lanes;
                    if (tk >= len) {
                        continue;
                    }
                    let q = value_offset(kv_head, tk & bs_mask, 4u * col) >> 2u;
                    var v = vec4<f32>(0.0);
                    if (s_phys[cur + (tk >> bs_log2)] >= 0) {
                        v = chunk_quad(w[K_BATCH + k], q % CQ);
                    }
                    let wi = (tk >> 2u) * MAX_GROUP;
                    let tj = tk & 3u;
                    let pa = vec4<f32>(s_w[wi][tj], s_w[wi + 1u][tj], s_w[wi + 2u][tj], s_w[wi + 3u][tj]);
                    for (var j = 0u; j < 4u; j++) {
                        acc_a[j] += v[j] * pa;
                    }
                    if (wide) {
                        let pb = vec4<f32>(s_w[wi + 4u][tj], s_w[wi + 5u][tj], s_w[wi + 6u][tj], s_w[wi + 7u][tj]);
                        for (var j = 0u; j < 4u; j++) {
                            acc_b[j] += v[j] * pb;
                        }
                    }
                }
            }
        }
    }
    workgroup_reduce(&l_a, &l_b, false, tid);
    workgroupBarrier();   // s_o's reduction scratch is read; the sums go there next

    // Each head's sums meet in s_o ([lane][head][dim]; one lane in vLLM's layout), then are normalized
    // and written two dims at a time.
    let n_lanes = select(1u, lanes, dims_contiguous);
    if (!dims_contiguous) {
        for (var slot = 0u; slot < slots; slot++) {
            let d = tid + slot * WG;
            if (d >= hs) {
                continue;
            }
            for (var g = 0u; g < 4u; g++) {
                s_o[g * hs + d] = acc_a[slot][g];
                s_o[(g + 4u) * hs + d] = acc_b[slot][g];
            }
        }
    } else if (lane < lanes) {
        for (var j = 0u; j < 4u; j++) {
            for (var g = 0u; g < 4u; g++) {
                s_o[(lane * MAX_GROUP + g) * hs + 4u * col + j] = acc_a[j][g];
                s_o[(lane * MAX_GROUP + g + 4u) * hs + 4u * col + j] = acc_b[j][g];
            }
        }
    }
    workgroupBarrier();
    let half_hs = hs / 2u;
    for (var i = tid; i < group * half_hs; i += WG) {
        let g = i / half_hs;
        let d0 = 2u * (i % half_hs);
        var o = vec2<f32>(0.0);
        for (var r = 0u; r < n_lanes; r++) {
            o += vec2<f32>(s_o[(r * MAX_GROUP + g) * hs + d0], s_o[(r * MAX_GROUP + g) * hs + d0 + 1u]);
        }
        let lo = g < 4u;
        let l = select(l_b[g & 3u], l_a[g & 3u], lo);
        let m = select(m_b[g & 3u], m_a[g & 3u], lo);
        let head = head0 + g;
        write_output_pair(seq, head, part, d0, hs, o, m, l);
    }
}
