// What the prefill kernels share beyond attention_common.wgsl: the ragged batch (PREFILL_INPUTS in
// pagedvk/abi.py; prefill_common.glsl explains). Pasted after attention_common.wgsl by kernels that bind
// query_start_loc.

// Sequence seq's queries: (its first token, q_len), offsets clamped to [0, max_tokens].
fn sequence_queries(seq: u32, max_tokens: u32) -> vec2<u32> {
    if (seq + 1u >= arrayLength(&query_start_loc)) {
        return vec2<u32>(0u);
    }
    let start = u32(clamp(query_start_loc[seq], 0, i32(max_tokens)));
    let end = u32(clamp(query_start_loc[seq + 1u], i32(start), i32(max_tokens)));
    return vec2<u32>(start, end - start);
}
