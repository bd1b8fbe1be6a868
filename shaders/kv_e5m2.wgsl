// fp8 e5m2 caches (kv_storage.glsl's KV_E5M2): the top byte of a float16.
alias KvQuad = u32;
const KV_CHUNK_QUADS: u32 = 4u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(((w & 0xffu) << 8u) | ((w & 0xff00u) << 16u)),
                     unpack2x16float(((w >> 8u) & 0xff00u) | (w & 0xff000000u)));
}

// Quad i (0 to 3) of a 16-byte chunk (kv_chunk_bound.wgsl).
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(w[i]);
}
