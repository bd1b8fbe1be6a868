"""The Llama family's settings and a model's weights on the host.

The architectures differ, for this runner, in how RoPE pairs a head's dims and in whether the QKV projection has a
bias. llama.cpp's GGUF converter permutes Llama's (and Mistral's) query and key weights so that rotary pairs are
adjacent dims (2i, 2i + 1: its rope type NORM, llama-model.cpp's `llama_model_rope_type`); Qwen2's are stored as
trained, pairs half a rotation apart (i, i + rot_dim / 2: NEOX).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Architecture:
    neox: bool          # rotary pairs (i, i + rot_dim / 2) instead of (2i, 2i + 1)
    qkv_bias: bool      # blk.N.attn_q/k/v.bias


ARCHITECTURES = {
    "llama": Architecture(neox=False, qkv_bias=False),
    "mistral": Architecture(neox=False, qkv_bias=False),
    "qwen2": Architecture(neox=True, qkv_bias=True),
}

# Per block, by GGUF name; blk.N.<name>.weight. The biases are read where the architecture has them.
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
QKV_BIASES = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape, from the GGUF's `{arch}.*` metadata."""
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    context_length: int
    rope_dim: int               # dims rotated per head (the first rope_dim; the rest pass through)
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool       # no `output.weight`: the logits reuse `token_embd.weight`

    @property
    def neox(self) -> bool:
        return ARCHITECTURES[self.architecture].neox

    @property
    def qkv_bias(self) -> bool:
        return ARCHITECTURES[self.architecture].qkv_bias

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


@dataclass
class Model:
    """A loaded model: its config, its tensors by GGUF name (numpy order: a matrix is [out_features, in_features];
    matrices float16, norms and biases float32) and its tokenizer (None for a file without one)."""
    config: ModelConfig
    tensors: dict
    tokenizer: object = None

    def tensor(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def layer(self, index: int, name: str, kind: str = "weight") -> np.ndarray:
        return self.tensors[f"blk.{index}.{name}.{kind}"]

    @property
    def lm_head(self) -> np.ndarray:
        """The output projection [vocab, hidden]: `output.weight`, or the embedding table where they are tied."""
        return self.tensors["token_embd.weight" if self.config.tied_embeddings else "output.weight"]
