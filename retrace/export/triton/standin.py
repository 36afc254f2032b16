"""A stand-in for ``retrace.runtime.Runtime`` with the same serving API and no model (tests, smoke checks).

It "decodes" by counting: a character-level tokenizer maps ASCII characters to their code points, and
each new token is the next printable character after the previous one (``"abc" -> "defg..."``). Every
round commits 1-4 tokens (a deterministic accept pattern), so streaming, batching, stop strings, limits
and statistics can be checked exactly without weights. A repository uses it only when
``write_repository(runtime_factory="retrace.export.triton.standin:create_runtime")`` says so.

Prompts with special meaning: one containing ``__reject__`` is refused by ``add`` (a runtime-side error);
one containing ``__crash__`` makes the next ``step`` raise.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

from retrace.runtime.sampling_params import SamplingParams  # the runtime's own (imports no torch)

PRINTABLE_LO, PRINTABLE_HI = 32, 126  # ' ' .. '~'
VOCAB_SIZE = 128


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) if ord(c) < VOCAB_SIZE else ord("?") for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def next_token(prev: int) -> int:
    if not PRINTABLE_LO <= prev <= PRINTABLE_HI:
        return ord("a")
    return PRINTABLE_LO + (prev - PRINTABLE_LO + 1) % (PRINTABLE_HI - PRINTABLE_LO + 1)


def expected_output(prompt: str | list[int], max_tokens: int, stop: list[str] | None = None) -> str:
    """What the stand-in generates for ``prompt`` (used by the tests)."""
    ids = CharTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
    out, prev = [], ids[-1]
    for _ in range(max_tokens):
        prev = next_token(prev)
        out.append(chr(prev))
        text = "".join(out)
        for s in stop or ():
            if s in text:
                return text[: text.index(s)]
    return "".join(out)


@dataclasses.dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_text: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # (the stand-in never fails one request alone)
    rounds: int = 0
    hist: list[int] = dataclasses.field(default_factory=lambda: [0] * 4)

    def result(self) -> dict[str, Any]:
        tau = sum((a + 1) * n for a, n in enumerate(self.hist)) / self.rounds if self.rounds else None
        return {
            "token_ids": list(self.output_ids), "text": self.text, "finish_reason": self.finish_reason,
            "stats": {"tau": tau, "rounds": self.rounds, "tokens": len(self.output_ids),
                      "accepted_hist": list(self.hist), "params": dataclasses.asdict(self.params),
                      "runtime": "standin"},
        }


@dataclasses.dataclass(eq=False)
class Event:
    request: Request
    token_ids: list[int]
    text: str
    finished: bool


class StandinScheduler:
    """Mirrors ``retrace.runtime.Scheduler``: add / step / cancel, continuous batching over slots."""

    block_size = 4
    tree_budget = 0

    def __init__(self, runtime: StandinRuntime) -> None:
        self.rt = runtime
        self.running: dict[int, Request] = {}
        self.waiting: list[Request] = []
        self.max_batch_seen = 0
        self.batch_sizes: list[int] = []
        self.cancelled: list[int] = []
        self._crash = False
        self._ids = itertools.count()

    def check(self, prompt_ids: list[int], params: SamplingParams, mode: str = "retrace") -> None:
        """Nothing is refused up front: `add` refuses, on the engine thread (a runtime-side error)."""

    def add(self, prompt_ids: list[int], params: SamplingParams, mode: str = "retrace") -> Request:
        text = CharTokenizer().decode(prompt_ids)
        if "__reject__" in text:
            raise ValueError("prompt refused by the stand-in runtime (__reject__)")
        if not prompt_ids:
            raise ValueError("empty prompt")
        need = len(prompt_ids) + params.max_new_tokens + self.block_size + 1
        if need > self.rt.backend.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens + block exceeds max length {self.rt.backend.max_seq_len}")
        self._crash = self._crash or "__crash__" in text
        req = Request(next(self._ids), list(prompt_ids), params, mode)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if self.running.pop(req.rid, None) is not None:
            self.cancelled.append(req.rid)
        req.finished, req.finish_reason = True, req.finish_reason or "cancelled"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Event]:
        if self._crash:
            self._crash = False
            raise RuntimeError("stand-in runtime crashed (__crash__)")
        while self.waiting and len(self.running) < self.rt.backend.max_batch:
            r = self.waiting.pop(0)
            self.running[r.rid] = r
        if self.rt.step_delay_s:
            time.sleep(self.rt.step_delay_s)
        n = len(self.running)
        self.batch_sizes.append(n)
        self.max_batch_seen = max(self.max_batch_seen, n)
        events = []
        for r in list(self.running.values()):
            accepted = (r.rounds + len(r.prompt_ids)) % self.block_size  # 0..3 drafts accepted, +1 bonus
            r.rounds += 1
            r.hist[accepted] += 1
            new: list[int] = []
            prev = r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
            for _ in range(accepted + 1):
                prev = next_token(prev)
                new.append(prev)
                r.output_ids.append(prev)
                if len(r.output_ids) >= r.params.max_new_tokens:
                    r.finish_reason = "length"
                    break
            # like the runtime: text cut at a stop string, tail held back while it may still become one
            r.text = CharTokenizer().decode(r.output_ids)
            cut = min((i for i in (r.text.find(s) for s in r.params.stop) if i >= 0), default=-1)
            if cut >= 0:
                r.text, r.finish_reason = r.text[:cut], "stop"
            hold = 0 if r.finish_reason else max([len(s) - 1 for s in r.params.stop] + [0])
            visible = r.text[: len(r.text) - hold]
            delta = visible[r.emitted_text:] if len(visible) > r.emitted_text else ""
            r.emitted_text = max(r.emitted_text, len(visible))
            if r.finish_reason:
                r.finished = True
                del self.running[r.rid]
            events.append(Event(r, new, delta, r.finished))
        return events


@dataclasses.dataclass
class _Config:
    vocab_size: int = VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = ()  # the stand-in has no EOS


@dataclasses.dataclass
class _Backend:
    max_batch: int
    max_seq_len: int
    name: str = "standin"
    target_config: _Config = dataclasses.field(default_factory=_Config)
    drafter_config: None = None  # no drafter: its block is StandinScheduler.block_size
    has_conditioner: bool = False


class StandinRuntime:
    """A ServableRuntime (retrace/runtime/serving_protocol.py) with no model."""

    def __init__(self, bundle_dir: str, backend: str = "onnxruntime", max_batch: int = 8,
                 step_delay_s: float = 0.005) -> None:
        manifest = json.loads((Path(bundle_dir) / "manifest.json").read_text())
        self.bundle_dir, self.backend_name = bundle_dir, backend
        self.backend = _Backend(max_batch=max_batch, max_seq_len=int(manifest.get("max_seq_len", 4096)))
        self.step_delay_s = float(step_delay_s)
        self.codec = CharTokenizer()
        self._sched: StandinScheduler | None = None

    def scheduler(self) -> StandinScheduler:
        if self._sched is None:
            self._sched = StandinScheduler(self)
        return self._sched


def create_runtime(bundle_dir: str, *, backend: str = "onnxruntime", max_batch: int = 8,
                   **options: Any) -> StandinRuntime:
    return StandinRuntime(bundle_dir, backend, max_batch, **options)


def create_runtime_from_dirs(bundle_dir: str, *, backend: str = "torch", max_batch: int = 8, target_dir: str,
                             drafter_dir: str | None = None, max_seq_len: int = 512, **kw: Any) -> Any:
    """The REAL runtime on its torch backend, from model directories (``bundle_dir`` is ignored).

    For tests of the Triton model against ``retrace.runtime`` before/without an exported engine bundle.
    """
    from retrace.runtime import Runtime

    return Runtime.from_dirs(target_dir, drafter_dir, backend="torch", max_batch=max_batch,
                             max_seq_len=max_seq_len, **kw)
