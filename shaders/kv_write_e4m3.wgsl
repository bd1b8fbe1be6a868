// fp8 e4m3fn caches, written (kv_encode.glsl's KV_E4M3): saturated to 448 (0x7e); 0x7f is NaN.
const KV_BITS: u32 = 8u;
const KV_MASK: u32 = 0xffu;
const KV_SCALED: bool = true;
fn kv_encode(v: f32) -> u32 { return sign_bit(v, 8u) | encode_small_float(v, 3u, 7u, 0x7eu, 0x7eu, 0x7fu); }
