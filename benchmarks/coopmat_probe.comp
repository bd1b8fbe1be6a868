#version 450
// What a device's cooperative-matrix multiplies cost through Vulkan, alone and with the shared-memory loads the
// prefill matrix kernels do (benchmarks/coopmat_probe.py builds one module per MODE and times it):
//   MODE_FMA       float32 multiply-adds, eight independent chains a thread (any device: the scalar ceiling);
//   MODE_MMA       16x16x16 float16 products accumulated in float32, A and B held in registers;
//   MODE_MMA_BCOL  each product's B loaded from shared memory column-major (K^T, as the forward reads its keys);
//   MODE_MMA_BROW  each product's B loaded row-major (values staged [key][dim], the nhd layout);
//   MODE_MMA_AROW  each product's A loaded row-major (P, as the forward's P.V reads it);
//   MODE_LAYOUT    not timed: which matrix element each invocation holds. Matrices of their own element indices are
//                  loaded from shared memory (a 16x16 float16 A, a 16x8 float16 B and a 16x8 float32 accumulator,
//                  row-major), and each invocation writes its elements' values: out[(m * 32 + lane) * 16 + e] for
//                  matrix m, element e (-1 past the invocation's count). A kernel that builds a matrix in registers
//                  (fp8 bytes turned into float16 elements, say) needs this map.
// Eight accumulators a subgroup, four subgroups a workgroup, ITERS steps of eight products; the results are
// stored so that nothing is dead code. Shared memory is laid out as paged_prefill_coopmat.comp's key tile: 64 rows
// of 128 float16 head dims, a row stride of KS quads.
#extension GL_EXT_control_flow_attributes : require
#if MODE != MODE_FMA
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;
layout(std430, set = 0, binding = 0) writeonly buffer Out { float out_[]; };   // 8 x 256 floats a subgroup
layout(push_constant) uniform Push { uint iters; } pc;

#if MODE == MODE_FMA
void main() {
    const uint tid = gl_GlobalInvocationID.x;
    vec4 a[8];
    [[unroll]] for (uint j = 0u; j < 8u; j++) a[j] = vec4(float(tid + j) * 1e-7);
    const vec4 m = vec4(0.999), b = vec4(1e-7);
    for (uint it = 0u; it < pc.iters; it++) {
        [[unroll]] for (uint j = 0u; j < 8u; j++) a[j] = a[j] * m + b;   // 32 multiply-adds a step
    }
    vec4 s = vec4(0.0);
    [[unroll]] for (uint j = 0u; j < 8u; j++) s += a[j];
    out_[tid] = dot(s, vec4(1.0));
}
#elif MODE == MODE_LAYOUT
shared float16_t s_a[256];
shared float16_t s_b[128];
shared float s_c[128];

void main() {
    const uint lane = gl_SubgroupInvocationID, tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < 256u; i += 128u) s_a[i] = float16_t(float(i));   // exact: integers below 2048
    for (uint i = tid; i < 128u; i += 128u) { s_b[i] = float16_t(float(i)); s_c[i] = float(i); }
    barrier();
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
    coopmat<float16_t, gl_ScopeSubgroup, 16, 8, gl_MatrixUseB> b;
    coopmat<float, gl_ScopeSubgroup, 16, 8, gl_MatrixUseAccumulator> c;
    coopMatLoad(a, s_a, 0u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(b, s_b, 0u, 8u, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(c, s_c, 0u, 8u, gl_CooperativeMatrixLayoutRowMajor);
    if (gl_WorkGroupID.x != 0u || gl_SubgroupID != 0u || lane >= 32u) return;
    [[unroll]] for (uint e = 0u; e < 16u; e++) {
        out_[lane * 16u + e] = e < uint(a.length()) ? float(a[e]) : -1.0;
        out_[(32u + lane) * 16u + e] = e < uint(b.length()) ? float(b[e]) : -1.0;
        out_[(64u + lane) * 16u + e] = e < uint(c.length()) ? c[e] : -1.0;
    }
}
#else
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define MAT_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
const uint ROWS = 64u, DQ = 32u, KS = DQ + 2u;
shared f16vec4 s_kv[ROWS * KS];

void main() {
    const uint tid = gl_LocalInvocationID.x, warp = gl_SubgroupID;
    for (uint i = tid; i < ROWS * KS; i += 128u) s_kv[i] = f16vec4(float16_t(float(i % 7u) * 0.01));
    barrier();
    MAT_A a;
    MAT_B b;
    coopMatLoad(a, s_kv, warp * 16u * KS, KS, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(b, s_kv, warp * 16u * KS + 4u, KS, gl_CooperativeMatrixLayoutColumnMajor);
    MAT_C c[8];
    [[unroll]] for (uint j = 0u; j < 8u; j++) c[j] = MAT_C(0.0);
    for (uint it = 0u; it < pc.iters; it++) {
        const uint k = (it & 7u) * 4u;   // the step's 16 head dims
        [[unroll]] for (uint j = 0u; j < 8u; j++) {
#if MODE == MODE_MMA
            c[j] = coopMatMulAdd(a, b, c[j]);
#elif MODE == MODE_MMA_BCOL
            MAT_B bj;   // keys j*16 .. j*16+15 (of 64: two rounds), head dims k*4 ..
            coopMatLoad(bj, s_kv, (j & 3u) * 16u * KS + k, KS, gl_CooperativeMatrixLayoutColumnMajor);
            c[j] = coopMatMulAdd(a, bj, c[j]);
#elif MODE == MODE_MMA_BROW
            MAT_B bj;   // keys k/4*4 .. (16 rows), head dims j*16 ..
            coopMatLoad(bj, s_kv, (it & 3u) * 16u * KS + j * 4u, KS, gl_CooperativeMatrixLayoutRowMajor);
            c[j] = coopMatMulAdd(a, bj, c[j]);
#elif MODE == MODE_MMA_AROW
            MAT_A aj;
            coopMatLoad(aj, s_kv, (j & 3u) * 16u * KS + k, KS, gl_CooperativeMatrixLayoutRowMajor);
            c[j] = coopMatMulAdd(aj, b, c[j]);
#endif
        }
    }
    const uint base = (gl_WorkGroupID.x * 4u + warp) * 8u * 256u;
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        coopMatStore(c[j], out_, base + j * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    }
}
#endif
