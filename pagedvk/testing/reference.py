"""Float64 numpy references, written for clarity, not speed. Tests and benchmarks check against these."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def gather_kv(key_cache, value_cache, block_table_row, seq_len, layout="vllm"):
    """The keys and values of one sequence, in token order, from a paged cache in `layout` (caches_as_nhd).

    key_cache, value_cache -> keys, values [seq_len, num_kv_heads, head_size]
    """
    block_size = nhd_shape(key_cache, value_cache, layout)[1]
    used = -(-seq_len // block_size)
    blocks = np.asarray(block_table_row[:used], dtype=np.int64)
    k, v = caches_as_nhd(key_cache[blocks], value_cache[blocks], layout)   # [used, block_size, kv_heads, head_size]
    return (k.reshape(-1, *k.shape[2:])[:seq_len], v.reshape(-1, *v.shape[2:])[:seq_len])


# -- the attention variants (pagedvk.ops.variants), as plain formulas over positions ---------------------------

def logits(q, k, scale, query_pos, key_pos, slope=None, logits_soft_cap=None, window_left=-1, causal=True):
    """[n, t] logits of queries q [n, d] at positions query_pos over keys k [t, d] at key_pos, -inf where a
    key is not visible: scaled, softcapped (c tanh(x / c)), plus ALiBi's slope * (key_pos - query_pos);
    visible: key_pos <= query_pos when causal, and query_pos - key_pos <= window_left when window_left >= 0."""
    x = scale * (q @ k.T)
    if logits_soft_cap:   # None or 0: off
        x = logits_soft_cap * np.tanh(x / logits_soft_cap)
    distance = np.asarray(query_pos, np.float64)[:, None] - np.asarray(key_pos, np.float64)[None, :]
    if slope is not None:
        x = x - float(slope) * distance
    seen = np.ones(x.shape, bool)
    if causal:
        seen &= distance >= 0
    if window_left >= 0:
        seen &= distance <= window_left
    return np.where(seen, x, -np.inf)


def attention(q, k, v, scale):
    """softmax(scale * q k^T) v for one query row set. q [n, d], k [t, d], v [t, d]; t == 0 gives zeros."""
    p, lse = softmax_rows(np.full((q.shape[0], 0), -np.inf) if k.shape[0] == 0 else scale * (q @ k.T))
    return p @ v, lse


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=None, alibi_slopes=None,
                    logits_soft_cap=None, sinks=None, window_left=-1, return_lse=False, layout="vllm"):
    """Decode attention: query [num_seqs, num_heads, head_size] -> out [num_seqs, num_heads, head_size], and
    with return_lse (out, lse [num_seqs, num_heads]). Each query is its sequence's last position; the variants
    as pagedvk.ops.variants defines them; caches in `layout` (caches_as_nhd)."""
    query = np.asarray(query, dtype=np.float64)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = nhd_shape(key_cache, value_cache, layout)[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    out, lse = np.zeros_like(query), np.zeros((num_seqs, num_heads))
    for s in range(num_seqs):
        n = int(seq_lens[s])
        k, v = gather_kv(key_cache, value_cache, block_tables[s], n, layout)
        for h in range(num_heads):
            x = logits(query[s, h][None], k[:, h // group], scale, [n - 1], np.arange(n),
                       None if alibi_slopes is None else alibi_slopes[h], logits_soft_cap, window_left)
            p, row_lse = softmax_rows(x, None if sinks is None else sinks[h])
            out[s, h], lse[s, h] = (p @ v[:, h // group])[0], row_lse[0]
    return (out, lse) if return_lse else out


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """FlashInfer's merge_state in float64: the attention over the union of two disjoint key sets from each
    set's output [..., head_size] and natural-log lse [...]; a part with lse -inf contributes nothing."""
    a, b = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    sa, sb = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(sa, sb)
    safe = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(sa - safe), np.exp(sb - safe)
    total = wa + wb
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where((total > 0)[..., None], (wa[..., None] * np.where(np.isfinite(sa)[..., None], a, 0)
                                                 + wb[..., None] * np.where(np.isfinite(sb)[..., None], b, 0))
                       / np.where(total > 0, total, 1.0)[..., None], 0.0)
        lse = np.where(total > 0, safe + np.log(total), -np.inf)
    return out, lse


# -- prefill and its backward: ragged batches (or q_len queries per sequence), either cache layout ---------

