// float16 queries and outputs (kv_storage.glsl's Q_F16): a pair of outputs is one word, so no two threads
// share a word.
alias QQuad = vec2<u32>;
alias OutPair = u32;

fn q_quad(w: QQuad) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn out_pair(v: vec2<f32>) -> OutPair {
    return pack2x16float(v);
}
