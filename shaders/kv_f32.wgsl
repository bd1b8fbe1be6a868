// float32 caches (kv_storage.glsl's KV_F32): a quad is four words, one 16-byte chunk.
alias KvQuad = vec4<u32>;
const KV_CHUNK_QUADS: u32 = 1u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return bitcast<vec4<f32>>(w);
}

// One 16-byte chunk (kv_chunk_bound.wgsl) is one quad here.
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(w);
}
