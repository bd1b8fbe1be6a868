// sampling, WGSL: shaders/sampling.comp statement for statement, with the same interface (SAMPLING in
// pagedvk/kernels/catalogue.py); the GLSL source explains the algorithm. Reductions return through
// workgroupUniformLoad, so that WGSL's uniformity analysis sees the branches on them as the workgroup's.

struct Params {
    batch: u32,
    vocab: u32,
    logits_type: u32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    seed_lo: u32,
    seed_hi: u32,
    offset: u32,
    per_row: u32,
    mix_row: u32,
}

@group(0) @binding(0) var<storage, read> logits: array<u32>;
@group(0) @binding(1) var<storage, read> temperatures: array<f32>;
@group(0) @binding(2) var<storage, read> top_ks: array<i32>;
@group(0) @binding(3) var<storage, read> top_ps: array<f32>;
@group(0) @binding(4) var<storage, read> seeds: array<u32>;
@group(0) @binding(5) var<storage, read_write> tokens: array<i32>;
var<immediate> pc: Params;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;

var<workgroup> red_f: array<f32, 256>;
var<workgroup> red_u: array<u32, 256>;

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

fn logit(i: u32) -> f32 {
    let w = logits[select(i >> 1u, i, pc.logits_type == 0u)];
    var v = bitcast<f32>(w);
    if (pc.logits_type == 1u) {
        v = unpack2x16float(w)[i & 1u];
    } else if (pc.logits_type == 2u) {
        v = bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
    }
    let b = bitcast<u32>(v);
    return select(v, neg_inf(), (b & 0x7fffffffu) > 0x7f800000u);   // NaN as -inf
}

fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn pcg4d(a: vec4<u32>) -> vec4<u32> {
    var v = a * 1664525u + 1013904223u;
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    v = v ^ (v >> vec4<u32>(16u));
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    return v;
}

fn is_inf(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) == 0x7f800000u;
}

fn workgroup_sum(tid: u32, v: f32) -> f32 {
    workgroupBarrier();
    red_f[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            red_f[tid] += red_f[tid + s];
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&red_f[0]);
}

// (index, value) of the largest value; ties: the lowest index.
fn workgroup_argmax(tid: u32, v: f32, index: u32) -> u32 {
    workgroupBarrier();
    red_f[tid] = v;
    red_u[tid] = index;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            let o = red_f[tid + s];
            let oi = red_u[tid + s];
            if (o > red_f[tid] || (o == red_f[tid] && oi < red_u[tid])) {
                red_f[tid] = o;
                red_u[tid] = oi;
            }
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&red_u[0]);
}

var<workgroup> red_digits: array<f32, 1920>;   // [15][WG / 2]

// threshold_search of sampling.comp: the largest key t whose logits at or above both t and floor_key weigh at least
// `wanted`, four bits a level.
fn threshold_search(tid: u32, base: u32, floor_key: u32, wanted: f32, weighted: bool, top: f32, inv_t: f32) -> u32 {
    let half = WG / 2u;
    var found = 0u;
    for (var level = 7i; level >= 0i; level--) {
        let shift = 4u * u32(level);
        var prefix = 0u;
        if (level != 7i) {
            prefix = found >> (shift + 4u);
        }
        var part: array<f32, 15>;
        for (var d = 0u; d < 15u; d++) {
            part[d] = 0.0;
        }
        for (var i = tid; i < pc.vocab; i += WG) {
            let l = logit(base + i);
            let key = order_key(l);
            var high = 0u;
            if (level != 7i) {
                high = key >> (shift + 4u);
            }
            if (key < floor_key || high < prefix) {
                continue;
            }
            let digit = select((key >> shift) & 15u, 16u, high > prefix);
            var w = 1.0;
            if (weighted) {
                w = exp((l - top) * inv_t);
            }
            for (var d = 0u; d < 15u; d++) {
                if (digit > d) {
                    part[d] += w;
                }
            }
        }
        workgroupBarrier();
        if (tid >= half) {
            for (var d = 0u; d < 15u; d++) {
                red_digits[d * half + tid - half] = part[d];
            }
        }
        workgroupBarrier();
        if (tid < half) {
            for (var d = 0u; d < 15u; d++) {
                red_digits[d * half + tid] += part[d];
            }
        }
        workgroupBarrier();
        for (var s = WG / 4u; s > 0u; s >>= 1u) {
            if (tid < s) {
                for (var d = 0u; d < 15u; d++) {
                    red_digits[d * half + tid] += red_digits[d * half + tid + s];
                }
            }
            workgroupBarrier();
        }
        var digit = 0u;
        for (var d = 15u; d > 0u; d--) {
            if (red_digits[(d - 1u) * half] >= wanted) {
                digit = d;
                break;
            }
        }
        found |= digit << shift;
    }
    return found;
}

