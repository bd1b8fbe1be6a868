// Merges the partitions of a split decode, WGSL: shaders/paged_decode_reduce.comp translated statement for
// statement, with the same interface (PAGED_DECODE_REDUCE in pagedvk/abi.py); the GLSL source explains it.

struct Params {
    num_heads: u32,
    head_size: u32,
    partition_size: u32,
    num_partitions: u32,
}

@group(0) @binding(0) var<storage, read> seq_lens: array<i32>;                 // [seqs]
@group(0) @binding(1) var<storage, read> partial_out: array<f32>;              // [seqs, heads, partitions, head_size]
@group(0) @binding(2) var<storage, read> partial_stats: array<vec2<f32>>;      // [seqs, heads, partitions]
@group(0) @binding(3) var<storage, read_write> out: array<f32>;                // [seqs, heads, head_size]
var<immediate> pc: Params;

const WG: u32 = 128u;
const NEG_INF_BITS: u32 = 0xff800000u;

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tid = lid.x;
    let head = wid.x;
    let seq = wid.y;
    let hs = pc.head_size;
    let o = (seq * pc.num_heads + head) * hs;
    let slot0 = (seq * pc.num_heads + head) * pc.num_partitions;
    if (o + hs > arrayLength(&out) || slot0 + pc.num_partitions > arrayLength(&partial_stats)
        || (slot0 + pc.num_partitions) * hs > arrayLength(&partial_out)) {
        return;
    }
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = u32(max(seq_lens[seq], 0));
    }
    let parts = min(pc.num_partitions, (seq_len + pc.partition_size - 1u) / pc.partition_size);

    var m = bitcast<f32>(NEG_INF_BITS);
    for (var i = 0u; i < parts; i++) {
        m = max(m, partial_stats[slot0 + i].x);
    }
    var acc0 = 0.0;
    var acc1 = 0.0;
    var total = 0.0;
    let d0 = tid;
    let d1 = tid + WG;
    for (var i = 0u; i < parts; i++) {
        let ml = partial_stats[slot0 + i];
        if (ml.y <= 0.0) {
            continue;    // a partition with no valid token
        }
        let w = ml.y * exp(ml.x - m);
        total += w;
        if (d0 < hs) {
            acc0 += w * partial_out[(slot0 + i) * hs + d0];
        }
        if (d1 < hs) {
            acc1 += w * partial_out[(slot0 + i) * hs + d1];
        }
    }
    let inv = select(0.0, 1.0 / total, total > 0.0);
    if (d0 < hs) {
        out[o + d0] = acc0 * inv;
    }
    if (d1 < hs) {
        out[o + d1] = acc1 * inv;
    }
}
