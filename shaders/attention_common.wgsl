// What the prefill forward and the two backward kernels share in WGSL (see attention_common.glsl for
// the GLSL side and the explanations): the push-constant block and the cache addressing. WGSL has no
// includes; build_shaders.py pastes this file where a module says `//!include attention_common.wgsl`.
// It refers to the module's `pc` (var<immediate>), declared there.

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_size: u32,
    block_size: u32,
    max_blocks_per_seq: u32,
    num_blocks: u32,
    q_len: u32,
    causal: u32,
    scale: f32,
    k_block_stride: u32,
    k_head_stride: u32,
    k_token_stride: u32,
    k_chunk_stride: u32,
    v_block_stride: u32,
    v_head_stride: u32,
    v_token_stride: u32,
    v_dim_stride: u32,
}

fn visible_keys(i: u32, seq_len: u32) -> u32 {
    if (pc.causal == 0u) {
        return seq_len;
    }
    return u32(clamp(i32(seq_len) - i32(pc.q_len) + i32(i) + 1, 0, i32(seq_len)));
}

fn row_base(seq: u32, kv_head: u32, gr: u32) -> u32 {
    let group = pc.num_heads / pc.num_kv_heads;
    return ((seq * pc.num_heads + kv_head * group + gr % group) * pc.q_len + gr / group) * pc.head_size;
}

fn key_chunk(b: u32, h: u32, t: u32, c: u32) -> u32 {
    return (b * pc.k_block_stride + h * pc.k_head_stride + t * pc.k_token_stride + c * pc.k_chunk_stride) >> 2u;
}

fn key_index(b: u32, h: u32, t: u32, d: u32) -> u32 {
    return b * pc.k_block_stride + h * pc.k_head_stride + t * pc.k_token_stride + (d >> 2u) * pc.k_chunk_stride
        + (d & 3u);
}

fn value_index(b: u32, h: u32, t: u32, d: u32) -> u32 {
    return b * pc.v_block_stride + h * pc.v_head_stride + t * pc.v_token_stride + d * pc.v_dim_stride;
}
