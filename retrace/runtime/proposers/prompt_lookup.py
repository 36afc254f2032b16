"""Prompt lookup as a proposer: drafts copied from a request's own tokens (runtime/prompt_lookup.py) for the
rounds the drafter sits out (and, with `first`, the rounds it is expected to beat the drafter in), as many as
the lookup's cost-aware `best` finds worth a wider verify. It observes its own rounds (the decayed acceptance
estimate behind `best`)."""

from __future__ import annotations

from retrace.runtime.device import host_values, index_tensor, to_device
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.proposers.base import Proposal, RoundBatch


class LookupProposer:
    def __init__(self, lookup: PromptLookup, cost, block_size: int):
        """cost: the verify policy's CostModel (None: a policy without one; every proposal is verified whole)."""
        self.lookup, self.cost, self.block_size = lookup, cost, block_size
        self._offer: tuple | None = None  # (batch, drafts, lengths, K, rate) of the round `gain` looked at

    def gain(self, batch: RoundBatch) -> float | None:
        """The expected commit rate over plain decoding's of this round's lookup tokens (1.0: none worth a
        wider verify; None: no cost model), kept for the same round's `propose`."""
        drafts, lengths = self.lookup.propose(batch.reqs, self.block_size - 1)  # built on the host
        k, rate = self.lookup.best(lengths, self.cost)
        self._offer = (batch, drafts, lengths, k, rate)
        return rate

    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        if self._offer is None or self._offer[0] is not batch:
            self.gain(batch)
        _, drafts, lengths, k, _ = self._offer
        self._offer = None
        return Proposal("chain", self, to_device(drafts[:, :k], batch.device),
                        index_tensor([min(n, k) for n in host_values(lengths)], batch.device))

    def observe(self, outcome) -> None:
        if outcome.proposal.source is self:
            self.lookup.observe(outcome.host_judged, outcome.host_accepted)  # read with the round

    def clear(self, slot: int) -> None:
        self.lookup.clear(slot)
