// fp8 e4m3fn caches (kv_storage.glsl's KV_E4M3, which explains the decoding): 4 exponent bits (bias 7),
// 3 mantissa bits, no infinities, 0x7f / 0xff NaN. Exponent and mantissa one bit below e5m2's places give a
// float16 of 2^-8 the value, subnormals included; a NaN byte's magnitude plus one carries into its top bit,
// spread over the float16's exponent.
alias KvQuad = u32;
const KV_CHUNK_QUADS: u32 = 4u;

fn e4m3_as_f16x2(pair: u32) -> u32 {   // two bytes at e5m2's places (bits 8-15, 24-31) to float16 bits
    let nan_exponents = (((pair & 0x7f007f00u) + 0x01000100u) & 0x80008000u) >> 5u;   // bits 10, 26
    return (pair & 0x80008000u) | ((pair >> 1u) & 0x3f803f80u) | (nan_exponents * 0x1fu);
}

fn kv_quad(w: KvQuad) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(e4m3_as_f16x2(((w & 0xffu) << 8u) | ((w & 0xff00u) << 16u))),
                     unpack2x16float(e4m3_as_f16x2(((w >> 8u) & 0xff00u) | (w & 0xff000000u)))) * 256.0;
}

// Quad i (0 to 3) of a 16-byte chunk (kv_chunk_bound.wgsl).
fn chunk_quad(w: vec4<u32>, i: u32) -> vec4<f32> {
    return kv_quad(w[i]);
}
