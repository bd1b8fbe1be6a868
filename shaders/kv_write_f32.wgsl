// float32 caches, written (kv_encode.glsl's KV_F32): pasted for `//!include kv_write.wgsl`.
const KV_BITS: u32 = 32u;
const KV_MASK: u32 = 0xffffffffu;
const KV_SCALED: bool = false;
fn kv_encode(v: f32) -> u32 { return bitcast<u32>(v); }
