// linear_gemv, WGSL: shaders/linear_gemv.comp statement for statement, with the same interface (LINEAR_GEMV in
// pagedvk/kernels/catalogue.py); the GLSL source explains the algorithm.

//!include linear_common.wgsl

const ROWS: u32 = 4u;
const LANES: u32 = 32u;
const TOKENS: u32 = 8u;
const UNROLL: u32 = 4u;   // chunks' loads in flight per thread (linear_gemv.comp)
const WG: u32 = 128u;

var<workgroup> partial: array<f32, 1024>;   // [TOKENS][ROWS * LANES]

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row_groups = (pc.out_features + ROWS - 1u) / ROWS;
    let wg = workgroup_index(wid, nwg);
    if (wg >= row_groups * ((pc.tokens + TOKENS - 1u) / TOKENS)) {
        return;
    }
    let lane = lid % LANES;
    let r = lid / LANES;
    let n = (wg % row_groups) * ROWS + r;
    let t0 = (wg / row_groups) * TOKENS;
    let group = min(TOKENS, pc.tokens - t0);
    let K = pc.in_features;
    let per = chunk_elements();

    var acc: array<f32, 8>;
    for (var t = 0u; t < TOKENS; t++) {
        acc[t] = 0.0;
    }
    if (n < pc.out_features) {
        let start = n * K;
        let end = min((start + K + per - 1u) / per, arrayLength(&weight));
        if (K % per == 0u) {
            for (var c0 = start / per + lane; c0 < end; c0 += UNROLL * LANES) {
                var chunk: array<vec4<u32>, 4>;
                for (var u = 0u; u < UNROLL; u++) {
                    let c = c0 + u * LANES;
                    chunk[u] = select(vec4<u32>(0u), weight[min(c, end - 1u)], c < end);
                }
                for (var u = 0u; u < UNROLL; u++) {
                    let c = c0 + u * LANES;
                    if (c >= end) {
                        break;
                    }
                    let v = unpack_chunk(chunk[u]);
                    let k = c * per - start;
                    for (var t = 0u; t < group; t++) {
                        let xi = (t0 + t) * K + k;
                        var s = dot(v[0], x_quad(xi));
                        if (per == 8u) {
                            s += dot(v[1], x_quad(xi + 4u));
                        }
                        acc[t] += s;
                    }
                }
            }
        } else {
            for (var c = start / per + lane; c < end; c += LANES) {
                var v = unpack_chunk(weight[c]);
                for (var j = 0u; j < per; j++) {
                    let g = c * per + j;
                    if (g < start || g >= start + K) {
                        continue;
                    }
                    let w = v[j / 4u][j % 4u];
                    for (var t = 0u; t < group; t++) {
                        acc[t] += w * x_element((t0 + t) * K + g - start);
                    }
                }
            }
        }
    }

    for (var t = 0u; t < TOKENS; t++) {
        partial[t * WG + lid] = acc[t];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var t = 0u; t < TOKENS; t++) {
                partial[t * WG + lid] += partial[t * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (n < pc.out_features && lane < group) {
        store_y((t0 + lane) * pc.out_features + n, partial[lane * WG + r * LANES] + bias_of(n));
    }
}
