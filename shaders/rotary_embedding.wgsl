// rotary_embedding, WGSL: shaders/rotary_embedding.comp statement for statement, with the same interface
// (ROTARY_EMBEDDING in pagedvk/kernels/catalogue.py); the GLSL source explains it.

struct Params {
    num_tokens: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_size: u32,
    rot_dim: u32,
    max_position: u32,
    is_neox: u32,
    position_words: u32,
    x_type: u32,
    cache_type: u32,
    query_pitch: u32,
    key_pitch: u32,
}

@group(0) @binding(0) var<storage, read> positions: array<i32>;
@group(0) @binding(1) var<storage, read_write> query: array<u32>;
@group(0) @binding(2) var<storage, read_write> key: array<u32>;
@group(0) @binding(3) var<storage, read> cos_sin_cache: array<u32>;
var<immediate> pc: Params;

//!include layer_elements.wgsl

fn cache_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.cache_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = cos_sin_cache[n * p + 1u];
    }
    return pair_of(cos_sin_cache[n * p], w1, pc.cache_type);
}

fn query_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.x_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = query[n * p + 1u];
    }
    return pair_of(query[n * p], w1, pc.x_type);
}

fn key_pair(p: u32) -> vec2<f32> {
    let n = pair_words(pc.x_type);
    var w1 = 0u;
    if (n == 2u) {
        w1 = key[n * p + 1u];
    }
    return pair_of(key[n * p], w1, pc.x_type);
}

fn query_store(p: u32, v: vec2<f32>) {
    let n = pair_words(pc.x_type);
    let w = words_of(v, pc.x_type);
    query[n * p] = w.x;
    if (n == 2u) {
        query[n * p + 1u] = w.y;
    }
}

fn key_store(p: u32, v: vec2<f32>) {
    let n = pair_words(pc.x_type);
    let w = words_of(v, pc.x_type);
    key[n * p] = w.x;
    if (n == 2u) {
        key[n * p + 1u] = w.y;
    }
}

// The two pairs a thread takes, rotated (rotary_embedding.comp's rotate): .xy and .zw of the result.
fn rotate(a: vec2<f32>, b: vec2<f32>, c: vec2<f32>, s: vec2<f32>) -> vec4<f32> {
    if (pc.is_neox != 0u) {
        return vec4<f32>(a * c - b * s, b * c + a * s);
    }
    let x1 = vec2<f32>(a.x, b.x);
    let x2 = vec2<f32>(a.y, b.y);
    let y1 = x1 * c - x2 * s;
    let y2 = x2 * c + x1 * s;
    return vec4<f32>(y1.x, y2.x, y1.y, y2.y);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let quads = pc.rot_dim / 4u;
    let heads = pc.num_heads + pc.num_kv_heads;
    let i = layer_workgroup(wid, nwg) * WG + lid;
    if (quads == 0u || i >= pc.num_tokens * heads * quads) {
        return;
    }
    let t = i / (heads * quads);
    let h = i / quads % heads;
    let k = i % quads;
    if (t * pc.position_words + pc.position_words > arrayLength(&positions)) {
        return;
    }
    var hi = 0;
    if (pc.position_words == 2u) {
        hi = positions[t * 2u + 1u];
    }
    let pos = index_below(positions[t * pc.position_words], hi, pc.max_position);
    let half_pairs = pc.rot_dim / 4u;
    let c = pos * (pc.rot_dim / 2u) + k;
    if (pos >= pc.max_position || c + half_pairs >= pairs_in(arrayLength(&cos_sin_cache), pc.cache_type)) {
        return;
    }
    let cs = cache_pair(c);
    let sn = cache_pair(c + half_pairs);

    let is_query = h < pc.num_heads;
    let head = select(h - pc.num_heads, h, is_query);
    let first = (t * select(pc.key_pitch, pc.query_pitch, is_query) + head * pc.head_size) / 2u;
    let neox = pc.is_neox != 0u;
    let a = first + select(2u * k, k, neox);
    let b = select(a + 1u, a + half_pairs, neox);
    if (is_query) {
        if (b >= pairs_in(arrayLength(&query), pc.x_type)) {
            return;
        }
        let r = rotate(query_pair(a), query_pair(b), cs, sn);
        query_store(a, r.xy);
        query_store(b, r.zw);
    } else {
        if (b >= pairs_in(arrayLength(&key), pc.x_type)) {
            return;
        }
        let r = rotate(key_pair(a), key_pair(b), cs, sn);
        key_store(a, r.xy);
        key_store(b, r.zw);
    }
}
