"""Validation of one Triton inference request for the ReTrace model (pure Python + numpy, no Triton).

Triton 2.51 enforces little for a decoupled python-backend model: a missing input is not reported when
another optional input is present, every unknown ``/generate`` JSON field arrives as a request
parameter, and ``/generate`` makes every scalar a shape-[1] tensor. So every input is checked here, and
every problem is reported in one message that names the input.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from retrace.export.triton.conventions import (
    VLLM_DEFAULT_MAX_TOKENS,
    ConventionError,
    check_trtllm,
    parse_sampling_parameters,
)
from retrace.request_validation import MAX_PROMPT_CHARS, InvalidParameter, check_prompt_text, check_sampling

# name -> (Triton data type, optional?) ; the single source for config.pbtxt and for validation. Every input
# is optional for Triton (the two conventions send different sets); parse_request says what is missing.
# Single values have dims [1] with max_batch_size 0 (repository.render_config), lists dims [-1] (LISTS).
INPUTS: dict[str, tuple[str, bool]] = {
    "text_input": ("TYPE_STRING", True),
    "input_ids": ("TYPE_INT64", True),
    "max_tokens": ("TYPE_INT32", True),
    "temperature": ("TYPE_FP32", True),
    "top_p": ("TYPE_FP32", True),
    "top_k": ("TYPE_INT32", True),
    "seed": ("TYPE_INT64", True),
    "stop": ("TYPE_STRING", True),
    "mode": ("TYPE_STRING", True),
    "stream": ("TYPE_BOOL", True),
    "ignore_eos": ("TYPE_BOOL", True),
    "min_tokens": ("TYPE_INT32", True),
    "exclude_input_in_output": ("TYPE_BOOL", True),  # both conventions
    # TensorRT-LLM
    "min_length": ("TYPE_INT32", True),
    "end_id": ("TYPE_INT32", True),
    "pad_id": ("TYPE_INT32", True),
    "beam_width": ("TYPE_INT32", True),
    "stop_words": ("TYPE_STRING", True),
    "bad_words": ("TYPE_STRING", True),
    # vLLM
    "sampling_parameters": ("TYPE_STRING", True),
}
LISTS = frozenset({"input_ids", "stop", "stop_words", "bad_words"})  # dims [-1]; every other input dims [1]
OUTPUTS: dict[str, str] = {"text_output": "TYPE_STRING", "output_ids": "TYPE_INT64", "stats": "TYPE_STRING"}

INT32_MAX = 2**31 - 1


class RequestError(ValueError):
    """A request is malformed; the message names the input and the problem (sent back to the client)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_tokens: int  # upper bound on max_tokens (bundle / runtime limit)
    max_seq_len: int | None = None  # prompt + generated tokens must fit
    vocab_size: int | None = None  # input_ids must be in [0, vocab_size)
    modes: tuple[str, ...] = ("retrace", "dflash", "ar")
    default_mode: str = "retrace"
    eos_ids: tuple[int, ...] | None = None  # the model's EOS tokens (TensorRT-LLM's end_id must be one)


@dataclasses.dataclass
class RequestSpec:
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    mode: str = "retrace"
    stream: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    exclude_input: bool = True  # exclude_input_in_output (false: the first response starts with the prompt)

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
        }
        if self.ignore_eos:  # only when asked: a runtime without them still serves everything else
            kw["ignore_eos"] = True
        if self.min_tokens:
            kw["min_tokens"] = self.min_tokens
        return kw


_INT_KINDS = ("i", "u")


def _single(name: str, arr: np.ndarray) -> Any:
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _check_kind(name: str, arr: np.ndarray, kinds: Sequence[str], expected: str) -> None:
    if arr.dtype.kind not in kinds:
        raise RequestError(f"input '{name}' has data type {arr.dtype}, expected {expected}")


def _to_str(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"input '{name}' must be BYTES (a string), got {type(value).__name__}")


def _strings(name: str, arr: np.ndarray) -> list[str]:
    _check_kind(name, arr, ("O", "S", "U"), "BYTES")
    return [_to_str(name, v) for v in arr.reshape(-1)]


