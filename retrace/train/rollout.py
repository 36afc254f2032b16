"""Batched generation and on-policy draft/verify rollouts through the runtime's own Scheduler.

Everything runs through `retrace.runtime.loop.Scheduler` (continuous batching, right padding, per-row
positions), so training sees exactly what serving computes: the same alignment (`suffix_memory.align`),
the same reliability features (`suffix_memory.suffix_features`) and the same correction taps. The
Scheduler is not modified: a thin backend wrapper (`RecordingBackend`) records what the Scheduler feeds
the drafter in every retrace round: the suffix memory, features, valid mask, and the verify taps at
`corr_index` (the correction source). Round r+1's recorded suffix is round r's rejected suffix.

On a GPU the rollouts run on the runtime's own torch backend with `device=` (`make_backend`); its tensors
(and so the records) live on that device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from retrace.models.drafter import DFlashDrafter
from retrace.models.target import Qwen3Target
from retrace.runtime.loop import Scheduler
from retrace.runtime.options import RuntimeOptions
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.torch_backend import TorchBackend
from retrace.runtime.torch_concat import ConcatTorchBackend


def make_backend(target: Qwen3Target, drafter: DFlashDrafter | None, max_batch: int, max_seq_len: int,
                 device: torch.device | str = "cpu", static_cache: bool = False):
    """The runtime's torch backend on `device` (the models must be there: the trainers put them there).
    Training and its evaluations run it over a dense past (runtime/torch_concat.py: the numerics the shipped
    zoo was trained with); static_cache=True: the runtime's static caches (same tokens, other last bits)."""
    cls = TorchBackend if static_cache else ConcatTorchBackend
    return cls(target, drafter, max_batch=max_batch, max_seq_len=max_seq_len, device=device)


# -- records -----------------------------------------------------------------------------------------------
@dataclass
class RoundRecord:
    """One draft call in retrace mode, as the Scheduler fed it (CPU tensors, one row)."""

    anchor_pos: int  # p' (the block's slot 0 position)
    anchor: int  # the anchor token
    memory: torch.Tensor  # [B, d]
    features: torch.Tensor  # [B, F]
    valid: torch.Tensor  # [B] float
    corr_taps: torch.Tensor  # [B, k*d] = ctx_taps[corr_index] (raw verify taps of the previous round)
    corr_index: torch.Tensor | None = None  # [B] (kept for checks)
    draft_logits: torch.Tensor | None = None  # [B-1, V] what the drafter returned (kept for checks)
    hidden: torch.Tensor | None = None  # [B, d]
    target_tokens: torch.Tensor | None = None  # [B] the previous verify's argmax at slot j-1 (diagnosis only)


@dataclass
class Rollout:
    prompt_ids: list[int]
    output_ids: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted count of every round (order not kept)
    verify: list[dict] = field(default_factory=list)  # per round, only with keep_debug

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def tau(self) -> float | None:
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else None


def _keep(t: torch.Tensor) -> torch.Tensor:
    """A host copy for a record (records are training data: kept on the host, whatever the device)."""
    return t.detach().to("cpu", copy=True)


class RecordingBackend:
    """Wraps a backend; records each retrace draft call's suffix inputs per request (see module doc)."""

    def __init__(self, inner, keep_debug: bool = False, keep_empty: bool = False):
        self.inner = inner
        self.sched: Scheduler | None = None
        self.records: dict[int, Rollout] = {}  # rid -> rollout
        self.keep_debug = keep_debug
        self.keep_empty = keep_empty
        self._last_verify: dict[int, torch.Tensor] = {}  # rid -> argmax tokens of its last verify pass [B]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, slots, input_ids, positions, logits_index):
        logits, taps = self.inner.target(slots, input_ids, positions, logits_index)
        if self.sched is not None and input_ids.shape[1] > 1 and logits.shape[1] == input_ids.shape[1]:
            post = logits.argmax(-1)
            for i, s in enumerate(slots.tolist()):
                req = self.sched.running.get(s)
                if req is None or req.rid not in self.records or int(positions[i, 0]) != req.anchor_pos:
                    continue  # not a verify pass (prefill)
                self._last_verify[req.rid] = post[i].clone()
                if self.keep_debug:
                    self.records[req.rid].verify.append({
                        "anchor_pos": int(positions[i, 0]), "block": input_ids[i].clone(),
                        "logits": logits[i].clone(), "taps": taps[i].clone()})
        return logits, taps

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        hidden, logits = self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        if self.sched is not None and suffix is not None:
            corr = torch.gather(ctx_taps, 1, suffix.corr_index.unsqueeze(-1).expand(-1, -1, ctx_taps.shape[-1]))
            for i, s in enumerate(slots.tolist()):
                req = self.sched.running[s]
                rec = self.records.get(req.rid)
                if rec is None:
                    continue
                if not self.keep_empty and not bool(suffix.valid[i].any()):
                    continue
                rec.rounds.append(RoundRecord(
                    anchor_pos=int(block_positions[i, 0]), anchor=int(block_ids[i, 0]),
                    memory=_keep(suffix.memory[i]), features=_keep(suffix.features[i]),
                    valid=_keep(suffix.valid[i]), corr_taps=_keep(corr[i]),
                    corr_index=_keep(suffix.corr_index[i]) if self.keep_debug else None,
                    draft_logits=_keep(logits[i]) if self.keep_debug else None,
                    hidden=_keep(hidden[i]) if self.keep_debug else None,
                    target_tokens=(_keep(self._last_verify[req.rid][suffix.corr_index[i]].cpu())
                                   if req.rid in self._last_verify
                                   else torch.zeros(suffix.corr_index.shape[1], dtype=torch.long))))
        return hidden, logits

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def run_requests(backend, prompts: list[list[int]], mode: str, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, block_size: int | None = None, eos_ids: tuple[int, ...] | None = None,
                 record: bool = False, keep_debug: bool = False, keep_empty: bool = False,
                 progress=None, verify_policy: str = "fixed", tree_budget: int = 0,
                 tree_sources: str = "topk,suffix,target") -> tuple[list[Rollout], Scheduler]:
    """Run every prompt through one continuous batch of `backend.max_batch` slots. Returns one Rollout per
    prompt (output ids, per-round accepted counts, and with `record` the retrace suffix records)."""
    rec_be = RecordingBackend(backend, keep_debug=keep_debug, keep_empty=keep_empty) if record else backend
    sched = Scheduler(rec_be, None, RuntimeOptions(block_size=block_size, eos_ids=eos_ids, verify_policy=verify_policy,
                                                   tree_budget=tree_budget, tree_sources=tree_sources,
                                                   prompt_lookup=False))  # the drafter's rounds only
    if record:
        rec_be.sched = sched
    reqs = []
    outs: list[Rollout] = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        reqs.append(sched.add(list(p), params, mode))
        outs.append(Rollout(list(p), []))
        if record:
            rec_be.records[reqs[-1].rid] = outs[-1]
    while sched.has_work:
        events = sched.step()
        if progress is not None:
            progress(sum(len(e.token_ids) for e in events))
    for req, out in zip(reqs, outs, strict=True):
        out.output_ids = list(req.output_ids)
        hist = req.stats.accepted_hist
        out.accepted = [a for a, n in enumerate(hist) for _ in range(n)]
    return outs, sched


