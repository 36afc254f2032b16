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
import threading
import time
from pathlib import Path
from typing import Any

PRINTABLE_LO, PRINTABLE_HI = 32, 126  # ' ' .. '~'
VOCAB_SIZE = 128


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)


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
class Event:
    request_id: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


@dataclasses.dataclass(eq=False)
class _Req:
    rid: int
    prompt: list[int]
    params: SamplingParams
    out: list[int] = dataclasses.field(default_factory=list)
    rounds: int = 0
    hist: list[int] = dataclasses.field(default_factory=lambda: [0] * 4)


class StandinScheduler:
    block_size = 4

    def __init__(self, runtime: StandinRuntime, mode: str) -> None:
        self.rt, self.mode = runtime, mode
        self.active: dict[int, _Req] = {}
        self.batch_sizes: list[int] = []
        self.cancelled: list[int] = []
        self._crash = False

    def add(self, prompt: str | list[int], params: SamplingParams) -> int:
        text = prompt if isinstance(prompt, str) else CharTokenizer().decode(prompt)
        if "__reject__" in text:
            raise ValueError("prompt refused by the stand-in runtime (__reject__)")
        ids = CharTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(self.active) >= self.rt.max_batch:
            raise RuntimeError(f"all {self.rt.max_batch} slots are busy")
        if len(ids) + params.max_new_tokens > self.rt.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_seq_len {self.rt.max_seq_len}")
        self._crash = self._crash or "__crash__" in text
        rid = next(self.rt._ids)
        self.active[rid] = _Req(rid, ids, params)
        return rid

    def cancel(self, rid: int) -> None:
        if self.active.pop(rid, None) is not None:
            self.cancelled.append(rid)

    def step(self) -> list[Event]:
        if self._crash:
            self._crash = False
            self.active.clear()
            raise RuntimeError("stand-in runtime crashed (__crash__)")
        if self.rt.step_delay_s:
            time.sleep(self.rt.step_delay_s)
        self.batch_sizes.append(len(self.active))
        with self.rt._lock:
            self.rt.batch_sizes.append(len(self.active))
        events = []
        for rid, r in list(self.active.items()):
            accepted = (r.rounds + len(r.prompt)) % self.block_size  # 0..3 drafts accepted, +1 bonus
            r.rounds += 1
            r.hist[accepted] += 1
            new: list[int] = []
            prev = r.out[-1] if r.out else r.prompt[-1]
            reason = None
            for _ in range(accepted + 1):
                if len(r.out) + len(new) >= r.params.max_new_tokens:
                    break
                prev = next_token(prev)
                new.append(prev)
            text = CharTokenizer().decode(r.out + new)
            for s in r.params.stop:
                if s in text:  # cut at the stop string; never emit it
                    keep = text.index(s) - len(r.out)
                    new, reason = new[: max(keep, 0)], "stop"
                    break
            r.out += new
            if reason is None and len(r.out) >= r.params.max_new_tokens:
                reason = "length"
            ev = Event(rid, new, finished=reason is not None, finish_reason=reason)
            if ev.finished:
                del self.active[rid]
                ev.stats = {
                    "rounds": r.rounds,
                    "tau": len(r.out) / r.rounds,
                    "accepted_hist": r.hist,
                    "params": dataclasses.asdict(r.params),
                    "runtime": "standin",
                }
            events.append(ev)
        return events


class StandinRuntime:
    SamplingParams = SamplingParams

    def __init__(self, bundle_dir: str, backend: str, max_batch: int, step_delay_s: float = 0.005) -> None:
        manifest = json.loads((Path(bundle_dir) / "manifest.json").read_text())
        self.bundle_dir, self.backend, self.max_batch = bundle_dir, backend, max_batch
        self.max_seq_len = int(manifest.get("max_seq_len", 4096))
        self.vocab_size = VOCAB_SIZE
        self.step_delay_s = float(step_delay_s)
        self.tokenizer = CharTokenizer()
        self.batch_sizes: list[int] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def scheduler(self, mode: str) -> StandinScheduler:
        return StandinScheduler(self, mode)


def create_runtime(bundle_dir: str, *, backend: str, max_batch: int, **options: Any) -> StandinRuntime:
    return StandinRuntime(bundle_dir, backend, max_batch, **options)
