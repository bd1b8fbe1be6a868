#version 450
// Paged-attention decode on cooperative matrices (VK_KHR_cooperative_matrix): the op of paged_decode.comp, with its
// bindings, push constants, grid, specialization constants and results (PAGED_DECODE in pagedvk/abi.py), for
// float16 or fp8 caches in vLLM's layout with 16-token blocks, float16 queries and a head size fixed at build
// time. The scalar kernel's arithmetic (four multiply-adds and a conversion per cache element, with the group's
// queries and weights read from shared memory) kept it at 70% of the H200's read bandwidth: here the tensor cores
// do the products, and a float16 cache is read by the matrix loads themselves, straight from the buffers (an fp8
// one is turned into float16 matrices through shared memory: FP8 below).
//
// Each of the workgroup's four subgroups walks its own blocks of the partition (every fourth), one 16-token block
// a step, with an online softmax of its own; the subgroups' states meet at the end.
//   S. vLLM's key layout holds a block's keys as 16 chunks of [16 tokens][8 head dims], so a 16 x 16 float16
//      matrix read row-major from chunk 2j holds, in row m < 8, tokens 2m and 2m + 1 of chunk 2j, and in row
//      m + 8 the same tokens of chunk 2j + 1. Multiplied by a B matrix whose column (s, p, h) holds head h's
//      query dims of chunk 2j + s in rows 8p .. 8p + 7 (zeros elsewhere), and summed over the 8 pairs j, the
//      product's element (m + 8s, (s, p, h)) is head h's dot over chunks of parity s of token 2m + p: the
//      logit is the sum of the two. A quarter of the products is used; the tensor cores have that to spare.
//   P. The lanes read the logits back through shared memory (token t = lane % 16; heads 0-3, and 4-7 in the
//      upper 16 lanes), apply the logit hooks and the mask, and reduce each head's block max across 16 lanes.
//      The running max m is raised only when a block's max exceeds it by more than RESCALE_MARGIN, so the
//      output accumulators are rescaled (through shared memory, a tile at a time) a few times a context, not
//      every block: weights exp(x - m) stay below exp(RESCALE_MARGIN), well inside float16's range.
//   V. vLLM's value layout holds a head dim's 16 tokens contiguous, so a 16 x 16 matrix read row-major from dim
//      16 i is V^T for 16 head dims: O^T += V^T P^T, O^T [dim][head] in 16 x 8 float32 accumulators (heads 0-7;
//      a 16 x 8 x 16 multiply, which the device must list too), P^T from shared
//      memory as float16 (FlashAttention-2 rounds P the same way).
// A block that is not whole (past the partition's end) stages its keys and values through shared memory with
// zeros for the missing tokens, and masks their logits: slots past a sequence's end may hold anything, NaN
// included, and 0 * NaN is NaN (a key row's zeros in B do not keep a NaN token from its row partner's logit).
// A block id outside the cache is not read: its tokens are masked.
//
// Every index into a buffer is bounded here too: block ids outside the cache, lengths beyond the block-table
// row and rows beyond the table are empty, never read; a launch whose cache strides are not the layout this
// kernel reads writes nothing (pagedvk.decode runs it only where they are).
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_EXT_control_flow_attributes : require
#define KV_CHUNKS   // the caches' bindings hold 16-byte chunks: 8 float16 elements
#include "kv_storage.glsl"

// bfloat16 modules (KV_BF16, Q_BF16) are this source compiled with float16_t matrices, given the bfloat16
// encoding by build_shaders.py (bfloat16_matrices; glslang 13 has no GL_EXT_bfloat16): nothing here computes in
// float16, it only loads, stores, converts from float32 and multiplies matrices.
#if !((defined(KV_F16) || defined(KV_E4M3) || defined(KV_E5M2)) && defined(Q_F16) || defined(KV_BF16) && defined(Q_BF16)) \
    || !defined(HEAD_SIZE)
