#version 450
// Paged-attention decode for CPU devices (VariantKey.target "cpu"): paged_decode.comp's op, bindings, push
// constants and outputs (split-K partials for paged_decode_reduce.comp included), shaped for a device that runs
// a subgroup as the lanes of one SIMD register and the subgroups of a workgroup one after another.
//
// Why a second kernel: llvmpipe (Mesa 22.3) loads from memory one lane at a time, each 32-bit word stored into
// a vector through the stack, even where every lane reads the same address; paged_decode.comp reads the
// queries and the softmax weights from shared memory inside its loops (a free broadcast on a GPU), and on
// lavapipe those reads took about 70% of its time (BENCHMARKS.md, "Where lavapipe's decode time goes"). Its
// barriers are coroutine switches there too. So here:
//   * one subgroup does the workgroup's work (the others return at once): no shared memory, no barrier;
//   * each lane keeps the group's queries (times the scale) in registers, loaded once;
//   * the partition is walked in stripes of 4 tokens a lane. K: lane i takes the quad of tokens 4i .. 4i + 3 of
//     the stripe (a quad never straddles a block, whose size is a multiple of 8, nor a partition, which starts
//     on a block) and computes their logits; S: the stripe's max per head over the subgroup (subgroupMax), so
//     every lane's weights share one running max, and the lane's own share of the softmax sum; V: each lane
//     owns head-dim quads lane, lane + lanes, ... and adds every lane's quad of values weighted by that lane's
//     weights, taken from it by subgroupShuffle (register moves on a CPU). In vLLM's layout one value load is
//     a head dim's 4 tokens, all of them used;
//   * at the end only the sums meet (subgroupAdd); each lane writes its own head dims.
// Every register array is indexed by loop counters of loops with constant bounds, which unroll: llvmpipe keeps
// a dynamically indexed local array in memory and reads it lane by lane too. Loops that would unroll into
// many memory instructions do not (dont_unroll, or a bound known only at run time): llvmpipe makes each a loop
// over the lanes, and its compile time grows with their count (a first version with an accumulator for every
// head dim in each lane took 16-20 s to compile against 2 s now). The head size is a compile-time constant in
// pipelines specialized for it (every plan's); without it the loops run to MAX_HEAD_SIZE, guarded.
//
// Every index into a buffer is bounded as in paged_decode.comp: block ids outside the cache, lengths beyond
// the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "kv_storage.glsl"

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { Q_IN query[]; };           // [seqs, heads, head_size]
#define KV_SEGMENT_BINDING 11  // the first of a segmented cache's extra bindings (pagedvk/abi.py)
CACHE_BINDINGS                                                                      // quads (kv_storage.glsl)
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { Q_WORD out_[]; };         // [seqs, heads, head_size]
layout(std430, set = 0, binding = 6) writeonly buffer PartialOut { vec2 partial_out[]; }; // [seqs, heads, partitions, head_size]
layout(std430, set = 0, binding = 7) writeonly buffer PartialStats { vec2 partial_stats[]; }; // [seqs, heads, partitions]: (max, sum)
layout(std430, set = 0, binding = 8) readonly buffer AlibiSlopes { float alibi_slopes[]; }; // [heads] (VARIANT_ALIBI)
layout(std430, set = 0, binding = 9) readonly buffer Sinks { float sinks[]; };             // [heads] (VARIANT_SINKS)
layout(std430, set = 0, binding = 10) writeonly buffer Lse { float lse[]; };               // [seqs, heads] (VARIANT_LSE)

#include "attention_common.glsl"
#include "attention_variants.glsl"
#include "decode_common.glsl"

const uint MAX_GROUP = 8u;   // query heads per workgroup: two vec4s (heads 0-3, heads 4-7), as paged_decode.comp
// The head size, specialized per plan (abi.DECODE_HEAD_SIZE_SPEC_ID); 0 reads the push constant.
layout(constant_id = 7) const uint HEAD_SIZE = 0u;
const uint DIMS = HEAD_SIZE != 0u ? HEAD_SIZE : MAX_HEAD_SIZE;
const uint QUADS = DIMS / 4u;
const uint MIN_LANES = 4u;                 // subgroups narrower than this are not given the kernel (pagedvk/decode.py)
// Head-dim quads a lane owns at most in the V stage, rounded up: every head size is specialized, 4 and 120 included
// (30 quads over 4 lanes are 8 a lane, not 7).
const uint SLOTS = (QUADS + MIN_LANES - 1u) / MIN_LANES;

