// Paged-attention backward, the key and value gradients, WGSL: shaders/paged_backward_dkdv.comp
// translated statement for statement, with the same interface (PAGED_BACKWARD_DKDV in pagedvk/abi.py).
// The algorithm is explained there and in attention_common.glsl; build_shaders.py pastes the storage files,
// the cache access and the common parts.

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include kv_access.wgsl
//!include cache_elements.wgsl
//!include prefill_common.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;             // [tokens, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;        // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;      // see value_load()
@group(0) @binding(3) var<storage, read> block_readers: array<i32>;        // see PAGED_BACKWARD_DKDV
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;             // [seqs]
@group(0) @binding(5) var<storage, read> query_start_loc: array<i32>;     // [seqs + 1]
@group(0) @binding(6) var<storage, read> dout: array<QQuad>;              // like query
@group(0) @binding(7) var<storage, read> out: array<QQuad>;               // like query
@group(0) @binding(8) var<storage, read> lse: array<f32>;                  // [tokens, heads]
@group(0) @binding(9) var<storage, read_write> dk_cache: array<f32>;       // float32, key_cache's shape
@group(0) @binding(10) var<storage, read_write> dv_cache: array<f32>;      // float32, value_cache's shape
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 11u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

const KEYS: u32 = 8u;               // block tokens per workgroup: two vec4s (_a, _b) in the accumulators
const ROWS: u32 = 16u;              // query rows per step: one (row, key) pair per thread in A
const PAIRS: u32 = 128u;            // ROWS * KEYS == WG

var<workgroup> s_p: array<f32, PAIRS>;     // [row][key]: P
var<workgroup> s_dd: array<f32, PAIRS>;    // [row][key]: dP - D
// The staged keys and values (phase S of the GLSL source), [token][head quad]: 16 KiB with s_p and s_dd.
const STAGED_HEAD_SIZE: u32 = 240u;
const STAGED_QUADS: u32 = 480u;            // KEYS * STAGED_HEAD_SIZE / 4
var<workgroup> s_k: array<vec4<f32>, STAGED_QUADS>;
var<workgroup> s_v: array<vec4<f32>, STAGED_QUADS>;

fn s_p4(i: u32) -> vec4<f32> {
    return vec4<f32>(s_p[i], s_p[i + 1u], s_p[i + 2u], s_p[i + 3u]);
}

fn s_dd4(i: u32) -> vec4<f32> {
    return vec4<f32>(s_dd[i], s_dd[i + 1u], s_dd[i + 2u], s_dd[i + 3u]);
}

