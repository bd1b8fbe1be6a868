// embedding, WGSL: shaders/embedding.comp statement for statement, with the same interface (EMBEDDING in
// pagedvk/kernels/catalogue.py); the GLSL source explains it.

struct Params {
    num_tokens: u32,
    hidden_size: u32,
    vocab_size: u32,
    id_words: u32,
    weight_type: u32,
    out_type: u32,
    out_pitch: u32,
}

@group(0) @binding(0) var<storage, read> token_ids: array<i32>;
@group(0) @binding(1) var<storage, read> weight: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
var<immediate> pc: Params;

//!include layer_elements.wgsl

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let pairs = pc.hidden_size / 2u;
    let i = layer_workgroup(wid, nwg) * WG + lid;
    if (pairs == 0u || i >= pc.num_tokens * pairs) {
        return;
    }
    let t = i / pairs;
    let j = i % pairs;
    let o = t * (pc.out_pitch / 2u) + j;
    if (o >= pairs_in(arrayLength(&out), pc.out_type) || t * pc.id_words + pc.id_words > arrayLength(&token_ids)) {
        return;
    }
    var hi = 0;
    if (pc.id_words == 2u) {
        hi = token_ids[t * 2u + 1u];
    }
    let id = index_below(token_ids[t * pc.id_words], hi, pc.vocab_size);
    let w = id * pairs + j;
    var v = vec2<f32>(0.0);
    if (id < pc.vocab_size && w < pairs_in(arrayLength(&weight), pc.weight_type)) {
        let n = pair_words(pc.weight_type);
        var w1 = 0u;
        if (n == 2u) {
            w1 = weight[n * w + 1u];
        }
        v = pair_of(weight[n * w], w1, pc.weight_type);
    }
    let x = words_of(v, pc.out_type);
    let n = pair_words(pc.out_type);
    out[n * o] = x.x;
    if (n == 2u) {
        out[n * o + 1u] = x.y;
    }
}
