// What the decode kernels (paged_decode.comp, and paged_decode_cpu.comp for CPU devices) share beyond
// attention_common.glsl. Included after it by kernels that bind block_tables.
#ifndef DECODE_COMMON_GLSL
#define DECODE_COMMON_GLSL

// A block-table entry, -1 where it is not a block of the caches.
int physical_block(uint i) {
    const int b = block_tables[i];
    return (b >= 0 && uint(b) < pc.num_blocks) ? b : -1;
}

// The first n (<= 4) elements of v, the rest zero: slots past a sequence's end may hold anything, NaN
// included, and 0 * NaN is NaN.
vec4 first(vec4 v, uint n) {
    return n >= 4u ? v : vec4(v.x, n > 1u ? v.y : 0.0, n > 2u ? v.z : 0.0, 0.0);
}

#endif
