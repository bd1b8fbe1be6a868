// KV-cache element storage, selected by one define per variant (see pagedvk/abi.py).
//
// The caches are bound as arrays of 16-byte chunks (uvec4) whatever the element type: that is vLLM's
// "x = 16 / itemsize" packing, so one chunk of the key cache holds CHUNK consecutive head dims of one
// token and one chunk of the value cache holds CHUNK consecutive tokens of one head dim. Each storage type
// only says how to turn a chunk into floats.
#ifndef KV_STORAGE_GLSL
#define KV_STORAGE_GLSL

#if defined(KV_F32)
#define CHUNK 4u
// dot(chunk, a[base .. base + CHUNK)) with a in shared memory
#define CHUNK_DOT(c, a, base) dot(uintBitsToFloat(c), vec4(a[(base)], a[(base) + 1u], a[(base) + 2u], a[(base) + 3u]))
// The same, but only the first n (<= CHUNK) elements count: positions past the end of a sequence may hold
// anything, NaN included, and 0 * NaN is NaN.
float chunk_dot_first(uvec4 c, vec4 w, uint n) {
    vec4 v = uintBitsToFloat(c);
    float s = 0.0;
    for (uint i = 0u; i < n; i++) s += v[i] * w[i];
    return s;
}
#define CHUNK_DOT_N(c, a, base, n) ((n) == CHUNK ? CHUNK_DOT(c, a, base) \
    : chunk_dot_first(c, vec4(a[(base)], a[(base) + 1u], a[(base) + 2u], a[(base) + 3u]), n))
#else
#error "no KV storage type defined (KV_F32)"
#endif

#endif
