"""What a request asks of the engine (SamplingParams) and what a step hands back (RequestOutput, SampleOutput), with
vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtypes import FLOAT32_MAX
from ..ops import checks
from .batch import UINT64


@dataclass(frozen=True)
class SamplingParams:
    """How to generate a request's tokens (vLLM's SamplingParams, the fields this engine has).

    Parameters
    ----------
    max_tokens : int, default 16
        Tokens to generate per sample, at least 1 (the prompt and these within the runner's max_context).
    temperature : float, default 1.0
        0 is greedy (the argmax); else the softmax of logits / temperature is sampled. Under 1e-5 counts as 0
        (vLLM's rule: the logits / temperature would overflow float32).
    top_p : float, default 1.0
        In (0, 1]: sample among the fewest most probable tokens whose probability reaches top_p.
    seed : int, optional
        The request's key: the same seed, prompt and settings give the same tokens, whatever else runs beside it.
        None draws one.
    n : int, default 1
        Samples generated from the prompt (it is prefilled once; the samples share its blocks).
    stop_token_ids : sequence of int, default ()
        A sample that generates one of these finishes ("stop"), the token included in its output.
    ignore_eos : bool, default False
        Keep generating past the model's end-of-sequence tokens (benchmarks); else they stop a sample as
        stop_token_ids do.

    Raises
    ------
    ValueError, TypeError
        A bad value, named.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks.integer("max_tokens", self.max_tokens, 1)
        checks.integer("n", self.n, 1)
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        if not (number(self.temperature) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            checks.integer("seed", self.seed, -(1 << 63), UINT64)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        for i, t in enumerate(self.stop_token_ids):
            checks.integer(f"stop_token_ids[{i}]", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class SampleOutput:
    """One sample's tokens from one step: index (of n), new_token_ids (those generated this step), and
    finish_reason: None while it runs, "stop" (a stop or end-of-sequence token, the last of new_token_ids) or
    "length" (max_tokens reached)."""
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """A request's progress in one step: the samples that produced tokens (outputs), finished once every sample has
    (or it was aborted), and num_cached_tokens, the prompt tokens found in the prefix cache."""
    request_id: object
    outputs: list[SampleOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
