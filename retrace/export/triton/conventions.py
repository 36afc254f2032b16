"""The request conventions of NVIDIA's two LLM backends for Triton, read into RequestSpec field values.

TensorRT-LLM (tensorrtllm_backend's ensemble): ``text_input``, ``max_tokens``, ``stream``,
``exclude_input_in_output``, ``end_id``, ``pad_id``, ``min_length``, ``stop_words``, ``bad_words``,
``beam_width``, each a tensor of its own. vLLM (vllm_backend): ``text_input``, ``stream``,
``exclude_input_in_output`` and ``sampling_parameters``, one JSON object in a string holding vLLM
SamplingParams fields, values as JSON numbers / booleans or as strings (genai-perf sends
``{"max_tokens": "32", "min_tokens": "32"}``, vllm_backend converts them the same way).

What the lossless loop cannot do is refused with a clear error, never ignored: a beam width other than 1,
banned words, an end token other than the model's EOS.
"""

from __future__ import annotations

import json
import math
from typing import Any

# sampling_parameters key -> kind; the keys are RequestSpec's field names too
SAMPLING_PARAMETERS = {"max_tokens": "int", "min_tokens": "int", "ignore_eos": "bool", "temperature": "float",
                       "top_p": "float", "top_k": "int", "seed": "int", "stop": "strings"}
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM SamplingParams' default when sampling_parameters has no max_tokens
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class ConventionError(ValueError):
    """A convention's input is malformed; the message names it."""


def _coerce(key: str, kind: str, v: Any) -> Any:
    where = f"sampling_parameters {key!r}"
    if kind == "bool":
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
            return v.strip().lower() in _TRUE
        raise ConventionError(f"{where} must be true or false, got {v!r}")
    if kind == "strings":
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ConventionError(f"{where} must be a string or a list of strings, got {v!r}")
        return stops
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConventionError(f"{where} must be a number, got {v!r}")
    try:
        x = float(v) if kind == "float" else int(v) if not isinstance(v, float) else v
    except ValueError:
        raise ConventionError(f"{where} must be a number, got {v!r}") from None
    if kind == "int" and isinstance(x, float):
        if not x.is_integer():
            raise ConventionError(f"{where} must be an integer, got {v!r}")
        x = int(x)
    if kind == "float" and not math.isfinite(x):
        raise ConventionError(f"{where} must be a finite number, got {v!r}")
    return x


def parse_sampling_parameters(text: str) -> dict[str, Any]:
    """vLLM's sampling_parameters string -> {RequestSpec field: value} (only the keys it holds)."""
    try:
        raw = json.loads(text) if text.strip() else {}
    except ValueError:
        raise ConventionError("input 'sampling_parameters' is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ConventionError("input 'sampling_parameters' must be a JSON object")
    unknown = sorted(k for k in raw if k not in SAMPLING_PARAMETERS)
    if unknown:
        raise ConventionError(f"unknown key(s) {', '.join(map(repr, unknown))} in 'sampling_parameters'; "
                              f"supported: {', '.join(SAMPLING_PARAMETERS)}")
    out = {k: _coerce(k, SAMPLING_PARAMETERS[k], v) for k, v in raw.items() if v is not None}
    if out.get("top_k") == -1:  # vLLM's "off"
        out["top_k"] = 0
    return out


def check_trtllm(beam_width: int | None, end_id: int | None, pad_id: int | None, bad_words: list[str] | None,
                 eos_ids: tuple[int, ...] | None) -> None:
    """TensorRT-LLM inputs that only select what this model does anyway; anything else is refused."""
    if beam_width is not None and beam_width != 1:
        raise ConventionError(f"input 'beam_width' is {beam_width}: this model decodes one sequence per request "
                              "(beam_width 1 only)")
    if end_id is not None and eos_ids is not None and end_id not in eos_ids:
        raise ConventionError(f"input 'end_id' is {end_id}, but this model ends at its own EOS token(s) "
                              f"{list(eos_ids)}; a per-request end token is not supported (use 'stop_words')")
    if pad_id is not None and pad_id < 0:
        raise ConventionError(f"input 'pad_id' must be >= 0, got {pad_id}")
    if bad_words and any(bad_words):
        raise ConventionError("input 'bad_words' is not supported: banning words would change the target's own "
                              "decode, which this model reproduces exactly")