def nhd_views(key_cache, value_cache, layout):
    """Both caches seen as [num_blocks, block_size, num_kv_heads, head_size] ("nhd"), in their own dtype: views
    where the layout allows (vLLM's key is a reshaped copy).

    "nhd":  key and value [num_blocks, block_size, num_kv_heads, head_size]
    "hnd":  key and value [num_blocks, num_kv_heads, block_size, head_size]
    "vllm": key [num_blocks, num_kv_heads, head_size // x, block_size, x], value [num_blocks, num_kv_heads,
            head_size, block_size]
    """
    k, v = np.asarray(key_cache), np.asarray(value_cache)
    if layout == "nhd":
        return k, v
    if layout == "hnd":
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    num_blocks, num_kv_heads, head_chunks, block_size, x = k.shape
    return (k.transpose(0, 3, 1, 2, 4).reshape(num_blocks, block_size, num_kv_heads, head_chunks * x),
            v.transpose(0, 3, 1, 2))


def nhd_shape(key_cache, value_cache, layout) -> tuple:
    """[num_blocks, block_size, num_kv_heads, head_size] of caches in `layout` (nothing copied)."""
    return (len(key_cache),) + nhd_views(key_cache[:1], value_cache[:1], layout)[0].shape[1:]


def caches_as_nhd(key_cache, value_cache, layout):
    """Both caches as float64 [num_blocks, block_size, num_kv_heads, head_size] ("nhd"), from any layout
    (nhd_views)."""
    return tuple(a.astype(np.float64) for a in nhd_views(key_cache, value_cache, layout))


def nhd_as_cache(k, v, layout, key_shape):
    """The inverse of caches_as_nhd: [num_blocks, block_size, num_kv_heads, head_size] arrays in `layout`."""
    if layout == "nhd":
        return k, v
    if layout == "hnd":
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    num_blocks, num_kv_heads, head_chunks, block_size, x = key_shape
    return (k.reshape(num_blocks, block_size, num_kv_heads, head_chunks, x).transpose(0, 2, 3, 1, 4),
            v.transpose(0, 2, 3, 1))


