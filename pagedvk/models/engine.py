"""Continuous batching over a ModelRunner's device forward (vLLM's LLMEngine): requests are added and aborted between
steps, and each step runs one forward over every running request's next rows.

Each step, as pagedvk.demo.serve's scheduler (oldest request first throughout):

1. swap in preempted requests while their blocks and one more token per running sample fit (and their rows fit
   max_batch);
2. give every decoding sample its next token's slot, preempting the newest request (its blocks swapped to the
   host) while the blocks run out; then give each request still in its prompt its next chunk, as much as the
   token budget (max_num_batched_tokens, less one token per decoding sample not yet served) and the free blocks
   allow;
3. admit waiting requests (none while any is swapped out) while the budget, the free blocks and max_batch allow: a
   prompt's leading blocks found in the prefix cache are shared, its first chunk starts after them;
4. run one forward over all of it (ModelRunner.execute): decode rows first, then the chunks, one ragged batch; a
   step of decode rows only replays a recorded step. Only the rows that need a token are sampled: each decoding
   sample's, and the last row of a chunk that ends its prompt, drawn n times for n samples, which then fork
   (sharing the prompt's blocks, copy-on-write).

A prompt's blocks are taken chunk by chunk, so that the prefix cache only ever holds blocks whose keys and values
are written (a chunk's blocks in the step that computes them: every layer writes its cache before it attends), and
an aborted or preempted prompt leaves nothing unwritten behind.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..ops import checks
from .batch import StepBatch, check_prompt, draw_seed
from .params import RequestOutput, SampleOutput, SamplingParams

DEFAULT_TOKEN_BUDGET = 512   # tokens a step computes at most, by default (vLLM's chunked-prefill budget is 512-8192)
GREEDY_BELOW = 1e-5          # temperatures under this are greedy (vLLM's _SAMPLING_EPS)


@dataclass(eq=False)
class _Sample:
    index: int
    seq_id: tuple                                  # its sequence in the BlockManager
    tokens: list = field(default_factory=list)     # generated so far; the last is not in the cache yet
    finish_reason: str | None = None


@dataclass(eq=False)
class _Request:
    id: object
    prompt: list
    params: SamplingParams
    seed: int
    arrival: int
    stops: frozenset
    samples: list = field(default_factory=list)    # sample 0 until the prompt is done, then n
    computed: int = 0                              # prompt tokens in the cache
    cached: int = 0                                # of them, found in the prefix cache

    @property
    def prefilled(self) -> bool:
        return self.computed == len(self.prompt)

    @property
    def live(self) -> list:
        return [s for s in self.samples if s.finish_reason is None]

    @property
    def width(self) -> int:
        """Rows it may take in a step: n until its prompt is done (it forks then), its live samples after."""
        return len(self.live) if self.prefilled else self.params.n


@dataclass(eq=False)
class _Entry:
    """One sequence's rows in a step: `tokens` from position `start`, and the draws from its last row, as (sample
    index, token index) pairs."""
    req: _Request
    seq_id: tuple
    tokens: list
    start: int
    slots: np.ndarray
    draws: list


class LLMEngine:
    """Serves requests with a ModelRunner: `add_request`, then `step` until `has_unfinished_requests` is False.

    Not thread-safe: one thread calls everything (pagedvk.serve runs the engine in a thread of its own and hands
    requests and aborts to it between steps).

    Parameters
    ----------
    runner : ModelRunner
        Its cache (blocks, host blocks, prefix caching), max_batch (samples in a step) and max_context.
    max_num_batched_tokens : int, optional
        Tokens a step computes at most (prompt chunks and decode rows), at least max_batch; None means
        max(512, max_batch). A longer prompt is prefilled over several steps.

    Raises
    ------
    ValueError
        max_num_batched_tokens below max_batch; or a cache of fewer blocks than max_batch full sequences (so that
        requests can be preempted) with fewer host blocks than that to swap them to.

    Examples
    --------
    >>> engine = LLMEngine(pagedvk.ModelRunner(model, max_batch=8, max_context=1024))
    >>> engine.add_request("a", model.tokenizer.encode("Hello"), SamplingParams(max_tokens=32, temperature=0))
    >>> while engine.has_unfinished_requests():
    ...     for out in engine.step():
    ...         print(out.request_id, out.outputs[0].new_token_ids, out.finished)
    """

    def __init__(self, runner, *, max_num_batched_tokens: int | None = None) -> None:
        # Not imported: pagedvk.models.runner builds its `generate` on this module.
        if not all(hasattr(runner, a) for a in ("execute", "cache", "max_batch", "max_blocks", "model")):
            raise TypeError(f"runner must be a ModelRunner, got {type(runner).__name__}")
        self.runner, self.blocks = runner, runner.cache.blocks
        self.max_batch = runner.max_batch
        self.max_num_batched_tokens = max(DEFAULT_TOKEN_BUDGET, self.max_batch) if max_num_batched_tokens is None \
            else checks.integer("max_num_batched_tokens", max_num_batched_tokens, self.max_batch)
        # The swapped requests' blocks: running and swapped requests together hold at most max_batch samples (none
        # is admitted while any is swapped out), each of at most max_context tokens.
        full = self.max_batch * runner.max_blocks
        if self.blocks.num_blocks < full and self.blocks.num_host_blocks < full:
            raise ValueError(f"num_host_blocks must be at least {full} (max_batch {self.max_batch} sequences of "
                             f"max_context {runner.max_context} tokens) when num_blocks ({self.blocks.num_blocks}) is "
                             f"fewer, to swap preempted requests to; got {self.blocks.num_host_blocks}")
        tokenizer = runner.model.tokenizer
        self.eos_token_ids = frozenset(tokenizer.stop_ids) if tokenizer is not None else frozenset()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []      # oldest first
        self.swapped: list[_Request] = []      # oldest first
        self._requests: dict[object, _Request] = {}
        self._arrivals = 0
        self._rng = np.random.default_rng()    # the seeds of requests that give none
        self.stats = {"steps": 0, "recorded_steps": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0,
                      "generated_tokens": 0, "preemptions": 0}

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(self, request_id, prompt_token_ids, params: SamplingParams | None = None) -> None:
        """Queue a request; it is admitted at a later step, oldest first.

        Parameters
        ----------
        request_id : hashable
            Not in use by an unfinished request.
        prompt_token_ids : sequence of int
            Non-empty, within the vocabulary, with params.max_tokens more within the runner's max_context.
        params : SamplingParams, optional
            None means SamplingParams() (16 tokens at temperature 1).

        Raises
        ------
        ValueError, TypeError
            A bad argument, named; nothing is queued then.
        """
        params = SamplingParams() if params is None else params
        try:
            in_use = request_id in self._requests
        except TypeError:
            raise TypeError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        if in_use:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        prompt = self.check_request(prompt_token_ids, params)
        seed = int(self._rng.integers(0, 1 << 63)) if params.seed is None else params.seed
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = _Request(request_id, prompt, params, seed, self._arrivals, stops)
        req.samples.append(_Sample(0, (request_id, 0)))
        self._arrivals += 1
        self._requests[request_id] = req
        self.waiting.append(req)

    def check_request(self, prompt_token_ids, params: SamplingParams) -> list[int]:
        """add_request's checks of a prompt and its params (ValueError or TypeError naming the argument); returns the
        prompt as a list of ints. It reads only the runner's and the cache's sizes, never what a step changes, so a
        server's request threads may call it while the engine steps."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        r = self.runner
        prompt = check_prompt("prompt_token_ids", prompt_token_ids, r.config.vocab_size, r.max_context,
                              params.max_tokens, "max_tokens").tolist()
        if params.n > self.max_batch:
            raise ValueError(f"n must be at most max_batch ({self.max_batch}), got {params.n}")
        for i, t in enumerate(params.stop_token_ids):
            if t >= r.config.vocab_size:
                raise ValueError(f"stop_token_ids[{i}] must be in [0, {r.config.vocab_size}) (the vocabulary), got {t}")
        # Alone in the cache, its samples share the prompt's full blocks and each holds the rest of its tokens
        # (the last sampled one is never written).
        bs, shared = self.blocks.block_size, len(prompt) // self.blocks.block_size
        alone = shared + params.n * (-(-(len(prompt) + params.max_tokens - 1) // bs) - shared)
        if alone > self.blocks.num_blocks:
            raise ValueError(f"n ({params.n}) samples of max_tokens {params.max_tokens} after prompt_token_ids "
                             f"({len(prompt)} tokens) need {alone} blocks, more than the cache's "
                             f"{self.blocks.num_blocks}")
        return prompt

    def abort(self, request_id) -> bool:
        """Drop a request wherever it is (waiting, running or swapped out), freeing its blocks; False where there is
        no such unfinished request."""
        req = self._requests.pop(request_id, None) if _hashable(request_id) else None
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        for s in req.live:
            self.blocks.free(s.seq_id)
        (self.running if req in self.running else self.swapped).remove(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (preempted ones not counted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- a step --------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; returns the requests that produced tokens (or finished), in row order."""
        self._swap_in()
        entries = self._schedule()
        if not entries:
            if self._requests:   # the checks in add_request make this unreachable: one request alone always fits
                raise RuntimeError(f"no request could be scheduled: {len(self.waiting)} waiting, "
                                   f"{len(self.running)} running, {len(self.swapped)} swapped")
            return []
        batch = self._batch(entries)
        ids = self.runner.execute(batch)
        self.stats["steps"] += 1
        self.stats["recorded_steps"] += self.runner.decode_step is not None
        return self._finish_step(entries, ids)

    def _rows(self) -> int:
        return sum(r.width for r in self.running)

    def _swap_in(self) -> None:
        m = self.blocks
        while self.swapped:
            req = self.swapped[0]
            seqs = [s.seq_id for s in req.live]
            resident = len({b for s in seqs for b in m.block_table(s)})
            # keep room for every running sample's next token, this one's included
            if self._rows() + req.width > self.max_batch or \
                    resident + sum(len(r.live) for r in self.running + [req]) > m.num_free_blocks:
                break
            self.runner.cache.swap(m.swap_in(seqs), to_host=False)
            self.running.append(self.swapped.pop(0))
            self.running.sort(key=lambda r: r.arrival)

    def _preempt(self, req: _Request) -> None:
        self.runner.cache.swap(self.blocks.swap_out([s.seq_id for s in req.live]), to_host=True)
        self.running.remove(req)
        self.swapped.append(req)
        self.swapped.sort(key=lambda r: r.arrival)
        self.stats["preemptions"] += 1

    def _schedule(self) -> list[_Entry]:
        m, bs, budget = self.blocks, self.blocks.block_size, self.max_num_batched_tokens
        decodes, chunks, used = [], [], 0
        for req in list(self.running):
            if req not in self.running:
                continue                                # preempted by an older request in this step
            if req.prefilled:
                live = req.live
                while req in self.running and sum(m.blocks_to_append(s.seq_id, 1) for s in live) > m.num_free_blocks:
                    self._preempt(self.running[-1])     # the newest: perhaps this one
                if req not in self.running:
                    continue
                for s in live:
                    start = m.seq_len(s.seq_id)
                    w = m.append_tokens(s.seq_id, s.tokens[-1:])
                    self.runner.cache.copy_blocks(w.copies)
                    decodes.append(_Entry(req, s.seq_id, s.tokens[-1:], start, w.slots, [(s.index, len(s.tokens))]))
                used += len(live)
                continue
            # a prompt's next chunk: the budget less one token for each decoding sample still to come
            later = self.running[self.running.index(req) + 1:]
            room = budget - used - sum(len(r.live) for r in later if r.prefilled)
            if room <= 0:
                continue
            seq = req.samples[0].seq_id
            fit = lambda: len(m.block_table(seq)) * bs - req.computed + m.num_free_blocks * bs
            while fit() == 0 and self.running[-1] is not req:
                self._preempt(self.running[-1])
            chunk = min(len(req.prompt) - req.computed, room, fit())
            if chunk:
                tokens = req.prompt[req.computed:req.computed + chunk]
                chunks.append(self._chunk(req, seq, tokens, req.computed, m.append_tokens(seq, tokens).slots))
                used += chunk
        while self.waiting and not self.swapped:
            req = self.waiting[0]
            if used >= budget or self._rows() + req.params.n > self.max_batch:
                break
            cached, free_hits = m.cached_prefix(req.prompt)
            chunk = min(len(req.prompt) - cached, budget - used, (m.num_free_blocks - free_hits) * bs)
            if chunk <= 0:
                break
            seq = req.samples[0].seq_id
            w = m.add_sequence(seq, req.prompt[:cached + chunk])
            req.computed = req.cached = w.num_cached
            self.stats["cached_prompt_tokens"] += w.num_cached
            self.running.append(self.waiting.popleft())
            chunks.append(self._chunk(req, seq, req.prompt[cached:cached + chunk], cached, w.slots))
            used += chunk
        return decodes + chunks   # decode rows first: the ragged forward hands them to the decode kernel together

    @staticmethod
    def _chunk(req: _Request, seq: tuple, tokens: list, start: int, slots: np.ndarray) -> _Entry:
        ends = start + len(tokens) == len(req.prompt)
        return _Entry(req, seq, tokens, start, slots, [(k, 0) for k in range(req.params.n)] if ends else [])

    def _batch(self, entries: list[_Entry]) -> StepBatch:
        tables, seq_lens = self.blocks.block_tables([e.seq_id for e in entries], self.runner.max_blocks)
        loc = np.cumsum([0] + [len(e.tokens) for e in entries]).astype(np.int32)
        rows, temperature, top_p, seeds = [], [], [], []
        for e, end in zip(entries, loc[1:]):
            p = e.req.params
            for sample, token in e.draws:
                rows.append(end - 1)
                temperature.append(p.temperature if p.temperature >= GREEDY_BELOW else 0.0)
                top_p.append(p.top_p)
                seeds.append(draw_seed(e.req.seed, sample, token))
        return StepBatch(
            ids=np.concatenate([e.tokens for e in entries]).astype(np.int32),
            positions=np.concatenate([np.arange(e.start, e.start + len(e.tokens)) for e in entries]).astype(np.int32),
            slots=np.concatenate([e.slots for e in entries]).astype(np.int32), query_start_loc=loc,
            block_tables=tables, seq_lens=seq_lens, sample_rows=np.array(rows, np.int32),
            temperature=np.array(temperature, np.float32), top_p=np.array(top_p, np.float32),
            seeds=np.array(seeds, np.uint64))

    def _finish_step(self, entries: list[_Entry], ids: np.ndarray) -> list[RequestOutput]:
        m, outputs, drawn = self.blocks, {}, iter(ids.tolist())
        for e in entries:
            req = e.req
            if e.start < len(req.prompt):               # a prompt chunk
                req.computed += len(e.tokens)
                self.stats["prompt_tokens"] += len(e.tokens)
                if e.draws:                              # the prompt is done: its samples fork from it
                    for k in range(1, req.params.n):
                        m.fork(req.samples[0].seq_id, (req.id, k))
                        req.samples.append(_Sample(k, (req.id, k)))
            for k, _ in e.draws:
                s, token = req.samples[k], next(drawn)
                s.tokens.append(token)
                self.stats["generated_tokens"] += 1
                if token in req.stops:
                    s.finish_reason = "stop"
                elif len(s.tokens) == req.params.max_tokens:
                    s.finish_reason = "length"
                if s.finish_reason:
                    m.free(s.seq_id)
                out = outputs.get(req.id)
                if out is None:
                    out = outputs[req.id] = RequestOutput(req.id, [], False, len(req.prompt), req.cached)
                out.outputs.append(SampleOutput(k, [token], s.finish_reason))
        for req_id, out in outputs.items():
            req = self._requests[req_id]
            if not req.live:
                out.finished = True
                self.running.remove(req)
                del self._requests[req_id]
        return list(outputs.values())


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
