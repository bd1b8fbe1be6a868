// Paged-attention decode, WGSL: shaders/paged_decode.comp translated statement for statement, with the
// same interface (PAGED_DECODE in pagedvk/abi.py) so one launcher runs either module. The algorithm and
// its bounds rules are explained in the GLSL source; comments here cover what WGSL changes.
//
// This module is the f32 storage variant: WGSL has no preprocessor, so the CHUNK_DOT macros of
// kv_storage.glsl are functions over vec4<f32> bitcast from the 16-byte chunks.

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_size: u32,
    block_size: u32,
    max_blocks_per_seq: u32,
    num_blocks: u32,
    scale: f32,
}

@group(0) @binding(0) var<storage, read> query: array<f32>;                // [seqs, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<vec4<u32>>;      // [blocks, kv_heads, head_size/x, block_size, x]
@group(0) @binding(2) var<storage, read> value_cache: array<vec4<u32>>;    // [blocks, kv_heads, head_size, block_size]
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;         // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;             // [seqs]
@group(0) @binding(5) var<storage, read_write> out: array<f32>;            // [seqs, heads, head_size]
var<immediate> pc: Params;

const WG: u32 = 128u;              // == workgroup_size == TILE
const TILE: u32 = 128u;
const MAX_HEAD_SIZE: u32 = 256u;
const MAX_TILE_BLOCKS: u32 = 16u;  // TILE / smallest block size (8)
const CHUNK: u32 = 4u;             // f32 elements per 16-byte chunk
// -inf cannot be a WGSL constant (constant expressions must be finite); bitcast it at run time.
const NEG_INF_BITS: u32 = 0xff800000u;

var<workgroup> s_q: array<f32, MAX_HEAD_SIZE>;     // query * scale
var<workgroup> s_red: array<f32, WG>;              // reduction scratch
var<workgroup> s_p: array<f32, TILE>;              // the tile's softmax weights
var<workgroup> s_phys: array<i32, MAX_TILE_BLOCKS>; // the tile's physical block ids, -1 where out of range

fn s_q4(base: u32) -> vec4<f32> {
    return vec4<f32>(s_q[base], s_q[base + 1u], s_q[base + 2u], s_q[base + 3u]);
}

fn s_p4(base: u32) -> vec4<f32> {
    return vec4<f32>(s_p[base], s_p[base + 1u], s_p[base + 2u], s_p[base + 3u]);
}

// dot of a value chunk with the weights of its n (<= CHUNK) tokens: lanes past the end of a sequence may
// hold anything, NaN included, and 0 * NaN is NaN, so they are skipped rather than weighted by zero.
fn chunk_dot_n(c: vec4<u32>, base: u32, n: u32) -> f32 {
    let v = bitcast<vec4<f32>>(c);
    if (n == CHUNK) {
        return dot(v, s_p4(base));
    }
    var s = 0.0;
    for (var i = 0u; i < n; i++) {
        s += v[i] * s_p[base + i];
    }
    return s;
}

fn workgroup_max(v: f32, tid: u32) -> f32 {
    s_red[tid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (tid < stride) {
            s_red[tid] = max(s_red[tid], s_red[tid + stride]);
        }
        workgroupBarrier();
    }
    let r = s_red[0];
    workgroupBarrier();
    return r;
}

fn workgroup_sum(v: f32, tid: u32) -> f32 {
    s_red[tid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (tid < stride) {
            s_red[tid] += s_red[tid + stride];
        }
        workgroupBarrier();
    }
    let r = s_red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let neg_inf = bitcast<f32>(NEG_INF_BITS);
    let tid = lid.x;
    let head = wid.x;
    let seq = wid.y;
    let hs = pc.head_size;
    let bs = pc.block_size;
    let kv_head = head / (pc.num_heads / pc.num_kv_heads);
    let chunks_per_head = hs / CHUNK;
    let chunks_per_block = pc.num_kv_heads * hs * bs / CHUNK;
    let q_base = (seq * pc.num_heads + head) * hs;
    if (q_base + hs > arrayLength(&query) || q_base + hs > arrayLength(&out)) {
        return;
    }

    // num_blocks is set by the launcher from the bound buffers' sizes: the caches' arrayLength() is not
    // used because NVIDIA's driver (580) returns a wrong one for bindings of 2 GiB and more.
    let num_blocks = pc.num_blocks;
    let row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let head_chunk0 = kv_head * hs * bs / CHUNK;

    for (var i = tid; i < hs; i += WG) {
        s_q[i] = query[q_base + i] * pc.scale;
    }

    var m = neg_inf;
    var l = 0.0;
    var acc0 = 0.0;
    var acc1 = 0.0;
    let d0 = tid;
    let d1 = tid + WG;

    for (var base = 0u; base < seq_len; base += TILE) {
        let tile_len = min(TILE, seq_len - base);
        let tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            let b = block_tables[row + base / bs + tid];
            s_phys[tid] = select(-1, b, b >= 0 && u32(b) < num_blocks);
        }
        workgroupBarrier();

        // A: one token's logit per thread.
        var logit = neg_inf;
        if (tid < tile_len) {
            let phys = s_phys[tid / bs];
            if (phys >= 0) {
                let k = u32(phys) * chunks_per_block + kv_head * chunks_per_head * bs + tid % bs;
                var s = 0.0;
                for (var c = 0u; c < chunks_per_head; c++) {
                    s += dot(bitcast<vec4<f32>>(key_cache[k + c * bs]), s_q4(c * CHUNK));
                }
                logit = s;
            }
        }

        // B: online softmax across tiles.
        let m_new = max(m, workgroup_max(logit, tid));
        let alpha = select(exp(m - m_new), 1.0, m_new == neg_inf);
        let p = select(exp(logit - m_new), 0.0, logit == neg_inf);
        m = m_new;
        l = l * alpha + p;
        acc0 *= alpha;
        acc1 *= alpha;
        s_p[tid] = p;
        workgroupBarrier();

        // C: weighted values, one value chunk (CHUNK tokens of one head dim) at a time.
        for (var b = 0u; b < tile_blocks; b++) {
            let phys = s_phys[b];
            if (phys < 0) {
                continue;
            }
            let v_dim0 = u32(phys) * chunks_per_block + head_chunk0;
            for (var j = 0u; j < bs / CHUNK; j++) {
                let t0 = b * bs + j * CHUNK;
                if (t0 >= tile_len) {
                    break;
                }
                let n = min(CHUNK, tile_len - t0);
                if (d0 < hs) {
                    acc0 += chunk_dot_n(value_cache[v_dim0 + d0 * (bs / CHUNK) + j], t0, n);
                }
                if (d1 < hs) {
                    acc1 += chunk_dot_n(value_cache[v_dim0 + d1 * (bs / CHUNK) + j], t0, n);
                }
            }
        }
        workgroupBarrier();
    }

    let denom = workgroup_sum(l, tid);
    let inv = select(0.0, 1.0 / denom, denom > 0.0);
    if (d0 < hs) {
        out[q_base + d0] = acc0 * inv;
    }
    if (d1 < hs) {
        out[q_base + d1] = acc1 * inv;
    }
}
