// linear_gemm, WGSL: shaders/linear_gemm.comp statement for statement, with the same interface (LINEAR_GEMM in
// pagedvk/kernels/catalogue.py); the GLSL source explains the tiling.

//!include linear_common.wgsl

const TILE: u32 = 64u;
const STEP: u32 = 16u;
const ROW: u32 = 68u;   // TILE + 4: a k's row of the staged slices

var<workgroup> xs: array<f32, 1088>;   // [STEP][ROW]: [k][token]
var<workgroup> ws: array<f32, 1088>;   // [STEP][ROW]: [k][output feature]

@compute @workgroup_size(256, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let col_tiles = (pc.out_features + TILE - 1u) / TILE;
    let wg = workgroup_index(wid, nwg);
    if (wg >= col_tiles * ((pc.tokens + TILE - 1u) / TILE)) {
        return;
    }
    let n0 = (wg % col_tiles) * TILE;
    let t0 = (wg / col_tiles) * TILE;
    let tx = tid % 16u;
    let ty = tid / 16u;
    let K = pc.in_features;

    var acc: array<vec4<f32>, 4>;   // acc[i][j]: token ty + 16 i, output tx + 16 j
    for (var i = 0u; i < 4u; i++) {
        acc[i] = vec4<f32>(0.0);
    }
    for (var k0 = 0u; k0 < K; k0 += STEP) {
        for (var q = 0u; q < TILE * STEP / 256u; q++) {
            let e = tid + 256u * q;
            let row = e / STEP;
            let kk = e % STEP;
            let k = k0 + kk;
            let t = t0 + row;
            let n = n0 + row;
            var xv = 0.0;
            if (t < pc.tokens && k < K) {
                xv = x_element(t * K + k);
            }
            var wv = 0.0;
            if (n < pc.out_features && k < K) {
                wv = weight_element(n * K + k);
            }
            xs[kk * ROW + row] = xv;
            ws[kk * ROW + row] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < STEP; kk++) {
            let a = vec4<f32>(xs[kk * ROW + ty], xs[kk * ROW + ty + 16u], xs[kk * ROW + ty + 32u], xs[kk * ROW + ty + 48u]);
            let b = vec4<f32>(ws[kk * ROW + tx], ws[kk * ROW + tx + 16u], ws[kk * ROW + tx + 32u], ws[kk * ROW + tx + 48u]);
            for (var i = 0u; i < 4u; i++) {
                acc[i] += a[i] * b;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = t0 + ty + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let n = n0 + tx + 16u * j;
            if (t < pc.tokens && n < pc.out_features) {
                store_y(t * pc.out_features + n, acc[i][j] + bias_of(n));
            }
        }
    }
}
