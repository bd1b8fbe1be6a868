"""The float64 numpy forward of a Llama-family model, written for clarity: what the runner's device forward is
checked against. It reads the same host tensors (`Model.tensors`, by GGUF name) and recomputes every position of a
sequence at each call (no cache)."""

from __future__ import annotations

import numpy as np

from ..testing.reference import cache_element
from .llama import Model, ModelConfig


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, config: ModelConfig) -> np.ndarray:
    """x [n, heads, head_size] rotated at positions [n]: the first rope_dim dims of each head, in pairs (2i, 2i + 1),
    or (i, i + rope_dim / 2) for NeoX-style architectures; theta_i = rope_theta^(-2i / rope_dim)."""
    half = config.rope_dim // 2
    theta = config.rope_theta ** (-np.arange(half) * 2.0 / config.rope_dim)
    angle = positions[:, None, None] * theta                                   # [n, 1, half]
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    if config.neox:
        first, second = np.arange(half), np.arange(half) + half
    else:
        first, second = np.arange(half) * 2, np.arange(half) * 2 + 1
    a, b = x[..., first], x[..., second]
    out[..., first], out[..., second] = a * cos - b * sin, b * cos + a * sin
    return out


def forward(model: Model, tokens, kv_dtype=None, k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """Logits [n, vocab] (float64) of every position of one sequence of token ids [n], causal.

    kv_dtype: keys and values rounded to this numpy dtype before attention, as a cache of that type holds them
    (None: float64); an fp8 cache holds key / k_scale and value / v_scale (saturated), multiplied back when read.
    """
    c = model.config
    tokens = np.asarray(tokens)
    n, positions = len(tokens), np.arange(len(tokens))

    def w(name):
        return np.asarray(model.tensors[name], np.float64)

    fp8 = kv_dtype is not None and np.dtype(kv_dtype).itemsize == 1

    def kv(t, scale):
        if kv_dtype is None:
            return t
        held = cache_element(t, kv_dtype, scale).astype(np.float64)
        return held * np.float32(scale) if fp8 else held

    x = w("token_embd.weight")[tokens]
    causal = np.tril(np.ones((n, n), bool))
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        def lw(name, kind="weight"):
            return w(f"blk.{i}.{name}.{kind}")

        h = rms_norm(x, lw("attn_norm"), c.rms_eps)
        q, k, v = h @ lw("attn_q").T, h @ lw("attn_k").T, h @ lw("attn_v").T
        if c.qkv_bias:
            q, k, v = q + lw("attn_q", "bias"), k + lw("attn_k", "bias"), v + lw("attn_v", "bias")
        q = rope(q.reshape(n, c.num_heads, c.head_size), positions, c)
        k = kv(rope(k.reshape(n, c.num_kv_heads, c.head_size), positions, c), k_scale)
        v = kv(v.reshape(n, c.num_kv_heads, c.head_size), v_scale)
        attn = np.empty((n, c.num_heads, c.head_size))
        for head in range(c.num_heads):
            logits = q[:, head] @ k[:, head // group].T / np.sqrt(c.head_size)
            logits = np.where(causal, logits, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            attn[:, head] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, head // group]
        x = x + attn.reshape(n, -1) @ lw("attn_output").T
        h = rms_norm(x, lw("ffn_norm"), c.rms_eps)
        gate, up = h @ lw("ffn_gate").T, h @ lw("ffn_up").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lw("ffn_down").T
    return rms_norm(x, w("output_norm.weight"), c.rms_eps) @ np.asarray(model.lm_head, np.float64).T


def greedy(model: Model, prompt, max_new_tokens: int, kv_dtype=None, k_scale: float = 1.0,
           v_scale: float = 1.0) -> list[int]:
    """The argmax continuation of a prompt (token ids), max_new_tokens long."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(np.argmax(forward(model, tokens, kv_dtype, k_scale, v_scale)[-1])))
    return tokens[len(prompt):]
