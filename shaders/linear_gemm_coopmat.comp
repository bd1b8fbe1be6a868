#version 450
// linear_gemm on cooperative matrices (VK_KHR_cooperative_matrix): y = x @ weight.T (+ bias) for float16 weights, with
// linear_gemm.comp's bindings, push constants and grid (LINEAR_GEMM in pagedvk/kernels/catalogue.py). The products
// are 16x16x16 float16 multiplies accumulated in float32 (kernels/matrix.py's MATRIX_SHAPE). The weights are float16
// already; float16 and bfloat16 x convert exactly (bfloat16 within float16's range); float32 x is split as it is
// staged into a float16 high part and the float16 rounding of the rest, x = hi + lo to about 2^-22, and both are
// multiplied: results as close to float32 products as the scalar kernels' (llama.cpp's matrix kernels round x to
// float16 once; the products are cheap here, the weights' bytes are the cost). pagedvk/ops/linear.py
// chooses it for float16 weights whose in_features is a multiple of 8 (a 16-byte chunk never straddles two rows),
// on devices that list the multiply, with 32-lane subgroups.
//
// One workgroup of four subgroups per 64 x 64 tile of y (tokens x output features); subgroup s owns the 32 x 32
// quarter (s / 2, s % 2) as 2 x 2 accumulators. The in_features are walked BK = 64 at a time: the step's slices of
// x ([64 tokens][64], converted to float16) and weight ([64 features][64], 16-byte chunks as they lie) go through
// shared memory, loaded into registers while the step before is multiplied (its latency hides behind the
// products). Rows past the arrays' edges are staged as zeros. The accumulators leave through shared memory, so that
// linear_common.glsl's store_y rounds each output to y's type and adds the bias, as the scalar kernels do.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#include "linear_common.glsl"

#if !defined(KV_F16)
#error "linear_gemm_coopmat is built for float16 weights (its module's storage axis, KV_F16)"
#endif

const uint TILE = 64u;                    // catalogue.LINEAR_GEMM_TILE: tokens and features a workgroup
const uint BK = 64u;                      // in_features a step
const uint KS = BK / 4u + 2u;             // a staged row's stride in f16vec4 (two spare: shared banks spread)
const uint OS = TILE / 4u + 1u;           // the output tile's row stride in vec4
layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

shared f16vec4 xs[TILE * KS];             // [token][k]
shared f16vec4 xs_lo[TILE * KS];          // [token][k]: float32 x's remainder (x - xs)
shared f16vec4 ws[TILE * KS];             // [feature][k]
shared vec4 ys[TILE * OS];                // [token][feature], the finished tile

#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define MAT_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

const uint X_QUADS = TILE * BK / 4u / 128u;   // x's quads a thread stages a step (8)
const uint W_CHUNKS = TILE * BK / 8u / 128u;  // weight's 16-byte chunks a thread stages a step (4)

vec4 x_regs[X_QUADS];
uvec4 w_regs[W_CHUNKS];

// The step at k0's slices into registers: zeros past the tokens, the features and in_features.
void load_step(uint t0, uint n0, uint k0) {
    const uint tid = gl_LocalInvocationID.x, K = pc.in_features;
    [[unroll]] for (uint q = 0u; q < X_QUADS; ++q) {
        const uint e = tid + 128u * q, row = e / (BK / 4u), k = k0 + 4u * (e % (BK / 4u));
        const uint t = t0 + row;
        x_regs[q] = t < pc.tokens && k < K ? x_quad(t * K + k) : vec4(0.0);   // K % 8 == 0: a quad is whole
    }
    [[unroll]] for (uint q = 0u; q < W_CHUNKS; ++q) {
        const uint c = tid + 128u * q, row = c / (BK / 8u), k = k0 + 8u * (c % (BK / 8u));
        const uint n = n0 + row;
        w_regs[q] = n < pc.out_features && k < K ? weight[(n * K + k) / 8u] : uvec4(0u);
    }
}

