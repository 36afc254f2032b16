"""Bounded request sizes for `retrace serve`: the HTTP body (413 before it is read, from its Content-Length,
or as soon as a chunked body grows past it), a text prompt's characters and the chat messages' total
characters (400, before anything tokenizes or renders them); stop lists are bounded as OpenAI does (4). A
prompt's token count is bounded by the runtime's max length (400 "exceeds the configured max length")."""

from __future__ import annotations

import json
from dataclasses import dataclass

from retrace.request_validation import MAX_PROMPT_CHARS

MAX_BODY_BYTES = 8 * 2**20
DISCARD_FACTOR = 8  # a body over the limit is read and dropped up to this many times the limit


@dataclass(frozen=True)
class ServeLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_stop: int = 4  # OpenAI's limit
    work_timeout_s: float = 10.0  # tokenizing one prompt or rendering one chat template


def _body(max_bytes: int) -> bytes:
    return json.dumps({"error": {"message": f"the request body is larger than {max_bytes} bytes",
                                 "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()


class BodyLimit:
    """ASGI middleware: a body over max_bytes gets 413 with an OpenAI-style error body."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send) -> None:
        body = _body(self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _discard(self, receive, declared: int) -> None:
        """Read (and drop) what the client is sending, up to a few times the limit, so that it gets to read
        the 413 instead of a reset connection; nothing is kept, nothing parsed."""
        seen = 0
        while seen < min(declared, DISCARD_FACTOR * self.max_bytes):
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body"):
                return

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._discard(receive, int(declared))
            return await self._refuse(send)
        if declared is not None or scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read it here, up to the limit, and hand it on whole
        chunks, seen, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            more = msg.get("more_body", False)
            if seen > self.max_bytes:
                await self._discard(receive, DISCARD_FACTOR * self.max_bytes)
                return await self._refuse(send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
