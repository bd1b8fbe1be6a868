// fp8 e5m2 caches, written (kv_encode.glsl's KV_E5M2): saturated to 57344 (0x7b).
const KV_BITS: u32 = 8u;
const KV_MASK: u32 = 0xffu;
const KV_SCALED: bool = true;
fn kv_encode(v: f32) -> u32 { return sign_bit(v, 8u) | encode_small_float(v, 2u, 15u, 0x7bu, 0x7bu, 0x7eu); }
