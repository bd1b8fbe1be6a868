// float32 caches (kv_storage.glsl's KV_F32): a quad is four words, one 16-byte chunk.
alias KvQuad = vec4<u32>;
const KV_CHUNK_QUADS: u32 = 1u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return bitcast<vec4<f32>>(w);
}
