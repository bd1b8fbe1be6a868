// key_load(b, q) / value_load(b, q) for caches larger than one binding: each cache is split into segments of
// blocks_per_segment whole blocks (pagedvk.array.DeviceArray), segment 0 bound as key_cache / value_cache and
// segments 1-3 at the bindings from KV_SEGMENT_BINDING on (the module declares that constant; pagedvk/abi.py
// declares the bindings). WGSL has neither pointers nor arrays of bindings, so a switch picks the segment.
// build_shaders.py pastes this file for `//!include kv_access.wgsl` in the "seg" modules.

@group(0) @binding(KV_SEGMENT_BINDING) var<storage, read> key_cache_1: array<KvQuad>;
@group(0) @binding(KV_SEGMENT_BINDING + 1u) var<storage, read> key_cache_2: array<KvQuad>;
@group(0) @binding(KV_SEGMENT_BINDING + 2u) var<storage, read> key_cache_3: array<KvQuad>;
@group(0) @binding(KV_SEGMENT_BINDING + 3u) var<storage, read> value_cache_1: array<KvQuad>;
@group(0) @binding(KV_SEGMENT_BINDING + 4u) var<storage, read> value_cache_2: array<KvQuad>;
@group(0) @binding(KV_SEGMENT_BINDING + 5u) var<storage, read> value_cache_3: array<KvQuad>;

fn key_load(b: u32, q: u32) -> KvQuad {
    let s = b / pc.blocks_per_segment;
    let i = (b - s * pc.blocks_per_segment) * pc.k_block_stride + q;
    switch s {
        case 0u: { return key_cache[i]; }
        case 1u: { return key_cache_1[i]; }
        case 2u: { return key_cache_2[i]; }
        default: { return key_cache_3[i]; }
    }
}

fn value_load(b: u32, q: u32) -> KvQuad {
    let s = b / pc.blocks_per_segment;
    let i = (b - s * pc.blocks_per_segment) * (pc.v_block_stride >> 2u) + q;
    switch s {
        case 0u: { return value_cache[i]; }
        case 1u: { return value_cache_1[i]; }
        case 2u: { return value_cache_2[i]; }
        default: { return value_cache_3[i]; }
    }
}
