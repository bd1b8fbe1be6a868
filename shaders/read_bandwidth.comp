#version 450
// The device's read bandwidth, the ceiling decode attention is measured against: every thread reads
// 16-byte chunks in a grid-stride loop (coalesced across neighbouring threads), sums them, and writes one
// word so the reads cannot be optimized away.
layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { uint dst[]; };

layout(push_constant) uniform Params {
    uint num_chunks;   // 16-byte chunks to read
} pc;

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const uint n = min(pc.num_chunks, uint(src.length()));
    uvec4 acc = uvec4(0u);
    for (uint i = gl_GlobalInvocationID.x; i < n; i += stride) acc ^= src[i];
    if (gl_GlobalInvocationID.x < uint(dst.length())) dst[gl_GlobalInvocationID.x] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
