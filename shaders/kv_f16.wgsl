// float16 caches (kv_storage.glsl's KV_F16), read as 32-bit words: core WGSL, no `enable f16`.
alias KvQuad = vec2<u32>;
const KV_CHUNK_QUADS: u32 = 2u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

// Quad i (0 or 1) of a 16-byte chunk (kv_chunk_bound.wgsl).
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(select(w.zw, w.xy, i == 0u));
}
