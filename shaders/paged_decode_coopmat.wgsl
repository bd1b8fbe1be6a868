// Paged-attention decode on cooperative matrices, WGSL: the float16 and bfloat16 paths of
// shaders/paged_decode_coopmat.comp (float16 caches with float16 queries, or bfloat16 caches with bfloat16 queries,
// in vLLM's layout with 16-token blocks, head size fixed at build time), with the same bindings, push constants and
// grid (PAGED_DECODE in pagedvk/abi.py). WGSL has no bfloat16: the bfloat16 module is this source built with the
// bfloat16 storage includes (kv_bf16.wgsl, q_bf16.wgsl) and its f16 type then given the bfloat16 encoding
// (build_shaders.bfloat16_matrices, as the GLSL bfloat16 modules): so f16 here is only loaded, stored, converted
// from f32 and multiplied in matrices (no f16 arithmetic or comparison; spirv-val refuses them for bfloat16), and
// its constants are zeros, which bfloat16 holds exactly. The algorithm (S, P, V), its bounds
// rules and the reasons for them are explained in the GLSL source; comments here cover what WGSL changes:
//   * naga 30's matrices (`enable wgpu_cooperative_matrix;`) are square: 16 x 16 or 8 x 8. The P.V product is
//     16 x 16 with heads 8-15 zero (PV_N 16, as the GLSL bfloat16 modules take it), not 16 x 8.
//   * naga types a matrix load by its pointer's element, so the caches are bound as array<f16> (the module needs
//     storageBuffer16BitAccess; abi.VariantKey.requires) and shared memory is f16 / f32 scalars: strides count
//     scalars. coopLoad / coopStore are column-major, coopLoadT / coopStoreT row-major.
//   * naga wants its matrix operations in workgroup-uniform control flow, and the kernel runs them in
//     subgroup-uniform flow (each subgroup its own blocks, as the GLSL): naga's check stops at function calls,
//     so every matrix operation is in a small function below. SPIR-V asks subgroup uniformity of them only.
//   * subgroupBarrier() orders subgroup memory only: build_shaders.py gives naga's subgroup barriers the
//     workgroup memory too (as GLSL's subgroupMemoryBarrierShared before subgroupBarrier).
//   * No specialization constants (naga emits none): a split always goes to PAGED_DECODE_REDUCE (the GLSL
//     kernel's merge in the dispatch, DECODE_MERGE_SPEC_ID, needs coherent memory WGSL has not), and the head
//     group's width is the push constants' (GROUP_LIMIT of the GLSL is 0 here). partial_stats holds (max, sum)
//     as float32 pairs, as the WGSL reduce reads them.

enable f16;
enable wgpu_cooperative_matrix;

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include attention_variants.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;                // [seqs, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<f16>;              // vLLM's layout, 16-token blocks
@group(0) @binding(2) var<storage, read> value_cache: array<f16>;
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;           // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;               // [seqs]
@group(0) @binding(5) var<storage, read_write> out: array<OutPair>;          // [seqs, heads, head_size]
@group(0) @binding(6) var<storage, read_write> partial_out: array<vec2<f32>>; // [seqs, heads, partitions, head_size]
@group(0) @binding(7) var<storage, read_write> partial_stats: array<vec2<f32>>; // [seqs, heads, partitions]: (max, sum)
@group(0) @binding(8) var<storage, read> alibi_slopes: array<f32>;         // [heads] (VARIANT_ALIBI)
@group(0) @binding(9) var<storage, read> sinks: array<f32>;                // [heads] (VARIANT_SINKS)
@group(0) @binding(10) var<storage, read_write> lse: array<f32>;           // [seqs, heads] (VARIANT_LSE)
//!include decode_output.wgsl
var<immediate> pc: Params;

override HEAD_SIZE: u32 = 128u;   // fixed by build_shaders.py: 64 or 128 (abi.PAGED_DECODE.matrix_variants)

