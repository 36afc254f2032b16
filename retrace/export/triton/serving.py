"""The serving loop behind the Triton model: a thin adapter over the one engine (retrace/runtime/serving_engine.py).

Nothing here imports Triton; ``model.py`` (the python-backend model) feeds validated requests in and
wraps each request's response sender in a :class:`Sink`. :class:`ServingLoop` tokenizes and checks each
job against the model's limits, submits it to the engine (whose background thread runs the runtime's
scheduler: requests join and leave between rounds), and turns the engine's events into the job's
responses (one per commit when streaming, one final otherwise). A client that hung up
(``Sink.is_cancelled``) is dropped before the next round; :meth:`ServingLoop.stop` fails every
outstanding request with an error so the server can exit.

RUNTIME INTEGRATION POINT: :func:`create_runtime` is the one place where the runtime is created; the
engine and :class:`RuntimeAdapter` use it through ``retrace.runtime``'s serving API (docs/INTERFACES.md)::

    rt = Runtime.from_bundle(bundle_dir, backend="onnxruntime", max_batch=N)
    sched = rt.scheduler()                         # long-lived; requests join/leave between rounds
    req = sched.add(prompt_ids, SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, stop), mode)
    for ev in sched.step():                        # one round for every running request
        ev.request, ev.token_ids (committed this round), ev.text (visible text delta), ev.finished
    req.result()["stats"], req.finish_reason       # tau, rounds, accepted_hist, ...
    sched.cancel(req)                              # client hung up: frees the slot and suffix memory
    rt.codec.encode(text) / .decode(ids)           # None when the bundle has no tokenizer.json

The seam is typed in retrace/runtime/serving_protocol.py (ServableRuntime); the stand-in runtime of
:mod:`retrace.export.triton.standin` implements it without a model.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from retrace.errors import RetraceError
from retrace.export.triton.validation import Limits, RequestSpec
from retrace.runtime.sampling_params import SamplingParams
from retrace.runtime.serving_engine import ServingEngine
from retrace.runtime.serving_handle import EngineClosed, EngineFull, Handle, RequestCancelled, RequestRejected
from retrace.runtime.serving_protocol import ServableRuntime, ServedEvent, ServingScheduler

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
) -> ServableRuntime:
    """Create the runtime that serves ``bundle_dir``. THE single place the real runtime is created.

    ``factory`` ("module:callable", called as ``f(bundle_dir, backend=..., max_batch=..., **options)``)
    replaces it; the tests use it to load the stand-in runtime of :mod:`retrace.export.triton.standin`
    (which has no verify policy).
    """
    if factory:
        return _import_callable(factory)(str(bundle_dir), backend=backend, max_batch=max_batch, **(options or {}))
    from retrace.runtime import Runtime  # imported here: only the real deployment needs torch/onnxruntime
    from retrace.runtime.options import RuntimeOptions

    fields, backend_kwargs = RuntimeOptions.split(options or {})  # a server's defaults (RuntimeOptions.serving)
    return Runtime.from_bundle(str(bundle_dir), backend=backend, options=RuntimeOptions.of(
        max_batch=max_batch, verify_policy=verify_policy, **fields).serving(), **backend_kwargs)


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


class RuntimeAdapter:
    """What the Triton model needs to know about the runtime (limits, tokenizer), read through the typed
    seam of retrace/runtime/serving_protocol.py; requests carry the one SamplingParams."""

    def __init__(self, runtime: ServableRuntime) -> None:
        self.rt = runtime
        self.backend = runtime.backend
        self.codec = runtime.codec

    @property
    def sched(self) -> ServingScheduler:
        return self.rt.scheduler()

    # limits the runtime knows better than the manifest
    @property
    def max_batch(self) -> int | None:
        return _int_or_none(self.backend.max_batch)

    @property
    def max_seq_len(self) -> int | None:
        return _int_or_none(self.backend.max_seq_len)

    @property
    def reserve(self) -> int:
        """Positions a request needs beyond prompt + max_tokens (the last draft block + its anchor)."""
        bs = _int_or_none(self.sched.block_size)
        return bs + 1 if bs else 0

    @property
    def vocab_size(self) -> int | None:
        return _int_or_none(self.backend.target_config.vocab_size)

    @property
    def eos_ids(self) -> tuple[int, ...] | None:
        eos = self.backend.target_config.eos_token_ids
        return tuple(int(t) for t in eos) if eos else None

    @property
    def drafter_block_size(self) -> int | None:
        """The drafter's block (None: a target-only runtime)."""
        dc = self.backend.drafter_config
        return None if dc is None else _int_or_none(dc.block_size)

    @property
    def max_batch_seen(self) -> int | None:
        return _int_or_none(self.sched.max_batch_seen)

    def encode(self, text: str) -> list[int] | None:
        return None if self.codec is None else [int(t) for t in self.codec.encode(text)]

    def params(self, spec: RequestSpec) -> SamplingParams:
        return SamplingParams(**spec.sampling_kwargs())

    def request_stats(self, handle: Handle) -> dict[str, Any]:
        stats = dict(handle.request.result().get("stats") or {}) if handle.request is not None else {}
        reason = handle.request.finish_reason if handle.request is not None else None
        if reason is not None:
            stats["finish_reason"] = reason
        return stats


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
    handle: Handle | None = None  # the engine's handle
    text: str = ""  # text delivered (stream) or gathered (non-stream) so far
    unsent_ids: list[int] = dataclasses.field(default_factory=list)


