"""What every proposer hands the round: the rows of the round (`RoundBatch`), the `Proposal` a proposer makes
for them, and the `Proposer` interface (the drafter chain, the drafter tree, prompt lookup, or none).

The round asks one proposer per round for a proposal (which one: runtime/proposers/select.py, from the verify
policy's plan); the proposal's `kind` picks its verify-and-accept step (runtime/verify_accept.py): "chain"
verifies [anchor, d_1 .. d_K] per row, "tree" a draft tree under its ancestor mask. Shapes: N rows, S draft
slots the drafter filled (block_size - 1 for a tree), D proposed tokens per row, V the vocabulary, d the
drafter's hidden size, B the block size, Vd the draft space's size (runtime/draft_space.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from retrace.runtime.candidates import Candidates
from retrace.runtime.device import index_tensor, to_device
from retrace.runtime.draft_space import DraftSpace
from retrace.runtime.draft_tree import DraftTree


@dataclass
class RoundBatch:
    """The rows of one round (one mode), in slot order."""

    reqs: list  # [N] the requests (runtime/loop.py Request)
    mode: str  # "ar", "dflash" or "retrace"
    slots: torch.Tensor  # [N] int64 batch slots (index_tensor: with a host copy)
    anchor: torch.Tensor  # [N] int64 the last committed token per row (no target K/V yet)
    anchor_pos: torch.Tensor  # [N] int64 its absolute position (index_tensor: with a host copy)
    anchor_host: list[int]  # [N] the same positions on the host (positions are built without a read)

    @classmethod
    def of(cls, reqs: list, device: torch.device) -> RoundBatch:
        anchor_host = [r.anchor_pos for r in reqs]
        return cls(reqs, reqs[0].mode, index_tensor([r.slot for r in reqs], device),
                   to_device([r.anchor for r in reqs], device), index_tensor(anchor_host, device),
                   anchor_host)

    @property
    def rows(self) -> int:
        return len(self.reqs)

    @property
    def device(self) -> torch.device:
        return self.anchor.device


@dataclass
class Proposal:
    """One proposer's offer for the round's verify."""

    kind: str  # "chain" ([anchor, d_1 .. d_K] verified as a chain) or "tree" (a draft tree, tree_mask verify)
    source: Any  # the proposer that made it (an observer of the round recognises its own proposals)
    drafts: torch.Tensor  # [N, D] int64 proposed tokens after the anchor (tree: the drafter's top-1 per slot)
    verified: torch.Tensor | None  # [N] int64 drafts each row sends to the target (index_tensor); None: none
    slots: int = 0  # S: draft slots the drafter filled this round (0: no drafter call)
    q: list[Candidates | None] | None = None  # [N] of [S, C] the drafter's processed distribution over `space`'s
    #   draft indices (sampling rows; runtime/candidates.py; None rows: greedy, or point-mass drafts)
    hidden: torch.Tensor | None = None  # [N, B, d] the drafter's final hidden states (None: no drafter call)
    draft_logits: torch.Tensor | None = None  # [N, S, Vd] the drafter's raw logits at slots 1..S, over `space`
    space: DraftSpace | None = None  # the index space of draft_logits' last dim (None: the target's vocab)
    tree: DraftTree | None = None  # the tree to verify (kind "tree"), M nodes per row
    marks: tuple = ()  # stopwatch marks: (draft start, draft end[, tree built]); () without a drafter call
    context: int = 0  # C: context positions per row the drafter call took (padded): the last round's taps,
    #   or after rounds without a draft call (a new request's prompt, a policy pause) all of theirs at once

    @property
    def drafted(self) -> bool:
        return self.hidden is not None


class Proposer(Protocol):
    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        """A proposal for the batch's rows, using at most `slots` draft slots (the verify policy's plan)."""
        ...

    def observe(self, outcome) -> None:
        """After the round's read: learn from the outcome (runtime/round_outcome.py) of its own proposals."""
        ...


class NoProposer:
    """Plain decoding: no drafts; the verify scores the anchor alone."""

    def propose(self, batch: RoundBatch, slots: int) -> Proposal:
        return Proposal("chain", self, torch.zeros(batch.rows, 0, dtype=torch.int64, device=batch.device), None)

    def observe(self, outcome) -> None:
        pass


def ranges(starts: list[int], width: int) -> list[list[int]]:
    """[[s, s+1, .., s+width-1] for each start] (host positions for `index_tensor`)."""
    return [list(range(p, p + width)) for p in starts]


@functools.lru_cache(maxsize=64)
def every_position(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] int64, 0..width-1 in each row: a verify's `logits_index` when every position is scored.
    Built once per shape and device (an expanded view: read-only; backends pad it into new tensors)."""
    return torch.arange(width, device=device).expand(rows, width)
