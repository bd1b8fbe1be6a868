#version 450
// linear_gemv for CPU devices (VariantKey.target "cpu" of LINEAR_GEMV): linear_gemv.comp's op, bindings, push
// constants and outputs, y = x @ weight.T (+ bias) for a few tokens, shaped for a device that runs a subgroup as the
// lanes of one SIMD register and the subgroups of a workgroup one after another (lavapipe).
//
// Why a second kernel: linear_gemv.comp moved weights at 42-48 MB/s on lavapipe (BENCHMARKS.md, "Linear layers on
// lavapipe"). llvmpipe (Mesa 22.3) loads memory one lane at a time, so what costs is the number of loads and what
// runs around them; linear_gemv.comp adds a shared-memory reduction (reads lane by lane, barriers that are coroutine
// switches), local arrays indexed by loops that break early (kept on the stack, read lane by lane too) and branches
// on the element types inside the loop, which llvmpipe runs masked rather than skips. So here:
//   * one subgroup does the workgroup's work (the others return at once): no shared memory, no barrier; the sums
//     meet with subgroupAdd;
//   * a workgroup takes ROWS * BLOCKS weight rows (32), in passes of ROWS (8): lane i reads chunk i of each stripe
//     of a row (a stripe: one chunk a lane, one contiguous read), and loads its x chunk of the stripe once for all
//     ROWS rows of the pass; several passes a workgroup spread the workgroup's own costs (its idle subgroups, the
//     masked-off side of its branches) over more bytes;
//   * the tokens of a pass (TOKENS), the weight type and x's type are specialization constants the host sets per
//     launch (pagedvk/ops/linear.py): the loops over rows and tokens unroll, every register array is indexed by
//     their counters only, and no type branch is left in the loop;
//   * float32 sums; the bias added once; each lane stores its own rows of the pass (store_y's atomics keep 16-bit
//     outputs, whose words neighbouring lanes and other workgroups share, right).
// The stripe loop does not unroll (a bound known at run time): llvmpipe makes every memory instruction a loop
// over the lanes, and unrolling many of them multiplies its compile time.
//
// x held in registers (HELD > 0, the host's choice where HELD * TOKENS is small: catalogue.LINEAR_GEMV_CPU_HELD):
// every lane loads x's chunks that it multiplies (chunk i * lanes + lane of each row, HELD of them a token) once for
// all the workgroup's rows, then walks the rows one at a time, loading only weights. The passes above load a lane's
// x chunk again for every ROWS rows: as many loads again as the weights' for 16-bit weights and 8 rows, each a loop
// over the lanes. A row's sums meet with subgroupAdd; lane r keeps the sum of row r of each group of `lanes` rows
// and the lanes store their rows together, one store_y a group. The loops over HELD and TOKENS unroll once the
// constants are set, so the arrays stay in registers (spilled to the stack as whole vectors, not lane by lane).
// SmolLM2's rows of 576 and 1536 float16 weights moved 2-3x the bytes a second of the passes on lavapipe
// (BENCHMARKS.md, "SmolLM2 on lavapipe: where a decode step goes").
//
// Reads are bounded as in linear_gemv.comp: rows start on a chunk boundary when in_features is a multiple of the
// chunk's elements (8, float32: 4), and whole chunks are read; otherwise a chunk may straddle two rows and each
// element is checked against the row. Nothing past the weight array's last chunk is read, nor past x's tokens.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#define WEIGHT_TEXELS
#include "linear_common.glsl"

// The weight as 16-byte texels (catalogue: LINEAR_GEMV's "cpu" bindings, Binding.texels): llvmpipe loads a texel
// with vector instructions, where a storage buffer's 16 bytes are four 32-bit loads, lane by lane, each checked
// against the binding; the kernel ran about 2x faster so. Out-of-range texels read as zero.
layout(set = 0, binding = 1, rgba32ui) uniform readonly uimageBuffer weight_texels;   // [out_features, in_features]
uvec4 weight_chunk(uint i) { return imageLoad(weight_texels, int(i)); }
uint weight_chunks() { return uint(imageSize(weight_texels)); }

