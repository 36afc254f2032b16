"""The drafter tree: the drafter's block (every slot) plus the previous round's rejected trajectory as a
draft tree of at most `budget` nodes per row (runtime/draft_tree.py: the drafter's top-k, the rejected
suffix, the target's argmax on it; sampling rows: the sampled drafts instead of the top-k), cut to the
verify policy's `choose_tree`. It observes its own rounds: each source's marginal acceptance rate (what it
adds beyond the others) steers the next trees' budget."""

from __future__ import annotations

import torch

from retrace.runtime.device import to_device
from retrace.runtime.draft_tree import SOURCES, SourceRates, build_trees
from retrace.runtime.proposers.base import Proposal, RoundBatch
from retrace.runtime.proposers.chain import DrafterCall
from retrace.runtime.tree_accept import source_counts


class DrafterTree:
    def __init__(self, drafter: DrafterCall, policy, memory, budget: int, sources: tuple[str, ...], clock,
                 rates: SourceRates | None = None, counts: dict[str, list[int]] | None = None):
        self.drafter, self.policy, self.memory, self.clock = drafter, policy, memory, clock
        self.budget, self.sources = budget, sources
        self.rates = rates if rates is not None else SourceRates()
        # per source: [tree nodes whose parent was accepted, of those accepted, accepted that only it proposed]
        self.counts = counts if counts is not None else {s: [0, 0, 0] for s in SOURCES}

    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        S = self.drafter.block_size - 1  # a tree draws on every slot of the block
        start = self.clock.mark()
        hidden, draft_logits, top1, q, context = self.drafter(batch, S)
        drafted = self.clock.mark()
        sampling = [qi is not None for qi in q]
        sampled = (torch.where(to_device(sampling, batch.device).unsqueeze(1), top1, -1)
                   if any(sampling) else None)
        space = self.drafter.space  # the tree's nodes are target ids; its distribution stays over the draft space
        probs = draft_logits.float().softmax(-1)
        tree = build_trees(probs, [r.anchor for r in batch.reqs], self.budget, self.sources,
                           self.memory.trajectory(batch.slots), self.rates, sampled=sampled, space=space)
        tree = tree.truncate(self.policy.choose_tree(batch.mode, tree))
        return Proposal("tree", self, top1, None, S, q, hidden, draft_logits, space, tree,
                        marks=(start, drafted, self.clock.mark()), context=context)

    def observe(self, outcome) -> None:
        if outcome.proposal.source is not self:
            return
        counts = source_counts(outcome.proposal.tree, outcome.path, outcome.accepted)
        for s, (tries, hits, only_tries, only_hits) in counts.items():
            self.rates.observe(s, only_tries, only_hits)  # what a source adds beyond the others
            for j, c in enumerate((tries, hits, only_hits)):
                self.counts[s][j] += c
