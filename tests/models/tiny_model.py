"""Tiny Llama-family GGUF files written with gguf.GGUFWriter for the tests: random weights, a made-up byte-level
vocabulary (GPT-2's 256 byte tokens, a few merges, ChatML's special tokens), and the host Model they hold, built here
from the written values (the quantized ones dequantized by gguf's own code), not by pagedvk's loader."""

from __future__ import annotations

import numpy as np

from pagedvk.models.llama import Model, ModelConfig
from pagedvk.models.tokenizer import byte_tokens

gguf = __import__("pytest").importorskip("gguf")

MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "1 2", "Ġa n", "Ġan d"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a tiny test model<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): the byte tokens, each merge's result, then the special tokens."""
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types


def write(path, *, arch="llama", qtype=None, tied=True, pre="smollm", layers=2, hidden=64, heads=4, kv_heads=2,
          intermediate=128, context=64, seed=0, skip=(), rope_theta=10000.0) -> Model:
    """Write a model to path; return the Model its tensors hold (float16 matrices, float32 vectors).

    qtype: None writes float16 matrices; "Q8_0", "Q4_1" or "Q4_0" quantizes them (token_embd included).
    skip: tensor names left out of the file (the returned Model has them all).
    """
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    head_size = hidden // heads
    config = ModelConfig(architecture=arch, num_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                         num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, vocab_size=len(tokens),
                         context_length=context, rope_dim=head_size, rope_theta=rope_theta,
                         rms_eps=float(np.float32(1e-5)),   # GGUF holds it as float32
                         tied_embeddings=tied)

    def matrix(rows, cols, scale=None):
        return rng.standard_normal((rows, cols)) * (scale if scale is not None else 1 / np.sqrt(cols))

    # The embedding's rows at unit scale, so that logits spread widely (greedy picks are far apart), and the layers'
    # outputs (attn_output, ffn_down) larger still, so that a tied model does not just repeat its last token.
    values = {"token_embd.weight": matrix(len(tokens), hidden, 1.0),
              "output_norm.weight": 1 + 0.1 * rng.standard_normal(hidden)}
    if not tied:
        values["output.weight"] = matrix(len(tokens), hidden, 1.0)
    q, kv = heads * head_size, kv_heads * head_size
    for i in range(layers):
        b = f"blk.{i}."
        values.update({b + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
                       b + "attn_q.weight": matrix(q, hidden), b + "attn_k.weight": matrix(kv, hidden),
                       b + "attn_v.weight": matrix(kv, hidden), b + "attn_output.weight": matrix(hidden, q, 4 / np.sqrt(q)),
                       b + "ffn_norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
                       b + "ffn_gate.weight": matrix(intermediate, hidden),
                       b + "ffn_up.weight": matrix(intermediate, hidden),
                       b + "ffn_down.weight": matrix(hidden, intermediate, 4 / np.sqrt(intermediate))})
        if arch == "qwen2":
            values.update({b + "attn_q.bias": rng.standard_normal(q), b + "attn_k.bias": rng.standard_normal(kv),
                           b + "attn_v.bias": rng.standard_normal(kv)})

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(head_size)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    held = {}
    for name, v in values.items():
        if v.ndim == 2 and qtype is not None:
            kind = gguf.GGMLQuantizationType[qtype]
            blocks = gguf.quants.quantize(v.astype(np.float32), kind)
            held[name] = gguf.quants.dequantize(blocks, kind).reshape(v.shape).astype(np.float16)
            if name not in skip:
                writer.add_tensor(name, blocks, raw_dtype=kind)
        else:
            held[name] = v.astype(np.float16 if v.ndim == 2 else np.float32)
            if name not in skip:
                writer.add_tensor(name, held[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Model(config, held)
