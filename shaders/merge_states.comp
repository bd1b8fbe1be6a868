#version 450
// Merges two attention results over disjoint sets of keys (FlashInfer's merge_state), as cascade and
// shared-prefix attention do: a row (query, head) with outputs o_a, o_b and natural-log log-sum-exps s_a, s_b
// gives
//     o = (exp(s_a - m) o_a + exp(s_b - m) o_b) / (exp(s_a - m) + exp(s_b - m)),   m = max(s_a, s_b),
//     s = m + log(exp(s_a - m) + exp(s_b - m)).
// A part with s = -inf saw no key and contributes nothing; both -inf gives zeros and -inf (FlashInfer's
// kernel would give NaN). One thread per quad of head dims (head_size is a multiple of 4), rows one after
// another, workgroups numbered linearly over a folded grid (MERGE_STATES in pagedvk/abi.py). The attention
// push constants carry the rows in num_seqs and head_size.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer OutA { Q_IN out_a[]; };   // [rows, head_size]
layout(std430, set = 0, binding = 1) readonly buffer LseA { float lse_a[]; };    // [rows]
layout(std430, set = 0, binding = 2) readonly buffer OutB { Q_IN out_b[]; };
layout(std430, set = 0, binding = 3) readonly buffer LseB { float lse_b[]; };
layout(std430, set = 0, binding = 4) writeonly buffer Out { Q_WORD out_[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Lse { float lse[]; };

#ifndef KV_CHUNK_QUADS
#define KV_CHUNK_QUADS 1u   // no cache here: attention_common.glsl's key addressing goes unused
#endif
#include "attention_common.glsl"

void main() {
    const uint wg = workgroup_index();
    const uint hq = pc.head_size / 4u;
    const uint i = wg * 128u + gl_LocalInvocationID.x;   // quad i of the flattened outputs
    if (hq == 0u || i >= pc.num_seqs * hq) return;
    const uint row = i / hq;
    if (i >= Q_QUADS(out_a) || i >= Q_QUADS(out_b) || 2u * i + 1u >= OUT_PAIRS(out_)
        || row >= uint(lse_a.length()) || row >= uint(lse_b.length()) || row >= uint(lse.length())) return;
    const float sa = lse_a[row], sb = lse_b[row];
    const float m = max(sa, sb);
    vec4 o = vec4(0.0);
    float s = NEG_INF;
    if (m != NEG_INF) {
        const float wa = exp(sa - m), wb = exp(sb - m);   // exp(-inf) = 0: an empty part weighs nothing
        const float total = wa + wb;
        // An empty part's output is not read: 0 * NaN would be NaN.
        if (sa != NEG_INF) o += (wa / total) * Q_QUAD_AT(out_a, i);
        if (sb != NEG_INF) o += (wb / total) * Q_QUAD_AT(out_b, i);
        s = m + log(total);
    }
    STORE_OUT_PAIR(out_, 2u * i, o.xy)
    STORE_OUT_PAIR(out_, 2u * i + 1u, o.zw)
    if (i % hq == 0u) lse[row] = s;
}
