// float16 inputs of reshape_and_cache: element i from the word holding it.
const TOKEN_PER_WORD: u32 = 2u;
fn token_element(w: u32, i: u32) -> f32 { return unpack2x16float(w)[i & 1u]; }