// out's whole pairs and its pair p stored (decode_output.wgsl), in the type the module is built for.
fn out_pairs() -> u32 {
    return arrayLength(&out);
}

fn out_store(p: u32, v: vec2<f32>) {
    out[p] = out_pair(v);
}

alias MatA = coop_mat16x16<f16, A>;
alias MatB = coop_mat16x16<f16, B>;
alias MatC = coop_mat16x16<f32, C>;

const D: u32 = HEAD_SIZE;          // a multiple of 16
const DT: u32 = D / 16u;           // 16-dim tiles: key chunk pairs, and value tiles
const BS: u32 = 16u;               // the block size this kernel reads
const SUBGROUPS: u32 = WG / 32u;   // subgroups of 32 invocations (pagedvk.decode checks the device's size)
const MAX_GROUP: u32 = 8u;         // query heads per workgroup: heads 0-3 and 4-7 of the S products' columns
const RESCALE_MARGIN: f32 = 8.0;   // weights stay below exp(8) ~ 2981 (the GLSL's P.)
const PV_N: u32 = 16u;             // P^T's columns: heads 0-7, then zeros

// The S products' B matrices, column-major: [heads 0-3 / 4-7][pair j][column][k], 256 halves a matrix.
var<workgroup> s_qb: array<f16, 4096>;          // 2 * DT * 256 at DT 8
// Blocks a subgroup takes a step, as the GLSL's STEP_BLOCKS: their loads all issued before any is used, one max, one
// rescale test and one pair of barriers for all of them.
const STEP: u32 = 2u;
const SCR: u32 = 512u * STEP;                   // floats of each subgroup's scratch: 512 a block of the step
var<workgroup> s_scr: array<f32, 4096>;         // SUBGROUPS * SCR: two 16 x 16 float32 S a block, or one tile of O^T
var<workgroup> s_v: array<f16, 1024>;           // SUBGROUPS * 256: a masked key or V^T tile (blocks not whole)
var<workgroup> s_p: array<f16, 2048>;           // SUBGROUPS * STEP * 16 * PV_N: P^T [token][head], heads 8-15 zero
var<workgroup> s_ml: array<vec4<f32>, 16>;      // SUBGROUPS * 4: each subgroup's final (max, sum), heads 0-3, 4-7
var<workgroup> s_o: array<f32, 4096>;           // SUBGROUPS * MAX_GROUP * D: scaled output sums [head][dim]

// The matrix operations (see above: each in a function of its own).
fn key_tile_load(at: u32) -> MatA {
    return coopLoadT<MatA>(&key_cache[at], 16u);
}
fn value_tile_load(at: u32) -> MatA {
    return coopLoadT<MatA>(&value_cache[at], 16u);
}
fn staged_tile_load(at: u32) -> MatA {
    return coopLoadT<MatA>(&s_v[at], 16u);
}
fn query_load(at: u32) -> MatB {
    return coopLoad<MatB>(&s_qb[at], 16u);
}
fn weights_load(at: u32) -> MatB {
    return coopLoadT<MatB>(&s_p[at], PV_N);
}
fn multiply_add(a: MatA, b: MatB, c: MatC) -> MatC {
    return coopMultiplyAdd(a, b, c);
}
fn scratch_store(m: MatC, at: u32) {
    coopStoreT(m, &s_scr[at], 16u);
}
fn scratch_load(at: u32) -> MatC {
    return coopLoadT<MatC>(&s_scr[at], 16u);
}
fn zero_sums() -> MatC {
    return MatC();
}

fn scr4(at: u32) -> vec4<f32> {
    return vec4<f32>(s_scr[at], s_scr[at + 1u], s_scr[at + 2u], s_scr[at + 3u]);
}
fn scr4_scale(at: u32, f: vec4<f32>) {
    s_scr[at] *= f.x;
    s_scr[at + 1u] *= f.y;
    s_scr[at + 2u] *= f.z;
    s_scr[at + 3u] *= f.w;
}

