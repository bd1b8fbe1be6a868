// What every attention kernel shares (ATTENTION_PUSH in pagedvk/abi.py): the push-constant block, the
// cache addressing, the causal limit, workgroup numbering. Included after each kernel's buffers.
//
// The caches are addressed through strides (pagedvk/layouts.py computes them), so one module reads both
// cache layouts:
//   key quad c (head dims 4c .. 4c+3) of token t of block b, kv head h, in quads (4 elements):
//       b*k_block_stride + h*k_head_stride + t*k_token_stride + (c / KV_CHUNK_QUADS)*k_chunk_stride
//       + c % KV_CHUNK_QUADS
//   value element (b, h, t, d): b*v_block_stride + h*v_head_stride + t*v_token_stride + d*v_dim_stride
// Four consecutive head dims of one key token are contiguous in both layouts (vLLM's x packing, or nhd's
// whole head). Values are contiguous along tokens in vLLM's layout (v_token_stride 1) and along head dims
// in nhd (v_dim_stride 1); value quads are read along whichever is contiguous.
//
// Block ids at or past num_blocks are never read (nor, in the backward, written). The launcher sets
// num_blocks from the bound buffers' real size; the caches' length() is not used because NVIDIA's driver
// (580) returns a wrong one for bindings of 2 GiB and more.
#ifndef ATTENTION_COMMON_GLSL
#define ATTENTION_COMMON_GLSL

layout(push_constant) uniform Params {
    uint num_heads;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint max_blocks_per_seq;
    uint num_blocks;
    uint num_seqs;
    uint q_token_stride;
    uint q_head_stride;
    uint causal;
    float scale;
    float v_scale;
    uint group_size;
    uint partition_size;
    uint num_partitions;
    uint k_block_stride;
    uint k_head_stride;
    uint k_token_stride;
    uint k_chunk_stride;
    uint v_block_stride;
    uint v_head_stride;
    uint v_token_stride;
    uint v_dim_stride;
    uint blocks_per_segment;
    float softcap;
    uint window;
    uint variants;
    uint q_type;       // query, out and dout storage (kv_storage.glsl): 0 float32, 1 float16, 2 bfloat16
    uint q_pitch;      // elements from one token's query row to the next (num_heads * head_size: contiguous)
    uint out_pitch;    // the same for out
} pc;

const uint WG = 128u;              // == local_size_x
const uint MAX_HEAD_SIZE = 256u;   // two head dims per thread where threads own dims
const uint MIN_BLOCK_SIZE = 1u;    // block sizes are powers of two from 1 to 32 (pagedvk.layouts)
#define NEG_INF uintBitsToFloat(0xff800000u)

// The workgroup's number in a grid folded to the device's limits (pagedvk.runtime.commands.fold_grid):
// workgroups past the launch's count return at once.
uint workgroup_index() {
    return gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z);
}

// -- Attention variants (pagedvk/abi.py's VARIANT_* flags, softcap, window). The hooks that read the variants'
// buffers (logit(), logits4(), sink_logit()) are in attention_variants.glsl; these read only the push constants.
const uint VARIANT_ALIBI = 1u;
const uint VARIANT_SINKS = 2u;
const uint VARIANT_LSE = 4u;

// False in the pipeline a launch without variants uses (pagedvk/kernels.py, VARIANTS_SPEC_ID in abi.py): the
// driver then drops every variant's code, where the push-constant tests alone cost the decode kernel 2-4% on
// the H200. WGSL modules have no specialization constants (naga emits none) and keep the tests.
layout(constant_id = 0) const bool VARIANTS = true;

// Whether the launch's VARIANT_* flags include `flag`.
bool variant_on(uint flag) { return VARIANTS && (pc.variants & flag) != 0u; }

// Whether the query at sequence position query_pos sees the key at key_pos (positions count from 0): causal
// masking (prefill's causal flag; decode's one query is its sequence's last position), and the sliding
// window, which keeps the keys less than `window` positions before the query (FlashInfer's window_left + 1).
bool key_visible(uint key_pos, uint query_pos) {
    return (pc.causal == 0u || key_pos <= query_pos) && (!VARIANTS || pc.window == 0u || key_pos + pc.window > query_pos);
}

