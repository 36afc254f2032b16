"""The lossless draft/verify loop with continuous batching.

One round for the requests of one mode, top to bottom as in the paper (`Scheduler._round`):
  1. draft   a proposer offers drafts (runtime/proposers/): the drafter's block [anchor, MASK x (B-1)]
             conditioned on the committed context (and, in `retrace` mode, on the previous round's
             rejected suffix) as a chain or a draft tree, prompt lookup, or nothing; which one runs is the
             verify policy's plan (runtime/proposers/select.py),
  2. verify  the proposal with the target in one pass,
  3. accept  the longest prefix the target agrees with (or speculative sampling) plus the bonus token
             (runtime/verify_accept.py: one step per proposal kind),
  4. remember the rejected suffix for the next round (runtime/suffix_memory.py); it, the verify policy,
             prompt lookup and the tree's source rates observe the round's outcome (runtime/round_outcome.py),
  5. commit  tokens, stop checks (runtime/stop_strings.py); the verify taps become the drafter's next context.
`ar` mode is the same round with no drafts. Requests join (prefill) and leave between rounds; every cache
is indexed by absolute position, so nothing is copied when a row accepts fewer tokens than another.
A verify policy (runtime/verify_policy.py) decides, before 1., whether the round drafts at all and, after
it, how many drafts K each row sends to 2. (K = 0 is plain decoding; fewer drafts never change the output),
or for a tree how many of its best-first nodes (<= tree_budget) it verifies.
Every tensor of a round lives on the backend's device (runtime/device.py); the host reads the round once,
before 4. (plus the adaptive policy's K), and times it with the device's clock (runtime/stopwatch.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from retrace.errors import RetraceError
from retrace.runtime.backend import Backend
from retrace.runtime.detokenize import IncrementalText
from retrace.runtime.device import device_of, index_tensor, read, to_device
from retrace.runtime.draft_tree import SOURCES, SourceRates
from retrace.runtime.host_threads import LoopThreads
from retrace.runtime.modes import MODES  # re-exported (retrace.runtime.loop.MODES)
from retrace.runtime.options import RuntimeOptions
from retrace.runtime.prefill_chunks import budget_for, next_chunks
from retrace.runtime.prefill_groups import free_rows_for, prefill_groups
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.proposers import (
    DrafterCall,
    DrafterChain,
    DrafterTree,
    LookupFirstPlan,
    LookupProposer,
    ProposerPlan,
    RoundBatch,
)
from retrace.runtime.proposers.context import continue_context, extend_context, start_context
from retrace.runtime.round_outcome import PolicyObserver, TimingObserver
from retrace.runtime.sampling import SamplingParams, argmax, flag_errors, pending_flags, row_probs
from retrace.runtime.stats import AcceptStats, Timing
from retrace.runtime.stop_strings import append
from retrace.runtime.stopwatch import stopwatch_for
from retrace.runtime.suffix_memory import SuffixMemory
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.verify_accept import VerifyAndAccept, min_length
from retrace.runtime.verify_policy import FixedPolicy, make_policy


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_text: int = 0  # chars of `text` already streamed
    detok: IncrementalText | None = None  # keeps `text` current, decoding a short window per round
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # why it failed alone (finish_reason "error"; its batch-mates went on)
    unsampleable: torch.Tensor | None = None  # device bool: a distribution of this round was none (sampling.py)
    stats: AcceptStats = field(default_factory=AcceptStats)
    slot: int = -1
    anchor: int = -1  # last committed token (no target K/V yet)
    anchor_pos: int = -1  # -1 until the prompt is all in the cache and the first token is committed
    prefilled: int = 0  # prompt tokens in the cache (runtime/prefill_chunks.py)
    ctx_taps: torch.Tensor | None = None  # target taps not yet given to the drafter (the last verify's)
    ctx_parts: list[torch.Tensor] = field(default_factory=list)  # earlier ones, from rounds without a draft
    ctx_parts_len: int = 0  # their total length
    ctx_pos0: int = 0  # absolute position of ctx_taps[0]
    generator: torch.Generator | None = None
    t_arrival: float = 0.0  # when `add` queued it
    t_start: float = 0.0  # when it was admitted to a slot
    t_first: float = 0.0  # when its first token was committed (0: none yet)
    t_end: float = 0.0

    def result(self) -> dict:
        wall = max(self.t_end - self.t_start, 1e-12)
        n = len(self.output_ids)
        latency = {  # what a server's latency metrics observe (runtime/serving_metrics.py), None where undefined
            "ttft_s": self.t_first - self.t_arrival if self.t_first else None,
            "tpot_s": (self.t_end - self.t_first) / (n - 1) if self.t_first and n > 1 else None,
        }
        return {
            "token_ids": list(self.output_ids), "text": self.text, "finish_reason": self.finish_reason,
            "stats": {**self.stats.to_dict(), "tokens_per_s": n / wall, "wall_s": wall, **latency},
        }


@dataclass
class Event:
    """What one step committed for one request (streaming)."""

    request: Request
    token_ids: list[int]
    text: str
    finished: bool


class Scheduler:
    def __init__(self, backend: Backend, codec: TextCodec | None, options: RuntimeOptions):
        """options (runtime/options.py): the block size, verify policy, draft tree, prompt lookup and EOS ids."""
        self.backend = backend
        self.device = device_of(backend)  # every tensor of the round lives there
        self.codec = codec
        dc = backend.drafter_config
        self.block_size = options.block_size_for(backend)
        self.eos_ids = set(backend.target_config.eos_token_ids if options.eos_ids is None else options.eos_ids)
        self.mask_id = dc.mask_token_id if dc else -1
        self.free_slots = list(range(backend.max_batch))
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}  # slot -> request
        self.timing = Timing()
        self.stats: dict[str, AcceptStats] = {m: AcceptStats() for m in MODES}
        self.max_batch_seen = 0
        self.prefill_free_rows = free_rows_for(self.device)  # padding a prefill call may add (prefill_groups.py)
        self.prefill_chunk = budget_for(options.prefill_chunk, self.device)  # prompt tokens a step (prefill_chunks.py)
        self._ids = itertools.count()
        # the round's parts: who proposes (runtime/proposers/), verify and accept, who observes the outcome
        self.policy = make_policy(options.verify_policy, backend, self.block_size) if dc is not None else FixedPolicy(1)
        self.tree_budget = options.tree_budget
        self.tree_sources = options.tree_sources
        self.tree_rates = SourceRates()
        # per source: [tree nodes whose parent was accepted, of those accepted, accepted that only it proposed]
        self.tree_counts = {s: [0, 0, 0] for s in SOURCES}
        self.memory = (SuffixMemory(backend.max_batch, self.block_size, dc.hidden_size, device=self.device,
                                    trajectory=self.tree_budget > 0) if dc is not None else None)
        prompt_lookup = {True: PromptLookup(), "first": PromptLookup(first=True)}.get(options.prompt_lookup,
                                                                                       options.prompt_lookup) or None
        self.lookup = prompt_lookup if dc is not None else None
        clock = stopwatch_for(self.device)  # host timers on the CPU, CUDA events on CUDA
        self.drafter = None
        if dc is not None:
            call = DrafterCall(backend, self.memory, self.block_size, self.mask_id)
            self.drafter = (DrafterTree(call, self.policy, self.memory, self.tree_budget, self.tree_sources, clock,
                                        self.tree_rates, self.tree_counts)
                            if self.tree_budget else DrafterChain(call, self.policy, clock))
        # prompt lookup's K is cost-aware where the policy has a cost model (FixedPolicy and test policies: none)
        lookup = (LookupProposer(self.lookup, getattr(self.policy, "cost", None), self.block_size)
                  if self.lookup is not None else None)
        plan = LookupFirstPlan if self.lookup is not None and self.lookup.first else ProposerPlan
        self.plan = plan(self.policy, self.drafter, lookup)
        self.verify_and_accept = VerifyAndAccept(backend, clock, self.eos_ids)
        self.observers = [o for o in (self.memory, PolicyObserver(self.policy, self.block_size),
                                      TimingObserver(lambda: self.timing), *self.plan.proposers) if o is not None]
        # torch's threads for the steps' own ops (runtime/host_threads.py), torch's own again once idle
        self.loop_threads = LoopThreads(backend, idle=lambda: not self.has_work)

    @property
    def clock(self):
        """The round's stopwatch (runtime/stopwatch.py)."""
        return self.verify_and_accept.clock

    @clock.setter
    def clock(self, clock) -> None:  # tests swap in their own; the parts that time the round share it
        for part in (self.verify_and_accept, self.drafter):
            if part is not None:
                part.clock = clock

    # -- requests --------------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, mode: str = "retrace") -> Request:
        """Queue a request (validated now, so a bad one never breaks a running batch)."""
        self.check(prompt_ids, params, mode)
        req = Request(next(self._ids), list(prompt_ids), params, mode, t_arrival=time.perf_counter())
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu"))
        req.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting.append(req)
        return req

    def check(self, prompt_ids: list[int], params: SamplingParams, mode: str = "retrace") -> None:
        """Raise RetraceError if `add` would refuse the request (reads no scheduler state: thread-safe)."""
        if mode not in MODES:
            raise RetraceError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if mode != "ar" and self.backend.drafter_config is None:
            raise RetraceError(f"mode {mode!r} needs a drafter; this runtime has only a target (use mode 'ar')")
        if mode == "retrace" and not self.backend.has_conditioner:
            raise RetraceError("mode 'retrace' needs a ReTrace conditioner beside the drafter "
                               "(retrace init-conditioner or retrace train conditioner)")
        if not prompt_ids:
            raise RetraceError("empty prompt")
        vocab = self.backend.target_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RetraceError(f"prompt token ids must be in [0, {vocab})")
        room, what = max((self.block_size, "block"), (self.tree_budget, "draft tree"))  # the last round's
        need = len(prompt_ids) + params.max_new_tokens + room + 1
        if need > self.backend.max_seq_len:
            raise RetraceError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} + {what} "
                f"{room} + 1 exceeds the configured max length {self.backend.max_seq_len}")

    def cancel(self, req: Request) -> None:
        """Drop a request (client went away / preemption): frees its slot and its suffix memory."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        with self.loop_threads:
            return self._step()

    def _step(self) -> list[Event]:
        t0 = time.perf_counter()
        events: dict[int, Event] = {}
        self._admit()
        prefilling = [r for r in self.running.values() if r.anchor_pos < 0]  # admission order
        if prefilling:
            self._prefill(prefilling, events)
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        for mode in MODES:
            # in slot order: a full batch's slots are then one contiguous range, which backends bind as views
            # (a scattered set is gathered; the running dict's order is admission order, not slot order); a
            # request whose prompt is still being prefilled in chunks joins the rounds once it has its first token
            group = sorted((r for r in self.running.values() if r.mode == mode and r.anchor_pos >= 0),
                           key=lambda r: r.slot)
            if group:
                self._round(group, events)
        self.timing.wall += time.perf_counter() - t0
        return list(events.values())

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.pop(0)
            req.slot = self.free_slots.pop(0)
            req.t_start = time.perf_counter()
            self.running[req.slot] = req
            if self.memory is not None:
                self.memory.clear(req.slot)
            if self.lookup is not None:
                self.lookup.clear(req.slot)
            admitted.append(req)
        return admitted

    def _prefill(self, reqs: list[Request], events: dict[int, Event]) -> None:
        """The prompts not all in the cache yet (admission order), as far as this step's budget goes
        (runtime/prefill_chunks.py), in calls of similar lengths (runtime/prefill_groups.py); the requests whose
        prompt is then complete get their first tokens in one read, committed in admission order."""
        t0 = time.perf_counter()
        parts = next_chunks(reqs, self.prefill_chunk)
        groups = prefill_groups([stop - start for _, start, stop in parts], self.prefill_free_rows)
        first_of = self._first_tokens([self._prefill_call([parts[i] for i in g]) for g in groups])
        self.timing.prefill += time.perf_counter() - t0
        for r in reqs:
            if r.rid in first_of:
                r.anchor, r.anchor_pos = first_of[r.rid], len(r.prompt_ids)
                self._commit(r, [r.anchor], events)

    @staticmethod
    def _first_tokens(calls: list[tuple[torch.Tensor | None, list[Request]]]) -> dict[int, int]:
        """The prefill calls' (first tokens, completed requests) -> {rid: first token} in one read (none when no
        prompt completed); a sampling row whose distribution was no distribution is flagged (sampling.py)."""
        done = [r for _, rs in calls for r in rs]
        if not done:
            return {}
        first = torch.cat([f for f, rs in calls if rs])
        flags = pending_flags(done, first.device)
        firsts = read(first if flags is None else torch.stack([first, flags.to(first.dtype)]))  # the step's one read
        if flags is not None:
            firsts, bad = firsts
            flag_errors(done, bad)
        return {r.rid: f for r, f in zip(done, firsts, strict=True)}

    def _prefill_call(self, parts: list[tuple[Request, int, int]]) -> tuple[torch.Tensor | None, list[Request]]:
        """One target call over prompt tokens [start, stop) of each request (padded to the longest) -> (the first
        tokens [n] on the device of the requests whose prompt it completes, those requests). The chunks' taps
        extend the drafter's first context."""
        dev, last = self.device, self.backend.max_seq_len - 1
        lens = [stop - start for _, start, stop in parts]
        T = max(lens)
        ids = to_device([r.prompt_ids[a:b] + [0] * (T - (b - a)) for r, a, b in parts], dev)
        positions = index_tensor([[min(a + i, last) for i in range(T)] for _, a, _ in parts], dev)
        slots = index_tensor([r.slot for r, _, _ in parts], dev)
        logits, taps = self.backend.target(slots, ids, positions, index_tensor([[n - 1] for n in lens], dev))
        for i, (r, a, b) in enumerate(parts):
            (start_context if a == 0 else continue_context)(r, taps[i, : b - a])
            r.prefilled = b
        rows = [i for i, (r, _, b) in enumerate(parts) if b == len(r.prompt_ids)]
        if not rows:
            return None, []
        done = [parts[i][0] for i in rows]
        logits = logits if len(rows) == len(parts) else logits[index_tensor(rows, logits.device)]
        return self._sample_first(min_length(logits, done, self.eos_ids)[:, 0], done), done

    def _round(self, reqs: list[Request], events: dict[int, Event]) -> None:
        batch = RoundBatch.of(reqs, self.device)
        # 1. draft: the proposer the verify policy's plan picks (the drafter's chain or tree, prompt lookup, none)
        proposer, slots = self.plan.pick(batch)
        proposal = proposer.propose(batch, slots)

        # 2. verify and 3. accept: the step of the proposal's kind (a chain, or a tree under its ancestor mask)
        outcome = self.verify_and_accept[proposal.kind](batch, proposal)

        # 4. remember the rejected suffix: after the round's one device-to-host read (accepted lengths, bonus
        #    tokens, drafts), the memory, the verify policy, the proposers and the timings observe the outcome
        host = outcome.read(self.clock)
        for observer in self.observers:
            observer.observe(outcome)

        # 5. commit: each row's accepted drafts and bonus; its verify taps become the drafter's next context
        for r, (a, b, k, *tokens), taps in zip(reqs, host, outcome.taps.unbind(), strict=True):
            r.stats.record(a, k, proposal.slots)
            self.stats[batch.mode].record(a, k, proposal.slots)
            extend_context(r, taps, drafted=proposal.slots > 0)
            r.anchor, r.anchor_pos = b, r.anchor_pos + a + 1
            self._commit(r, tokens[:a] + [b], events)

    # -- the prefill's first token ---------------------------------------------------------------------
    def _sample_first(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits [N, V] after a prefill -> each request's first token [N] (argmax, or sampled), on the device."""
        first = argmax(logits)
        for i, p in enumerate(row_probs(logits, reqs)):
            if p is not None:
                first[i] = p.sample(reqs[i].generator)
        return first

    # -- commit and stop ---------------------------------------------------------------------------------
    def _commit(self, r: Request, tokens: list[int], events: dict[int, Event]) -> None:
        if r.error is not None:  # its distribution could not be sampled: it fails alone, commits nothing
            self._finish(r, "error")
            events.setdefault(r.rid, Event(r, [], "", True)).finished = True
            return
        n0 = len(r.output_ids)
        delta = append(r, tokens, self.eos_ids, self.codec)  # EOS, length, text and stop strings
        new = r.output_ids[n0:]
        if new and not n0:
            r.t_first = time.perf_counter()
        r.stats.tokens += len(new)
        self.stats[r.mode].tokens += len(new)
        ev = events.get(r.rid)
        if ev is None:
            events[r.rid] = Event(r, new, delta, False)
        else:
            ev.token_ids.extend(new)
            ev.text += delta
        if r.finish_reason:
            self._finish(r, r.finish_reason)
            events[r.rid].finished = True

    def _finish(self, r: Request, reason: str) -> None:
        r.finished = True
        r.finish_reason = r.finish_reason or reason
        r.t_end = time.perf_counter()
        r.ctx_taps, r.ctx_parts = None, []
        if r.slot >= 0 and self.running.get(r.slot) is r:
            del self.running[r.slot]
            if self.memory is not None:
                self.memory.clear(r.slot)
            self.backend.release(r.slot)
            self.free_slots.append(r.slot)
            self.free_slots.sort()
        r.slot = -1
