// The output of the kernels that write a query-typed `out` (paged_decode, paged_decode_reduce, paged_prefill,
// merge_states): its whole pairs, and pair p stored, in the type the push constants name (q_any.wgsl's layout). WGSL
// passes no storage array to a function, so these name the includer's `out` binding.

fn out_pairs() -> u32 {
    return q_pairs(arrayLength(&out));
}

// Output pair p := v.
fn out_store(p: u32, v: vec2<f32>) {
    let n = q_pair_words();
    let x = q_pair_of(v);
    out[n * p] = x.x;
    if (n == 2u) {
        out[n * p + 1u] = x.y;
    }
}
