// Elements of the layer ops, WGSL: layer_elements.glsl's pairs (two consecutive elements from an even one; pair p is
// words 2p, 2p + 1 in float32 and word p in the 16-bit types) and type codes (abi.QUERY_TYPES: 0 float32, 1 float16,
// 2 bfloat16); the GLSL file explains them. WGSL passes no storage array to a function: a kernel reads a pair's words
// itself (pair_words) and converts them here.

const T_F16: u32 = 1u;
const T_BF16: u32 = 2u;
const WG: u32 = 128u;   // == @workgroup_size

// Words of one pair; any code other than 1 and 2 reads float32.
fn pair_words(t: u32) -> u32 {
    return select(2u, 1u, t == T_F16 || t == T_BF16);
}

// Whole pairs in `words` words.
fn pairs_in(words: u32, t: u32) -> u32 {
    return words / pair_words(t);
}

fn layer_bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

// Rounded to nearest even; NaN stays NaN (WGSL has no isnan: the bits say it).
fn layer_pack_bf16x2(v: vec2<f32>) -> u32 {
    let b = bitcast<vec2<u32>>(v);
    let r = (b + vec2<u32>(0x7fffu) + ((b >> vec2<u32>(16u)) & vec2<u32>(1u))) >> vec2<u32>(16u);
    let nan = (b & vec2<u32>(0x7fffffffu)) > vec2<u32>(0x7f800000u);
    let h = select(r, vec2<u32>(0x7fc0u), nan);
    return h.x | (h.y << 16u);
}

// A pair from its words (w1 unread in the 16-bit types).
fn pair_of(w0: u32, w1: u32, t: u32) -> vec2<f32> {
    if (t == T_F16) {
        return unpack2x16float(w0);
    }
    if (t == T_BF16) {
        return layer_bf16x2(w0);
    }
    return vec2<f32>(bitcast<f32>(w0), bitcast<f32>(w1));
}

// A pair as its words (.y unused in the 16-bit types).
fn words_of(v: vec2<f32>, t: u32) -> vec2<u32> {
    if (t == T_F16) {
        return vec2<u32>(pack2x16float(v), 0u);
    }
    if (t == T_BF16) {
        return vec2<u32>(layer_pack_bf16x2(v), 0u);
    }
    return bitcast<vec2<u32>>(v);
}

// v rounded to the type, as storing and loading it again would give.
fn rounded_to(v: vec2<f32>, t: u32) -> vec2<f32> {
    let w = words_of(v, t);
    return pair_of(w.x, w.y, t);
}

fn layer_workgroup(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + nwg.x * (wid.y + nwg.y * wid.z);
}

// An index's value where it lies in [0, limit), else `limit` (layer_elements.glsl's index_below): lo is its int32
// value or an int64's low word, hi 0 or the int64's high word.
fn index_below(lo: i32, hi: i32, limit: u32) -> u32 {
    return select(bitcast<u32>(lo), limit, hi != 0 || bitcast<u32>(lo) >= limit);
}
