// silu_and_mul, WGSL: shaders/silu_and_mul.comp statement for statement, with the same interface (SILU_AND_MUL in
// pagedvk/kernels/catalogue.py); the GLSL source explains it.

struct Params {
    num_rows: u32,
    d: u32,
    x_type: u32,
    x_pitch: u32,
    out_pitch: u32,
}

@group(0) @binding(0) var<storage, read> x: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<immediate> pc: Params;

//!include layer_elements.wgsl

fn x_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.x_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = x[n * p + 1u];
    }
    return pair_of(x[n * p], w1, pc.x_type);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let pairs = pc.d / 2u;
    let i = layer_workgroup(wid, nwg) * WG + lid;
    if (pairs == 0u || i >= pc.num_rows * pairs) {
        return;
    }
    let r = i / pairs;
    let j = i % pairs;
    let a = r * (pc.x_pitch / 2u) + j;
    let b = a + pairs;
    let o = r * (pc.out_pitch / 2u) + j;
    if (b >= pairs_in(arrayLength(&x), pc.x_type) || o >= pairs_in(arrayLength(&out), pc.x_type)) {
        return;
    }
    let gate = x_pair(a);
    let y = words_of(gate / (1.0 + exp(-gate)) * x_pair(b), pc.x_type);
    let n = pair_words(pc.x_type);
    out[n * o] = y.x;
    if (n == 2u) {
        out[n * o + 1u] = y.y;
    }
}
