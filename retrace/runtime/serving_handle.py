"""One request submitted to the engine (retrace/runtime/serving_engine.py), as its caller sees it.

The engine thread pushes the request's events (``token_ids``, ``text``, ``finished``: what each round
committed) into its handle; the caller reads them from any thread or event loop:

    async for ev in handle: ...          # asyncio streaming (a cancelled consumer task cancels the request)
    result = await handle                # asyncio, the whole Result
    for ev in handle: ...                # blocking streaming
    result = handle.result(timeout)      # blocking, the whole Result
    handle.cancel()                      # thread-safe; the slot is free after the current round

Errors (all RetraceError, so a server maps each to one status): EngineFull (the queue is full),
EngineClosed (shutting down), RequestRejected (the runtime refused the request), RequestCancelled,
EngineFailure (a round raised).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

from retrace.errors import RetraceError
from retrace.runtime.api import Result
from retrace.runtime.serving_protocol import ServedRequest


class EngineFull(RetraceError):
    """The engine's queue of waiting requests is full (back-pressure: retry later)."""


class EngineClosed(RetraceError):
    """The engine is shutting down (or was never started) and takes no new requests."""


class RequestRejected(RetraceError):
    """The runtime refused the request (a bad prompt, a length over the limits, ...)."""


class RequestCancelled(RetraceError):
    """The request was cancelled before it finished."""


class EngineFailure(RetraceError):
    """A scheduler round raised; every request of the round fails with this error."""


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Handle:
    """Thread-safe view of one request; the engine thread is its only writer."""

    def __init__(self, engine: Any, prompt_ids: list[int], params: Any, mode: str, listener: Any = None):
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.mode = mode
        self.listener = listener  # optional: on_event(handle, ev), on_error(handle, err), is_cancelled()
        self.request: ServedRequest | None = None  # the scheduler's request, once the engine thread added it
        self.token_ids: list[int] = []
        self.text = ""
        self.error: RetraceError | None = None
        self.batch_hist: collections.Counter = collections.Counter()  # rows in the rounds it took part in
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self._result: Result | None = None
        self._events: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._cancel_asked = False
        self._done = False

    # -- caller side ------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    @property
    def max_batch_seen(self) -> int:
        return max(self.batch_hist, default=0)

    def cancel(self) -> None:
        """Ask the engine to drop this request (no-op once it finished)."""
        if not self._done:
            self._cancel_asked = True
            self.engine._wake()

    def result(self, timeout: float | None = None) -> Result:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request not finished within {timeout} s")
        return self._outcome()

    def __iter__(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._events or self._done)
                ev = self._events.popleft() if self._events else None
            if ev is None:
                self._end_of_stream()
                return
            yield ev

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            fut = None
            with self._cond:
                if self._events:
                    return self._events.popleft()
                if not self._done:
                    loop = asyncio.get_running_loop()
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if fut is None:
                self._end_of_stream()
                raise StopAsyncIteration
            try:
                await fut
            except asyncio.CancelledError:  # the consumer went away (e.g. an HTTP client hung up)
                self.cancel()
                raise

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Result:
        try:
            while True:
                with self._cond:
                    if self._done:
                        break
                    loop = asyncio.get_running_loop()
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
                await fut
        except asyncio.CancelledError:
            self.cancel()
            raise
        return self._outcome()

    def _outcome(self) -> Result:
        if self.error is not None:
            raise self.error
        assert self._result is not None
        return self._result

    def _end_of_stream(self) -> None:
        """Iteration ends quietly after the last event, or after a cancellation; other errors raise."""
        if self.error is not None and not isinstance(self.error, RequestCancelled):
            raise self.error

    # -- engine side (engine thread only) ---------------------------------------------------------------
    def _push(self, ev: Any, batch: int) -> None:
        now = time.monotonic()
        new = [int(t) for t in (ev.token_ids or ())]
        if new and self.t_first is None:
            self.t_first = now
        self.token_ids.extend(new)
        self.text += ev.text or ""
        self.batch_hist[batch] += 1
        if ev.finished:
            self.t_end = now
            d = self.request.result()
            text = d.get("text")
            self._result = Result(list(d.get("token_ids", self.token_ids)), text if text is not None else None,
                                  d.get("finish_reason"), dict(d.get("stats") or {}))
        with self._cond:
            self._events.append(ev)
            if ev.finished:
                self._done = True
            self._notify()

    def _fail(self, error: RetraceError) -> None:
        self.t_end = time.monotonic()
        with self._cond:
            self.error = error
            self._done = True
            self._notify()

    def _notify(self) -> None:  # holds self._cond
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass
