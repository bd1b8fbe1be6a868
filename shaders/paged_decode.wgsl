// Paged-attention decode, WGSL: shaders/paged_decode.comp translated statement for statement, with the
// same interface (PAGED_DECODE in pagedvk/abi.py) so one launcher runs either module. The algorithm and
// its bounds rules are explained in the GLSL source; comments here cover what WGSL changes.
//
// The GLSL keeps the per-head state of a workgroup's (up to 8) query heads in float[8] arrays indexed in
// loops; here each such array is two vec4s, heads 0-3 (_a) and 4-7 (_b), updated by vector arithmetic
// (paged_prefill.comp says why: naga's guarded loops are not unrolled, and a local array indexed in a loop
// becomes a chain of selects). Heads past the group are masked (their logits -inf, so their weights, sums
// and accumulators stay 0) and never written out. HEAD_SIZE is an override that build_shaders.py fixes at
// translation time; 0 means "from the push constants".

//!include kv_storage.wgsl
//!include q_storage.wgsl
//!include attention_common.wgsl
//!include kv_access.wgsl

@group(0) @binding(0) var<storage, read> query: array<QQuad>;                // [seqs, heads, head_size]
@group(0) @binding(1) var<storage, read> key_cache: array<KvQuad>;           // see key_load()
@group(0) @binding(2) var<storage, read> value_cache: array<KvQuad>;         // see value_load()
@group(0) @binding(3) var<storage, read> block_tables: array<i32>;           // [seqs, max_blocks_per_seq]
@group(0) @binding(4) var<storage, read> seq_lens: array<i32>;               // [seqs]
@group(0) @binding(5) var<storage, read_write> out: array<OutPair>;          // [seqs, heads, head_size]
@group(0) @binding(6) var<storage, read_write> partial_out: array<vec2<f32>>; // [seqs, heads, partitions, head_size]
@group(0) @binding(7) var<storage, read_write> partial_stats: array<vec2<f32>>; // [seqs, heads, partitions]: (max, sum)
var<immediate> pc: Params;

const KV_SEGMENT_BINDING: u32 = 8u;   // the first of a segmented cache's extra bindings (pagedvk/abi.py)

override HEAD_SIZE: u32 = 0u;

const MAX_GROUP: u32 = 8u;          // query heads per workgroup: two vec4s
const LOGIT_SLOTS: u32 = 4096u;     // group_size * partition_size must fit

var<workgroup> s_q: array<vec4<f32>, 512>;     // MAX_GROUP * MAX_HEAD_SIZE / 4: queries * scale, [group][quad]
var<workgroup> s_p: array<vec4<f32>, 1024>;    // LOGIT_SLOTS / 4: logits, then weights, [group][token]
var<workgroup> s_red: array<vec4<f32>, 256>;   // reduction scratch, [thread][heads 0-3 | heads 4-7]
var<workgroup> s_phys: array<i32, 512>;        // LOGIT_SLOTS / MIN_BLOCK_SIZE: the tile's physical blocks, -1 where invalid

// Reduce (*a, *b) over the workgroup, lane by lane; max when is_max, else sum.
fn workgroup_reduce(a: ptr<function, vec4<f32>>, b: ptr<function, vec4<f32>>, is_max: bool, tid: u32) {
    s_red[tid * 2u] = *a;
    s_red[tid * 2u + 1u] = *b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (tid < stride) {
            for (var h = 0u; h < 2u; h++) {
                let x = s_red[tid * 2u + h];
                let y = s_red[(tid + stride) * 2u + h];
                s_red[tid * 2u + h] = select(x + y, max(x, y), is_max);
            }
        }
        workgroupBarrier();
    }
    *a = s_red[0];
    *b = s_red[1];
    workgroupBarrier();
}

// The first n (<= 4) elements of v, the rest zero: slots past a sequence's end may hold anything, NaN
// included, and 0 * NaN is NaN.
fn first(v: vec4<f32>, n: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), v, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(n));
}

