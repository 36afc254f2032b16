"""The OpenAI-compatible routes over one engine: /v1/models, /v1/completions, /v1/chat/completions (SSE
streaming with ``data: [DONE]``), /health and /metrics. Errors are OpenAI-style bodies:
422 unreadable body, 400 a request retrace refuses, 404 unknown model or route, 413 a body over the limit,
503 full or shutting down (a stream gets the error as its last event, then ``data: [DONE]``). Prompts are
bounded before tokenizing (limits.py); tokenizing and chat-template rendering run off the event loop with
a time limit (offload.py).

Extensions: request field ``mode`` (ar | dflash | retrace; default: the best the model supports) and
``top_k``; ``usage.retrace`` holds the request's acceptance stats (tau, rounds, accepted_hist, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from retrace.cli_checks import is_text
from retrace.errors import RetraceError
from retrace.request_validation import InvalidParameter, check_prompt_text
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.serving_engine import ServingEngine
from retrace.runtime.serving_handle import EngineClosed, EngineFailure, EngineFull, Handle, RequestRejected
from retrace.runtime.serving_protocol import ServableRuntime
from retrace.serve.chat import ChatTemplate
from retrace.serve.limits import BodyLimit, ServeLimits
from retrace.serve.offload import off_loop
from retrace.serve.schemas import ApiError, ChatCompletionRequest, CompletionRequest, _Common

# SamplingParams' names -> the request field a client sent
PARAMS = {"max_new_tokens": "max_tokens", "min_tokens": "min_tokens"}
STATS_KEYS = ("tau", "rounds", "drafted", "accepted_hist", "verify_hist", "tokens_per_s", "wall_s")


def best_mode(runtime: ServableRuntime) -> tuple[str, ...]:
    """The modes the runtime can serve, best first."""
    be = runtime.backend
    if be.drafter_config is None:
        return ("ar",)
    return ("retrace", "dflash", "ar") if be.has_conditioner else ("dflash", "ar")


def api_error(err: Exception) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, (EngineFull, EngineClosed)):
        return ApiError(503, str(err), code="unavailable")
    if isinstance(err, InvalidParameter):
        return ApiError(400, str(err), PARAMS.get(err.param, err.param))
    if isinstance(err, EngineFailure):
        return ApiError(500, str(err), code="internal_error")
    if isinstance(err, RequestRejected | RetraceError):
        return ApiError(400, str(err))
    return ApiError(500, f"{type(err).__name__}: {err}")


class Service:
    """What the routes share: the engine, the model's name, modes and chat template."""

    def __init__(self, engine: ServingEngine, model: str, chat: ChatTemplate | None = None, drain_s: float = 60.0,
                 limits: ServeLimits | None = None):
        self.engine, self.model, self.chat, self.drain_s = engine, model, chat, drain_s
        self.limits = limits or ServeLimits()
        self.modes = best_mode(engine.runtime)
        self.max_seq_len = int(engine.runtime.backend.max_seq_len)
        sched = engine.sched  # the positions a request needs beyond prompt + max_tokens (the scheduler's check)
        self.reserve = max(int(sched.block_size), int(sched.tree_budget)) + 1
        self.created = int(time.time())
        self._drain: threading.Thread | None = None

    def begin_drain(self) -> None:
        """On SIGTERM, at once: take no new requests, finish the in-flight ones within drain_s; what is left
        then fails with 503 (a stream: an error event, then [DONE]) while the server still writes answers."""
        if self._drain is None:
            self._drain = threading.Thread(target=self.engine.shutdown, args=(True, self.drain_s),
                                           name="retrace-drain", daemon=True)
            self._drain.start()

    def check(self, body: _Common) -> str:
        """What can be refused before any work: unsupported fields, the model, the mode -> the mode."""
        if (err := body.unsupported(self.limits.max_stop)) is not None:
            raise err
        if body.model is not None and not is_text(body.model):
            raise ApiError(400, "model is not valid Unicode text (a lone surrogate such as \\ud800)", "model")
        if body.model not in (None, "", self.model):
            raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{self.model}`)",
                           "model", "model_not_found")
        mode = body.mode or self.modes[0]
        if mode not in self.modes:
            raise ApiError(400, f"mode {mode!r} is not served by this model (choose from {', '.join(self.modes)})",
                           "mode")
        return mode

    def check_text(self, text: str, param: str) -> None:
        try:
            check_prompt_text(text, self.limits.max_prompt_chars, param)
        except InvalidParameter as e:
            raise ApiError(400, str(e), param, "prompt_too_long" if len(text) > self.limits.max_prompt_chars
                           else None) from None

    async def submit(self, body: _Common, prompt: str | list[int], default_max: int | None) -> Handle:
        mode = self.check(body)
        if isinstance(prompt, str):
            self.check_text(prompt, "prompt")
            ids = await off_loop(lambda: self.engine.encode(prompt), self.limits.work_timeout_s,
                                 "tokenizing the prompt")
        else:
            ids = self.engine.encode(prompt)
        max_tokens = (body.limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens) or default_max
        if max_tokens is None:  # as many as fit
            max_tokens = max(1, self.max_seq_len - len(ids) - self.reserve)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, stop=tuple(body.stop_list()),
                                ignore_eos=body.ignore_eos)
        return self.engine.submit(ids, params, mode)

    def usage(self, h: Handle) -> dict[str, Any]:
        res = h.result(0)
        stats = {k: res.stats.get(k) for k in STATS_KEYS if k in res.stats}
        stats.update(mode=h.mode, max_batch_seen=h.max_batch_seen,
                     ttft_s=None if h.t_first is None else round(h.t_first - h.t_submit, 6),
                     latency_s=round((h.t_end or time.monotonic()) - h.t_submit, 6))
        n_in, n_out = len(h.prompt_ids), len(res.token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out, "retrace": stats}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _streaming(h: Handle, chunk, body: _Common, svc: Service) -> StreamingResponse:
    """The SSE response of a `stream: true` request (usage at the end when stream_options asks for it)."""
    include = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_stream(h, chunk, include, svc), media_type="text/event-stream")


async def _stream(h: Handle, chunk, include_usage: bool, svc: Service):
    """SSE events of one handle; chunk(text, finish_reason, first) -> the OpenAI chunk object."""
    try:
        first = True
        async for ev in h:
            reason = h.result(0).finish_reason if ev.finished else None
            if ev.text or reason or first:
                yield _sse(chunk(ev.text or "", reason, first))
                first = False
        if include_usage:
            yield _sse({**chunk("", None, False), "choices": [], "usage": svc.usage(h)})
        yield "data: [DONE]\n\n"
    except RetraceError as e:  # the request failed mid-stream (engine shutting down, a failed round)
        yield _sse(api_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        h.cancel()  # no-op when finished; frees the slot when the client went away


def create_app(svc: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not svc.engine.running:
            svc.engine.start()
        yield
        await asyncio.to_thread(svc.engine.shutdown, True, svc.drain_s)  # finish in-flight requests

    app = FastAPI(title="retrace", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=svc.limits.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RetraceError)
    async def _retrace_error(request: Request, exc: RetraceError):
        err = api_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {}
        if e.get("type") == "json_invalid":  # its loc holds a byte offset, not a field
            where = e.get("loc", ("", "?"))[-1]
            msg = f"the body is not valid JSON: {e.get('ctx', {}).get('error', 'invalid JSON')} (at byte {where})"
            return JSONResponse(ApiError(422, msg).body(), status_code=422)
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid request')}"
        return JSONResponse(ApiError(422, msg, ".".join(loc) or None).body(), status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        if not svc.engine.running:
            return JSONResponse({"status": "unavailable", **svc.engine.snapshot()}, status_code=503)
        return {"status": "ok", **svc.engine.snapshot()}

    @app.get("/metrics")
    async def metrics():
        return Response(svc.engine.metrics.prometheus_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model, "object": "model", "created": svc.created,
                                            "owned_by": "retrace", "modes": list(svc.modes)}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        h = await svc.submit(body, body.single_prompt(), default_max=16)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None, first: bool) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": svc.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}

        if body.stream:
            return _streaming(h, chunk, body, svc)
        res = await h
        out = chunk(res.text or "", res.finish_reason, True)
        return {**out, "usage": svc.usage(h)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        if svc.chat is None:
            raise ApiError(400, f"the model `{svc.model}` has no chat template (its tokenizer_config.json has no "
                                "chat_template): use /v1/completions, or start the server with --chat-template",
                           "messages", "no_chat_template")
        svc.check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if sum(len(m["content"]) for m in messages) > svc.limits.max_prompt_chars:
            raise ApiError(400, f"messages have more than {svc.limits.max_prompt_chars} characters in all",
                           "messages", "prompt_too_long")
        for m in messages:
            svc.check_text(m["content"], "messages")
        prompt = await off_loop(lambda: svc.chat.render(messages), svc.limits.work_timeout_s,
                                "the chat template")
        h = await svc.submit(body, prompt, default_max=None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None, first: bool) -> dict:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": svc.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}

        if body.stream:
            return _streaming(h, chunk, body, svc)
        res = await h
        return {"id": rid, "object": "chat.completion", "created": created, "model": svc.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text or ""},
                             "finish_reason": res.finish_reason, "logprobs": None}],
                "usage": svc.usage(h)}

    return app