#error "paged_decode_coopmat is built for float16 or fp8 caches with float16 queries, or bfloat16 caches and queries, and HEAD_SIZE fixed"
#endif
#if defined(KV_F16) || defined(KV_BF16)
#define KV_FP8 0
const float FP8_F16_SCALE = 1.0;
#else
#define KV_FP8 1   // fp8 caches: each block staged as float16 matrices (FP8 below)
#endif

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_QUAD query[]; };           // [seqs, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { OUT_PAIR out_[]; };         // [seqs, heads, head_size]
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

#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define MAT_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
// The P.V product's width PV_N: 16 x 8 matrices (heads 0-7) where the device lists the 16 x 8 x 16 multiply for
// the operand type (float16 on the H200), 16 x 16 with heads 8-15 zero for bfloat16 (the H200 lists no 16 x 8
// bfloat16 multiply; pagedvk.decode.MATRIX_PV_SHAPES says which module takes which).
#if defined(KV_BF16)
#define PV_N 16u
#else
#define PV_N 8u
#endif
#define MAT_BP coopmat<float16_t, gl_ScopeSubgroup, 16, PV_N, gl_MatrixUseB>
#define MAT_CP coopmat<float, gl_ScopeSubgroup, 16, PV_N, gl_MatrixUseAccumulator>

const uint D = HEAD_SIZE;          // a multiple of 16
const uint DT = D / 16u;           // 16-dim tiles: key chunk pairs, and value tiles
const uint BS = 16u;               // the block size this kernel reads
const uint SUBGROUPS = WG / 32u;   // subgroups of 32 invocations (pagedvk.decode checks the device's size)
const uint MAX_GROUP = 8u;         // query heads per workgroup: heads 0-3 and 4-7 of the S products' columns
const float RESCALE_MARGIN = 8.0;  // see P. above: weights stay below exp(8) ~ 2981

// The same specialization as paged_decode.comp (pagedvk/decode.py): VALUE_ORDER 1 is the only layout read here.
layout(constant_id = 1) const uint VALUE_ORDER = 0u;
layout(constant_id = 2) const uint GROUP_LIMIT = 0u;

shared uvec4 s_qb[2u * DT * 32u];            // the S products' B matrices, column-major: [heads 0-3 / 4-7][pair j][column][k]
shared vec4 s_scr[SUBGROUPS * 128u];          // each subgroup's two 16 x 16 float32 matrices (S), or one tile of O^T
const uint PV_ROW = PV_N / 4u;                // vec4s a row of P^T or of an O^T tile
shared f16vec4 s_p[SUBGROUPS * 16u * PV_ROW]; // each subgroup's P^T [token][head], 16 x PV_N (heads past 7 zero)
#if !KV_FP8
shared uvec4 s_v[SUBGROUPS * 32u];            // each subgroup's masked key or V^T tile (blocks not whole)
#else
const uint HT = DT / 2u;                     // tiles staged at a time: half a block's keys or values
shared uvec4 s_stage[SUBGROUPS * HT * 32u];   // each subgroup's tiles as float16 (FP8 below; 48 KiB is the limit)
#endif
shared vec4 s_ml[SUBGROUPS * 4u];             // each subgroup's final (max, sum) of heads 0-3 and 4-7
shared float s_o[SUBGROUPS * MAX_GROUP * D];  // each subgroup's scaled output sums [head][dim]

#define DECODE_MERGE_IN_DISPATCH
#define MERGE_SCRATCH s_o   // s_o, done with when the split is merged
#include "decode_merge.glsl"

// A 16 x 16 matrix of the value cache, V^T for head dims 16 i .. 16 i + 15 of kv head h in block b: rows are
// dims, 16 tokens each (vLLM's layout), 16 halves = two 16-byte chunks a row.
uint value_tile(uint b, uint h, uint i) {
    return b * value_block_elems() + (value_offset(h, 0u, 16u * i) >> 3);
}

// Key chunks 2 j and 2 j + 1 of kv head h in block b: 256 halves, read as 16 rows of 16.
uint key_tile(uint b, uint h, uint j) {
    return b * key_block_elems() + (key_offset(h, 0u, 4u * j) >> 1);
}

