"""What the serving engine (runtime/serving_engine.py) and the Triton model's adapter (export/triton/serving.py)
need from a runtime: the typed seam between them.

`retrace.runtime.Runtime` is one (its Scheduler, Request and Event); the Triton model's stand-in
(export/triton/standin.py) is another, with no model. Nothing else of a runtime is read at this seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from retrace.runtime.sampling_params import SamplingParams


class Codec(Protocol):
    """Text <-> token ids (runtime/tokenizer.py's TextCodec)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TargetLimits(Protocol):
    vocab_size: int
    eos_token_ids: Sequence[int]


class DrafterLimits(Protocol):
    block_size: int  # the drafter's block (a tokens-per-round bound: the metrics' histogram range)


class ServedBackend(Protocol):
    """The backend's limits (runtime/backend.py's Backend has these and more)."""

    max_batch: int
    max_seq_len: int
    target_config: TargetLimits
    drafter_config: DrafterLimits | None  # None: a target-only runtime (mode "ar" only)
    has_conditioner: bool  # a ReTrace conditioner beside the drafter (mode "retrace")


class ServedRequest(Protocol):
    """One request in the scheduler (runtime/loop.py's Request)."""

    rid: int
    finished: bool
    finish_reason: str | None
    error: str | None  # why it failed alone (finish_reason "error"); its batch-mates went on

    def result(self) -> dict[str, Any]:
        """{"token_ids", "text", "finish_reason", "stats": {...}}."""
        ...


class ServedEvent(Protocol):
    """What one step committed for one request (runtime/loop.py's Event)."""

    request: ServedRequest
    token_ids: list[int]
    text: str  # the visible text delta (partial characters and possible stop strings held back)
    finished: bool


class ServingScheduler(Protocol):
    """The continuous-batching scheduler: requests join and leave between steps."""

    block_size: int  # tokens per draft block: a request needs block_size + 1 positions beyond its tokens
    tree_budget: int  # 0, or the nodes of a draft tree (a request then needs tree_budget + 1 positions)
    max_batch_seen: int

    def check(self, prompt_ids: list[int], params: SamplingParams, mode: str) -> None:
        """Raise RetraceError if `add` would refuse the request (reads no scheduler state: thread-safe)."""
        ...

    def add(self, prompt_ids: list[int], params: SamplingParams, mode: str) -> ServedRequest: ...

    def step(self) -> list[ServedEvent]: ...

    def cancel(self, request: ServedRequest) -> None: ...


class ServableRuntime(Protocol):
    """A runtime the Engine can serve: one long-lived scheduler, its backend's limits, its codec."""

    backend: ServedBackend
    codec: Codec | None  # None: no tokenizer (token ids only)

    def scheduler(self) -> ServingScheduler: ...
