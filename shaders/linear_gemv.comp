#version 450
// linear_gemv: y = x @ weight.T (+ bias) for a few tokens (LINEAR_GEMV in pagedvk/kernels/catalogue.py), the decode's
// matrix-vector products. Reading the weights is the whole cost, so each is read once, in 16-byte chunks, for up to
// TOKENS tokens: a workgroup takes ROWS weight rows (output features) and one group of TOKENS tokens, LANES threads
// a row striding over the row's chunks, each applying a chunk to every token of the group (float32 sums in
// registers), then the row's LANES partial sums are added in shared memory (no subgroup operation: subgroup sizes
// differ, 32 on NVIDIA, 4 to 64 elsewhere).
//
// Rows start on a chunk boundary when in_features is a multiple of the chunk's elements (8, float32: 4), and the
// loop reads whole chunks; otherwise a chunk may straddle two rows and each element is checked against the row
// (in_features 100, 576 in float32...). Nothing past the weight array's last chunk is read.
#extension GL_GOOGLE_include_directive : require
#include "linear_common.glsl"

const uint ROWS = 4u, LANES = 32u, TOKENS = 8u;   // catalogue.LINEAR_GEMV_ROWS, LINEAR_GEMV_TOKENS
const uint UNROLL = 4u;
layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

shared float partial[TOKENS][ROWS * LANES];

void main() {
    const uint row_groups = (pc.out_features + ROWS - 1u) / ROWS;
    const uint wg = workgroup_index();
    if (wg >= row_groups * ((pc.tokens + TOKENS - 1u) / TOKENS)) return;   // the folded grid's spare workgroups
    const uint lane = gl_LocalInvocationID.x % LANES, r = gl_LocalInvocationID.x / LANES;
    const uint n = (wg % row_groups) * ROWS + r;        // this thread's row of weight (output feature)
    const uint t0 = (wg / row_groups) * TOKENS;
    const uint group = min(TOKENS, pc.tokens - t0);     // tokens t0 .. t0 + group - 1
    const uint K = pc.in_features, per = chunk_elements();

    float acc[TOKENS];
    for (uint t = 0u; t < TOKENS; ++t) acc[t] = 0.0;
    if (n < pc.out_features) {
        const uint start = n * K;                                       // the row's first element
        const uint end = min((start + K + per - 1u) / per, weight.length());
        float v[8];
        if (K % per == 0u) {
            // UNROLL chunks' loads issued before any is used: bytes in flight to cover the memory's latency where a
            // grid of few rows, or long rows, leaves few threads per core
            for (uint c0 = start / per + lane; c0 < end; c0 += UNROLL * LANES) {
                uvec4 chunk[UNROLL];
                for (uint u = 0u; u < UNROLL; ++u) {
                    const uint c = c0 + u * LANES;
                    chunk[u] = c < end ? weight[c] : uvec4(0u);
                }
                for (uint u = 0u; u < UNROLL; ++u) {
                    const uint c = c0 + u * LANES;
                    if (c >= end) break;
                    unpack_chunk(chunk[u], v);
                    const uint k = c * per - start;
                    for (uint t = 0u; t < TOKENS; ++t) {
                        if (t >= group) break;
                        const uint xi = (t0 + t) * K + k;
                        float s = dot(vec4(v[0], v[1], v[2], v[3]), x_quad(xi));
                        if (per == 8u) s += dot(vec4(v[4], v[5], v[6], v[7]), x_quad(xi + 4u));
                        acc[t] += s;
                    }
                }
            }
        } else {
            for (uint c = start / per + lane; c < end; c += LANES) {
                unpack_chunk(weight[c], v);
                for (uint j = 0u; j < per; ++j) {
                    const uint g = c * per + j;
                    if (g < start || g >= start + K) continue;          // another row's element
                    for (uint t = 0u; t < TOKENS; ++t) {
                        if (t >= group) break;
                        acc[t] += v[j] * ELEMENT(x, (t0 + t) * K + g - start, pc.x_type);
                    }
                }
            }
        }
    }

    // the group's tokens only (a decode of one sequence adds one token's sums, not eight)
    for (uint t = 0u; t < TOKENS; ++t) {
        if (t >= group) break;
        partial[t][gl_LocalInvocationID.x] = acc[t];
    }
    barrier();
    for (uint s = LANES / 2u; s > 0u; s >>= 1) {
        if (lane < s) {
            for (uint t = 0u; t < TOKENS; ++t) {
                if (t >= group) break;
                partial[t][gl_LocalInvocationID.x] += partial[t][gl_LocalInvocationID.x + s];
            }
        }
        barrier();
    }
    // lane t writes token t's output of the row
    if (n < pc.out_features && lane < group) {
        store_y((t0 + lane) * pc.out_features + n, partial[lane][r * LANES] + bias_of(n));
    }
}
