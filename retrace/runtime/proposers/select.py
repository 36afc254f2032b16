"""Which proposer drafts this round, from the verify policy's plan (how many draft slots can pay, before
drafting): S > 0 -> the drafter (a chain, or a tree with a tree budget); S = 0 -> prompt lookup where the
runtime has one, else none (plain decoding). `ar` mode never drafts."""

from __future__ import annotations

from retrace.runtime.proposers.base import NoProposer, Proposer, RoundBatch


class ProposerPlan:
    def __init__(self, policy, drafter: Proposer | None, lookup: Proposer | None = None):
        self.policy, self.drafter, self.lookup = policy, drafter, lookup
        self.none = NoProposer()

    def pick(self, batch: RoundBatch) -> tuple[Proposer, int]:
        """-> (the proposer, the draft slots it may fill)."""
        if batch.mode == "ar" or self.drafter is None:
            return self.none, 0
        slots = self.policy.plan(batch.mode, batch.rows)
        if slots > 0:
            return self.drafter, slots
        return self.lookup or self.none, 0

    @property
    def proposers(self) -> list[Proposer]:
        """Every proposer this plan can pick (each observes the rounds)."""
        return [p for p in (self.drafter, self.lookup, self.none) if p is not None]
