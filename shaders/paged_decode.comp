#version 450
// Paged-attention decode: one query token per sequence attends over that sequence's cached keys and
// values, found through its block-table row (vLLM's cache layout). Grown from the seed decode kernel.
//
// One workgroup per (query head, sequence). The context is walked in tiles of TILE tokens with an online
// softmax, so each key and value is read once:
//   A. each thread computes the logit of one token of the tile (16-byte key chunks; neighbouring threads
//      read neighbouring chunks of the same block, so the reads coalesce);
//   B. the workgroup takes the tile's max, rescales what it has accumulated, and turns logits into weights;
//   C. each thread accumulates the weighted values of the head dims it owns.
// The softmax denominator is summed per thread and reduced once at the end; no epsilon is added, so a
// sequence of length 0 gives zeros and any other matches float64 to float32 rounding.
//
// Every index into a buffer is bounded here, not only in Python: block ids outside the cache, lengths
// beyond the block-table row and rows beyond the table are treated as empty, never read.
#extension GL_GOOGLE_include_directive : require
#include "kv_storage.glsl"

const uint WG = 128u;              // == local_size_x == TILE
const uint TILE = WG;              // tokens per tile
const uint MAX_HEAD_SIZE = 256u;   // two head dims per thread
const uint MIN_BLOCK_SIZE = 8u;
const uint MAX_TILE_BLOCKS = TILE / MIN_BLOCK_SIZE;
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(std430, set = 0, binding = 0) readonly buffer Query { float query[]; };          // [seqs, heads, head_size]
layout(std430, set = 0, binding = 1) readonly buffer KeyCache { uvec4 key_cache[]; };   // [blocks, kv_heads, head_size/x, block_size, x]
layout(std430, set = 0, binding = 2) readonly buffer ValueCache { uvec4 value_cache[]; }; // [blocks, kv_heads, head_size, block_size]
layout(std430, set = 0, binding = 3) readonly buffer BlockTables { int block_tables[]; }; // [seqs, max_blocks_per_seq]
layout(std430, set = 0, binding = 4) readonly buffer SeqLens { int seq_lens[]; };        // [seqs]
layout(std430, set = 0, binding = 5) writeonly buffer Out { float out_[]; };            // [seqs, heads, head_size]

layout(push_constant) uniform Params {
    uint num_heads;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint max_blocks_per_seq;
    uint num_blocks;
    float scale;
} pc;

shared float s_q[MAX_HEAD_SIZE];     // query * scale
shared float s_red[WG];              // reduction scratch
shared float s_p[TILE];              // the tile's softmax weights
shared int s_phys[MAX_TILE_BLOCKS];  // the tile's physical block ids, -1 where out of range

float workgroup_max(float v) {
    uint tid = gl_LocalInvocationID.x;
    s_red[tid] = v;
    barrier();
    for (uint stride = WG / 2u; stride > 0u; stride >>= 1) {
        if (tid < stride) s_red[tid] = max(s_red[tid], s_red[tid + stride]);
        barrier();
    }
    float r = s_red[0];
    barrier();
    return r;
}

float workgroup_sum(float v) {
    uint tid = gl_LocalInvocationID.x;
    s_red[tid] = v;
    barrier();
    for (uint stride = WG / 2u; stride > 0u; stride >>= 1) {
        if (tid < stride) s_red[tid] += s_red[tid + stride];
        barrier();
    }
    float r = s_red[0];
    barrier();
    return r;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint head = gl_WorkGroupID.x;
    const uint seq = gl_WorkGroupID.y;
    const uint hs = pc.head_size;
    const uint bs = pc.block_size;
    const uint kv_head = head / (pc.num_heads / pc.num_kv_heads);
    const uint chunks_per_head = hs / CHUNK;                 // key chunks of one token
    const uint chunks_per_block = pc.num_kv_heads * hs * bs / CHUNK;
    const uint q_base = (seq * pc.num_heads + head) * hs;
    if (q_base + hs > uint(query.length()) || q_base + hs > uint(out_.length())) return;

    // num_blocks is set by the launcher from the bound buffers' sizes, not taken from the caller: the
    // caches' own length() is not used because NVIDIA's driver (580) returns a wrong one for bindings of
    // 2 GiB and more.
    const uint num_blocks = pc.num_blocks;
    const uint row = seq * pc.max_blocks_per_seq;
    const uint row_blocks = min(pc.max_blocks_per_seq, uint(max(int(block_tables.length()) - int(row), 0)));
    const uint seq_len = seq < uint(seq_lens.length()) ? min(uint(max(seq_lens[seq], 0)), row_blocks * bs) : 0u;
    const uint head_chunk0 = kv_head * hs * bs / CHUNK;      // this kv head's offset inside a block

    for (uint i = tid; i < hs; i += WG) s_q[i] = query[q_base + i] * pc.scale;

    float m = NEG_INF;        // running max of the logits, the same in every thread
    float l = 0.0;            // this thread's share of the softmax denominator
    float acc0 = 0.0, acc1 = 0.0;   // weighted values of head dims tid and tid + WG
    const uint d0 = tid, d1 = tid + WG;

    for (uint base = 0u; base < seq_len; base += TILE) {
        const uint tile_len = min(TILE, seq_len - base);
        const uint tile_blocks = (tile_len + bs - 1u) / bs;
        if (tid < tile_blocks) {
            int b = block_tables[row + base / bs + tid];
            s_phys[tid] = (b >= 0 && uint(b) < num_blocks) ? b : -1;
        }
        barrier();

        // A: one token's logit per thread.
        float logit = NEG_INF;
        if (tid < tile_len) {
            int phys = s_phys[tid / bs];
            if (phys >= 0) {
                uint k = uint(phys) * chunks_per_block + kv_head * chunks_per_head * bs + tid % bs;
                float s = 0.0;
                for (uint c = 0u; c < chunks_per_head; c++) {
                    s += CHUNK_DOT(key_cache[k + c * bs], s_q, c * CHUNK);
                }
                logit = s;
            }
        }

        // B: online softmax across tiles.
        const float m_new = max(m, workgroup_max(logit));
        const float alpha = m_new == NEG_INF ? 1.0 : exp(m - m_new);
        const float p = logit == NEG_INF ? 0.0 : exp(logit - m_new);
        m = m_new;
        l = l * alpha + p;
        acc0 *= alpha;
        acc1 *= alpha;
        s_p[tid] = p;
        barrier();

        // C: weighted values, one value chunk (CHUNK tokens of one head dim) at a time.
        for (uint b = 0u; b < tile_blocks; b++) {
            int phys = s_phys[b];
            if (phys < 0) continue;
            uint v_dim0 = uint(phys) * chunks_per_block + head_chunk0;
            for (uint j = 0u; j < bs / CHUNK; j++) {
                uint t0 = b * bs + j * CHUNK;    // tile-local token of the chunk's first lane
                if (t0 >= tile_len) break;
                uint n = min(CHUNK, tile_len - t0);
                if (d0 < hs) acc0 += CHUNK_DOT_N(value_cache[v_dim0 + d0 * (bs / CHUNK) + j], s_p, t0, n);
                if (d1 < hs) acc1 += CHUNK_DOT_N(value_cache[v_dim0 + d1 * (bs / CHUNK) + j], s_p, t0, n);
            }
        }
        barrier();   // s_p and s_phys are rewritten by the next tile
    }

    const float denom = workgroup_sum(l);
    const float inv = denom > 0.0 ? 1.0 / denom : 0.0;
    if (d0 < hs) out_[q_base + d0] = acc0 * inv;
    if (d1 < hs) out_[q_base + d1] = acc1 * inv;
}
