"""What a round's verify decided (`RoundOutcome`), and the observers that learn from it.

After the round's one device-to-host read every observer sees the outcome (`observer.observe(outcome)`):
the rejected-suffix memory (runtime/suffix_memory.py), the verify policy (`PolicyObserver`), prompt lookup
and the tree's source rates (their proposers), the run's timings (`TimingObserver`). Shapes: N rows, D tokens
after the anchor, L+1 positions on the verified chain (a tree's round path), H the taps' width, V the
vocabulary, M a tree's nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from retrace.runtime.device import read
from retrace.runtime.proposers.base import Proposal, RoundBatch
from retrace.runtime.sampling import flag_errors, pending_flags
from retrace.runtime.stats import Timing


@dataclass
class RoundOutcome:
    batch: RoundBatch  # the round's rows
    proposal: Proposal  # what was verified
    accepted: torch.Tensor  # [N] int64 drafts accepted per row
    bonus: torch.Tensor  # [N] int64 the target's token after them (committed too)
    tokens: torch.Tensor  # [N, D] int64 tokens after the anchor; a row commits its first `accepted`, then bonus
    taps: torch.Tensor  # [N, L+1, H] verify taps along the verified chain: the drafter's next context
    judged: torch.Tensor | None  # [N] int64 drafts (tree: nodes) the target judged per row; None: none
    width: int  # tokens per row the verify scored (chain: K + 1, tree: M)
    block: torch.Tensor  # [N, 1+S] the anchor, then the verified chain's tokens, then the drafter's top-1
    logits: torch.Tensor  # chain: [N, K+1, V] verify logits; tree: [N, M, V] at every node
    target_argmax: torch.Tensor  # [N, L+1] int64 the target's argmax along the verified chain
    path: torch.Tensor | None = None  # tree: [N, L+1] node index of the round path per depth; chain: None
    path_len: torch.Tensor | None = None  # [N] int64 verified chain length (chain: `judged`; tree: path depth)
    marks: tuple = ()  # stopwatch marks around the verify
    draft_s: float | None = None  # seconds of the drafter call (None: no call); set by `read`
    build_s: float = 0.0  # seconds building the tree (chain: 0); set by `read`
    verify_s: float = 0.0  # seconds of the verify (tree: and its acceptance); set by `read`
    host_accepted: list[int] | None = None  # [N] `accepted` on the host; set by `read`
    host_judged: list[int] | None = None  # [N] `judged` on the host (0: none); set by `read`

    def path_logits(self) -> torch.Tensor:
        """[N, L+1, V] the verify logits along the verified chain (a tree's: gathered on the round path)."""
        if self.path is None:
            return self.logits
        return self.logits.gather(1, self.path.unsqueeze(-1).expand(-1, -1, self.logits.shape[-1]))

    def read(self, clock) -> list[list[int]]:
        """The round's one device-to-host read -> per row [accepted, bonus, judged, tokens..] (and the sampling
        rows' unsampleable flags, which become their requests' errors); then the stopwatch's marks
        (complete by now) become seconds."""
        N, reqs = self.batch.rows, self.batch.reqs
        judged = self.judged if self.judged is not None else self.accepted  # no drafts: accepted is 0 too
        cols = [torch.stack([self.accepted, self.bonus, judged], 1), self.tokens.view(N, self.tokens.shape[1])]
        flags = pending_flags(reqs, self.accepted.device)  # sampling rows: whose distribution was no distribution
        if flags is not None:
            cols.append(flags.view(N, 1))
        host = read(torch.cat(cols, dim=1).to(torch.int64))
        if flags is not None:
            flag_errors(reqs, [row.pop() for row in host])
        self.host_accepted, self.host_judged = [row[0] for row in host], [row[2] for row in host]
        marks = self.proposal.marks
        if marks:
            self.draft_s = clock.seconds(marks[0], marks[1])
            self.build_s = clock.seconds(marks[1], marks[2]) if len(marks) > 2 else 0.0
        self.verify_s = clock.seconds(*self.marks)
        return host


class RoundObserver(Protocol):
    def observe(self, outcome: RoundOutcome) -> None:
        """After the round's read: learn from it (times are set, host values may be read)."""
        ...


class PolicyObserver:
    """The verify policy learns the round's costs and outcome (a chain's K, or a tree's budget).

    A draft call's time is the cost of drafting only when its context was one round's taps (C <= B). A call
    after rounds without one (a new request's prompt, a pause of the policy) also runs all the positions
    committed since through the drafter: a cost owed for every committed position whether the policy drafts
    now or later, so not the cost of drafting now (at the 0.6B shape, batch 4: 39 ms against a 30 ms decode,
    which then kept the policy from drafting, and each later call caught up more). Such a call's time is
    passed as None (not measured)."""

    def __init__(self, policy, block_size: int):
        self.policy, self.block_size = policy, block_size

    def observe(self, o: RoundOutcome) -> None:
        mode, N, p = o.batch.mode, o.batch.rows, o.proposal
        draft_s = o.draft_s if o.draft_s is not None and p.context <= self.block_size else None
        if p.tree is None:
            self.policy.observe(mode, N, o.width, o.verify_s, draft_s, p.verified, o.accepted)
        else:  # the tree's build counts as drafting
            self.policy.observe_tree(mode, N, o.width, o.verify_s, None if draft_s is None else draft_s + o.build_s,
                                     p.tree, o.path, o.accepted)


class TimingObserver:
    """The run's time split: the drafter calls, the verifies (a tree's build included)."""

    def __init__(self, timing: Callable[[], Timing]):
        self.timing = timing  # the scheduler's current Timing (Runtime.reset_stats replaces it)

    def observe(self, o: RoundOutcome) -> None:
        timing = self.timing()
        timing.draft += o.draft_s or 0.0
        timing.verify += o.build_s + o.verify_s
