// The attention-variant hooks that read the variants' buffers, shared by decode and prefill: included after
// attention_common.glsl by kernels that bind alibi_slopes and sinks (float32 [num_heads]; ATTENTION_VARIANT_INPUTS
// in pagedvk/abi.py). Each is read only where its VARIANT_* flag is set: a uniform branch, the same for every
// thread of a launch, so plain attention pays a test of a push constant and no read.
#ifndef ATTENTION_VARIANTS_GLSL
#define ATTENTION_VARIANTS_GLSL

// A visible key's logit from the scaled dot product of query and key: softcapped, then ALiBi's bias (Gemma 2's
// order; vLLM's ALiBi bias slope * (key_pos - query_pos)). tanh is taken of a clamped argument: some drivers
// compute it as a quotient of exponentials, which overflows to NaN, and tanh(15) is 1 in float32.
float logit(float scaled_dot, uint head, uint key_pos, uint query_pos) {
    float x = scaled_dot;
    if (pc.softcap > 0.0) x = pc.softcap * tanh(clamp(x / pc.softcap, -15.0, 15.0));
    if ((pc.variants & VARIANT_ALIBI) != 0u && head < uint(alibi_slopes.length())) {
        x += alibi_slopes[head] * (float(key_pos) - float(query_pos));
    }
    return x;
}

// The hooks for four query rows (prefill) or four heads (decode) at once: -inf where a key is not visible, or
// at or past `keys` (a row's keys in the cache, 0 for rows or blocks that are not there).
vec4 logits4(vec4 scaled_dot, uvec4 heads, uint key_pos, uvec4 query_pos, uvec4 keys) {
    vec4 l = vec4(NEG_INF);
    for (uint j = 0u; j < 4u; j++) {
        if (key_pos < keys[j] && key_visible(key_pos, query_pos[j])) {
            l[j] = logit(scaled_dot[j], heads[j], key_pos, query_pos[j]);
        }
    }
    return l;
}

// The head's sink logit (gpt-oss), NEG_INF without sinks.
float sink_logit(uint head) {
    return (pc.variants & VARIANT_SINKS) != 0u && head < uint(sinks.length()) ? sinks[head] : NEG_INF;
}

#endif
