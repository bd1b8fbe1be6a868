// Paged-attention decode, WGSL: shaders/paged_decode.comp translated statement for statement, with the
// same interface (PAGED_DECODE in pagedvk/abi.py) so one launcher runs either module. The algorithm and
// its bounds rules are explained in the GLSL source; comments here cover what WGSL changes.
//
// This module is the f32 storage variant: WGSL has no preprocessor, so the chunk macros of
// kv_storage.glsl are bitcasts of the 16-byte chunks. HEAD_SIZE is an override that build_shaders.py
// fixes at translation time (naga writes no specialization constants); 0 means "from the push constants".

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_size: u32,
    block_size: u32,
    max_blocks_per_seq: u32,
    num_blocks: u32,
    scale: f32,
    group_size: u32,
    partition_size: u32,
    num_partitions: u32,
}

@group(0) @binding(0) var<storage, read> query: array<vec4<f32>>;          // [seqs, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<vec4<u32>>;      // [blocks, kv_heads, head_size/x, block_size, x]
@group(0) @binding(2) var<storage, read> value_cache: array<vec4<u32>>;    // [blocks, kv_heads, head_size, block_size]
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;         // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;             // [seqs]
@group(0) @binding(5) var<storage, read_write> out: array<f32>;            // [seqs, heads, head_size]
@group(0) @binding(6) var<storage, read_write> partial_out: array<f32>;    // [seqs, heads, partitions, head_size]
@group(0) @binding(7) var<storage, read_write> partial_stats: array<vec2<f32>>; // [seqs, heads, partitions]
var<immediate> pc: Params;

override HEAD_SIZE: u32 = 0u;

const WG: u32 = 128u;
const MAX_GROUP: u32 = 8u;
const MAX_HEAD_SIZE: u32 = 256u;
const LOGIT_SLOTS: u32 = 4096u;
const MIN_BLOCK_SIZE: u32 = 8u;
const CHUNK: u32 = 4u;             // f32 elements per 16-byte chunk
// -inf cannot be a WGSL constant (constant expressions must be finite); bitcast it at run time.
const NEG_INF_BITS: u32 = 0xff800000u;

var<workgroup> s_q: array<vec4<f32>, 512>;     // MAX_GROUP * MAX_HEAD_SIZE / 4: queries * scale, [group][chunk]
var<workgroup> s_p: array<vec4<f32>, 1024>;    // LOGIT_SLOTS / 4: logits, then weights, [group][token]
var<workgroup> s_red: array<f32, 1024>;        // MAX_GROUP * WG: reduction scratch, [group][thread]
var<workgroup> s_phys: array<i32, 512>;        // LOGIT_SLOTS / MIN_BLOCK_SIZE: physical blocks, -1 where invalid

// The first n (<= CHUNK) elements of a chunk, the rest zero: elements past the end of a sequence may hold
// anything, NaN included, and 0 * NaN is NaN.
fn chunk_first(v: vec4<f32>, n: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), v, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(n));
}

