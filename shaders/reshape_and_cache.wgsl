// reshape_and_cache, WGSL: shaders/reshape_and_cache.comp statement for statement, with the same interface
// (RESHAPE_AND_CACHE in pagedvk/abi.py); the GLSL source explains the algorithm and the race-free writes.
// build_shaders.py pastes the key's files for the includes: kv_write_<type>.wgsl (the cache element's
// encoding), kv_write_bound.wgsl or kv_write_segmented.wgsl (the cache bindings and key_store / value_store), and
// token_input.wgsl, which reads an input element of the type pc.token_type names (key and value are bound as
// 32-bit words whatever their type).

struct Params {
    num_tokens: u32,
    num_kv_heads: u32,
    head_size: u32,
    block_size: u32,
    num_blocks: u32,
    slot_words: u32,
    k_scale: f32,
    v_scale: f32,
    k_block_stride: u32,
    k_head_stride: u32,
    k_token_stride: u32,
    k_chunk_stride: u32,
    v_block_stride: u32,
    v_head_stride: u32,
    v_token_stride: u32,
    v_dim_stride: u32,
    blocks_per_segment: u32,
    token_type: u32,   // key and value storage (token_input.wgsl)
    key_pitch: u32,    // elements from one token's keys (values) to the next (reshape_and_cache.comp)
    value_pitch: u32,
}

@group(0) @binding(0) var<storage, read> key: array<u32>;            // [tokens, kv_heads, head_size]
@group(0) @binding(1) var<storage, read> value: array<u32>;          // [tokens, kv_heads, head_size]
@group(0) @binding(2) var<storage, read> slot_mapping: array<i32>;   // int32, or int64 as 2 words
// Written through atomicAnd / atomicOr on whole words (reshape_and_cache.comp says why); a cache split into
// segments has more bindings (kv_write_segmented.wgsl).
@group(0) @binding(3) var<storage, read_write> key_cache: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> value_cache: array<atomic<u32>>;
var<immediate> pc: Params;

const WG: u32 = 128u;

// v as a float with M mantissa bits and exponent bias BIAS, its bits without the sign, rounded to nearest
// even; largest: the bits of its largest finite value, overflow: what larger values become (kv_encode.glsl).
fn encode_small_float(v: f32, M: u32, BIAS: u32, largest: u32, overflow: u32, nan_bits: u32) -> u32 {
    let a = bitcast<u32>(v) & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return nan_bits;
    }
    var bits: u32;
    if (a < ((128u - BIAS) << 23u)) {   // below the smallest normal: a multiple of 2^(1 - BIAS - M), exactly
        bits = u32(round(bitcast<f32>(a) * bitcast<f32>((BIAS + M - 1u + 127u) << 23u)));
    } else {
        let shift = 23u - M;
        bits = ((a + (1u << (shift - 1u)) - 1u + ((a >> shift) & 1u)) >> shift) - ((127u - BIAS) << M);
    }
    return select(bits, overflow, bits > largest);
}

fn sign_bit(v: f32, bits: u32) -> u32 {   // the sign of v at bit `bits` - 1
    return (bitcast<u32>(v) >> 31u) << (bits - 1u);
}

//!include kv_write.wgsl
//!include token_input.wgsl
//!include kv_write_access.wgsl

// (word index, mask that clears element x's bits, element x's bits in place) for element x of a cache array.
fn word_write(x: u32, bits: u32) -> vec3<u32> {
    let shift = x * KV_BITS % 32u;
    return vec3<u32>(x * KV_BITS / 32u, ~(KV_MASK << shift), bits << shift);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let per_token = pc.num_kv_heads * pc.head_size;
    let i = (wid.x + nwg.x * (wid.y + nwg.y * wid.z)) * WG + lid;
    if (i >= pc.num_tokens * per_token) {
        return;
    }
    let token = i / per_token;
    let h = (i % per_token) / pc.head_size;
    let d = i % pc.head_size;

    let lo = slot_mapping[token * pc.slot_words];
    var nonnegative = lo >= 0;
    if (pc.slot_words == 2u) {   // an int64 slot is in range only if its high word is 0
        nonnegative = slot_mapping[token * 2u + 1u] == 0;
    }
    let slot = bitcast<u32>(lo);
    if (!nonnegative || slot / pc.block_size >= pc.num_blocks) {
        return;
    }
    let b = slot / pc.block_size;
    let t = slot % pc.block_size;

    let ki = token * pc.key_pitch + (i - token * per_token);     // the element in key and value, whose token
    let vi = token * pc.value_pitch + (i - token * per_token);   // rows lie key_pitch / value_pitch apart
    let kw = token_word(ki);
    let vw = token_word(vi);
    if (kw >= arrayLength(&key) || vw >= arrayLength(&value)) {   // a token_type the buffers do not hold
        return;
    }
    var k = token_element(key[kw], ki);
    var v = token_element(value[vw], vi);
    if (KV_SCALED) {
        k = k / pc.k_scale;
        v = v / pc.v_scale;
    }
    let x = 128u / KV_BITS;
    key_store(b, h * pc.k_head_stride + t * pc.k_token_stride + (d / x) * pc.k_chunk_stride + d % x, kv_encode(k));
    value_store(b, h * pc.v_head_stride + t * pc.v_token_stride + d * pc.v_dim_stride, kv_encode(v));
}
