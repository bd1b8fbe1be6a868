#version 450
// Paged-attention decode on cooperative matrices (VK_KHR_cooperative_matrix): the op of paged_decode.comp, with its
// bindings, push constants, grid, specialization constants and results (PAGED_DECODE in pagedvk/abi.py), for
// float16 or fp8 caches in vLLM's layout with 16-token blocks, float16 queries and a head size fixed at build
// time. The scalar kernel's arithmetic (four multiply-adds and a conversion per cache element, with the group's
// queries and weights read from shared memory) kept it at 70% of the H200's read bandwidth: here the tensor cores
// do the products, and a float16 cache is read by the matrix loads themselves, straight from the buffers (an fp8
// one is turned into float16 matrices in registers, or through shared memory: FP8 below).
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
// fp8 caches take other products (FP8 below): S = K Q^T into [token][head], with head dims and tokens permuted so
// that each lane's matrix elements are bytes it loads whole.
// A float16 block that is not whole (past the partition's end) stages its keys and values through shared memory with
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
#if defined(KV_ADDRESSED) || defined(KV_SEGMENTED)
#error "paged_decode_coopmat reads its caches by binding"
#endif
#if defined(KV_F16) || defined(KV_BF16)
#define KV_FP8 0
const float FP8_F16_SCALE = 1.0;
#else
#define KV_FP8 1   // fp8 caches: each block's matrices built in registers or staged (FP8 below)
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
#define MAT_B8 coopmat<float16_t, gl_ScopeSubgroup, 16, 8, gl_MatrixUseB>
#define MAT_C8 coopmat<float, gl_ScopeSubgroup, 16, 8, gl_MatrixUseAccumulator>
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
// How fp8 modules build their matrices (abi.DECODE_FP8_BUILD_SPEC_ID; float16 modules ignore it): 0, the default,
// in registers where the subgroup finds its device's element layout known, else through shared memory; 1 through
// shared memory always; 2 in registers, and a workgroup with a subgroup whose layout is not known writes NaN
// outputs (a test's way to tell that the register path ran).
layout(constant_id = 4) const uint FP8_BUILD = 0u;