// Column j: query quad c of head g0 + j (times scale), for the dot products of a key quad with four heads.
fn queries4(g0: u32, c: u32, hq: u32) -> mat4x4<f32> {
    return mat4x4<f32>(s_q[g0 * hq + c], s_q[(g0 + 1u) * hq + c], s_q[(g0 + 2u) * hq + c], s_q[(g0 + 3u) * hq + c]);
}

// Where head g's logit or weight of token t sits in s_p ([group][token], four tokens a vec4).
fn logit_slot(g: u32, t: u32, P: u32) -> u32 {
    return (g * P + t) >> 2u;
}

// Token t's logits (or weights) of heads g0 .. g0 + 3, -inf for heads past the group.
fn load4(g0: u32, t: u32, group: u32, P: u32) -> vec4<f32> {
    var x = vec4<f32>(neg_inf());
    if (g0 < group) {
        x.x = s_p[logit_slot(g0, t, P)][t & 3u];
    }
    if (g0 + 1u < group) {
        x.y = s_p[logit_slot(g0 + 1u, t, P)][t & 3u];
    }
    if (g0 + 2u < group) {
        x.z = s_p[logit_slot(g0 + 2u, t, P)][t & 3u];
    }
    if (g0 + 3u < group) {
        x.w = s_p[logit_slot(g0 + 3u, t, P)][t & 3u];
    }
    return x;
}

// Stores token t's logits (or weights) of the heads g0 .. g0 + 3 that are in the group.
fn store4(g0: u32, t: u32, group: u32, P: u32, x: vec4<f32>) {
    if (g0 < group) {
        s_p[logit_slot(g0, t, P)][t & 3u] = x.x;
    }
    if (g0 + 1u < group) {
        s_p[logit_slot(g0 + 1u, t, P)][t & 3u] = x.y;
    }
    if (g0 + 2u < group) {
        s_p[logit_slot(g0 + 2u, t, P)][t & 3u] = x.z;
    }
    if (g0 + 3u < group) {
        s_p[logit_slot(g0 + 3u, t, P)][t & 3u] = x.w;
    }
}

// The weights of tokens t0 .. t0 + 3 for head g (zero past the group or past n tokens).
fn weights(g: u32, t0: u32, n: u32, group: u32, P: u32) -> vec4<f32> {
    if (g >= group) {
        return vec4<f32>(0.0);
    }
    return first(s_p[logit_slot(g, t0, P)], n);
}

// Column j: weights() of head g0 + j.
fn weights4(g0: u32, t0: u32, n: u32, group: u32, P: u32) -> mat4x4<f32> {
    return mat4x4<f32>(weights(g0, t0, n, group, P), weights(g0 + 1u, t0, n, group, P),
                       weights(g0 + 2u, t0, n, group, P), weights(g0 + 3u, t0, n, group, P));
}

// Dims (d, d + 1) of one token in the nhd layout: two consecutive elements of one value quad.
fn value_pair(b: u32, v: u32) -> vec2<f32> {
    let q = kv_quad(value_load(b, v >> 2u));
    return vec2<f32>(q[v & 3u], q[(v & 3u) + 1u]);
}

