"""A Llama-family model run on the device over a KVCache. The host hands in a step's rows (token ids, positions, cache
slots, block tables, which rows to sample and how) and reads back the sampled ids, nothing else; which rows a step
holds is the engine's choice (pagedvk.models.engine: continuous batching, chunked prefill, prefix caching, forks,
swapping), and `generate` is a static batch over that engine.

Weights go to the device once, as float16 (or the model's dtype): the query, key and value projections fused into one
[q + k + v, hidden] matrix (one linear; the cache write, the rotary embedding and the attention read its column
slices where they lie), the gate and up projections into one [2 * intermediate, hidden] matrix (one linear, then
silu_and_mul). Activations are float32: the ops compute in float32 anyway, and a float16 residual stream would round
each layer's sum.

A step over n rows (prompt tokens, prompt chunks after cached tokens, one token per decoding sequence):

    residual = embedding(ids)
    per layer:  x = rms_norm(residual) (the first) or fused_add_rms_norm(x, residual) (the others: residual += x)
                qkv = linear(x, w_qkv) (+ bias); rotary_embedding(q, k); cache.write(k, v, slots)
                attn = attention(q, cache)            a PrefillPlan (ragged, queued) or a DecodePlan (recorded)
                x = linear(attn, w_o); fused_add_rms_norm(x, residual)
                x = linear(silu_and_mul(linear(x, w_gate_up)), w_down)
    x = fused_add_rms_norm(x, residual)               the output norm
    ids = sample(linear(x[sampled rows], lm_head))    per row its temperature, top_p and seed

A step with any prompt rows runs the ragged forward op by op (`PrefillPlan.run` cannot be recorded; decode rows are
its q_len 1 sequences, which the prefill op hands to the decode kernel), and gathers the rows to sample (the
embedding op is a row gather: a prompt's last row, once per sample to draw from it). A step of decode rows only
replays a step recorded once for its batch size and kept (CUDA graphs are captured per batch size), its tables,
lengths, positions, slots and sampling settings written in place.
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
from .batch import UINT64, StepBatch, check_prompt, draw_seed
from .engine import LLMEngine
from .llama import Model, ModelConfig
from .params import SamplingParams

ACTIVATIONS = np.float32
PREFILL_PLANS_KEPT = 16   # ragged plans kept, one per number of sequences in a step (updated in place)


@dataclass
class LayerWeights:
    attn_norm: DeviceArray
    qkv: DeviceArray            # [q + k + v, hidden]
    qkv_bias: DeviceArray | None
    wo: DeviceArray
    ffn_norm: DeviceArray
    gate_up: DeviceArray        # [2 * intermediate, hidden]: gate rows, then up rows (silu_and_mul's order)
    down: DeviceArray


class RowArrays(Owned):
    """Named device arrays of a step's rows (FIELDS): its own, or the first rows of a larger set's (a view owns
    nothing, and closing it frees nothing)."""

    FIELDS: tuple = ()
    _owns = False

    @property
    def closed(self) -> bool:
        return all(getattr(self, name).closed for name in self.FIELDS)

    def close(self) -> None:
        if self._owns:
            for name in self.FIELDS:
                getattr(self, name).close()


class Activations(RowArrays):
    """A step's device arrays for n tokens, with the views the ops read in place: arrays of their own, or views of
    the first n rows of a larger Activations (`rows`), so that steps of any size up to its capacity allocate
    nothing."""

    FIELDS = ("ids", "positions", "slots", "residual", "x", "qkv", "attn", "gate_up", "act")

    def __init__(self, config: ModelConfig, n: int, device=None, *, base: Activations | None = None) -> None:
        c = self.config = config
        self.n = n
        if base is None:
            widths = {"residual": c.hidden_size, "x": c.hidden_size, "qkv": c.q_size + 2 * c.kv_size,
                      "attn": c.q_size, "gate_up": 2 * c.intermediate_size, "act": c.intermediate_size}
            for name in self.FIELDS:   # the host's per-step inputs in mapped memory: written with no transfer
                setattr(self, name, empty((n, widths[name]), ACTIVATIONS, device) if name in widths
                        else empty(n, np.int32, device, host_visible=True))
        else:
            for name in self.FIELDS:
                setattr(self, name, getattr(base, name)[:n])
        self._owns = base is None
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        self.q, self.k = self.qkv[:, :q_end], self.qkv[:, q_end:k_end]          # [n, heads * head_size] views
        self.q_heads = self.q.reshape(n, c.num_heads, c.head_size)
        self.k_heads = self.k.reshape(n, c.num_kv_heads, c.head_size)
        self.v_heads = self.qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_size)
        self.attn_heads = self.attn.reshape(n, c.num_heads, c.head_size)

    def rows(self, n: int) -> Activations:
        """Views of the first n rows (n <= this one's)."""
        return Activations(self.config, n, base=self)

class Sampler(RowArrays):
    """The sampled rows' hidden states, logits and per-row sampling settings, on the device, for up to `capacity`
    rows: `rows(r)` views the first r. `sample` reads the settings from the device (in a recorded step too), so a
    step writes them in place: each row's seed is its own key (a request's seed mixed with the sample and the
    token's index), so that a request's draws do not depend on its place in the batch."""

    FIELDS = ("gather", "x", "logits", "temperature", "top_p", "seeds", "ids")

    def __init__(self, config: ModelConfig, capacity: int, device=None, *, base: Sampler | None = None) -> None:
        self.config, self.n = config, capacity
        if base is None:
            shapes = {"gather": (capacity, np.int32), "x": ((capacity, config.hidden_size), ACTIVATIONS),
                      "logits": ((capacity, config.vocab_size), np.float32), "temperature": (capacity, np.float32),
                      "top_p": (capacity, np.float32), "seeds": (capacity, np.int64), "ids": (capacity, np.int32)}
            for name in self.FIELDS:   # the host writes the settings and reads the ids: mapped, no transfers
                setattr(self, name, empty(*shapes[name], device, host_visible=name not in ("x", "logits")))
        else:
            for name in self.FIELDS:
                setattr(self, name, getattr(base, name)[:capacity])
        self._owns = base is None

    def rows(self, r: int) -> Sampler:
        return Sampler(self.config, r, base=self)

    def write(self, batch: StepBatch) -> None:
        """The draws' settings (and the rows to gather) of a step."""
        self.gather.write(np.asarray(batch.sample_rows, np.int32))
        self.temperature.write(np.asarray(batch.temperature, np.float32))
        self.top_p.write(np.asarray(batch.top_p, np.float32))
        self.seeds.write(np.asarray(batch.seeds, np.uint64).view(np.int64))

class ModelRunner(Owned):
    """A `Model` on a device: its weights uploaded once, a KVCache, and the forward of a step's rows (`execute`).
    `generate` runs a static batch of prompts; `pagedvk.models.engine.LLMEngine` serves a stream of requests.

    Parameters
    ----------
    model : Model
        From `pagedvk.load_model`.
    cache_dtype : numpy dtype, default float16
        The KV cache's type: float16 or float32 (any `KVCache` dtype: bfloat16, float8_e4m3fn, float8_e5m2).
    k_scale, v_scale : float, default 1.0
        An fp8 cache's scales (`KVCache`'s): it holds key / k_scale and value / v_scale.
    max_context : int, optional
        Tokens per sequence, prompt and generated together; None means the model's context_length. Sizes the block
        tables and the rotary table.
    max_batch : int, default 1
        Sequences (samples) in a step, and rows sampled in a step.
    block_size : int, default 16
    num_blocks : int, optional
        The cache's blocks; None means max_batch sequences of max_context tokens (then nothing is ever preempted).
    num_host_blocks : int, default 0
        Host blocks that preempted sequences swap to (an engine over fewer than the default num_blocks needs
        max_batch sequences' worth: see LLMEngine).
    prefix_caching : bool, default True
        Share full prompt blocks by their token-prefix hash.
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
                 block_size: int = 16, num_blocks: int | None = None, num_host_blocks: int = 0,
                 prefix_caching: bool = True, device: DeviceLike = None, backend: str | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self._closed = True
        c = self.config = model.config
        self.model = model
        self.max_context = c.context_length if max_context is None else checks.integer(
            "max_context", max_context, 1, c.context_length)
        self.max_batch = checks.integer("max_batch", max_batch, 1)
        self.device, self.backend = get_device(device), backend
        self.max_blocks = math.ceil(self.max_context / checks.integer("block_size", block_size, 1))
        num_blocks = self.max_batch * self.max_blocks if num_blocks is None else checks.integer(
            "num_blocks", num_blocks, self.max_blocks)   # one sequence of max_context tokens at least
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_size, block_size=block_size, dtype=cache_dtype,
                             num_blocks=num_blocks, num_host_blocks=num_host_blocks, k_scale=k_scale, v_scale=v_scale,
                             prefix_caching=prefix_caching, device=self.device, backend=backend)
        self._closed, self._uploaded = False, []
        self._decode_steps = {}    # batch size -> (RecordedStep, DecodePlan, Activations rows, Sampler rows)
        self._step_tables = []     # the recorded steps' plans' tables and lengths (mapped), the runner's to free
        self._prefill_plans = {}   # number of sequences -> PrefillPlan, updated step to step
        self._ragged = None        # Activations of the ragged steps, grown to the largest step so far
        try:
            self._upload_weights(model)
            self._decode = Activations(c, self.max_batch, self.device)   # the recorded steps' rows
            self._sampler = Sampler(c, self.max_batch, self.device)
        except BaseException:
            self.close()   # what was uploaded so far, and the cache
            raise
        self.logits = None        # the last step's logits [sampled rows, vocab] (a DeviceArray view)
        self.decode_step = None   # the RecordedStep the last step replayed (None: a ragged step)

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

    # -- the forward -----------------------------------------------------------------------------------------------

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

    def _head(self, x: DeviceArray, s: Sampler) -> None:
        """The logits of x's rows and one sampled id each, into s.logits and s.ids."""
        linear(x, self.lm_head, out=s.logits, backend=self.backend)
        sample(s.logits, s.temperature, top_p=s.top_p, seed=s.seeds, out=s.ids, backend=self.backend,
               validate=False)

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step's rows through the model and sample: returns the sampled ids, int32 [len(sample_rows)].

        The engine's tables are trusted (it made them with the cache's BlockManager); `self.logits` then holds the
        sampled rows' logits and `self.decode_step` the RecordedStep replayed (None for a ragged step)."""
        self._require_open()
        r = len(batch.sample_rows)
        if r > self.max_batch:
            raise ValueError(f"batch samples {r} rows, more than max_batch ({self.max_batch})")
        s = self._sampler.rows(r)
        if r:
            s.write(batch)
        if batch.decode_only:
            self.decode_step = self._replay_decode(batch, s)
        else:
            self.decode_step = None
            self._run_ragged(batch, s)
        self.logits = s.logits
        return s.ids.numpy() if r else np.zeros(0, np.int32)

    @staticmethod
    def _write_rows(a: Activations, batch: StepBatch) -> None:
        a.ids.write(np.asarray(batch.ids, np.int32))
        a.positions.write(np.asarray(batch.positions, np.int32))
        a.slots.write(np.asarray(batch.slots, np.int32))

    def _run_ragged(self, batch: StepBatch, s: Sampler) -> None:
        """Prompt rows (and decode rows beside them): one ragged forward, queued op by op, then the sampled rows
        gathered out of it (the embedding op is a row gather) for the head."""
        n = len(batch.ids)
        if self._ragged is None or self._ragged.n < n:
            if self._ragged is not None:
                self._ragged.close()
            self._ragged = None
            self._ragged = Activations(self.config, 1 << (n - 1).bit_length(), self.device)   # doubling
        a = self._ragged.rows(n)
        self._write_rows(a, batch)
        plan = self._prefill_plans.pop(len(batch.seq_lens), None)
        if plan is None:
            plan = self.cache.prefill_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc)
        else:
            plan.update(batch.block_tables, batch.seq_lens, batch.query_start_loc)
        self._prefill_plans[len(batch.seq_lens)] = plan   # the most recent last
        while len(self._prefill_plans) > PREFILL_PLANS_KEPT:
            self._prefill_plans.pop(next(iter(self._prefill_plans))).close()
        key, value = self.cache.key, self.cache.value
        self._layers(a, lambda layer, q, out: plan.run(q, key[layer], value[layer], out=out))
        if s.n:
            embedding(s.gather, a.x, out=s.x, backend=self.backend, validate=False)
            self._head(s.x, s)

    def _replay_decode(self, batch: StepBatch, s: Sampler):
        """Decode rows only: the step recorded for this batch size (recorded at its first use and kept), its
        plan's tables and the rows' inputs updated in place, replayed in one submission."""
        b = len(batch.ids)
        kept = self._decode_steps.get(b)
        a = kept[2] if kept else self._decode.rows(b)
        self._write_rows(a, batch)
        if kept is None:
            # The plan binds the step's own tables, in mapped memory: each step rewrites them with no transfer.
            tables = empty(batch.block_tables.shape, np.int32, self.device, host_visible=True)
            seq_lens = empty(len(batch.seq_lens), np.int32, self.device, host_visible=True)
            tables.write(batch.block_tables)
            seq_lens.write(np.asarray(batch.seq_lens, np.int32))
            plan = self.cache.decode_plan(tables, seq_lens, num_heads=self.config.num_heads, query_dtype=ACTIVATIONS)
            self._step_tables.append((tables, seq_lens))
            key, value = self.cache.key, self.cache.value
            try:
                with record(self.device) as step:
                    self._layers(a, lambda layer, q, out: plan.run(q, key[layer], value[layer], out=out))
                    self._head(a.x, s)
            except BaseException:
                plan.close()
                raise
            kept = self._decode_steps[b] = (step, plan, a, s)
        else:
            # The plan re-records the step where its kernel or split changes (its generation); else the replay
            # binds the same buffers with the new tables.
            plan = kept[1]
            plan.block_tables.write(batch.block_tables)
            plan.seq_lens.write(np.asarray(batch.seq_lens, np.int32))
            plan.update(plan.block_tables, plan.seq_lens, max_seq_len=int(np.max(batch.seq_lens)), validate=False)
        kept[0].replay()
        return kept[0]

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_ids=()):
        """Generate a continuation of each prompt, a step at a time: a static batch served by an LLMEngine over
        this runner (every prompt prefilled in the first step, then one token per sequence a step).

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
        max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not 1 <= len(prompts) <= \
                self.max_batch:
            raise ValueError(f"prompts must be a list of 1 to max_batch ({self.max_batch}) lists of token ids, got "
                             f"{type(prompts).__name__}" + (f" of {len(prompts)}" if hasattr(prompts, "__len__") else ""))
        prompts = [check_prompt(f"prompts[{i}]", p, self.config.vocab_size, self.max_context, max_new_tokens,
                                "max_new_tokens") for i, p in enumerate(prompts)]
        checks.integer("seed", seed, -(1 << 63), UINT64)
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        # Every prompt in the first step: a budget of all their tokens.
        engine = LLMEngine(self, max_num_batched_tokens=max(sum(map(len, prompts)), self.max_batch))
        for row, prompt in enumerate(prompts):
            # Each row its own key, as the same prompt twice draws differently; ignore_eos: `stop_ids` are the
            # caller's, who gets every sequence's tokens until all have stopped.
            engine.add_request(row, prompt, SamplingParams(
                max_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                seed=draw_seed(seed, row, 0), ignore_eos=True))
        stops, done = {int(s) for s in stop_ids}, np.zeros(len(prompts), bool)
        got, step = [[] for _ in prompts], 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got[out.request_id] += out.outputs[0].new_token_ids
                while step < max_new_tokens and all(len(g) > step for g in got):
                    tokens = np.array([g[step] for g in got], np.int32)
                    step += 1
                    yield tokens
                    done |= np.isin(tokens, list(stops))
                    if done.all():
                        return
        finally:
            self.logits, self.decode_step = None, None
            for row in range(len(prompts)):
                engine.abort(row)   # what is still running frees its blocks

    # -- lifetime ------------------------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError("the ModelRunner was closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the weights, the cache, the recorded steps and their plans; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for step, plan, _, _ in self._decode_steps.values():
            step.close()
            plan.close()
        for plan in self._prefill_plans.values():
            plan.close()
        self._decode_steps, self._prefill_plans = {}, {}
        for tables in self._step_tables:
            for a in tables:
                a.close()
        for owned in (self._ragged, getattr(self, "_decode", None), getattr(self, "_sampler", None)):
            if owned is not None:
                owned.close()
        for a in self._uploaded:
            a.close()
        self.cache.close()