layout(constant_id = 5) const uint STEP_ASKED = 1u;   // abi.DECODE_STEP_SPEC_ID: 1 or 2 (STEP below)
#if !KV_FP8
// Blocks a subgroup takes a step (abi.DECODE_STEP_SPEC_ID, set per plan: 1 or 2): their loads are all issued before
// any is used, and their logits share one max, one rescale test and one pair of barriers. Two were faster on the
// H200 where a workgroup's partition is long (64 x 4096: 262.0 -> 256.4 us, 216 registers against 160), slower
// where it is 1024 tokens (8 x 4096: 44.5 -> 46.5 us; BENCHMARKS.md); three spilled. Arrays and shared memory
// are sized for MAX_STEP; the driver drops what a pipeline specialized for 1 leaves unused. fp8 modules take one
// block a step whatever it says.
const uint MAX_STEP = 2u, STEP = STEP_ASKED > MAX_STEP ? MAX_STEP : STEP_ASKED;
shared uvec4 s_qb[2u * DT * 32u];            // the S products' B matrices, column-major: [heads 0-3 / 4-7][pair j][column][k]
shared vec4 s_scr[SUBGROUPS * MAX_STEP * 128u];   // each subgroup's two 16 x 16 float32 matrices (S) a block, or one tile of O^T
const uint SCR = MAX_STEP * 128u;
shared uvec4 s_v[SUBGROUPS * 32u];            // each subgroup's masked key or V^T tile (blocks not whole)
#else
const uint STEP = 1u, MAX_STEP = 1u;
shared uvec4 s_qb[DT * 16u];                  // the S products' B matrices Q^T, 16 x 8, column-major: [tile j][head][k]
shared vec4 s_scr[SUBGROUPS * 32u];           // each subgroup's 16 x 8 float32 S [token][head], or one tile of O^T
const uint SCR = 32u;
shared uint s_stage[SUBGROUPS * DT * 128u];   // each subgroup's key or V^T tiles as float16 (layouts not known)
shared uvec4 s_index[32u];                    // a 16 x 16 float16 matrix of its element indices (the layout check)
shared uint s_refused;                        // FP8_BUILD 2: a subgroup did not know its layout
#endif
const uint PV_ROW = PV_N / 4u;                // vec4s a row of P^T or of an O^T tile
shared f16vec4 s_p[SUBGROUPS * MAX_STEP * 16u * PV_ROW]; // each subgroup's P^T [token][head], 16 x PV_N a block (heads
                                                     // past 7 zero; fp8: tokens permuted)
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
// FP8. The products are taken so that every lane owns bytes it loads whole. A dot product does not change when the
// same permutation is applied to both of its operands, so the head dims (of S) and the tokens (of O^T += V^T P^T)
// are put in whatever order makes a lane's matrix elements its own contiguous cache bytes:
//   S = K Q^T, 16 x 8 x 16 products: A is a key tile, 16 tokens x 16 dim slots (row = the block's token); B is Q^T,
//      16 dim slots x 8 heads, from s_qb with its rows permuted to match; C is S [token][head], heads 0-7 at once.
//      Tile j's column slot c is head dim fp8_key_dim(j, c): byte e = c / 8 + 2 (c % 2) of word j % 4 of the
//      key's 16-byte chunk (c % 8) / 2 + 4 (j / 4).
//   O^T += V^T P^T: A is a V^T tile, 16 dims (16 i + row) x 16 token slots; token slot c is token
//      4 ((c % 8) / 2) + c / 8 + 2 (c % 2), byte e of word (c % 8) / 2 of the dim's 16-byte value row; B is P^T,
//      written to s_p with its rows in that order (fp8_token_slot).
// Where a 16 x 16 float16 A matrix holds, in lane L (r = L / 4, q = L % 4), elements (rows r and r + 8) x (columns
// 2q, 2q + 1, 2q + 8, 2q + 9) - mma.m16n8k16's elements; the H200 orders them differently from mma (both known
// here) - the lane's elements are then the 4 bytes of one word of token r and of token r + 8, bytes 0, 2, 1, 3 in
// those columns, as fp8_as_f16 pairs them with the fewest bit operations (keys: lane q takes chunks q and q + 4
// of its tokens, 16 bytes each; tile j word j % 4), and of dim rows 16 i + r and 16 i + r + 8
// (values: word q). Each lane loads those words (a block ahead), turns them into float16 (fp8_as_f16_fast or exact
// fp8_as_f16, at 1 / FP8_F16_SCALE of the value, scaled back in the logits and the output) and assigns them to the matrices'
// elements: no shared memory and no barrier between the bytes and the products. The element order is the
// implementation's: each subgroup checks it at the start (fp8_known_layout) and, where it is neither known order,
// stores the same converted words to s_stage in the tiles' row-major layout and loads the matrices from there.
// Tokens from `end` on are zeros in both matrices (0 * NaN is NaN), and their logits masked.
// e4m3 (FP8_NAN_SEPARATE): a block's matrices take fp8_as_f16_fast, which reads a NaN byte as 480, unless some lane
// of the subgroup finds a NaN byte in the block's keys (for the values: in its values before `end`); then that
// block's keys (values) take the exact fp8_as_f16. The products are those of the exact conversion, NaN where it
// puts NaN; the NaN test costs about 3 operations a word, the exact conversion about 10 more than the fast one.
const uint KC = DT / 4u;   // 16-byte key chunks a lane loads of each of its two tokens (head size 64: 1, 128: 2)

// The query dim that key tile j's column slot c holds (s_qb is written by it; the kernel's loads follow it).
uint fp8_key_dim(uint j, uint c) { return 16u * ((c % 8u) / 2u + 4u * (j / 4u)) + 4u * (j % 4u) + c / 8u + 2u * (c % 2u); }
// The row of P^T (token slot) that holds token t of a block: token 4 q + e in slot 2 q + e / 2 + 8 (e % 2).
uint fp8_token_slot(uint t) { return 2u * (t / 4u) + (t % 4u) / 2u + 8u * (t % 2u); }