// paged_decode.comp's specialization (pagedvk/decode.py sets both per plan; 0 reads the push constants).
layout(constant_id = 1) const uint VALUE_ORDER = 0u;   // 1: vLLM's layout (a dim's tokens contiguous); 2: nhd
layout(constant_id = 2) const uint GROUP_LIMIT = 0u;   // 4 or 8: the most query heads a workgroup takes

// Element i of v, chosen by selects: a local vector indexed by a variable is kept in memory by llvmpipe.
float element(vec4 v, uint i) {
    return i == 0u ? v.x : i == 1u ? v.y : i == 2u ? v.z : v.w;
}

// exp(x - m), 0 where x is -inf (m may be -inf too: exp(-inf - -inf) would be NaN).
vec4 weight(vec4 x, vec4 m) {
    return mix(exp(x - m), vec4(0.0), equal(x, vec4(NEG_INF)));
}

void main() {
    if (gl_SubgroupID != 0u) return;   // one subgroup takes the workgroup's work: no barrier anywhere
    const uint lane = gl_SubgroupInvocationID, lanes = gl_SubgroupSize;
    const uint hs = HEAD_SIZE != 0u ? HEAD_SIZE : pc.head_size;
    const uint bs = pc.block_size;          // a power of two (1 to 32)
    const bool short_blocks = bs < 4u;      // a lane's quad of tokens spans blocks (token-major layouts only)
    const uint bs_log2 = uint(findLSB(bs)), bs_mask = bs - 1u;
    const uint group = pc.group_size;
    const bool wide = GROUP_LIMIT == 0u ? group > 4u : GROUP_LIMIT > 4u;   // heads 4-7 in use
    const uint P = pc.partition_size;
    const uint head_groups = pc.num_heads / max(group, 1u);
    const uint wg = workgroup_index();
    const uint seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    const uint part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || P == 0u || hs > DIMS || hs != pc.head_size || bs < MIN_BLOCK_SIZE || bs > WG
        || part >= pc.num_partitions || lanes < MIN_LANES) return;
    if ((GROUP_LIMIT != 0u && group > GROUP_LIMIT) || (VALUE_ORDER != 0u && (pc.v_dim_stride == 1u) != (VALUE_ORDER == 2u)))
        return;
    const uint head0 = (wg % head_groups) * group;
    const uint kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    const uint hq = hs / 4u;
    const uint q_quad0 = (query_token(seq) >> 2) + head0 * hq;   // q_pitch: a multiple of 4
    if (q_quad0 + group * hq > Q_QUADS(query)) return;

    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint last = seq_len - 1u;
    const uint window0 = min(window_first_key(last), seq_len) & ~bs_mask;
    const uint start = window0 + part * P;
    const uint end = part + 1u == pc.num_partitions ? seq_len : min(seq_len, start + P);

    // Every lane holds the queries times the scale: quad c of heads 0-3 (qa) and 4-7 (qb), heads in columns,
    // so that a key quad times it gives four heads' partial dot products. The loop unrolls, so every register is
    // written at a constant index. (A loop kept from unrolling that shifted them in, for llvmpipe's compile time,
    // gave wrong queries on the H200, NVIDIA 580.159.04: relative errors of 0.6-1.4 against 1e-7 unrolled.)
    mat4 qa[QUADS], qb[QUADS];
    [[unroll]] for (uint c = 0u; c < QUADS; c++) {
        mat4 a = mat4(0.0), b = mat4(0.0);
        [[unroll]] for (uint g = 0u; g < MAX_GROUP; g++) {
            const vec4 q = g < group && c < hq ? Q_QUAD_AT(query, q_quad0 + g * hq + c) * pc.scale : vec4(0.0);
            if (g < 4u) a[g] = q; else b[g - 4u] = q;
        }
        qa[c] = a; qb[c] = b;
    }
    const uvec4 heads_a = head0 + uvec4(0u, 1u, 2u, 3u), heads_b = heads_a + 4u;
    const uvec4 keys_a = uvec4(lessThan(uvec4(0u, 1u, 2u, 3u), uvec4(group))) * end;   // 0 for heads not in use
    const uvec4 keys_b = uvec4(lessThan(uvec4(4u, 5u, 6u, 7u), uvec4(group))) * end;
    const bool dims_contiguous = VALUE_ORDER == 0u ? pc.v_dim_stride == 1u : VALUE_ORDER == 2u;

    vec4 m_a = vec4(NEG_INF), m_b = vec4(NEG_INF);   // running max per head, the same in every lane
    vec4 l_a = vec4(0.0), l_b = vec4(0.0);           // this lane's tokens' share of the softmax sum
    // Weighted values of this lane's head dims 4 c .. 4 c + 3, c = lane + s * lanes (slot s): [4 s + i] for
    // heads 0-3 / 4-7.
    vec4 acc_a[4u * SLOTS], acc_b[4u * SLOTS];
    [[unroll]] for (uint i = 0u; i < 4u * SLOTS; i++) { acc_a[i] = vec4(0.0); acc_b[i] = vec4(0.0); }

    for (uint base = start; base < end; base += 4u * lanes) {
        // K: lane i takes the quad of tokens base + 4 i .. + 3; its logits, token j in column j (shifted in, so
        // no column is chosen by a counter).
        // No lane branches on its own tokens between here and the subgroup operations below: without maximal
        // reconvergence (VK_KHR_shader_maximal_reconvergence) Vulkan does not promise that lanes which took
        // different paths run those operations together again. A lane with no token in the stripe reads a
        // block of its row, or block 0, in bounds, and a select discards its logits.
        const uint t0 = base + 4u * lane;
        const uint n = t0 < end ? min(4u, end - t0) : 0u;          // this quad's tokens in the partition
        int phys = -1;
        if (row_blocks > 0u) {   // the same in every lane
            const int b = physical_block(row + min(t0 >> bs_log2, row_blocks - 1u));
            phys = n > 0u ? b : -1;
        }
        // Each token's block: the quad's one, or in blocks shorter than a quad its own (a lane past the context's
        // last block reads that block, as above).
        ivec4 phys4 = ivec4(phys);
        if (short_blocks && row_blocks > 0u) {   // the same in every lane
            [[unroll]] for (uint j = 1u; j < 4u; j++) {
                const int b = physical_block(row + min((t0 + j) >> bs_log2, row_blocks - 1u));
                phys4[j] = j < n ? b : -1;
            }
        }
        mat4 x_a = mat4(vec4(NEG_INF), vec4(NEG_INF), vec4(NEG_INF), vec4(NEG_INF)), x_b = x_a;
        if (pc.num_blocks > 0u) {   // the same in every lane
            [[dont_unroll]] for (uint j = 0u; j < 4u; j++) {
                vec4 s_a = vec4(0.0), s_b = vec4(0.0);
                const uint key_block = uint(max(phys4[j], 0)), t = (t0 + j) & bs_mask;
                [[unroll]] for (uint c = 0u; c < QUADS; c++) {
                    if (c >= hq) continue;   // the same in every lane
                    const vec4 k = kv_quad(key_load(key_block, key_offset(kv_head, t, c)));
                    s_a += k * qa[c];
                    if (wide) s_b += k * qb[c];
                }
                const vec4 y_a = logits4(s_a, heads_a, t0 + j, uvec4(last), keys_a);
                const vec4 y_b = wide ? logits4(s_b, heads_b, t0 + j, uvec4(last), keys_b) : vec4(NEG_INF);
                x_a = mat4(x_a[1], x_a[2], x_a[3], phys4[j] >= 0 ? y_a : vec4(NEG_INF));
                x_b = mat4(x_b[1], x_b[2], x_b[3], phys4[j] >= 0 ? y_b : vec4(NEG_INF));
            }
        }

        // S: the stripe's max per head over the subgroup, the rescale, this lane's weights.
        const vec4 n_a = max(m_a, subgroupMax(max(max(x_a[0], x_a[1]), max(x_a[2], x_a[3]))));
        const vec4 n_b = wide ? max(m_b, subgroupMax(max(max(x_b[0], x_b[1]), max(x_b[2], x_b[3])))) : m_b;
        const vec4 alpha_a = mix(exp(m_a - n_a), vec4(1.0), equal(n_a, vec4(NEG_INF)));
        const vec4 alpha_b = mix(exp(m_b - n_b), vec4(1.0), equal(n_b, vec4(NEG_INF)));
        const mat4 p_a = mat4(weight(x_a[0], n_a), weight(x_a[1], n_a), weight(x_a[2], n_a), weight(x_a[3], n_a));
        const mat4 p_b = mat4(weight(x_b[0], n_b), weight(x_b[1], n_b), weight(x_b[2], n_b), weight(x_b[3], n_b));
        m_a = n_a; m_b = n_b;
        l_a = l_a * alpha_a + (p_a[0] + p_a[1] + p_a[2] + p_a[3]);
        l_b = l_b * alpha_b + (p_b[0] + p_b[1] + p_b[2] + p_b[3]);
        [[unroll]] for (uint i = 0u; i < 4u * SLOTS; i++) { acc_a[i] *= alpha_a; if (wide) acc_b[i] *= alpha_b; }

        // V: each lane takes its own head dims of every lane's quad, with that lane's weights (shuffled over).
        const uint quads = min(lanes, (end - base + 3u) / 4u);
        for (uint r = 0u; r < quads; r++) {
            const int ph = subgroupShuffle(phys, r);
            const ivec4 ph4 = short_blocks ? subgroupShuffle(phys4, r) : ivec4(ph);   // short_blocks: uniform
            if (all(lessThan(ph4, ivec4(0)))) continue;
            const uint tr = base + 4u * r, nr = min(4u, end - tr), tb = tr & bs_mask;
            mat4 w_a, w_b;
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                w_a[j] = subgroupShuffle(p_a[j], r);
                w_b[j] = wide ? subgroupShuffle(p_b[j], r) : vec4(0.0);
            }
            [[unroll]] for (uint s = 0u; s < SLOTS; s++) {
                // Lanes past the head's quads load its last quad and keep sums that are never written, rather
                // than branch (see the K stage: the next shuffle needs every lane).
                if (s * lanes >= hq) continue;   // the same in every lane
                const uint c = min(lane + s * lanes, hq - 1u);
                if (!dims_contiguous) {
                    // vLLM's layout: one load is head dim 4 c + i of the quad's 4 tokens.
                    [[unroll]] for (uint i = 0u; i < 4u; i++) {
                        const vec4 v = first(kv_quad(value_load(uint(ph), value_offset(kv_head, tb, 4u * c + i) >> 2)), nr);
                        acc_a[4u * s + i] += w_a * v;
                        if (wide) acc_b[4u * s + i] += w_b * v;
                    }
                } else {
                    // nhd and hnd: one load is head dims 4 c .. 4 c + 3 of token j.
                    [[unroll]] for (uint j = 0u; j < 4u; j++) {
                        const vec4 v = j < nr && ph4[j] >= 0
                            ? kv_quad(value_load(uint(ph4[j]), value_offset(kv_head, (tr + j) & bs_mask, 4u * c) >> 2))
                            : vec4(0.0);
                        [[unroll]] for (uint i = 0u; i < 4u; i++) {
                            acc_a[4u * s + i] += v[i] * w_a[j];
                            if (wide) acc_b[4u * s + i] += v[i] * w_b[j];
                        }
                    }
                }
            }
        }
    }
    l_a = subgroupAdd(l_a);
    if (wide) l_b = subgroupAdd(l_b);

    // Each lane writes its own head dims, two at a time.
    for (uint g = 0u; g < group; g++) {
        const uint gi = g & 3u;
        const bool in_b = g >= 4u;
        const float l = element(in_b ? l_b : l_a, gi);
        const float m = element(in_b ? m_b : m_a, gi);
        const uint head = head0 + g;
        const uint slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
        // One partition: the result is final (the sink joins the denominator, lse is written). Split: it is
        // normalized by this partition's sum, and paged_decode_reduce.comp merges the partitions.
        const vec2 fin = pc.num_partitions == 1u ? softmax_finish(m, l, sink_logit(head)) : vec2(l == 0.0 ? 0.0 : 1.0 / l, 0.0);
        const bool partial_fits = slot < uint(partial_stats.length()) && (slot + 1u) * hs <= 2u * uint(partial_out.length());
        [[unroll]] for (uint s = 0u; s < SLOTS; s++) {
            const uint c = lane + s * lanes;
            if (c >= hq) continue;
            [[unroll]] for (uint h = 0u; h < 2u; h++) {
                const uint d0 = 4u * c + 2u * h;
                const vec2 o = fin.x * vec2(element(in_b ? acc_b[4u * s + 2u * h] : acc_a[4u * s + 2u * h], gi),
                                            element(in_b ? acc_b[4u * s + 2u * h + 1u] : acc_a[4u * s + 2u * h + 1u], gi));
                if (pc.num_partitions == 1u) {
                    const uint pair = (out_token(seq) + head * hs + d0) >> 1;
                    if (pair < OUT_PAIRS(out_)) STORE_OUT_PAIR(out_, pair, o * pc.v_scale)
                } else if (partial_fits) {
                    partial_out[(slot * hs + d0) >> 1] = o;
                }
            }
        }
        if (lane != 0u) continue;
        if (pc.num_partitions == 1u) {
            const uint lse_row = seq * pc.num_heads + head;
            if (variant_on(VARIANT_LSE) && lse_row < uint(lse.length())) lse[lse_row] = fin.y;
        } else if (partial_fits) {
            partial_stats[slot] = vec2(m, l);
        }
    }
}
