"""Reading a Llama-family GGUF file (llama.cpp's format, through its reader: PyPI `gguf`) into a `Model`: the config
from `{arch}.*` metadata, every tensor as a numpy array, and the tokenizer from `tokenizer.*`.

GGUF lists a tensor's dims innermost first (ne[0] is a row's length), so a matrix's numpy shape is (ne[1], ne[0]):
[out_features, in_features], which `pagedvk.linear` takes as is. Quantized tensors (Q4_0, Q4_1, Q8_0) and F32/BF16
matrices become float16 once, here (`pagedvk.ops.quant.dequantize`); norms and biases stay float32.
"""

from __future__ import annotations

import os

import numpy as np

from ..ops.quant import GGUF_TYPES, dequantize
from .dependencies import require
from .llama import ARCHITECTURES, LAYER_TENSORS, QKV_BIASES, Model, ModelConfig
from .tokenizer import Tokenizer

def load_model(path: str | os.PathLike, *, weight_dtype=np.float16) -> Model:
    """A Llama-family model from a GGUF file: architectures llama, mistral and qwen2.

    Parameters
    ----------
    path : str or os.PathLike
        The .gguf file.
    weight_dtype : float16 or float32, default float16
        What matrices become (quantized ones are dequantized to it).

    Returns
    -------
    Model
        Its config, tensors and tokenizer (None where the file has no `tokenizer.ggml.tokens`).

    Raises
    ------
    ValueError
        An architecture other than llama, mistral or qwen2, missing metadata or tensors, a tensor of the wrong shape
        or an unsupported type, or a tokenizer this package does not build (each named).
    ImportError
        The `gguf` package is missing (the `models` extra).
    """
    if np.dtype(weight_dtype) not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise TypeError(f"weight_dtype must be float16 or float32, got {np.dtype(weight_dtype)}")
    gguf = require("gguf")
    if not os.path.isfile(path):
        raise ValueError(f"path must be a GGUF file, got {os.fspath(path)!r} (no such file)")
    reader = gguf.GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    config = read_config(metadata, tensors, path)
    arrays = {name: tensor_array(tensors[name], np.dtype(weight_dtype), path) for name in expected_tensors(config)}
    check_shapes(config, arrays, path)
    tokenizer = Tokenizer.from_gguf_metadata(metadata) if "tokenizer.ggml.tokens" in metadata else None
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{path}: tokenizer.ggml.tokens has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{config.vocab_size} rows of token_embd.weight")
    return Model(config, arrays, tokenizer)


def read_config(metadata: dict, tensors: dict, path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: metadata {arch}.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_size = int(key("attention.key_length", hidden // heads))
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor token_embd.weight is missing")
    vocab = int(tensors["token_embd.weight"].shape[1])   # ne[1]: rows
    config = ModelConfig(
        architecture=arch, num_layers=int(key("block_count")), hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)), head_size=head_size, vocab_size=vocab,
        context_length=int(key("context_length")), rope_dim=int(key("rope.dimension_count", head_size)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in tensors)
    if int(key("attention.value_length", head_size)) != head_size:
        raise ValueError(f"{path}: {arch}.attention.value_length differs from the key length {head_size}; the "
                         "runner's cache holds one head size")
    if heads % config.num_kv_heads:
        raise ValueError(f"{path}: {arch}.attention.head_count ({heads}) is not a multiple of "
                         f"attention.head_count_kv ({config.num_kv_heads})")
    if config.rope_dim % 4 or config.rope_dim > head_size:
        raise ValueError(f"{path}: {arch}.rope.dimension_count ({config.rope_dim}) must be a multiple of 4 at most "
                         f"the head size {head_size}")
    missing = [n for n in expected_tensors(config) if n not in tensors]
    if missing:
        raise ValueError(f"{path}: tensor {missing[0]} is missing" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return config


def expected_tensors(config: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if config.tied_embeddings else ["output.weight"])
    for i in range(config.num_layers):
        names += [f"blk.{i}.{t}.weight" for t in LAYER_TENSORS]
        if config.qkv_bias:
            names += [f"blk.{i}.{t}.bias" for t in QKV_BIASES]
    return names


def expected_shapes(config: ModelConfig) -> dict:
    c = config
    shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,),
              "output.weight": (c.vocab_size, c.hidden_size)}
    per_layer = {"attn_norm.weight": (c.hidden_size,), "attn_q.weight": (c.q_size, c.hidden_size),
                 "attn_k.weight": (c.kv_size, c.hidden_size), "attn_v.weight": (c.kv_size, c.hidden_size),
                 "attn_output.weight": (c.hidden_size, c.q_size), "ffn_norm.weight": (c.hidden_size,),
                 "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                 "ffn_up.weight": (c.intermediate_size, c.hidden_size),
                 "ffn_down.weight": (c.hidden_size, c.intermediate_size),
                 "attn_q.bias": (c.q_size,), "attn_k.bias": (c.kv_size,), "attn_v.bias": (c.kv_size,)}
    for i in range(c.num_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def check_shapes(config: ModelConfig, arrays: dict, path) -> None:
    shapes = expected_shapes(config)
    for name, a in arrays.items():
        if a.shape != shapes[name]:
            raise ValueError(f"{path}: tensor {name} has shape {a.shape} (numpy order), the config wants "
                             f"{shapes[name]}")


def tensor_array(tensor, weight_dtype: np.dtype, path) -> np.ndarray:
    """A tensor's values: matrices as weight_dtype, vectors float32."""
    type_name = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    out_dtype = weight_dtype if len(shape) >= 2 else np.dtype(np.float32)
    if type_name in ("F32", "F16"):
        return np.asarray(tensor.data).reshape(shape).astype(out_dtype)
    if type_name == "BF16":   # the reader hands bfloat16 over as raw bytes: the high half of a float32
        bits = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape).astype(out_dtype)
    if type_name in GGUF_TYPES:
        # float16 rounds ggml's float32 result once; float32 holds it exactly
        return dequantize(tensor.data, type_name, shape, np.float16 if out_dtype == np.float16 else np.float32)
    raise ValueError(f"{path}: tensor {tensor.name} has type {type_name}; supported: F32, F16, BF16, "
                     f"{', '.join(GGUF_TYPES)}")
