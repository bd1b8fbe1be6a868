#version 450
// sampling: one token per row of logits (SAMPLING in pagedvk/kernels/catalogue.py), one workgroup a row, every
// step a pass over the row with a workgroup reduction (shared memory only: no subgroup operation).
//
//   temperature 0: the argmax (ties: the lowest index).
//   else, vLLM's and FlashInfer's top-k then top-p over softmax(logits / temperature), by thresholds, not a sort:
//   1. top-k: the k-th largest logit's order-preserving 32-bit key, the largest key t with at least k logits >= t,
//      found 4 bits a pass (threshold_search: 8 counting passes). Ties with it are kept.
//   2. top-p: among those, the largest key t whose logits >= t still hold top_p of the kept probability (the
//      same search over sums of exp((l - max) / temperature), after one pass for their total); every logit at or
//      above it is kept, so the kept set is the shortest prefix of the sorted probabilities reaching top_p, and
//      its ties.
//   3. the draw: the kept logit maximizing l / temperature - log(E), E exponential from a counter-based hash of
//      (seed, offset, index) (PCG's pcg4d): the exponential race, distributed exactly as the kept softmax, in one
//      pass, as vLLM's `probs / q.exponential_()` argmax. The same (seed, offset) gives the same token.
// NaN logits count as -inf. The WGSL twin is shaders/sampling.wgsl.
layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;
const uint WG = 256u;

layout(std430, set = 0, binding = 0) readonly buffer Logits { uint logits[]; };        // [batch, vocab]
layout(std430, set = 0, binding = 1) readonly buffer Temps { float temperatures[]; };  // [batch] (per_row & 1)
layout(std430, set = 0, binding = 2) readonly buffer TopKs { int top_ks[]; };          // [batch] (per_row & 2)
layout(std430, set = 0, binding = 3) readonly buffer TopPs { float top_ps[]; };        // [batch] (per_row & 4)
layout(std430, set = 0, binding = 4) readonly buffer Seeds { uint seeds[]; };          // [batch] int64 (per_row & 8)
layout(std430, set = 0, binding = 5) buffer Out { int tokens[]; };                     // [batch]

layout(push_constant) uniform Params {
    uint batch;
    uint vocab;
    uint logits_type;   // abi.QUERY_TYPES: 0 float32, 1 float16, 2 bfloat16
    float temperature;  // the whole batch's, where per_row leaves the array unread
    uint top_k;         // 0: off
    float top_p;        // 1: off
    uint seed_lo;
    uint seed_hi;
    uint offset;        // the generator's step: a new draw for the same seed
    uint per_row;       // which of the arrays above are read: 1 temperatures, 2 top_ks, 4 top_ps, 8 seeds
    uint mix_row;       // 1: one seed for the batch, each row's draw keyed by its row too
} pc;

// The logit at flat index i, NaN as -inf.
float logit(uint i) {
    const uint w = logits[pc.logits_type == 0u ? i : i >> 1];
    float v = uintBitsToFloat(w);
    if (pc.logits_type == 1u) v = unpackHalf2x16(w)[i & 1u];
    else if (pc.logits_type == 2u) v = uintBitsToFloat((i & 1u) == 1u ? (w & 0xffff0000u) : (w << 16));
    return isnan(v) ? uintBitsToFloat(0xff800000u) : v;
}

// A key ordering floats as uints: larger float, larger key.
uint order_key(float v) {
    const uint b = floatBitsToUint(v);
    return (b & 0x80000000u) != 0u ? ~b : b | 0x80000000u;
}

// Jarzynski and Olano's pcg4d (JCGT 2020): a counter-based hash, every output bit depending on every input bit.
uvec4 pcg4d(uvec4 v) {
    v = v * 1664525u + 1013904223u;
    v.x += v.y * v.w; v.y += v.z * v.x; v.z += v.x * v.y; v.w += v.y * v.z;
    v ^= v >> 16u;
    v.x += v.y * v.w; v.y += v.z * v.x; v.z += v.x * v.y; v.w += v.y * v.z;
    return v;
}

shared float red_f[WG];
shared uint red_u[WG];

float workgroup_sum(float v) {
    barrier();   // every thread has read the previous reduction's result
    red_f[gl_LocalInvocationID.x] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (gl_LocalInvocationID.x < s) red_f[gl_LocalInvocationID.x] += red_f[gl_LocalInvocationID.x + s];
        barrier();
    }
    return red_f[0];
}

// The index of the largest value over the workgroup (ties: the lowest index; index 0xffffffff: none).
uint workgroup_argmax(float v, uint index) {
    barrier();
    red_f[gl_LocalInvocationID.x] = v;
    red_u[gl_LocalInvocationID.x] = index;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        const uint t = gl_LocalInvocationID.x;
        if (t < s) {
            const float o = red_f[t + s];
            const uint oi = red_u[t + s];
            if (o > red_f[t] || (o == red_f[t] && oi < red_u[t])) { red_f[t] = o; red_u[t] = oi; }
        }
        barrier();
    }
    return red_u[0];
}

shared float red_digits[15][WG / 2u];

