"""Sampling a token from each row of logits on the device: greedy, or temperature, top-k and top-p (vLLM's and
FlashInfer's order: top-k, then top-p over the softmax of logits / temperature) and a seeded draw
(shaders/sampling.comp says how, without a sort)."""

from __future__ import annotations

import numpy as np

from ..dtypes import FLOAT32_MAX, QUERY_TYPES, storage_type
from ..kernels import modules
from ..kernels.abi import q_type_code
from ..kernels.catalogue import SAMPLING, SAMPLING_PER_ROW
from ..runtime.array import Array, DeviceArray, asarray, empty
from ..runtime.pipeline import fold_grid
from ..runtime.recording import active_recording, dispatch, require_device_arrays
from . import checks
from .opargs import backend_name, device_of

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # int64 or uint64, taken as 64 bits
MAX_VOCAB = 1 << 24   # top-k counts logits in float32, exact up to 2^24


def sample(logits: Array, temperature=1.0, top_k=0, top_p=1.0, seed=0, offset: int = 0, out: Array | None = None, *,
           backend: str | None = None, validate: bool = True) -> Array:
    """One token id per row of logits: greedy where the temperature is 0, else drawn from the softmax of
    logits / temperature restricted by top-k, then top-p (vLLM's and FlashInfer's semantics).

    Parameters
    ----------
    logits : DeviceArray or numpy.ndarray, shape (batch, vocab)
        float32, float16 or bfloat16; NaN counts as -inf.
    temperature : float, or DeviceArray / numpy.ndarray of shape (batch,) float32, default 1.0
        0 is greedy (the largest logit; ties: the lowest index); else finite and positive.
    top_k : int, or DeviceArray / numpy.ndarray of shape (batch,) int32, default 0
        Keep the k largest logits (and any tied with the k-th); 0 or -1 (vLLM's spellings), or k >= vocab, keeps all.
    top_p : float, or DeviceArray / numpy.ndarray of shape (batch,) float32, default 1.0
        In (0, 1]: then keep the fewest most probable tokens (of those top-k kept) whose probability reaches top_p
        (and any tied with the last); 1 keeps all.
    seed : int, or DeviceArray / numpy.ndarray of shape (batch,) int64, default 0
        The draw's key, 64 bits. One int serves the batch, each row's draw keyed by its row too; an array gives each
        row its own (a request's seed: its tokens then do not depend on its place in the batch).
    offset : int, default 0
        The generator's step, in [0, 2^32): the same (seed, offset) and logits give the same token; pass a new offset
        each step (FlashInfer's philox offset).
    out : DeviceArray or numpy.ndarray, shape (batch,), int32, optional
        Written and returned; None allocates it.
    backend : {"glsl", "wgsl"}, optional
        The kernel language; None means PAGEDVK_BACKEND, else "glsl".
    validate : bool, default True
        Check the values of DeviceArray temperature, top_k and top_p (a read back); False leaves them to the kernel,
        which treats a temperature that is not positive and finite as 0, a top_k outside [1, vocab) as off, and a
        top_p that is NaN or >= 1 as off, <= 0 as keeping the largest logit only.

    Returns
    -------
    DeviceArray or numpy.ndarray, shape (batch,), int32
        `out` itself when given; else numpy for numpy logits, a DeviceArray for DeviceArray logits.

    Raises
    ------
    ValueError, TypeError
        A bad argument (named), before anything reaches the GPU.

    Examples
    --------
    >>> tokens = pagedvk.sample(logits, temperature=0.7, top_k=50, top_p=0.9, seed=1234, offset=step)
    """
    checks.kind("logits", logits)
    checks.ndim("logits", logits, 2, "[batch, vocab]")
    logits_type = storage_type("logits", logits, QUERY_TYPES)
    batch, vocab = logits.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits must have 1 to {MAX_VOCAB} columns (vocab; the kernel counts logits in float32), "
                         f"got shape {tuple(logits.shape)}")
    if batch * vocab >= 2 ** 32:
        raise ValueError(f"logits has {batch * vocab} elements, more than the kernel indexes (2^32 - 1): split the "
                         "batch")
    if out is not None:
        checks.kind("out", out)
        checks.writable("out", out)
        checks.ndim("out", out, 1, "[batch]")
        checks.dtype("out", out, [np.int32])
        checks.dim("out", out, 0, batch, "batch, from logits")
    offset = checks.integer("offset", offset, 0, 2 ** 32 - 1)
    rows = {"temperatures": _per_row("temperature", temperature, batch, np.float32, _temperature, validate),
            "top_ks": _per_row("top_k", top_k, batch, np.int32, _top_k, validate),
            "top_ps": _per_row("top_p", top_p, batch, np.float32, _top_p, validate),
            "seeds": _per_row("seed", seed, batch, np.int64, _seed, validate)}
    device = device_of(logits, out, *rows.values())
    if active_recording(device) is not None:
        require_device_arrays("sample inside pagedvk.record()", logits=logits, out=out,
                              **{name: a for name, a in zip(("temperature", "top_k", "top_p", "seed"), rows.values())
                                 if not np.isscalar(a)})
    name = backend_name(backend)

    temporaries = []
    try:
        def on_device(a):
            d = asarray(a, device=device)
            if d is not a:
                temporaries.append(d)
            return d

        ld = on_device(logits)
        arrays = {k: on_device(a) for k, a in rows.items() if not np.isscalar(a)}
        td = out if isinstance(out, DeviceArray) else empty(batch, np.int32, device)
        if td is not out and not (out is None and isinstance(logits, DeviceArray)):
            temporaries.append(td)
        scalar = {k: a for k, a in rows.items() if np.isscalar(a)}
        seed_bits = int(scalar.get("seeds", 0)) & ((1 << 64) - 1)
        push = SAMPLING.pack_push(
            batch=batch, vocab=vocab, logits_type=q_type_code(logits_type.tag),
            temperature=float(scalar.get("temperatures", 0.0)), top_k=max(int(scalar.get("top_ks", 0)), 0),
            top_p=float(scalar.get("top_ps", 1.0)), seed_lo=seed_bits & 0xFFFFFFFF, seed_hi=seed_bits >> 32,
            offset=offset, per_row=sum(SAMPLING_PER_ROW[k] for k in arrays), mix_row=int("seeds" in scalar))
        if batch:
            pipeline = modules.pipeline(device, SAMPLING, SAMPLING.key(name))
            # an array not given binds the logits' buffer, unread (per_row's bit clear)
            buffers = [ld.buffer] + [arrays[k].buffer if k in arrays else ld.buffer for k in SAMPLING_PER_ROW] \
                + [td.buffer]
            grid = fold_grid(batch, device.info.max_workgroup_count)
            dispatch("sample", device, lambda: [(pipeline, buffers, push, grid)])
        if isinstance(out, np.ndarray):
            out[...] = td.numpy()
            return out
        if out is not None:
            return out
        return td.numpy() if isinstance(logits, np.ndarray) else td
    finally:
        for a in temporaries:
            a.close()