#if KV_FP8
// FP8. An fp8 chunk holds 16 head dims of a token (vLLM's x = 16), and a head dim's 16 tokens are one 16-byte value
// row. Each block's chunks are loaded 16 bytes a lane, turned into float16 (fp8_as_f16: exact, at
// 1 / FP8_F16_SCALE of the value, scaled back in the logits and the output) and laid out in s_stage as the float16
// kernel reads its tiles: key tile j is chunk j with row m < 8 holding tokens 2m, 2m + 1 of its dims 0-7 and row
// m + 8 of its dims 8-15; V^T tile i is value rows 16 i .. 16 i + 15. Lane l takes tiles 2 r + l / 16, token (key)
// or row (value) l % 16, for r < DT / 2; s_stage holds half the tiles at a time. Tokens from `end` on are zeros,
// as in blocks not whole.
uvec4 fp8_as_f16_lo(uvec4 w) { return uvec4(fp8_as_f16(w.x), fp8_as_f16(w.y)); }
uvec4 fp8_as_f16_hi(uvec4 w) { return uvec4(fp8_as_f16(w.z), fp8_as_f16(w.w)); }

// Key chunk j of token t, kv head h, block b; value row d.
uint key_chunk(uint b, uint h, uint t, uint j) {
    return b * key_block_elems() + key_offset(h, t, KV_CHUNK_QUADS * j) / KV_CHUNK_QUADS;
}
uint value_row(uint b, uint h, uint d) {
    return b * value_block_elems() + value_offset(h, 0u, d) / (4u * KV_CHUNK_QUADS);
}

// Byte k of a 16-byte value row kept where token base + k is before end.
uvec4 tokens_before(uvec4 w, uint base, uint end) {
    const uint n = end - min(base, end);
    [[unroll]] for (uint e = 0u; e < 4u; e++) {
        const uint have = uint(clamp(int(n) - int(4u * e), 0, 4));
        w[e] &= have >= 4u ? 0xffffffffu : (1u << (8u * have)) - 1u;
    }
    return w;
}

