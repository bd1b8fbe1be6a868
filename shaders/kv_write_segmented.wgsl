// reshape_and_cache's caches split into segments of blocks_per_segment blocks (kv_segmented.wgsl's
// twin for writing): segment 0 is key_cache / value_cache, segments 1-3 of each at 5-10 (pagedvk/abi.py's
// bindings_for). WGSL has no arrays of bindings, so a switch picks the segment.
@group(0) @binding(5) var<storage, read_write> key_cache_1: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> key_cache_2: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read_write> key_cache_3: array<atomic<u32>>;
@group(0) @binding(8) var<storage, read_write> value_cache_1: array<atomic<u32>>;
@group(0) @binding(9) var<storage, read_write> value_cache_2: array<atomic<u32>>;
@group(0) @binding(10) var<storage, read_write> value_cache_3: array<atomic<u32>>;

fn key_store(b: u32, e: u32, bits: u32) {
    let s = b / pc.blocks_per_segment;
    let w = word_write((b - s * pc.blocks_per_segment) * pc.k_block_stride + e, bits);
    switch s {
        case 0u: { atomicAnd(&key_cache[w.x], w.y); atomicOr(&key_cache[w.x], w.z); }
        case 1u: { atomicAnd(&key_cache_1[w.x], w.y); atomicOr(&key_cache_1[w.x], w.z); }
        case 2u: { atomicAnd(&key_cache_2[w.x], w.y); atomicOr(&key_cache_2[w.x], w.z); }
        default: { atomicAnd(&key_cache_3[w.x], w.y); atomicOr(&key_cache_3[w.x], w.z); }
    }
}

fn value_store(b: u32, e: u32, bits: u32) {
    let s = b / pc.blocks_per_segment;
    let w = word_write((b - s * pc.blocks_per_segment) * pc.v_block_stride + e, bits);
    switch s {
        case 0u: { atomicAnd(&value_cache[w.x], w.y); atomicOr(&value_cache[w.x], w.z); }
        case 1u: { atomicAnd(&value_cache_1[w.x], w.y); atomicOr(&value_cache_1[w.x], w.z); }
        case 2u: { atomicAnd(&value_cache_2[w.x], w.y); atomicOr(&value_cache_2[w.x], w.z); }
        default: { atomicAnd(&value_cache_3[w.x], w.y); atomicOr(&value_cache_3[w.x], w.z); }
    }
}
