// What the linear layer's kernels share, WGSL: shaders/linear_common.glsl's bindings, push constants, loads and
// store, function for function (that file explains them). build_shaders.py pastes this file where a module says
// `//!include linear_common.wgsl`.

struct Params {
    tokens: u32,
    in_features: u32,
    out_features: u32,
    x_type: u32,
    weight_type: u32,
    bias_type: u32,
    y_type: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<u32>;          // [tokens, in_features]
@group(0) @binding(1) var<storage, read> weight: array<vec4<u32>>;   // [out_features, in_features]
@group(0) @binding(2) var<storage, read> bias: array<u32>;       // [out_features]
@group(0) @binding(3) var<storage, read_write> y: array<atomic<u32>>;   // [tokens, out_features]
var<immediate> pc: Params;

const T_F32: u32 = 0u;
const T_F16: u32 = 1u;
const T_BF16: u32 = 2u;

fn word_index(i: u32, t: u32) -> u32 {
    return select(i >> 1u, i, t == T_F32);
}

fn from_word(w: u32, i: u32, t: u32) -> f32 {
    if (t == T_F16) {
        return unpack2x16float(w)[i & 1u];
    }
    if (t == T_BF16) {
        return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
    }
    return bitcast<f32>(w);
}

fn x_element(i: u32) -> f32 {
    return from_word(x[word_index(i, pc.x_type)], i, pc.x_type);
}

fn x_quad(i: u32) -> vec4<f32> {
    if (pc.x_type == T_F32) {
        return bitcast<vec4<f32>>(vec4<u32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]));
    }
    let w0 = x[i >> 1u];
    let w1 = x[(i >> 1u) + 1u];
    if (pc.x_type == T_F16) {
        return vec4<f32>(unpack2x16float(w0), unpack2x16float(w1));
    }
    return vec4<f32>(bitcast<f32>(w0 << 16u), bitcast<f32>(w0 & 0xffff0000u),
                     bitcast<f32>(w1 << 16u), bitcast<f32>(w1 & 0xffff0000u));
}

fn chunk_elements() -> u32 {
    return select(8u, 4u, pc.weight_type == T_F32);
}

// A chunk's elements: [0] holds elements 0-3, [1] elements 4-7 (zeros in float32).
fn unpack_chunk(c: vec4<u32>) -> array<vec4<f32>, 2> {
    if (pc.weight_type == T_F32) {
        return array<vec4<f32>, 2>(bitcast<vec4<f32>>(c), vec4<f32>(0.0));
    }
    if (pc.weight_type == T_F16) {
        return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(c.x), unpack2x16float(c.y)),
                                   vec4<f32>(unpack2x16float(c.z), unpack2x16float(c.w)));
    }
    let lo = bitcast<vec4<f32>>(c << vec4<u32>(16u));
    let hi = bitcast<vec4<f32>>(c & vec4<u32>(0xffff0000u));
    return array<vec4<f32>, 2>(vec4<f32>(lo.x, hi.x, lo.y, hi.y), vec4<f32>(lo.z, hi.z, lo.w, hi.w));
}

fn weight_element(g: u32) -> f32 {
    let per = chunk_elements();
    let e = g % per;
    let c = weight[g / per];
    if (pc.weight_type == T_F32) {
        return bitcast<f32>(c[e]);
    }
    return from_word(c[e >> 1u], e, pc.weight_type);
}

fn bias_of(n: u32) -> f32 {
    if (pc.has_bias == 0u) {
        return 0.0;
    }
    return from_word(bias[word_index(n, pc.bias_type)], n, pc.bias_type);
}

fn store_y(i: u32, v: f32) {
    if (pc.y_type == T_F32) {
        atomicStore(&y[i], bitcast<u32>(v));
        return;
    }
    var bits: u32;
    if (pc.y_type == T_F16) {
        bits = pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu;
    } else {
        let b = bitcast<u32>(v);
        bits = select((b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u, 0x7fc0u, (b & 0x7fffffffu) > 0x7f800000u);
    }
    let shift = (i & 1u) * 16u;
    atomicAnd(&y[i >> 1u], ~(0xffffu << shift));
    atomicOr(&y[i >> 1u], bits << shift);
}

fn workgroup_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + nwg.x * (wid.y + nwg.y * wid.z);
}