// The workgroup is one subgroup: LANES (catalogue.LinearSpec.LANES), the device's subgroup size, set by the host; 128
// where unset. Idle subgroups are not free on llvmpipe: a `return` in a branch only masks the lanes off, and the
// code after it still runs once, lane by lane for every load (the held path below, whose x loads are straight-line
// code, ran 5x slower in workgroups of 128).
layout(local_size_x = 128, local_size_x_id = 4, local_size_y = 1, local_size_z = 1) in;

const uint ROWS = 8u;        // rows a pass
const uint BLOCKS = 4u;      // passes a workgroup: ROWS * BLOCKS rows (catalogue.LINEAR_GEMV_CPU_ROWS)
const uint MIN_LANES = 4u;   // narrower subgroups are not given the kernel (pagedvk/ops/linear.py)
const uint ANY_TYPE = 3u;    // a type constant left unset: read the push constant
// catalogue.LinearSpec: the tokens of a pass (1 to 8; the host takes 1, 2, 4 or 8), the weight's and x's
// QUERY_TYPES codes. A launch whose push constants disagree with a set type returns without writing.
layout(constant_id = 0) const uint TOKENS = 8u;
layout(constant_id = 1) const uint WEIGHT_TYPE = ANY_TYPE;
layout(constant_id = 2) const uint X_TYPE = ANY_TYPE;
// x chunks a lane holds a token (catalogue.LinearSpec.HELD): at least ceil(in_features / chunk / lanes) for the held
// path; 0 (or too few for the subgroup the device gives) runs the passes.
layout(constant_id = 3) const uint HELD = 0u;
const uint HELD_SIZE = HELD > 0u ? HELD : 1u;   // an array's size: at least 1

float acc[ROWS][TOKENS];   // [row][token]: this lane's float32 sums
vec4 xlo[HELD_SIZE][TOKENS], xhi[HELD_SIZE][TOKENS];   // the held path's x: elements 0-3 and 4-7 of each chunk

// Elements i .. i + 3 of x (i a multiple of 4) in type xt.
vec4 x4(uint i, uint xt) {
    if (xt == T_F32) return uintBitsToFloat(uvec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]));
    const uint w0 = x[i >> 1], w1 = x[(i >> 1) + 1u];
    if (xt == T_F16) return vec4(unpackHalf2x16(w0), unpackHalf2x16(w1));
    return vec4(uintBitsToFloat(w0 << 16), uintBitsToFloat(w0 & 0xffff0000u),
                uintBitsToFloat(w1 << 16), uintBitsToFloat(w1 & 0xffff0000u));
}

// A 16-bit chunk's elements 0-3 (lo) and 4-7 (hi); float32's four in lo.
void unpack(uvec4 c, uint wt, out vec4 lo, out vec4 hi) {
    if (wt == T_F32) {
        lo = uintBitsToFloat(c); hi = vec4(0.0);
    } else if (wt == T_F16) {
        lo = vec4(unpackHalf2x16(c.x), unpackHalf2x16(c.y)); hi = vec4(unpackHalf2x16(c.z), unpackHalf2x16(c.w));
    } else {
        lo = uintBitsToFloat(uvec4(c.x << 16, c.x & 0xffff0000u, c.y << 16, c.y & 0xffff0000u));
        hi = uintBitsToFloat(uvec4(c.z << 16, c.z & 0xffff0000u, c.w << 16, c.w & 0xffff0000u));
    }
}

