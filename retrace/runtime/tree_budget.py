"""Cost-aware tree budget: how many of a draft tree's best-first nodes one round verifies.

The nodes of a tree are in best-first order (runtime/draft_tree.py), so its first b nodes are the tree of
budget b. A node is accepted only if its parent was, so with p(m) the acceptance probability of node m given
its parent's (its best-first factor through an online calibration, runtime/calibration.py):
    P(m) = prod of p over m's root path,    E_i[a | b] = sum_{1 <= m < b} P_i(m)
(at most one node per depth matches the target, so the accepted length is the number of accepted nodes), and
the budget that maximises the round's expected committed tokens per second is
    b* = argmax_b (N + sum_i E_i[a | b]) / (t_draft(N) + t_verify(N, b))
with the times from the verify policy's cost model (runtime/cost_model.py). b = 1 verifies the root alone
(plain decoding); the verify policy's auto-off (runtime/verify_policy.py) skips the draft call when even the
best budget does not pay. The budget never changes the output: any prefix of the pop order is a valid tree.
"""

from __future__ import annotations

import torch

from retrace.runtime.device import to_device
from retrace.runtime.draft_tree import DraftTree


def path_probs(tree: DraftTree, p: torch.Tensor) -> torch.Tensor:
    """[N, M] P(m): the product of p [N, M] over each node's root path (root 1, pads 0)."""
    N, M = tree.tokens.shape
    P = torch.zeros(N, M, dtype=torch.float64, device=p.device)
    P[:, 0] = 1.0
    rows = torch.arange(N, device=p.device)
    for m in range(1, M):  # parents come before children
        P[:, m] = P[rows, tree.parent[:, m]] * p[:, m]
    return P * tree.valid()


def expected_accepted(tree: DraftTree, p: torch.Tensor) -> torch.Tensor:
    """[M] sum over rows of E_i[a | b] for b = 1..M (index b - 1)."""
    P = path_probs(tree, p)
    P[:, 0] = 0.0
    return P.sum(0).cumsum(0)


def best_budget(tree: DraftTree, p: torch.Tensor, cost) -> tuple[int, float, float]:
    """-> (b*, its rate in tokens/s, the plain-decoding rate N / t_verify(N, 1)) for the rows of the tree."""
    N, M = tree.tokens.shape
    gain = expected_accepted(tree, p)
    t_verify = to_device([cost.verify(N, b) for b in range(1, M + 1)], p.device, torch.float64)
    rate = (N + gain) / (cost.draft(N) + t_verify)
    best = int(rate.argmax())
    return best + 1, float(rate[best]), N / float(t_verify[0])


def node_outcomes(tree: DraftTree, path: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (judged [N, M]: valid non-root nodes whose parent is on the accepted path, hit [N, M]: those
    accepted). path [N, L]: each row's round path (node indices from the root), accepted [N]."""
    N, M = tree.tokens.shape
    dev = path.device
    on_path = torch.zeros(N, M, dtype=torch.bool, device=dev)
    keep = torch.arange(path.shape[1], device=dev).unsqueeze(0) <= accepted.unsqueeze(1)
    on_path.scatter_(1, torch.where(keep, path, 0), keep)
    on_path[:, 0] = True
    judged = tree.valid() & (torch.arange(M, device=dev) > 0) & on_path.gather(1, tree.parent)
    return judged, judged & on_path
