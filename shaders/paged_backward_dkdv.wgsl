// Paged-attention backward, the key and value gradients, WGSL: shaders/paged_backward_dkdv.comp
// translated statement for statement, with the same interface (PAGED_BACKWARD_DKDV in pagedvk/abi.py).
// The algorithm (per physical block and its readers, the rows' operands staged and shared by the block's
// keys) is explained there and in attention_common.glsl; build_shaders.py pastes the storage files, the
// cache access and the common parts. query and dout are of the type pc.q_type names, bound as 32-bit words
// (q_any.wgsl).

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include q_rows.wgsl
//!include attention_common.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl

@group(0) @binding(0) var<storage, read> query: array<u32>;               // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;        // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;      // see value_load()
@group(0) @binding(3) var<storage, read> block_readers: array<i32>;        // see PAGED_BACKWARD_DKDV
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;             // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;     // [seqs + 1]
@group(0) @binding(6) var<storage, read> dout: array<u32>;                // like query
@group(0) @binding(7) var<storage, read> delta: array<f32>;              // like lse: D of each row
@group(0) @binding(8) var<storage, read> lse: array<f32>;                  // [tokens, heads]
@group(0) @binding(9) var<storage, read_write> dk_cache: array<f32>;       // float32, key_cache's shape
@group(0) @binding(10) var<storage, read_write> dv_cache: array<f32>;      // float32, value_cache's shape
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

const MAX_KEYS: u32 = 16u;          // block tokens per workgroup (pagedvk.prefill.DKDV_KEYS)
const MIN_KEYS: u32 = 8u;           // and at least: the keys past a shorter block masked (see the GLSL)
const MAX_ROWS: u32 = 64u;          // R = 512 / KEYS
// Shared memory in vec4s, as paged_backward_dkdv.comp lays it out.
const S_MEM: u32 = 976u;
const PD_QUADS: u32 = 256u;
const CQ: u32 = 8u;
const QK_STRIDE: u32 = 9u;          // CQ + 1
const NO_ROW: u32 = 0xffffffffu;
const ABSENT_BITS: u32 = 0x7f800000u;   // s_rows' lse of a row past the sequence or a buffer (+inf)

var<workgroup> s_mem: array<vec4<f32>, S_MEM>;
var<workgroup> s_rows: array<vec2<f32>, MAX_ROWS>;   // (lse, D) of the step's rows

// Key (phase 0) or value (phase 1) quad c of token t of block b.
fn key_quad(phase: u32, b: u32, h: u32, t: u32, c: u32) -> vec4<f32> {
    if (phase == 0u) {
        return kv_quad(key_load(b, key_offset(h, t, c)));
    }
    return value_quad(b, h, t, c);
}

// Where key element (b, h, t, d) sits in an array of key_cache's shape (dk_cache).
fn key_element(b: u32, h: u32, t: u32, d: u32) -> u32 {
    return (b * pc.k_block_stride + key_offset(h, t, d >> 2u)) * 4u + (d & 3u);
}

