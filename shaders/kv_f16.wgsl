// float16 caches (kv_storage.glsl's KV_F16), read as 32-bit words: core WGSL, no `enable f16`.
alias KvQuad = vec2<u32>;
const KV_CHUNK_QUADS: u32 = 2u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
