// bfloat16 queries and outputs (kv_storage.glsl's Q_BF16); the conversions are in attention_common.wgsl.
alias QQuad = vec2<u32>;
alias OutPair = u32;

fn q_quad(w: QQuad) -> vec4<f32> {
    return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
}

fn out_pair(v: vec2<f32>) -> OutPair {
    return pack_bf16x2(v);
}
