"""The lossless draft/verify loop with continuous batching.

One round for the requests of one mode, top to bottom as in the paper:
  1. draft   the block [anchor, MASK x (B-1)] conditioned on the committed context (and, in `retrace`
             mode, on the previous round's rejected suffix),
  2. verify  [anchor, d_1 .. d_{B-1}] with the target in one pass,
  3. accept  the longest prefix the target agrees with (or speculative sampling) plus the bonus token,
  4. remember the rejected suffix for the next round (retrace mode),
  5. commit  tokens, stop checks; the verify taps become the drafter's next context.
`ar` mode is the same round with no drafts. Requests join (prefill) and leave between rounds; every cache
is indexed by absolute position, so nothing is copied when a row accepts fewer tokens than another.
A verify policy (runtime/verify_policy.py) decides, before 1., whether the round drafts at all and, after
it, how many drafts K each row sends to 2. (K = 0 is plain decoding; fewer drafts never change the output).
Tree mode (tree_budget > 0): 2. verifies a draft tree of at most tree_budget nodes
per row instead (runtime/draft_tree.py: the drafter's top-k, the previous round's rejected suffix, the
target's argmax on it; sampling rows: the sampled drafts instead of the top-k), 3. keeps its longest path
the target agrees with (greedy) or SpecInfer's recursive rejection sampling walk (runtime/tree_accept.py), the
backend moves that path's K/V to its absolute positions (commit_path), and 4./5. see the round path (the
accepted path continued by the best child) as a chain round's verify. The verify policy decides, before
1., whether the round drafts at all (no draft: a plain decoding round) and, after it, how many of the tree's
best-first nodes (<= tree_budget) it verifies (policy.choose_tree; fixed: all).
Every tensor of a round lives on the backend's device (runtime/device.py); the host reads the round once, at
5. (plus the adaptive policy's K), and times it with the device's clock (runtime/stopwatch.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from retrace.errors import RetraceError
from retrace.runtime.backend import Backend
from retrace.runtime.detokenize import IncrementalText
from retrace.runtime.device import device_of, host_values, index_tensor, read
from retrace.runtime.draft_tree import SOURCES, SourceRates, build_trees
from retrace.runtime.modes import MODES  # re-exported (retrace.runtime.loop.MODES)
from retrace.runtime.options import RuntimeOptions
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.rejected_trajectory import RejectedTrajectory
from retrace.runtime.sampling import (
    SamplingParams,
    argmax,
    greedy_accept,
    guard_rows,
    mask_early_eos,
    processed_probs,
    sample_drafts,
    speculative_accept,
)
from retrace.runtime.stats import AcceptStats, Timing
from retrace.runtime.stopwatch import stopwatch_for
from retrace.runtime.suffix_memory import SuffixMemory
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.tree_accept import (
    continue_path,
    greedy_tree_accept,
    root_path,
    sample_tree_accept,
    source_counts,
)
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
    stats: AcceptStats = field(default_factory=AcceptStats)
    slot: int = -1
    anchor: int = -1  # last committed token (no target K/V yet)
    anchor_pos: int = -1
    ctx_taps: torch.Tensor | None = None  # target taps not yet given to the drafter (the last verify's)
    ctx_parts: list[torch.Tensor] = field(default_factory=list)  # earlier ones, from rounds without a draft
    ctx_parts_len: int = 0  # their total length
    ctx_pos0: int = 0  # absolute position of ctx_taps[0]
    generator: torch.Generator | None = None
    t_start: float = 0.0
    t_end: float = 0.0

    def result(self) -> dict:
        wall = max(self.t_end - self.t_start, 1e-12)
        return {
            "token_ids": list(self.output_ids), "text": self.text, "finish_reason": self.finish_reason,
            "stats": {**self.stats.to_dict(), "tokens_per_s": len(self.output_ids) / wall, "wall_s": wall},
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
        self.memory = (SuffixMemory(backend.max_batch, self.block_size, dc.hidden_size, device=self.device)
                       if dc is not None else None)
        self.free_slots = list(range(backend.max_batch))
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}  # slot -> request
        self.timing = Timing()
        self.stats: dict[str, AcceptStats] = {m: AcceptStats() for m in MODES}
        self.max_batch_seen = 0
        self._ids = itertools.count()
        self.policy = make_policy(options.verify_policy, backend, self.block_size) if dc is not None else FixedPolicy(1)
        self.tree_budget = options.tree_budget
        self.tree_sources = options.tree_sources
        self.tree_rates = SourceRates()
        self.clock = stopwatch_for(self.device)  # host timers on the CPU, CUDA events on CUDA
        self.trajectory = (RejectedTrajectory(backend.max_batch, self.block_size, device=self.device)
                           if dc is not None else None)
        # per source: [tree nodes whose parent was accepted, of those accepted, accepted that only it proposed]
        self.tree_counts = {s: [0, 0, 0] for s in SOURCES}
        lookup = PromptLookup() if options.prompt_lookup is True else options.prompt_lookup or None
        self.lookup = lookup if dc is not None else None

    # -- requests --------------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, mode: str = "retrace") -> Request:
        """Queue a request (validated now, so a bad one never breaks a running batch)."""
        self.check(prompt_ids, params, mode)
        req = Request(next(self._ids), list(prompt_ids), params, mode)
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
        t0 = time.perf_counter()
        events: dict[int, Event] = {}
        admitted = self._admit()
        if admitted:
            self._prefill(admitted, events)
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        for mode in MODES:
            # in slot order: a full batch's slots are then one contiguous range, which backends bind as views
            # (a scattered set is gathered; the running dict's order is admission order, not slot order)
            group = sorted((r for r in self.running.values() if r.mode == mode), key=lambda r: r.slot)
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
                self.trajectory.clear(req.slot)
            if self.lookup is not None:
                self.lookup.clear(req.slot)
            admitted.append(req)
        return admitted

    def _prefill(self, reqs: list[Request], events: dict[int, Event]) -> None:
        t0 = time.perf_counter()
        dev = self.device
        lens = [len(r.prompt_ids) for r in reqs]
        T = max(lens)
        ids = torch.tensor([r.prompt_ids + [0] * (T - len(r.prompt_ids)) for r in reqs], device=dev)
        positions = index_tensor([list(range(T))] * len(reqs), dev)
        slots = index_tensor([r.slot for r in reqs], dev)
        logits, taps = self.backend.target(slots, ids, positions, torch.tensor(lens, device=dev).sub(1).unsqueeze(1))
        logits = self._min_length(logits, reqs)
        firsts = read(self._sample_first(logits[:, 0], reqs))  # the step's one read for the prefill
        self.timing.prefill += time.perf_counter() - t0
        for i, (r, first) in enumerate(zip(reqs, firsts, strict=True)):
            r.ctx_taps, r.ctx_parts, r.ctx_parts_len, r.ctx_pos0 = taps[i, : len(r.prompt_ids)], [], 0, 0
            r.anchor, r.anchor_pos = first, len(r.prompt_ids)
            self._commit(r, [first], events)

    def _round(self, reqs: list[Request], events: dict[int, Event]) -> None:
        mode = reqs[0].mode
        N = len(reqs)
        dev = self.device
        slots = index_tensor([r.slot for r in reqs], dev)
        anchor = torch.tensor([r.anchor for r in reqs], device=dev)
        anchor_host = [r.anchor_pos for r in reqs]
        anchor_pos = torch.tensor(anchor_host, device=dev)
        # draft slots the verify policy can use this round (0: no draft call; `ar` never drafts)
        S = self.policy.plan(mode, N) if mode != "ar" else 0
        tree = self.tree_budget > 0 and S > 0
        if tree:  # a tree draws on every slot of the block
            S = self.block_size - 1
        elif self.tree_budget > 0 and mode != "ar":  # no draft: the rejected trajectory goes stale
            for r in reqs:
                self.trajectory.clear(r.slot)

        # 1. draft (the drafter always fills the whole block; the policy picks K drafts per row to verify)
        hidden = q = draft_logits = verified = None
        drafts = torch.zeros(N, 0, dtype=torch.int64, device=dev)
        draft_marks = None  # the stopwatch's marks around the draft call (device time on CUDA)
        if S > 0:
            draft_marks = [self.clock.mark()]
            B = self.block_size
            block_ids = torch.cat([anchor.unsqueeze(1), torch.full((N, B - 1), self.mask_id, device=dev)], dim=1)
            ctx_taps, ctx_pos = self._context(reqs)
            suffix = self.memory.read(slots) if mode == "retrace" else None
            hidden, draft_logits = self.backend.draft(slots, ctx_taps, ctx_pos, block_ids,
                                                      index_tensor(_ranges(anchor_host, B), dev), suffix)
            draft_logits = draft_logits[:, :S]
            drafts, q = self._propose(draft_logits, reqs)
            verified = self.policy.choose(mode, draft_logits, drafts, q) if not tree else None
            draft_marks.append(self.clock.mark())
        lookup = S == 0 and self.lookup is not None and mode != "ar"
        if lookup:  # no drafter call: the request's own tokens may still offer a few drafts
            drafts, lengths = self.lookup.propose(reqs, self.block_size - 1)
            k = self.lookup.choose(lengths, getattr(self.policy, "cost", None))
            drafts, verified = drafts[:, :k].to(dev), index_tensor(lengths.clamp_max(k).tolist(), dev)  # host-built
        K = max(host_values(verified)) if verified is not None else 0  # policies build K on the host

        t_draft = verify_marks = None
        if tree:  # 2.-4. on a draft tree
            t_draft = self.clock.seconds(*draft_marks)
            self.timing.draft += t_draft
            accepted, bonus, drafts, taps, verified = self._tree_round(reqs, slots, anchor, anchor_pos, hidden,
                                                                       draft_logits, drafts, q, t_draft)
        else:
            # 2. verify [anchor, d_1 .. d_K] (rows with a smaller K ignore the tail: a masked, padded verify)
            verify_marks = [self.clock.mark()]
            block = torch.cat([anchor.unsqueeze(1), drafts], dim=1)
            logits, taps = self.backend.target(slots, block[:, : K + 1], index_tensor(_ranges(anchor_host, K + 1), dev),
                                               torch.arange(K + 1, device=dev).expand(N, K + 1))
            verify_marks.append(self.clock.mark())
            logits = self._min_length(logits, reqs)

            # 3. accept
            accepted, bonus, target_argmax = self._accept(logits, drafts[:, :K], q, reqs, verified)
            if lookup:
                self.lookup.observe(verified, accepted)

            # 4. remember the rejected suffix (every drafted slot the target scored; nothing without a draft)
            if mode == "retrace":
                self.memory.write(slots, hidden, block, logits, draft_logits, accepted, anchor_pos,
                                  target_argmax, verified)

        # 5. commit: the round's one device-to-host read (accepted lengths, bonus tokens, drafts)
        ks = host_values(verified) if verified is not None else [0] * N
        D = drafts.shape[1]
        host = read(torch.cat([accepted.view(N, 1), bonus.view(N, 1), drafts.view(N, D)], dim=1).to(torch.int64))
        if verify_marks is not None:  # after the read: the marks' device work has completed
            t_draft = self.clock.seconds(*draft_marks) if draft_marks is not None else None
            t_verify = self.clock.seconds(*verify_marks)
            self.timing.draft += t_draft or 0.0
            self.timing.verify += t_verify
            self.policy.observe(mode, N, K + 1, t_verify, t_draft, verified, accepted)
        for i, (r, row, k) in enumerate(zip(reqs, host, ks, strict=True)):
            a, b, d = row[0], row[1], row[2:]
            r.stats.record(a, k, S)
            self.stats[mode].record(a, k, S)
            self._extend_context(r, taps[i], drafted=S > 0)
            r.anchor, r.anchor_pos = b, r.anchor_pos + a + 1
            self._commit(r, d[:a] + [b], events)

    # -- pieces of a round -----------------------------------------------------------------------------
    def _tree_round(self, reqs, slots, anchor, anchor_pos, hidden, draft_logits, top1, q, t_draft):
        """Verify and accept a draft tree per row (greedy, or the sampling walk of runtime/tree_accept.py). -> (accepted [N], bonus [N], path tokens after the
        anchor [N, D] (the first `accepted` are committed), round path taps [N, D+1] (the drafter's next
        context), tree nodes verified per row [N])."""
        N = len(reqs)
        dev = self.device
        rows = torch.arange(N, device=dev)
        t0 = self.clock.mark()
        sampling = [q[i] is not None for i in range(N)]
        tree = build_trees(draft_logits.float().softmax(-1), anchor, self.tree_budget, self.tree_sources,
                           self.trajectory.read(slots), self.tree_rates,
                           sampled=(torch.where(torch.tensor(sampling, device=dev).unsqueeze(1), top1, -1)
                                    if any(sampling) else None))
        tree = tree.truncate(self.policy.choose_tree(reqs[0].mode, tree))
        M = tree.nodes
        t1 = self.clock.mark()
        logits, taps = self.backend.target(slots, tree.tokens, anchor_pos.unsqueeze(1) + tree.depth,
                                           torch.arange(M, device=dev).expand(N, M), tree_mask=tree.ancestor_mask())
        logits = self._min_length(logits, reqs, tree.depth)
        accepted, bonus, node, post = greedy_tree_accept(tree, logits)
        for i, p in enumerate(_sampling_probs(logits, reqs)):  # sampling rows: the tree walk
            if p is not None:
                a, b, m = sample_tree_accept(tree, i, p, reqs[i].generator, q[i])
                accepted[i], bonus[i], node[i] = a, b, m
        end = continue_path(tree, node)  # the round path: accepted, then each node's best child
        path = root_path(tree, end)
        path_len = tree.depth[rows, end]
        L = path.shape[1]
        self.backend.commit_path(slots, anchor_pos.unsqueeze(1) + path, anchor_pos.unsqueeze(1) + torch.arange(L, device=dev))
        t_build, t_verify = self.clock.seconds(t0, t1), self.clock.seconds(t0, self.clock.mark())
        self.timing.verify += t_verify
        self.policy.observe_tree(reqs[0].mode, N, M, t_verify - t_build, t_draft + t_build, tree, path, accepted)
        for s, (tries, hits, only_tries, only_hits) in source_counts(tree, path, accepted).items():
            self.tree_rates.observe(s, only_tries, only_hits)  # what a source adds beyond the others
            for j, c in enumerate((tries, hits, only_hits)):
                self.tree_counts[s][j] += c
        path_tokens = tree.tokens.gather(1, path)
        path_taps = taps.gather(1, path.unsqueeze(-1).expand(-1, -1, taps.shape[-1]))
        path_post = post.gather(1, path)
        # the round's block: the round path's tokens, then the drafter's top-1 where the tree stopped
        block = torch.cat([anchor.unsqueeze(1), top1], dim=1)
        on = torch.arange(1, L, device=dev).unsqueeze(0) <= path_len.unsqueeze(1)
        block[:, 1:L] = torch.where(on, path_tokens[:, 1:], block[:, 1:L])
        self.trajectory.write(slots, block[:, 1:], path_post, path_len, accepted)
        if reqs[0].mode == "retrace":  # the round path is the verified chain the memory remembers
            path_logits = logits.gather(1, path.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            self.memory.write(slots, hidden, block, path_logits, draft_logits, accepted, anchor_pos, path_post,
                              path_len)
        return accepted, bonus, path_tokens[:, 1:], path_taps, tree.size - 1

    def _extend_context(self, r: Request, taps: torch.Tensor, drafted: bool) -> None:
        """The verify taps of this round become the drafter's next context. A round without a draft call
        gave the drafter nothing: its pending taps (up to the anchor) stay and the new ones follow."""
        if drafted:
            r.ctx_parts, r.ctx_pos0 = [], r.anchor_pos
        else:  # the valid part of the last taps: up to the anchor (the parts before it are all valid)
            r.ctx_parts.append(r.ctx_taps[: r.anchor_pos - r.ctx_pos0 - r.ctx_parts_len])
            r.ctx_parts_len += r.ctx_parts[-1].shape[0]
        if not r.ctx_parts:
            r.ctx_parts_len = 0
        r.ctx_taps = taps

    def _context(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pending target taps per row (prompt after prefill, the verify slots after a round, all the
        rounds' since the last draft call), right-padded. Pad entries sit at positions >= the anchor,
        where the drafter masks them."""
        for r in reqs:
            if r.ctx_parts:
                r.ctx_taps = torch.cat(r.ctx_parts + [r.ctx_taps])
                r.ctx_parts, r.ctx_parts_len = [], 0
        C = max(r.ctx_taps.shape[0] for r in reqs)
        if all(r.ctx_taps.shape[0] == C for r in reqs):
            taps = torch.stack([r.ctx_taps for r in reqs])
        else:
            taps = reqs[0].ctx_taps.new_zeros(len(reqs), C, reqs[0].ctx_taps.shape[-1])
            for i, r in enumerate(reqs):
                taps[i, : r.ctx_taps.shape[0]] = r.ctx_taps
        last = self.backend.max_seq_len - 1
        positions = index_tensor([[min(p, last) for p in row] for row in _ranges([r.ctx_pos0 for r in reqs], C)],
                                 self.device)
        return taps, positions

    def _propose(self, draft_logits: torch.Tensor, reqs: list[Request]):
        """Greedy rows take the drafter's argmax; sampling rows sample from its processed distribution q
        (q[i] is None for greedy rows)."""
        drafts = argmax(draft_logits)
        q = _sampling_probs(draft_logits, reqs)
        for i, r in enumerate(reqs):
            if q[i] is not None:
                drafts[i] = sample_drafts(q[i], r.generator)
        return drafts, q

    def _accept(self, logits, drafts, q, reqs, verified):
        """drafts [N, K]; row i judges only its first verified[i] drafts (None: all K).
        -> (accepted [N], bonus [N], the target's argmax [N, K+1]); sampling rows overwrite the first two."""
        K = drafts.shape[1]
        ks = host_values(verified) if verified is not None else [K] * len(reqs)
        if any(k < K for k in ks):  # drafts past a row's K can never match: -1 is no token
            drafts = drafts.masked_fill(torch.arange(K, device=drafts.device).unsqueeze(0) >= verified.unsqueeze(1), -1)
        accepted, bonus, target_argmax = greedy_accept(logits, drafts)
        p = _sampling_probs(logits, reqs)
        for i, r in enumerate(reqs):
            if p[i] is not None:
                k = ks[i]
                a, b = speculative_accept(p[i][: k + 1], q[i][:k] if q is not None else p[i][:0], drafts[i, :k],
                                          r.generator)
                accepted[i], bonus[i] = a, b
        return accepted, bonus, target_argmax

    def _min_length(self, logits: torch.Tensor, reqs: list[Request], offsets: torch.Tensor | None = None):
        """No EOS before a request's min_tokens: masked in the target's logits [N, T, V], before acceptance
        (offsets [N, T]: which new token each position scores; default 0..T-1, a tree's node depths)."""
        return mask_early_eos(logits, [len(r.output_ids) for r in reqs], [r.params.min_tokens for r in reqs],
                              self.eos_ids, offsets)

    def _sample_first(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits [N, V] after a prefill -> each request's first token [N] (argmax, or sampled), on the device."""
        first = argmax(logits)
        for i, p in enumerate(_sampling_probs(logits, reqs)):
            if p is not None:
                first[i] = torch.multinomial(p, 1, generator=reqs[i].generator)[0]
        return first

    # -- commit and stop ---------------------------------------------------------------------------------
    def _commit(self, r: Request, tokens: list[int], events: dict[int, Event]) -> None:
        if r.error is not None:  # its distribution could not be sampled: it fails alone, commits nothing
            self._finish(r, "error")
            events.setdefault(r.rid, Event(r, [], "", True)).finished = True
            return
        p = r.params
        n0 = len(r.output_ids)
        for t in tokens:
            r.output_ids.append(t)
            if t in self.eos_ids and not p.ignore_eos:
                r.finish_reason = "stop"
                break
            if len(r.output_ids) >= p.max_new_tokens:
                r.finish_reason = "length"
                break
        delta = ""
        if self.codec is not None:
            r.detok = r.detok or IncrementalText(self.codec)
            # a stop string not in the earlier (final) text can only end in the new text: search from there
            start = max(0, len(r.detok.stable) - max((len(s) for s in p.stop), default=0))
            r.text = r.detok.update(r.output_ids)
            if p.stop and _find_stop(r.text, p.stop, start) >= 0:
                # Stop right after the token that completes the stop string, as one token per round
                # would: the tokens of the accepted block after it are dropped, never emitted.
                for n in range(n0 + 1, len(r.output_ids) + 1):
                    text = self.codec.decode(r.output_ids[:n])
                    cut = _find_stop(text, p.stop)
                    if cut >= 0:
                        break
                del r.output_ids[n:]
                r.text = text[:cut]
                r.finish_reason = "stop"
            # hold back an incomplete UTF-8 tail and anything that might still become a stop string
            hold = 0 if r.finish_reason else max([len(s) - 1 for s in p.stop] + [0])
            visible = r.text[: len(r.text) - hold] if hold else r.text
            if not r.finish_reason and visible.endswith("\ufffd"):
                visible = visible.rstrip("\ufffd")
            if len(visible) > r.emitted_text:
                delta = visible[r.emitted_text:]
                r.emitted_text = len(visible)
        new = r.output_ids[n0:]
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
                self.trajectory.clear(r.slot)
            self.backend.release(r.slot)
            self.free_slots.append(r.slot)
            self.free_slots.sort()
        r.slot = -1


def _sampling_probs(logits: torch.Tensor, reqs: list[Request]) -> list[torch.Tensor | None]:
    """processed_probs(logits[i], params of row i) for the sampling rows, None for greedy rows; one call
    per distinct (temperature, top_k, top_p) rather than one per row. A row that is no distribution gets
    its request's `error` set (sampling.guard_rows)."""
    out: list[torch.Tensor | None] = [None] * len(reqs)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        if not r.params.greedy:
            groups.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(i)
    for rows in groups.values():
        probs, bad = guard_rows(processed_probs(logits[rows], reqs[rows[0]].params))
        for j in bad:  # the row fails alone (at its commit); the one-hot guard_rows put there keeps the round going
            p = reqs[rows[j]].params
            reqs[rows[j]].error = (f"the sampling distribution of this request cannot be sampled (non-finite "
                                   f"probabilities at temperature {p.temperature:g}, top_k {p.top_k}, top_p {p.top_p:g})")
        for j, i in enumerate(rows):
            out[i] = probs[j]
    return out


def _ranges(starts: list[int], width: int) -> list[list[int]]:
    """[[s, s+1, .., s+width-1] for each start] (host positions for `index_tensor`)."""
    return [list(range(p, p + width)) for p in starts]


def _find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:] (an index into text), -1 if none."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