// Which known order, if any, the device gives a 16 x 16 float16 A matrix's elements in this lane: loaded from
// s_index (element (row, col) holds row * 16 + col, exact in float16) and compared with each order. x: the H200's
// (r, 2q), (r, 2q + 1), (r, 2q + 8), (r, 2q + 9), then the same columns of row r + 8; y: mma.m16n8k16's (r, 2q),
// (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1), then columns 2q + 8, 2q + 9 of rows r and r + 8. Uniform over the
// subgroup (subgroupAll).
bvec2 fp8_known_layout(uint lane) {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> probe;
    coopMatLoad(probe, s_index, 0u, 2u, gl_CooperativeMatrixLayoutRowMajor);
    bool h200 = probe.length() == 8, mma = probe.length() == 8;
    if (h200) {
        const uint r = lane / 4u, q = lane % 4u;
        [[unroll]] for (uint i = 0u; i < 8u; i++) {
            const uint col = 2u * q + i % 2u;
            const float got = float(probe[i]);
            h200 = h200 && got == float((r + 8u * (i / 4u)) * 16u + col + 8u * ((i / 2u) % 2u));
            mma = mma && got == float((r + 8u * ((i / 2u) % 2u)) * 16u + col + 8u * (i / 4u));
        }
    }
    return bvec2(subgroupAll(h200), subgroupAll(mma));
}

// An A tile from this lane's words: `lo` (row r) and `hi` (row r + 8), bytes 0, 2, 1, 3 in the columns 2q, 2q + 1,
// 2q + 8, 2q + 9 (above), in the H200's element order or (mma) mma.m16n8k16's. The two orders differ by elements 2-3
// and 4-5, two selects. `exact` (a constant where it is called): NaN bytes as NaN; else fp8_as_f16_fast.
MAT_A fp8_tile(uint lo, uint hi, bool mma, bool exact) {
    // .x: bytes 0, 2 (columns 2q, 2q + 1); .y: bytes 1, 3 (columns 2q + 8, 2q + 9)
    const uvec2 a = exact ? fp8_as_f16(lo) : fp8_as_f16_fast(lo), b = exact ? fp8_as_f16(hi) : fp8_as_f16_fast(hi);
    const f16vec2 e01 = unpackFloat2x16(a.x), e23 = unpackFloat2x16(mma ? b.x : a.y);
    const f16vec2 e45 = unpackFloat2x16(mma ? a.y : b.x), e67 = unpackFloat2x16(b.y);
    MAT_A m;
    m[0] = e01.x; m[1] = e01.y; m[2] = e23.x; m[3] = e23.y;
    m[4] = e45.x; m[5] = e45.y; m[6] = e67.x; m[7] = e67.y;
    return m;
}

// The same tile through shared memory (layouts not known): stored row-major (16 halves, 8 words, a row) at `at`,
// to be loaded once the subgroup's stores are visible. Always the exact conversion (this path is the fallback).
void fp8_stage(uint at, uint lane, uint lo, uint hi) {
    const uint r = lane / 4u, q = lane % 4u;
    const uvec2 a = fp8_as_f16(lo), b = fp8_as_f16(hi);
    s_stage[at + 8u * r + q] = a.x;
    s_stage[at + 8u * r + 4u + q] = a.y;
    s_stage[at + 8u * (r + 8u) + q] = b.x;
    s_stage[at + 8u * (r + 8u) + 4u + q] = b.y;
}