// The largest key t whose logits at or above both t and floor_key weigh at least `want` (each 1, or where `weighted`
// its exp((l - top) * inv_t)), given that t = 0 does. Four bits a pass, most significant first: a pass weighs, for
// each next digit d = 1 .. 15, the logits at or above t's bits so far followed by d (then zeros), and keeps the
// largest d that still weighs enough (0 always does). Counts are exact in float32 up to 2^24 logits.
uint threshold_search(uint base, uint floor_key, float want, bool weighted, float top, float inv_t) {
    const uint tid = gl_LocalInvocationID.x;
    uint found = 0u;
    for (int level = 7; level >= 0; --level) {
        const uint shift = 4u * uint(level);
        const uint prefix = level == 7 ? 0u : found >> (shift + 4u);   // the bits fixed so far
        float part[15];
        for (uint d = 0u; d < 15u; ++d) part[d] = 0.0;
        for (uint i = tid; i < pc.vocab; i += WG) {
            const float l = logit(base + i);
            const uint key = order_key(l);
            const uint high = level == 7 ? 0u : key >> (shift + 4u);
            if (key < floor_key || high < prefix) continue;
            const uint digit = high > prefix ? 16u : (key >> shift) & 15u;   // 16: above every candidate
            const float w = weighted ? exp((l - top) * inv_t) : 1.0;
            for (uint d = 0u; d < 15u; ++d) part[d] += digit > d ? w : 0.0;   // part[d]: keys >= digit d + 1
        }
        barrier();   // every thread has read the previous pass's sums
        if (tid >= WG / 2u) for (uint d = 0u; d < 15u; ++d) red_digits[d][tid - WG / 2u] = part[d];
        barrier();
        if (tid < WG / 2u) for (uint d = 0u; d < 15u; ++d) red_digits[d][tid] += part[d];
        barrier();
        for (uint s = WG / 4u; s > 0u; s >>= 1) {
            if (tid < s) for (uint d = 0u; d < 15u; ++d) red_digits[d][tid] += red_digits[d][tid + s];
            barrier();
        }
        uint digit = 0u;
        for (uint d = 15u; d > 0u; --d) {
            if (red_digits[d - 1u][0] >= want) { digit = d; break; }
        }
        found |= digit << shift;
    }
    return found;
}

void main() {
    const uint row = gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
    if (row >= pc.batch) return;   // the folded grid's spare workgroups
    const uint tid = gl_LocalInvocationID.x, base = row * pc.vocab;
    const float NEG_INF = uintBitsToFloat(0xff800000u);

    const float temperature = (pc.per_row & 1u) != 0u ? temperatures[row] : pc.temperature;
    const int k_given = (pc.per_row & 2u) != 0u ? top_ks[row] : int(pc.top_k);
    const float top_p = (pc.per_row & 4u) != 0u ? top_ps[row] : pc.top_p;

    // the largest logit, and where it first is
    float best = NEG_INF;
    uint best_i = 0xffffffffu;
    for (uint i = tid; i < pc.vocab; i += WG) {
        const float l = logit(base + i);
        if (l > best || best_i == 0xffffffffu) { best = l; best_i = i; }   // strided: the first of ties
    }
    const uint arg = min(workgroup_argmax(best_i == 0xffffffffu ? NEG_INF : best, best_i), pc.vocab - 1u);
    const float top = red_f[0];   // the largest logit
    // Greedy: temperature 0 (or, from unvalidated arrays, not a positive finite number), or no finite largest logit.
    if (!(temperature > 0.0) || isinf(temperature) || isinf(top)) {
        if (tid == 0u) tokens[row] = int(arg);
        return;
    }
    const float inv_t = 1.0 / temperature;

    // 1. top-k's threshold key
    uint threshold = 0u;
    if (k_given > 0 && uint(k_given) < pc.vocab) {
        threshold = threshold_search(base, 0u, float(k_given), false, top, inv_t);
    }
    // 2. top-p's, at or above it
    if (top_p < 1.0) {
        float z = 0.0;
        for (uint i = tid; i < pc.vocab; i += WG) {
            const float l = logit(base + i);
            z += order_key(l) >= threshold ? exp((l - top) * inv_t) : 0.0;
        }
        const float want = top_p * workgroup_sum(z);
        threshold = max(threshold, threshold_search(base, threshold, want, true, top, inv_t));
    }
    // 3. the exponential race over the kept logits
    uint seed_lo = pc.seed_lo, seed_hi = pc.seed_hi;
    if ((pc.per_row & 8u) != 0u) { seed_lo = seeds[2u * row]; seed_hi = seeds[2u * row + 1u]; }
    if (pc.mix_row != 0u) seed_hi ^= row * 0x9e3779b9u + 0x7f4a7c15u;
    float score = NEG_INF;
    uint chosen = 0xffffffffu;
    for (uint i = tid; i < pc.vocab; i += WG) {
        const float l = logit(base + i);
        if (order_key(l) < threshold) continue;
        const uint h = pcg4d(uvec4(i, pc.offset, seed_lo, seed_hi)).x;
        const float u = (float(h >> 8) + 0.5) * (1.0 / 16777216.0);   // (0, 1)
        const float s = (l - top) * inv_t - log(-log(u));
        if (s > score || chosen == 0xffffffffu) { score = s; chosen = i; }
    }
    const uint token = workgroup_argmax(chosen == 0xffffffffu ? NEG_INF : score, chosen);
    // None kept only where an unvalidated top_p <= 0 left nothing: the largest logit then.
    if (tid == 0u) tokens[row] = int(token == 0xffffffffu ? arg : token);
}
