// Merges the partitions of a split decode, WGSL, with the interface of shaders/paged_decode_reduce.comp
// (PAGED_DECODE_REDUCE in pagedvk/abi.py) and the algorithm of shaders/decode_merge.glsl, which explains it, with a
// pair of head dims a thread where the GLSL merge takes a quad (its loops left to the driver to unroll).
// out is of the type pc.q_type names, bound as 32-bit words (q_any.wgsl).

//!include q_storage.wgsl
//!include q_output.wgsl
//!include attention_common.wgsl

@group(0) @binding(0) var<storage, read> seq_lens: array<i32>;                 // [seqs]
@group(0) @binding(1) var<storage, read> partial_out: array<vec2<f32>>;        // [seqs, heads, partitions, head_size]
@group(0) @binding(2) var<storage, read> partial_stats: array<vec2<f32>>;      // [seqs, heads, partitions]
@group(0) @binding(3) var<storage, read_write> out: array<u32>;                // [seqs, heads, head_size]
@group(0) @binding(4) var<storage, read> sinks: array<f32>;                    // [heads] (VARIANT_SINKS)
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;                // [seqs, heads] (VARIANT_LSE)
var<immediate> pc: Params;

const KV_CHUNK_QUADS: u32 = 1u;   // no cache here: attention_common.wgsl's key addressing goes unused

const UNROLL: u32 = 16u;    // partitions a thread loads before it uses any
var<workgroup> s_ml: array<vec2<f32>, WG>;     // each thread's (max, sum)
var<workgroup> s_acc: array<vec2<f32>, WG>;    // and its weighted sum of outputs, scaled to its max


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
    let o = out_token(seq) + head * hs;
    let slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > 2u * q_pairs(arrayLength(&out)) || slot0 + pc.num_partitions > arrayLength(&partial_stats)
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

    var sink = neg_inf();
    if ((pc.variants & VARIANT_SINKS) != 0u && head < arrayLength(&sinks)) {
        sink = sinks[head];
    }
    let pairs = hs / 2u;
    let lanes = WG / pairs;
    let pair = tid % pairs;
    let lane = tid / pairs;
    var m = neg_inf();        // this thread's max, and its sum of weights scaled to it
    var total = 0.0;
    var acc = vec2<f32>(0.0);
    var j = lane;
    loop {
        var ml: array<vec2<f32>, UNROLL>;
        var x: array<vec2<f32>, UNROLL>;
        for (var u = 0u; u < UNROLL; u++) {
            let k = j + u * lanes;
            ml[u] = vec2<f32>(neg_inf(), 0.0);
            x[u] = vec2<f32>(0.0);
            if (lane < lanes && k < pc.num_partitions) {
                ml[u] = partial_stats[slot0 + k];
                x[u] = partial_out[(slot0 + k) * pairs + pair];
            }
        }
        // A partition past the sequence's, or with no valid token (sum 0: its output was never written), is none; a NaN
        // sum (a NaN logit: float64 makes the head NaN) is kept, and poisons the result.
        var top = m;
        for (var u = 0u; u < UNROLL; u++) {
            if (j + u * lanes >= parts || ml[u].y == 0.0) {
                ml[u] = vec2<f32>(neg_inf(), 0.0);
            }
            top = max(top, ml[u].x);
        }
        if (top > m) {
            let alpha = select(exp(m - top), 0.0, m == neg_inf());
            total *= alpha;
            acc *= alpha;
            m = top;
        }
        for (var u = 0u; u < UNROLL; u++) {
            if (ml[u].y != 0.0) {   // NaN included (build_shaders.unordered_not_equal): it poisons the merge
                let w = ml[u].y * exp(ml[u].x - m);
                total += w;
                acc += w * x[u];
            }
        }
        j += UNROLL * lanes;
        continuing {
            break if !(lane < lanes && j < parts);
        }
    }

    // The lanes meet: each pair's lane 0 sums the others', scaled to their common max.
    s_ml[tid] = vec2<f32>(m, total);
    s_acc[tid] = acc;
    workgroupBarrier();
    if (lane == 0u) {
        for (var l = 1u; l < lanes; l++) {
            let other = s_ml[l * pairs + pair];
            let top = max(m, other.x);
            if (top == neg_inf()) {   // no key on either side: sums are 0, or NaN that must carry
                total += other.y;
                acc += s_acc[l * pairs + pair];
                continue;
            }
            let a = select(exp(m - top), 0.0, m == neg_inf());
            let b = select(exp(other.x - top), 0.0, other.x == neg_inf());
            total = total * a + other.y * b;
            acc = acc * a + s_acc[l * pairs + pair] * b;
            m = top;
        }
    }
    let fin = softmax_finish(m, total, sink);
    if (lane == 0u) {
        out_store((o >> 1u) + pair, acc * (fin.x * pc.v_scale));
    }
    let row = seq * pc.num_heads + head;
    if (tid == 0u && (pc.variants & VARIANT_LSE) != 0u && row < arrayLength(&lse)) {
        lse[row] = fin.y;
    }
}
