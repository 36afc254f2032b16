"""The serving loop behind the Triton model: requests join and leave the runtime's scheduler between rounds.

Nothing here imports Triton; ``model.py`` (the python-backend model) feeds validated requests in and
wraps each request's response sender in a :class:`Sink`. One background thread owns the runtime: it
admits queued requests up to ``max_batch`` active ones, runs one scheduler round (``sched.step()``) for
all of them together, sends each request's newly committed tokens, drops requests whose client hung up
(``Sink.is_cancelled``), and on :meth:`ServingLoop.stop` finishes every outstanding request with an error
so the server can exit.

RUNTIME INTEGRATION POINT: :func:`create_runtime` is the one place where the runtime is created, and
:class:`RuntimeAdapter` the one place that calls it. The calls follow ``docs/INTERFACES.md``::

    rt = retrace.runtime.Runtime.from_bundle(bundle_dir, backend="onnxruntime", max_batch=N)
    sched = rt.scheduler(mode)                     # one per mode, created on first use
    rid = sched.add(prompt_ids_or_text, retrace.runtime.SamplingParams(max_new_tokens, temperature,
                                                                        top_p, top_k, seed, stop=[...]))
    for ev in sched.step():                        # one round for every active request
        ev.request_id, ev.token_ids (committed this round), ev.finished, ev.stats (dict)
    sched.cancel(rid)                              # client hung up: free the slot
    rt.tokenizer.encode(text) / .decode(ids)       # optional; used for prompt checks and detokenization

Events may be objects or dicts; ``finish_reason`` and ``text`` are used when present.
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
from collections.abc import Callable, Iterable
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
) -> Any:
    """Create the runtime that serves ``bundle_dir``. THE single place the real runtime is created.

    ``factory`` ("module:callable", called as ``f(bundle_dir, backend=..., max_batch=..., **options)``)
    replaces it; the tests use it to load the stand-in runtime of :mod:`retrace.export.triton.standin`.
    """
    if factory:
        return _import_callable(factory)(str(bundle_dir), backend=backend, max_batch=max_batch, **(options or {}))
    from retrace.runtime import Runtime  # imported here: only the real deployment needs torch/onnxruntime

    return Runtime.from_bundle(str(bundle_dir), backend=backend, max_batch=max_batch, **(options or {}))


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


class RuntimeAdapter:
    """Every call into the runtime goes through here (see the module docstring for the expected API)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self._scheds: dict[str, Any] = {}
        tok = getattr(runtime, "tokenizer", None)
        self.tokenizer = tok if tok is not None and hasattr(tok, "encode") and hasattr(tok, "decode") else None
        params_cls = getattr(runtime, "SamplingParams", None)
        if params_cls is None:
            from retrace.runtime import SamplingParams as params_cls  # noqa: N813
        self._params_cls = params_cls

    # limits the runtime knows better than the manifest
    @property
    def max_seq_len(self) -> int | None:
        v = getattr(self.rt, "max_seq_len", None)
        return int(v) if isinstance(v, int) else None

    @property
    def vocab_size(self) -> int | None:
        v = getattr(self.rt, "vocab_size", None)
        if v is None:
            v = getattr(getattr(self.rt, "target_config", None), "vocab_size", None)
        return int(v) if isinstance(v, int) else None

    def encode(self, text: str) -> list[int] | None:
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.encode(text)
        return list(getattr(ids, "ids", ids))

    def decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids)

    def scheduler(self, mode: str) -> Any:
        if mode not in self._scheds:
            self._scheds[mode] = self.rt.scheduler(mode)
        return self._scheds[mode]

    def drop_scheduler(self, mode: str) -> None:
        self._scheds.pop(mode, None)

    def add(self, mode: str, prompt: str | list[int], spec: RequestSpec) -> Any:
        return self.scheduler(mode).add(prompt, self._params_cls(**spec.sampling_kwargs()))

    def step(self, mode: str) -> Iterable[Any]:
        return self.scheduler(mode).step() or ()

    def cancel(self, mode: str, rid: Any) -> None:
        sched = self._scheds.get(mode)
        if sched is None:
            return
        for name in ("cancel", "remove", "release"):
            fn = getattr(sched, name, None)
            if fn is not None:
                fn(rid)
                return

    def close(self) -> None:
        for fn_name in ("close", "shutdown"):
            fn = getattr(self.rt, fn_name, None)
            if callable(fn):
                fn()
                return


