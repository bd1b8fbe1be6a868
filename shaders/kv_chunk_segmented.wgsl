// kv_chunk_bound.wgsl for caches larger than one binding, split into segments of blocks_per_segment whole
// blocks as kv_segmented.wgsl describes: segment 0 bound as key_cache / value_cache, segments 1-3 at the
// bindings from KV_SEGMENT_BINDING on, all as 16-byte chunks; a switch picks the segment.
// build_shaders.py pastes this file for `//!include kv_chunk_access.wgsl` in the "seg" modules.

@group(0) @binding(KV_SEGMENT_BINDING) var<storage, read> key_cache_1: array<vec4<u32>>;
@group(0) @binding(KV_SEGMENT_BINDING + 1u) var<storage, read> key_cache_2: array<vec4<u32>>;
@group(0) @binding(KV_SEGMENT_BINDING + 2u) var<storage, read> key_cache_3: array<vec4<u32>>;
@group(0) @binding(KV_SEGMENT_BINDING + 3u) var<storage, read> value_cache_1: array<vec4<u32>>;
@group(0) @binding(KV_SEGMENT_BINDING + 4u) var<storage, read> value_cache_2: array<vec4<u32>>;
@group(0) @binding(KV_SEGMENT_BINDING + 5u) var<storage, read> value_cache_3: array<vec4<u32>>;

fn key_load(b: u32, i: u32) -> vec4<u32> {
    let s = b / pc.blocks_per_segment;
    let j = (b - s * pc.blocks_per_segment) * (pc.k_block_stride / KV_CHUNK_QUADS) + i;
    switch s {
        case 0u: { return key_cache[j]; }
        case 1u: { return key_cache_1[j]; }
        case 2u: { return key_cache_2[j]; }
        default: { return key_cache_3[j]; }
    }
}

fn value_load(b: u32, i: u32) -> vec4<u32> {
    let s = b / pc.blocks_per_segment;
    let j = (b - s * pc.blocks_per_segment) * (pc.v_block_stride / (4u * KV_CHUNK_QUADS)) + i;
    switch s {
        case 0u: { return value_cache[j]; }
        case 1u: { return value_cache_1[j]; }
        case 2u: { return value_cache_2[j]; }
        default: { return value_cache_3[j]; }
    }
}
