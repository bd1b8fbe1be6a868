#version 450
// Paged-attention decode: one query token per sequence attends over that sequence's cached keys and
// values, found through its block-table row, in either cache layout and any storage type
// (kv_storage.glsl). Built to read the caches at memory bandwidth.
//
// One workgroup per (group of up to 8 query heads sharing one kv head, sequence, partition of the context):
//   * GQA: every key and value is read once for all the group's heads;
//   * split-K: when the grid would not fill the device, a context is cut into partitions that run in
//     parallel, and paged_decode_reduce.comp merges their partial results (with one partition the result is
//     written to `out` directly). The last partition takes every token from its start to the sequence's end,
//     so lengths that grew after the plan chose its partitions are still covered whole.
// A partition is walked in tiles of TILE tokens, one pass with an online softmax:
//   K. thread t takes token t of the tile: it loads the token's key as 16-byte chunks, K_BATCH at a time,
//      each batch issued before any of it is used, and dots it with the group's queries (read from shared
//      memory, where every thread of the workgroup reads the same address: a broadcast);
//   S. the workgroup takes each head's tile max (subgroup reductions, then across subgroups), rescales what
//      earlier tiles accumulated and turns logits into weights in shared memory; the next tile's block ids
//      are fetched meanwhile (s_phys holds two);
//   V. vLLM's layout keeps a head dim's tokens contiguous, so thread t owns head dim t (and t + 128): it
//      loads the tile's values of that dim as 16-byte chunks, V_BATCH at a time, and accumulates them
//      weighted for every head. In the nhd layout a token's head dims are contiguous, so threads own a quad
//      of head dims and a share of the tokens, and their sums meet in shared memory at the end.
// Two barriers a tile (three where the device lacks subgroup arithmetic: SHARED_REDUCE).
// The per-head state of up to 8 heads is two vec4s (heads 0-3, heads 4-7; the second is skipped when the
// group has at most 4 heads), so every product is a 4x4 matrix-vector product and the WGSL twin has the same
// shape. The softmax denominator is summed per thread and reduced once at the end; no epsilon is added, so a
// sequence of length 0 gives zeros and any other matches float64 to float32 rounding.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the cache, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifndef SHARED_REDUCE
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#define KV_CHUNKS   // the caches are read 16 bytes at a time (kv_storage.glsl)
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_IN query[]; };           // [seqs, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // see key_load()
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { Q_WORD out_[]; };         // [seqs, heads, head_size]
// Coherent: the last workgroup of a split merged here reads what the others wrote (decode_merge.glsl).
layout(std430, set = 0, binding = 6) coherent buffer PartialOut { vec2 partial_out[]; };  // [seqs, heads, partitions, head_size]
// [seqs, heads, partitions]: (max, sum) as float bits; then MERGE_IN_DECODE's counters, one a (sequence, head group) in .x
layout(std430, set = 0, binding = 7) coherent buffer PartialStats { uvec2 partial_stats[]; };
layout(std430, set = 0, binding = 8) readonly buffer AlibiSlopes { float alibi_slopes[]; }; // [heads] (VARIANT_ALIBI)
layout(std430, set = 0, binding = 9) readonly buffer Sinks { float sinks[]; };             // [heads] (VARIANT_SINKS)
layout(std430, set = 0, binding = 10) writeonly buffer Lse { float lse[]; };               // [seqs, heads] (VARIANT_LSE)

#include "attention_common.glsl"
#include "attention_variants.glsl"
#include "decode_common.glsl"