def greedy_sample(logits: Array, out: Array | None = None, *, backend: str | None = None) -> Array:
    """Each row's largest logit's index (ties: the lowest; NaN counts as -inf), on the device: `sample` at
    temperature 0. Arguments and result as `sample`'s."""
    return sample(logits, temperature=0.0, out=out, backend=backend)


def _per_row(name: str, value, batch: int, dtype, check, validate: bool):
    """A sampling parameter: a number for the whole batch (checked; returned as it is), or an array of one per row
    (shape and dtype checked, and its values: a host array's always, a DeviceArray's read back where `validate`). A
    host array of another int (or, for floats, float) dtype is converted to `dtype`."""
    if isinstance(value, DeviceArray):
        checks.kind(name, value)
        checks.ndim(name, value, 1, "[batch]")
        checks.dim(name, value, 0, batch, "batch, from logits")
        checks.dtype(name, value, [dtype])
        if validate and batch:
            check(name, value.numpy())
        return value
    if isinstance(value, np.ndarray):
        checks.ndim(name, value, 1, "[batch]")
        checks.dim(name, value, 0, batch, "batch, from logits")
        if value.dtype.kind not in ("iu" if np.dtype(dtype).kind == "i" else "fiu"):
            raise TypeError(f"{name} must be an array of {np.dtype(dtype)}, got {value.dtype}")
        check(name, value)
        return value.astype(dtype)   # uint64 seeds wrap to int64: the same 64 bits
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number or an array of {batch} (one per row), not {type(value).__name__}")
    check(name, value)
    return value


def _first_bad(name: str, values, bad) -> int | None:
    """The index of the first bad value of an array (None: none), -1 for a bad scalar."""
    bad = np.asarray(bad)
    if not bad.any():
        return None
    return int(np.flatnonzero(bad)[0]) if bad.ndim else -1


def _refuse(name: str, values, bad, allowed: str) -> None:
    i = _first_bad(name, values, bad)
    if i is not None:
        where, got = (name, values) if i < 0 else (f"{name}[{i}]", values[i])
        raise ValueError(f"{where} must be {allowed}, got {got}")


def _temperature(name, values):
    v = np.asarray(values, np.float64)
    _refuse(name, values, ~(np.isfinite(v) & (v >= 0) & (v <= FLOAT32_MAX)), "0 (greedy) or a finite positive number")


def _top_k(name, values):
    if np.asarray(values).dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int, or 0 or -1 for no top-k, got {values!r}")
    v = np.asarray(values, np.int64)
    _refuse(name, values, (v < -1) | (v > 2 ** 31 - 1), "a positive int (int32), or 0 or -1 for no top-k")


def _top_p(name, values):
    v = np.asarray(values, np.float64)
    _refuse(name, values, ~((v > 0) & (v <= 1)), "in (0, 1] (1: no top-p)")


def _seed(name, values):
    if isinstance(values, np.ndarray):
        return   # any int array: its 64 bits
    checks.integer(name, values, *SEED_RANGE)
