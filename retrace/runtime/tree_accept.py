"""Greedy acceptance on a draft tree (runtime/draft_tree.py) and the paths the loop keeps from it.

Greedy (T=0): node m is on an accepted path iff every node on its root path equals the target's argmax at
that node's parent; the tree's children have distinct tokens, so at most one node per depth qualifies and
the accepted path is the deepest such node's root path. a = its depth, the bonus = the target's argmax at it.
That is exactly what the chain's greedy acceptance gives when the tree is a chain, so the output is the
target's greedy decode whatever the tree holds.

Sampling (T>0): walk from the root; at each node draw x ~ p(node) (the target's processed distribution
there); if a child holds x, move to it and repeat, else x is the bonus and the walk stops. Every emitted
token is a draw from the target's distribution given the tokens before it, so the output distribution is
exactly the target's (lossless); a node's acceptance probability is the target mass of its children's
tokens. The tree is built from the drafter's distribution alone, never from these draws. With
deterministic candidates this is what SpecInfer's recursive rejection sampling reduces to: try child t_i
with probability r(t_i), on rejection zero t_i in r and renormalise, after the last child sample from r.

The round path: the accepted path continued, while the tree has it, by each node's first child (the
best-scored candidate; in a topk tree the drafter's top-1 token, the chain a plain round would verify). Its verify logits and taps are
what the rejected-suffix memory and the drafter's next context see (the same meaning as a chain round's).
"""

from __future__ import annotations

import torch

from retrace.runtime.draft_tree import SOURCE_BITS, DraftTree
from retrace.runtime.sampling import argmax


def greedy_tree_accept(tree: DraftTree, logits: torch.Tensor):
    """logits [N, M, V] at every node -> (accepted a [N], bonus [N], accepted node [N], target argmax [N, M])."""
    post = argmax(logits)
    N, M = tree.tokens.shape
    rows = torch.arange(N)
    match = (tree.tokens == post.gather(1, tree.parent)) & tree.valid()
    ok = torch.zeros(N, M, dtype=torch.bool)
    ok[:, 0] = True
    for m in range(1, M):  # parents come before children
        ok[:, m] = ok[rows, tree.parent[:, m]] & match[:, m]
    node = torch.where(ok, tree.depth, -1).max(1).indices
    accepted = tree.depth[rows, node]
    return accepted, post[rows, node], node, post


def continue_path(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """From node [N], follow the first child (the earliest built: the best-scored) while there is one -> the
    last node [N]."""
    N, M = tree.tokens.shape
    child_ok = tree.valid() & (torch.arange(M) > 0)
    cur = node.clone()
    big = torch.full((N, M), M, dtype=torch.int64)
    idx = torch.arange(M).expand(N, M)
    for _ in range(int(tree.depth.max()) if tree.depth.numel() else 0):
        hit = child_ok & (tree.parent == cur.unsqueeze(1))
        found = hit.any(1)
        if not bool(found.any()):
            break
        cur = torch.where(found, torch.where(hit, idx, big).min(1).values, cur)
    return cur


def root_path(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """node [N] -> its root path [N, D+1] by depth (D = the deepest node's depth); shorter rows repeat their
    last node."""
    N = node.shape[0]
    rows = torch.arange(N)
    depth = tree.depth[rows, node]
    D = int(depth.max()) if N else 0
    path = node.unsqueeze(1).repeat(1, D + 1)
    cur = node.clone()
    for d in range(D, 0, -1):
        here = depth >= d
        path[:, d] = torch.where(here, cur, path[:, d])
        cur = torch.where(here, tree.parent[rows, cur], cur)
    path[:, 0] = 0
    for d in range(1, D + 1):  # rows shorter than D: repeat their last node
        path[:, d] = torch.where(depth >= d, path[:, d], path[:, d - 1])
    return path


def source_counts(tree: DraftTree, path: torch.Tensor,
                  accepted: torch.Tensor) -> dict[str, tuple[int, int, int, int]]:
    """Per source: (tries, hits, tries only, hits only) = its nodes whose parent is on the accepted path,
    those accepted, and the same two counts for the nodes no other source proposed."""
    N, M = tree.tokens.shape
    on_path = torch.zeros(N, M, dtype=torch.bool)
    keep = torch.arange(path.shape[1]).unsqueeze(0) <= accepted.unsqueeze(1)
    on_path.scatter_(1, torch.where(keep, path, 0), keep)
    on_path[:, 0] = True
    child = tree.valid() & (torch.arange(M) > 0) & on_path.gather(1, tree.parent)
    hit = child & on_path
    return {s: (int((child & (tree.source & b > 0)).sum()), int((hit & (tree.source & b > 0)).sum()),
                int((child & (tree.source == b)).sum()), int((hit & (tree.source == b)).sum()))
            for s, b in SOURCE_BITS.items()}


def sample_tree_accept(tree: DraftTree, row: int, p: torch.Tensor, gen: torch.Generator) -> tuple[int, int, int]:
    """One sampling row. p [M, V]: the target's processed probabilities at every node -> (accepted a, bonus
    token, accepted node)."""
    size = int(tree.size[row])
    children: dict[tuple[int, int], int] = {}
    for m, (par, tok) in enumerate(zip(tree.parent[row, :size].tolist(), tree.tokens[row, :size].tolist(),
                                       strict=True)):
        if m:
            children[(par, tok)] = m
    node, a = 0, 0
    while True:
        x = int(torch.multinomial(p[node], 1, generator=gen))
        nxt = children.get((node, x))
        if nxt is None:
            return a, x, node
        node, a = nxt, a + 1
