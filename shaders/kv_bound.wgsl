// key_load(b, q) / value_load(b, q) for caches in one binding each: quad q of block b (see
// attention_common.glsl for the addressing). build_shaders.py pastes this file for `//!include kv_access.wgsl`
// in modules whose caches fit one binding; kv_segmented.wgsl is the other case.

fn key_load(b: u32, q: u32) -> KvQuad {
    return key_cache[b * pc.k_block_stride + q];
}

fn value_load(b: u32, q: u32) -> KvQuad {
    return value_cache[b * (pc.v_block_stride >> 2u) + q];
}