// Rows whose chunks are whole (in_features a multiple of the chunk's elements): stripe by stripe, lane i takes chunk
// i of the stripe in each of the ROWS rows, with its x chunk loaded once per token for all of them. wt and xt are
// the specialization constants in every pipeline the host makes, so the loop keeps no type branch.
void whole_chunks(uint wt, uint xt, uint lane, uint lanes, uint n0, uint rows, uint t0, uint group) {
    const uint K = pc.in_features, per = wt == T_F32 ? 4u : 8u;
    const uint row_chunks = K / per, chunks = weight_chunks();
    [[dont_unroll]] for (uint s = 0u; s < row_chunks; s += lanes) {
        const uint c = s + lane;                      // this lane's chunk of each row
        const bool live = c < row_chunks;             // the last stripe may be partial
        vec4 xlo[TOKENS], xhi[TOKENS];
        [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
            xlo[t] = vec4(0.0); xhi[t] = vec4(0.0);
            if (live && t < group) {
                const uint xi = (t0 + t) * K + c * per;
                xlo[t] = x4(xi, xt);
                if (per == 8u) xhi[t] = x4(xi + 4u, xt);
            }
        }
        [[unroll]] for (uint r = 0u; r < ROWS; r++) {
            const uint g = (n0 + r) * row_chunks + c;
            const uvec4 w = live && r < rows && g < chunks ? weight_chunk(g) : uvec4(0u);
            vec4 lo, hi;
            unpack(w, wt, lo, hi);
            [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
                acc[r][t] += dot(lo, xlo[t]) + (per == 8u ? dot(hi, xhi[t]) : 0.0);
            }
        }
    }
}

// Rows that straddle chunks (in_features 37, 100...): each lane walks each row's chunks, checking every element
// against the row. Not the decode's shapes; kept simple, with the types read from the push constants.
void straddling_chunks(uint lane, uint lanes, uint n0, uint rows, uint t0, uint group) {
    const uint K = pc.in_features, per = chunk_elements();
    [[unroll]] for (uint r = 0u; r < ROWS; r++) {
        if (r >= rows) continue;
        const uint start = (n0 + r) * K;
        const uint end = min((start + K + per - 1u) / per, weight_chunks());
        [[dont_unroll]] for (uint c = start / per + lane; c < end; c += lanes) {
            float v[8];
            unpack_chunk(weight_chunk(c), v);
            [[unroll]] for (uint j = 0u; j < 8u; j++) {
                const uint g = c * per + j;
                if (j >= per || g < start || g >= start + K) continue;   // another row's element
                [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
                    if (t < group) acc[r][t] += v[j] * ELEMENT(x, (t0 + t) * K + g - start, pc.x_type);
                }
            }
        }
    }
}

void clear() {
    [[unroll]] for (uint r = 0u; r < ROWS; r++) {
        [[unroll]] for (uint t = 0u; t < TOKENS; t++) acc[r][t] = 0.0;
    }
}

// The pass's sums meet (subgroupAdd, the result in every lane), and lane i stores rows i and lanes + i of the pass
// (lanes >= MIN_LANES = ROWS / 2), with their bias: one store_y, whose type branches and atomics run lane by lane
// whatever the mask, for every lane's row at once rather than one a row.
void finish(uint lane, uint lanes, uint n0, uint rows, uint t0, uint group) {
    const uint lo = lane, hi = lanes + lane;   // the lane's rows of the pass
    const float b_lo = lo < rows ? bias_of(n0 + lo) : 0.0, b_hi = hi < rows ? bias_of(n0 + hi) : 0.0;
    [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
        float y_lo = 0.0, y_hi = 0.0;
        [[unroll]] for (uint r = 0u; r < ROWS; r++) {
            const float sum = subgroupAdd(acc[r][t]);
            if (r == lo) y_lo = sum;
            if (r == hi) y_hi = sum;
        }
        if (t < group) {
            const uint at = (t0 + t) * pc.out_features + n0;
            if (lo < rows) store_y(at + lo, y_lo + b_lo);
            if (hi < rows) store_y(at + hi, y_hi + b_hi);
        }
    }
}

