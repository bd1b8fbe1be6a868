// Merges two attention results over disjoint sets of keys, WGSL: shaders/merge_states.comp translated
// statement for statement, with the same interface (MERGE_STATES in pagedvk/abi.py); the GLSL source explains it.
// out_a, out_b and out are of the type pc.q_type names, bound as 32-bit words (q_any.wgsl).

//!include q_storage.wgsl
//!include q_output.wgsl
//!include attention_common.wgsl

@group(0) @binding(0) var<storage, read> out_a: array<u32>;            // [rows, head_size]
@group(0) @binding(1) var<storage, read> lse_a: array<f32>;            // [rows]
@group(0) @binding(2) var<storage, read> out_b: array<u32>;
@group(0) @binding(3) var<storage, read> lse_b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
var<immediate> pc: Params;

const KV_CHUNK_QUADS: u32 = 1u;   // no cache here: attention_common.wgsl's key addressing goes unused

// Quad i of out_a and of out_b, and output pair p (q_any.wgsl).
fn out_a_quad(i: u32) -> vec4<f32> {
    let n = q_quad_words();
    let w = n * i;
    var x = vec4<u32>(out_a[w], out_a[w + 1u], 0u, 0u);
    if (n == 4u) {
        x.z = out_a[w + 2u];
        x.w = out_a[w + 3u];
    }
    return q_quad_of(x);
}

fn out_b_quad(i: u32) -> vec4<f32> {
    let n = q_quad_words();
    let w = n * i;
    var x = vec4<u32>(out_b[w], out_b[w + 1u], 0u, 0u);
    if (n == 4u) {
        x.z = out_b[w + 2u];
        x.w = out_b[w + 3u];
    }
    return q_quad_of(x);
}


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
    if (i >= q_quads(arrayLength(&out_a)) || i >= q_quads(arrayLength(&out_b))
        || 2u * i + 1u >= q_pairs(arrayLength(&out))
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
            o += (wa / total) * out_a_quad(i);
        }
        if (sb != neg_inf()) {
            o += (wb / total) * out_b_quad(i);
        }
        s = m + log(total);
    }
    out_store(2u * i, o.xy);
    out_store(2u * i + 1u, o.zw);
    if (i % hq == 0u) {
        lse[row] = s;
    }
}
