// bfloat16 inputs of reshape_and_cache: element i from the word holding it (the top half of a float32).
const TOKEN_PER_WORD: u32 = 2u;
fn token_element(w: u32, i: u32) -> f32 { return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u)); }
