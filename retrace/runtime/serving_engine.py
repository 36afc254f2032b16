"""One thread-safe serving engine: a background thread runs the scheduler; any thread or event loop submits.

    engine = ServingEngine(Runtime.from_bundle(bundle, max_batch=8)).start()
    handle = engine.submit("prompt", SamplingParams(max_new_tokens=64), mode="retrace")   # thread-safe
    async for ev in handle: print(ev.text, end="")      # or: result = await handle
    engine.shutdown()                                   # finishes in-flight requests, joins the thread

The thread owns the scheduler (retrace/runtime/loop.py): between rounds it adds the submitted requests
(they join the running batch), drops cancelled ones (their slot is free for the next round), runs one
``step()`` for all of them and pushes each request's events into its :class:`Handle`. Back-pressure:
at most ``max_queue`` requests wait beyond the batch slots; ``submit`` raises :class:`EngineFull` past
that. Every finished request (cancelled ones too) is counted in :attr:`metrics` (ServingMetrics).

The engine owns the runtime's scheduler: while it runs, do not call the runtime's generate/stream too.
What it needs from the runtime is typed in runtime/serving_protocol.py (ServableRuntime: ``scheduler()``
with check/add/step/cancel, ``codec``, ``backend.max_batch``), so the Triton model's stand-in runtime runs
on the same engine (retrace/export/triton/serving.py).

"Engine" alone means three things in this project: an engine bundle (retrace.engines.bundle, the
`--engine` directory), this serving engine, and a TensorRT engine (a `.plan`, retrace.export.tensorrt).
This class is `ServingEngine`; `Engine` is the same class under the name the embedding API documents
(`from retrace.runtime import Engine`).
"""

from __future__ import annotations

import numbers
import threading
import traceback
from collections.abc import Callable
from typing import Any

from retrace.errors import RetraceError
from retrace.request_validation import check_prompt_text
from retrace.runtime.sampling_params import SamplingParams
from retrace.runtime.serving_handle import (
    EngineClosed,
    EngineFailure,
    EngineFull,
    Handle,
    RequestCancelled,
    RequestRejected,
)
from retrace.runtime.serving_metrics import ServingMetrics
from retrace.runtime.serving_protocol import ServableRuntime, ServingScheduler