// The outer product of column c and row r: column e is c * r[e].
fn outer(c: vec4<f32>, r: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(c * r.x, c * r.y, c * r.z, c * r.w);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let kv_head = wid.y;
    let sub = wid.z;
    let hs = pc.head_size;
    let hq = hs / 4u;
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let max_blocks = pc.max_blocks_per_seq;
    let keys = clamp(bs, MIN_KEYS, MAX_KEYS);
    if (hs > MAX_HEAD_SIZE || hq == 0u || bs == 0u || sub * keys >= bs) {
        return;
    }
    let n_rows = 512u / keys;            // R
    let kg = tid % keys;                 // S: key kg, rows 4rg .. 4rg+3
    let rg = tid / keys;
    let kq_count = keys / 4u;            // C: keys 4kq .. 4kq+3, head quads cg, cg + c_groups
    let c_groups = WG / kq_count;
    let kq = tid / c_groups;
    let cg = tid % c_groups;
    let c0_ = min(cg, hq - 1u);
    let c1_ = min(cg + c_groups, hq - 1u);
    let vr = min(n_rows, (S_MEM - PD_QUADS) / (2u * hq));
    let k_off = n_rows * QK_STRIDE;
    let absent = bitcast<f32>(ABSENT_BITS);

    let num_blocks = pc.num_blocks;   // see attention_common.glsl
    let row_floats = min(q_quads(arrayLength(&query)), q_quads(arrayLength(&dout))) * 4u;
    let first_entry = pc.num_blocks + 1u;
    let entries = u32(max(i32(arrayLength(&block_readers)) - i32(first_entry), 0));

    // What this thread stages (paged_backward_dkdv.comp explains).
    let cl = tid & (CQ - 1u);
    let lane_row = tid / CQ;
    let row_step = WG / CQ;
    var sr = vec4<u32>(0u);
    var sc = vec4<u32>(0u);
    for (var n = 0u; n < 4u; n++) {
        sr[n] = (tid + WG * n) / hq;
        sc[n] = (tid + WG * n) % hq;
    }

    for (var b = wid.x; b < num_blocks; b += nwg.x) {
        var dk0 = mat4x4<f32>();   // column e: key 4kq+e
        var dk1 = mat4x4<f32>();
        var dv0 = mat4x4<f32>();
        var dv1 = mat4x4<f32>();
        var e_begin = 0u;
        var e_end = 0u;
        if (b + 1u < arrayLength(&block_readers)) {
            e_begin = min(u32(max(block_readers[b], 0)), entries);
            e_end = min(u32(max(block_readers[b + 1u], 0)), entries);
        }

        for (var e = e_begin; e < e_end; e++) {
            let reader = block_readers[first_entry + e];
            if (reader < 0 || max_blocks == 0u) {
                continue;
            }
            let seq = u32(reader) / max_blocks;
            let slot = u32(reader) % max_blocks;
            var seq_len = 0u;
            if (seq < arrayLength(&seq_lens)) {
                seq_len = min(u32(max(seq_lens[seq], 0)), max_blocks * bs);
            }
            let queries = sequence_queries(seq, row_floats / (hs * pc.num_heads));
            let q_start = queries.x;
            let q_len = queries.y;
            let rows = group * q_len;
            let p0 = slot * bs + sub * keys;
            if (p0 >= seq_len) {
                continue;
            }
            var i_first = 0u;
            if (pc.causal != 0u) {
                i_first = u32(clamp(i32(p0) - (i32(seq_len) - i32(q_len)), 0, i32(q_len)));
            }

            for (var r0 = i_first * group; r0 < rows; r0 += n_rows) {
                // D: row r of the step is there when it is a row of the sequence inside every row buffer.
                if (tid < n_rows) {
                    let gr = r0 + tid;
                    let q = row_base(q_start, kv_head, gr);
                    var row = vec2<f32>(absent, 0.0);
                    if (gr < rows && q + hs <= row_floats && q / hs < min(arrayLength(&lse), arrayLength(&delta))) {
                        row = vec2<f32>(lse[q / hs], delta[q / hs]);   // D: paged_backward_delta.wgsl's
                    }
                    s_rows[tid] = row;
                }
                var q_src = vec4<u32>(NO_ROW);
                for (var n = 0u; n < 4u; n++) {
                    let r = lane_row + n * row_step;
                    let q = row_base(q_start, kv_head, r0 + r);
                    if (r < n_rows && r0 + r < rows && q + hs <= row_floats) {
                        q_src[n] = q / 4u + cl;
                    }
                }

                // S: phase 0 the logits' dot products, phase 1 dP.
                var st = vec4<f32>(0.0);
                var dp = vec4<f32>(0.0);
                for (var phase = 0u; phase < 2u; phase++) {
                    var acc = vec4<f32>(0.0);
                    for (var c0 = 0u; c0 < hq; c0 += CQ) {
                        let in_head = c0 + cl < hq;
                        for (var n = 0u; n < 4u; n++) {
                            let r = lane_row + n * row_step;
                            if (r >= n_rows) {
                                break;
                            }
                            var x = vec4<f32>(0.0);
                            if (q_src[n] != NO_ROW && in_head) {
                                x = row_quad(phase, q_src[n] + c0);
                            }
                            s_mem[r * QK_STRIDE + cl] = x;
                        }
                        if (lane_row < keys) {
                            var x = vec4<f32>(0.0);
                            if (in_head && sub * keys + lane_row < bs) {
                                x = key_quad(phase, b, kv_head, sub * keys + lane_row, c0 + cl);
                            }
                            s_mem[k_off + lane_row * QK_STRIDE + cl] = x;
                        }
                        workgroupBarrier();
                        let n = min(CQ, hq - c0);
                        for (var c = 0u; c < n; c++) {
                            let qr = 4u * rg * QK_STRIDE + c;
                            let q = mat4x4<f32>(s_mem[qr], s_mem[qr + QK_STRIDE], s_mem[qr + 2u * QK_STRIDE],
                                                s_mem[qr + 3u * QK_STRIDE]);
                            acc += s_mem[k_off + kg * QK_STRIDE + c] * q;
                        }
                        workgroupBarrier();
                    }
                    if (phase == 0u) {
                        st = acc;
                    } else {
                        dp = acc;
                    }
                }
                // P and dS of rows 4rg .. 4rg+3 with key kg, 0 where the query does not see the token.
                for (var i = 0u; i < 4u; i++) {
                    let r = 4u * rg + i;
                    let row = s_rows[r];
                    var p = 0.0;
                    var ds = 0.0;
                    if (row.x != absent && sub * keys + kg < bs
                        && p0 + kg < visible_keys((r0 + r) / group, q_len, seq_len)) {
                        p = exp(st[i] * pc.scale - row.x);
                        ds = p * (dp[i] - row.y);
                    }
                    s_mem[r * kq_count + kg / 4u][kg & 3u] = p;
                    s_mem[PD_QUADS / 2u + r * kq_count + kg / 4u][kg & 3u] = ds;
                }

                // C: dV and dK of keys 4kq .. 4kq+3, vr rows at a time.
                for (var s0 = 0u; s0 < n_rows && r0 + s0 < rows; s0 += vr) {
                    workgroupBarrier();   // P and dS are written; the previous sub-tile is used
                    for (var n = 0u; n < 4u; n++) {
                        if (tid + WG * n >= vr * hq) {
                            break;
                        }
                        let gr = r0 + s0 + sr[n];
                        let q = row_base(q_start, kv_head, gr);
                        var x = vec4<f32>(0.0);
                        var g = vec4<f32>(0.0);
                        if (s0 + sr[n] < n_rows && gr < rows && q + hs <= row_floats) {
                            x = row_quad(0u, q / 4u + sc[n]);
                            g = row_quad(1u, q / 4u + sc[n]);
                        }
                        s_mem[PD_QUADS + tid + WG * n] = x;
                        s_mem[PD_QUADS + vr * hq + tid + WG * n] = g;
                    }
                    workgroupBarrier();
                    let n = min(vr, n_rows - s0);
                    for (var r = 0u; r < n; r++) {
                        let p = s_mem[(s0 + r) * kq_count + kq];
                        let ds = s_mem[PD_QUADS / 2u + (s0 + r) * kq_count + kq];
                        let qr = PD_QUADS + r * hq;
                        let gr = PD_QUADS + (vr + r) * hq;
                        dv0 += outer(s_mem[gr + c0_], p);
                        dk0 += outer(s_mem[qr + c0_], ds);
                        if (hq > c_groups) {
                            dv1 += outer(s_mem[gr + c1_], p);
                            dk1 += outer(s_mem[qr + c1_], ds);
                        }
                    }
                }
                workgroupBarrier();   // s_mem and s_rows are rewritten by the next step
            }
        }

        for (var e = 0u; e < 4u; e++) {
            let t = sub * keys + 4u * kq + e;
            if (t >= bs) {   // past a block shorter than keys
                break;
            }
            for (var j = 0u; j < 2u; j++) {
                let c = cg + c_groups * j;
                if (c >= hq) {
                    break;
                }
                var dk = dk0[e];
                var dv = dv0[e];
                if (j == 1u) {
                    dk = dk1[e];
                    dv = dv1[e];
                }
                dk *= pc.scale;
                for (var d = 0u; d < 4u; d++) {
                    dk_cache[key_element(b, kv_head, t, 4u * c + d)] = dk[d];
                    dv_cache[b * pc.v_block_stride + value_offset(kv_head, t, 4u * c + d)] = dv[d];
                }
            }
        }
    }
}
