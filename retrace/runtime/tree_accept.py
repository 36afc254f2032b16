"""Greedy acceptance on a draft tree (runtime/draft_tree.py) and the paths the loop keeps from it.

Greedy (T=0): node m is on an accepted path iff every node on its root path equals the target's argmax at
that node's parent; the tree's children have distinct tokens, so at most one node per depth qualifies and
the accepted path is the deepest such node's root path. a = its depth, the bonus = the target's argmax at it.
That is exactly what the chain's greedy acceptance gives when the tree is a chain, so the output is the
target's greedy decode whatever the tree holds.

Sampling (T>0): SpecInfer's recursive rejection sampling along the tree. At node u, r = p(u) (the
target's processed distribution there). Each fixed child t (a suffix or target candidate: a point-mass
proposal) is accepted with probability r(t); on rejection r(t) = 0 and r is renormalised. Then the sampled
child x (the drafter's draft, x ~ q of its slot, drawn independently of everything else) is accepted with
probability min(1, r(x) / q(x)); on rejection r = norm(max(0, r - q)). An accepted child becomes u; when
none is accepted the bonus is drawn from r. Each step is a speculative-sampling step whose output is
distributed as its r, so by induction every emitted token is distributed as the target's p given the
tokens before it: lossless. This needs the tree's shape not to depend on the sampled drafts
(build_trees does that for sampling rows). The chain's rule is the special case of one sampled child.

The round path: the accepted path continued, while the tree has it, by each node's first child (the
best-scored candidate; in a topk tree the drafter's top-1 token, the chain a plain round would verify). Its verify
logits and taps are
what the rejected-suffix memory and the drafter's next context see (the same meaning as a chain round's).
"""

from __future__ import annotations

import torch

from retrace.runtime.device import read
from retrace.runtime.draft_tree import SOURCE_BITS, DraftTree
from retrace.runtime.sampling import argmax, sample_index
from retrace.runtime.tree_budget import node_outcomes


def greedy_tree_accept(tree: DraftTree, logits: torch.Tensor):
    """logits [N, M, V] at every node -> (accepted a [N], bonus [N], accepted node [N], target argmax [N, M])."""
    post = argmax(logits)
    N, M = tree.tokens.shape
    rows = torch.arange(N, device=post.device)
    match = (tree.tokens == post.gather(1, tree.parent)) & tree.valid()
    ok = torch.zeros(N, M, dtype=torch.bool, device=post.device)
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
    dev = node.device
    child_ok = tree.valid() & (torch.arange(M, device=dev) > 0)
    cur = node.clone()
    big = torch.full((N, M), M, dtype=torch.int64, device=dev)
    idx = torch.arange(M, device=dev).expand(N, M)
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
    rows = torch.arange(N, device=node.device)
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
    child, hit = node_outcomes(tree, path, accepted)
    counts = torch.stack([torch.stack([(child & (tree.source & b > 0)).sum(), (hit & (tree.source & b > 0)).sum(),
                                       (child & (tree.source == b)).sum(), (hit & (tree.source == b)).sum()])
                          for b in SOURCE_BITS.values()])
    return {s: tuple(row) for s, row in zip(SOURCE_BITS, read(counts), strict=True)}  # one read for all


def sample_tree_accept(tree: DraftTree, row: int, p: torch.Tensor, gen: torch.Generator,
                       q: torch.Tensor | None = None) -> tuple[int, int, int]:
    """One sampling row. p [M, V]: the target's processed probabilities at every node; q [S, V]: the drafter's
    processed distribution per slot, when the row's `topk` children are sampled drafts (build_trees'
    `sampled`; None: every child is a fixed candidate) -> (accepted a, bonus token, accepted node)."""
    size = int(tree.size[row])
    fixed: dict[int, list[tuple[int, int]]] = {}
    drawn: dict[int, tuple[int, int]] = {}
    for m in range(1, size):
        par, tok = int(tree.parent[row, m]), int(tree.tokens[row, m])
        if q is not None and int(tree.source[row, m]) & SOURCE_BITS["topk"]:
            drawn[par] = (m, tok)
        else:
            fixed.setdefault(par, []).append((m, tok))
    node, a = 0, 0
    while True:
        r = p[node].double()
        nxt = None
        for m, t in fixed.get(node, []):  # a fixed candidate: proposal = a point mass on t
            if float(torch.rand((), generator=gen, device=gen.device)) < float(r[t]):
                nxt = m
                break
            r = r.clone()
            r[t] = 0
            r = r / r.sum()
        if nxt is None and node in drawn:  # the sampled draft x ~ q: min(1, r(x) / q(x)), else max(0, r - q)
            m, x = drawn[node]
            qd = q[int(tree.depth[row, node])].double()
            if float(torch.rand((), generator=gen, device=gen.device)) * float(qd[x]) <= float(r[x]):
                nxt = m
            else:
                res = (r - qd).clamp_min(0)
                r = res / res.sum() if float(res.sum()) > 0 else r
        if nxt is None:
            return a, int(sample_index(r, gen)), node
        node, a = nxt, a + 1
