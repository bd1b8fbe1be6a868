"""The engine's own thread: it steps an LLMEngine while there is work and sleeps while there is none. Requests and
aborts reach it through an inbox it empties between steps (the engine is not thread-safe); each step's outputs go
back to the caller's callback, which an asyncio server wraps in loop.call_soon_threadsafe."""

from __future__ import annotations

import logging
import threading
from collections import deque

from ..errors import PagedVKError
from ..models.engine import LLMEngine
from ..models.params import SamplingParams

log = logging.getLogger("pagedvk.serve")


class QueueFullError(PagedVKError):
    """More requests are waiting to be admitted than the worker's max_waiting."""


class EngineWorker:
    """Runs `engine` in a thread of its own (started by `start`, ended by `close`).

    Parameters
    ----------
    engine : LLMEngine
    max_waiting : int, default 64
        Requests handed in and not yet admitted by the engine that `submit` accepts; past it, QueueFullError.

    Each request's callback gets every RequestOutput of it, on the worker's thread, and then None where the request
    ended without finishing (aborted), or an exception where the engine failed.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 64) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self._lock = threading.Condition()
        self._inbox: deque = deque()        # ("add", id, prompt, params, callback) or ("abort", id)
        self._inbox_adds = 0                # adds in the inbox
        self._engine_waiting = 0            # the engine's waiting requests after its last step
        self._callbacks: dict = {}          # request id -> callback, while the engine has the request
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedvk-engine", daemon=True)

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        """Requests handed in and not yet admitted."""
        with self._lock:
            return self._inbox_adds + self._engine_waiting

    def check(self, prompt_token_ids, params: SamplingParams) -> None:
        """What the engine's add_request would refuse (ValueError or TypeError naming the argument), checked in the
        caller's thread before `submit`: the engine's checks read nothing that its steps change."""
        self.engine.check_request(prompt_token_ids, params)

    def submit(self, request_id, prompt_token_ids, params: SamplingParams, callback) -> None:
        """Hand a request to the engine; QueueFullError where max_waiting requests are waiting already."""
        with self._lock:
            if self._closed:
                raise PagedVKError("the engine worker is closed")
            waiting = self._inbox_adds + self._engine_waiting
            if waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting to be served, the most this server queues "
                                     f"(--max-waiting {self.max_waiting}); try again later")
            self._inbox.append(("add", request_id, prompt_token_ids, params, callback))
            self._inbox_adds += 1
            self._lock.notify()

    def abort(self, request_id) -> None:
        """Drop a request (its callback gets None), wherever it is; nothing where it has finished."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._inbox and not engine.has_unfinished_requests() and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                self._apply(command)
            with self._lock:
                self._inbox_adds -= sum(c[0] == "add" for c in commands)
                self._engine_waiting = engine.num_waiting
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:   # the device failed: every request ends with the error, the worker goes on
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            with self._lock:
                self._engine_waiting = engine.num_waiting
            for out in outputs:
                callback = self._callbacks[out.request_id]
                if out.finished:
                    del self._callbacks[out.request_id]
                self._call(callback, out)
        with self._lock:   # closed: what was handed in and never reached the engine ends too
            left, self._inbox_adds = [c for c in self._inbox if c[0] == "add"], 0
            self._inbox.clear()
        for command in left:
            self._call(command[4], None)
        self._fail_all(None)

    def _apply(self, command) -> None:
        if command[0] == "abort":
            if self.engine.abort(command[1]):
                self._call(self._callbacks.pop(command[1]), None)
            return
        _, request_id, prompt, params, callback = command
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:   # checked by the caller already: a duplicate id, say
            self._call(callback, e)
            return
        self._callbacks[request_id] = callback

    def _fail_all(self, error) -> None:
        for request_id, callback in list(self._callbacks.items()):
            self.engine.abort(request_id)
            self._call(callback, error)
        self._callbacks.clear()

    @staticmethod
    def _call(callback, value) -> None:
        try:
            callback(value)
        except Exception:   # a caller's callback must not stop the engine (a closed event loop, say)
            log.exception("a request's callback failed")

    def close(self, timeout: float | None = None) -> None:
        """End the thread after its current step; requests still running get None. Safe to call twice."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