// Reduce v[g] over the workgroup for every g < group; max when is_max, else sum.
fn workgroup_reduce(v: ptr<function, array<f32, 8>>, group: u32, is_max: bool, tid: u32) {
    for (var g = 0u; g < group; g++) {
        s_red[g * WG + tid] = (*v)[g];
    }
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (tid < stride) {
            for (var g = 0u; g < group; g++) {
                let a = s_red[g * WG + tid];
                let b = s_red[g * WG + tid + stride];
                s_red[g * WG + tid] = select(a + b, max(a, b), is_max);
            }
        }
        workgroupBarrier();
    }
    for (var g = 0u; g < group; g++) {
        (*v)[g] = s_red[g * WG];
    }
    workgroupBarrier();
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let neg_inf = bitcast<f32>(NEG_INF_BITS);
    let tid = lid.x;
    let seq = wid.y;
    let part = wid.z;
    let hs = select(pc.head_size, HEAD_SIZE, HEAD_SIZE > 0u);
    let bs = pc.block_size;
    let group = pc.group_size;
    let P = pc.partition_size;
    let head0 = wid.x * group;
    let kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    let chunks_per_head = hs / CHUNK;
    let chunks_per_block = pc.num_kv_heads * hs * bs / CHUNK;
    let q_chunk0 = (seq * pc.num_heads + head0) * chunks_per_head;
    if (group > MAX_GROUP || group * P > LOGIT_SLOTS || hs > MAX_HEAD_SIZE
        || q_chunk0 + group * chunks_per_head > arrayLength(&query)) {
        return;
    }

    let row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let start = part * P;
    var part_len = 0u;
    if (start < seq_len) {
        part_len = min(P, seq_len - start);
    }
    let part_blocks = (part_len + bs - 1u) / bs;

    for (var i = tid; i < group * chunks_per_head; i += WG) {
        s_q[i] = query[q_chunk0 + i] * pc.scale;
    }
    for (var i = tid; i < part_blocks; i += WG) {
        let b = block_tables[row + start / bs + i];
        // num_blocks is set by the launcher from the bound caches' real size (see the GLSL source).
        s_phys[i] = select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
    }
    workgroupBarrier();

    // A: logits of whole tokens, and each thread's running max per head.
    var m: array<f32, 8>;
    for (var g = 0u; g < MAX_GROUP; g++) {
        m[g] = neg_inf;
    }
    let key_head = kv_head * chunks_per_head * bs;
    for (var t = tid; t < part_len; t += WG) {
        var s: array<f32, 8>;
        let phys = s_phys[t / bs];
        if (phys >= 0) {
            let k = u32(phys) * chunks_per_block + key_head + t % bs;
            for (var c = 0u; c < chunks_per_head; c++) {
                let kc = bitcast<vec4<f32>>(key_cache[k + c * bs]);
                for (var g = 0u; g < group; g++) {
                    s[g] += dot(kc, s_q[g * chunks_per_head + c]);
                }
            }
        }
        for (var g = 0u; g < group; g++) {
            let logit = select(neg_inf, s[g], phys >= 0);
            s_p[(g * P + t) >> 2u][t & 3u] = logit;
            m[g] = max(m[g], logit);
        }
    }
    workgroup_reduce(&m, group, true, tid);

    // B: weights; each thread sums the ones it wrote.
    var l: array<f32, 8>;
    for (var t = tid; t < part_len; t += WG) {
        for (var g = 0u; g < group; g++) {
            let logit = s_p[(g * P + t) >> 2u][t & 3u];
            let p = select(exp(logit - m[g]), 0.0, logit == neg_inf);
            s_p[(g * P + t) >> 2u][t & 3u] = p;
            l[g] += p;
        }
    }
    workgroupBarrier();

    // C: weighted values of head dims d0 and d1, one value chunk (CHUNK tokens of one dim) at a time.
    let d0 = tid;
    let d1 = tid + WG;
    var acc0: array<f32, 8>;
    var acc1: array<f32, 8>;
    let value_head = kv_head * hs * bs / CHUNK;
    let chunks_per_dim = bs / CHUNK;
    for (var b = 0u; b < part_blocks; b++) {
        let phys = s_phys[b];
        if (phys < 0) {
            continue;
        }
        let v_dim0 = u32(phys) * chunks_per_block + value_head;
        for (var j = 0u; j < chunks_per_dim; j++) {
            let t0 = b * bs + j * CHUNK;
            if (t0 >= part_len) {
                break;
            }
            let n = min(CHUNK, part_len - t0);
            var v0 = vec4<f32>(0.0);
            var v1 = vec4<f32>(0.0);
            if (d0 < hs) {
                v0 = chunk_first(bitcast<vec4<f32>>(value_cache[v_dim0 + d0 * chunks_per_dim + j]), n);
            }
            if (d1 < hs) {
                v1 = chunk_first(bitcast<vec4<f32>>(value_cache[v_dim0 + d1 * chunks_per_dim + j]), n);
            }
            for (var g = 0u; g < group; g++) {
                let p = chunk_first(s_p[(g * P + t0) >> 2u], n);
                acc0[g] += dot(v0, p);
                acc1[g] += dot(v1, p);
            }
        }
    }
    workgroup_reduce(&l, group, false, tid);

    for (var g = 0u; g < group; g++) {
        let head = head0 + g;
        let inv = select(0.0, 1.0 / l[g], l[g] > 0.0);
        if (pc.num_partitions == 1u) {
            let o = (seq * pc.num_heads + head) * hs;
            if (o + hs > arrayLength(&out)) {
                break;
            }
            if (d0 < hs) {
                out[o + d0] = acc0[g] * inv;
            }
            if (d1 < hs) {
                out[o + d1] = acc1[g] * inv;
            }
        } else {
            let slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= arrayLength(&partial_stats) || (slot + 1u) * hs > arrayLength(&partial_out)) {
                break;
            }
            if (d0 < hs) {
                partial_out[slot * hs + d0] = acc0[g] * inv;
            }
            if (d1 < hs) {
                partial_out[slot * hs + d1] = acc1[g] * inv;
            }
            if (tid == 0u) {
                partial_stats[slot] = vec2<f32>(m[g], l[g]);
            }
        }
    }
}
