#version 450
// linear_gemv: y = x @ weight.T (+ bias) for a few tokens (LINEAR_GEMV in pagedvk/kernels/catalogue.py), the decode's
// matrix-vector products. Reading the weights is the whole cost, so each is read once, in 16-byte chunks, for up to
// TOKENS tokens: a workgroup takes ROWS weight rows (output features) and one group of TOKENS tokens. LANES threads
// take RPW rows together, striding over the rows' chunks: x's elements for a chunk's columns are loaded once and
// applied to the RPW rows' chunks (x's loads, from the caches, were what held the kernel back on the H100, not the
// weights' bytes), every token of the group summed in float32 registers; then each row's LANES partial sums are
// added in shared memory (no subgroup operation: subgroup sizes differ, 32 on NVIDIA, 4 to 64 elsewhere).
//
// Rows start on a chunk boundary when in_features is a multiple of the chunk's elements (8, float32: 4), and the
// loop reads whole chunks; otherwise a chunk may straddle two rows and each element is checked against the row
// (in_features 100, 576 in float32...). Nothing past the weight array's last chunk is read.
#extension GL_GOOGLE_include_directive : require
#include "linear_common.glsl"

const uint LANES = 32u, RPW = 2u, TOKENS = 8u;     // catalogue.LINEAR_GEMV_TOKENS
const uint ROWS = 128u / LANES * RPW;              // catalogue.LINEAR_GEMV_ROWS
const uint UNROLL = 4u;
layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

shared float partial[TOKENS][ROWS * LANES];

void main() {
    const uint row_groups = (pc.out_features + ROWS - 1u) / ROWS;
    const uint wg = workgroup_index();
    if (wg >= row_groups * ((pc.tokens + TOKENS - 1u) / TOKENS)) return;   // the folded grid's spare workgroups
    const uint lane = gl_LocalInvocationID.x % LANES, warp = gl_LocalInvocationID.x / LANES;
    const uint n0 = (wg % row_groups) * ROWS + warp * RPW;   // this thread's first row of weight (output feature)
    const uint t0 = (wg / row_groups) * TOKENS;
    const uint group = min(TOKENS, pc.tokens - t0);          // tokens t0 .. t0 + group - 1
    const uint K = pc.in_features, per = chunk_elements();
    const uint rows = n0 < pc.out_features ? min(RPW, pc.out_features - n0) : 0u;

    float acc[RPW][TOKENS];
    for (uint r = 0u; r < RPW; ++r) for (uint t = 0u; t < TOKENS; ++t) acc[r][t] = 0.0;
    float v[8];
    if (K % per == 0u) {
        // Rows start on a chunk. UNROLL chunks of each row loaded before any is used: bytes in flight to cover the
        // memory's latency where a grid of few rows, or long rows, leaves few threads per core.
        const uint row_chunks = K / per;
        for (uint j0 = lane; j0 < row_chunks; j0 += UNROLL * LANES) {
            uvec4 chunk[UNROLL][RPW];
            for (uint u = 0u; u < UNROLL; ++u) {
                const uint j = j0 + u * LANES;
                for (uint r = 0u; r < RPW; ++r) chunk[u][r] = j < row_chunks && r < rows ? weight[(n0 + r) * row_chunks + j] : uvec4(0u);
            }
            for (uint u = 0u; u < UNROLL; ++u) {
                const uint j = j0 + u * LANES;
                if (j >= row_chunks) break;
                const uint k = j * per;
                for (uint t = 0u; t < TOKENS; ++t) {
                    if (t >= group) break;
                    const uint xi = (t0 + t) * K + k;
                    const vec4 xa = x_quad(xi), xb = per == 8u ? x_quad(xi + 4u) : vec4(0.0);
                    for (uint r = 0u; r < RPW; ++r) {
                        unpack_chunk(chunk[u][r], v);
                        acc[r][t] += dot(vec4(v[0], v[1], v[2], v[3]), xa) + dot(vec4(v[4], v[5], v[6], v[7]), xb);
                    }
                }
            }
        }
    } else {
        // A chunk may straddle two rows: each element is checked against its row. Nothing past the array is read.
        for (uint r = 0u; r < rows; ++r) {
            const uint start = (n0 + r) * K;                            // the row's first element
            const uint end = min((start + K + per - 1u) / per, weight.length());
            for (uint c = start / per + lane; c < end; c += LANES) {
                unpack_chunk(weight[c], v);
                for (uint e = 0u; e < per; ++e) {
                    const uint g = c * per + e;
                    if (g < start || g >= start + K) continue;          // another row's element
                    for (uint t = 0u; t < TOKENS; ++t) {
                        if (t >= group) break;
                        acc[r][t] += v[e] * ELEMENT(x, (t0 + t) * K + g - start, pc.x_type);
                    }
                }
            }
        }
    }

    // the group's tokens only (a decode of one sequence adds one token's sums, not eight)
    for (uint r = 0u; r < RPW; ++r) {
        const uint slot = (warp * RPW + r) * LANES + lane;
        for (uint t = 0u; t < TOKENS; ++t) {
            if (t >= group) break;
            partial[t][slot] = acc[r][t];
        }
    }
    barrier();
    for (uint s = LANES / 2u; s > 0u; s >>= 1) {
        if (lane < s) {
            for (uint r = 0u; r < RPW; ++r) {
                const uint slot = (warp * RPW + r) * LANES + lane;
                for (uint t = 0u; t < TOKENS; ++t) {
                    if (t >= group) break;
                    partial[t][slot] += partial[t][slot + s];
                }
            }
        }
        barrier();
    }
    // lane t writes token t's output of each of the thread's rows
    for (uint r = 0u; r < rows; ++r) {
        if (lane < group) {
            store_y((t0 + lane) * pc.out_features + n0 + r, partial[lane][(warp * RPW + r) * LANES] + bias_of(n0 + r));
        }
    }
}
