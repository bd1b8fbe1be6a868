// Workgroup wg's work from the tile table (PREFILL_INPUTS in pagedvk/abi.py), kv heads fastest: (kv head,
// sequence, first row, 1), or w == 0 past the table or for an entry naming no sequence (prefill_common.glsl's
// tile_work). Pasted by the kernels that bind `tiles`.
fn tile_work(wg: u32) -> vec4<u32> {
    let kv_head = wg % pc.num_kv_heads;
    let tile = wg / pc.num_kv_heads;
    if (tile >= arrayLength(&tiles) / 2u) {
        return vec4<u32>(0u);
    }
    let seq = u32(max(tiles[2u * tile], 0));
    let row0 = u32(max(tiles[2u * tile + 1u], 0));
    return vec4<u32>(kv_head, seq, row0, select(0u, 1u, seq < pc.num_seqs));
}

// Rows per tile of paged_prefill and paged_backward_dq (prefill_common.glsl's tile_rows()).
fn tile_rows(rows: u32, hs: u32) -> u32 {
    let most = select(32u, 64u, hs <= 128u);
    var r = 8u;
    while (r < rows && r < most) {
        r *= 2u;
    }
    return r;
}