def token_slots(block_table_row, seq_len, block_size):
    """(physical block, offset in block) of each of a sequence's seq_len tokens."""
    pos = np.arange(seq_len)
    return np.asarray(block_table_row, np.int64)[pos // block_size], pos % block_size


def visible(q_len, seq_len, causal):
    """[q_len, seq_len] mask: the queries are the sequence's last q_len tokens, so with causal masking
    query i sees keys 0 .. seq_len - q_len + i."""
    if not causal:
        return np.ones((q_len, seq_len), bool)
    return np.arange(seq_len)[None, :] <= seq_len - q_len + np.arange(q_len)[:, None]


def softmax_rows(logits, sink=None):
    """(probabilities, log-sum-exp) of each row of logits, -inf where masked; a row with no visible key
    gives zero probabilities and lse -inf. sink: one more logit in every row's denominator, with no value
    (attention sinks): it lowers the probabilities and joins the lse."""
    m = logits.max(axis=1, keepdims=True, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, float(sink))
    seen = ~np.isneginf(m)   # a NaN logit makes its row NaN, its lse too
    p = np.exp(logits - np.where(seen, m, 0.0))
    denom = p.sum(axis=1, keepdims=True) + (np.exp(float(sink) - np.where(seen, m, 0.0)) if sink is not None else 0)
    denom = np.where(seen, denom, 1.0)
    return p / denom, np.where(seen, m + np.log(denom), -np.inf)[:, 0]


def ragged_query(query, query_start_loc=None):
    """(query as float64 [num_tokens, num_heads, head_size], query_start_loc, unflatten) from either query form:
    ragged with query_start_loc, or [num_seqs, num_heads, q_len, head_size] (q_len queries per sequence).
    unflatten(x) turns a ragged result [num_tokens, num_heads, ...] back into the query's form."""
    q = np.asarray(query, np.float64)
    if query_start_loc is not None:
        return q, np.asarray(query_start_loc, np.int64), lambda x: x
    num_seqs, num_heads, q_len, head_size = q.shape

    def unflatten(x):
        return np.ascontiguousarray(x.reshape(num_seqs, q_len, num_heads, *x.shape[2:]).swapaxes(1, 2))
    return (q.transpose(0, 2, 1, 3).reshape(num_seqs * q_len, num_heads, head_size),
            np.arange(num_seqs + 1) * q_len, unflatten)


def paged_attention_prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, scale=None,
                            causal=True, layout="vllm", alibi_slopes=None, logits_soft_cap=None, sinks=None,
                            window_left=-1):
    """Ragged query [num_tokens, num_heads, head_size] with query_start_loc [num_seqs + 1] (sequence s owns tokens
    query_start_loc[s] .. query_start_loc[s + 1] - 1, its last positions), or query [num_seqs, num_heads, q_len,
    head_size] -> (out like query, lse like query without head_size). lse is the natural-log sum of
    exp(logit) over the keys a query sees, and its sink (-inf, with zeros out, if none); the variants as
    pagedvk.ops.variants defines them."""
    q, loc, unflatten = ragged_query(query, query_start_loc)
    num_heads, head_size = q.shape[1], q.shape[2]
    k_nhd, v_nhd = caches_as_nhd(key_cache, value_cache, layout)
    block_size, num_kv_heads = k_nhd.shape[1], k_nhd.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    out, lse = np.zeros_like(q), np.zeros(q.shape[:2])
    for s in range(len(loc) - 1):
        n, rows = int(seq_lens[s]), slice(loc[s], loc[s + 1])
        blocks, offsets = token_slots(block_tables[s], n, block_size)
        k, v = k_nhd[blocks, offsets], v_nhd[blocks, offsets]        # [n, num_kv_heads, head_size]
        q_len = loc[s + 1] - loc[s]
        for h in range(num_heads):
            x = logits(q[rows, h], k[:, h // group], scale, n - q_len + np.arange(q_len), np.arange(n),
                       None if alibi_slopes is None else alibi_slopes[h], logits_soft_cap, window_left, causal)
            p, lse[rows, h] = softmax_rows(x, None if sinks is None else sinks[h])
            out[rows, h] = p @ v[:, h // group]
    return unflatten(out), unflatten(lse)


def paged_attention_backward(dout, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None,
                             scale=None, causal=True, layout="vllm"):
    """Gradients of sum(dout * out) for out = paged_attention_prefill(...): (dq like query, dk_cache and
    dv_cache like the caches); query and dout in either form. Tokens of a physical block that several sequences
    read add up; blocks and slots nobody reads get zero. Probabilities are recomputed here in float64
    (FlashAttention's backward: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = scale dS K,
    dK = scale dS^T Q)."""
    q, loc, unflatten = ragged_query(query, query_start_loc)
    do = ragged_query(dout, query_start_loc)[0]
    num_heads, head_size = q.shape[1], q.shape[2]
    k_nhd, v_nhd = caches_as_nhd(key_cache, value_cache, layout)
    block_size, num_kv_heads = k_nhd.shape[1], k_nhd.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    dq, dk_nhd, dv_nhd = np.zeros_like(q), np.zeros_like(k_nhd), np.zeros_like(v_nhd)
    for s in range(len(loc) - 1):
        n, rows = int(seq_lens[s]), slice(loc[s], loc[s + 1])
        blocks, offsets = token_slots(block_tables[s], n, block_size)
        k, v = k_nhd[blocks, offsets], v_nhd[blocks, offsets]
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        mask = visible(loc[s + 1] - loc[s], n, causal)
        for h in range(num_heads):
            kh = h // group
            p, _ = softmax_rows(np.where(mask, scale * (q[rows, h] @ k[:, kh].T), -np.inf))
            dp = do[rows, h] @ v[:, kh].T
            ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))     # rowsum(P dP) == rowsum(dO * O)
            dq[rows, h] = scale * ds @ k[:, kh]
            dk[:, kh] += scale * ds.T @ q[rows, h]
            dv[:, kh] += p.T @ do[rows, h]
        np.add.at(dk_nhd, (blocks, offsets), dk)
        np.add.at(dv_nhd, (blocks, offsets), dv)
    return (unflatten(dq),) + nhd_as_cache(dk_nhd, dv_nhd, layout, np.shape(key_cache))


def cache_element(x, dtype, scale=1.0):
    """What a cache of `dtype` stores for x: fp8 stores x / scale (divided in float32, as vLLM does), rounded
    to nearest even and saturated to the type's largest finite value (vLLM's __NV_SATFINITE); the others
    store x rounded to nearest even (float16 and bfloat16 overflow to infinity)."""
    x = np.asarray(x, np.float32)
    dtype = np.dtype(dtype)
    if dtype.itemsize == 1:
        largest = np.float32(ml_dtypes.finfo(dtype).max)
        # A float64 quotient rounded to float32 is the correctly rounded float32 quotient.
        x = np.clip((x.astype(np.float64) / np.float64(np.float32(scale))).astype(np.float32), -largest, largest)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layout="vllm", k_scale=1.0, v_scale=1.0,
                      dtype=None):
    """Copies of the caches with token i's key and value [num_kv_heads, head_size] in slot slot_mapping[i]
    (block slot // block_size, offset slot % block_size); negative slots and slots past the caches are
    skipped. dtype: the element type the caches hold (default their own; fp8 for uint8 caches)."""
    kc, vc = np.array(key_cache), np.array(value_cache)
    dtype = kc.dtype if dtype is None else np.dtype(dtype)
    slots = np.asarray(slot_mapping, np.int64)
    num_blocks, block_size = nhd_shape(kc, vc, layout)[:2]
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    b, t = slots[keep] // block_size, slots[keep] % block_size
    k = cache_element(np.asarray(key)[keep], dtype, k_scale).view(kc.dtype)
    v = cache_element(np.asarray(value)[keep], dtype, v_scale).view(vc.dtype)
    if layout != "vllm":   # nhd_views are views of these two: written through
        kn, vn = nhd_views(kc, vc, layout)
        kn[b, t], vn[b, t] = k, v
    else:   # transposed views, written through: key [blocks, block_size, heads, head_size // x, x]
        kc.transpose(0, 3, 1, 2, 4)[b, t] = k.reshape(len(k), kc.shape[1], kc.shape[2], kc.shape[4])
        vc.transpose(0, 3, 1, 2)[b, t] = v
    return kc, vc


