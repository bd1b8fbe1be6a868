// What the cooperative-matrix prefill kernels share (paged_prefill_coopmat.comp, paged_backward_dq_coopmat.comp,
// paged_backward_dkdv_coopmat.comp): float16 matrices of 16 x 16, float16 caches read as 16-byte chunks (8
// elements), and the query rows of a ragged batch. Included after attention_common.glsl and
// prefill_common.glsl, by a module that defines, before including it:
//   D    the head size (HEAD_SIZE), DC = D / 8 chunks to a key row, DQ = D / 4 quads;
//   BC   the keys a workgroup stages at a time (a multiple of 16: a matrix's columns);
//   KS   the row stride, in quads, of keys, queries and [key][dim] values staged as f16vec4 (padded against bank
//        conflicts; a multiple of 16 bytes, as matrix loads need);
//   TS   the row stride, in quads, of values staged [dim][key] (vLLM's layout, tokens contiguous);
// and MATRIX_WALKS_TABLES where it walks a sequence's context through block_tables (the forward and dq).
#ifndef PREFILL_MATRIX_GLSL
#define PREFILL_MATRIX_GLSL

#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define MAT_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

f16vec4 half4(uvec2 w) { return f16vec4(unpackFloat2x16(w.x), unpackFloat2x16(w.y)); }

// The sequence's queries and context a workgroup works on.
struct Seq { uint start; uint q_len; uint len; };

// What one query row gr of the sequence is: where it starts in the row buffers (query, out, dout, dq: elements;
// lse: / D), its head, its sequence position, and the keys it sees (0 for rows past row_end or past the
// row_floats elements every row buffer holds). The one place a row number becomes a (token, head, position).
struct Row { uint base; uint head; uint pos; uint keys; bool valid; };
Row query_row(Seq q, uint kv_head, uint gr, uint row_end, uint row_floats) {
    const uint group = pc.num_heads / pc.num_kv_heads;
    Row r;
    r.base = row_base(q.start, kv_head, gr);
    r.head = kv_head * group + gr % group;
    r.pos = query_position(gr / group, q.q_len, q.len);
    r.valid = gr < row_end && r.base + D <= row_floats;
    r.keys = r.valid ? visible_keys(gr / group, q.q_len, q.len) : 0u;
    return r;
}

// Chunk dc (head dims 8 dc .. 8 dc + 7) of the key in slot `slot` of physical block b; zeros where b < 0.
uvec4 key_chunk_at(int b, uint kv_head, uint slot, uint dc) {
    return b >= 0 ? key_load(uint(b), key_offset(kv_head, slot, 2u * dc) >> 1) : uvec4(0u);
}

// 8 values of physical block b (zeros where b < 0 or live == 0): by_dim (nhd) head dims d .. d + 7 of slot
// `slot`; else (vLLM) head dim d of slots slot .. slot + 7, of which only the first `live` are kept (the
// rest are past the context and may hold NaN, and 0 * NaN is NaN).
uvec4 value_chunk_at(int b, uint kv_head, uint slot, uint d, bool by_dim, uint live) {
    uvec4 w = b >= 0 && live > 0u ? value_load(uint(b), value_offset(kv_head, slot, d) >> 3) : uvec4(0u);
    if (!by_dim) {
        [[unroll]] for (uint j = 0u; j < 4u; j++) {   // word j holds slots slot + 2j, slot + 2j + 1
            w[j] &= (2u * j < live ? 0xffffu : 0u) | (2u * j + 1u < live ? 0xffff0000u : 0u);
        }
    }
    return w;
}

// Where chunk i of BC tokens' keys or values goes in shared memory: keys and nhd values [key][dim] (row stride
// KS: token i / DC, head dims 8 (i % DC) on); vLLM values [dim][key] (row stride TS: head dim i / (BC / 8),
// tokens 8 (i % (BC / 8)) on).
uint chunk_slot(uint i, bool by_dim) {
    return by_dim ? (i / DC) * KS + 2u * (i % DC) : (i / (BC / 8u)) * TS + 2u * (i % (BC / 8u));
}

#ifdef MATRIX_WALKS_TABLES
// Block sizes are powers of two (8, 16, 32: pagedvk.layouts.BLOCK_SIZES): tokens split into (block, slot)
// by shifts, not by the integer divisions the staging would otherwise do for every chunk.
uint block_shift() { return uint(findLSB(pc.block_size)); }

// The physical block of a token of the sequence, -1 past kv_end or outside the caches.
int token_block(uint bt_row, uint token, uint kv_end) {
    if (token >= kv_end) return -1;
    int b = block_tables[bt_row + (token >> block_shift())];
    return (b >= 0 && uint(b) < pc.num_blocks) ? b : -1;
}

// A window of a sequence's block ids, one per lane: lane l holds the physical block of the sequence's block
// w0 + l (token_block's -1 where there is none). A step's chunks find their blocks in it by a shuffle, where each
// chunk reading block_tables itself put a dependent load and its address arithmetic before every chunk (the
// forward on the H200: 1514 -> 1447 us). Called by every lane of a subgroup (the loops that stage keys and values
// are uniform in the workgroup); a window spans 32 blocks (the matrix kernels run with 32-lane subgroups only), at
// least 256 tokens.
int block_window(uint bt_row, uint w0, uint kv_end) {
    return token_block(bt_row, (w0 + gl_SubgroupInvocationID) << block_shift(), kv_end);
}

// The physical block of token t (in the window from block w0; -1 past kv_end).
int window_block(int win, uint w0, uint t, uint kv_end) {
    const int b = subgroupShuffle(win, (t >> block_shift()) - w0);
    return t < kv_end ? b : -1;
}

// Chunk i (< BC * DC) of a step's keys from `base` on (token i / DC), their blocks in the window (win, w0);
// zeros for tokens that are not there.
uvec4 key_chunk(int win, uint w0, uint kv_head, uint base, uint i, uint kv_end) {
    const uint t = base + i / DC;
    return key_chunk_at(window_block(win, w0, t, kv_end), kv_head, t & (pc.block_size - 1u), i % DC);
}

// Chunk i of a step's values, as chunk_slot() places it; tokens at or past kv_end are zeros.
uvec4 value_chunk(int win, uint w0, uint kv_head, uint base, uint i, uint kv_end, bool by_dim) {
    const uint t = base + (by_dim ? i / DC : 8u * (i % (BC / 8u)));
    const uint d = by_dim ? 8u * (i % DC) : i / (BC / 8u);
    return value_chunk_at(window_block(win, w0, t, kv_end), kv_head, t & (pc.block_size - 1u), d, by_dim,
                          kv_end > t ? kv_end - t : 0u);
}
#endif

#endif
