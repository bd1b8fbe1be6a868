// float16 caches, written (kv_encode.glsl's KV_F16; not pack2x16float, whose rounding WGSL leaves open).
const KV_BITS: u32 = 16u;
const KV_MASK: u32 = 0xffffu;
const KV_SCALED: bool = false;
fn kv_encode(v: f32) -> u32 { return sign_bit(v, 16u) | encode_small_float(v, 10u, 15u, 0x7bffu, 0x7c00u, 0x7e00u); }
