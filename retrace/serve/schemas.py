"""OpenAI request bodies (the fields retrace honours, checked) and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 422: "invalid_request_error",
             503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored (as OpenAI's SDKs send extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM's name)
    ignore_eos: bool = False  # extension (vLLM's name): generate max_tokens whatever the EOS
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    mode: Literal["ar", "dflash", "retrace"] | None = None  # extension: the decoding mode

    def unsupported(self) -> ApiError | None:
        """A clear 400 for what retrace does not do (rather than silently ignoring it)."""
        if self.n != 1:
            return ApiError(400, f"n={self.n} is not supported: retrace returns exactly one choice (n=1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return ApiError(400, f"{name} is not supported (leave it 0)", name)
        if self.logprobs not in (None, False, 0):
            return ApiError(400, "logprobs are not supported", "logprobs")
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            return ApiError(400, "stop must be a non-empty string or a list of at most 4 non-empty strings", "stop")
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> ApiError | None:
        if self.echo:
            return ApiError(400, "echo is not supported", "echo")
        if self.best_of not in (None, 1):
            return ApiError(400, "best_of is not supported (leave it 1)", "best_of")
        if self.suffix:
            return ApiError(400, "suffix is not supported", "suffix")
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string, token ids, or a list holding exactly one of those."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return p
        if isinstance(p, list) and len(p) == 1:
            return p[0]
        raise ApiError(400, f"prompt must be one string or one list of token ids (batches of {len(p)} prompts "
                            "are not supported: send one request per prompt)", "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> ApiError | None:
        if self.tools:
            return ApiError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return ApiError(400, "response_format other than text is not supported", "response_format")
        return super().unsupported()

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