// The first key the window lets a query at query_pos see (0 without a window). Tile loops start at its block,
// so blocks wholly before the window are never read.
uint window_first_key(uint query_pos) {
    return !VARIANTS || pc.window == 0u || query_pos < pc.window ? 0u : query_pos + 1u - pc.window;
}

// The end of an online softmax whose visible logits have max m and sum l of exp(logit - m), with a sink
// logit (NEG_INF for none) joining the denominator: (the factor that turns the accumulated exp(logit - m)
// weighted values into the output, the log-sum-exp). No visible key and no sink: (0, -inf).
vec2 softmax_finish(float m, float l, float sink) {
    if (isnan(l)) return vec2(l);   // a NaN logit among the keys: NaN output and lse, as float64 gives
    const float top = max(l > 0.0 ? m : NEG_INF, sink);
    if (top == NEG_INF) return vec2(0.0, NEG_INF);
    const float kept = l > 0.0 ? l * exp(m - top) : 0.0;
    const float denom = kept + (sink == NEG_INF ? 0.0 : exp(sink - top));
    return vec2(l > 0.0 ? exp(m - top) / denom : 0.0, top + log(denom));
}

// The sequence position of query i of a sequence with q_len queries: they are its last q_len tokens.
uint query_position(uint i, uint q_len, uint seq_len) { return uint(max(int(seq_len) - int(q_len) + int(i), 0)); }

// Keys a query row sees. The q_len queries are the last q_len positions of the sequence, so with causal
// masking query i sees keys 0 .. seq_len - q_len + i (not 0 .. i: that only holds when seq_len == q_len).
uint visible_keys(uint i, uint q_len, uint seq_len) {
    if (pc.causal == 0u) return seq_len;
    return uint(clamp(int(seq_len) - int(q_len) + int(i) + 1, 0, int(seq_len)));
}

// Where row gr of a sequence's query rows starts in query, out, dout and dq, in elements (lse: divided by
// head_size); q_start is the sequence's first query token (PREFILL_INPUTS in pagedvk/abi.py). A sequence's
// rows are the (query, head) pairs of the heads sharing one kv head (GQA), query-major, so every key and
// value a workgroup reads serves all of its rows.
uint row_base(uint q_start, uint kv_head, uint gr) {
    uint group = pc.num_heads / pc.num_kv_heads;
    return (q_start * pc.num_heads + (gr / group) * pc.q_token_stride
            + (kv_head * group + gr % group) * pc.q_head_stride) * pc.head_size;
}

// query_token(t) / out_token(t): where token t's row of query / out starts, in elements. Token rows lie q_pitch /
// out_pitch elements apart (num_heads * head_size when contiguous; more in a strided view, such as a fused QKV
// projection's query columns), each row contiguous. One multiply, as the contiguous address had.
uint query_token(uint t) { return t * pc.q_pitch; }
uint out_token(uint t) { return t * pc.out_pitch; }

// row_base(...) (an element of the contiguous [tokens, num_heads, head_size] order) in an array whose token rows lie
// `pitch` elements apart: the identity where pitch is num_heads * head_size (the fixed-q_len form is only ever
// contiguous). Once per row, outside the loops over keys.
uint pitched(uint base, uint pitch) {
    const uint row = pc.num_heads * pc.head_size;
    return (base / row) * pitch + base % row;
}

// Tokens whose rows a query-typed binding of `elems` elements holds at `pitch` (the last row need not be followed by
// a pitch's gap).
uint tokens_held(uint elems, uint pitch) {
    const uint row = pc.num_heads * pc.head_size;
    return elems < row || pitch == 0u ? 0u : (elems - row) / pitch + 1u;
}

// The bound on row_base() + head_size those tokens give: a row_base() under it is a row pitched() finds in the binding.
uint rows_held(uint elems, uint pitch) { return tokens_held(elems, pitch) * pc.num_heads * pc.head_size; }

