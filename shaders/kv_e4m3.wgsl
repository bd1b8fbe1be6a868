// fp8 e4m3fn caches (kv_storage.glsl's KV_E4M3, which explains the decoding): 4 exponent bits (bias 7),
// 3 mantissa bits, no infinities, 0x7f / 0xff NaN. Moved into a float16's bit positions its value is
// 2^-8 of the real one, subnormals included.
alias KvQuad = u32;
const KV_CHUNK_QUADS: u32 = 4u;

fn e4m3x2(w: u32) -> vec2<f32> {   // bytes 0 and 1 of w
    let h = ((w & 0x7fu) << 7u) | ((w & 0x80u) << 8u) | ((w & 0x7f00u) << 15u) | ((w & 0x8000u) << 16u);
    let v = unpack2x16float(h) * 256.0;
    let nan = bitcast<f32>(NAN_BITS);
    return vec2<f32>(select(v.x, nan, (w & 0x7fu) == 0x7fu), select(v.y, nan, (w & 0x7f00u) == 0x7f00u));
}

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(e4m3x2(w), e4m3x2(w >> 16u));
}

// Quad i (0 to 3) of a 16-byte chunk (kv_chunk_bound.wgsl).
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(w[i]);
}
