// The attention-variant hooks that read the variants' buffers, WGSL: attention_variants.glsl translated, which
// explains them. Pasted after attention_common.wgsl into modules that bind alibi_slopes and sinks.

fn logit(scaled_dot: f32, head: u32, key_pos: u32, query_pos: u32) -> f32 {
    var x = scaled_dot;
    if (pc.softcap > 0.0) {
        x = pc.softcap * tanh(clamp(x / pc.softcap, -15.0, 15.0));
    }
    if ((pc.variants & VARIANT_ALIBI) != 0u && head < arrayLength(&alibi_slopes)) {
        x += alibi_slopes[head] * (f32(key_pos) - f32(query_pos));
    }
    return x;
}

// Four logits written out, not looped over: a vector written at a variable index is a local-memory array on
// some drivers (the H200's).
fn logits4(scaled_dot: vec4<f32>, heads: vec4<u32>, key_pos: u32, query_pos: vec4<u32>, keys: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(logit_seen(scaled_dot.x, heads.x, key_pos, query_pos.x, keys.x),
                     logit_seen(scaled_dot.y, heads.y, key_pos, query_pos.y, keys.y),
                     logit_seen(scaled_dot.z, heads.z, key_pos, query_pos.z, keys.z),
                     logit_seen(scaled_dot.w, heads.w, key_pos, query_pos.w, keys.w));
}

// The logit, or -inf where the row does not see the key (keys: how many keys it sees).
fn logit_seen(scaled_dot: f32, head: u32, key_pos: u32, query_pos: u32, keys: u32) -> f32 {
    if (key_pos < keys && key_visible(key_pos, query_pos)) {
        return logit(scaled_dot, head, key_pos, query_pos);
    }
    return neg_inf();
}

fn sink_logit(head: u32) -> f32 {
    if ((pc.variants & VARIANT_SINKS) != 0u && head < arrayLength(&sinks)) {
        return sinks[head];
    }
    return neg_inf();
}