# -- the layer's other ops (pagedvk.ops.layer_ops) --------------------------------------------------------------------

def embedding(token_ids, weight):
    """The rows of weight [vocab_size, hidden_size] that token_ids name: token_ids.shape + (hidden_size,)."""
    return np.asarray(weight, np.float64)[np.asarray(token_ids, np.int64)]


def rms_norm(x, weight, epsilon):
    """x / sqrt(mean(x^2) + epsilon) * weight over the last axis."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon) * np.asarray(weight, np.float64)


def fused_add_rms_norm(x, residual, weight, epsilon):
    """(normalized, residual after): the residual x + residual rounded to residual's dtype (as the op stores it),
    and the rms_norm of that rounded sum (as the op normalizes what it stored)."""
    dtype = np.asarray(residual).dtype
    summed = (np.asarray(x, np.float64) + np.asarray(residual, np.float64)).astype(dtype).astype(np.float64)
    return rms_norm(summed, weight, epsilon), summed


def silu_and_mul(x):
    """silu(x[..., :d]) * x[..., d:], silu(a) = a / (1 + exp(-a))."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1] // 2
    a, b = x[..., :d], x[..., d:]
    return a / (1.0 + np.exp(-a)) * b


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """(query, key) rotated (vLLM's rotary_embedding), in their shapes; key None gives None. Rotation i < rot_dim / 2
    pairs dims (i, i + rot_dim / 2) with is_neox, (2i, 2i + 1) without, by cos_sin_cache[position, i] and
    cos_sin_cache[position, rot_dim / 2 + i]; dims from rot_dim on are left as they are."""
    table = np.asarray(cos_sin_cache, np.float64)[np.asarray(positions, np.int64)]   # [tokens, rot_dim]
    rot_dim = table.shape[1]
    half = rot_dim // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    first = np.arange(half) if is_neox else np.arange(0, rot_dim, 2)
    second = first + half if is_neox else first + 1

    def rotate(x):
        if x is None:
            return None
        shape = np.shape(x)
        x = np.array(x, np.float64).reshape(shape[0], -1, head_size)
        x1, x2 = x[..., first].copy(), x[..., second].copy()
        x[..., first] = x1 * cos - x2 * sin
        x[..., second] = x2 * cos + x1 * sin
        return x.reshape(shape)

    return rotate(query), rotate(key)


# -- the model's other layers ---------------------------------------------------------------------------------

def linear(x, weight, bias=None):
    """y = x @ weight.T + bias in float64: x [tokens, in_features], weight [out_features, in_features]."""
    y = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    return y + np.asarray(bias, np.float64) if bias is not None else y


def sampling_probabilities(logits, temperature=1.0, top_k=0, top_p=1.0):
    """float64 [batch, vocab]: the distribution each row's token is drawn from (pagedvk.sample), zero outside the
    kept tokens. Per row (scalars serve every row): NaN as -inf; temperature 0 puts everything on the first largest
    logit; else top-k keeps the logits >= the k-th largest (0, -1 or k >= vocab: all), then top-p keeps the fewest
    most probable of those whose probabilities (softmax of logits / temperature over the kept) sum to at least
    top_p, and every token as probable as the last of them."""
    x = np.asarray(logits, np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    batch, vocab = x.shape
    per_row = [np.broadcast_to(np.asarray(a), (batch,)) for a in (temperature, top_k, top_p)]
    out = np.zeros_like(x)
    for r, (t, k, p) in enumerate(zip(*per_row)):
        row = x[r]
        if t == 0:
            out[r, np.argmax(row)] = 1.0
            continue
        keep = np.ones(vocab, bool)
        if 0 < k < vocab:
            keep = row >= np.sort(row)[::-1][k - 1]
        probs = np.where(keep, np.exp((row - row.max()) / float(t)), 0.0)
        probs /= probs.sum()
        if p < 1:
            ordered = np.sort(probs)[::-1]
            last = min(int(np.searchsorted(np.cumsum(ordered), p)), vocab - 1)   # the first prefix reaching p
            probs = np.where(probs >= ordered[last], probs, 0.0)
            probs /= probs.sum()
        out[r] = probs
    return out
