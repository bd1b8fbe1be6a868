// Paged-attention backward, its first dispatch, WGSL: shaders/paged_backward_delta.comp translated statement for
// statement, with the same interface (PAGED_BACKWARD_DELTA in pagedvk/abi.py): D = rowsum(dout * out) of every
// query row, float32 in lse's order, summed as paged_backward_dq.wgsl sums dP (the GLSL source explains why).
// dout and out are of the type pc.q_type names, bound as 32-bit words (q_any.wgsl).

//!include q_storage.wgsl
//!include attention_common.wgsl
//!include prefill_common.wgsl

@group(0) @binding(0) var<storage, read> query_start_loc: array<i32>;   // [seqs + 1]
@group(0) @binding(1) var<storage, read> dout: array<u32>;              // like query
@group(0) @binding(2) var<storage, read> out: array<u32>;               // like query
@group(0) @binding(3) var<storage, read_write> delta: array<f32>;      // like lse
var<immediate> pc: Params;

const KV_CHUNK_QUADS: u32 = 1u;   // no cache here: attention_common.wgsl's key addressing goes unused
const ROWS_PER_THREAD: u32 = 4u;  // abi.DELTA_ROWS_PER_THREAD
const NO_ROW: u32 = 0xffffffffu;

// Quad i of dout and of out (q_any.wgsl).
fn dout_quad(i: u32) -> vec4<f32> {
    let n = q_quad_words();
    let w = n * i;
    var x = vec4<u32>(dout[w], dout[w + 1u], 0u, 0u);
    if (n == 4u) {
        x.z = dout[w + 2u];
        x.w = dout[w + 3u];
    }
    return q_quad_of(x);
}

fn out_quad(i: u32) -> vec4<f32> {
    let n = q_quad_words();
    let w = n * i;
    var x = vec4<u32>(out[w], out[w + 1u], 0u, 0u);
    if (n == 4u) {
        x.z = out[w + 2u];
        x.w = out[w + 3u];
    }
    return q_quad_of(x);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let hs = pc.head_size;
    let hq = hs / 4u;
    if (hs > MAX_HEAD_SIZE || hq == 0u || pc.num_heads == 0u) {
        return;
    }
    // The batch's rows (num_tokens * num_heads), bounded by dout's and out's whole rows and by delta.
    let max_rows = min(q_quads(arrayLength(&dout)), q_quads(arrayLength(&out))) / hq;
    var tokens = 0u;
    if (pc.num_seqs < arrayLength(&query_start_loc)) {
        tokens = u32(max(query_start_loc[pc.num_seqs], 0));
    }
    let rows = min(min(tokens, max_rows / pc.num_heads) * pc.num_heads, arrayLength(&delta));
    let r0 = (workgroup_index(wid, nwg) * WG + lid.x) * ROWS_PER_THREAD;
    if (r0 >= rows) {
        return;
    }

    var qb = vec4<u32>(NO_ROW);   // each row's quad 0 in dout and out, or NO_ROW
    for (var i = 0u; i < 4u; i++) {
        if (r0 + i < rows) {
            qb[i] = (r0 + i) * hq;
        }
    }
    var d = vec4<f32>(0.0);
    for (var c = 0u; c < hq; c++) {
        var g = mat4x4<f32>();
        var o = mat4x4<f32>();   // column i: row i's out quad
        for (var i = 0u; i < 4u; i++) {
            if (qb[i] != NO_ROW) {
                g[i] = dout_quad(qb[i] + c);
                o[i] = out_quad(qb[i] + c);
            }
        }
        d += vec4<f32>((o[0] * g).x, (o[1] * g).y, (o[2] * g).z, (o[3] * g).w);
    }
    for (var i = 0u; i < 4u; i++) {
        if (qb[i] != NO_ROW) {
            delta[r0 + i] = d[i];
        }
    }
}