# ------------------------------------------------------------------------------------------------ loop
class Sink(Protocol):
    """Where one request's responses go (model.py wraps Triton's response sender in one)."""

    def send(self, token_ids: list[int], text: str, stats: dict[str, Any] | None, final: bool) -> None: ...

    def error(self, message: str, kind: str = "internal") -> None:
        """``kind``: "invalid" (bad request), "unavailable" (shutting down) or "internal"."""

    def is_cancelled(self) -> bool: ...


@dataclasses.dataclass(eq=False)
class Job:
    spec: RequestSpec
    sink: Sink
    prompt: str | list[int] | None = None
    prompt_len: int | None = None
    rid: Any = None
    ids: list[int] = dataclasses.field(default_factory=list)
    text_sent: str = ""
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
        self._active: dict[tuple[str, Any], Job] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        # counters (read by tests / logs)
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
        self.adapter.close()

    def snapshot(self) -> dict[str, int]:
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
                if not self._active:
                    if self._pending:  # nothing admitted although requests wait: back off briefly
                        time.sleep(self.idle_wait_s)
                    continue
                for mode in sorted({m for m, _ in self._active}):
                    self._round(mode)
        except Exception:  # never leave clients hanging on a loop bug
            self.log("serving loop crashed:\n" + traceback.format_exc())
        finally:
            self._fail_all("the model is shutting down", "unavailable")

    def _fail_all(self, message: str, kind: str) -> None:
        with self._cv:
            jobs = list(self._incoming) + list(self._pending)
            self._incoming.clear()
            self._pending.clear()
        for (mode, rid), job in list(self._active.items()):
            self._safe(lambda m=mode, r=rid: self.adapter.cancel(m, r))
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
            keep = collections.deque()
            for job in self._pending:
                if self._cancelled(job):
                    self.cancelled += 1
                else:
                    keep.append(job)
            self._pending = keep
        for key, job in list(self._active.items()):
            if self._cancelled(job):
                self._release(key, cancelled=True)

    def _release(self, key: tuple[str, Any], cancelled: bool) -> None:
        job = self._active.pop(key, None)
        if job is None:
            return
        self._safe(lambda: self.adapter.cancel(*key))
        if cancelled:
            self.cancelled += 1
            self.log(f"request {key[1]} cancelled by the client after {len(job.ids)} tokens; slot freed")

    def _prepare(self, job: Job) -> str | None:
        """Tokenize a text prompt where the runtime has a tokenizer; return an error message or None."""
        spec = job.spec
        if spec.prompt_ids is not None:
            job.prompt, job.prompt_len = list(spec.prompt_ids), len(spec.prompt_ids)
        else:
            assert spec.prompt_text is not None
            ids = self.adapter.encode(spec.prompt_text)
            if ids is None:
                job.prompt = spec.prompt_text
            else:
                if not ids:
                    return "input 'text_input' tokenizes to an empty prompt"
                job.prompt, job.prompt_len = ids, len(ids)
        msl = self.limits.max_seq_len
        if msl is not None and job.prompt_len is not None and job.prompt_len + spec.max_tokens > msl:
            return (f"prompt ({job.prompt_len} tokens) + 'max_tokens' ({spec.max_tokens}) exceeds the maximum "
                    f"sequence length {msl}")
        return None

    def _admit(self) -> None:
        while self._pending and len(self._active) < self.max_batch:
            job = self._pending.popleft()
            problem = self._prepare(job)
            if problem is None:
                try:
                    assert job.prompt is not None
                    job.rid = self.adapter.add(job.spec.mode, job.prompt, job.spec)
                except Exception as e:
                    problem = f"the runtime rejected the request: {type(e).__name__}: {e}"
            if problem is not None:
                self.failed += 1
                self._safe(lambda j=job, p=problem: j.sink.error(p, "invalid"))
                continue
            self._active[(job.spec.mode, job.rid)] = job

    def _round(self, mode: str) -> None:
        members = {rid: job for (m, rid), job in self._active.items() if m == mode}
        if not members:
            return
        n = len(members)
        try:
            events = list(self.adapter.step(mode))
        except Exception as e:
            self.log(f"runtime step failed for mode {mode!r}:\n" + traceback.format_exc())
            msg = f"the runtime failed: {type(e).__name__}: {e}"
            self.adapter.drop_scheduler(mode)
            for rid, job in members.items():
                self._active.pop((mode, rid), None)
                self.failed += 1
                self._safe(lambda j=job: j.sink.error(msg, "internal"))
            return
        self.rounds += 1
        self.max_batch_seen = max(self.max_batch_seen, n)
        for job in members.values():
            job.batch_hist[n] += 1
        for ev in events:
            rid = _get(ev, "request_id")
            job = members.get(rid)
            if job is None or (mode, rid) not in self._active:
                continue  # cancelled meanwhile, or an event for a request we do not know
            self._deliver(mode, rid, job, ev)

    def _deliver(self, mode: str, rid: Any, job: Job, ev: Any) -> None:
        new_ids = [int(t) for t in (_get(ev, "token_ids") or ())]
        finished = bool(_get(ev, "finished", False))
        if new_ids and job.t_first is None:
            job.t_first = time.monotonic()
        job.ids.extend(new_ids)
        job.unsent_ids.extend(new_ids)
        stats = self._final_stats(job, ev) if finished else None
        if job.spec.stream or finished:
            full = self.adapter.decode(job.ids)
            if full is None:  # no tokenizer: the event's text is this round's delta
                full = job.text_sent + str(_get(ev, "text", "") or "")
            if job.spec.stream:
                # Hold back an incomplete multi-byte character until the next round completes it.
                if (job.unsent_ids or finished) and (finished or not full.endswith("\ufffd")):
                    delta = full[len(job.text_sent):]
                    ok = self._safe(lambda: job.sink.send(job.unsent_ids, delta, stats, finished))
                    job.text_sent, job.unsent_ids = full, []
                    if not ok:
                        self._release((mode, rid), cancelled=True)
                        return
            elif not self._safe(lambda: job.sink.send(job.ids, full, stats, True)):
                self._release((mode, rid), cancelled=True)
                return
        elif self.adapter.tokenizer is None:
            job.text_sent += str(_get(ev, "text", "") or "")
        if finished:
            self._active.pop((mode, rid), None)
            self.completed += 1

    def _final_stats(self, job: Job, ev: Any) -> dict[str, Any]:
        stats = dict(_get(ev, "stats") or {})
        rounds = stats.get("rounds")
        if "tau" not in stats and isinstance(rounds, int) and rounds > 0:
            stats["tau"] = len(job.ids) / rounds
        reason = _get(ev, "finish_reason") or stats.get("finish_reason")
        if reason is None:
            reason = "length" if len(job.ids) >= job.spec.max_tokens else "stop"
        now = time.monotonic()
        stats.update(
            mode=job.spec.mode,
            prompt_tokens=job.prompt_len,
            completion_tokens=len(job.ids),
            finish_reason=reason,
            max_batch_seen=max(job.batch_hist, default=0),
            batch_hist={str(k): v for k, v in sorted(job.batch_hist.items())},
            latency_s=round(now - job.t_submit, 6),
            ttft_s=None if job.t_first is None else round(job.t_first - job.t_submit, 6),
        )
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
