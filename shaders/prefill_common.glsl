// What the prefill kernels share beyond attention_common.glsl: the ragged batch (PREFILL_INPUTS in
// pagedvk/abi.py). Included after attention_common.glsl by kernels that bind query_start_loc (and tiles).
#ifndef PREFILL_COMMON_GLSL
#define PREFILL_COMMON_GLSL

// Sequence seq's queries: (its first token, q_len). Offsets are clamped to [0, max_tokens] and a decreasing
// pair gives no queries, so unchecked offsets never address a row past the query buffers.
uvec2 sequence_queries(uint seq, uint max_tokens) {
    if (seq + 1u >= uint(query_start_loc.length())) return uvec2(0u);
    const uint start = uint(clamp(query_start_loc[seq], 0, int(max_tokens)));
    const uint end = uint(clamp(query_start_loc[seq + 1u], int(start), int(max_tokens)));
    return uvec2(start, end - start);
}

#ifndef HEAD_SIZE
// The head size, specialized per plan (abi.PREFILL_HEAD_SIZE_SPEC_ID, pagedvk/prefill.py), so the driver compiles
// loops and branches on it as constants; 0 (a pipeline made without it) reads the push constant. The matrix
// modules fix HEAD_SIZE at build time instead. Callers return early where the two differ, so a pipeline
// specialized for another head size writes nothing.
layout(constant_id = 3) const uint HEAD_SIZE_SPEC = 0u;
uint head_size() {
    return HEAD_SIZE_SPEC != 0u ? HEAD_SIZE_SPEC : pc.head_size;
}
#endif

#ifdef PREFILL_TILES
// Workgroup wg's work, kv heads fastest: (kv head, sequence, first row) from its tile's entry; false past the
// table or for an entry naming no sequence.
bool tile_work(uint wg, out uint kv_head, out uint seq, out uint row0) {
    kv_head = wg % pc.num_kv_heads;
    const uint tile = wg / pc.num_kv_heads;
    if (tile >= uint(tiles.length()) / 2u) return false;
    seq = uint(max(tiles[2u * tile], 0));
    row0 = uint(max(tiles[2u * tile + 1u], 0));
    return seq < pc.num_seqs;
}

// Rows per tile of paged_prefill and paged_backward_dq for a sequence of `rows` rows: 8, 16, 32 or 64, at most
// 32 above head size 128. The tile table is built with the same rule (pagedvk.prefill.forward_rows).
uint tile_rows(uint rows, uint hs) {
    const uint most = hs <= 128u ? 64u : 32u;
    uint r = 8u;
    while (r < rows && r < most) r *= 2u;
    return r;
}
#endif

#endif
