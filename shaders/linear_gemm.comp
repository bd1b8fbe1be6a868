#version 450
// linear_gemm: y = x @ weight.T (+ bias) for many tokens (LINEAR_GEMM in pagedvk/kernels/catalogue.py), the
// prefill's matrix products. A workgroup computes a TILE x TILE tile of y (tokens x output features): STEP columns
// of in_features at a time, it stages x's and weight's slices in shared memory as float32 (converted from their
// types as they are loaded, zero past the arrays' edges), then each thread adds the products of its 4 x 4 outputs,
// which lie 16 apart so that the 16 threads of a row of the tile read 16 consecutive shared words. float32 sums.
#extension GL_GOOGLE_include_directive : require
#include "linear_common.glsl"

const uint TILE = 64u, STEP = 16u, PAD = 4u;   // catalogue.LINEAR_GEMM_TILE
layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

shared float xs[STEP][TILE + PAD];   // [k][token]
shared float ws[STEP][TILE + PAD];   // [k][output feature]

void main() {
    const uint col_tiles = (pc.out_features + TILE - 1u) / TILE;
    const uint wg = workgroup_index();
    if (wg >= col_tiles * ((pc.tokens + TILE - 1u) / TILE)) return;   // the folded grid's spare workgroups
    const uint n0 = (wg % col_tiles) * TILE, t0 = (wg / col_tiles) * TILE;
    const uint tid = gl_LocalInvocationID.x, tx = tid % 16u, ty = tid / 16u;
    const uint K = pc.in_features;

    float acc[4][4];
    for (uint i = 0u; i < 4u; ++i) for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0;
    for (uint k0 = 0u; k0 < K; k0 += STEP) {
        for (uint q = 0u; q < TILE * STEP / 256u; ++q) {   // 4 elements of each slice a thread, k fastest
            const uint e = tid + 256u * q, row = e / STEP, kk = e % STEP, k = k0 + kk;
            const uint t = t0 + row, n = n0 + row;
            xs[kk][row] = t < pc.tokens && k < K ? ELEMENT(x, t * K + k, pc.x_type) : 0.0;
            ws[kk][row] = n < pc.out_features && k < K ? weight_element(n * K + k) : 0.0;
        }
        barrier();
        for (uint kk = 0u; kk < STEP; ++kk) {
            vec4 a = vec4(xs[kk][ty], xs[kk][ty + 16u], xs[kk][ty + 32u], xs[kk][ty + 48u]);
            vec4 b = vec4(ws[kk][tx], ws[kk][tx + 16u], ws[kk][tx + 32u], ws[kk][tx + 48u]);
            for (uint i = 0u; i < 4u; ++i) for (uint j = 0u; j < 4u; ++j) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    for (uint i = 0u; i < 4u; ++i) {
        const uint t = t0 + ty + 16u * i;
        for (uint j = 0u; j < 4u; ++j) {
            const uint n = n0 + tx + 16u * j;
            if (t < pc.tokens && n < pc.out_features) store_y(t * pc.out_features + n, acc[i][j] + bias_of(n));
        }
    }
}