# engine errors -> (the message the client gets or None for the error's own, Sink.error kind)
_ERROR_KINDS = ((RequestCancelled, "the request was cancelled", "cancelled"),
                (EngineClosed, "the model is shutting down", "unavailable"),
                (EngineFull, None, "unavailable"),
                (RequestRejected, None, "invalid"))


class ServingLoop:
    """Serves Triton jobs on the one engine (retrace/runtime/serving_engine.py); see the module docstring."""

    def __init__(
        self,
        adapter: RuntimeAdapter,
        limits: Limits,
        *,
        max_batch: int,
        log: Callable[[str], None] | None = None,
        max_queue: int = 4096,
    ) -> None:
        self.adapter = adapter
        self.limits = limits
        self.max_batch = max(1, int(max_batch))
        self.log = log or (lambda m: None)
        self.engine = ServingEngine(adapter.rt, max_queue=max_queue, log=self.log)
        self.metrics = self.engine.metrics
        self.invalid = 0  # refused before reaching the engine

    # -- public ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()

    def submit(self, job: Job) -> None:
        problem = self._prepare(job)
        if problem is not None:
            self.invalid += 1
            self._safe(lambda: job.sink.error(problem, "invalid"))
            return
        try:
            assert job.prompt_ids is not None
            job.handle = self.engine.submit(job.prompt_ids, self.adapter.params(job.spec), job.spec.mode,
                                            listener=_JobListener(self, job))
        except RetraceError as e:
            message, kind = self._error_reply(e)
            if isinstance(e, RequestRejected):
                message = f"the runtime rejected the request: {e}"
            self._safe(lambda: job.sink.error(message, kind))
        except Exception as e:
            message = f"the runtime rejected the request: {e}"
            self._safe(lambda: job.sink.error(message, "invalid"))

    def stop(self, timeout: float = 30.0) -> None:
        """Fail every outstanding request with 'the model is shutting down' (so the server can exit)."""
        self.engine.shutdown(drain=False, timeout=timeout)

    def snapshot(self) -> dict[str, Any]:
        snap = self.engine.snapshot()
        snap["failed"] += self.invalid
        return snap

    @property
    def max_batch_seen(self) -> int:
        return self.engine.max_batch_seen

    @property
    def rounds(self) -> int:
        return self.engine.rounds

    @property
    def completed(self) -> int:
        return self.engine.completed

    @property
    def cancelled(self) -> int:
        return self.engine.cancelled

    @property
    def failed(self) -> int:
        return self.engine.failed + self.invalid

    # -- pieces ---------------------------------------------------------------------------------------
    def _safe(self, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except Exception as e:
            self.log(f"ignored error: {type(e).__name__}: {e}")
            return False

    @staticmethod
    def _error_reply(err: Exception) -> tuple[str, str]:
        for cls, message, kind in _ERROR_KINDS:
            if isinstance(err, cls):
                return message or str(err), kind
        return str(err), "internal"

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

    def _final_stats(self, job: Job, h: Handle) -> dict[str, Any]:
        stats = self.adapter.request_stats(h)
        stats.setdefault("finish_reason", "length" if len(h.token_ids) >= job.spec.max_tokens else "stop")
        now = time.monotonic()
        stats.update(
            mode=job.spec.mode,
            prompt_tokens=len(job.prompt_ids or ()),
            completion_tokens=len(h.token_ids),
            max_batch_seen=h.max_batch_seen,
            batch_hist={str(k): v for k, v in sorted(h.batch_hist.items())},
            scheduler_max_batch_seen=self.adapter.max_batch_seen,
            latency_s=round(now - h.t_submit, 6),
            ttft_s=None if h.t_first is None else round(h.t_first - h.t_submit, 6),
        )
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}


class _JobListener:
    """Serving-engine listener of one job: runs on the engine thread and answers through the job's sink."""

    def __init__(self, loop: ServingLoop, job: Job) -> None:
        self.loop, self.job = loop, job

    def is_cancelled(self) -> bool:
        return bool(self.job.sink.is_cancelled())

    def on_event(self, h: Handle, ev: ServedEvent) -> None:  # raising: the client is gone (the engine cancels)
        job = self.job
        new_ids = [int(t) for t in ev.token_ids]
        delta = ev.text  # the runtime holds back partial characters / stop strings
        finished = ev.finished
        job.unsent_ids.extend(new_ids)
        job.text += delta
        stats = self.loop._final_stats(job, h) if finished else None
        if job.spec.stream:
            if job.unsent_ids or delta or finished:
                ids, job.unsent_ids = job.unsent_ids, []
                job.sink.send(ids, delta, stats, finished)
        elif finished:
            job.sink.send(list(h.token_ids), job.text, stats, True)

    def on_error(self, h: Handle, err: Exception) -> None:
        # A cancelled request is closed with a FINAL response too: Triton counts it as in flight until
        # then (and would not shut down cleanly); the client is gone, so nobody sees this error.
        if isinstance(err, RequestCancelled):
            self.loop.log(f"request {h.request.rid if h.request is not None else '?'} cancelled by the client after "
                          f"{len(h.token_ids)} tokens; slot freed")
        self.job.sink.error(*self.loop._error_reply(err))
