"""A Llama-family model run on the device over a KVCache: prefill of the prompts, then decode steps, each step one
recorded submission. The host hands in token ids and reads back the sampled ids, nothing else.

Weights go to the device once, as float16 (or the model's dtype): the query, key and value projections fused into one
[q + k + v, hidden] matrix (one linear; the cache write, the rotary embedding and the attention read its column
slices where they lie), the gate and up projections into one [2 * intermediate, hidden] matrix (one linear, then
silu_and_mul). Activations are float32: the ops compute in float32 anyway, and a float16 residual stream would round
each layer's sum.

A step over n tokens (prefill: every prompt token; decode: one per sequence):

    residual = embedding(ids)
    per layer:  x = rms_norm(residual) (the first) or fused_add_rms_norm(x, residual) (the others: residual += x)
                qkv = linear(x, w_qkv) (+ bias); rotary_embedding(q, k); cache.write(k, v, slots)
                attn = attention(q, cache)            prefill: a PrefillPlan (queued); decode: a DecodePlan (recorded)
                x = linear(attn, w_o); fused_add_rms_norm(x, residual)
                x = linear(silu_and_mul(linear(x, w_gate_up)), w_down)
    x = fused_add_rms_norm(x, residual)               the output norm
    ids = sample(linear(x[last rows], lm_head))        decode's ids: the next step's input, on the device

Prefill is queued op by op: `PrefillPlan.run` cannot be recorded (pagedvk.record refuses it), and a prompt is
prefilled once. Decode records its ops once per batch and replays them each step, positions, slots, block tables and
lengths written in place; the sampled ids written by one replay are the next replay's input ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engine.cache import KVCache
from ..errors import ClosedError
from ..ops import checks
from ..ops.layer_ops import (embedding, fused_add_rms_norm, rms_norm, rope_cos_sin_cache, rotary_embedding,
                             silu_and_mul)
from ..ops.linear import linear
from ..ops.sampling import sample
from ..runtime.array import DeviceArray, asarray, empty
from ..runtime.owned import Owned
from ..runtime.recording import record
from ..runtime.selection import DeviceLike, get_device
from .llama import Model

ACTIVATIONS = np.float32
UINT64 = (1 << 64) - 1


@dataclass
class LayerWeights:
    attn_norm: DeviceArray
    qkv: DeviceArray            # [q + k + v, hidden]
    qkv_bias: DeviceArray | None
    wo: DeviceArray
    ffn_norm: DeviceArray
    gate_up: DeviceArray        # [2 * intermediate, hidden]: gate rows, then up rows (silu_and_mul's order)
    down: DeviceArray


class Activations(Owned):
    """One step's device arrays for n tokens, with the views the ops read in place."""

    def __init__(self, model: Model, n: int, device) -> None:
        c = model.config
        self.n = n
        self.ids, self.positions, self.slots = (empty(n, np.int32, device) for _ in range(3))
        self.residual = empty((n, c.hidden_size), ACTIVATIONS, device)
        self.x = empty((n, c.hidden_size), ACTIVATIONS, device)
        self.qkv = empty((n, c.q_size + 2 * c.kv_size), ACTIVATIONS, device)
        self.attn = empty((n, c.q_size), ACTIVATIONS, device)
        self.gate_up = empty((n, 2 * c.intermediate_size), ACTIVATIONS, device)
        self.act = empty((n, c.intermediate_size), ACTIVATIONS, device)
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        self.q, self.k = self.qkv[:, :q_end], self.qkv[:, q_end:k_end]          # [n, heads * head_size] views
        self.q_heads = self.q.reshape(n, c.num_heads, c.head_size)
        self.k_heads = self.k.reshape(n, c.num_kv_heads, c.head_size)
        self.v_heads = self.qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_size)
        self.attn_heads = self.attn.reshape(n, c.num_heads, c.head_size)
        self._owned = [self.ids, self.positions, self.slots, self.residual, self.x, self.qkv, self.attn,
                       self.gate_up, self.act]

    @property
    def closed(self) -> bool:
        return all(a.closed for a in self._owned)

    def close(self) -> None:
        for a in self._owned:
            a.close()