// A block-table entry, -1 where it is not a block of the caches.
fn physical_block(i: u32) -> i32 {
    let b = block_tables[i];
    return select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
}

// The first half of a 16 x 16 key tile: key chunks 2 j and 2 j + 1 of kv head h in block b, 256 halves read as 16
// rows of 16 (the GLSL's key_tile, in halves).
fn key_tile(b: u32, h: u32, j: u32) -> u32 {
    return (b * pc.k_block_stride + key_offset(h, 0u, 4u * j)) * 4u;
}

// V^T for head dims 16 i .. 16 i + 15 of kv head h in block b: rows are dims, 16 tokens each.
fn value_tile(b: u32, h: u32, i: u32) -> u32 {
    return b * pc.v_block_stride + value_offset(h, 0u, 16u * i);
}

fn nan_safe_exp(x: vec4<f32>, m: vec4<f32>) -> vec4<f32> {
    return select(exp(x - m), vec4<f32>(0.0), x == vec4<f32>(neg_inf()));
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sg_size: u32) {
    let tid = lid.x;
    let group = pc.group_size;
    let wide = group > 4u;   // heads 4-7 in use
    let P = pc.partition_size;
    let head_groups = pc.num_heads / max(group, 1u);
    let wg = workgroup_index(wid, nwg);
    let seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    let part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || P == 0u || part >= pc.num_partitions || sg_size != 32u) {
        return;
    }
    // The layout the matrix loads assume (the GLSL's check).
    if (pc.head_size != D || pc.block_size != BS || pc.k_token_stride != KV_CHUNK_QUADS
        || pc.k_chunk_stride != KV_CHUNK_QUADS * BS || pc.v_token_stride != 1u || pc.v_dim_stride != BS) {
        return;
    }
    let head0 = (wg % head_groups) * group;
    let kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    let hq = D / 4u;
    let q_quad0 = (query_token(seq) >> 2u) + head0 * hq;   // q_pitch: a multiple of 4
    if (q_quad0 + group * hq > arrayLength(&query)) {
        return;
    }

    let row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(row), 0)));
    let early_block = part * P / BS + sg;
    var early_phys = -1;
    if (early_block < row_blocks) {
        early_phys = physical_block(row + early_block);
    }
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * BS);
    }
    let last = seq_len - 1u;
    let window0 = min(window_first_key(last), seq_len) & ~(BS - 1u);
    let start = window0 + part * P;
    let end = select(min(seq_len, start + P), seq_len, part + 1u == pc.num_partitions);
    var blocks = 0u;
    if (start < end) {
        blocks = (end - start + BS - 1u) / BS;
    }

    // The S products' B matrices (the GLSL's s_qb, in halves): column n = 8 s + 4 p + h (head 4 half + h) holds,
    // in rows 8 p .. 8 p + 7, head dims 8 (2 j + s) .. of the query (one 16-byte chunk), zeros in the other 8 rows.
    for (var i = tid; i < 2u * DT * 32u; i += WG) {
        let half_ = i / (DT * 32u);
        let n = (i / 2u) % 16u;
        let k8 = i % 2u;
        let j = (i / 32u) % DT;
        let s = n / 8u;
        let p = (n / 4u) % 2u;
        let g = 4u * half_ + n % 4u;
        let c = q_quad0 + g * hq + 2u * (2u * j + s);   // the chunk's first quad
        var w = vec4<u32>(0u);
        if (k8 == p && g < group) {
            w = vec4<u32>(query[c], query[c + 1u]);
        }
        // The query storage's own conversion (q_f16.wgsl, q_bf16.wgsl), then to the matrices' type: exact both ways
        // (float16 -> float32 -> float16; in the bfloat16 module, whose f16 is bfloat16, bfloat16 -> float32 ->
        // bfloat16), and no float16 arithmetic, which a bfloat16 module may not have.
        for (var e = 0u; e < 2u; e++) {
            let h4 = vec4<f16>(q_quad(select(w.zw, w.xy, e == 0u)));
            s_qb[8u * i + 4u * e] = h4.x;
            s_qb[8u * i + 4u * e + 1u] = h4.y;
            s_qb[8u * i + 4u * e + 2u] = h4.z;
            s_qb[8u * i + 4u * e + 3u] = h4.w;
        }
    }
    workgroupBarrier();

    // This lane's token of a block and its heads (4 hh .. 4 hh + 3; the upper lanes' heads are absent unless wide).
    let t = lane % 16u;
    let hh = lane / 16u;
    let heads = vec4<u32>(head0 + 4u * hh) + vec4<u32>(0u, 1u, 2u, 3u);
    let in_group = select(vec4<u32>(0u), vec4<u32>(1u),
                          vec4<u32>(4u * hh) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(select(0u, group, wide || hh == 0u)));
    let scr = sg * SCR;
    let pbase = sg * STEP * 16u * PV_N;
    let vbase = sg * 256u;
    let ninf4 = vec4<f32>(neg_inf());
    var m = ninf4;
    var l = vec4<f32>(0.0);
    var o: array<MatC, DT>;   // O^T [dim][head]: heads 0-7 (8-15 stay zero)
    for (var i = 0u; i < DT; i++) {
        o[i] = zero_sums();
    }
    let o_at = scr + 4u * (PV_N / 4u * (lane / 2u) + lane % 2u);   // lane l's heads 4 (l % 2) .. + 3 of row l / 2
    for (var u = 0u; u < STEP; u++) {   // P^T's columns past head 7 stay zero
        for (var e = 0u; e < 4u; e++) {
            s_p[pbase + (16u * u + t) * PV_N + 8u + 4u * hh + e] = 0.0h;
        }
    }

    // Block ids of this step's blocks kb + u SUBGROUPS (u < STEP); the next step's are fetched a step ahead.
    var kb = sg;
    var phys: array<i32, STEP>;
    for (var u = 0u; u < STEP; u++) {
        let bk = kb + u * SUBGROUPS;
        phys[u] = -1;
        if (bk < blocks) {
            if (u == 0u && window0 == 0u) {
                phys[u] = early_phys;
            } else {
                phys[u] = physical_block(row + start / BS + bk);
            }
        }
    }
    var kt: array<MatA, STEP * DT>;
    var vt: array<MatA, STEP * DT>;
    for (; kb < blocks; kb += STEP * SUBGROUPS) {
        var next_phys: array<i32, STEP>;
        for (var u = 0u; u < STEP; u++) {
            let bk = kb + (STEP + u) * SUBGROUPS;
            next_phys[u] = -1;
            if (bk < blocks) {
                next_phys[u] = physical_block(row + start / BS + bk);
            }
        }
        for (var u = 0u; u < STEP; u++) {
            let base = start + (kb + u * SUBGROUPS) * BS;
            let whole = phys[u] >= 0 && base + BS <= end;
            let b = u32(max(phys[u], 0));
            if (whole) {
                for (var j = 0u; j < DT; j++) {
                    kt[u * DT + j] = key_tile_load(key_tile(b, kv_head, j));
                }
            } else if (phys[u] >= 0) {
                // Keys through shared memory, zeros for the tokens not there (0 * NaN is NaN). Lane l: token l % 16
                // of chunk 2 j + l / 16, 8 halves.
                for (var j = 0u; j < DT; j++) {
                    let src = key_tile(b, kv_head, j) + 8u * lane;
                    let keep = base + lane % 16u < end;
                    for (var e = 0u; e < 8u; e++) {
                        var x = 0.0h;
                        if (keep) {
                            x = key_cache[src + e];
                        }
                        s_v[vbase + 8u * lane + e] = x;
                    }
                    subgroupBarrier();
                    kt[u * DT + j] = staged_tile_load(vbase);
                    subgroupBarrier();
                }
            }
            if (whole) {
                for (var i = 0u; i < DT; i++) {
                    vt[u * DT + i] = value_tile_load(value_tile(b, kv_head, i));
                }
            }
        }

        // S: each block's logits, through shared memory to the lanes (block u's at scr + 512 u).
        var x: array<vec4<f32>, STEP>;
        for (var u = 0u; u < STEP; u++) {
            x[u] = ninf4;
            if (phys[u] < 0) {
                continue;
            }
            let su = scr + 512u * u;
            var sa = zero_sums();
            for (var j = 0u; j < DT; j++) {
                sa = multiply_add(kt[u * DT + j], query_load(j * 256u), sa);
            }
            scratch_store(sa, su);
            if (wide) {
                var sb = zero_sums();
                for (var j = 0u; j < DT; j++) {
                    sb = multiply_add(kt[u * DT + j], query_load((DT + j) * 256u), sb);
                }
                scratch_store(sb, su + 256u);
            }
        }
        subgroupBarrier();
        for (var u = 0u; u < STEP; u++) {
            if (phys[u] < 0) {
                continue;
            }
            // Token t = 2 r + p: row r (chunks 2j) column 4p + h, plus row r + 8 (chunks 2j + 1) column 8 + 4p + h.
            let at = scr + 512u * u + 256u * hh + 16u * (t / 2u) + 4u * (t % 2u);
            let dot4 = scr4(at) + scr4(at + 136u);
            let key = start + (kb + u * SUBGROUPS) * BS + t;
            let keys = select(vec4<u32>(0u), in_group * seq_len, key < end);
            x[u] = logits4(dot4 * pc.scale, heads, key, vec4<u32>(last), keys);
        }
        subgroupBarrier();   // read before the next step's products overwrite it

        // P: each head's max over the step's blocks and the 16 lanes of its half, the lazy rescale, the weights.
        var bmax = x[0];
        for (var u = 1u; u < STEP; u++) {
            bmax = max(bmax, x[u]);
        }
        for (var s = 1u; s < 16u; s <<= 1u) {
            bmax = max(bmax, subgroupShuffleXor(bmax, s));
        }
        if (subgroupAny(any(bmax > m + RESCALE_MARGIN))) {
            let n = max(m, bmax);
            let alpha = select(exp(m - n), vec4<f32>(1.0), n == ninf4);
            m = n;
            l *= alpha;
            let alpha_a = subgroupShuffle(alpha, 0u);
            let alpha_b = subgroupShuffle(alpha, 16u);
            let f = select(alpha_b, alpha_a, lane % 2u == 0u);
            // O^T [dim][head] a tile at a time: lane l scales row l / 2, heads 4 (l % 2) .. 4 (l % 2) + 3.
            for (var i = 0u; i < DT; i++) {
                scratch_store(o[i], scr);
                subgroupBarrier();
                scr4_scale(o_at, f);
                subgroupBarrier();
                o[i] = scratch_load(scr);
                subgroupBarrier();
            }
        }
        for (var u = 0u; u < STEP; u++) {
            let p = nan_safe_exp(x[u], m);
            l += p;
            if (phys[u] < 0) {
                continue;
            }
            let pw = vec4<f16>(p);
            for (var e = 0u; e < 4u; e++) {
                s_p[pbase + (16u * u + t) * PV_N + 4u * hh + e] = pw[e];
            }
            let base = start + (kb + u * SUBGROUPS) * BS;
            if (base + BS > end) {   // V^T through shared memory, zeros for the tokens not there
                let t0 = 8u * (lane % 2u);
                let b = u32(phys[u]);
                for (var i = 0u; i < DT; i++) {
                    let src = value_tile(b, kv_head, i) + 8u * lane;   // row lane / 2, tokens t0 .. t0 + 7
                    for (var e = 0u; e < 8u; e++) {
                        var y = 0.0h;
                        if (base + t0 + e < end) {
                            y = value_cache[src + e];
                        }
                        s_v[vbase + 8u * lane + e] = y;
                    }
                    subgroupBarrier();
                    vt[u * DT + i] = staged_tile_load(vbase);
                    subgroupBarrier();
                }
            }
        }
        subgroupBarrier();
        for (var u = 0u; u < STEP; u++) {
            if (phys[u] < 0) {
                continue;
            }
            let pt = weights_load(pbase + 16u * u * PV_N);
            for (var i = 0u; i < DT; i++) {
                o[i] = multiply_add(vt[u * DT + i], pt, o[i]);
            }
        }
        subgroupBarrier();   // P^T read before the next step's weights overwrite it
        phys = next_phys;
    }

    // The subgroups' states meet: each head's max M over the subgroups, each subgroup's sums scaled to it.
    for (var s = 1u; s < 16u; s <<= 1u) {
        l += subgroupShuffleXor(l, s);
    }
    if (lane % 16u == 0u) {
        s_ml[sg * 4u + hh] = m;
        s_ml[sg * 4u + 2u + hh] = l;
    }
    workgroupBarrier();
    var mm_a = ninf4;
    var mm_b = ninf4;
    for (var s = 0u; s < SUBGROUPS; s++) {
        mm_a = max(mm_a, s_ml[s * 4u]);
        mm_b = max(mm_b, s_ml[s * 4u + 1u]);
    }
    var l_a = vec4<f32>(0.0);
    var l_b = vec4<f32>(0.0);
    for (var s = 0u; s < SUBGROUPS; s++) {
        l_a += s_ml[s * 4u + 2u] * select(exp(s_ml[s * 4u] - mm_a), vec4<f32>(0.0), mm_a == ninf4);
        l_b += s_ml[s * 4u + 3u] * select(exp(s_ml[s * 4u + 1u] - mm_b), vec4<f32>(0.0), mm_b == ninf4);
    }
    // Each subgroup's sums, scaled to the workgroup's max, into its own part of s_o: lane l takes row l / 2 (a
    // head dim) and heads 4 (l % 2) .. 4 (l % 2) + 3 of each tile.
    let f_a = select(exp(s_ml[sg * 4u] - mm_a), vec4<f32>(0.0), mm_a == ninf4);
    let f_b = select(exp(s_ml[sg * 4u + 1u] - mm_b), vec4<f32>(0.0), mm_b == ninf4);
    let f = select(f_b, f_a, lane % 2u == 0u);
    for (var i = 0u; i < DT; i++) {
        scratch_store(o[i], scr);
        subgroupBarrier();
        let v = scr4(o_at) * f;
        for (var h = 0u; h < 4u; h++) {
            s_o[(sg * MAX_GROUP + 4u * (lane % 2u) + h) * D + 16u * i + lane / 2u] = v[h];
        }
        subgroupBarrier();
    }
    workgroupBarrier();

    // Normalized and written two dims at a time, as paged_decode.wgsl writes them.
    let half_hs = D / 2u;
    for (var i = tid; i < group * half_hs; i += WG) {
        let g = i / half_hs;
        let d0 = 2u * (i % half_hs);
        var o2 = vec2<f32>(0.0);
        for (var s = 0u; s < SUBGROUPS; s++) {
            o2 += vec2<f32>(s_o[(s * MAX_GROUP + g) * D + d0], s_o[(s * MAX_GROUP + g) * D + d0 + 1u]);
        }
        let lo = g < 4u;
        let lg = select(l_b[g & 3u], l_a[g & 3u], lo);
        let mg = select(mm_b[g & 3u], mm_a[g & 3u], lo);
        let head = head0 + g;
        write_output_pair(seq, head, part, d0, D, o2, mg, lg);
    }
}
