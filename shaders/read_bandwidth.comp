#version 450
// The device's read bandwidth, the ceiling decode attention is measured against. Each workgroup reads tiles of
// UNROLL x 256 consecutive 16-byte chunks, grid-strided: every thread issues its UNROLL loads of a tile before it
// uses any (coalesced across neighbouring threads), XORs each into an accumulator of its own, and writes one word so the reads cannot be optimized
// away. One load a thread in flight read 1.3% slower on the H200 at 1 GiB (docs/benchmarks-log.md, 2026-12-03 "A truer ceiling").
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { uint dst[]; };

layout(push_constant) uniform Params {
    uint num_chunks;   // 16-byte chunks to read
} pc;

const uint UNROLL = 8u;
const uint TILE = UNROLL * 256u;

void main() {
    const uint n = min(pc.num_chunks, uint(src.length()));
    uvec4 acc[UNROLL];
    [[unroll]] for (uint u = 0u; u < UNROLL; u++) acc[u] = uvec4(0u);
    uint i = gl_WorkGroupID.x * TILE + gl_LocalInvocationID.x;
    for (; i + (UNROLL - 1u) * 256u < n; i += gl_NumWorkGroups.x * TILE) {
        uvec4 w[UNROLL];
        [[unroll]] for (uint u = 0u; u < UNROLL; u++) w[u] = src[i + u * 256u];
        [[unroll]] for (uint u = 0u; u < UNROLL; u++) acc[u] ^= w[u];
    }
    for (; i < n; i += 256u) acc[0] ^= src[i];   // this workgroup's last tile, where n cuts it short
    [[unroll]] for (uint u = 1u; u < UNROLL; u++) acc[0] ^= acc[u];
    if (gl_GlobalInvocationID.x < uint(dst.length())) dst[gl_GlobalInvocationID.x] = acc[0].x ^ acc[0].y ^ acc[0].z ^ acc[0].w;
}
