// Merges two attention results over disjoint sets of keys, WGSL: shaders/merge_states.comp translated
// statement for statement, with the same interface (MERGE_STATES in pagedvk/abi.py); the GLSL source explains it.

//!include q_storage.wgsl
//!include attention_common.wgsl

@group(0) @binding(0) var<storage, read> out_a: array<QQuad>;          // [rows, head_size]
@group(0) @binding(1) var<storage, read> lse_a: array<f32>;            // [rows]
@group(0) @binding(2) var<storage, read> out_b: array<QQuad>;
@group(0) @binding(3) var<storage, read> lse_b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<OutPair>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
var<immediate> pc: Params;

const KV_CHUNK_QUADS: u32 = 1u;   // no cache here: attention_common.wgsl's key addressing goes unused

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let wg = workgroup_index(wid, nwg);
    let hq = pc.head_size / 4u;
    let i = wg * 128u + lid.x;
    if (hq == 0u || i >= pc.num_seqs * hq) {
        return;
    }
    let row = i / hq;
    if (i >= arrayLength(&out_a) || i >= arrayLength(&out_b) || 2u * i + 1u >= arrayLength(&out)
        || row >= arrayLength(&lse_a) || row >= arrayLength(&lse_b) || row >= arrayLength(&lse)) {
        return;
    }
    let sa = lse_a[row];
    let sb = lse_b[row];
    let m = max(sa, sb);
    var o = vec4<f32>(0.0);
    var s = neg_inf();
    if (m != neg_inf()) {
        let wa = exp(sa - m);
        let wb = exp(sb - m);
        let total = wa + wb;
        if (sa != neg_inf()) {
            o += (wa / total) * q_quad(out_a[i]);
        }
        if (sb != neg_inf()) {
            o += (wb / total) * q_quad(out_b[i]);
        }
        s = m + log(total);
    }
    out[2u * i] = out_pair(o.xy);
    out[2u * i + 1u] = out_pair(o.zw);
    if (i % hq == 0u) {
        lse[row] = s;
    }
}
