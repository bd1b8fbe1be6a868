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

#ifdef TILE_BLOCK_IDS
// The physical blocks of a tile of keys (paged_prefill.comp, paged_backward_dq.comp: 256 keys at most, from a block
// boundary). Blocks of STAGED_BLOCK_SIZE tokens and more have a tile's ids staged in shared memory once (32 at
// most); smaller blocks (up to 256 a tile) have each id read from the table where it is used: 256 staged ids would
// take the kernels' shared memory past the 16 KiB every Vulkan device offers.
const uint STAGED_BLOCK_SIZE = 8u;
shared int s_phys[256u / STAGED_BLOCK_SIZE];   // the tile's physical block ids, -1 where out of range

// Entry i of block_tables, -1 where it names no block of the caches.
int table_block(uint i) {
    const int b = block_tables[i];
    return (b >= 0 && uint(b) < pc.num_blocks) ? b : -1;
}

// Stage the ids of the tile of tile_len keys from key `base` of the sequence whose table row starts at bt_row.
// The caller's barrier follows.
void stage_tile_blocks(uint bt_row, uint base, uint tile_len) {
    const uint bs = pc.block_size, tid = gl_LocalInvocationID.x;
    if (bs >= STAGED_BLOCK_SIZE && tid < (tile_len + bs - 1u) / bs) s_phys[tid] = table_block(bt_row + base / bs + tid);
}

// The physical block of key k of that tile (k < tile_len; -1 outside the caches).
int tile_block(uint bt_row, uint base, uint k) {
    const uint bs_log2 = findMSB(pc.block_size);
    return pc.block_size >= STAGED_BLOCK_SIZE ? s_phys[k >> bs_log2] : table_block(bt_row + ((base + k) >> bs_log2));
}
#endif

#endif
