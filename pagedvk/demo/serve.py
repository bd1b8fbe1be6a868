"""Continuous batching for the demo: a stream of requests served by the model over a paged KV cache driven by
the BlockManager, with prefix sharing, parallel samples (fork + copy-on-write) and preemption by swapping.

The cache is anything with NumpyPagedCache's methods (write, copy_blocks, swap, attend): pagedvk.KVCache on the
device (its `blocks` manager then drives the stream), NumpyPagedCache (float64, pagedvk.testing.reference), or a
CheckedCache that runs both and compares every attention call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..engine.blocks import BlockManager
from ..errors import NoFreeBlocksError
from ..testing import reference
from .model import Model, ModelConfig, generate_dense, pick, rounded


@dataclass
class Request:
    """prompt: token ids; n: parallel samples (sample b starts with the b-th most likely token, then greedy);
    max_new: tokens generated per sample; arrival: the step it arrives at."""
    id: int
    prompt: list[int]
    n: int = 1
    max_new: int = 8
    arrival: int = 0


@dataclass
class Batch:
    """One forward pass: per sequence its new tokens' count (q_len), in order; the new tokens' cache slots
    int32 [sum q_len]; block_tables int32 [num_seqs, max_blocks] and seq_lens int32 [num_seqs] (new tokens
    included)."""
    q_lens: list[int]
    slots: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray


class NumpyPagedCache:
    """Per-layer key and value caches in vLLM's layout on the "device" and the same on the host (swap space).

    key   [num_blocks, kv_heads, head_size // x, block_size, x] with x = 16 // itemsize
    value [num_blocks, kv_heads, head_size, block_size]
    """

    def __init__(self, layers, kv_heads, head_size, num_blocks, block_size, num_host_blocks, dtype=np.float64):
        x = 16 // np.dtype(dtype).itemsize
        if head_size % x:
            raise ValueError(f"head_size must be a multiple of {x} for dtype {np.dtype(dtype).name}, got {head_size}")

        def caches(n):
            return ([np.full((n, kv_heads, head_size // x, block_size, x), np.nan, dtype) for _ in range(layers)],
                    [np.full((n, kv_heads, head_size, block_size), np.nan, dtype) for _ in range(layers)])

        self.block_size = block_size
        self.key, self.value = caches(num_blocks)
        self.host_key, self.host_value = caches(num_host_blocks)

    def write(self, layer, k, v, slots):
        """reshape_and_cache: k, v [n, kv_heads, head_size] into the slots int32 [n]; negative slots skipped."""
        keep = slots >= 0
        block, off = np.divmod(slots[keep], self.block_size)
        kc, vc = self.key[layer], self.value[layer]
        x = kc.shape[-1]
        kc[block, :, :, off, :] = k[keep].reshape(len(block), k.shape[1], -1, x)
        vc[block, :, :, off] = v[keep]

    def copy_blocks(self, pairs):
        """copy_blocks over every layer: (src, dst) device block pairs."""
        for src, dst in pairs:
            for c in self.key + self.value:
                c[dst] = c[src]

    def swap(self, pairs, to_host: bool):
        """swap_blocks over every layer: (device, host) pairs out, or (host, device) pairs in."""
        src, dst = ((self.key + self.value, self.host_key + self.host_value) if to_host
                    else (self.host_key + self.host_value, self.key + self.value))
        for a, b in pairs:
            for s, d in zip(src, dst):
                d[b] = s[a]

    def attend(self, layer, q, batch: Batch):
        """q [sum q_len, heads, head_size] -> out like q: decode rows through reference.paged_attention, prefill
        rows through reference.paged_attention_prefill, over this layer's cache."""
        kc, vc = self.key[layer], self.value[layer]
        out, starts = np.empty(q.shape), np.cumsum([0] + batch.q_lens)
        decode = [i for i, n in enumerate(batch.q_lens) if n == 1]
        if decode:
            rows = starts[decode]
            out[rows] = reference.paged_attention(q[rows], kc, vc, batch.block_tables[decode], batch.seq_lens[decode])
        for i, n in enumerate(batch.q_lens):
            if n > 1:
                qi = q[starts[i]:starts[i + 1]].transpose(1, 0, 2)[None]
                o, _ = reference.paged_attention_prefill(qi, kc, vc, batch.block_tables[i:i + 1],
                                                         batch.seq_lens[i:i + 1], layout="vllm")
                out[starts[i]:starts[i + 1]] = o[0].transpose(1, 0, 2)
        return out


@dataclass
class Report:
    outputs: dict = field(default_factory=dict)         # (request id, sample) -> generated tokens
    steps: int = 0
    tokens: int = 0                                     # tokens computed (prompts and decodes)
    generated: int = 0
    seconds: float = 0.0
    attention_seconds: float = 0.0
    occupancy: list = field(default_factory=list)      # share of device blocks in use after each step
    preemptions: int = 0
    manager_stats: dict = field(default_factory=dict)

    def summary(self) -> str:
        s = self.manager_stats
        return (f"{self.steps} steps, {self.generated} tokens generated, {self.tokens} computed in "
                f"{self.seconds:.2f} s: {self.generated / max(self.seconds, 1e-9):.1f} generated tokens/s, "
                f"{100 * self.attention_seconds / max(self.seconds, 1e-9):.0f}% of the time in attention\n"
                f"cache occupancy mean {100 * np.mean(self.occupancy or [0]):.0f}% peak "
                f"{100 * max(self.occupancy or [0]):.0f}%; prefix hits {s.get('prefix_hit_blocks', 0)} blocks; "
                f"forks {s.get('forks', 0)} (copy-on-write copies {s.get('cow_copies', 0)}); "
                f"preemptions {self.preemptions} (blocks swapped out {s.get('swapped_out_blocks', 0)}, "
                f"in {s.get('swapped_in_blocks', 0)})")


def serve(model: Model, requests, num_blocks=64, block_size=8, num_host_blocks=256, cache=None,
          progress=None) -> Report:
    """Serve `requests` (list of Request) with continuous batching; returns the Report. Each step: swap in
    preempted requests that fit (oldest first), give every running sample its next token's slot (preempting
    the newest request when blocks run out), admit arrived requests while blocks last, then run one forward
    over all of it. progress: a stream for a progress line (None: none)."""
    c = model.config
    if cache is None:
        cache = NumpyPagedCache(c.layers, c.kv_heads, c.head_size, num_blocks, block_size, num_host_blocks)
    m = getattr(cache, "blocks", None) or BlockManager(num_blocks, block_size, num_host_blocks)
    num_blocks, block_size = m.num_blocks, m.block_size
    report = Report()
    pending = sorted(requests, key=lambda r: r.arrival)
    waiting, running, swapped = [], [], []             # requests, oldest first
    live: dict[int, list] = {}                          # request id -> its unfinished samples' seq ids
    start = time.perf_counter()

    def preempt(req):
        cache.swap(m.swap_out(live[req.id]), to_host=True)
        running.remove(req)
        swapped.append(req)
        report.preemptions += 1

    while pending or waiting or running or swapped:
        report.steps += 1
        while pending and pending[0].arrival <= report.steps:
            waiting.append(pending.pop(0))
        entries = []                                    # (seq id, tokens, first position, Writes)
        while swapped:
            req = swapped[0]
            resident = {b for s in live[req.id] for b in m.block_table(s)}
            if len(resident) + sum(len(live[r.id]) for r in running + [req]) > m.num_free_blocks:
                break                                   # keep room for every running sample's next token
            cache.swap(m.swap_in(live[req.id]), to_host=False)
            running.append(swapped.pop(0))
            running.sort(key=lambda r: (r.arrival, r.id))
        for req in list(running):
            if req not in running:
                continue                                # preempted by an older request in this step
            while req in running and sum(m.blocks_to_append(s, 1) for s in live[req.id]) > m.num_free_blocks:
                preempt(running[-1])
            if req not in running:
                continue
            for s in live[req.id]:
                tok = report.outputs[s][-1]
                w = m.append_tokens(s, [tok])
                cache.copy_blocks(w.copies)
                entries.append((s, [tok], m.seq_len(s) - 1, w))
        while waiting and not swapped:
            req = waiting[0]
            try:
                w = m.add_sequence((req.id, 0), req.prompt)
            except NoFreeBlocksError:
                if not running and not entries:
                    raise ValueError(f"num_blocks ({num_blocks}) cannot hold request {req.id}'s prompt "
                                     f"({len(req.prompt)} tokens at block_size {block_size})") from None
                break
            live[req.id] = [(req.id, 0)]
            running.append(waiting.pop(0))
            entries.append(((req.id, 0), req.prompt[w.num_cached:], w.num_cached, w))
        if not entries:
            if swapped and not running:
                raise ValueError(f"num_blocks ({num_blocks}) cannot hold request {swapped[0].id} with its samples")
            continue
        logits = forward(model, cache, m, entries, report)
        ends = np.cumsum([len(t) for _, t, _, _ in entries]) - 1
        for (s, toks, pos0, _), row in zip(entries, logits[ends]):
            req = next(r for r in running if r.id == s[0])
            if pos0 + len(toks) == len(req.prompt):     # prompt done: fork the parallel samples
                for b in range(1, req.n):
                    m.fork(s, (req.id, b))
                    live[req.id].append((req.id, b))
                for b in range(req.n):
                    report.outputs[(req.id, b)] = [pick(row, b)]
            else:
                report.outputs[s].append(pick(row, 0))
        for req in list(running):
            for s in [s for s in live[req.id] if len(report.outputs[s]) == req.max_new]:
                m.free(s)
                live[req.id].remove(s)
            if not live[req.id]:
                running.remove(req)
        report.generated = sum(len(v) for v in report.outputs.values())
        report.occupancy.append(1 - m.num_free_blocks / num_blocks)
        if progress is not None:
            print(f"\rstep {report.steps}  running {len(running)}  waiting {len(waiting) + len(pending)}  "
                  f"swapped {len(swapped)}  generated {report.generated}  cache {100 * report.occupancy[-1]:.0f}%",
                  end="", file=progress, flush=True)
    if progress is not None:
        print(file=progress)
    report.seconds = time.perf_counter() - start
    report.manager_stats = dict(m.stats)
    return report


def forward(model, cache, m: BlockManager, entries, report: Report):
    """One forward over the step's entries; returns logits [sum of their tokens, vocab]."""
    tables, seq_lens = m.block_tables([s for s, _, _, _ in entries])
    batch = Batch([len(t) for _, t, _, _ in entries], np.concatenate([w.slots for *_, w in entries]),
                  tables, seq_lens)
    tokens = np.concatenate([np.asarray(t, np.int64) for _, t, _, _ in entries])
    positions = np.concatenate([np.arange(p, p + len(t)) for _, t, p, _ in entries])

    def attention(layer, q, k, v):
        t0 = time.perf_counter()
        cache.write(layer, k, v, batch.slots)
        out = cache.attend(layer, q, batch)
        report.attention_seconds += time.perf_counter() - t0
        return out

    report.tokens += len(tokens)
    return model.forward(tokens, positions, attention)


def make_requests(num_requests=24, vocab=128, block_size=8, seed=0, steps=12) -> list[Request]:
    """A random stream: arrivals over `steps` steps; half the prompts start with one of two shared system
    prompts (two and a half blocks long); a third ask for 2 or 3 parallel samples."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, vocab, 2 * block_size + block_size // 2)) for _ in range(2)]
    out = []
    for i in range(num_requests):
        tail = list(rng.integers(0, vocab, int(rng.integers(1, 2 * block_size))))
        prompt = (systems[i % 2] if rng.random() < 0.5 else []) + tail
        out.append(Request(i, [int(t) for t in prompt], n=int(rng.choice([1, 1, 2, 3])),
                           max_new=int(rng.integers(2, 3 * block_size)), arrival=int(rng.integers(0, steps))))
    return out


class CheckedCache:
    """A cache (pagedvk.KVCache) with a float64 NumpyPagedCache beside it holding the same keys and values
    (rounded to the cache's type, as the cache holds them): every op runs on both, and every attention call's
    result is compared with the float64 one (relative error, worst kept in `worst`; AssertionError past
    `tolerance`). Its `blocks` is the device cache's."""

    def __init__(self, cache, tolerance: float):
        s = cache.spec
        self.cache, self.blocks, self.tolerance, self.worst = cache, cache.blocks, tolerance, 0.0
        self.shadow = NumpyPagedCache(cache.num_layers, s.num_kv_heads, s.head_size, s.num_blocks, s.block_size,
                                      len(cache.host_key[0]))

    def write(self, layer, k, v, slots):
        self.cache.write(layer, k, v, slots)
        self.shadow.write(layer, rounded(k, self.cache.dtype), rounded(v, self.cache.dtype), slots)

    def copy_blocks(self, pairs):
        self.cache.copy_blocks(pairs)
        self.shadow.copy_blocks(pairs)

    def swap(self, pairs, to_host: bool):
        self.cache.swap(pairs, to_host)
        self.shadow.swap(pairs, to_host)

    def attend(self, layer, q, batch):
        out = self.cache.attend(layer, q, batch)
        ref = self.shadow.attend(layer, q, batch)
        error = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
        self.worst = max(self.worst, error)
        if not error <= self.tolerance:
            raise AssertionError(f"layer {layer}: attention differs from float64 by {error:.2e} "
                                 f"(tolerance {self.tolerance:.0e})")
        return out


def demo(requests=24, layers=2, heads=4, kv_heads=2, head_size=16, num_blocks=48, block_size=8, seed=0,
         check=False, dtype="float32", layout="vllm", out=None, progress=None) -> int:
    """`pagedvk demo`: serve a random stream over a KVCache on the selected device, print the report and, with
    check, compare every step's attention with float64 and every sample's tokens with a dense float64 run (both
    over keys and values rounded to the cache's dtype, as the cache holds them).
    Returns the exit status (1 if the check failed). out, progress: streams for the report and the progress
    line (default stdout, stderr)."""
    from ..engine.cache import KVCache
    out, progress = out or sys.stdout, progress or sys.stderr
    model = Model(ModelConfig(layers=layers, heads=heads, kv_heads=kv_heads, head_size=head_size, seed=seed))
    reqs = make_requests(requests, model.config.vocab, block_size, seed)
    with KVCache(layers, kv_heads, head_size, block_size, np.dtype(dtype), layout, num_blocks=num_blocks,
                 num_host_blocks=256) as device_cache:
        cache = CheckedCache(device_cache, 1e-4) if check else device_cache
        print(f"device {device_cache.device.info.name}: {layers} layers x {num_blocks} blocks of {block_size} "
              f"tokens, {np.dtype(dtype)} {layout} cache", file=out)
        report = serve(model, reqs, cache=cache, progress=progress)
    print(report.summary(), file=out)
    if not check:
        return 0
    bad = [(r.id, b) for r in reqs for b in range(r.n)
           if report.outputs[(r.id, b)] != generate_dense(model, r.prompt, r.max_new, b, np.dtype(dtype))]
    print(f"check: every step's attention within {cache.worst:.1e} of float64", file=out)
    print(f"check FAILED: samples {bad} differ from the dense reference" if bad
          else "check: every sample's tokens equal the dense reference's", file=out)
    return 1 if bad else 0