def _int(name: str, arr: np.ndarray, expected: str) -> int:
    _check_kind(name, arr, _INT_KINDS, expected)
    return int(_single(name, arr))


def _float(name: str, arr: np.ndarray) -> float:
    _check_kind(name, arr, ("f",), "FP32")
    v = float(_single(name, arr))
    if not math.isfinite(v):
        raise RequestError(f"input '{name}' must be a finite number, got {v}")
    return v


def _bool(name: str, arr: np.ndarray) -> bool:
    _check_kind(name, arr, ("b",), "BOOL")
    return bool(_single(name, arr))


def _parse_parameters(parameters: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, Mapping):
        return dict(parameters)
    try:
        params = json.loads(parameters)
    except ValueError:
        raise RequestError("request parameters are not valid JSON") from None
    if not isinstance(params, dict):
        raise RequestError("request parameters must be a JSON object")
    return params


def parse_request(
    inputs: Mapping[str, np.ndarray | None],
    parameters: str | Mapping[str, Any] | None,
    limits: Limits,
) -> RequestSpec:
    """Check every input of one request and return its :class:`RequestSpec` or raise :class:`RequestError`."""
    params = _parse_parameters(parameters)
    # Triton's own reserved parameters start with "triton_"; everything else is a typo or a field that
    # /generate turned into a parameter because no input has that name.
    unknown = sorted(k for k in params if not k.startswith("triton_"))
    if unknown:
        allowed = ", ".join(INPUTS)
        raise RequestError(f"unknown request parameter(s) {', '.join(map(repr, unknown))}; the inputs are: {allowed}")
    extra = sorted(k for k, v in inputs.items() if v is not None and k not in INPUTS)
    if extra:
        raise RequestError(f"unknown input(s) {', '.join(map(repr, extra))}")

    def get(name: str) -> np.ndarray | None:
        v = inputs.get(name)
        return None if v is None else np.asarray(v)

    text_arr, ids_arr = get("text_input"), get("input_ids")
    if text_arr is None and ids_arr is None:
        raise RequestError("missing prompt: give 'text_input' (BYTES) or 'input_ids' (INT64)")
    if text_arr is not None and ids_arr is not None:
        raise RequestError("give either 'text_input' or 'input_ids', not both")
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    if text_arr is not None:
        texts = _strings("text_input", text_arr)
        if len(texts) != 1:
            raise RequestError(f"input 'text_input' must hold exactly one string, got {len(texts)}")
        prompt_text = texts[0]
        if not prompt_text:
            raise RequestError("input 'text_input' is an empty prompt")
        try:  # by its size, before anything tokenizes it
            check_prompt_text(prompt_text, MAX_PROMPT_CHARS, "input 'text_input'")
        except InvalidParameter as e:
            raise RequestError(str(e)) from None
    else:
        assert ids_arr is not None
        _check_kind("input_ids", ids_arr, _INT_KINDS, "INT64 or INT32")
        if ids_arr.ndim > 2 or (ids_arr.ndim == 2 and ids_arr.shape[0] != 1):
            raise RequestError(f"input 'input_ids' must be 1-D (or [1, T]), got shape {list(ids_arr.shape)}")
        prompt_ids = [int(x) for x in ids_arr.reshape(-1)]
        if not prompt_ids:
            raise RequestError("input 'input_ids' is an empty prompt")
        bad = [t for t in prompt_ids if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size)]
        if bad:
            hi = f", {limits.vocab_size})" if limits.vocab_size is not None else ", inf)"
            raise RequestError(f"input 'input_ids' has token id {bad[0]} outside [0{hi}")

    # field -> (value, where it came from); a field may come from one source only
    fields: dict[str, tuple[Any, str]] = {}

    def put(field: str, value: Any, where: str) -> None:
        if field in fields:
            raise RequestError(f"'{field}' is given twice ({fields[field][1]} and {where})")
        fields[field] = (value, where)

    for name, field, read in (
        ("max_tokens", "max_tokens", lambda a: _int("max_tokens", a, "INT32")),
        ("temperature", "temperature", lambda a: _float("temperature", a)),
        ("top_p", "top_p", lambda a: _float("top_p", a)),
        ("top_k", "top_k", lambda a: _int("top_k", a, "INT32")),
        ("seed", "seed", lambda a: _int("seed", a, "INT64")),
        ("stop", "stop", lambda a: _strings("stop", a)),
        ("stop_words", "stop", lambda a: [w for w in _strings("stop_words", a) if w]),
        ("min_tokens", "min_tokens", lambda a: _int("min_tokens", a, "INT32")),
        ("min_length", "min_tokens", lambda a: _int("min_length", a, "INT32")),
        ("ignore_eos", "ignore_eos", lambda a: _bool("ignore_eos", a)),
    ):
        if (a := get(name)) is not None:
            put(field, read(a), f"input '{name}'")
    trt = {name: _int(name, a, "INT32") if name != "bad_words" else _strings(name, a)
           for name in ("beam_width", "end_id", "pad_id", "bad_words") if (a := get(name)) is not None}
    try:
        check_trtllm(trt.get("beam_width"), trt.get("end_id"), trt.get("pad_id"), trt.get("bad_words"),
                     limits.eos_ids)
        if (a := get("sampling_parameters")) is not None:
            texts = _strings("sampling_parameters", a)
            if len(texts) != 1:
                raise RequestError(f"input 'sampling_parameters' must hold exactly one string, got {len(texts)}")
            for k, v in parse_sampling_parameters(texts[0]).items():
                put(k, v, f"sampling_parameters {k!r}")
            if "max_tokens" not in fields:
                put("max_tokens", VLLM_DEFAULT_MAX_TOKENS, "vLLM's default max_tokens")
    except ConventionError as e:
        raise RequestError(str(e)) from None

    if "max_tokens" not in fields:
        raise RequestError("missing input 'max_tokens' (INT32, number of tokens to generate; or 'max_tokens' in "
                           "'sampling_parameters')")
    max_tokens, where = fields.pop("max_tokens")
    if max_tokens <= 0:
        raise RequestError(f"{where} must be > 0, got {max_tokens}")
    if max_tokens > limits.max_tokens:
        raise RequestError(f"{where} is {max_tokens}, above this model's limit of {limits.max_tokens}")
    if limits.max_seq_len is not None and prompt_ids is not None and len(prompt_ids) + max_tokens > limits.max_seq_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + 'max_tokens' ({max_tokens}) exceeds the maximum sequence "
            f"length {limits.max_seq_len}"
        )

    spec = RequestSpec(prompt_text=prompt_text, prompt_ids=prompt_ids, max_tokens=max_tokens, mode=limits.default_mode)
    given = {field: v for field, (v, _) in fields.items()}
    try:  # the check every entrance shares (retrace/request_validation.py): temperature < 1e-5 is greedy
        checked = check_sampling(max_tokens, given.get("temperature", spec.temperature), given.get("top_p", spec.top_p),
                                 given.get("top_k", spec.top_k), given.get("seed"), given.get("stop", []),
                                 given.get("ignore_eos", False), given.get("min_tokens", 0))
    except InvalidParameter as e:
        field = "max_tokens" if e.param == "max_new_tokens" else e.param
        raise RequestError(f"{fields[field][1] if field in fields else repr(field)} {e.problem}") from None
    for field in fields:
        setattr(spec, field, list(checked[field]) if field == "stop" else checked[field])
    if (a := get("mode")) is not None:
        modes = _strings("mode", a)
        if len(modes) != 1:
            raise RequestError(f"input 'mode' must hold exactly one string, got {len(modes)}")
        if modes[0] not in limits.modes:
            raise RequestError(f"unknown mode {modes[0]!r} in input 'mode'; this model serves: "
                               f"{', '.join(limits.modes)}")
        spec.mode = modes[0]
    if (a := get("stream")) is not None:
        spec.stream = _bool("stream", a)
    if (a := get("exclude_input_in_output")) is not None:
        spec.exclude_input = _bool("exclude_input_in_output", a)
    return spec
