"""The drafter chain: the block [anchor, MASK x S] drafted in one call (S <= B-1 draft slots: the verify
policy's draft width), conditioned on the committed context (and, in retrace mode, on the previous round's
rejected suffix); greedy rows take the drafter's argmax, sampling rows sample its processed distribution;
the verify policy picks K <= S drafts per row."""

from __future__ import annotations

import torch

from retrace.runtime.candidates import Candidates
from retrace.runtime.device import index_tensor
from retrace.runtime.draft_space import DraftSpace
from retrace.runtime.proposers.base import Proposal, RoundBatch, ranges
from retrace.runtime.proposers.context import context
from retrace.runtime.sampling import argmax, row_probs


class DrafterCall:
    """One drafter call for a round's rows -> (hidden [N, B, d], draft_logits [N, S, Vd] over the backend's
    draft space (runtime/draft_space.py), drafts [N, S] target ids, q, C the context positions per row it took)."""

    def __init__(self, backend, memory, block_size: int, mask_id: int):
        self.backend, self.memory = backend, memory
        self.block_size, self.mask_id = block_size, mask_id
        self._space = DraftSpace.of(backend)

    @property
    def space(self) -> DraftSpace:
        """The backend's draft space (again if its draft vocabulary was swapped since)."""
        if getattr(self.backend, "draft_ids", None) is not self._space.ids:
            self._space = DraftSpace.of(self.backend)
        return self._space

    def __call__(self, batch: RoundBatch, slots: int):
        """The block [anchor, MASK x slots]: `slots` <= B - 1 draft slots (the verify policy's draft width)."""
        N, W, dev = batch.rows, slots + 1, batch.device
        block_ids = torch.cat([batch.anchor.unsqueeze(1), torch.full((N, slots), self.mask_id, device=dev)], dim=1)
        ctx_taps, ctx_pos = context(batch.reqs, self.backend.max_seq_len, dev)
        suffix = self.memory.read(batch.slots, W) if batch.mode == "retrace" else None
        hidden, draft_logits = self.backend.draft(batch.slots, ctx_taps, ctx_pos, block_ids,
                                                  index_tensor(ranges(batch.anchor_host, W), dev), suffix)
        space = self.space
        space.check(draft_logits, self.backend)
        drafts, q = propose_tokens(draft_logits, batch.reqs, space)
        return hidden, draft_logits, drafts, q, ctx_taps.shape[1]


def propose_tokens(draft_logits: torch.Tensor, reqs: list, space: DraftSpace | None = None
                   ) -> tuple[torch.Tensor, list[Candidates | None]]:
    """Greedy rows take the drafter's argmax; sampling rows sample from its processed distribution q
    (q[i] is None for greedy rows) -> (drafts [N, S] target ids, q [S] rows of candidates over `space`'s draft
    indices, runtime/candidates.py: the verify maps the rows it judges to target ids, `space.to_target`).
    draft_logits [N, S, Vd] over `space` (None: the target's vocabulary)."""
    index = argmax(draft_logits)
    q = row_probs(draft_logits, reqs)
    for i, r in enumerate(reqs):
        if q[i] is not None:
            index[i] = q[i].sample(r.generator)  # one token per slot
    return (index if space is None or space.full else space.tokens(index)), q


class DrafterChain:
    """The drafter's block verified as a chain: K drafts per row from the verify policy's `choose`."""

    def __init__(self, drafter: DrafterCall, policy, clock):
        self.drafter, self.policy, self.clock = drafter, policy, clock

    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        start = self.clock.mark()
        hidden, draft_logits, drafts, q, context = self.drafter(batch, slots)
        verified = self.policy.choose(batch.mode, draft_logits, drafts, q)
        return Proposal("chain", self, drafts, verified, slots, q, hidden, draft_logits, self.drafter.space,
                        marks=(start, self.clock.mark()), context=context)

    def observe(self, outcome) -> None:
        pass  # the verify policy learns the chain's K (runtime/round_outcome.py PolicyObserver)
