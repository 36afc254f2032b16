"""The serving loop behind the Triton model: requests join and leave the runtime's scheduler between rounds.

Nothing here imports Triton; ``model.py`` (the python-backend model) feeds validated requests in and
wraps each request's response sender in a :class:`Sink`. One background thread owns the runtime: it
admits queued requests up to ``max_batch`` active ones, runs one scheduler round (``sched.step()``) for
all of them together, sends each request's newly committed tokens, drops requests whose client hung up
(``Sink.is_cancelled``), and on :meth:`ServingLoop.stop` finishes every outstanding request with an error
so the server can exit.

RUNTIME INTEGRATION POINT: :func:`create_runtime` is the one place where the runtime is created, and
:class:`RuntimeAdapter` the one place that calls it (``retrace.runtime``, see docs/INTERFACES.md)::

    rt = Runtime.from_bundle(bundle_dir, backend="onnxruntime", max_batch=N)
    sched = rt.scheduler()                         # long-lived; requests join/leave between rounds
    req = sched.add(prompt_ids, SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, stop), mode)
    for ev in sched.step():                        # one round for every running request
        ev.request, ev.token_ids (committed this round), ev.text (visible text delta), ev.finished
    req.result()["stats"], req.finish_reason       # tau, rounds, accepted_hist, ...
    sched.cancel(req)                              # client hung up: frees the slot and suffix memory
    rt.codec.encode(text) / .decode(ids)           # None when the bundle has no tokenizer.json
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import math
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from retrace.export.triton.validation import Limits, RequestSpec

DEFAULT_BACKEND = "onnxruntime"


# --------------------------------------------------------------------------------------------- runtime
def read_manifest(bundle_dir: str | Path) -> dict[str, Any]:
    path = Path(bundle_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"engine bundle {bundle_dir} has no manifest.json")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _lookup(manifest: dict[str, Any], key: str) -> Any:
    """``key`` at the top level of the manifest or in one of its usual sections."""
    if key in manifest:
        return manifest[key]
    for section in ("limits", "runtime", "serving", "target", "config"):
        sub = manifest.get(section)
        if isinstance(sub, dict) and key in sub:
            return sub[key]
    return None


def bundle_limits(manifest: dict[str, Any]) -> dict[str, int | None]:
    """``max_seq_len``, ``max_new_tokens`` and ``vocab_size`` as far as the manifest states them."""
    out: dict[str, int | None] = {}
    for key in ("max_seq_len", "max_new_tokens", "vocab_size"):
        v = _lookup(manifest, key)
        out[key] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return out


def _import_callable(spec: str) -> Callable[..., Any]:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"runtime factory must be 'module:callable', got {spec!r}")
    return getattr(importlib.import_module(mod), attr)


def create_runtime(
    bundle_dir: str | Path,
    *,
    backend: str = DEFAULT_BACKEND,
    max_batch: int = 8,
    factory: str | None = None,
    options: dict[str, Any] | None = None,
    verify_policy: str = "adaptive",
) -> Any:
    """Create the runtime that serves ``bundle_dir``. THE single place the real runtime is created.

    ``factory`` ("module:callable", called as ``f(bundle_dir, backend=..., max_batch=..., **options)``)
    replaces it; the tests use it to load the stand-in runtime of :mod:`retrace.export.triton.standin`
    (which has no verify policy).
    """
    if factory:
        return _import_callable(factory)(str(bundle_dir), backend=backend, max_batch=max_batch, **(options or {}))
    from retrace.runtime import Runtime  # imported here: only the real deployment needs torch/onnxruntime

    return Runtime.from_bundle(str(bundle_dir), backend=backend, max_batch=max_batch, verify_policy=verify_policy,
                               **(options or {}))


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


class RuntimeAdapter:
    """Every call into the runtime goes through here (see the module docstring for the API it uses)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.backend = getattr(runtime, "backend", None)
        codec = getattr(runtime, "codec", None)
        self.codec = codec if codec is not None and hasattr(codec, "encode") and hasattr(codec, "decode") else None
        params_cls = getattr(runtime, "SamplingParams", None)
        if params_cls is None:
            from retrace.runtime import SamplingParams as params_cls  # noqa: N813
        self._params_cls = params_cls
        self._sched: Any = None

    @property
    def sched(self) -> Any:
        if self._sched is None:
            self._sched = self.rt.scheduler()
        return self._sched

    # limits the runtime knows better than the manifest
    @property
    def max_batch(self) -> int | None:
        return _int_or_none(getattr(self.backend, "max_batch", None))

    @property
    def max_seq_len(self) -> int | None:
        return _int_or_none(getattr(self.backend, "max_seq_len", None))

    @property
    def reserve(self) -> int:
        """Positions a request needs beyond prompt + max_tokens (the last draft block + its anchor)."""
        bs = _int_or_none(getattr(self.sched, "block_size", None))
        return bs + 1 if bs else 0

    @property
    def vocab_size(self) -> int | None:
        return _int_or_none(getattr(getattr(self.backend, "target_config", None), "vocab_size", None))

    @property
    def max_batch_seen(self) -> int | None:
        return _int_or_none(getattr(self._sched, "max_batch_seen", None))

    def encode(self, text: str) -> list[int] | None:
        return None if self.codec is None else [int(t) for t in self.codec.encode(text)]

    def add(self, prompt_ids: list[int], spec: RequestSpec) -> Any:
        return self.sched.add(prompt_ids, self._params_cls(**spec.sampling_kwargs()), spec.mode)

    def key(self, handle: Any) -> Any:
        return _get(handle, "rid", handle)

    def step(self) -> list[Any]:
        return list(self.sched.step() or ())

    def event_key(self, ev: Any) -> Any:
        return self.key(_get(ev, "request"))

    def request_stats(self, handle: Any) -> dict[str, Any]:
        result = getattr(handle, "result", None)
        stats = dict(result().get("stats") or {}) if callable(result) else {}
        reason = _get(handle, "finish_reason")
        if reason is not None:
            stats["finish_reason"] = reason
        return stats

    def cancel(self, handle: Any) -> None:
        if self._sched is not None:
            self._sched.cancel(handle)

    def close(self) -> None:
        fn = getattr(self.rt, "close", None)
        if callable(fn):
            fn()


