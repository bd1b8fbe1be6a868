// bfloat16 caches (kv_storage.glsl's KV_BF16); bf16x2() is in attention_common.wgsl.
alias KvQuad = vec2<u32>;
const KV_CHUNK_QUADS: u32 = 2u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
}

// Quad i (0 or 1) of a 16-byte chunk (kv_chunk_bound.wgsl).
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(select(w.zw, w.xy, i == 0u));
}