// Where key element (b, h, t, d) sits in an array of key_cache's shape (dk_cache).
fn key_element(b: u32, h: u32, t: u32, d: u32) -> u32 {
    return (b * pc.k_block_stride + key_offset(h, t, d >> 2u)) * 4u + (d & 3u);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let kv_head = wid.y;
    let sub = wid.z;
    let hs = pc.head_size;
    let hc = hs / 4u;
    let bs = pc.block_size;
    let group = pc.num_heads / pc.num_kv_heads;
    let max_blocks = pc.max_blocks_per_seq;
    if (hs > MAX_HEAD_SIZE || (sub + 1u) * KEYS > bs) {
        return;
    }

    let num_blocks = pc.num_blocks;   // see attention_common.glsl
    let row_floats = min(min(arrayLength(&query), arrayLength(&dout)), arrayLength(&out)) * 4u;
    let first_entry = pc.num_blocks + 1u;
    let entries = u32(max(i32(arrayLength(&block_readers)) - i32(first_entry), 0));

    let pr = tid / KEYS;   // phase A's pair: row pr, key pk
    let pk = tid % KEYS;
    let d0 = tid;
    let d1 = tid + WG;
    let staged = hs <= STAGED_HEAD_SIZE;

    for (var b = wid.x; b < num_blocks; b += nwg.x) {
        var dk0_a = vec4<f32>(0.0);
        var dk0_b = vec4<f32>(0.0);
        var dk1_a = vec4<f32>(0.0);
        var dk1_b = vec4<f32>(0.0);
        var dv0_a = vec4<f32>(0.0);
        var dv0_b = vec4<f32>(0.0);
        var dv1_a = vec4<f32>(0.0);
        var dv1_b = vec4<f32>(0.0);
        var e_begin = 0u;
        var e_end = 0u;
        if (b + 1u < arrayLength(&block_readers)) {
            e_begin = min(u32(max(block_readers[b], 0)), entries);
            e_end = min(u32(max(block_readers[b + 1u], 0)), entries);
        }
        if (staged && e_begin < e_end) {   // S (uniform)
            workgroupBarrier();
            for (var i = tid; i < KEYS * hc; i += WG) {
                let t = sub * KEYS + i / hc;
                let c = i % hc;
                s_k[i] = kv_quad(key_load(b, key_offset(kv_head, t, c)));
                s_v[i] = value_quad(b, kv_head, t, c);
            }
            workgroupBarrier();
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
            let p0 = slot * bs + sub * KEYS;
            if (p0 >= seq_len) {
                continue;
            }
            var i_first = 0u;
            if (pc.causal != 0u) {
                i_first = u32(clamp(i32(p0) - (i32(seq_len) - i32(q_len)), 0, i32(q_len)));
            }

            for (var r0 = i_first * group; r0 < rows; r0 += ROWS) {
                // A: P and dP - D of pair (pr, pk), 0 where the query does not see the token.
                let gr = r0 + pr;
                let q = row_base(q_start, kv_head, gr);
                let token = sub * KEYS + pk;
                var p = 0.0;
                var dd = 0.0;
                if (gr < rows && p0 + pk < visible_keys(gr / group, q_len, seq_len) && q + hs <= row_floats
                        && q / hs < arrayLength(&lse)) {
                    var x = 0.0;
                    var s = 0.0;
                    var t = 0.0;
                    for (var c = 0u; c < hc; c++) {
                        var k = s_k[min(pk * hc + c, STAGED_QUADS - 1u)];
                        var v = s_v[min(pk * hc + c, STAGED_QUADS - 1u)];
                        if (!staged) {
                            k = kv_quad(key_load(b, key_offset(kv_head, token, c)));
                            v = value_quad(b, kv_head, token, c);
                        }
                        let g = q_quad(dout[q / 4u + c]);
                        x += dot(q_quad(query[q / 4u + c]), k);
                        s += dot(g, v);
                        t += dot(g, q_quad(out[q / 4u + c]));
                    }
                    p = exp(x * pc.scale - lse[q / hs]);
                    dd = s - t;
                }
                s_p[tid] = p;
                s_dd[tid] = dd;
                workgroupBarrier();

                // C: this thread's head dims of dV and dK, for the KEYS tokens.
                for (var r = 0u; r < ROWS; r++) {
                    let qr = row_base(q_start, kv_head, r0 + r);
                    if (r0 + r >= rows || qr + hs > row_floats) {
                        break;
                    }
                    let i = r * KEYS;
                    let p_a = s_p4(i);
                    let p_b = s_p4(i + 4u);
                    let ds_a = p_a * s_dd4(i);
                    let ds_b = p_b * s_dd4(i + 4u);
                    let c0 = qr / 4u + d0 / 4u;
                    let c1 = qr / 4u + d1 / 4u;
                    var q0 = 0.0;
                    var g0 = 0.0;
                    var q1 = 0.0;
                    var g1 = 0.0;
                    if (d0 < hs) {
                        q0 = q_quad(query[c0])[d0 % 4u];
                        g0 = q_quad(dout[c0])[d0 % 4u];
                    }
                    if (d1 < hs) {
                        q1 = q_quad(query[c1])[d1 % 4u];
                        g1 = q_quad(dout[c1])[d1 % 4u];
                    }
                    dv0_a += p_a * g0;
                    dv0_b += p_b * g0;
                    dk0_a += ds_a * q0;
                    dk0_b += ds_b * q0;
                    if (hs > WG) {
                        dv1_a += p_a * g1;
                        dv1_b += p_b * g1;
                        dk1_a += ds_a * q1;
                        dk1_b += ds_b * q1;
                    }
                }
                workgroupBarrier();
            }
        }

        for (var k = 0u; k < KEYS; k++) {
            let token = sub * KEYS + k;
            let lo = k < 4u;
            if (d0 < hs) {
                dk_cache[key_element(b, kv_head, token, d0)] = pc.scale * select(dk0_b[k % 4u], dk0_a[k % 4u], lo);
                dv_cache[b * pc.v_block_stride + value_offset(kv_head, token, d0)] = select(dv0_b[k % 4u], dv0_a[k % 4u], lo);
            }
            if (d1 < hs) {
                dk_cache[key_element(b, kv_head, token, d1)] = pc.scale * select(dk1_b[k % 4u], dk1_a[k % 4u], lo);
                dv_cache[b * pc.v_block_stride + value_offset(kv_head, token, d1)] = select(dv1_b[k % 4u], dv1_a[k % 4u], lo);
            }
        }
    }
}