@compute @workgroup_size(256, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let row = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
    if (row >= pc.batch) {
        return;
    }
    let base = row * pc.vocab;
    var temperature = pc.temperature;
    if ((pc.per_row & 1u) != 0u) {
        temperature = temperatures[row];
    }
    var k_given = i32(pc.top_k);
    if ((pc.per_row & 2u) != 0u) {
        k_given = top_ks[row];
    }
    var top_p = pc.top_p;
    if ((pc.per_row & 4u) != 0u) {
        top_p = top_ps[row];
    }

    var best = neg_inf();
    var best_i = NONE;
    for (var i = tid; i < pc.vocab; i += WG) {
        let l = logit(base + i);
        if (l > best || best_i == NONE) {
            best = l;
            best_i = i;
        }
    }
    let arg = min(workgroup_argmax(tid, select(best, neg_inf(), best_i == NONE), best_i), pc.vocab - 1u);
    let top = workgroupUniformLoad(&red_f[0]);
    if (!(temperature > 0.0) || is_inf(temperature) || is_inf(top)) {
        if (tid == 0u) {
            tokens[row] = i32(arg);
        }
        return;
    }
    let inv_t = 1.0 / temperature;

    var threshold = 0u;
    if (k_given > 0 && u32(k_given) < pc.vocab) {
        threshold = threshold_search(tid, base, 0u, f32(k_given), false, top, inv_t);
    }
    if (top_p < 1.0) {
        var z = 0.0;
        for (var i = tid; i < pc.vocab; i += WG) {
            let l = logit(base + i);
            if (order_key(l) >= threshold) {
                z += exp((l - top) * inv_t);
            }
        }
        let wanted = top_p * workgroup_sum(tid, z);
        threshold = max(threshold, threshold_search(tid, base, threshold, wanted, true, top, inv_t));
    }
    var seed_lo = pc.seed_lo;
    var seed_hi = pc.seed_hi;
    if ((pc.per_row & 8u) != 0u) {
        seed_lo = seeds[2u * row];
        seed_hi = seeds[2u * row + 1u];
    }
    if (pc.mix_row != 0u) {
        seed_hi ^= row * 0x9e3779b9u + 0x7f4a7c15u;
    }
    var score = neg_inf();
    var chosen = NONE;
    for (var i = tid; i < pc.vocab; i += WG) {
        let l = logit(base + i);
        if (order_key(l) < threshold) {
            continue;
        }
        let h = pcg4d(vec4<u32>(i, pc.offset, seed_lo, seed_hi)).x;
        let u = (f32(h >> 8u) + 0.5) * (1.0 / 16777216.0);
        let s = (l - top) * inv_t - log(-log(u));
        if (s > score || chosen == NONE) {
            score = s;
            chosen = i;
        }
    }
    let token = workgroup_argmax(tid, select(score, neg_inf(), chosen == NONE), chosen);
    if (tid == 0u) {
        tokens[row] = i32(select(token, arg, token == NONE));
    }
}
