// reshape_and_cache's key and value inputs, of the type the push constants name (pc.token_type, abi.QUERY_TYPES:
// 0 float32, 1 float16, 2 bfloat16), bound as 32-bit words: element i is word i in
// float32, half of word i / 2 in the 16-bit types. Any other code reads float32.

fn token_half() -> bool {
    return pc.token_type == 1u || pc.token_type == 2u;
}

// The word holding element i.
fn token_word(i: u32) -> u32 {
    return select(i, i >> 1u, token_half());
}

// Element i from the word holding it (bfloat16: the top half of a float32).
fn token_element(w: u32, i: u32) -> f32 {
    if (pc.token_type == 1u) {
        return unpack2x16float(w)[i & 1u];
    }
    if (pc.token_type == 2u) {
        return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
    }
    return bitcast<f32>(w);
}