// The held path (whole chunks, HELD * lanes >= the row's chunks): rows first .. end - 1 for the pass's tokens.
void held_rows(uint wt, uint xt, uint lane, uint lanes, uint first, uint end, uint t0, uint group) {
    const uint K = pc.in_features, per = wt == T_F32 ? 4u : 8u, row_chunks = K / per;
    [[unroll]] for (uint i = 0u; i < HELD; i++) {
        const uint c = i * lanes + lane;
        [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
            xlo[i][t] = vec4(0.0); xhi[i][t] = vec4(0.0);
            if (c < row_chunks && t < group) {
                const uint xi = (t0 + t) * K + c * per;
                xlo[i][t] = x4(xi, xt);
                if (per == 8u) xhi[i][t] = x4(xi + 4u, xt);
            }
        }
    }
    [[dont_unroll]] for (uint r0 = first; r0 < end; r0 += lanes) {
        const uint rows = min(lanes, end - r0);
        float mine[TOKENS];   // lane r: row r0 + r's sums
        [[unroll]] for (uint t = 0u; t < TOKENS; t++) mine[t] = 0.0;
        [[dont_unroll]] for (uint r = 0u; r < rows; r++) {
            float sums[TOKENS];
            [[unroll]] for (uint t = 0u; t < TOKENS; t++) sums[t] = 0.0;
            const uint g0 = (r0 + r) * row_chunks;
            [[unroll]] for (uint i = 0u; i < HELD; i++) {
                const uint c = i * lanes + lane;
                const uvec4 w = c < row_chunks ? weight_chunk(g0 + c) : uvec4(0u);
                vec4 lo, hi;
                unpack(w, wt, lo, hi);
                [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
                    sums[t] += dot(lo, xlo[i][t]) + (per == 8u ? dot(hi, xhi[i][t]) : 0.0);
                }
            }
            [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
                const float sum = subgroupAdd(sums[t]);
                if (lane == r) mine[t] = sum;
            }
        }
        if (lane < rows) {
            const float b = bias_of(r0 + lane);
            [[unroll]] for (uint t = 0u; t < TOKENS; t++) {
                if (t < group) store_y((t0 + t) * pc.out_features + r0 + lane, mine[t] + b);
            }
        }
    }
}

void main() {
    if (gl_SubgroupID != 0u) return;   // one subgroup takes the workgroup's work: no barrier anywhere
    // a workgroup narrower than the subgroup leaves its last lanes out
    const uint lane = gl_SubgroupInvocationID, lanes = min(gl_SubgroupSize, gl_WorkGroupSize.x);
    const uint row_groups = (pc.out_features + ROWS * BLOCKS - 1u) / (ROWS * BLOCKS);
    const uint wg = workgroup_index();
    if (wg >= row_groups * ((pc.tokens + TOKENS - 1u) / TOKENS) || lanes < MIN_LANES) return;
    if ((WEIGHT_TYPE != ANY_TYPE && WEIGHT_TYPE != pc.weight_type) || (X_TYPE != ANY_TYPE && X_TYPE != pc.x_type))
        return;
    const uint first = (wg % row_groups) * ROWS * BLOCKS, end = min(first + ROWS * BLOCKS, pc.out_features);
    const uint t0 = (wg / row_groups) * TOKENS, group = min(TOKENS, pc.tokens - t0);
    const uint wt = WEIGHT_TYPE != ANY_TYPE ? WEIGHT_TYPE : pc.weight_type;
    const uint xt = X_TYPE != ANY_TYPE ? X_TYPE : pc.x_type;

    const uint per = wt == T_F32 ? 4u : 8u;
    if (HELD > 0u && pc.in_features % per == 0u && HELD * lanes >= pc.in_features / per) {
        held_rows(wt, xt, lane, lanes, first, end, t0, group);
    } else if (pc.in_features % chunk_elements() == 0u) {
        // the test is outside the passes: llvmpipe runs both sides of a branch, the one not taken masked off
        [[dont_unroll]] for (uint n0 = first; n0 < end; n0 += ROWS) {
            const uint rows = min(ROWS, pc.out_features - n0);
            clear();
            whole_chunks(wt, xt, lane, lanes, n0, rows, t0, group);
            finish(lane, lanes, n0, rows, t0, group);
        }
    } else {
        [[dont_unroll]] for (uint n0 = first; n0 < end; n0 += ROWS) {
            const uint rows = min(ROWS, pc.out_features - n0);
            clear();
            straddling_chunks(lane, lanes, n0, rows, t0, group);
            finish(lane, lanes, n0, rows, t0, group);
        }
    }
}
