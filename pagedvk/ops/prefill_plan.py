"""The prefill plan: FlashInfer's plan/run split for ragged prefill. Every layer of a prefill step attends with the
same tables and query lengths, so ``PrefillPlan`` does the per-step work once (the tables on the device, the checks
and the tile schedule, the pipelines) and ``run`` does the per-layer work: bind that layer's query, caches and output
to a command buffer recorded the first time those buffers were seen, and queue it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..errors import ClosedError
from ..runtime.array import Array, DeviceArray, asarray, empty
from ..runtime.owned import Owned
from ..runtime.recording import refuse_recording
from ..runtime.selection import DeviceLike
from . import checks
from .decode_plan import RECORDED_LAUNCHES, argument_signature
from .opargs import device_of
from .prefill import QUERY_DOC, _check_lengths, _forward, _int_arguments, _launch, paged_attention_prefill

SHAPES_KEPT = 8   # per plan: the query / cache shapes seen (a model has one; a benchmark a few)


class PrefillPlan(Owned):
    """The per-step part of ragged paged prefill, reused by every layer's `run`.

    Parameters
    ----------
    block_tables : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs, max_blocks_per_seq), int32
    seq_lens : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs,), int32
        Tokens per sequence, the new ones included.
    query_start_loc : DeviceArray, numpy.ndarray or sequence of ints, shape (num_seqs + 1,), int32, optional
        For ragged queries [num_tokens, num_heads, head_size] (as `paged_attention_prefill`); None for queries of
        q_len tokens per sequence [num_seqs, num_heads, q_len, head_size].
    **options
        `paged_attention_prefill`'s keyword arguments, the same for every run: scale, causal, layout,
        kv_cache_dtype, k_scale, v_scale, backend, validate, alibi_slopes, logits_soft_cap, sinks, window_left,
        kernel.
    device : Device, DeviceInfo, int or str, optional
        None means the device of the arrays given, else the default device.

    Examples
    --------
    >>> plan = pagedvk.PrefillPlan(block_tables, seq_lens, query_start_loc)      # or cache.prefill_plan(...)
    >>> for layer in range(num_layers):
    ...     plan.run(q[layer], cache.key[layer], cache.value[layer], out=out[layer])
    """

    def __init__(self, block_tables: Array, seq_lens: Array, query_start_loc: Array | None = None, *,
                 device: DeviceLike = None, **options) -> None:
        self._closed, self._lock = True, threading.Lock()
        unknown = set(options) - set(_PREFILL_OPTIONS)
        if unknown:
            raise TypeError(f"PrefillPlan got unexpected argument(s) {', '.join(sorted(unknown))} (it takes "
                            f"paged_attention_prefill's: {', '.join(_PREFILL_OPTIONS)})")
        block_tables, seq_lens, query_start_loc = _int_arguments(block_tables, seq_lens, query_start_loc)
        checks.tables(block_tables, seq_lens)
        self.device = device_of(block_tables, seq_lens, query_start_loc, device=device)
        self.options = dict(options)
        self._owned = []
        self.block_tables, self.seq_lens = (self._on_device(a) for a in (block_tables, seq_lens))
        # query_start_loc stays on the host (the tile schedule is built from it there), checked at the first run.
        self.query_start_loc = None if query_start_loc is None else np.array(checks.host(query_start_loc), np.int32)
        self._shapes = OrderedDict()     # argument signature -> (problem, dispatches, static device inputs)
        self._launches = OrderedDict()   # buffer uids -> recorded Launch
        self._lse = {}                   # lse shape -> the plan's lse, bound by runs that return none
        self._closed = False

    def _on_device(self, a):
        d = asarray(a, device=self.device)
        if d is not a:
            self._owned.append(d)
        return d

    def run(self, query: Array, key_cache: Array, value_cache: Array, out: Array | None = None, *,
            lse: Array | None = None, return_lse: bool = False):
        """One layer's prefill attention (`paged_attention_prefill` with the plan's tables and options).

        Parameters
        ----------
        {query}
        key_cache, value_cache : DeviceArray or numpy.ndarray
            One layer's caches.
        out : DeviceArray or numpy.ndarray, optional
            The query's shape and dtype: written and returned. Give it (with device arrays) for the launch to be
            recorded once and queued at every later run.
        lse : DeviceArray or numpy.ndarray, float32, optional
            The query's shape without head_size: written with each row's log-sum-exp.
        return_lse : bool, default False
            True (or an `lse` given) returns (out, lse).

        Returns
        -------
        out, or (out, lse)
            DeviceArrays for a DeviceArray query (queued: they are ready when read), numpy for a numpy query.
        """
        self._require_open()
        refuse_recording("PrefillPlan.run", self.device)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, not {type(return_lse).__name__}")
        arrays = (query, key_cache, value_cache, out, lse)
        if not all(a is None or type(a) is DeviceArray for a in arrays):
            # Host arrays are copied for the call anyway: the op itself, with the plan's device tables.
            result = paged_attention_prefill(query, key_cache, value_cache, self.block_tables, self.seq_lens,
                                             self.query_start_loc, out=out, **self.options)
            if isinstance(lse, np.ndarray):
                lse[...] = np.asarray(result[1])
            return result if return_lse or lse is not None else result[0]
        entry = self._entry(query, key_cache, value_cache, out, lse)
        problem, dispatches, static = entry
        if out is None:
            out = empty(tuple(query.shape), query.dtype, self.device)
        lse_array = lse if lse is not None else (
            empty(tuple(query.shape[:-1]), np.float32, self.device) if return_lse else self._plan_lse(query))
        if problem.num_tokens:
            self._queue(problem, dispatches, dict(static, query=query, key_cache=key_cache, value_cache=value_cache,
                                                  out=out, lse=lse_array))
        return (out, lse_array) if return_lse or lse is not None else out

    def _entry(self, query, key_cache, value_cache, out, lse):
        """The checked problem, its dispatches and its device-resident inputs for arguments of these shapes."""
        signature = argument_signature((query, key_cache, value_cache, out, lse))
        with self._lock:
            entry = self._shapes.get(signature)
            if entry is not None:
                self._shapes.move_to_end(signature)
                return entry
        problem, dispatches, inputs, _ = _forward(query, key_cache, value_cache, self.block_tables, self.seq_lens,
                                                  self.query_start_loc, out, **self.options)
        if lse is not None:
            problem.check_like("lse", lse, tuple(query.shape[:-1]), "(the query's shape without head_size)",
                               np.float32)
        static = {name: self._on_device(a) for name, a in inputs.items()
                  if name not in ("query", "key_cache", "value_cache")}
        with self._lock:
            self._require_open()
            self._shapes[signature] = entry = (problem, dispatches, static)
            while len(self._shapes) > SHAPES_KEPT:
                self._forget_problem(self._shapes.popitem(last=False)[1][0])
        return entry

    def _plan_lse(self, query) -> DeviceArray:
        shape = tuple(query.shape[:-1])
        with self._lock:
            if shape not in self._lse:
                self._lse[shape] = empty(shape, np.float32, self.device)
                self._owned.append(self._lse[shape])
            return self._lse[shape]

    def _queue(self, problem, dispatches, arrays: dict) -> None:
        key = (id(problem),) + tuple(b.uid for name in sorted(arrays) for b in arrays[name].buffers)
        with self._lock:
            self._require_open()
            kept = self._launches.get(key)
            if kept is not None:
                try:
                    self._launches.move_to_end(key)
                    kept[0].enqueue()
                    return
                except ClosedError:
                    self._launches.pop(key)[0].close()
            launch = _launch(problem, dispatches, arrays)
            # The decode tokens' row views (_DecodePart.steps) are bound weakly: kept beside their launch.
            views = problem.decode_part.views if problem.decode_part is not None else ()
            self._launches[key] = (launch, views)
            while len(self._launches) > RECORDED_LAUNCHES:
                self._launches.popitem(last=False)[1][0].close()
            launch.enqueue()

    def update(self, block_tables: Array, seq_lens: Array, query_start_loc: Array | None = None) -> None:
        """Prepare the plan for the next prefill step: new tables and lengths, in the plan's own device tables.

        Same shapes as the plan's tables. Where query_start_loc is unchanged (a steady batch of chunks), the tile
        schedule and the recorded launches stay and nothing is allocated; a new one makes them again at the next
        run."""
        self._require_open()
        block_tables, seq_lens, query_start_loc = _int_arguments(block_tables, seq_lens, query_start_loc)
        checks.tables(block_tables, seq_lens)
        for name, given, planned in (("block_tables", block_tables, self.block_tables),
                                     ("seq_lens", seq_lens, self.seq_lens)):
            if tuple(given.shape) != tuple(planned.shape):
                raise ValueError(f"{name} has shape {tuple(given.shape)}, the plan's is {tuple(planned.shape)}: a "
                                 "batch of another shape needs a plan of its own")
        if (query_start_loc is None) != (self.query_start_loc is None):
            raise ValueError("query_start_loc must be given exactly when the plan was made with one (ragged queries)")
        new_loc = None if query_start_loc is None else np.array(checks.host(query_start_loc), np.int32)
        same_schedule = (new_loc is None or (self.query_start_loc is not None
                                              and np.array_equal(new_loc, self.query_start_loc)))
        if same_schedule and self.options.get("validate", True):
            for problem, _, _ in list(self._shapes.values()):   # what a new problem would check
                checks.block_table_values(block_tables, seq_lens, problem.block_size, problem.num_blocks)
                _check_lengths(checks.host(seq_lens), np.diff(problem.query_start_loc), problem.ragged)
        with self._lock:
            if not same_schedule or not all(a in self._owned for a in (self.block_tables, self.seq_lens)):
                self._forget_all()
            for name, given in (("block_tables", block_tables), ("seq_lens", seq_lens)):
                current = getattr(self, name)
                if current in self._owned:
                    current.write(np.asarray(checks.host(given), np.int32))
                else:
                    setattr(self, name, self._on_device(given))
            self.query_start_loc = new_loc
            for problem, _, _ in self._shapes.values():   # kept: their decode tokens' plans take the new rows
                if problem.decode_part is not None:
                    problem.decode_part.update(block_tables, seq_lens)

    def _forget_problem(self, problem) -> None:
        if problem.decode_part is not None:
            problem.decode_part.close()

    def _forget_all(self) -> None:
        for launch, _ in self._launches.values():
            launch.close()
        self._launches.clear()
        for problem, _, static in self._shapes.values():
            self._forget_problem(problem)
            for a in static.values():
                if a in self._owned:
                    self._owned.remove(a)
                    a.close()
        self._shapes.clear()

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the plan's launches and device arrays; safe to call twice."""
        with self._lock:
            self._closed = True
            if hasattr(self, "_shapes"):
                self._forget_all()
            for a in getattr(self, "_owned", ()):
                a.close()
            self._owned = []

    def __repr__(self) -> str:
        if not hasattr(self, "block_tables"):
            return "PrefillPlan(<not constructed>)"
        return (f"PrefillPlan(num_seqs={self.block_tables.shape[0]}, ragged={self.query_start_loc is not None}, "
                f"device={self.device!r}{', closed' if self._closed else ''})")


_PREFILL_OPTIONS = ("scale", "causal", "layout", "kv_cache_dtype", "k_scale", "v_scale", "backend", "validate",
                    "alibi_slopes", "logits_soft_cap", "sinks", "window_left", "kernel")
PrefillPlan.run.__doc__ = PrefillPlan.run.__doc__.format(query=QUERY_DOC)
