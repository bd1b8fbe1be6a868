// Merges the partitions of a split decode, WGSL: shaders/paged_decode_reduce.comp translated statement for
// statement, with the same interface (PAGED_DECODE_REDUCE in pagedvk/abi.py); the GLSL source explains it.

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
        || (slot0 + pc.num_partitions) * hs > 2u * arrayLength(&partial_out)) {
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
    for (var i = 0u; i < parts; i++) {
        m = max(m, partial_stats[slot0 + i].x);
    }
    var acc = vec2<f32>(0.0);
    var total = 0.0;
    let d0 = 2u * tid;
    for (var i = 0u; i < parts; i++) {
        let ml = partial_stats[slot0 + i];
        if (ml.y <= 0.0) {
            continue;    // a partition with no valid token
        }
        let w = ml.y * exp(ml.x - m);
        total += w;
        if (d0 < hs) {
            acc += w * partial_out[((slot0 + i) * hs + d0) >> 1u];
        }
    }
    var sink = neg_inf();
    if ((pc.variants & VARIANT_SINKS) != 0u && head < arrayLength(&sinks)) {
        sink = sinks[head];
    }
    let fin = softmax_finish(m, total, sink);
    if (d0 < hs) {
        out[(o + d0) >> 1u] = out_pair(acc * (fin.x * pc.v_scale));
    }
    let row = seq * pc.num_heads + head;
    if (tid == 0u && (pc.variants & VARIANT_LSE) != 0u && row < arrayLength(&lse)) {
        lse[row] = fin.y;
    }
}
