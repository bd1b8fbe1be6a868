"""A step's rows as the engine hands them to the runner (StepBatch), each draw's key, and the checks of a prompt that
both `ModelRunner.generate` and `LLMEngine.add_request` make."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

UINT64 = (1 << 64) - 1


@dataclass(frozen=True)
class StepBatch:
    """One forward's rows, as the engine schedules them: sequence s owns rows query_start_loc[s] to
    query_start_loc[s + 1] - 1, the last tokens of its seq_lens[s] (decode rows: one each, first).

    ids, positions, slots : int32 [n]
        Each row's token, its position in its sequence and its cache slot.
    query_start_loc : int32 [num_seqs + 1]
    block_tables : int32 [num_seqs, max_blocks]
    seq_lens : int32 [num_seqs]
        Tokens cached per sequence once the step has written its rows.
    sample_rows : int32 [r]
        The rows whose logits are sampled, a row once per token drawn from it (a prompt's last row n times for n
        samples), r <= max_batch.
    temperature, top_p : float32 [r]; seeds : int64 [r]
        Each draw's settings (temperature 0: greedy) and its key.
    """
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    sample_rows: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray

    @property
    def decode_only(self) -> bool:
        """Every sequence has one row and every row is sampled once, in order: a recorded decode step runs it."""
        n = len(self.ids)
        return len(self.seq_lens) == n == len(self.sample_rows) and bool(
            np.array_equal(self.sample_rows, np.arange(n)))


def draw_seed(seed: int, sample: int, token: int) -> int:
    """The 64-bit key of one draw: a request's seed, the sample (of n) and the token's index in that sample, mixed
    (golden-ratio and SplitMix64 multipliers) so that nearby inputs give unrelated keys."""
    return ((seed & UINT64) * 0x9E3779B97F4A7C15 + sample * 0xBF58476D1CE4E5B9 + token * 0x94D049BB133111EB) & UINT64


def check_prompt(name: str, prompt, vocab_size: int, max_context: int, max_tokens: int,
                 max_tokens_name: str) -> np.ndarray:
    """A prompt's token ids as int32, checked: non-empty, within the vocabulary, and with max_tokens more within
    max_context; ValueError naming `name` (and `max_tokens_name`) otherwise."""
    p = np.asarray(prompt)
    if p.ndim != 1 or not len(p) or p.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a non-empty list of token ids, got {p.tolist()!r:.60}")
    if p.min() < 0 or p.max() >= vocab_size:
        raise ValueError(f"{name} holds token ids outside [0, {vocab_size}) (the vocabulary)")
    if len(p) + max_tokens > max_context:
        raise ValueError(f"{name} has {len(p)} tokens: with {max_tokens_name} {max_tokens} that is longer than "
                         f"max_context ({max_context} tokens)")
    return p.astype(np.int32)