void stage_step() {
    const uint tid = gl_LocalInvocationID.x;
    [[unroll]] for (uint q = 0u; q < X_QUADS; ++q) {
        const uint e = tid + 128u * q;
        const f16vec4 hi = f16vec4(x_regs[q]);
        xs[(e / (BK / 4u)) * KS + e % (BK / 4u)] = hi;
        if (pc.x_type == T_F32) xs_lo[(e / (BK / 4u)) * KS + e % (BK / 4u)] = f16vec4(x_regs[q] - vec4(hi));
    }
    [[unroll]] for (uint q = 0u; q < W_CHUNKS; ++q) {
        const uint c = tid + 128u * q, at = (c / (BK / 8u)) * KS + 2u * (c % (BK / 8u));
        const uvec4 w = w_regs[q];
        ws[at] = f16vec4(unpackFloat2x16(w.x), unpackFloat2x16(w.y));
        ws[at + 1u] = f16vec4(unpackFloat2x16(w.z), unpackFloat2x16(w.w));
    }
}

void main() {
    const uint col_tiles = (pc.out_features + TILE - 1u) / TILE;
    const uint wg = workgroup_index();
    if (wg >= col_tiles * ((pc.tokens + TILE - 1u) / TILE)) return;   // the folded grid's spare workgroups
    const uint n0 = (wg % col_tiles) * TILE, t0 = (wg / col_tiles) * TILE;
    const uint sg = gl_SubgroupID, rows = 32u * (sg / 2u), cols = 32u * (sg % 2u);

    MAT_C acc[2][2];
    [[unroll]] for (uint i = 0u; i < 2u; ++i) [[unroll]] for (uint j = 0u; j < 2u; ++j) acc[i][j] = MAT_C(0.0);
    load_step(t0, n0, 0u);
    for (uint k0 = 0u; k0 < pc.in_features; k0 += BK) {
        barrier();                       // the step before has been multiplied: its slices may be overwritten
        stage_step();
        barrier();
        if (k0 + BK < pc.in_features) load_step(t0, n0, k0 + BK);
        [[unroll]] for (uint kk = 0u; kk < BK / 16u; ++kk) {
            MAT_A a[2];
            MAT_B b[2];
            [[unroll]] for (uint i = 0u; i < 2u; ++i)
                coopMatLoad(a[i], xs, (rows + 16u * i) * KS + 4u * kk, KS, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0u; j < 2u; ++j)   // B[k][n] = weight[n][k]: the staged rows as columns
                coopMatLoad(b[j], ws, (cols + 16u * j) * KS + 4u * kk, KS, gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint i = 0u; i < 2u; ++i) [[unroll]] for (uint j = 0u; j < 2u; ++j)
                acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
            if (pc.x_type == T_F32) {
                [[unroll]] for (uint i = 0u; i < 2u; ++i)
                    coopMatLoad(a[i], xs_lo, (rows + 16u * i) * KS + 4u * kk, KS, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint i = 0u; i < 2u; ++i) [[unroll]] for (uint j = 0u; j < 2u; ++j)
                    acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
            }
        }
    }
    [[unroll]] for (uint i = 0u; i < 2u; ++i) [[unroll]] for (uint j = 0u; j < 2u; ++j)
        coopMatStore(acc[i][j], ys, (rows + 16u * i) * OS + (cols + 16u * j) / 4u, OS,
                     gl_CooperativeMatrixLayoutRowMajor);
    barrier();
    const uint tid = gl_LocalInvocationID.x;
    for (uint e = tid; e < TILE * TILE; e += 128u) {   // consecutive threads, consecutive features: coalesced
        const uint row = e / TILE, col = e % TILE, t = t0 + row, n = n0 + col;
        if (t < pc.tokens && n < pc.out_features) store_y(t * pc.out_features + n, ys[row * OS + col / 4u][col % 4u] + bias_of(n));
    }
}
