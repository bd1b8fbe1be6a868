// reshape_and_cache's caches, one binding each (key_cache, value_cache): pasted for `//!include kv_write_access.wgsl`. Element e of
// block b is written through atomicAnd / atomicOr on its 32-bit word (reshape_and_cache.comp says why).

fn key_store(b: u32, e: u32, bits: u32) {
    let w = word_write(b * pc.k_block_stride + e, bits);
    atomicAnd(&key_cache[w.x], w.y);
    atomicOr(&key_cache[w.x], w.z);
}

fn value_store(b: u32, e: u32, bits: u32) {
    let w = word_write(b * pc.v_block_stride + e, bits);
    atomicAnd(&value_cache[w.x], w.y);
    atomicOr(&value_cache[w.x], w.z);
}
