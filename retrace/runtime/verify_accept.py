"""Verify and accept, one step per proposal kind behind one signature: (batch, proposal) -> RoundOutcome.

`chain`: the target scores [anchor, d_1 .. d_K] in one pass (rows with a smaller K ignore the tail: a
masked, padded verify) and each row keeps the longest prefix it agrees with (greedy) or speculative
sampling's (runtime/sampling.py), plus the bonus token. `tree`: the target scores a draft tree under its
ancestor mask, each row keeps its longest accepted path (greedy) or SpecInfer's recursive rejection walk
(runtime/tree_accept.py), the backend moves that path's K/V to its absolute positions, and the outcome
describes the round path (the accepted path continued by each node's best child) as a chain round's verify.
A chain is a tree's special case (tree_accept.py), but the chain keeps its own target call: no tree mask,
the backends' cheaper chain shapes.
"""

from __future__ import annotations

import torch

from retrace.runtime.device import host_values, index_tensor
from retrace.runtime.proposers.base import Proposal, RoundBatch, every_position, ranges
from retrace.runtime.round_outcome import RoundOutcome
from retrace.runtime.sampling import greedy_accept, mask_early_eos, row_probs, speculative_accept
from retrace.runtime.tree_accept import continue_path, greedy_tree_accept, root_path, sample_tree_accept


class VerifyAndAccept:
    def __init__(self, backend, clock, eos_ids: set[int]):
        self.backend, self.clock, self.eos_ids = backend, clock, eos_ids

    def __getitem__(self, kind: str):
        """The step for a proposal kind ("chain" or "tree")."""
        return {"chain": self.chain, "tree": self.tree}[kind]

    def chain(self, batch: RoundBatch, p: Proposal) -> RoundOutcome:
        N, dev = batch.rows, batch.device
        K = max(host_values(p.verified)) if p.verified is not None else 0  # policies build K on the host
        start = self.clock.mark()
        block = torch.cat([batch.anchor.unsqueeze(1), p.drafts], dim=1)
        logits, taps = self.backend.target(batch.slots, block[:, : K + 1],
                                           index_tensor(ranges(batch.anchor_host, K + 1), dev),
                                           every_position(N, K + 1, dev))
        marks = (start, self.clock.mark())
        logits = min_length(logits, batch.reqs, self.eos_ids)
        accepted, bonus, target_argmax = accept_chain(logits, p.drafts[:, :K], p.q, batch.reqs, p.verified, p.space)
        return RoundOutcome(batch, p, accepted, bonus, p.drafts, taps, p.verified, K + 1, block, logits,
                            target_argmax, path_len=p.verified, marks=marks)

    def tree(self, batch: RoundBatch, p: Proposal) -> RoundOutcome:
        reqs, tree, dev = batch.reqs, p.tree, batch.device
        N, M = batch.rows, tree.nodes
        anchor_pos = batch.anchor_pos.unsqueeze(1)
        start = self.clock.mark()
        logits, taps = self.backend.target(batch.slots, tree.tokens, anchor_pos + tree.depth,
                                           every_position(N, M, dev), tree_mask=tree.ancestor_mask())
        logits = min_length(logits, reqs, self.eos_ids, tree.depth)
        accepted, bonus, node, post = greedy_tree_accept(tree, logits)
        V = logits.shape[-1]
        for i, pi in enumerate(row_probs(logits, reqs)):  # sampling rows: the tree walk, over dense rows
            if pi is not None:
                qi = None if p.q[i] is None else (p.q[i] if p.space is None else p.space.to_target(p.q[i])).dense(V)
                accepted[i], bonus[i], node[i] = sample_tree_accept(tree, i, pi.dense(V), reqs[i].generator, qi)
        end = continue_path(tree, node)  # the round path: accepted, then each node's best child
        path = root_path(tree, end)
        path_len = tree.depth[torch.arange(N, device=dev), end]
        L = path.shape[1]
        self.backend.commit_path(batch.slots, anchor_pos + path, anchor_pos + torch.arange(L, device=dev))
        marks = (start, self.clock.mark())
        path_tokens = tree.tokens.gather(1, path)
        path_taps = taps.gather(1, path.unsqueeze(-1).expand(-1, -1, taps.shape[-1]))
        # the round's block: the round path's tokens, then the drafter's top-1 where the tree stopped
        block = torch.cat([batch.anchor.unsqueeze(1), p.drafts], dim=1)
        on = torch.arange(1, L, device=dev).unsqueeze(0) <= path_len.unsqueeze(1)
        block[:, 1:L] = torch.where(on, path_tokens[:, 1:], block[:, 1:L])
        return RoundOutcome(batch, p, accepted, bonus, path_tokens[:, 1:], path_taps, tree.size - 1, M, block,
                            logits, post.gather(1, path), path=path, path_len=path_len, marks=marks)


def accept_chain(logits, drafts, q, reqs, verified, space=None):
    """logits [N, K+1, V], drafts [N, K]; row i judges only its first verified[i] drafts (None: all K); q [N]
    of [>= K] rows of candidates, the proposal distributions of sampling rows over `space` (None: the target's
    vocabulary; None, or a None row: the drafts are point masses; runtime/candidates.py). -> (accepted [N],
    bonus [N], the target's argmax [N, K+1]); sampling rows overwrite the first two."""
    K = drafts.shape[1]
    ks = host_values(verified) if verified is not None else [K] * len(reqs)
    if any(k < K for k in ks):  # drafts past a row's K can never match: -1 is no token
        drafts = drafts.masked_fill(torch.arange(K, device=drafts.device).unsqueeze(0) >= verified.unsqueeze(1), -1)
    accepted, bonus, target_argmax = greedy_accept(logits, drafts)
    for i, (r, p) in enumerate(zip(reqs, row_probs(logits, reqs), strict=True)):
        if p is not None:
            k = ks[i]
            qi = q[i][:k] if q is not None and q[i] is not None else None  # None: point masses (prompt lookup)
            if qi is not None and space is not None:
                qi = space.to_target(qi)  # the rows it judges only
            accepted[i], bonus[i] = speculative_accept(p[: k + 1], qi, drafts[i, :k], r.generator)
    return accepted, bonus, target_argmax


def min_length(logits: torch.Tensor, reqs: list, eos_ids: set[int], offsets: torch.Tensor | None = None):
    """No EOS before a request's min_tokens: masked in the target's logits [N, T, V], before acceptance
    (offsets [N, T]: which new token each position scores; default 0..T-1, a tree's node depths)."""
    return mask_early_eos(logits, [len(r.output_ids) for r in reqs], [r.params.min_tokens for r in reqs], eos_ids,
                          offsets)
