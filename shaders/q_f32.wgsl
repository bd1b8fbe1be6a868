// float32 queries and outputs (kv_storage.glsl's Q_F32). Outputs are written two elements at a time.
alias QQuad = vec4<u32>;
alias OutPair = vec2<u32>;

fn q_quad(w: QQuad) -> vec4<f32> {
    return bitcast<vec4<f32>>(w);
}

fn out_pair(v: vec2<f32>) -> OutPair {
    return bitcast<vec2<u32>>(v);
}
