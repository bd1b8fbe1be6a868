// rms_norm and fused_add_rms_norm, WGSL: shaders/rms_norm.comp statement for statement, with the same interface
// (RMS_NORM in pagedvk/kernels/catalogue.py); the GLSL source explains it.

struct Params {
    num_tokens: u32,
    hidden_size: u32,
    epsilon: f32,
    x_type: u32,
    weight_type: u32,
    flags: u32,
    x_pitch: u32,
    residual_pitch: u32,
    out_pitch: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<u32>;
@group(0) @binding(1) var<storage, read_write> residual: array<u32>;
@group(0) @binding(2) var<storage, read> weight: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
var<immediate> pc: Params;

//!include layer_elements.wgsl

const ADD_RESIDUAL: u32 = 1u;
const WRITE_INPUT: u32 = 2u;

var<workgroup> partial: array<f32, 128>;

// Pair p of each binding, and pair p := v.
fn x_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.x_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = x[n * p + 1u];
    }
    return pair_of(x[n * p], w1, pc.x_type);
}

fn residual_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.x_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = residual[n * p + 1u];
    }
    return pair_of(residual[n * p], w1, pc.x_type);
}

fn weight_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.weight_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = weight[n * p + 1u];
    }
    return pair_of(weight[n * p], w1, pc.weight_type);
}

fn x_store(p: u32, v: vec2<f32>) {
    let n = pair_words(pc.x_type);
    let w = words_of(v, pc.x_type);
    x[n * p] = w.x;
    if (n == 2u) {
        x[n * p + 1u] = w.y;
    }
}

fn residual_store(p: u32, v: vec2<f32>) {
    let n = pair_words(pc.x_type);
    let w = words_of(v, pc.x_type);
    residual[n * p] = w.x;
    if (n == 2u) {
        residual[n * p + 1u] = w.y;
    }
}

fn out_store(p: u32, v: vec2<f32>) {
    let n = pair_words(pc.x_type);
    let w = words_of(v, pc.x_type);
    out[n * p] = w.x;
    if (n == 2u) {
        out[n * p + 1u] = w.y;
    }
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let row = layer_workgroup(wid, nwg);   // uniform: a workgroup that returns here returns whole
    let pairs = pc.hidden_size / 2u;
    let add = (pc.flags & ADD_RESIDUAL) != 0u;
    let into_x = (pc.flags & WRITE_INPUT) != 0u;
    let xp = row * (pc.x_pitch / 2u);
    let rp = row * (pc.residual_pitch / 2u);
    let op = row * (pc.out_pitch / 2u);
    if (row >= pc.num_tokens || pairs == 0u || xp + pairs > pairs_in(arrayLength(&x), pc.x_type)
        || pairs > pairs_in(arrayLength(&weight), pc.weight_type)
        || (add && rp + pairs > pairs_in(arrayLength(&residual), pc.x_type))
        || (!into_x && op + pairs > pairs_in(arrayLength(&out), pc.x_type))) {
        return;
    }

    var sum = 0.0;
    for (var j = tid; j < pairs; j += WG) {
        var z = x_pair(xp + j);
        if (add) {
            z = rounded_to(z + residual_pair(rp + j), pc.x_type);
            residual_store(rp + j, z);
        }
        sum += dot(z, z);
    }
    partial[tid] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            partial[tid] += partial[tid + s];
        }
        workgroupBarrier();
    }
    let scale = inverseSqrt(partial[0] / f32(pc.hidden_size) + pc.epsilon);

    for (var j = tid; j < pairs; j += WG) {
        var z: vec2<f32>;
        if (add) {
            z = residual_pair(rp + j);
        } else {
            z = x_pair(xp + j);
        }
        let y = z * scale * weight_pair(j);
        if (into_x) {
            x_store(xp + j, y);
        } else {
            out_store(op + j, y);
        }
    }
}