# ------------------------------------------------------------------------------------------------ loop
class Sink(Protocol):
    """Where one request's responses go (model.py wraps Triton's response sender in one)."""

    def send(self, token_ids: list[int], text: str, stats: dict[str, Any] | None, final: bool) -> None: ...

    def error(self, message: str, kind: str = "internal") -> None:
        """Final error response; ``kind``: invalid (bad request), unavailable (shutting down), cancelled, internal."""

    def is_cancelled(self) -> bool: ...


@dataclasses.dataclass(eq=False)
class Job:
    spec: RequestSpec
    sink: Sink
    prompt_ids: list[int] | None = None
    handle: Any = None  # the runtime's request object
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # text delivered (stream) or gathered (non-stream) so far
    unsent_ids: list[int] = dataclasses.field(default_factory=list)
    batch_hist: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    t_submit: float = dataclasses.field(default_factory=time.monotonic)
    t_first: float | None = None


class ServingLoop:
    """Runs the runtime's scheduler on one background thread; see the module docstring."""

    def __init__(
        self,
        adapter: RuntimeAdapter,
        limits: Limits,
        *,
        max_batch: int,
        log: Callable[[str], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.adapter = adapter
        self.limits = limits
        self.max_batch = max(1, int(max_batch))
        self.log = log or (lambda m: None)
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._incoming: collections.deque[Job] = collections.deque()
        self._pending: collections.deque[Job] = collections.deque()
        self._active: dict[Any, Job] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        # counters (logged at shutdown, read by tests)
        self.max_batch_seen = 0
        self.rounds = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0

    # -- public ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="retrace-serving-loop", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop:
                job.sink.error("the model is shutting down", "unavailable")
                return
            self._incoming.append(job)
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.log(f"serving loop did not stop within {timeout} s; failing outstanding requests")
                self._fail_all("the model is shutting down", "unavailable")
        self._safe(self.adapter.close)

    def snapshot(self) -> dict[str, Any]:
        return {"max_batch_seen": self.max_batch_seen, "rounds": self.rounds, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "active": len(self._active),
                "pending": len(self._pending) + len(self._incoming)}

    # -- loop -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if not self._stop and not self._incoming and not self._active and not self._pending:
                        self._cv.wait(self.idle_wait_s)
                    if self._stop:
                        break
                    self._pending.extend(self._incoming)
                    self._incoming.clear()
                self._drop_cancelled()
                self._admit()
                if self._active:
                    self._round()
        except Exception:  # never leave clients hanging on a loop bug
            self.log("serving loop crashed:\n" + traceback.format_exc())
        finally:
            self._fail_all("the model is shutting down", "unavailable")

    def _fail_all(self, message: str, kind: str) -> None:
        with self._cv:
            jobs = list(self._incoming) + list(self._pending)
            self._incoming.clear()
            self._pending.clear()
        for job in list(self._active.values()):
            self._safe(lambda j=job: self.adapter.cancel(j.handle))
            jobs.append(job)
        self._active.clear()
        for job in jobs:
            self._safe(lambda j=job: j.sink.error(message, kind))

    def _safe(self, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except Exception as e:
            self.log(f"ignored error: {type(e).__name__}: {e}")
            return False

    def _cancelled(self, job: Job) -> bool:
        try:
            return bool(job.sink.is_cancelled())
        except Exception:
            return True  # the sender is gone: treat as a hang-up

    def _drop_cancelled(self) -> None:
        if self._pending:
            keep: collections.deque[Job] = collections.deque()
            for job in self._pending:
                if self._cancelled(job):
                    self._safe(lambda j=job: j.sink.error("the request was cancelled", "cancelled"))
                    self.cancelled += 1
                else:
                    keep.append(job)
            self._pending = keep
        for key, job in list(self._active.items()):
            if self._cancelled(job):
                self._release(key, cancelled=True)

    def _release(self, key: Any, cancelled: bool) -> None:
        job = self._active.pop(key, None)
        if job is None:
            return
        self._safe(lambda: self.adapter.cancel(job.handle))
        if cancelled:
            # Close the request with a FINAL response: Triton counts it as in flight until then (and would
            # not shut down cleanly); the client is gone, so nobody sees this error.
            self._safe(lambda: job.sink.error("the request was cancelled", "cancelled"))
            self.cancelled += 1
            self.log(f"request {key} cancelled by the client after {len(job.ids)} tokens; slot freed")

    def _prepare(self, job: Job) -> str | None:
        """Tokenize a text prompt and check its length; return an error message or None."""
        spec = job.spec
        if spec.prompt_ids is not None:
            job.prompt_ids = list(spec.prompt_ids)
        else:
            assert spec.prompt_text is not None
            ids = self.adapter.encode(spec.prompt_text)
            if ids is None:
                return "this model has no tokenizer: send token ids in 'input_ids' instead of 'text_input'"
            if not ids:
                return "input 'text_input' tokenizes to an empty prompt"
            job.prompt_ids = ids
        msl = self.limits.max_seq_len
        if msl is not None and len(job.prompt_ids) + spec.max_tokens > msl:
            return (f"prompt ({len(job.prompt_ids)} tokens) + 'max_tokens' ({spec.max_tokens}) exceeds the "
                    f"model's token budget of {msl} per request")
        return None

    def _admit(self) -> None:
        while self._pending and len(self._active) < self.max_batch:
            job = self._pending.popleft()
            problem = self._prepare(job)
            if problem is None:
                try:
                    assert job.prompt_ids is not None
                    job.handle = self.adapter.add(job.prompt_ids, job.spec)
                except Exception as e:
                    problem = f"the runtime rejected the request: {e}"
            if problem is not None:
                self.failed += 1
                self._safe(lambda j=job, p=problem: j.sink.error(p, "invalid"))
                continue
            self._active[self.adapter.key(job.handle)] = job

    def _round(self) -> None:
        n = len(self._active)
        try:
            events = self.adapter.step()
        except Exception as e:
            self.log("runtime step failed:\n" + traceback.format_exc())
            msg = f"the runtime failed: {type(e).__name__}: {e}"
            for job in list(self._active.values()):
                self._safe(lambda j=job: self.adapter.cancel(j.handle))
                self.failed += 1
                self._safe(lambda j=job: j.sink.error(msg, "internal"))
            self._active.clear()
            return
        self.rounds += 1
        self.max_batch_seen = max(self.max_batch_seen, n)
        for job in self._active.values():
            job.batch_hist[n] += 1
        for ev in events:
            key = self.adapter.event_key(ev)
            job = self._active.get(key)
            if job is not None:  # None: cancelled meanwhile
                self._deliver(key, job, ev)

    def _deliver(self, key: Any, job: Job, ev: Any) -> None:
        new_ids = [int(t) for t in (_get(ev, "token_ids") or ())]
        finished = bool(_get(ev, "finished", False))
        delta = str(_get(ev, "text", "") or "")  # the runtime holds back partial characters / stop strings
        if new_ids and job.t_first is None:
            job.t_first = time.monotonic()
        job.ids.extend(new_ids)
        job.unsent_ids.extend(new_ids)
        job.text += delta
        stats = self._final_stats(job) if finished else None
        if job.spec.stream:
            if job.unsent_ids or delta or finished:
                ok = self._safe(lambda: job.sink.send(job.unsent_ids, delta, stats, finished))
                job.unsent_ids = []
                if not ok:
                    self._release(key, cancelled=True)
                    return
        elif finished and not self._safe(lambda: job.sink.send(job.ids, job.text, stats, True)):
            self._release(key, cancelled=True)
            return
        if finished:
            self._active.pop(key, None)
            self.completed += 1

    def _final_stats(self, job: Job) -> dict[str, Any]:
        stats = self.adapter.request_stats(job.handle)
        stats.setdefault("finish_reason", "length" if len(job.ids) >= job.spec.max_tokens else "stop")
        now = time.monotonic()
        stats.update(
            mode=job.spec.mode,
            prompt_tokens=len(job.prompt_ids or ()),
            completion_tokens=len(job.ids),
            max_batch_seen=max(job.batch_hist, default=0),
            batch_hist={str(k): v for k, v in sorted(job.batch_hist.items())},
            scheduler_max_batch_seen=self.adapter.max_batch_seen,
            latency_s=round(now - job.t_submit, 6),
            ttft_s=None if job.t_first is None else round(job.t_first - job.t_submit, 6),
        )
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
