"""The attention variants decode and prefill share: ALiBi, logit softcapping, attention sinks, sliding windows.

The arguments are named as FlashInfer's plan arguments name them (``logits_soft_cap``, ``window_left``) and as
vLLM's ops (``alibi_slopes``); ``sinks`` as gpt-oss and vLLM's FlashAttention backend name them:

alibi_slopes     float32 [num_heads]: logit += slope[head] * (key position - query position) (vLLM's ALiBi)
logits_soft_cap  c > 0: logit = c * tanh(logit / c) of the scaled logit, before ALiBi (Gemma 2's order); 0 or None
                 is off (FlashInfer's 0); at most MAX_SOFT_CAP (100)
sinks            float32 [num_heads]: one more logit per head in the softmax denominator that contributes no
                 value (gpt-oss); the log-sum-exp includes it
window_left      a query at position p sees keys p - window_left .. p only (FlashInfer's window_left; vLLM's
                 sliding_window w is window_left = w - 1); -1, the default, is no window. Blocks wholly before
                 a query's window are never read.

The kernels take them through the push constants (softcap, window, the VARIANT_* flags) and two per-head
bindings: one module serves every combination, where a module per combination would multiply the decode
modules (more than 300 today). A launch with none of them runs a pipeline of the same GLSL module with the
specialization constant VARIANTS false, which holds none of their code: the push-constant tests alone cost
the decode kernel 2-4% on the H200 (BENCHMARKS.md). WGSL modules, which naga builds without specialization
constants, keep the tests. Positions count from 0 in the sequence.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import FLOAT32_TINY
from ..kernels.catalogue import VARIANT_ALIBI, VARIANT_LSE, VARIANT_SINKS
from . import checks

MAX_WINDOW_LEFT = 2**31 - 2   # the window (window_left + 1) travels as a u32 push constant; kept well inside it


def per_head(name: str, a, num_heads: int):
    if a is None:
        return None
    checks.kind(name, a)
    checks.ndim(name, a, 1, "[num_heads]")
    checks.dtype(name, a, [np.float32])
    checks.dim(name, a, 0, num_heads, "num_heads")
    if isinstance(a, np.ndarray) and not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {a[~np.isfinite(a)][0]} at index "
                         f"{int(np.flatnonzero(~np.isfinite(a))[0])}")
    return a


# The kernels' c * tanh(x / c) loses accuracy as c grows: the float32 tanh of a small argument is off by about
# 3e-8 absolutely, so each logit by c times that (lavapipe, 2026-12-03: relative error 2.7e-6 at c = 100, 2.9e-5 at
# 1e3, 2.3e-4 at 1e4, and 0.74 from 1e10 on, where x / c is flushed to zero). Models cap at 30 or 50 (Gemma 2).
MAX_SOFT_CAP = 100.0


def soft_cap(value) -> float:
    """The push constant for logits_soft_cap: 0.0 (off) for None or 0 (FlashInfer's "off"), else the checked cap."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"logits_soft_cap must be a real number or None, not {type(value).__name__} ({value!r})")
    cap = float(value)
    if cap == 0.0:
        return 0.0
    if not (math.isfinite(cap) and FLOAT32_TINY <= cap <= MAX_SOFT_CAP):
        raise ValueError(f"logits_soft_cap must be 0 or None (no softcapping), or in [{FLOAT32_TINY:.4g}, "
                         f"{MAX_SOFT_CAP:g}] (float32's normal numbers, and the caps the kernels' tanh keeps to "
                         f"float32 accuracy), got {value}")
    return cap


def window(window_left) -> int:
    """The push constant for window_left: keys a query sees (window_left + 1), 0 for no window (-1)."""
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left must be an int, not {type(window_left).__name__} ({window_left!r})")
    if not -1 <= window_left <= MAX_WINDOW_LEFT:
        raise ValueError(f"window_left must be -1 (no window) or in [0, {MAX_WINDOW_LEFT}] (the keys a query sees "
                         f"besides its own: vLLM's sliding_window - 1), got {window_left}")
    return int(window_left) + 1 if window_left >= 0 else 0


class Variants:
    """The checked variant arguments of a plan or a call: the push constants they give and ``inputs``, the
    alibi_slopes and sinks bindings' arrays as given (numpy or DeviceArray), a 16-byte numpy placeholder where
    a variant is off; the op puts them on its device."""

    def __init__(self, num_heads: int, *, alibi_slopes=None, logits_soft_cap=None, sinks=None, window_left: int = -1):
        self.softcap = soft_cap(logits_soft_cap)
        self.window = window(window_left)
        given = {"alibi_slopes": per_head("alibi_slopes", alibi_slopes, num_heads),
                 "sinks": per_head("sinks", sinks, num_heads)}
        self.flags = (VARIANT_ALIBI if alibi_slopes is not None else 0) | (VARIANT_SINKS if sinks is not None else 0)
        self.inputs = {name: a if a is not None else np.zeros(4, np.float32) for name, a in given.items()}

    def push(self, lse: bool = False, sinks: bool = False) -> dict:
        """The variants' push constants; lse sets VARIANT_LSE (the kernel writes the log-sum-exp), sinks
        VARIANT_SINKS (sinks given for this launch)."""
        flags = self.flags | (VARIANT_LSE if lse else 0) | (VARIANT_SINKS if sinks else 0)
        return dict(softcap=self.softcap, window=self.window, variants=flags)

    def span(self, max_seq_len: int, block_size: int) -> int:
        """Tokens a decode must read of a sequence of max_seq_len: the window, from its first key's block."""
        return max_seq_len if not self.window else min(max_seq_len, self.window + block_size - 1)


def in_use(push: dict) -> bool:
    """Whether a launch's push constants (any dict holding softcap, window and variants, as Variants.push gives
    them) turn on a variant: the launch then needs the pipeline with the variants' code (kernels.pipeline)."""
    return any(push[name] for name in ("softcap", "window", "variants"))


def refuse(op: str, **variants) -> None:
    """ValueError naming the first variant argument that is not off, for ops that support none yet."""
    for name, value in variants.items():
        off = -1 if name == "window_left" else None
        if name == "logits_soft_cap" and soft_cap(value) == 0.0:   # None or 0: off (FlashInfer's 0)
            continue
        if not (value is None if off is None else (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                                                   and value == -1)):
            raise ValueError(f"{op} does not support attention variants: {name} must be {off} (its default), "
                             f"got {value!r}")
