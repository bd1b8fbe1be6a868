// Merges the partitions of a split decode, WGSL: shaders/paged_decode_reduce.comp translated statement for
// statement (its loops left to the driver to unroll), with the same interface (PAGED_DECODE_REDUCE in
// pagedvk/abi.py); the GLSL source explains it.

//!include q_storage.wgsl
//!include attention_common.wgsl

@group(0) @binding(0) var<storage, read> seq_lens: array<i32>;                 // [seqs]
@group(0) @binding(1) var<storage, read> partial_out: array<vec2<f32>>;        // [seqs, heads, partitions, head_size]
@group(0) @binding(2) var<storage, read> partial_stats: array<vec2<f32>>;      // [seqs, heads, partitions]
@group(0) @binding(3) var<storage, read_write> out: array<OutPair>;            // [seqs, heads, head_size]
@group(0) @binding(4) var<storage, read> sinks: array<f32>;                    // [heads] (VARIANT_SINKS)
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;                // [seqs, heads] (VARIANT_LSE)
var<immediate> pc: Params;

const KV_CHUNK_QUADS: u32 = 1u;   // no cache here: attention_common.wgsl's key addressing goes unused

const CHUNK: u32 = 512u;    // partitions whose weights shared memory holds at a time
const UNROLL: u32 = 8u;     // partial outputs a thread loads before it uses any
var<workgroup> s_w: array<f32, CHUNK>;
var<workgroup> s_red: array<f32, WG>;
var<workgroup> s_acc: array<vec2<f32>, WG>;

// Max (is_max) or sum of every thread's x; every thread gets the result. Barriers on both sides.
fn workgroup_reduce(tid: u32, x: f32, is_max: bool) -> f32 {
    workgroupBarrier();
    s_red[tid] = x;
    workgroupBarrier();
    for (var half_ = WG / 2u; half_ > 0u; half_ >>= 1u) {
        if (tid < half_) {
            s_red[tid] = select(s_red[tid] + s_red[tid + half_], max(s_red[tid], s_red[tid + half_]), is_max);
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&s_red[0]);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let wg = workgroup_index(wid, nwg);
    let head = wg % pc.num_heads;
    let seq = wg / pc.num_heads;
    let hs = pc.head_size;
    if (seq >= pc.num_seqs || pc.partition_size == 0u) {
        return;
    }
    let o = (seq * pc.num_heads + head) * hs;
    let slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > 2u * arrayLength(&out) || slot0 + pc.num_partitions > arrayLength(&partial_stats)
        || (slot0 + pc.num_partitions) * hs > 2u * arrayLength(&partial_out) || hs > 2u * WG) {
        return;
    }
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = u32(max(seq_lens[seq], 0));
    }
    let seq_keys = min(seq_len, pc.max_blocks_per_seq * pc.block_size);   // as the decode bounds it
    let first = min(window_first_key(seq_keys - 1u), seq_keys) & ~(pc.block_size - 1u);
    let parts = min(pc.num_partitions, (seq_keys - first + pc.partition_size - 1u) / pc.partition_size);

    var m = neg_inf();
    for (var i = tid; i < parts; i += WG) {
        m = max(m, partial_stats[slot0 + i].x);
    }
    m = workgroup_reduce(tid, m, true);

    let pairs = hs / 2u;
    let lanes = WG / pairs;
    let pair = tid % pairs;
    let lane = tid / pairs;
    var acc = vec2<f32>(0.0);
    var total = 0.0;
    for (var c0 = 0u; c0 < parts; c0 += CHUNK) {
        let n = min(CHUNK, parts - c0);
        workgroupBarrier();   // the previous chunk's weights are read
        for (var j = tid; j < n; j += WG) {
            let ml = partial_stats[slot0 + c0 + j];
            var w = 0.0;      // a partition with no valid token: none
            if (ml.y > 0.0) {
                w = ml.y * exp(ml.x - m);
            }
            s_w[j] = w;
            total += w;
        }
        workgroupBarrier();
        for (var j = lane; lane < lanes && j < n; j += UNROLL * lanes) {
            var x: array<vec2<f32>, UNROLL>;
            for (var u = 0u; u < UNROLL; u++) {
                let k = j + u * lanes;
                x[u] = vec2<f32>(0.0);
                if (k < n && s_w[k] > 0.0) {   // an empty partition's output was never written: not read
                    x[u] = partial_out[(slot0 + c0 + k) * pairs + pair];
                }
            }
            for (var u = 0u; u < UNROLL; u++) {
                let k = j + u * lanes;
                if (k < n) {
                    acc += s_w[k] * x[u];
                }
            }
        }
    }
    total = workgroup_reduce(tid, total, false);
    s_acc[tid] = acc;
    workgroupBarrier();
    if (lane == 0u) {
        for (var l = 1u; l < lanes; l++) {
            acc += s_acc[l * pairs + pair];
        }
    }
    var sink = neg_inf();
    if ((pc.variants & VARIANT_SINKS) != 0u && head < arrayLength(&sinks)) {
        sink = sinks[head];
    }
    let fin = softmax_finish(m, total, sink);
    if (lane == 0u) {
        out[(o >> 1u) + pair] = out_pair(acc * (fin.x * pc.v_scale));
    }
    let row = seq * pc.num_heads + head;
    if (tid == 0u && (pc.variants & VARIANT_LSE) != 0u && row < arrayLength(&lse)) {
        lse[row] = fin.y;
    }
}
