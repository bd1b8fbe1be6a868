// Queries and outputs of the type the push constants name (pc.q_type, abi.QUERY_TYPES: 0 float32, 1 float16,
// 2 bfloat16), for every module but the matrix ones, which are built for one type (q_f32.wgsl, q_f16.wgsl,
// q_bf16.wgsl). Pasted for `//!include q_storage.wgsl`; bf16x2 and pack_bf16x2 are in attention_common.wgsl.
// A query-typed buffer (query, out, dout; merge_states' out_a, out_b, out) is bound as 32-bit words: quad i (4
// consecutive elements) is words 4i .. 4i + 3 in float32, 2i and 2i + 1 in the 16-bit types; output pair p (2
// elements) is words 2p and 2p + 1 in float32, word p in the 16-bit types, so no two threads share a word. WGSL
// passes no storage array to a function: each kernel writes its buffers' loads (<buffer>_words) and stores
// (<buffer>_store) with these, and counts its bounds in quads or pairs with q_quads() and q_pairs().

const Q_F32: u32 = 0u;
const Q_F16: u32 = 1u;
const Q_BF16: u32 = 2u;

// The type fixed at translation where the module is built for one (WGSL's fixed decode modules, VariantKey.constants:
// the cache type's usual query, so the loads and stores take no branch on it); 3, the default, reads pc.q_type.
override Q_TYPE_FIXED: u32 = 3u;

fn q_code() -> u32 {
    return select(pc.q_type, Q_TYPE_FIXED, Q_TYPE_FIXED < 3u);
}

// Whether the elements are 16-bit. Any other code reads float32, conversions and bounds alike, so a wrong code
// still reads and writes inside the buffers.
fn q_half() -> bool {
    return q_code() == Q_F16 || q_code() == Q_BF16;
}

// Words of a quad, and the whole quads in `words` words.
fn q_quad_words() -> u32 {
    return select(4u, 2u, q_half());
}

fn q_quads(words: u32) -> u32 {
    return words / q_quad_words();
}

// Words of an output pair, and the whole pairs in `words` words.
fn q_pair_words() -> u32 {
    return select(2u, 1u, q_half());
}

fn q_pairs(words: u32) -> u32 {
    return words / q_pair_words();
}

// A quad from its words: all four in float32, .xy in the 16-bit types (.zw unread).
fn q_quad_of(w: vec4<u32>) -> vec4<f32> {
    if (q_code() == Q_F16) {
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    if (q_code() == Q_BF16) {
        return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
    }
    return bitcast<vec4<f32>>(w);
}

// A pair of outputs as words: both in float32, .x alone in the 16-bit types.
fn q_pair_of(v: vec2<f32>) -> vec2<u32> {
    if (q_code() == Q_F16) {
        return vec2<u32>(pack2x16float(v), 0u);
    }
    if (q_code() == Q_BF16) {
        return vec2<u32>(pack_bf16x2(v), 0u);
    }
    return bitcast<vec2<u32>>(v);
}