// The S product K Q^T of a block from this lane's key words (in registers); `exact` as fp8_tile's.
MAT_C8 fp8_logits(uvec4 kw[2u * KC], bool mma, bool exact) {
    MAT_C8 sa = MAT_C8(0.0);
    [[unroll]] for (uint j = 0u; j < DT; j++) {
        MAT_B8 qb;
        coopMatLoad(qb, s_qb, j * 16u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
        sa = coopMatMulAdd(fp8_tile(kw[j / 4u][j % 4u], kw[KC + j / 4u][j % 4u], mma, exact), qb, sa);
    }
    return sa;
}

// Key chunk j of token t, kv head h, block b (16 bytes); word w of value row d (4 bytes: tokens 4 w .. 4 w + 3).
uint key_chunk(uint b, uint h, uint t, uint j) {
    return b * key_block_elems() + key_offset(h, t, KV_CHUNK_QUADS * j) / KV_CHUNK_QUADS;
}
uint value_word(uint b, uint h, uint d, uint w) {
    return value_cache[b * value_block_elems() + value_offset(h, 0u, d) / (4u * KV_CHUNK_QUADS)][w];
}

// The bytes of a value word (tokens first .. first + 3) kept where their token is before end.
uint fp8_tokens_before(uint first, uint end) {
    const uint have = end - min(first, end);
    return have >= 4u ? 0xffffffffu : (1u << (8u * have)) - 1u;
}

// This lane's key chunks (kw[s KC + c]: token r + 8 s, chunk q + 4 c) and value words (vw[2 i + s]: word q of dim
// 16 i + r + 8 s) of block `phys` at token `base`; none where phys < 0, key tokens from `end` on read as zeros (the
// values' are masked where they are used).
void fp8_block_load(int phys, uint base, uint end, uint kv_head, uint lane, out uvec4 kw[2u * KC], out uint vw[2u * DT]) {
    const uint b = uint(max(phys, 0)), r = lane / 4u, q = lane % 4u;
    [[unroll]] for (uint s = 0u; s < 2u; s++) {
        [[unroll]] for (uint c = 0u; c < KC; c++) {
            kw[s * KC + c] = phys >= 0 && base + r + 8u * s < end
                           ? key_load(b, key_chunk(0u, kv_head, r + 8u * s, q + 4u * c)) : uvec4(0u);
        }
    }
    [[unroll]] for (uint i = 0u; i < DT; i++) {
        [[unroll]] for (uint s = 0u; s < 2u; s++) {
            vw[2u * i + s] = phys >= 0 ? value_word(b, kv_head, 16u * i + r + 8u * s, q) : 0u;
        }
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
    if (group == 0u || group > MAX_GROUP || P == 0u || part >= pc.num_partitions || gl_SubgroupSize != 32u
        || STEP_ASKED == 0u || STEP_ASKED > 2u) return;
    if (GROUP_LIMIT != 0u && group > GROUP_LIMIT) return;
    // The layout the matrix loads assume: 16-token blocks, a key token's 8-dim chunk after the previous token's,
    // a chunk's 16 tokens before the next chunk's; values [dim][token].
    if (pc.head_size != D || pc.block_size != BS || pc.k_token_stride != KV_CHUNK_QUADS
        || pc.k_chunk_stride != KV_CHUNK_QUADS * BS
        || pc.v_token_stride != 1u || pc.v_dim_stride != BS) return;
    const uint head0 = (wg % head_groups) * group;
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint hq = D / 4u;
    const uint q_quad0 = (query_token(seq) >> 2) + head0 * hq;   // q_pitch: a multiple of 4
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

#if !KV_FP8
    // The S products' B matrices, column-major: column n = 8 s + 4 p + h (head 4 half + h) holds, in rows
    // 8 p .. 8 p + 7, head dims 8 (2 j + s) .. of the query (one 16-byte chunk), and zeros in the other 8 rows.
    // Each block loads them from here (holding them took 32-64 registers a thread).
    for (uint i = tid; i < 2u * DT * 32u; i += WG) {
        const uint half_ = i / (DT * 32u), n = (i / 2u) % 16u, k8 = i % 2u, j = (i / 32u) % DT;
        const uint s = n / 8u, p = (n / 4u) % 2u, g = 4u * half_ + n % 4u;
        const uint c = q_quad0 + g * hq + 2u * (2u * j + s);   // the chunk's first quad
        s_qb[i] = k8 == p && g < group ? uvec4(query[c], query[c + 1u]) : uvec4(0u);
    }
#else
    // Q^T for each key tile j, column-major: column n (head n) holds, in row k, the query's dim fp8_key_dim(j, k);
    // rows 2 kp and 2 kp + 1 are dims d and d + 2 (d % 4 = e < 2): half e of each word of the query's quad. Zeros
    // for heads past the group.
    for (uint i = tid; i < DT * 64u; i += WG) {
        const uint j = i / 64u, n = (i / 8u) % 8u, kp = i % 8u;
        const uint d = fp8_key_dim(j, 2u * kp);
        const uvec2 qd = n < group ? query[q_quad0 + n * hq + d / 4u] >> (16u * (d % 4u)) : uvec2(0u);
        s_qb[i / 4u][i % 4u] = (qd.x & 0xffffu) | (qd.y << 16);
    }
    if (tid < 32u) {   // element (row, col) of a 16 x 16 matrix: row * 16 + col, as float16
        const uint e = 8u * tid;
        s_index[tid] = uvec4(packHalf2x16(vec2(e, e + 1u)), packHalf2x16(vec2(e + 2u, e + 3u)),
                             packHalf2x16(vec2(e + 4u, e + 5u)), packHalf2x16(vec2(e + 6u, e + 7u)));
    }
    if (tid == 0u) s_refused = 0u;
#endif
    barrier();

    // This lane's token of a block and its heads (4 hh .. 4 hh + 3; the upper lanes' heads are absent unless wide).
    const uint t = lane % 16u, hh = lane / 16u;
    const uvec4 heads = head0 + 4u * hh + uvec4(0u, 1u, 2u, 3u);
    const uvec4 in_group = uvec4(lessThan(4u * hh + uvec4(0u, 1u, 2u, 3u), uvec4(wide || hh == 0u ? group : 0u)));
    const uint scr = sg * SCR, pbase = sg * MAX_STEP * 16u * PV_ROW;
    vec4 m = vec4(NEG_INF), l = vec4(0.0);
    MAT_CP o[DT];   // O^T [dim][head]: heads 0-7 (16 x 8 accumulators: half the registers of 16 x 16; PV_N above)
    [[unroll]] for (uint i = 0u; i < DT; i++) o[i] = MAT_CP(0.0);
    const uint o_at = scr + PV_ROW * (lane / 2u) + lane % 2u;   // lane l's heads 4 (l % 2) .. + 3 of row l / 2
    if (PV_N > 8u) {   // P^T's columns past head 7 stay zero (read first after the block's subgroup barriers)
        [[unroll]] for (uint u = 0u; u < STEP; u++) s_p[pbase + (16u * u + t) * PV_ROW + 2u + hh] = f16vec4(0.0);
    }

    uint kb = sg;
#if KV_FP8
    int phys = kb < blocks ? (window0 == 0u ? early_phys : physical_block(row + start / BS + kb)) : -1;
    // The element layout (uniform over the subgroup): matrices built in registers where it is a known one.
    const bvec2 known = fp8_known_layout(lane);
    const bool in_registers = FP8_BUILD != 1u && (known.x || known.y), mma_order = !known.x;
    if (FP8_BUILD == 2u && !in_registers && lane == 0u) s_refused = 1u;
    const uint qq = lane % 4u;                   // the value word this lane loads of each row (FP8 above)
    const uint stage = sg * DT * 128u;           // this subgroup's tiles in s_stage (layouts not known)
    // Each subgroup loads the bytes of its next block before it works on this one (32 registers), and that block's
    // id a step further: kw, vw hold this block's words; phys1 is the next block's id. (Two blocks ahead measured
    // slower on the H200: 224.7 against 216.7 us, e5m2 at 64 x 4096; BENCHMARKS.md.)
    uvec4 kw[2u * KC];
    uint vw[2u * DT];
    int phys1 = kb + SUBGROUPS < blocks ? physical_block(row + start / BS + kb + SUBGROUPS) : -1;
    fp8_block_load(phys, start + kb * BS, end, kv_head, lane, kw, vw);
#else
    // Block ids of this step's blocks kb + u SUBGROUPS (u < STEP); the next step's are fetched a step ahead.
    int phys[MAX_STEP];
    [[unroll]] for (uint u = 0u; u < STEP; u++) {
        const uint bk = kb + u * SUBGROUPS;
        phys[u] = bk < blocks ? (u == 0u && window0 == 0u ? early_phys : physical_block(row + start / BS + bk)) : -1;
    }
#endif
    for (; kb < blocks; kb += STEP * SUBGROUPS) {
#if KV_FP8
        const uint ahead = kb + SUBGROUPS, later = ahead + SUBGROUPS;   // bytes loaded; id fetched
        const int later_phys = later < blocks ? physical_block(row + start / BS + later) : -1;
        uvec4 ahead_kw[2u * KC];
        uint ahead_vw[2u * DT];
        fp8_block_load(phys1, start + ahead * BS, end, kv_head, lane, ahead_kw, ahead_vw);
#else
        int next_phys[MAX_STEP];
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            const uint bk = kb + (STEP + u) * SUBGROUPS;
            next_phys[u] = bk < blocks ? physical_block(row + start / BS + bk) : -1;
        }
#endif
        vec4 x[MAX_STEP];   // this lane's logits (token t, heads 4 hh ..) of each block of the step
#if KV_FP8
        const uint base = start + kb * BS;
        // S: the block's logits [token][head], through shared memory to the lanes.
        x[0] = vec4(NEG_INF);
        if (phys >= 0) {
            MAT_C8 sa = MAT_C8(0.0);
            if (in_registers) {
                uint nan_bytes = 0u;   // e4m3: the exact conversion for a block whose keys hold a NaN (FP8 above)
                [[unroll]] for (uint c = 0u; c < 2u * KC; c++) {
                    [[unroll]] for (uint e = 0u; e < 4u; e++) nan_bytes |= fp8_nan_bytes(kw[c][e]);
                }
                if (subgroupAny(fp8_any_nan(nan_bytes))) {
                    sa = fp8_logits(kw, mma_order, true);
                } else {
                    sa = fp8_logits(kw, mma_order, false);
                }
            } else {
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    fp8_stage(stage + 128u * j, lane, kw[j / 4u][j % 4u], kw[KC + j / 4u][j % 4u]);
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    MAT_A kt;
                    coopMatLoad(kt, s_stage, stage + 128u * j, 8u, gl_CooperativeMatrixLayoutRowMajor);
                    MAT_B8 qb;
                    coopMatLoad(qb, s_qb, j * 16u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
                    sa = coopMatMulAdd(kt, qb, sa);
                }
            }
            coopMatStore(sa, s_scr, scr, 2u, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            const vec4 dot4 = s_scr[scr + 2u * t + hh];   // token t, heads 4 hh .. 4 hh + 3
            const uint key = base + t;
            const uvec4 keys = key < end ? in_group * seq_len : uvec4(0u);
            x[0] = logits4(dot4 * (pc.scale * FP8_F16_SCALE), heads, key, uvec4(last), keys);
            subgroupBarrier();   // read (and the staged keys loaded) before the next products overwrite them
        }
#else
        MAT_A kt[MAX_STEP * DT];
        MAT_A vt[MAX_STEP * DT];
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            const uint base = start + (kb + u * SUBGROUPS) * BS;
            const bool whole = phys[u] >= 0 && base + BS <= end;
            const uint b = uint(max(phys[u], 0));
            if (whole) {
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    coopMatLoad(kt[u * DT + j], key_cache, key_tile(b, kv_head, j), 2u, gl_CooperativeMatrixLayoutRowMajor);
                }
            } else if (phys[u] >= 0) {
                // Keys through shared memory, zeros for the tokens not there: a key row holds two tokens, and a NaN in
                // a missing one would reach its partner's logit through B's zeros (0 * NaN). Lane l: token l % 16 of
                // chunk 2 j + l / 16, one 16-byte chunk.
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    s_v[sg * 32u + lane] = base + lane % 16u < end ? key_load(b, key_tile(0u, kv_head, j) + lane) : uvec4(0u);
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    coopMatLoad(kt[u * DT + j], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                    subgroupBarrier();
                }
            }
            if (whole) {
                [[unroll]] for (uint i = 0u; i < DT; i++) {
                    coopMatLoad(vt[u * DT + i], value_cache, value_tile(b, kv_head, i), 2u, gl_CooperativeMatrixLayoutRowMajor);
                }
            }
        }

        // S: each block's logits, through shared memory to the lanes (block u's at scr + 128 u).
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            x[u] = vec4(NEG_INF);
            if (phys[u] < 0) continue;
            const uint su = scr + 128u * u;
            MAT_C sa = MAT_C(0.0);
            [[unroll]] for (uint j = 0u; j < DT; j++) {
                MAT_B qb;
                coopMatLoad(qb, s_qb, j * 32u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
                sa = coopMatMulAdd(kt[u * DT + j], qb, sa);
            }
            coopMatStore(sa, s_scr, su, 4u, gl_CooperativeMatrixLayoutRowMajor);
            if (wide) {
                MAT_C sb = MAT_C(0.0);
                [[unroll]] for (uint j = 0u; j < DT; j++) {
                    MAT_B qb;
                    coopMatLoad(qb, s_qb, (DT + j) * 32u, 2u, gl_CooperativeMatrixLayoutColumnMajor);
                    sb = coopMatMulAdd(kt[u * DT + j], qb, sb);
                }
                coopMatStore(sb, s_scr, su + 64u, 4u, gl_CooperativeMatrixLayoutRowMajor);
            }
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            if (phys[u] < 0) continue;
            // Token t = 2 r + p: row r (chunks 2j) column 4p + h, plus row r + 8 (chunks 2j + 1) column 8 + 4p + h.
            const uint at = scr + 128u * u + 64u * hh + (t / 2u) * 4u + t % 2u;
            const vec4 dot4 = s_scr[at] + s_scr[at + 32u + 2u];
            const uint key = start + (kb + u * SUBGROUPS) * BS + t;
            const uvec4 keys = key < end ? in_group * seq_len : uvec4(0u);
            x[u] = logits4(dot4 * (pc.scale * FP8_F16_SCALE), heads, key, uvec4(last), keys);
        }
        subgroupBarrier();   // read before the next step's products overwrite it
#endif

        // P: each head's block max over the 16 lanes of its half, the lazy rescale, the weights.
        vec4 bmax = x[0];
        [[unroll]] for (uint u = 1u; u < STEP; u++) bmax = max(bmax, x[u]);
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
        vec4 p[MAX_STEP];
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            p[u] = mix(exp(x[u] - m), vec4(0.0), equal(x[u], vec4(NEG_INF)));
            l += p[u];
        }
#if KV_FP8
        if (phys >= 0) {
            s_p[pbase + fp8_token_slot(t) * PV_ROW + hh] = f16vec4(p[0]);
            // V^T's words, the tokens from `end` on zeroed (one mask: every word of the lane holds tokens 4 qq ..).
            const uint keep = fp8_tokens_before(base + 4u * qq, end);
            if (!in_registers) {
                [[unroll]] for (uint i = 0u; i < DT; i++) {
                    fp8_stage(stage + 128u * i, lane, vw[2u * i] & keep, vw[2u * i + 1u] & keep);
                }
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            MAT_BP pt;
            coopMatLoad(pt, s_p, pbase, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
            if (in_registers) {
                uint nan_bytes = 0u;   // e4m3: the exact conversion for a block whose values hold a NaN (FP8 above)
                [[unroll]] for (uint i = 0u; i < 2u * DT; i++) nan_bytes |= fp8_nan_bytes(vw[i] & keep);
                if (subgroupAny(fp8_any_nan(nan_bytes))) {
                    [[unroll]] for (uint i = 0u; i < DT; i++) {
                        const MAT_A vt = fp8_tile(vw[2u * i] & keep, vw[2u * i + 1u] & keep, mma_order, true);
                        o[i] = coopMatMulAdd(vt, pt, o[i]);
                    }
                } else {
                    [[unroll]] for (uint i = 0u; i < DT; i++) {
                        const MAT_A vt = fp8_tile(vw[2u * i] & keep, vw[2u * i + 1u] & keep, mma_order, false);
                        o[i] = coopMatMulAdd(vt, pt, o[i]);
                    }
                }
            } else {
                [[unroll]] for (uint i = 0u; i < DT; i++) {
                    MAT_A vt;
                    coopMatLoad(vt, s_stage, stage + 128u * i, 8u, gl_CooperativeMatrixLayoutRowMajor);
                    o[i] = coopMatMulAdd(vt, pt, o[i]);
                }
            }
            subgroupBarrier();   // P^T (and the staged values) read before the next block's overwrite them
        }
#else
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            if (phys[u] < 0) continue;
            s_p[pbase + (16u * u + t) * PV_ROW + hh] = f16vec4(p[u]);
            const uint base = start + (kb + u * SUBGROUPS) * BS;
            if (base + BS > end) {   // V^T through shared memory, zeros for the tokens not there
                const uint d = lane / 2u, t0 = 8u * (lane % 2u), b = uint(phys[u]);
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
                    coopMatLoad(vt[u * DT + i], s_v, sg * 32u, 2u, gl_CooperativeMatrixLayoutRowMajor);
                    subgroupBarrier();
                }
            }
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint u = 0u; u < STEP; u++) {
            if (phys[u] < 0) continue;
            MAT_BP pt;
            coopMatLoad(pt, s_p, pbase + 16u * u * PV_ROW, PV_ROW, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint i = 0u; i < DT; i++) o[i] = coopMatMulAdd(vt[u * DT + i], pt, o[i]);
        }
        subgroupBarrier();   // P^T read before the next step's weights overwrite it
#endif
#if KV_FP8
        phys = phys1;
        kw = ahead_kw;
        vw = ahead_vw;
        phys1 = later_phys;
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
        o2 *= FP8_F16_SCALE;   // the values' scale (fp8: converted at 1 / FP8_F16_SCALE)
#if KV_FP8
        if (FP8_BUILD == 2u && s_refused != 0u) o2 = vec2(uintBitsToFloat(0x7fc00000u));   // not in registers
#endif
        const float lg = g < 4u ? l_a[g] : l_b[g - 4u];
        const float mg = g < 4u ? mm_a[g] : mm_b[g - 4u];
        const uint head = head0 + g;
        if (pc.num_partitions == 1u) {
            const vec2 fin = softmax_finish(mg, lg, sink_logit(head));
            o2 *= fin.x;
            const uint pair = (out_token(seq) + head * D + d0) >> 1;
            if (pair < uint(out_.length())) out_[pair] = out_pair(o2 * pc.v_scale);
            const uint lse_row = seq * pc.num_heads + head;
            if (d0 == 0u && variant_on(VARIANT_LSE) && lse_row < uint(lse.length())) lse[lse_row] = fin.y;
        } else {
            o2 *= lg == 0.0 ? 0.0 : 1.0 / lg;   // NaN carries
            const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= uint(partial_stats.length()) || (slot + 1u) * D > 2u * uint(partial_out.length())) continue;
            partial_out[(slot * D + d0) >> 1] = o2;
            if (d0 == 0u) partial_stats[slot] = floatBitsToUint(vec2(mg, lg));
        }
    }
    // A split merged here (MERGE_IN_DECODE), over the partitions that hold keys of the sequence.
    merge_if_last(seq, head0, group, partitions_holding(window0, seq_len));
}
