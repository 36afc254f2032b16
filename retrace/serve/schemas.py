"""OpenAI request bodies (the fields retrace honours, checked) and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from retrace.request_validation import MAX_STOP_CHARS


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             422: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


# JSON types as sent, no coercion: `"max_tokens": true` or `2.5` is refused, not read as 1 or 2
Int = StrictInt
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored (as OpenAI's SDKs send extras). The
    values' ranges are checked once, by SamplingParams (retrace/request_validation.py), except OpenAI's own
    bounds on temperature (<= 2) and the stop list (4)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=0)] = 0  # extension (vLLM's name)
    ignore_eos: StrictBool = False  # extension (vLLM's name): generate max_tokens whatever the EOS
    seed: Annotated[Int, Field(ge=0, lt=2**63)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    mode: Literal["ar", "dflash", "retrace"] | None = None  # extension: the decoding mode

    def unsupported(self, max_stop: int = 4) -> ApiError | None:
        """A clear 400 for what retrace does not do (rather than silently ignoring it)."""
        if self.n != 1:
            return ApiError(400, f"n={self.n} is not supported: retrace returns exactly one choice (n=1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return ApiError(400, f"{name} is not supported (leave it 0)", name)
        if self.logprobs not in (None, False, 0):
            return ApiError(400, "logprobs are not supported", "logprobs")
        stops = self.stop_list()
        if len(stops) > max_stop or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            return ApiError(400, f"stop must be a non-empty string or a list of at most {max_stop} non-empty "
                                 f"strings of at most {MAX_STOP_CHARS} characters", "stop")
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: StrictStr | list[Int] | list[StrictStr] | list[list[Int]]
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self, max_stop: int = 4) -> ApiError | None:
        if self.echo:
            return ApiError(400, "echo is not supported", "echo")
        if self.best_of not in (None, 1):
            return ApiError(400, "best_of is not supported (leave it 1)", "best_of")
        if self.suffix:
            return ApiError(400, "suffix is not supported", "suffix")
        return super().unsupported(max_stop)

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
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self, max_stop: int = 4) -> ApiError | None:
        if self.tools:
            return ApiError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return ApiError(400, "response_format other than text is not supported", "response_format")
        return super().unsupported(max_stop)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
