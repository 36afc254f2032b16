"""The bench's precision axis (`retrace bench --weights fp32,int4,int8,w8a8`): which weights each system runs.

A precision is `fp32`, `int8` or `int4`, optionally with a quantization block (`int4:256`). Our ONNX
Runtime systems run a bundle built with `retrace-export build --weights` (retrace.export.quantize),
onnxruntime-genai's its builder's model (`-p int4 -e cpu`, `block_size` in its extra options), llama.cpp
the GGUF type CPU users pick at that width (int4: Q4_K_M, int8: Q8_0). A system's name carries its
precision as a suffix (`retrace-onnxruntime-ar-int4`, `ortgenai-ar-int4b256`, `llamacpp-ar-q4_k_m`);
fp32 names stay as they were. `w8a8` (retrace.export.w8a8) is ours only: its peers are the int8 ones (give
`--weights w8a8,int8` for them), and the fastest-peer ratio compares it with the int8 systems.
"""

from __future__ import annotations

import re

from retrace.errors import RetraceError

LLAMACPP_TYPES = {"int4": "Q4_K_M", "int8": "Q8_0"}


def parse(value: str) -> tuple[str, ...]:
    """'fp32,int4:256' -> ('fp32', 'int4:256'), each checked."""
    out = []
    for item in (v.strip() for v in value.split(",")):
        w, _, block = item.partition(":")
        if w not in ("fp32", "int8", "int4", "w8a8") or (block and (w in ("fp32", "w8a8") or not block.isdigit())):
            raise RetraceError(f"--weights: {item!r} is not fp32, int8, int4, w8a8 or int8/int4:BLOCK (e.g. int4:128)")
        if item not in out:
            out.append(item)
    if not out:
        raise RetraceError("--weights needs at least one precision, e.g. fp32,int4")
    return tuple(out)


def suffix(precision: str) -> str:
    """The system-name suffix: '' (fp32), '-int4', '-int4b256', '-w8a8'."""
    if precision == "fp32":
        return ""
    w, _, block = precision.partition(":")
    return f"-{w}" + (f"b{block}" if block else "")


def of_name(name: str) -> str:
    """The precision suffix a system's name ends with ('' for fp32): '...-ar-int4b256' -> '-int4b256'."""
    m = re.search(r"-(int[48](b\d+)?|w8a8)$", name)
    return m.group(0) if m else ""


def llamacpp_type(precision: str) -> str | None:
    return LLAMACPP_TYPES.get(precision.partition(":")[0])


def width_of(name: str) -> str:
    """The weight width a system's name says it runs: 'int4' / 'int8' (our and onnxruntime-genai's precision
    suffix, w8a8's 8 bits, or llama.cpp's GGUF type: q4_k_m, q8_0), else 'fp32'."""
    suffix = of_name(name)
    if suffix:
        return "int8" if suffix == "-w8a8" else suffix[1:5]
    low = name.lower()
    return next((w for w, t in LLAMACPP_TYPES.items() if low.endswith("-" + t.lower())), "fp32")