class Sampler(Owned):
    """The decode batch's logits and per-row sampling settings, on the device: `sample` reads them in the recorded
    step, and a new seed per row and step is written in place (the draw's offset is a push constant, fixed when
    recorded)."""

    def __init__(self, batch: int, vocab: int, temperature: float, top_p: float, seed: int, device) -> None:
        self.seed = seed
        self.logits = empty((batch, vocab), np.float32, device)
        self.temperature = asarray(np.full(batch, temperature, np.float32), device=device)
        self.top_p = asarray(np.full(batch, top_p, np.float32), device=device)
        self.seeds = empty(batch, np.int64, device)

    def set_step(self, step: int) -> None:
        mixed = [((self.seed & UINT64) * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + row) & UINT64
                 for row in range(self.seeds.shape[0])]
        self.seeds.write(np.array(mixed, np.uint64).view(np.int64))

    @property
    def closed(self) -> bool:
        return self.logits.closed

    def close(self) -> None:
        for a in (self.logits, self.temperature, self.top_p, self.seeds):
            a.close()


class ModelRunner(Owned):
    """Generates with a `Model` on a device: its weights uploaded once, a KVCache for max_batch sequences of up to
    max_context tokens.

    Parameters
    ----------
    model : Model
        From `pagedvk.load_model`.
    cache_dtype : numpy dtype, default float16
        The KV cache's type: float16 or float32 (any `KVCache` dtype: bfloat16, fp8 with unit scales).
    max_context : int, optional
        Tokens per sequence, prompt and generated together; None means the model's context_length. Sizes the cache
        (max_batch sequences of this many tokens) and the rotary table.
    max_batch : int, default 1
        Sequences generated together.
    block_size : int, default 16
    device : Device, DeviceInfo, int or str, optional
        None means the default device.
    backend : {"glsl", "wgsl"}, optional
        The kernel language of every op; None means PAGEDVK_BACKEND, else "glsl".

    Examples
    --------
    >>> model = pagedvk.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> with pagedvk.ModelRunner(model, max_context=512) as runner:
    ...     for tokens in runner.generate([model.tokenizer.encode("The capital of France is")], 16):
    ...         print(model.tokenizer.decode(tokens), end="")
    """

    def __init__(self, model: Model, *, cache_dtype=np.float16, max_context: int | None = None, max_batch: int = 1,
                 block_size: int = 16, device: DeviceLike = None, backend: str | None = None) -> None:
        self._closed = True
        c = self.config = model.config
        self.model = model
        self.max_context = c.context_length if max_context is None else checks.integer(
            "max_context", max_context, 1, c.context_length)
        self.max_batch = checks.integer("max_batch", max_batch, 1)
        self.device, self.backend = get_device(device), backend
        self.max_blocks = math.ceil(self.max_context / checks.integer("block_size", block_size, 1))
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_size, block_size=block_size, dtype=cache_dtype,
                             num_blocks=self.max_batch * self.max_blocks, prefix_caching=False, device=self.device,
                             backend=backend)
        self._closed, self._uploaded = False, []
        try:
            self._upload_weights(model)
        except BaseException:
            self.close()   # what was uploaded so far, and the cache
            raise
        self.logits = None        # the last step's logits [batch, vocab] (a DeviceArray), while generate runs
        self.decode_step = None   # the recorded decode step (a RecordedStep) generate replays, while it runs

    def _upload_weights(self, model: Model) -> None:
        c = self.config

        def upload(a):
            self._uploaded.append(asarray(np.ascontiguousarray(a), device=self.device))
            return self._uploaded[-1]

        self.embed = upload(model.tensor("token_embd.weight"))
        self.lm_head = self.embed if c.tied_embeddings else upload(model.tensor("output.weight"))
        self.output_norm = upload(model.tensor("output_norm.weight"))
        self.layers = []
        for i in range(c.num_layers):
            self.layers.append(LayerWeights(
                attn_norm=upload(model.layer(i, "attn_norm")),
                qkv=upload(np.concatenate([model.layer(i, n) for n in ("attn_q", "attn_k", "attn_v")])),
                qkv_bias=upload(np.concatenate([model.layer(i, n, "bias") for n in ("attn_q", "attn_k", "attn_v")]))
                if c.qkv_bias else None,
                wo=upload(model.layer(i, "attn_output")), ffn_norm=upload(model.layer(i, "ffn_norm")),
                gate_up=upload(np.concatenate([model.layer(i, "ffn_gate"), model.layer(i, "ffn_up")])),
                down=upload(model.layer(i, "ffn_down"))))
        self.cos_sin = upload(rope_cos_sin_cache(self.max_context, c.rope_dim, c.rope_theta))

    # -- the forward, shared by prefill and decode ---------------------------------------------------------------

    def _layers(self, a: Activations, attention) -> None:
        """Every layer over a's tokens, then the output norm: a.x holds the normalized final hidden states.
        attention(layer, q [n, heads, head_size], out [n, heads, head_size]) reads the layer's cache."""
        c, backend = self.config, self.backend
        embedding(a.ids, self.embed, out=a.residual, backend=backend, validate=False)
        for i, w in enumerate(self.layers):
            if i == 0:
                rms_norm(a.x, a.residual, w.attn_norm, c.rms_eps, backend=backend)
            else:
                fused_add_rms_norm(a.x, a.residual, w.attn_norm, c.rms_eps, backend=backend)
            linear(a.x, w.qkv, w.qkv_bias, out=a.qkv, backend=backend)
            rotary_embedding(a.positions, a.q, a.k, c.head_size, self.cos_sin, c.neox, backend=backend,
                             validate=False)
            self.cache.write(i, a.k_heads, a.v_heads, a.slots)
            attention(i, a.q_heads, a.attn_heads)
            linear(a.attn, w.wo, out=a.x, backend=backend)
            fused_add_rms_norm(a.x, a.residual, w.ffn_norm, c.rms_eps, backend=backend)
            linear(a.x, w.gate_up, out=a.gate_up, backend=backend)
            silu_and_mul(a.act, a.gate_up, backend=backend)
            linear(a.act, w.down, out=a.x, backend=backend)
        fused_add_rms_norm(a.x, a.residual, self.output_norm, c.rms_eps, backend=backend)

    def _head(self, a: Activations, sampler: Sampler) -> None:
        """The logits of a's tokens and one sampled id each, written into a.ids (the next decode step's input)."""
        linear(a.x, self.lm_head, out=sampler.logits, backend=self.backend)
        sample(sampler.logits, sampler.temperature, top_p=sampler.top_p, seed=sampler.seeds, out=a.ids,
               backend=self.backend, validate=False)

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_ids=()):
        """Generate a continuation of each prompt, a step at a time.

        Parameters
        ----------
        prompts : list of lists of int
            Token ids, 1 to max_batch prompts, each non-empty, with len(prompt) + max_new_tokens <= max_context.
        max_new_tokens : int
            At least 1.
        temperature : float, default 0.0
            0 is greedy (the argmax); else the softmax of logits / temperature is sampled.
        top_p : float, default 1.0
            In (0, 1]: sample among the fewest most probable tokens whose probability reaches top_p.
        seed : int, default 0
            The draws' key (temperature > 0): the same seed, prompts and settings give the same tokens.
        stop_ids : collection of int
            Generation ends once every sequence has produced one of these (its later tokens are still yielded).

        Yields
        ------
        numpy.ndarray, shape (len(prompts),), int32
            Each step's token per sequence; meanwhile `self.logits` holds that step's logits [len(prompts), vocab]
            and, from the second step, `self.decode_step` the RecordedStep each decode step replays.
        """
        self._require_open()
        prompts = self._check_prompts(prompts, max_new_tokens)
        checks.integer("seed", seed, -(1 << 63), UINT64)
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        batch, blocks = len(prompts), self.cache.blocks
        sampler = Sampler(batch, self.config.vocab_size, temperature, top_p, seed, self.device)
        decode = Activations(self.model, batch, self.device)
        owned, rows = [sampler, decode], []
        stops, done = {int(s) for s in stop_ids}, np.zeros(batch, bool)
        try:
            slots = []
            for row, prompt in enumerate(prompts):
                slots.append(blocks.add_sequence(row, prompt).slots)
                rows.append(row)
            self.logits = sampler.logits
            tokens = self._prefill(prompts, slots, decode, sampler, owned)
            for step in range(1, max_new_tokens + 1):
                yield tokens
                done |= np.isin(tokens, list(stops))
                if step == max_new_tokens or done.all():
                    break
                tokens = self._decode(tokens, step, decode, sampler, owned)
        finally:
            self.logits, self.decode_step = None, None
            for row in rows:
                blocks.free(row)
            for o in reversed(owned):
                o.close()

    def _check_prompts(self, prompts, max_new_tokens: int) -> list[np.ndarray]:
        max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not 1 <= len(prompts) <= \
                self.max_batch:
            raise ValueError(f"prompts must be a list of 1 to max_batch ({self.max_batch}) lists of token ids, got "
                             f"{type(prompts).__name__}" + (f" of {len(prompts)}" if hasattr(prompts, "__len__") else ""))
        checked = []
        for i, p in enumerate(prompts):
            p = np.asarray(p)
            if p.ndim != 1 or not len(p) or p.dtype.kind not in "iu":
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {p.tolist()!r:.60}")
            if p.min() < 0 or p.max() >= self.config.vocab_size:
                raise ValueError(f"prompts[{i}] holds token ids outside [0, {self.config.vocab_size}) (the vocabulary)")
            if len(p) + max_new_tokens > self.max_context:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens: with max_new_tokens {max_new_tokens} that is "
                                 f"longer than max_context ({self.max_context} tokens)")
            checked.append(p.astype(np.int32))
        return checked

    def _prefill(self, prompts, slots, decode: Activations, sampler: Sampler, owned: list) -> np.ndarray:
        """Every prompt's tokens through the model in one ragged batch (queued ops), then the first token of each."""
        lens = [len(p) for p in prompts]
        a = Activations(self.model, sum(lens), self.device)
        owned.append(a)
        a.ids.write(np.concatenate(prompts))
        a.positions.write(np.concatenate([np.arange(n, dtype=np.int32) for n in lens]))
        a.slots.write(np.concatenate(slots).astype(np.int32))
        starts = np.cumsum([0] + lens).astype(np.int32)
        tables, seq_lens = self.cache.blocks.block_tables(range(len(prompts)), self.max_blocks)
        plan = self.cache.prefill_plan(tables, seq_lens, starts)
        owned.append(plan)
        self._layers(a, lambda layer, q, out: plan.run(q, self.cache.key[layer], self.cache.value[layer], out=out))
        # Each prompt's last row, gathered into the decode batch's rows: the embedding op is a row gather.
        last_rows = asarray(starts[1:] - 1, device=self.device)
        owned.append(last_rows)
        embedding(last_rows, a.x, out=decode.x, backend=self.backend, validate=False)
        sampler.set_step(0)
        self._head(decode, sampler)
        return decode.ids.numpy()

    def _decode(self, tokens, step: int, a: Activations, sampler: Sampler, owned: list) -> np.ndarray:
        """One decode step: the tokens just sampled (already in a.ids on the device) appended to their sequences."""
        blocks = self.cache.blocks
        slots = [blocks.append_tokens(row, [int(t)]).slots for row, t in enumerate(tokens)]
        tables, seq_lens = blocks.block_tables(range(len(tokens)), self.max_blocks)
        a.positions.write(seq_lens - 1)
        a.slots.write(np.concatenate(slots).astype(np.int32))
        sampler.set_step(step)
        if step == 1:
            # One recording for the whole generation: every later step updates the plan's tables in place (the
            # plan re-records the step where its kernel or split changes) and replays it.
            self._plan = plan = self.cache.decode_plan(tables, seq_lens, num_heads=self.config.num_heads,
                                                       query_dtype=ACTIVATIONS)
            owned.append(plan)
            with record(self.device) as self.decode_step:
                self._layers(a, lambda layer, q, out: plan.run(q, self.cache.key[layer], self.cache.value[layer],
                                                               out=out))
                self._head(a, sampler)
            owned.append(self.decode_step)
        else:
            self._plan.update(tables, seq_lens, max_seq_len=int(seq_lens.max()))
        self.decode_step.replay()
        return a.ids.numpy()

    # -- lifetime ------------------------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError("the ModelRunner was closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the weights and the cache; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for a in self._uploaded:
            a.close()
        self.cache.close()