// This lane's key chunks and value rows of block `phys` at token `base` (none where phys < 0; key tokens from `end`
// on read as zeros).
void fp8_block_load(int phys, uint base, uint end, uint kv_head, uint t, uint hh, out uvec4 k_chunks[HT],
                    out uvec4 v_rows[HT]) {
    const uint b = uint(max(phys, 0));
    [[unroll]] for (uint r = 0u; r < HT; r++) {
        k_chunks[r] = phys >= 0 && base + t < end ? key_load(b, key_chunk(0u, kv_head, t, 2u * r + hh)) : uvec4(0u);
        v_rows[r] = phys >= 0 ? value_load(b, value_row(0u, kv_head, 16u * (2u * r + hh) + t)) : uvec4(0u);
    }
}
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint group = pc.group_size;
    const bool wide = GROUP_LIMIT == 0u ? group > 4u : GROUP_LIMIT > 4u;   // heads 4-7 in use
    const uint P = pc.partition_size;
    const uint head_groups = pc.num_heads / max(group, 1u);
    const uint wg = workgroup_index();
    const uint seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    const uint part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || P == 0u || part >= pc.num_partitions || gl_SubgroupSize != 32u) return;
    if (GROUP_LIMIT != 0u && group > GROUP_LIMIT) return;
    // The layout the matrix loads assume: 16-token blocks, a key token's 8-dim chunk after the previous token's,
    // a chunk's 16 tokens before the next chunk's; values [dim][token].
    if (pc.head_size != D || pc.block_size != BS || pc.k_token_stride != KV_CHUNK_QUADS
        || pc.k_chunk_stride != KV_CHUNK_QUADS * BS
        || pc.v_token_stride != 1u || pc.v_dim_stride != BS) return;
    const uint head0 = (wg % head_groups) * group;
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint hq = D / 4u;
    const uint q_quad0 = (seq * pc.num_heads + head0) * hq;
    if (q_quad0 + group * hq > uint(query.length())) return;

    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    // Each subgroup's first block id is fetched beside the sequence's length and the queries, as in paged_decode.comp
    // (unless a sliding window moves the partition's start, the start does not depend on the length).
    const uint early_block = part * P / BS + sg;
    const int early_phys = early_block < row_blocks ? physical_block(row + early_block) : -1;
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * BS) : 0u;
    const uint last = seq_len - 1u;
    const uint window0 = min(window_first_key(last), seq_len) & ~(BS - 1u);
    const uint start = window0 + part * P;
    const uint end = part + 1u == pc.num_partitions ? seq_len : min(seq_len, start + P);
    const uint blocks = start < end ? (end - start + BS - 1u) / BS : 0u;

    // The S products' B matrices, column-major: column n = 8 s + 4 p + h (head 4 half + h) holds, in rows
    // 8 p .. 8 p + 7, head dims 8 (2 j + s) .. of the query (one 16-byte chunk), and zeros in the other 8 rows.
    // Each block loads them from here (holding them took 32-64 registers a thread).
    for (uint i = tid; i < 2u * DT * 32u; i += WG) {
        const uint half_ = i / (DT * 32u), n = (i / 2u) % 16u, k8 = i % 2u, j = (i / 32u) % DT;
        const uint s = n / 8u, p = (n / 4u) % 2u, g = 4u * half_ + n % 4u;
        const uint c = q_quad0 + g * hq + 2u * (2u * j + s);   // the chunk's first quad
        s_qb[i] = k8 == p && g < group ? uvec4(query[c], query[c + 1u]) : uvec4(0u);
    }
    barrier();

    // This lane's token of a block and its heads (4 hh .. 4 hh + 3; the upper lanes' heads are absent unless wide).
    const uint t = lane % 16u, hh = lane / 16u;
    const uvec4 heads = head0 + 4u * hh + uvec4(0u, 1u, 2u, 3u);
    const uvec4 in_group = uvec4(lessThan(4u * hh + uvec4(0u, 1u, 2u, 3u), uvec4(wide || hh == 0u ? group : 0u)));
    const uint scr = sg * 128u, pbase = sg * 16u * PV_ROW;
    vec4 m = vec4(NEG_INF), l = vec4(0.0);
    MAT_CP o[DT];   // O^T [dim][head]: heads 0-7 (16 x 8 accumulators: half the registers of 16 x 16; PV_N above)
    [[unroll]] for (uint i = 0u; i < DT; i++) o[i] = MAT_CP(0.0);
    const uint o_at = scr + PV_ROW * (lane / 2u) + lane % 2u;   // lane l's heads 4 (l % 2) .. + 3 of row l / 2
    if (PV_N > 8u) {   // P^T's columns past head 7 stay zero (read first after the block's subgroup barriers)
        s_p[pbase + t * PV_ROW + 2u + hh] = f16vec4(0.0);
    }

    uint kb = sg;
    int phys = kb < blocks ? (window0 == 0u ? early_phys : physical_block(row + start / BS + kb)) : -1;
#if KV_FP8
    // An fp8 block is a quarter of the bytes a float16 step had in flight, behind a longer chain (staging): each
    // subgroup loads its next block's bytes before it works on this one (32 registers more), and the block ids
    // two steps ahead.
    uvec4 k_chunks[HT], v_rows[HT];
    fp8_block_load(phys, start + kb * BS, end, kv_head, t, hh, k_chunks, v_rows);
    int next_phys = kb + SUBGROUPS < blocks ? physical_block(row + start / BS + kb + SUBGROUPS) : -1;
