// paged_decode.wgsl's workgroup reduction with subgroup arithmetic (naga's subgroupMax / subgroupAdd and the
// subgroup_id / num_subgroups built-ins, which main() copies into sg_id / sg_count): each subgroup reduces its
// own values, then every thread combines the subgroups' results, as paged_decode.comp's workgroup_reduce. One
// barrier. Subgroups of at least 4 invocations (pagedvk/decode.py runs decode_reduce_shared.wgsl's modules
// otherwise).

const MAX_SUBGROUPS: u32 = WG / 4u;
var<workgroup> s_red: array<vec4<f32>, 64>;    // 2 * MAX_SUBGROUPS: each subgroup's (a, b)

// Max (is_max) or sum of (*a, *b) over the workgroup.
fn workgroup_reduce(a: ptr<function, vec4<f32>>, b: ptr<function, vec4<f32>>, is_max: bool, tid: u32) {
    var va: vec4<f32>;
    var vb: vec4<f32>;
    if (is_max) {
        va = subgroupMax(*a);
        vb = subgroupMax(*b);
    } else {
        va = subgroupAdd(*a);
        vb = subgroupAdd(*b);
    }
    if (sg_lane == 0u) {
        s_red[2u * sg_id] = va;
        s_red[2u * sg_id + 1u] = vb;
    }
    workgroupBarrier();
    var ra = s_red[0];
    var rb = s_red[1];
    for (var i = 1u; i < sg_count; i++) {
        ra = select(ra + s_red[2u * i], max(ra, s_red[2u * i]), is_max);
        rb = select(rb + s_red[2u * i + 1u], max(rb, s_red[2u * i + 1u]), is_max);
    }
    *a = ra;
    *b = rb;
}