const uint MAX_GROUP = 8u;                      // query heads per workgroup: two vec4s
const uint TILE = WG;                           // tokens per tile: one key token per thread
const uint CQ = KV_CHUNK_QUADS;                 // quads per 16-byte chunk
const uint CHUNK_TOKENS = 4u * CQ;              // value tokens in one chunk of vLLM's layout
// Chunks a thread loads before it uses any: a 128-dim key whole, and half a tile's values (64 tokens), in float16
// and float32; fp8 keeps float16's counts. Measured on the H200 with the specialized pipelines (BENCHMARKS.md,
// "Decode with specialized pipelines"): for float16, 16 and 8 beat 8/8, 8/16, 16/16 and 4/8 at large batch (350
// against 360-399 us at 64 x 4096); loading a tile's values together with its keys was slower still. For float32,
// 32 and 16 took 556 us against 620 us at 64 x 4096 (88% of the read kernel against 79%; "Host time, fp8 e4m3 ...").
#if defined(KV_F32)
const uint K_BATCH = 32u;
const uint V_BATCH = 16u;
#else
const uint K_BATCH = 16u;
const uint V_BATCH = 8u;
#endif
// Values a thread loads with the keys, where a plan asks for it (VALUES_WITH_KEYS): a whole 128-token tile's of one
// head dim in float16 (16 chunks), half of it in float32.
const uint V_BATCH_WITH_KEYS = 16u;
// Blocks of a tile at most: 128 in 1-token blocks. Their ids take 1 KiB of s_phys where blocks of 8 tokens and
// more took 128 bytes; the kernel's shared memory stays under 32 KiB, and its occupancy is set by its registers.
const uint TILE_BLOCKS = TILE / MIN_BLOCK_SIZE;
const uint MAX_QUADS = MAX_HEAD_SIZE / 4u;
// Head dims a thread owns in vLLM's layout (dim tid, then tid + WG): one where the head size is fixed and at most
// WG. A loop to this constant unrolls, so acc_a/acc_b stay in registers; with a bound of 2 and a skipped second
// pass the H200's compiler kept them in local memory, and the kernel took 1.22x the time (630 against 516 us at
// 64 x 4096 float16; BENCHMARKS.md).
// The head size, specialized per plan (abi.DECODE_HEAD_SIZE_SPEC_ID, pagedvk/decode.py) so that the loops over
// head dims unroll to it; 0 reads the push constant. A pipeline specialized for another head size than the push
// constants' writes nothing.
layout(constant_id = 7) const uint HEAD_SIZE = 0u;
const uint SLOTS = HEAD_SIZE != 0u ? (HEAD_SIZE + WG - 1u) / WG : 2u;

// Specialized per plan (pagedvk/decode.py; abi.DECODE_VALUE_ORDER_SPEC_ID, abi.DECODE_GROUP_SPEC_ID), so the
// pipeline holds one layout's V stage and one width of head group: the H200's compiler gave the kernel with
// both 231 registers a thread, with one 155-167, and it ran 1.25x faster (BENCHMARKS.md). 0 reads the push
// constants, as a pipeline made without specialization must.
layout(constant_id = 1) const uint VALUE_ORDER = 0u;   // 1: vLLM's layout (a dim's tokens contiguous); 2: nhd
layout(constant_id = 2) const uint GROUP_LIMIT = 0u;   // 4 or 8: the most query heads a workgroup takes
// abi.DECODE_VALUES_SPEC_ID, set per plan (pagedvk/decode.py, values_with_keys): 1 issues a tile's first batch of
// values (vLLM's layout; V_BATCH_WITH_KEYS chunks a head dim) beside its keys, before the tile's max is known. Where
// a workgroup takes one tile, its cache loads are then one round trip, not three (keys, two batches of values): 1 x 4096
// float16 on the H200 16.5 against 17.2 us. fp8, whose tile of values is one batch already, lost (BENCHMARKS.md).
layout(constant_id = 6) const uint VALUES_WITH_KEYS = 0u;

shared vec4 s_q[MAX_QUADS * MAX_GROUP];         // queries * scale: [quad][head]
shared vec4 s_w[TILE / 4u * MAX_GROUP];         // logits, then weights: [token quad][head], 4 tokens a vec4
shared int s_phys[2u * TILE_BLOCKS];            // physical blocks of this tile and the next, -1 where invalid
shared float s_o[4u * MAX_HEAD_SIZE * MAX_GROUP / 2u]; // sums at the end: [lane][head][dim]; SHARED_REDUCE's scratch

#define DECODE_MERGE_IN_DISPATCH
#define MERGE_SCRATCH s_o   // s_o, done with when the split is merged
#include "decode_merge.glsl"