class TapRecorder:
    """Wraps a backend in `ar` mode; keeps the target taps of every fed token per request (prefill rows
    trimmed to the prompt), so generating the responses also yields the drafter's training context."""

    def __init__(self, inner, dtype=torch.float16):
        self.inner = inner
        self.sched: Scheduler | None = None
        self.dtype = dtype
        self.parts: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, slots, input_ids, positions, logits_index):
        logits, taps = self.inner.target(slots, input_ids, positions, logits_index)
        for i, s in enumerate(slots.tolist()):
            req = self.sched.running.get(s)
            if req is None:
                continue
            p0 = int(positions[i, 0])
            n = len(req.prompt_ids) if p0 == 0 else input_ids.shape[1]
            self.parts.setdefault(req.rid, []).append((p0, taps[i, :n].to(self.dtype).clone()))
        return logits, taps

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def taps_of(self, rid: int) -> torch.Tensor:
        parts = sorted(self.parts.get(rid, []), key=lambda x: x[0])
        pos = 0
        for p0, t in parts:
            if p0 != pos:
                raise RuntimeError(f"taps of request {rid} are not contiguous at position {pos}")
            pos += t.shape[0]
        return torch.cat([t for _, t in parts])


def generate(target: Qwen3Target, prompts: list[list[int]], max_new_tokens: int, max_batch: int = 32,
             temperature: float = 0.0, seed: int = 0, device="cpu", progress=None, return_taps: bool = False):
    """The target's own continuations (autoregressive, batched; greedy at temperature 0). With return_taps,
    also the target taps [len(prompt) + len(output) - 1, k*d] (fp16, CPU) of each sequence (every token but
    the last was fed to the target): (outputs, taps)."""
    if not prompts:
        return ([], []) if return_taps else []
    max_len = max(len(p) for p in prompts) + max_new_tokens + 2
    be = make_backend(target, None, min(max_batch, len(prompts)), max_len, device)
    if not return_taps:
        outs, _ = run_requests(be, prompts, "ar", max_new_tokens, temperature, seed, progress=progress)
        return [o.output_ids for o in outs]
    rec = TapRecorder(be)
    sched = Scheduler(rec, None, RuntimeOptions(verify_policy="fixed", prompt_lookup=False))
    rec.sched = sched
    reqs = [sched.add(list(p), SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i),
                      "ar") for i, p in enumerate(prompts)]
    while sched.has_work:
        events = sched.step()
        if progress is not None:
            progress(sum(len(e.token_ids) for e in events))
    return [list(r.output_ids) for r in reqs], [rec.taps_of(r.rid) for r in reqs]


def rollout(target: Qwen3Target, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
            max_batch: int = 32, temperature: float = 0.0, seed: int = 0, block_size: int | None = None,
            device="cpu", keep_debug: bool = False, keep_empty: bool = False, progress=None) -> list[Rollout]:
    """On-policy retrace rounds with the drafter's current conditioner; records every round's suffix."""
    B = block_size or drafter.config.block_size
    max_len = max(len(p) for p in prompts) + max_new_tokens + B + 2
    be = make_backend(target, drafter, min(max_batch, len(prompts)), max_len, device)
    outs, _ = run_requests(be, prompts, "retrace", max_new_tokens, temperature, seed, block_size=B, record=True,
                           keep_debug=keep_debug, keep_empty=keep_empty, progress=progress)
    return outs


def generate_shard(target_dir: str, tap_layers: tuple[int, ...], prompts: list[list[int]], max_new_tokens: int,
                   max_batch: int, temperature: float, seed: int, return_taps: bool):
    """`generate` in a worker process (loads the target itself; CPU)."""
    target = Qwen3Target.from_pretrained(target_dir, tap_layers=tuple(tap_layers))
    return generate(target, prompts, max_new_tokens, max_batch, temperature, seed, "cpu", return_taps=return_taps)
