// float32 inputs of reshape_and_cache (kv_encode.glsl's TOKEN_ELEMENT): element i from the word holding it.
const TOKEN_PER_WORD: u32 = 1u;
fn token_element(w: u32, i: u32) -> f32 { return bitcast<f32>(w); }