@compute @workgroup_size(128, 1, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let tid = lid.x;
    let hs = select(pc.head_size, HEAD_SIZE, HEAD_SIZE > 0u);
    let bs = pc.block_size;
    let group = pc.group_size;
    let P = pc.partition_size;
    let head_groups = pc.num_heads / max(group, 1u);
    let wg = workgroup_index(wid, nwg);
    let seq = (wg / head_groups) % max(pc.num_seqs, 1u);
    let part = wg / (head_groups * max(pc.num_seqs, 1u));
    if (group == 0u || group > MAX_GROUP || group * P > LOGIT_SLOTS || P == 0u || hs > MAX_HEAD_SIZE
        || part >= pc.num_partitions) {
        return;
    }
    let head0 = (wg % head_groups) * group;                   // first query head of this workgroup
    let kv_head = head0 / (pc.num_heads / pc.num_kv_heads);
    let hq = hs / 4u;                                         // quads of one head
    let q_quad0 = (seq * pc.num_heads + head0) * hq;
    if (q_quad0 + group * hq > arrayLength(&query)) {
        return;
    }

    let row = seq * pc.max_blocks_per_seq;
    let row_blocks = min(pc.max_blocks_per_seq, u32(max(i32(arrayLength(&block_tables)) - i32(row), 0)));
    var seq_len = 0u;
    if (seq < arrayLength(&seq_lens)) {
        seq_len = min(u32(max(seq_lens[seq], 0)), row_blocks * bs);
    }
    let start = part * P;                                     // first token of the partition
    let end = select(min(seq_len, start + P), seq_len, part + 1u == pc.num_partitions);

    for (var i = tid; i < group * hq; i += WG) {
        s_q[i] = q_quad(query[q_quad0 + i]) * pc.scale;
    }

    let ninf4 = vec4<f32>(neg_inf());
    // Heads of the group, as lanes of the _a and _b vectors.
    let in_a = vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(group);
    let in_b = vec4<u32>(4u, 5u, 6u, 7u) < vec4<u32>(group);
    var m_a = ninf4;
    var m_b = ninf4;
    var l_a = vec4<f32>(0.0);
    var l_b = vec4<f32>(0.0);
    var acc0_a = vec4<f32>(0.0);   // head dim d0, per head
    var acc0_b = vec4<f32>(0.0);
    var acc1_a = vec4<f32>(0.0);   // head dim d0 + 1
    var acc1_b = vec4<f32>(0.0);
    let d0 = 2u * tid;                                        // this thread's head dims: d0, d0 + 1

    for (var base = start; base < end; base += P) {
        let len = min(P, end - base);
        let blocks = (len + bs - 1u) / bs;
        workgroupBarrier();   // the previous tile's s_p and s_phys are no longer read
        for (var i = tid; i < blocks; i += WG) {
            let b = block_tables[row + base / bs + i];
            s_phys[i] = select(-1, b, b >= 0 && u32(b) < pc.num_blocks);
        }
        workgroupBarrier();

        // A: logits of whole tokens, and each thread's max per head.
        var mt_a = ninf4;
        var mt_b = ninf4;
        for (var t = tid; t < len; t += WG) {
            var s_a = vec4<f32>(0.0);
            var s_b = vec4<f32>(0.0);
            let phys = s_phys[t / bs];
            if (phys >= 0) {
                let k0 = key_offset(kv_head, t % bs, 0u);
                for (var c = 0u; c < hq; c++) {
                    let kc = kv_quad(key_load(u32(phys), k0 + (c / KV_CHUNK_QUADS) * pc.k_chunk_stride
                                                         + c % KV_CHUNK_QUADS));
                    s_a += kc * queries4(0u, c, hq);
                    if (group > 4u) {
                        s_b += kc * queries4(4u, c, hq);
                    }
                }
            }
            // The query is the sequence's last token; heads past the group and blocks outside the cache see nothing.
            let keys_a = select(vec4<u32>(0u), vec4<u32>(seq_len), in_a & vec4<bool>(phys >= 0));
            let keys_b = select(vec4<u32>(0u), vec4<u32>(seq_len), in_b & vec4<bool>(phys >= 0));
            let last = vec4<u32>(seq_len - 1u);
            let logit_a = logits4(s_a, vec4<u32>(head0) + vec4<u32>(0u, 1u, 2u, 3u), base + t, last, keys_a);
            let logit_b = logits4(s_b, vec4<u32>(head0) + vec4<u32>(4u, 5u, 6u, 7u), base + t, last, keys_b);
            store4(0u, t, group, P, logit_a);
            store4(4u, t, group, P, logit_b);
            mt_a = max(mt_a, logit_a);
            mt_b = max(mt_b, logit_b);
        }
        workgroup_reduce(&mt_a, &mt_b, true, tid);

        // B: rescale what earlier tiles accumulated to the new max; weights, each thread summing its own.
        let mn_a = max(m_a, mt_a);
        let mn_b = max(m_b, mt_b);
        let alpha_a = select(exp(m_a - mn_a), vec4<f32>(1.0), mn_a == ninf4);
        let alpha_b = select(exp(m_b - mn_b), vec4<f32>(1.0), mn_b == ninf4);
        m_a = mn_a;
        m_b = mn_b;
        l_a *= alpha_a;
        l_b *= alpha_b;
        acc0_a *= alpha_a;
        acc0_b *= alpha_b;
        acc1_a *= alpha_a;
        acc1_b *= alpha_b;
        for (var t = tid; t < len; t += WG) {
            let x_a = load4(0u, t, group, P);
            let p_a = select(exp(x_a - m_a), vec4<f32>(0.0), x_a == ninf4);
            store4(0u, t, group, P, p_a);
            l_a += p_a;
            if (group > 4u) {
                let x_b = load4(4u, t, group, P);
                let p_b = select(exp(x_b - m_b), vec4<f32>(0.0), x_b == ninf4);
                store4(4u, t, group, P, p_b);
                l_b += p_b;
            }
        }
        workgroupBarrier();

        // C: weighted values of head dims d0 and d0 + 1, four tokens at a time (tiles start on a block, and
        // blocks hold a multiple of 4 tokens, so four tokens never straddle two blocks).
        if (d0 < hs) {
            for (var t0 = 0u; t0 < len; t0 += 4u) {
                let phys = s_phys[t0 / bs];
                if (phys < 0) {
                    continue;
                }
                let n = min(4u, len - t0);
                let v0 = value_offset(kv_head, t0 % bs, d0);
                var va: vec4<f32>;   // dims d0 and d0 + 1 of the four tokens
                var vb: vec4<f32>;
                if (pc.v_token_stride == 1u) {   // vLLM's layout: a quad is four tokens of one dim
                    va = first(kv_quad(value_load(u32(phys), v0 >> 2u)), n);
                    vb = first(kv_quad(value_load(u32(phys), (v0 + pc.v_dim_stride) >> 2u)), n);
                } else {                         // nhd: a quad is four dims of one token
                    let ts = pc.v_token_stride;
                    let x0 = value_pair(u32(phys), v0);
                    var x1 = vec2<f32>(0.0);
                    var x2 = vec2<f32>(0.0);
                    var x3 = vec2<f32>(0.0);
                    if (n > 1u) {
                        x1 = value_pair(u32(phys), v0 + ts);
                    }
                    if (n > 2u) {
                        x2 = value_pair(u32(phys), v0 + 2u * ts);
                    }
                    if (n > 3u) {
                        x3 = value_pair(u32(phys), v0 + 3u * ts);
                    }
                    va = vec4<f32>(x0.x, x1.x, x2.x, x3.x);
                    vb = vec4<f32>(x0.y, x1.y, x2.y, x3.y);
                }
                let w_a = weights4(0u, t0, n, group, P);
                acc0_a += va * w_a;
                acc1_a += vb * w_a;
                if (group > 4u) {
                    let w_b = weights4(4u, t0, n, group, P);
                    acc0_b += va * w_b;
                    acc1_b += vb * w_b;
                }
            }
        }
    }
    workgroup_reduce(&l_a, &l_b, false, tid);

    for (var g = 0u; g < group; g++) {
        let head = head0 + g;
        let lo = g < 4u;
        let j = g & 3u;
        let l = select(l_b[j], l_a[j], lo);
        let inv = select(0.0, 1.0 / l, l > 0.0);
        let o = vec2<f32>(select(acc0_b[j], acc0_a[j], lo), select(acc1_b[j], acc1_a[j], lo)) * inv;
        if (pc.num_partitions == 1u) {
            let pair = ((seq * pc.num_heads + head) * hs + d0) >> 1u;
            if (d0 < hs && pair < arrayLength(&out)) {
                out[pair] = out_pair(o * pc.v_scale);
            }
        } else {
            let slot = (seq * pc.num_heads + head) * pc.num_partitions + part;
            if (slot >= arrayLength(&partial_stats) || (slot + 1u) * hs > 2u * arrayLength(&partial_out)) {
                break;
            }
            if (d0 < hs) {
                partial_out[(slot * hs + d0) >> 1u] = o;
            }
            if (tid == 0u) {
                partial_stats[slot] = vec2<f32>(select(m_b[j], m_a[j], lo), l);
            }
        }
    }
}
