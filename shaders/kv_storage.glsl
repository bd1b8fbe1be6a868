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
#define CHUNK_VEC4(c) uintBitsToFloat(c)
#else
#error "no KV storage type defined (KV_F32)"
#endif

// A chunk's first n (<= CHUNK) elements, the rest zero: elements past the end of a sequence may hold
// anything, NaN included, and 0 * NaN is NaN.
vec4 chunk_first(vec4 v, uint n) {
    return vec4(v.x, n > 1u ? v.y : 0.0, n > 2u ? v.z : 0.0, n > 3u ? v.w : 0.0);
}
#define CHUNK_VEC4_FIRST(c, n) chunk_first(CHUNK_VEC4(c), n)

#endif