class ServingEngine:
    def __init__(self, runtime: ServableRuntime, *, max_queue: int = 1024, metrics: ServingMetrics | None = None,
                 log: Callable[[str], None] | None = None, idle_wait_s: float = 0.5):
        if max_queue < 0:
            raise RetraceError(f"max_queue must be >= 0, got {max_queue}")
        self.runtime = runtime
        self.sched: ServingScheduler = runtime.scheduler()
        self.codec = runtime.codec
        self.max_batch = int(runtime.backend.max_batch) or 1
        self.max_queue = max_queue
        self.metrics = metrics or ServingMetrics()
        self.log = log or (lambda m: None)
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._incoming: list[Handle] = []
        self._active: dict[int, Handle] = {}  # id(scheduler request) -> handle
        self._outstanding = 0  # submitted and not finished (guarded by _cv)
        self._accepting = False
        self._drain = True
        self._stop = False
        self._thread: threading.Thread | None = None
        # counters (read by servers and tests)
        self.max_batch_seen = 0
        self.rounds = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0

    @classmethod
    def from_bundle(cls, bundle_dir: str, backend: str = "onnxruntime", *, max_queue: int = 1024,
                    **runtime_kwargs) -> ServingEngine:
        from retrace.runtime.api import Runtime

        return cls(Runtime.from_bundle(bundle_dir, backend=backend, **runtime_kwargs), max_queue=max_queue)

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> ServingEngine:
        with self._cv:
            if self._thread is not None:
                raise RetraceError("the engine is already started" if self._thread.is_alive() else
                                   "the engine was shut down and cannot start again: create a new Engine")
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="retrace-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop taking requests; finish the in-flight ones (drain) or fail them with EngineClosed; join.
        A drain that takes longer than ``timeout`` fails what is left."""
        with self._cv:
            self._accepting = False
            self._drain = drain
            self._stop = self._stop or not drain
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                self.log(f"engine did not drain within {timeout} s; failing outstanding requests")
                with self._cv:
                    self._stop = True
                    self._cv.notify_all()
                t.join(timeout)

    def __enter__(self) -> ServingEngine:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text (checked by its size before the tokenizer reads it) or token ids (a list, tuple or 1-D
        array of integers) -> ids; anything else is RequestRejected."""
        if isinstance(prompt, str):
            if self.codec is None:
                raise RequestRejected("this model has no tokenizer: send token ids instead of text")
            try:
                check_prompt_text(prompt)
            except RetraceError as e:
                raise RequestRejected(str(e)) from None
            ids = [int(t) for t in self.codec.encode(prompt)]
            if not ids:
                raise RequestRejected("the prompt text tokenizes to an empty prompt")
            return ids
        ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt  # numpy / torch
        if not isinstance(ids, list | tuple) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                         for t in ids):
            raise RequestRejected(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}")
        return [int(t) for t in ids]

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, mode: str = "retrace", *,
               listener: Any = None) -> Handle:
        """Queue one request; thread-safe and non-blocking. Raises RequestRejected (bad request: checked here,
        by the scheduler's stateless check), EngineFull, EngineClosed."""
        if params is None:
            params = SamplingParams()
        ids = self.encode(prompt)
        try:
            params.validate()  # again: fields may have changed since it was built
            self.sched.check(ids, params, mode)
        except RetraceError as e:
            raise RequestRejected(str(e)) from None
        handle = Handle(self, ids, params, mode, listener)
        with self._cv:
            if not self._accepting:
                raise EngineClosed("the engine is shutting down" if self._thread else "the engine is not started")
            if self._outstanding >= self.max_batch + self.max_queue:
                raise EngineFull(f"the engine is full: {self._outstanding} requests in flight "
                                 f"({self.max_batch} batch slots + a queue of {self.max_queue}); retry later")
            self._outstanding += 1
            self._incoming.append(handle)
            self._cv.notify_all()
        return handle

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            pending = len(self._incoming)
            outstanding = self._outstanding
        return {"max_batch_seen": self.max_batch_seen, "rounds": self.rounds, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "outstanding": outstanding,
                "active": len(self._active), "pending": pending}

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if not (self._incoming or self._active or self._stop or not self._accepting):
                        self._cv.wait(self.idle_wait_s)
                    incoming, self._incoming = self._incoming, []
                    stop = self._stop or (not self._accepting and not self._drain)
                    idle_closed = not self._accepting and not incoming and not self._active
                for h in incoming:
                    self._add(h)
                if stop or idle_closed:
                    break
                self._drop_cancelled()
                if self._active:
                    self._round()
        except Exception:  # a bug in here must never leave clients waiting
            self.log("engine thread crashed:\n" + traceback.format_exc())
        finally:
            with self._cv:
                self._accepting = False
                incoming, self._incoming = self._incoming, []
            for h in incoming + list(self._active.values()):
                self._close(h, EngineClosed("the engine is shutting down"))

    def _add(self, h: Handle) -> None:
        try:
            h.request = self.sched.add(h.prompt_ids, h.params, h.mode)
        except Exception as e:
            self._close(h, RequestRejected(f"the runtime rejected the request: {e}"))
            return
        self._active[id(h.request)] = h

    def _drop_cancelled(self) -> None:
        for h in list(self._active.values()):
            if h._cancel_asked or self._listener_cancelled(h):
                self._close(h, RequestCancelled("the request was cancelled"))

    def _listener_cancelled(self, h: Handle) -> bool:
        fn = getattr(h.listener, "is_cancelled", None)
        if fn is None:
            return False
        try:
            return bool(fn())
        except BaseException:  # noqa: BLE001 - whatever a listener raises (SystemExit too) ends only its request
            return True  # the client's channel is gone: a hang-up

    def _round(self) -> None:
        try:
            events = list(self.sched.step() or ())
        except Exception as e:
            self.log("scheduler round failed:\n" + traceback.format_exc())
            err = EngineFailure(f"the runtime failed: {type(e).__name__}: {e}")
            for h in list(self._active.values()):
                self._close(h, err)
            return
        self.rounds += 1
        n = len(events)
        self.max_batch_seen = max(self.max_batch_seen, n)
        for ev in events:
            h = self._active.get(id(ev.request))
            if h is None:
                continue
            if ev.finished and ev.request.error:  # it failed alone; its batch-mates go on
                self._close(h, RequestRejected(ev.request.error))
                continue
            if ev.finished:  # counted before its caller can see the end, so a scrape after it agrees
                del self._active[id(ev.request)]
                self.completed += 1
                self._observe(h)
            h._push(ev, n)
            delivered = self._notify_listener(h, ev)
            if ev.finished:
                self._finished(h)
            elif not delivered:
                self._close(h, RequestCancelled("the client went away"))

    def _notify_listener(self, h: Handle, ev: Any) -> bool:
        fn = getattr(h.listener, "on_event", None)
        if fn is None:
            return True
        try:
            fn(h, ev)
            return True
        except BaseException as e:  # noqa: BLE001 - SystemExit from a listener must not end the engine thread
            self.log(f"listener failed ({type(e).__name__}: {e}); cancelling the request")
            return False

    def _close(self, h: Handle, error: RetraceError) -> None:
        """End a request that did not finish normally: free its slot, tell its caller, count it."""
        self._active.pop(id(h.request), None)
        if h.request is not None and not h.request.finished:
            try:
                self.sched.cancel(h.request)
            except Exception as e:
                self.log(f"cancel failed: {type(e).__name__}: {e}")
        if h.done:
            return
        if isinstance(error, RequestCancelled):
            self.cancelled += 1
        else:
            self.failed += 1
        self._observe(h)
        h._fail(error)
        fn = getattr(h.listener, "on_error", None)
        if fn is not None:
            try:
                fn(h, error)
            except BaseException as e:  # noqa: BLE001
                self.log(f"listener on_error failed: {type(e).__name__}: {e}")
        self._finished(h)

    def _finished(self, h: Handle) -> None:
        with self._cv:
            self._outstanding -= 1

    def _observe(self, h: Handle) -> None:
        if h.request is not None:
            try:
                d = h.request.result()
                reason = d.get("finish_reason") or h.request.finish_reason
                self.metrics.observe(h.mode, dict(d.get("stats") or {}), reason)
            except Exception as e:
                self.log(f"metrics: {type(e).__name__}: {e}")


Engine = ServingEngine  # the embedding API's name for it (README: `from retrace.runtime import Engine`)
