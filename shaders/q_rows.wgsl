// The backward kernels' query-typed rows (paged_backward_dq, paged_backward_dkdv), in the type the push constants
// name (q_any.wgsl's layout). WGSL passes no storage array to a function, so this names the includer's `query` and
// `dout` bindings.

// Query (phase 0) or dout (phase 1) quad i (q_any.wgsl).
fn row_quad(phase: u32, i: u32) -> vec4<f32> {
    let n = q_quad_words();
    let w = n * i;
    var x = vec4<u32>(0u);
    if (phase == 0u) {
        x.x = query[w];
        x.y = query[w + 1u];
        if (n == 4u) {
            x.z = query[w + 2u];
            x.w = query[w + 3u];
        }
    } else {
        x.x = dout[w];
        x.y = dout[w + 1u];
        if (n == 4u) {
            x.z = dout[w + 2u];
            x.w = dout[w + 3u];
        }
    }
    return q_quad_of(x);
}
