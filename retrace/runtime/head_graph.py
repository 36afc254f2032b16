"""`HeadGraph`: a graph whose LM head was rewritten at load time (retrace.runtime.lm_head_split for a float
head, retrace.runtime.lm_head_nbits for an int4 / int8 one), the result type both rewrites return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeadGraph:
    model: bytes  # the rewritten graph (serialized ModelProto; its external data stays on disk)
    rows: str | None  # cut: its output replacing logits, [R, d] rows in logits order (R = N * K); else None
    weight: str  # the LM head's [V, d] initializer
    weight_bytes: int
    initializers: set[str]  # those the rewritten graph still reads
    nbits: bool = False  # a MatMulNBits (int4 / int8) head (retrace.runtime.lm_head_nbits)
