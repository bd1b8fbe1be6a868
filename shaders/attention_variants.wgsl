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

fn logits4(scaled_dot: vec4<f32>, heads: vec4<u32>, key_pos: u32, query_pos: vec4<u32>, keys: vec4<u32>) -> vec4<f32> {
    var l = vec4<f32>(neg_inf());
    for (var j = 0u; j < 4u; j++) {
        if (key_pos < keys[j] && key_visible(key_pos, query_pos[j])) {
            l[j] = logit(scaled_dot[j], heads[j], key_pos, query_pos[j]);
        }
    }
    return l;
}

fn sink_logit(head: u32) -> f32 {
    if ((pc.variants & VARIANT_SINKS) != 0u && head < arrayLength(&sinks)) {
        return sinks[head];
    }
    return neg_inf();
}
