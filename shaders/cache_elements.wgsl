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

// Value quad c of token t, kv head h, block b: one load where head dims are contiguous (nhd), four along
// vLLM's token-contiguous values.
fn value_quad(b: u32, h: u32, t: u32, c: u32) -> vec4<f32> {
    let vi = value_offset(h, t, 4u * c);
    let vs = pc.v_dim_stride;
    if (vs == 1u) {
        return kv_quad(value_load(b, vi >> 2u));
    }
    return vec4<f32>(value_at(b, vi), value_at(b, vi + vs), value_at(b, vi + 2u * vs), value_at(b, vi + 3u * vs));
}
