// The decode kernels' last step (shaders/paged_decode.wgsl, paged_decode_coopmat.wgsl), for output dims d0 and
// d0 + 1 of one head, its workgroup's sums in o_sum, its running max m and sum l: an unsplit launch normalizes them
// (the sink joins the denominator here, once: a split's reduce adds it), writes out and, with VARIANT_LSE, lse; a
// split writes the partition's normalized outputs and (max, sum) for the reduce. Every index is checked against its
// buffer. Needs the kernels' bindings lse, partial_out, partial_stats, their push constants and their out_pairs() and
// out_store(): out's whole pairs of elements, and pair p stored (paged_decode.wgsl's in the type pc.q_type names,
// paged_decode_coopmat.wgsl's in the type it is built for).
fn write_output_pair(seq: u32, head: u32, part: u32, d0: u32, hs: u32, o_sum: vec2<f32>, m: f32, l: f32) {
    if (pc.num_partitions == 1u) {
        let fin = softmax_finish(m, l, sink_logit(head));
        let pair = (out_token(seq) + head * hs + d0) >> 1u;
        if (pair < out_pairs()) {
            out_store(pair, o_sum * fin.x * pc.v_scale);
        }
        let lse_row = seq * pc.num_heads + head;
        if (d0 == 0u && (pc.variants & VARIANT_LSE) != 0u && lse_row < arrayLength(&lse)) {
            lse[lse_row] = fin.y;
        }
        return;
    }
    let slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
    if (slot >= arrayLength(&partial_stats) || (slot + 1u) * hs > 2u * arrayLength(&partial_out)) {
        return;
    }
    partial_out[(slot * hs + d0) >> 1u] = o_sum * select(1.0 / l, 0.0, l == 0.0);
    if (d0 == 0u) {
        partial_stats[slot] = vec2<f32>(m, l);
    }
}
