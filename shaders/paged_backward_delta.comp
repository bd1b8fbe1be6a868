#version 450
// Paged-attention backward, its first dispatch: D = rowsum(dout * out) of every query row, float32 in lse's order
// (PAGED_BACKWARD_DELTA in pagedvk/abi.py), which paged_backward_dq and paged_backward_dkdv (scalar and matrix) then
// read in place of `out`: FlashAttention-2's _bwd_preprocess. Summed once per row here, not once per workgroup
// that needs the row (every 16-key dk/dv workgroup needed every row's).
//
// A row is head_size consecutive elements of dout and out in both query forms (PREFILL_INPUTS), so row r starts at
// element r * head_size and is row r of lse and delta. Each thread sums four consecutive rows exactly as the
// scalar dq sums dP (paged_backward_dq.comp): head quad by head quad, as component i of (out quad of row i) times
// (the rows' dout quads as columns). Where a query sees a single key, out == v and P == 1, so dP - D must be
// exactly 0 there, as in float64 (tests/ops/test_backward.py: test_query_seeing_one_key_has_zero_dq); a sum in another
// order would leave rounding noise that would then be all of that row's dq.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer QueryStartLoc { int query_start_loc[]; }; // [seqs + 1]
layout(std430, set = 0, binding = 1) readonly buffer Dout { Q_IN dout[]; };            // like query
layout(std430, set = 0, binding = 2) readonly buffer Out { Q_IN out_[]; };             // like query
layout(std430, set = 0, binding = 3) writeonly buffer Delta { float delta_[]; };         // like lse

#ifndef KV_CHUNK_QUADS
#define KV_CHUNK_QUADS 1u   // no cache here: attention_common.glsl's key addressing goes unused
#endif
#include "attention_common.glsl"
#include "prefill_common.glsl"

const uint ROWS_PER_THREAD = 4u;   // abi.DELTA_ROWS_PER_THREAD
const uint NO_ROW = 0xffffffffu;

void main() {
    const uint hs = head_size();   // a constant where the plan specialized it (prefill_common.glsl)
    const uint hq = hs / 4u;
    if (hs > MAX_HEAD_SIZE || hq == 0u || hs != pc.head_size || pc.num_heads == 0u) return;
    // The batch's rows (num_tokens * num_heads), bounded by dout's and out's whole rows and by delta.
    const uint max_rows = min(Q_QUADS(dout), Q_QUADS(out_)) / hq;
    const uint tokens = pc.num_seqs < uint(query_start_loc.length()) ? uint(max(query_start_loc[pc.num_seqs], 0)) : 0u;
    const uint rows = min(min(tokens, max_rows / pc.num_heads) * pc.num_heads, uint(delta_.length()));
    const uint r0 = (workgroup_index() * WG + gl_LocalInvocationID.x) * ROWS_PER_THREAD;
    if (r0 >= rows) return;

    uvec4 qb;   // each row's quad 0 in dout and out, or NO_ROW
    for (uint i = 0u; i < 4u; i++) qb[i] = r0 + i < rows ? (r0 + i) * hq : NO_ROW;
    vec4 delta = vec4(0.0);
    for (uint c = 0u; c < hq; c++) {
        mat4 g;
        vec4 o[4];
        for (uint i = 0u; i < 4u; i++) {
            g[i] = qb[i] != NO_ROW ? Q_QUAD_AT(dout, qb[i] + c) : vec4(0.0);
            o[i] = qb[i] != NO_ROW ? Q_QUAD_AT(out_, qb[i] + c) : vec4(0.0);
        }
        delta += vec4((o[0] * g).x, (o[1] * g).y, (o[2] * g).z, (o[3] * g).w);
    }
    for (uint i = 0u; i < 4u; i++) {
        if (qb[i] != NO_ROW) delta_[r0 + i] = delta[i];
    }
}