// Max (is_max) or sum of (a, b; b only where `wide`) over the workgroup. The callers' barriers separate one
// call's reads of the scratch from the next call's writes.
#ifndef SHARED_REDUCE
// Each subgroup reduces its own values (one instruction a step on the GPU), then every thread combines the
// subgroups' results: one barrier. Subgroups of at least 4 invocations (pagedvk/decode.py sends smaller ones to
// SHARED_REDUCE). s_red is its own array: reusing s_o's floats for it made the kernel 1.13x slower on the H200.
const uint MAX_SUBGROUPS = WG / 4u;
shared vec4 s_red[2u * MAX_SUBGROUPS];
void workgroup_reduce(inout vec4 a, inout vec4 b, bool is_max, bool wide) {
    if (is_max) {
        a = subgroupMax(a);
        if (wide) b = subgroupMax(b);
    } else {
        a = subgroupAdd(a);
        if (wide) b = subgroupAdd(b);
    }
    if (subgroupElect()) { s_red[2u * gl_SubgroupID] = a; s_red[2u * gl_SubgroupID + 1u] = b; }
    barrier();
    a = s_red[0]; b = s_red[1];
    for (uint i = 1u; i < gl_NumSubgroups; i++) {
        a = is_max ? max(a, s_red[2u * i]) : a + s_red[2u * i];
        if (wide) b = is_max ? max(b, s_red[2u * i + 1u]) : b + s_red[2u * i + 1u];
    }
}
#else
// Devices without subgroup arithmetic (abi.VariantKey.reduce "shared"): each thread's values into s_o (its
// sums come only at the end), 32 threads reduce eight threads' values each, then every thread reduces those
// 16 x 2. Two barriers.
const uint REDUCE_ROUND = 8u * WG;   // where in s_o the 16 x 2 partial results go
void workgroup_reduce(inout vec4 a, inout vec4 b, bool is_max, bool wide) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint j = 0u; j < 4u; j++) { s_o[8u * tid + j] = a[j]; s_o[8u * tid + 4u + j] = b[j]; }
    barrier();
    if (tid < 32u) {   // thread tid reduces one half (heads 0-3 or 4-7) of eight threads' values
        const uint h = tid & 1u, first = (tid >> 1) * 8u;
        vec4 r = vec4(0.0);
        for (uint i = 0u; i < 8u; i++) {
            const uint o = 8u * (first + i) + 4u * h;
            const vec4 x = vec4(s_o[o], s_o[o + 1u], s_o[o + 2u], s_o[o + 3u]);
            r = i == 0u ? x : is_max ? max(r, x) : r + x;
        }
        for (uint j = 0u; j < 4u; j++) s_o[REDUCE_ROUND + 4u * tid + j] = r[j];
    }
    barrier();
    for (uint i = 0u; i < 16u; i++) {
        const uint o = REDUCE_ROUND + 8u * i;
        const vec4 x = vec4(s_o[o], s_o[o + 1u], s_o[o + 2u], s_o[o + 3u]);
        const vec4 y = vec4(s_o[o + 4u], s_o[o + 5u], s_o[o + 6u], s_o[o + 7u]);
        a = i == 0u ? x : is_max ? max(a, x) : a + x;
        b = i == 0u ? y : is_max ? max(b, y) : b + y;
    }
}
#endif

// Blocks of the tile that starts at token `base` of a partition ending at `end` (0 past the end).
uint tile_blocks(uint base, uint end, uint bs_log2) {
    return base < end ? (min(TILE, end - base) + (1u << bs_log2) - 1u) >> bs_log2 : 0u;
}

// The group's queries times one key quad: columns are heads (0-3 or 4-7 by h), rows head dims.
mat4 queries(uint c, uint h) {
    const uint i = (c * MAX_GROUP) + 4u * h;
    return mat4(s_q[i], s_q[i + 1u], s_q[i + 2u], s_q[i + 3u]);
}

// The weights of tile tokens 4 tq .. 4 tq + 3 (rows) for heads 4h .. 4h + 3 (columns).
mat4 weights(uint tq, uint h) {
    const uint i = tq * MAX_GROUP + 4u * h;
    return mat4(s_w[i], s_w[i + 1u], s_w[i + 2u], s_w[i + 3u]);
}