#endif
    for (; kb < blocks; kb += SUBGROUPS) {
#if KV_FP8
        const int later_phys = kb + 2u * SUBGROUPS < blocks ? physical_block(row + start / BS + kb + 2u * SUBGROUPS) : -1;
        uvec4 next_k_chunks[HT], next_v_rows[HT];
        fp8_block_load(next_phys, start + (kb + SUBGROUPS) * BS, end, kv_head, t, hh, next_k_chunks, next_v_rows);
#else
        const int next_phys = kb + SUBGROUPS < blocks ? physical_block(row + start / BS + kb + SUBGROUPS) : -1;
#endif
        const uint base = start + kb * BS;
        const bool whole = phys >= 0 && base + BS <= end;
        const uint b = uint(max(phys, 0));
        MAT_A kt[DT];
        MAT_A vt[DT];
#if KV_FP8
        if (phys >= 0) {   // the value rows are staged after S
            [[unroll]] for (uint h2 = 0u; h2 < 2u; h2++) {
                [[unroll]] for (uint r = h2 * HT / 2u; r < (h2 + 1u) * HT / 2u; r++) {
                    const uint slot = (sg * HT + 2u * r + hh - h2 * HT) * 32u;
                    s_stage[slot + t] = fp8_as_f16_lo(k_chunks[r]);
                    s_stage[slot + 16u + t] = fp8_as_f16_hi(k_chunks[r]);
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                [[unroll]] for (uint j = 0u; j < HT; j++) {
                    coopMatLoad(kt[h2 * HT + j], s_stage, (sg * HT + j) * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                }
                subgroupBarrier();   // read before the next tiles overwrite them
            }
        }
#else
        if (whole) {
            [[unroll]] for (uint j = 0u; j < DT; j++) {
                coopMatLoad(kt[j], key_cache, key_tile(b, kv_head, j), 2u, gl_CooperativeMatrixLayoutRowMajor);
            }
        } else if (phys >= 0) {
            // Keys through shared memory, zeros for the tokens not there: a key row holds two tokens, and a NaN in
            // a missing one would reach its partner's logit through B's zeros (0 * NaN). Lane l: token l % 16 of
            // chunk 2 j + l / 16, one 16-byte chunk.
            [[unroll]] for (uint j = 0u; j < DT; j++) {
                s_v[sg * 32u + lane] = base + lane % 16u < end ? key_load(b, key_tile(0u, kv_head, j) + lane) : uvec4(0u);
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                coopMatLoad(kt[j], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                subgroupBarrier();
            }
        }
        if (whole) {
            [[unroll]] for (uint i = 0u; i < DT; i++) {
                coopMatLoad(vt[i], value_cache, value_tile(b, kv_head, i), 2u, gl_CooperativeMatrixLayoutRowMajor);
            }
        }
#endif

        // S: the block's logits, through shared memory to the lanes.
        vec4 x = vec4(NEG_INF);
        if (phys >= 0) {
            MAT_C sa = MAT_C(0.0);
            [[unroll]] for (uint j = 0u; j < DT; j++) {
                MAT_B qb;
                coopMatLoad(qb, s_qb, j * 32u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
                sa = coopMatMulAdd(kt[j], qb, sa);
            }
            coopMatStore(sa, s_scr, scr, 4u, gl_CooperativeMatrixLayoutRowMajor);
            if (wide) {
                MAT_C sb = MAT_C(0.0);
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    MAT_B qb;
                    coopMatLoad(qb, s_qb, (DT + j) * 32u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
                    sb = coopMatMulAdd(kt[j], qb, sb);
                }
                coopMatStore(sb, s_scr, scr + 64u, 4u, gl_CooperativeMatrixLayoutRowMajor);
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            // Token t = 2 r + p: row r (chunks 2j) column 4p + h, plus row r + 8 (chunks 2j + 1) column 8 + 4p + h.
            const uint at = scr + 64u * hh + (t / 2u) * 4u + t % 2u;
            const vec4 dot4 = s_scr[at] + s_scr[at + 32u + 2u];
            const uint key = base + t;
            const uvec4 keys = key < end ? in_group * seq_len : uvec4(0u);
            x = logits4(dot4 * (pc.scale * FP8_F16_SCALE), heads, key, uvec4(last), keys);
            subgroupBarrier();   // read before the next block's products overwrite it
        }

        // P: each head's block max over the 16 lanes of its half, the lazy rescale, the weights.
        vec4 bmax = x;
        [[unroll]] for (uint s = 1u; s < 16u; s <<= 1) bmax = max(bmax, subgroupShuffleXor(bmax, s));
        // subgroupAny, not a max over shuffles: the driver knows its result uniform, and the shuffles made the
        // kernel 1.25x slower on the H200 (751.6 against 603.0 us at 256 x 2048).
        if (subgroupAny(any(greaterThan(bmax, m + RESCALE_MARGIN)))) {
            const vec4 n = max(m, bmax);
            const vec4 alpha = mix(exp(m - n), vec4(1.0), equal(n, vec4(NEG_INF)));
            m = n;
            l *= alpha;
            const vec4 alpha_a = subgroupShuffle(alpha, 0u), alpha_b = subgroupShuffle(alpha, 16u);
            // O^T [dim][head] a tile at a time: lane l scales row l / 2, heads 4 (l % 2) .. 4 (l % 2) + 3.
            [[unroll]] for (uint i = 0u; i < DT; i++) {
                coopMatStore(o[i], s_scr, scr, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                s_scr[o_at] *= lane % 2u == 0u ? alpha_a : alpha_b;
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                coopMatLoad(o[i], s_scr, scr, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
                subgroupBarrier();
            }
        }
        const vec4 p = mix(exp(x - m), vec4(0.0), equal(x, vec4(NEG_INF)));
        l += p;
        if (phys >= 0) {
            s_p[pbase + t * PV_ROW + hh] = f16vec4(p);
#if KV_FP8
            [[unroll]] for (uint h2 = 0u; h2 < 2u; h2++) {
                [[unroll]] for (uint r = h2 * HT / 2u; r < (h2 + 1u) * HT / 2u; r++) {
                    const uint slot = (sg * HT + 2u * r + hh - h2 * HT) * 32u;
                    const uvec4 w = tokens_before(v_rows[r], base, end);
                    s_stage[slot + 2u * t] = fp8_as_f16_lo(w);
                    s_stage[slot + 2u * t + 1u] = fp8_as_f16_hi(w);
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                [[unroll]] for (uint i = 0u; i < HT; i++) {
                    coopMatLoad(vt[h2 * HT + i], s_stage, (sg * HT + i) * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                }
                subgroupBarrier();
            }
#else
            if (!whole) {   // V^T through shared memory, zeros for the tokens not there
                const uint d = lane / 2u, t0 = 8u * (lane % 2u);
                [[unroll]] for (uint i = 0u; i < DT; i++) {
                    uvec4 w = value_load(b, value_tile(0u, kv_head, i) + lane);   // row d, tokens t0 .. t0 + 7
                    [[unroll]] for (uint e = 0u; e < 4u; e++) {
                        const uint k0 = base + t0 + 2u * e;
                        const uint lo = k0 < end ? 0xffffu : 0u, hi = k0 + 1u < end ? 0xffff0000u : 0u;
                        w[e] &= lo | hi;
                    }
                    s_v[sg * 32u + lane] = w;
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    coopMatLoad(vt[i], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                    subgroupBarrier();
                }
            }
#endif
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            MAT_BP pt;
            coopMatLoad(pt, s_p, pbase, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint i = 0u; i < DT; i++) o[i] = coopMatMulAdd(vt[i], pt, o[i]);
            subgroupBarrier();   // P^T read before the next block's weights overwrite it
        }
#if KV_FP8
        k_chunks = next_k_chunks;
        v_rows = next_v_rows;
        phys = next_phys;
        next_phys = later_phys;
#else
        phys = next_phys;
#endif
    }

    // The subgroups' states meet: each head's max M over the subgroups, each subgroup's sums scaled to it.
    [[unroll]] for (uint s = 1u; s < 16u; s <<= 1) l += subgroupShuffleXor(l, s);
    if (lane % 16u == 0u) { s_ml[sg * 4u + hh] = m; s_ml[sg * 4u + 2u + hh] = l; }
    barrier();
    vec4 mm_a = vec4(NEG_INF), mm_b = vec4(NEG_INF);
    for (uint s = 0u; s < SUBGROUPS; s++) { mm_a = max(mm_a, s_ml[s * 4u]); mm_b = max(mm_b, s_ml[s * 4u + 1u]); }
    vec4 l_a = vec4(0.0), l_b = vec4(0.0);
    for (uint s = 0u; s < SUBGROUPS; s++) {
        l_a += s_ml[s * 4u + 2u] * mix(exp(s_ml[s * 4u] - mm_a), vec4(0.0), equal(mm_a, vec4(NEG_INF)));
        l_b += s_ml[s * 4u + 3u] * mix(exp(s_ml[s * 4u + 1u] - mm_b), vec4(0.0), equal(mm_b, vec4(NEG_INF)));
    }
    // Each subgroup's sums, scaled to the workgroup's max, into its own part of s_o (one barrier, not one a
    // subgroup): lane l takes row l / 2 (a head dim) and heads 4 (l % 2) .. 4 (l % 2) + 3 of each tile.
    const vec4 f = lane % 2u == 0u ? mix(exp(s_ml[sg * 4u] - mm_a), vec4(0.0), equal(mm_a, vec4(NEG_INF)))
                                   : mix(exp(s_ml[sg * 4u + 1u] - mm_b), vec4(0.0), equal(mm_b, vec4(NEG_INF)));
    [[unroll]] for (uint i = 0u; i < DT; i++) {
        coopMatStore(o[i], s_scr, scr, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        const vec4 v = s_scr[o_at] * f;
        [[unroll]] for (uint h = 0u; h < 4u; h++) {
            s_o[(sg * MAX_GROUP + 4u * (lane % 2u) + h) * D + 16u * i + lane / 2u] = v[h];
        }
        subgroupBarrier();
    }
    barrier();

    // Normalized and written two dims at a time, as paged_decode.comp writes them.
    const uint half_hs = D / 2u;
    for (uint i = tid; i < group * half_hs; i += WG) {
        const uint g = i / half_hs, d0 = 2u * (i % half_hs);
        vec2 o2 = vec2(0.0);
        for (uint s = 0u; s < SUBGROUPS; s++) {
            o2 += vec2(s_o[(s * MAX_GROUP + g) * D + d0], s_o[(s * MAX_GROUP + g) * D + d0 + 1u]);
        }
        o2 *= FP8_F16_SCALE;   // the values' scale (fp8: staged at 1 / FP8_F16_SCALE)
        const float lg = g < 4u ? l_a[g] : l_b[g - 4u];
        const float mg = g < 4u ? mm_a[g] : mm_b[g - 4u];
        const uint head = head0 + g;
        if (pc.num_partitions == 1u) {
            const vec2 fin = softmax_finish(mg, lg, sink_logit(head));
            o2 *= fin.x;
            const uint pair = ((seq * pc.num_heads + head) * D + d0) >> 1;
            if (pair < uint(out_.length())) out_[pair] = out_pair(o2 * pc.v_scale);
            const uint lse_row = seq * pc.num_heads + head;
            if (d0 == 0u && variant_on(VARIANT_LSE) && lse_row < uint(lse.length())) lse[lse_row] = fin.y;
        } else {
            o2 *= lg > 0.0 ? 1.0 / lg : 0.0;
            const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= uint(partial_stats.length()) || (slot + 1u) * D > 2u * uint(partial_out.length())) continue;
            partial_out[(slot * D + d0) >> 1] = o2;
            if (d0 == 0u) partial_stats[slot] = floatBitsToUint(vec2(mg, lg));
        }
    }
    // A split merged here (MERGE_IN_DECODE), over the partitions that hold keys of the sequence.
    merge_if_last(seq, head0, group, partitions_holding(window0, seq_len));
}
