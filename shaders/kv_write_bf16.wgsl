// bfloat16 caches, written (kv_encode.glsl's KV_BF16): the top half of a float32, rounded to nearest even.
const KV_BITS: u32 = 16u;
const KV_MASK: u32 = 0xffffu;
const KV_SCALED: bool = false;
fn kv_encode(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select((b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u, 0x7fc0u | ((b >> 16u) & 0x8000u), v != v);
}