// Chunk n of the current tile's values of the head dim whose tokens start at row_d (vLLM's layout: CHUNK_TOKENS
// tokens a chunk), zeros past the tile's vchunks chunks or in an invalid block.
uvec4 value_chunk(uint cur, uint row_d, uint n, uint vchunks, uint bs_log2) {
    const uint t0 = n * CHUNK_TOKENS;
    const int ph = n < vchunks ? s_phys[cur + (t0 >> bs_log2)] : -1;
    return ph >= 0 ? value_load(uint(ph), (row_d + (t0 & ((1u << bs_log2) - 1u))) / CHUNK_TOKENS) : uvec4(0u);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint hs = HEAD_SIZE != 0u ? HEAD_SIZE : pc.head_size;   // a constant where specialized: loops unroll
    const uint bs = pc.block_size;          // a power of two (1 to 32): divisions by it are shifts
    const uint bs_log2 = uint(findLSB(bs)), bs_mask = bs - 1u;
    const uint group = pc.group_size;
    const bool wide = GROUP_LIMIT == 0u ? group > 4u : GROUP_LIMIT > 4u;   // heads 4-7 in use
    const uint P = pc.partition_size;
    const uint head_groups = pc.num_heads / max(group, 1u);
    const uint wg = workgroup_index();
    const uint seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    const uint part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || P == 0u || hs > MAX_HEAD_SIZE || hs != pc.head_size || bs < MIN_BLOCK_SIZE
        || bs > TILE || part >= pc.num_partitions) return;
    // A pipeline specialized for other arguments than the push constants' writes nothing (the plan keeps them
    // equal: pagedvk/decode.py).
    if ((GROUP_LIMIT != 0u && group > GROUP_LIMIT) || (VALUE_ORDER != 0u && (pc.v_dim_stride == 1u) != (VALUE_ORDER == 2u)))
        return;
    const uint head0 = (wg % head_groups) * group;               // first query head of this workgroup
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint hq = hs / 4u;                                     // quads of one head
    const uint q_quad0 = (query_token(seq) >> 2) + head0 * hq;   // q_pitch: a multiple of 4
    if (q_quad0 + group * hq > Q_QUADS(query)) return;

    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    // The first tile's block ids are fetched beside the sequence's length, not after it: unless a sliding window
    // moves the partition's start, the start does not depend on the length (one round trip less before the first
    // keys; 1-2% at 8 x 4096 and 1 x 32768 on the H200).
    const uint early_block = ((part * P) >> bs_log2) + tid;
    const int early_phys = tid < TILE_BLOCKS && early_block < row_blocks ? physical_block(row + early_block) : -1;
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint last = seq_len - 1u;                               // the query's position
    // Variant: the partitions cover the sliding window only, from the block of its first key.
    const uint window0 = min(window_first_key(last), seq_len) & ~bs_mask;
    const uint start = window0 + part * P;                         // first token of the partition
    const uint end = part + 1u == pc.num_partitions ? seq_len : min(seq_len, start + P);

    for (uint i = tid; i < MAX_GROUP * hq; i += WG) {
        const uint g = i % MAX_GROUP, c = i / MAX_GROUP;
        s_q[i] = g < group ? Q_QUAD_AT(query, q_quad0 + g * hq + c) * pc.scale : vec4(0.0);
    }
    const uvec4 heads_a = head0 + uvec4(0u, 1u, 2u, 3u), heads_b = heads_a + 4u;
    const uvec4 in_a = uvec4(lessThan(uvec4(0u, 1u, 2u, 3u), uvec4(group)));
    const uvec4 in_b = uvec4(lessThan(uvec4(4u, 5u, 6u, 7u), uvec4(group)));

    // The V stage's share of the work. vLLM's layout: head dims tid and tid + WG. nhd: quad column `col` of
    // the head and every `lanes`-th token from `lane`.
    const bool dims_contiguous = VALUE_ORDER == 0u ? pc.v_dim_stride == 1u : VALUE_ORDER == 2u;
    const uint lanes = dims_contiguous ? WG / hq : 1u;
    const uint col = tid % hq, lane = tid / hq;

    vec4 m_a = vec4(NEG_INF), m_b = vec4(NEG_INF);   // running max per head
    vec4 l_a = vec4(0.0), l_b = vec4(0.0);           // this thread's share of the softmax sum
    vec4 acc_a[4], acc_b[4];                         // [dim slot] of heads 0-3 / 4-7
    for (uint i = 0u; i < 4u; i++) { acc_a[i] = vec4(0.0); acc_b[i] = vec4(0.0); }

    // Block ids are fetched a tile ahead into the other half of s_phys.
    uint next_blocks = tile_blocks(start, end, bs_log2);
    if (tid < next_blocks) s_phys[tid] = window0 == 0u ? early_phys : physical_block(row + (start >> bs_log2) + tid);
    barrier();
    uint tile = 0u;
    for (uint base = start; base < end; base += TILE, tile++) {
        const uint len = min(TILE, end - base);
        const uint cur = (tile & 1u) * TILE_BLOCKS, nxt = TILE_BLOCKS - cur;
        const uint nbase = base + TILE;
        next_blocks = tile_blocks(nbase, end, bs_log2);
        const int next_phys = tid < next_blocks ? physical_block(row + (nbase >> bs_log2) + tid) : -1;

        // Loads first: token tid's key, K_BATCH chunks at a time.
        const int phys = tid < len ? s_phys[cur + (tid >> bs_log2)] : -1;
        const uint t = tid & bs_mask;
        uvec4 w[K_BATCH + V_BATCH_WITH_KEYS];   // key chunks, then value chunks
        const uint kchunks = hq / CQ;             // whole chunks of a key (see below for part chunks)
        const bool key_chunks = hq % CQ == 0u;
        if (phys >= 0 && key_chunks) {
            for (uint k = 0u; k < K_BATCH; k++) {
                if (k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, k * CQ) / CQ);
            }
        }
        const uint vchunks = (len + CHUNK_TOKENS - 1u) / CHUNK_TOKENS;
        // The values' first batch beside the keys (head dim tid, its first slot), where the plan asks for it.
        const bool values_early = VALUES_WITH_KEYS != 0u && !dims_contiguous && bs % CHUNK_TOKENS == 0u;
        const uint v_batch = values_early ? V_BATCH_WITH_KEYS : V_BATCH;
        if (values_early && tid < hs) {
            const uint row_d = value_offset(kv_head, 0u, tid);
            for (uint k = 0u; k < V_BATCH_WITH_KEYS; k++) w[K_BATCH + k] = value_chunk(cur, row_d, k, vchunks, bs_log2);
        }

        // K: the logits of token tid of the tile. (Loops over register arrays run to their constant bound,
        // guarded: a `break` could keep the compiler from unrolling them and put the arrays in memory.)
        vec4 s_a = vec4(0.0), s_b = vec4(0.0);
        if (phys >= 0) {
            if (key_chunks) {
                for (uint c0 = 0u; c0 < kchunks; c0 += K_BATCH) {
                    if (c0 > 0u) {   // the next batch (the first was loaded above)
                        for (uint k = 0u; k < K_BATCH; k++) {
                            if (c0 + k < kchunks) w[k] = key_load(uint(phys), key_offset(kv_head, t, (c0 + k) * CQ) / CQ);
                        }
                    }
                    for (uint k = 0u; k < K_BATCH; k++) {
                        if (c0 + k < kchunks) {
                            for (uint i = 0u; i < CQ; i++) s_a += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 0u);
                        }
                    }
                    if (wide) {
                        for (uint k = 0u; k < K_BATCH; k++) {
                            if (c0 + k < kchunks) {
                                for (uint i = 0u; i < CQ; i++) s_b += chunk_quad(w[k], i) * queries((c0 + k) * CQ + i, 1u);
                            }
                        }
                    }
                }
            } else {                 // nhd with a head of part chunks: quad by quad
                for (uint c = 0u; c < hq; c++) {
                    const uint q = key_offset(kv_head, t, c);
                    const vec4 kq = chunk_quad(key_load(uint(phys), q / CQ), q % CQ);
                    s_a += kq * queries(c, 0u);
                    if (wide) s_b += kq * queries(c, 1u);
                }
            }
        }
        const uint key = base + tid;
        const uvec4 keys_a = phys >= 0 ? in_a * seq_len : uvec4(0u), keys_b = phys >= 0 ? in_b * seq_len : uvec4(0u);
        const vec4 x_a = logits4(s_a, heads_a, key, uvec4(last), keys_a);
        const vec4 x_b = wide ? logits4(s_b, heads_b, key, uvec4(last), keys_b) : vec4(NEG_INF);

        // S: the tile's max per head, the rescale, this token's weights.
        vec4 t_a = x_a, t_b = x_b;
        workgroup_reduce(t_a, t_b, true, wide);
        const vec4 n_a = max(m_a, t_a), n_b = max(m_b, t_b);
        // exp(-inf - -inf) would be NaN: a head with no visible key so far keeps weight 0.
        const vec4 alpha_a = mix(exp(m_a - n_a), vec4(1.0), equal(n_a, vec4(NEG_INF)));
        const vec4 alpha_b = mix(exp(m_b - n_b), vec4(1.0), equal(n_b, vec4(NEG_INF)));
        const vec4 p_a = mix(exp(x_a - n_a), vec4(0.0), equal(x_a, vec4(NEG_INF)));
        const vec4 p_b = mix(exp(x_b - n_b), vec4(0.0), equal(x_b, vec4(NEG_INF)));
        m_a = n_a; m_b = n_b;
        l_a = l_a * alpha_a + p_a; l_b = l_b * alpha_b + p_b;
        for (uint i = 0u; i < 4u; i++) { acc_a[i] *= alpha_a; acc_b[i] *= alpha_b; }
        for (uint g = 0u; g < 4u; g++) {
            s_w[(tid >> 2) * MAX_GROUP + g][tid & 3u] = p_a[g];
            s_w[(tid >> 2) * MAX_GROUP + 4u + g][tid & 3u] = p_b[g];
        }
        if (tid < next_blocks) s_phys[nxt + tid] = next_phys;
        barrier();

        // V: weighted values.
        if (!dims_contiguous) {
            // vLLM's layout: a head dim's bs tokens of one block are contiguous, CHUNK_TOKENS a chunk.
            [[unroll]] for (uint slot = 0u; slot < SLOTS; slot++) {
                const uint d = tid + slot * WG;
                if (d >= hs) continue;
                const uint row_d = value_offset(kv_head, 0u, d);
                if (bs % CHUNK_TOKENS == 0u) {
                    for (uint n0 = 0u; n0 < vchunks; n0 += v_batch) {
                        if (!(values_early && slot == 0u && n0 == 0u)) {   // that batch was loaded with the keys
                            for (uint k = 0u; k < V_BATCH_WITH_KEYS; k++) {
                                if (k < v_batch) w[K_BATCH + k] = value_chunk(cur, row_d, n0 + k, vchunks, bs_log2);
                            }
                        }
                        for (uint k = 0u; k < V_BATCH_WITH_KEYS; k++) {
                            for (uint i = 0u; i < CQ; i++) {
                                const uint t0 = (n0 + k) * CHUNK_TOKENS + 4u * i;
                                if (k < v_batch && t0 < len) {
                                    const vec4 v = first(chunk_quad(w[K_BATCH + k], i), len - t0);
                                    acc_a[slot] += v * weights(t0 >> 2, 0u);
                                    if (wide) acc_b[slot] += v * weights(t0 >> 2, 1u);
                                }
                            }
                        }
                    }
                } else {            // rows shorter than a chunk (fp8 with 8-token blocks): quad by quad
                    for (uint t0 = 0u; t0 < len; t0 += 4u) {
                        const int ph = s_phys[cur + (t0 >> bs_log2)];
                        if (ph < 0) continue;
                        const uint q = (row_d + (t0 & bs_mask)) >> 2;
                        const vec4 v = first(chunk_quad(value_load(uint(ph), q / CQ), q % CQ), len - t0);
                        acc_a[slot] += v * weights(t0 >> 2, 0u);
                        if (wide) acc_b[slot] += v * weights(t0 >> 2, 1u);
                    }
                }
            }
        } else if (lane < lanes) {
            // nhd: four head dims of one token are one quad; this thread takes every lanes-th token.
            for (uint t0 = lane; t0 < len; t0 += V_BATCH * lanes) {
                for (uint k = 0u; k < V_BATCH; k++) {
                    const uint tk = t0 + k * lanes;
                    const int ph = tk < len ? s_phys[cur + (tk >> bs_log2)] : -1;
                    const uint q = value_offset(kv_head, tk & bs_mask, 4u * col) >> 2;
                    w[K_BATCH + k] = ph >= 0 ? value_load(uint(ph), q / CQ) : uvec4(0u);
                }
                for (uint k = 0u; k < V_BATCH; k++) {
                    const uint tk = t0 + k * lanes;
                    if (tk >= len) continue;
                    const uint q = value_offset(kv_head, tk & bs_mask, 4u * col) >> 2;
                    const vec4 v = s_phys[cur + (tk >> bs_log2)] >= 0 ? chunk_quad(w[K_BATCH + k], q % CQ) : vec4(0.0);
                    const uint wi = (tk >> 2) * MAX_GROUP;
                    const vec4 pa = vec4(s_w[wi][tk & 3u], s_w[wi + 1u][tk & 3u], s_w[wi + 2u][tk & 3u], s_w[wi + 3u][tk & 3u]);
                    for (uint j = 0u; j < 4u; j++) acc_a[j] += v[j] * pa;
                    if (wide) {
                        const vec4 pb = vec4(s_w[wi + 4u][tk & 3u], s_w[wi + 5u][tk & 3u], s_w[wi + 6u][tk & 3u],
                                             s_w[wi + 7u][tk & 3u]);
                        for (uint j = 0u; j < 4u; j++) acc_b[j] += v[j] * pb;
                    }
                }
            }
        }
    }
    workgroup_reduce(l_a, l_b, false, wide);
    barrier();   // s_o's reduction scratch is read; the sums go there next

    // Each head's sums meet in s_o ([lane][head][dim]; one lane in vLLM's layout), then are normalized
    // and written two dims at a time.
    const uint n_lanes = dims_contiguous ? lanes : 1u;
    if (!dims_contiguous) {
        [[unroll]] for (uint slot = 0u; slot < SLOTS; slot++) {
            const uint d = tid + slot * WG;
            if (d >= hs) continue;
            for (uint g = 0u; g < 4u; g++) {
                s_o[g * hs + d] = acc_a[slot][g];
                s_o[(g + 4u) * hs + d] = acc_b[slot][g];
            }
        }
    } else if (lane < lanes) {
        for (uint j = 0u; j < 4u; j++) {
            for (uint g = 0u; g < 4u; g++) {
                s_o[(lane * MAX_GROUP + g) * hs + 4u * col + j] = acc_a[j][g];
                s_o[(lane * MAX_GROUP + g + 4u) * hs + 4u * col + j] = acc_b[j][g];
            }
        }
    }
    barrier();
    const uint half_hs = hs / 2u;
    for (uint i = tid; i < group * half_hs; i += WG) {
        const uint g = i / half_hs, d0 = 2u * (i % half_hs);
        vec2 o = vec2(0.0);
        for (uint r = 0u; r < n_lanes; r++) {
            o += vec2(s_o[(r * MAX_GROUP + g) * hs + d0], s_o[(r * MAX_GROUP + g) * hs + d0 + 1u]);
        }
        const float l = g < 4u ? l_a[g] : l_b[g - 4u];
        const float m = g < 4u ? m_a[g] : m_b[g - 4u];
        const uint head = head0 + g;
        if (pc.num_partitions == 1u) {
            // Variants: the sink joins the denominator here (once: a split's reduce adds it), lse is written.
            const vec2 fin = softmax_finish(m, l, sink_logit(head));
            o *= fin.x;
            const uint pair = (out_token(seq) + head * hs + d0) >> 1;
            if (pair < OUT_PAIRS(out_)) STORE_OUT_PAIR(out_, pair, o * pc.v_scale)
            const uint lse_row = seq * pc.num_heads + head;
            if (d0 == 0u && variant_on(VARIANT_LSE) && lse_row < uint(lse.length())) lse[lse_row] = fin.y;
        } else {
            o *= l == 0.0 ? 0.0 : 1.0 / l;   // NaN carries
            const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= uint(partial_stats.length()) || (slot + 1u) * hs > 2u * uint(partial_out.length())) continue;
            partial_out[(slot * hs + d0) >> 1] = o;
            if (d0 == 0u) partial_stats[slot] = floatBitsToUint(vec2(m, l));
        }
    }
    // A split merged here (MERGE_IN_DECODE), over the partitions that hold keys of the sequence.
    merge_if_last(seq, head0, group, partitions_holding(window0, seq_len));
}
