#version 450
// rms_norm and fused_add_rms_norm (RMS_NORM in pagedvk/kernels/catalogue.py): one workgroup per row of
// hidden_size elements,
//     z = x (+ residual, stored back into residual rounded to its type, with ADD_RESIDUAL)
//     y = z / sqrt(mean(z^2) + epsilon) * weight
// written to out, or into x with WRITE_INPUT (vLLM's fused_add_rms_norm, and rms_norm given out = input). The sum
// of squares is float32, each thread's share then a tree in shared memory (no subgroup operations: every device
// runs it). x, residual and out share x_type, weight has weight_type (layer_elements.glsl); each array's rows lie its
// own pitch apart. A binding the flags leave unused holds another of the launch's written arrays and is never read.
#extension GL_GOOGLE_include_directive : require
#include "layer_elements.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) buffer X { uint x[]; };
layout(std430, set = 0, binding = 1) buffer Residual { uint residual[]; };
layout(std430, set = 0, binding = 2) readonly buffer Weight { uint weight[]; };
layout(std430, set = 0, binding = 3) buffer Out { uint out_[]; };

layout(push_constant) uniform Params {
    uint num_tokens;
    uint hidden_size;     // even
    float epsilon;
    uint x_type;
    uint weight_type;
    uint flags;           // ADD_RESIDUAL | WRITE_INPUT
    uint x_pitch;         // even, as the other pitches
    uint residual_pitch;
    uint out_pitch;
} pc;

const uint ADD_RESIDUAL = 1u, WRITE_INPUT = 2u;

shared float partial[WG];

void main() {
    const uint row = layer_workgroup();   // uniform: a workgroup that returns here returns whole
    const uint pairs = pc.hidden_size / 2u, tid = gl_LocalInvocationID.x;
    const bool add = (pc.flags & ADD_RESIDUAL) != 0u, into_x = (pc.flags & WRITE_INPUT) != 0u;
    const uint xp = row * (pc.x_pitch / 2u), rp = row * (pc.residual_pitch / 2u), op = row * (pc.out_pitch / 2u);
    if (row >= pc.num_tokens || pairs == 0u || xp + pairs > PAIRS_IN(x, pc.x_type)
        || pairs > PAIRS_IN(weight, pc.weight_type)
        || (add && rp + pairs > PAIRS_IN(residual, pc.x_type))
        || (!into_x && op + pairs > PAIRS_IN(out_, pc.x_type))) return;

    float sum = 0.0;
    for (uint j = tid; j < pairs; j += WG) {
        vec2 z = LOAD_PAIR(x, xp + j, pc.x_type);
        if (add) {
            z = rounded_to(z + LOAD_PAIR(residual, rp + j, pc.x_type), pc.x_type);
            STORE_PAIR(residual, rp + j, pc.x_type, z)
        }
        sum += dot(z, z);
    }
    partial[tid] = sum;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) partial[tid] += partial[tid + s];
        barrier();
    }
    const float scale = inversesqrt(partial[0] / float(pc.hidden_size) + pc.epsilon);

    // The same pairs as above, per thread: a thread reads back only the residual pairs it stored itself.
    for (uint j = tid; j < pairs; j += WG) {
        const vec2 z = add ? LOAD_PAIR(residual, rp + j, pc.x_type) : LOAD_PAIR(x, xp + j, pc.x_type);
        const vec2 y = z * scale * LOAD_PAIR(weight, j, pc.weight_type);
        if (into_x) STORE_PAIR(x, xp + j, pc.x_type, y)
        else STORE_PAIR(out_, op + j, pc.x_type, y)
    }
}
