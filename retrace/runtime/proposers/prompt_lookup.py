"""Prompt lookup as a proposer: drafts copied from a request's own tokens (runtime/prompt_lookup.py) for the
rounds the drafter sits out, as many as the lookup's cost-aware `choose` finds worth a wider verify. It
observes its own rounds (the decayed acceptance estimate behind `choose`)."""

from __future__ import annotations

from retrace.runtime.device import host_values, index_tensor
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.proposers.base import Proposal, RoundBatch


class LookupProposer:
    def __init__(self, lookup: PromptLookup, cost, block_size: int):
        """cost: the verify policy's CostModel (None: a policy without one; every proposal is verified whole)."""
        self.lookup, self.cost, self.block_size = lookup, cost, block_size

    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        drafts, lengths = self.lookup.propose(batch.reqs, self.block_size - 1)  # built on the host
        k = self.lookup.choose(lengths, self.cost)
        return Proposal("chain", self, drafts[:, :k].to(batch.device),
                        index_tensor([min(n, k) for n in host_values(lengths)], batch.device))

    def observe(self, outcome) -> None:
        if outcome.proposal.source is self:
            self.lookup.observe(outcome.host_judged, outcome.host_accepted)  # read with the round

    def clear(self, slot: int) -> None:
        self.lookup.clear(slot)