// Quad c of key token t, kv head h, from the start of its block (see above).
uint key_offset(uint h, uint t, uint c) {
    return h * pc.k_head_stride + t * pc.k_token_stride + (c / KV_CHUNK_QUADS) * pc.k_chunk_stride + c % KV_CHUNK_QUADS;
}

// Value element (h, t, d) from the start of its block.
uint value_offset(uint h, uint t, uint d) {
    return h * pc.v_head_stride + t * pc.v_token_stride + d * pc.v_dim_stride;
}

// key_load(b, i) / value_load(b, i): element i (a quad, or a 16-byte chunk where the module defines KV_CHUNKS:
// KV_ELEM in kv_storage.glsl) of block b of each cache. A cache larger than one binding is split into segments
// of blocks_per_segment whole blocks (pagedvk.array.DeviceArray), reached through KV_SEGMENTS bindings
// (KV_SEGMENTED) or through buffer device addresses held in the cache's binding (KV_ADDRESSED); otherwise the
// cache is one binding. Only these two functions know which.
uint key_block_elems() { return pc.k_block_stride / KV_ELEM_QUADS; }
uint value_block_elems() { return pc.v_block_stride / (4u * KV_ELEM_QUADS); }
#if defined(KV_ADDRESSED)
layout(buffer_reference, std430, buffer_reference_align = KV_ELEM_ALIGN) readonly buffer KvSegment { KV_ELEM elems[]; };
KV_ELEM key_load(uint b, uint i) {
    const uint s = b / pc.blocks_per_segment;
    return KvSegment(key_cache[s]).elems[(b - s * pc.blocks_per_segment) * key_block_elems() + i];
}
KV_ELEM value_load(uint b, uint i) {
    const uint s = b / pc.blocks_per_segment;
    return KvSegment(value_cache[s]).elems[(b - s * pc.blocks_per_segment) * value_block_elems() + i];
}
#elif defined(KV_SEGMENTED)
KV_ELEM key_load(uint b, uint i) {
    const uint s = b / pc.blocks_per_segment;
    const uint j = (b - s * pc.blocks_per_segment) * key_block_elems() + i;
    switch (s) {
        case 0u: return key_cache[j];
        case 1u: return key_cache_1[j];
        case 2u: return key_cache_2[j];
        default: return key_cache_3[j];
    }
}
KV_ELEM value_load(uint b, uint i) {
    const uint s = b / pc.blocks_per_segment;
    const uint j = (b - s * pc.blocks_per_segment) * value_block_elems() + i;
    switch (s) {
        case 0u: return value_cache[j];
        case 1u: return value_cache_1[j];
        case 2u: return value_cache_2[j];
        default: return value_cache_3[j];
    }
}
#elif defined(KV_QUAD)
KV_ELEM key_load(uint b, uint i) { return key_cache[b * key_block_elems() + i]; }
KV_ELEM value_load(uint b, uint i) { return value_cache[b * value_block_elems() + i]; }
#endif

// One key element and one value element (at value_offset v of block b), converted.
#define KEY_AT(b, h, t, d) kv_quad(key_load(b, key_offset(h, t, (d) >> 2)))[(d) & 3u]
#define VALUE_AT(b, v) kv_quad(value_load(b, (v) >> 2))[(v) & 3u]

#if (defined(KV_ADDRESSED) || defined(KV_SEGMENTED) || defined(KV_QUAD)) && !defined(KV_CHUNKS)
// Value quad c (head dims 4c .. 4c+3) of token t, kv head h, block b: one load where head dims are contiguous
// (nhd), four along vLLM's token-contiguous values.
vec4 value_quad(uint b, uint h, uint t, uint c) {
    const uint vi = value_offset(h, t, 4u * c), vs = pc.v_dim_stride;
    if (vs == 1u) return kv_quad(value_load(b, vi >> 2));
    return vec4(VALUE_AT(b, vi), VALUE_AT(b, vi + vs), VALUE_AT(b, vi + 2u * vs), VALUE_AT(b, vi + 3u * vs));
}
#endif

#endif
