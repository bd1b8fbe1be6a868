// What every attention kernel shares in WGSL (ATTENTION_PUSH in pagedvk/abi.py): the push-constant block,
// workgroup numbering, the causal limit, the cache addressing and the bfloat16 conversions. The GLSL twin,
// attention_common.glsl, explains the addressing and the bounds. WGSL has no includes: build_shaders.py
// pastes this file where a module says `//!include attention_common.wgsl`. It refers to the module's `pc`
// (var<immediate>) and to KV_CHUNK_QUADS (from the module's kv_<type>.wgsl, or its own where it reads no
// cache).

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_size: u32,
    block_size: u32,
    max_blocks_per_seq: u32,
    num_blocks: u32,
    num_seqs: u32,
    q_token_stride: u32,
    q_head_stride: u32,
    causal: u32,
    scale: f32,
    v_scale: f32,
    group_size: u32,
    partition_size: u32,
    num_partitions: u32,
    k_block_stride: u32,
    k_head_stride: u32,
    k_token_stride: u32,
    k_chunk_stride: u32,
    v_block_stride: u32,
    v_head_stride: u32,
    v_token_stride: u32,
    v_dim_stride: u32,
    blocks_per_segment: u32,
    softcap: f32,
    window: u32,
    variants: u32,
    q_type: u32,   // query, out and dout storage (q_any.wgsl; matrix modules: ignored)
    q_pitch: u32,     // elements from one token's query row to the next (num_heads * head_size: contiguous)
    out_pitch: u32,   // the same for out
}

const WG: u32 = 128u;              // == @workgroup_size
const MAX_HEAD_SIZE: u32 = 256u;   // two head dims per thread where threads own dims
const MIN_BLOCK_SIZE: u32 = 1u;    // block sizes are powers of two from 1 to 32 (pagedvk.layouts)
// -inf cannot be a WGSL constant (constant expressions must be finite): bitcast at run time.
const NEG_INF_BITS: u32 = 0xff800000u;

fn neg_inf() -> f32 {
    return bitcast<f32>(NEG_INF_BITS);
}

// The workgroup's number in a grid folded to the device's limits (pagedvk.runtime.commands.fold_grid):
// workgroups past the launch's count return at once. WGSL passes builtins to main only.
fn workgroup_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + nwg.x * (wid.y + nwg.y * wid.z);
}

// Attention variants: the hooks that read only the push constants (see attention_common.glsl); those that
// read the variants' buffers are in attention_variants.wgsl.
const VARIANT_ALIBI: u32 = 1u;
const VARIANT_SINKS: u32 = 2u;
const VARIANT_LSE: u32 = 4u;

fn key_visible(key_pos: u32, query_pos: u32) -> bool {
    return (pc.causal == 0u || key_pos <= query_pos) && (pc.window == 0u || key_pos + pc.window > query_pos);
}

fn window_first_key(query_pos: u32) -> u32 {
    if (pc.window == 0u || query_pos < pc.window) {
        return 0u;
    }
    return query_pos + 1u - pc.window;
}

// A NaN test (WGSL has no isNan), on the bits: it does not lean on how a compiler takes `x != x`.
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn softmax_finish(m: f32, l: f32, sink: f32) -> vec2<f32> {
    if (is_nan(l)) {   // a NaN logit among the keys: NaN output and lse, as float64 gives
        return vec2<f32>(l);
    }
    let top = max(select(neg_inf(), m, l > 0.0), sink);
    if (top == neg_inf()) {
        return vec2<f32>(0.0, neg_inf());
    }
    var kept = 0.0;
    var factor = 0.0;
    if (l > 0.0) {
        factor = exp(m - top);
        kept = l * factor;
    }
    var denom = kept;
    if (sink != neg_inf()) {
        denom += exp(sink - top);
    }
    return vec2<f32>(factor / denom, top + log(denom));
}

// A sequence's queries are its last q_len tokens (see attention_common.glsl).
fn query_position(i: u32, q_len: u32, seq_len: u32) -> u32 {
    return u32(max(i32(seq_len) - i32(q_len) + i32(i), 0));
}

fn visible_keys(i: u32, q_len: u32, seq_len: u32) -> u32 {
    if (pc.causal == 0u) {
        return seq_len;
    }
    return u32(clamp(i32(seq_len) - i32(q_len) + i32(i) + 1, 0, i32(seq_len)));
}

// Where row gr of the sequence whose first query token is q_start starts in query, out, dout and dq, in
// elements (GQA rows, query-major; PREFILL_INPUTS in pagedvk/abi.py).
fn row_base(q_start: u32, kv_head: u32, gr: u32) -> u32 {
    let group = pc.num_heads / pc.num_kv_heads;
    return (q_start * pc.num_heads + (gr / group) * pc.q_token_stride
            + (kv_head * group + gr % group) * pc.q_head_stride) * pc.head_size;
}

// Token rows of query and out at their pitches, a row_base() at a pitch, the tokens a binding holds (see
// attention_common.glsl).
fn query_token(t: u32) -> u32 {
    return t * pc.q_pitch;
}

fn out_token(t: u32) -> u32 {
    return t * pc.out_pitch;
}

fn pitched(base: u32, pitch: u32) -> u32 {
    let row = pc.num_heads * pc.head_size;
    return (base / row) * pitch + base % row;
}

fn tokens_held(elems: u32, pitch: u32) -> u32 {
    let row = pc.num_heads * pc.head_size;
    if (elems < row || pitch == 0u) {
        return 0u;
    }
    return (elems - row) / pitch + 1u;
}

fn rows_held(elems: u32, pitch: u32) -> u32 {
    return tokens_held(elems, pitch) * pc.num_heads * pc.head_size;
}

// Quad c of key token t, kv head h, from the start of its block.
fn key_offset(h: u32, t: u32, c: u32) -> u32 {
    return h * pc.k_head_stride + t * pc.k_token_stride + (c / KV_CHUNK_QUADS) * pc.k_chunk_stride
        + c % KV_CHUNK_QUADS;
}

// Value element (h, t, d) from the start of its block.
fn value_offset(h: u32, t: u32, d: u32) -> u32 {
    return h * pc.v_head_stride + t * pc.v_token_stride + d * pc.v_dim_stride;
}

// bfloat16 is the top half of a float32 (kv_bf16.wgsl, q_any.wgsl, q_bf16.wgsl).
fn bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

// Two floats as bfloat16, rounded to nearest even (NaN stays NaN; WGSL has no isnan, so the bits say it).
fn pack_bf16x2(v: vec2<f32>) -> u32 {
    let b = bitcast<vec2<u32>>(v);
    let r = (b + vec2<u32>(0x7fffu) + ((b >> vec2<u32>(16u)) & vec2<u32>(1u))) >> vec2<u32>(16u);
    let nan = (b & vec2<u32>(0x7fffffffu)) > vec2<u32>(0x7f800000u);
    let h = select(r, vec2<u32>(0x7fc0u), nan);
    return h.x | (h.y << 16u);
}
