// bfloat16 caches (kv_storage.glsl's KV_BF16); bf16x2() is in attention_common.wgsl.
alias KvQuad = vec2<u32>;
const KV_CHUNK_QUADS: u32 = 2u;

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
}
