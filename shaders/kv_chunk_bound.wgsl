// key_load(b, i) / value_load(b, i) for the decode, whose caches are bound as 16-byte chunks
// (array<vec4<u32>>: one load reads 16 bytes whatever the storage type; kv_storage.glsl's KV_CHUNKS):
// chunk i of block b, caches in one binding each. build_shaders.py pastes this file for
// `//!include kv_chunk_access.wgsl`; kv_chunk_segmented.wgsl is the other case. chunk_quad() (kv_<type>.wgsl)
// takes a quad out of a chunk.

fn key_load(b: u32, i: u32) -> vec4<u32> {
    return key_cache[b * (pc.k_block_stride / KV_CHUNK_QUADS) + i];
}

fn value_load(b: u32, i: u32) -> vec4<u32> {
    return value_cache[b * (pc.v_block_stride / (4u * KV_CHUNK_QUADS)) + i];
}
