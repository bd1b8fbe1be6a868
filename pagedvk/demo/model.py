"""A small decoder-only transformer in float64 numpy (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, greedy decoding), for the demo. Attention is a call the caller passes in, so the same weights run
over a dense per-sequence KV store (the reference, here) or a paged cache on a device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..testing import reference


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_size", "intermediate"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_size % 2:
            raise ValueError(f"head_size must be even (rotary pairs), got {self.head_size}")


class Model:
    """Weights drawn from config.seed. forward() runs one batch of tokens of several sequences.

    attention(layer, q, k, v) -> out is the pluggable part: q [n, heads, head_size], k and v [n, kv_heads,
    head_size] (float64, rotary applied) are the batch's new tokens; it must store k and v for later steps and
    return out [n, heads, head_size], each token attending causally to its own sequence's keys so far.
    """

    def __init__(self, config: ModelConfig = ModelConfig()):
        self.config = c = config
        rng = np.random.default_rng(c.seed)

        def w(*shape):
            return rng.standard_normal(shape) / np.sqrt(shape[0])

        self.embed = rng.standard_normal((c.vocab, c.hidden))
        self.layer_weights = [dict(wq=w(c.hidden, c.heads * c.head_size), wk=w(c.hidden, c.kv_heads * c.head_size),
                                   wv=w(c.hidden, c.kv_heads * c.head_size), wo=w(c.heads * c.head_size, c.hidden),
                                   gate=w(c.hidden, c.intermediate), up=w(c.hidden, c.intermediate),
                                   down=w(c.intermediate, c.hidden))
                              for _ in range(c.layers)]
        self.lm_head = w(c.hidden, c.vocab)
        self.inv_freq = c.rope_theta ** (-np.arange(0, c.head_size, 2) / c.head_size)

    def forward(self, tokens, positions, attention) -> np.ndarray:
        """tokens, positions int [n] -> logits float64 [n, vocab]."""
        c = self.config
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        if tokens.ndim != 1 or tokens.shape != positions.shape:
            raise ValueError(f"tokens and positions must be 1-d of one length, got {tokens.shape}, {positions.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= c.vocab):
            raise ValueError(f"tokens must be in [0, {c.vocab}), got [{tokens.min()}, {tokens.max()}]")
        n, x = len(tokens), self.embed[tokens]
        for layer, lw in enumerate(self.layer_weights):
            h = rms_norm(x)
            q = self.rope((h @ lw["wq"]).reshape(n, c.heads, c.head_size), positions)
            k = self.rope((h @ lw["wk"]).reshape(n, c.kv_heads, c.head_size), positions)
            v = (h @ lw["wv"]).reshape(n, c.kv_heads, c.head_size)
            x = x + attention(layer, q, k, v).reshape(n, -1) @ lw["wo"]
            h = rms_norm(x)
            gate = h @ lw["gate"]
            x = x + (gate / (1 + np.exp(-gate)) * (h @ lw["up"])) @ lw["down"]
        return rms_norm(x) @ self.lm_head

    def rope(self, t, positions):
        """Rotary embedding (GPT-NeoX halves) of t [n, heads, head_size] at positions [n]."""
        angle = positions[:, None, None] * self.inv_freq                  # [n, 1, head_size / 2]
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = np.split(t, 2, axis=-1)
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rms_norm(x, eps=1e-6):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def causal_attention(q, k, v):
    """The last q_len = len(q) of t = len(k) tokens attending causally: q [q_len, heads, d], k and v
    [t, kv_heads, d] -> [q_len, heads, d], float64."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    mask = reference.visible(len(q), len(k), causal=True)
    out = np.empty(q.shape)
    for h in range(heads):
        logits = q[:, h] @ k[:, h // group].T / np.sqrt(q.shape[-1])
        p, _ = reference.softmax_rows(np.where(mask, logits, -np.inf))
        out[:, h] = p @ v[:, h // group]
    return out


class DenseKV:
    """The reference attention for one sequence: its full keys and values per layer, kept in numpy (rounded to
    `storage`, a numpy dtype, when given: what a cache of that type holds)."""

    def __init__(self, layers: int, storage=None):
        self.k, self.v = [None] * layers, [None] * layers
        self.storage = storage

    def __call__(self, layer, q, k, v):
        if self.storage is not None:
            k, v = rounded(k, self.storage), rounded(v, self.storage)
        self.k[layer] = k if self.k[layer] is None else np.concatenate([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else np.concatenate([self.v[layer], v])
        return causal_attention(q, self.k[layer], self.v[layer])


def rounded(x, dtype) -> np.ndarray:
    """x rounded to `dtype` and back to float64."""
    return np.asarray(x).astype(dtype).astype(np.float64)


def generate_dense(model: Model, prompt, max_new: int, first_rank: int = 0, storage=None) -> list[int]:
    """Greedy generation with the dense reference: the first new token is the `first_rank`-th most likely
    (0: the argmax; parallel samples of one prompt differ by it), the rest the argmax. storage: keys and
    values rounded to this dtype, as a cache of it holds them (None: float64)."""
    kv, prompt = DenseKV(model.config.layers, storage), list(prompt)
    logits = model.forward(prompt, np.arange(len(prompt)), kv)[-1]
    out = [pick(logits, first_rank)]
    while len(out) < max_new:
        logits = model.forward([out[-1]], [len(prompt) + len(out) - 1], kv)[-1]
        out.append(pick(logits, 0))
    return out


def pick(logits, rank: int) -> int:
    """The rank-th most likely token of logits [vocab] (ties to the lower id)."""
    return int(np.argsort(-logits, kind="stable")[rank])
