// One key element and one value element, converted (attention_common.glsl's KEY_AT and VALUE_AT). Apart from
// attention_common.wgsl because they read the caches, which paged_decode_reduce does not bind.

// Key element d of token t, kv head h, block b.
fn key_at(b: u32, h: u32, t: u32, d: u32) -> f32 {
    return kv_quad(key_load(b, key_offset(h, t, d >> 2u)))[d & 3u];
}

// The value element at value_offset v of block b.
fn value_at(b: u32, v: u32) -> f32 {
    return kv_quad(value_load(b, v >> 2u))[v & 3u];
}
