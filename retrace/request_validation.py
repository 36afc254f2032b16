"""The one check of a request's sampling parameters and prompt size, shared by every entrance.

`retrace serve`, the Triton model, the Engine API and `retrace generate` all build a SamplingParams, whose
validation is :func:`check_sampling`; servers check a text prompt with :func:`check_prompt_text` before
they tokenize it. Every problem raises :class:`InvalidParameter` naming the parameter. Only the standard
library is imported (the Triton model's validation imports this without torch).

Temperature: a finite number >= 0. Below TEMPERATURE_FLOOR (1e-5) it is greedy (temperature 0), the
limit of sampling as the temperature goes to 0 (vLLM's convention): logits / 1e-38 overflow float32, and
the distribution can no longer be sampled.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from retrace.cli_checks import SEED_MAX, is_text
from retrace.errors import RetraceError

TEMPERATURE_FLOOR = 1e-5
MAX_STOP_STRINGS = 16  # per request (the OpenAI routes allow 4, as OpenAI does)
MAX_STOP_CHARS = 256  # per stop string
MAX_PROMPT_CHARS = 1_000_000  # a text prompt, checked before it is tokenized


class InvalidParameter(RetraceError):
    """One request parameter is wrong; ``param`` names it, the message says why."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param} {problem}")
        self.param, self.problem = param, problem


def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """An integer (not a bool, not 2.5) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameter(name, f"must be an integer, got {value!r}")
    if value < low:
        raise InvalidParameter(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidParameter(name, f"must be <= {high}, got {value}")
    return int(value)


def check_float(name: str, value: Any, low: float, high: float | None = None, low_open: bool = False) -> float:
    """A finite number (an int is fine, a bool or a string is not) in [low, high] ((low, high] if low_open)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameter(name, f"must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidParameter(name, f"must be a finite number, got {value!r}")
    if (v <= low if low_open else v < low) or (high is not None and v > high):
        left = "(" if low_open else "["
        span = f"in {left}{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
        raise InvalidParameter(name, f"must be {span}, got {value!r}")
    return v


def check_stops(stops: Any, max_count: int = MAX_STOP_STRINGS, max_chars: int = MAX_STOP_CHARS,
                name: str = "stop") -> tuple[str, ...]:
    """A string or a list of non-empty strings, at most max_count of at most max_chars characters each."""
    if isinstance(stops, str):
        stops = (stops,)
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise InvalidParameter(name, f"must be a string or a list of strings, got {stops!r}")
    if len(stops) > max_count:
        raise InvalidParameter(name, f"has {len(stops)} strings, at most {max_count} are allowed")
    for s in stops:
        if not s:
            raise InvalidParameter(name, "contains an empty string")
        if len(s) > max_chars:
            raise InvalidParameter(name, f"has a string of {len(s)} characters, at most {max_chars} are allowed")
        if not is_text(s):
            raise InvalidParameter(name, "is not valid Unicode text (a lone surrogate such as \\ud800)")
    return tuple(stops)


def check_sampling(max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any, stop: Any,
                   ignore_eos: Any, min_tokens: Any) -> dict[str, Any]:
    """Every sampling parameter checked -> the same fields, normalized (temperature below the floor is 0,
    stop a tuple). Raises InvalidParameter."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    temperature = check_float("temperature", temperature, 0.0)
    if temperature < TEMPERATURE_FLOOR:
        temperature = 0.0
    top_p = check_float("top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = check_int("top_k", top_k, 0)
    if seed is not None:
        seed = check_int("seed", seed, 0, SEED_MAX)
    if not isinstance(ignore_eos, bool):
        raise InvalidParameter("ignore_eos", f"must be true or false, got {ignore_eos!r}")
    min_tokens = check_int("min_tokens", min_tokens, -2**63)
    if not 0 <= min_tokens <= max_new_tokens:
        raise InvalidParameter("min_tokens", f"must be in [0, max_tokens={max_new_tokens}], got {min_tokens}")
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": check_stops(stop), "ignore_eos": ignore_eos, "min_tokens": min_tokens}


def check_prompt_text(text: Any, max_chars: int = MAX_PROMPT_CHARS, name: str = "prompt") -> str:
    """A text prompt a tokenizer may take: a str of at most max_chars characters, valid Unicode. Checked by
    its length before anything reads it, so a 12 MB prompt costs no tokenization."""
    if not isinstance(text, str):
        raise InvalidParameter(name, f"must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise InvalidParameter(name, f"has {len(text)} characters, at most {max_chars} are allowed")
    if not is_text(text):
        raise InvalidParameter(name, "is not valid Unicode text (a lone surrogate such as \\ud800)")
    return text
