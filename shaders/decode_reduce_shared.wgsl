// paged_decode.wgsl's workgroup reduction through shared memory only, for devices without subgroup arithmetic
// (abi.VariantKey.reduce "shared"; decode_reduce_subgroup.wgsl otherwise). Two barriers.
// Max (is_max) or sum of (*a, *b) over the workgroup, as paged_decode.comp's workgroup_reduce with SHARED_REDUCE.
const REDUCE_ROUND: u32 = 8u * WG;   // where in s_o the 16 x 2 partial results go
fn workgroup_reduce(a: ptr<function, vec4<f32>>, b: ptr<function, vec4<f32>>, is_max: bool, tid: u32) {
    let va = *a;
    let vb = *b;
    s_o[8u * tid] = va.x;
    s_o[8u * tid + 1u] = va.y;
    s_o[8u * tid + 2u] = va.z;
    s_o[8u * tid + 3u] = va.w;
    s_o[8u * tid + 4u] = vb.x;
    s_o[8u * tid + 5u] = vb.y;
    s_o[8u * tid + 6u] = vb.z;
    s_o[8u * tid + 7u] = vb.w;
    workgroupBarrier();
    if (tid < 32u) {   // thread tid reduces one half (heads 0-3 or 4-7) of eight threads' values
        let h = tid & 1u;
        let first = (tid >> 1u) * 8u;
        var r = vec4<f32>(0.0);
        for (var i = 0u; i < 8u; i++) {
            let o = 8u * (first + i) + 4u * h;
            let x = vec4<f32>(s_o[o], s_o[o + 1u], s_o[o + 2u], s_o[o + 3u]);
            r = select(select(r + x, max(r, x), is_max), x, i == 0u);
        }
        s_o[REDUCE_ROUND + 4u * tid] = r.x;
        s_o[REDUCE_ROUND + 4u * tid + 1u] = r.y;
        s_o[REDUCE_ROUND + 4u * tid + 2u] = r.z;
        s_o[REDUCE_ROUND + 4u * tid + 3u] = r.w;
    }
    workgroupBarrier();
    var ra = vec4<f32>(0.0);
    var rb = vec4<f32>(0.0);
    for (var i = 0u; i < 16u; i++) {
        let o = REDUCE_ROUND + 8u * i;
        let x = vec4<f32>(s_o[o], s_o[o + 1u], s_o[o + 2u], s_o[o + 3u]);
        let y = vec4<f32>(s_o[o + 4u], s_o[o + 5u], s_o[o + 6u], s_o[o + 7u]);
        ra = select(select(ra + x, max(ra, x), is_max), x, i == 0u);
        rb = select(select(rb + y, max(rb, y), is_max), y, i == 0u);
    }
    *a = ra;
    *b = rb;
}
