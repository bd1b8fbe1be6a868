#version 450
// silu_and_mul: out[r, j] = silu(x[r, j]) * x[r, d + j], silu(a) = a / (1 + exp(-a)), for rows r of x [rows, 2d]
// and out [rows, d] of one type (x_type), rows x_pitch and out_pitch elements apart; one thread per pair of an
// output row (SILU_AND_MUL in pagedvk/kernels/catalogue.py, layer_elements.glsl).
#extension GL_GOOGLE_include_directive : require
#include "layer_elements.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer X { uint x[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Out { uint out_[]; };

layout(push_constant) uniform Params {
    uint num_rows;
    uint d;          // even
    uint x_type;     // x's and out's
    uint x_pitch;    // even
    uint out_pitch;  // even
} pc;

void main() {
    const uint pairs = pc.d / 2u;
    const uint i = layer_workgroup() * WG + gl_LocalInvocationID.x;
    if (pairs == 0u || i >= pc.num_rows * pairs) return;
    const uint r = i / pairs, j = i % pairs;
    const uint a = r * (pc.x_pitch / 2u) + j, b = a + pairs, o = r * (pc.out_pitch / 2u) + j;
    if (b >= PAIRS_IN(x, pc.x_type) || o >= PAIRS_IN(out_, pc.x_type)) return;
    const vec2 gate = LOAD_PAIR(x, a, pc.x_type);
    // exp(-a) overflows to inf for a below about -88: a / inf = -0, silu's limit
    STORE_PAIR(out_, o, pc.x_type, gate / (1.0 + exp(-gate)) * LOAD_PAIR(x, b, pc.x_type))
}
