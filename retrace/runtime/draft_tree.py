"""Draft trees: the candidates of one round as a token tree per row, built best-first under a node budget.

A tree (plain tensors, ragged per row, padded to the longest row's M nodes):
  tokens [N, M]  node 0 is the root (the anchor); pads hold 0
  parent [N, M]  parent node index (< own index); the root and pads point at 0
  depth  [N, M]  0 for the root; node m sits at absolute position anchor_pos + depth[m]
  source [N, M]  bit mask of the sources that proposed the node (SOURCE_BITS); 0 for root and pads
  size   [N]     valid nodes per row (<= budget, root counted)
  score  [N, M]  the best-first score of each node (cumulative: its parent's times its own factor; root 1,
                 pads 0); node order is pop order, so the first b nodes are the tree of budget b
A node's children have distinct tokens, so at most one node per depth can match the target.

Sources (each proposes children of a node; a node proposed by several keeps all their bits):
  topk    the drafter's per-slot distribution q_k: child t of a depth-(k-1) node scores s * q_k(t), as in
          DDTree / EAGLE-2 (cumulative draft probability);
  suffix  the previous round's rejected suffix aligned to this block: old draft d_j at new slot
          k = j - a - 1 (runtime/suffix_memory.py's alignment), drafted-but-unverified slots included;
  target  the target's argmax at old slot j-1 of the rejected verify, at the same new slot k.
The suffix and target sources are chains from the root: a node continues a chain only if its whole root
path is that chain's prefix. Their children score s * max(q_k(t), rate), rate the source's measured
marginal acceptance rate (SourceRates: accepted / proposed among the nodes only that source proposed whose
parent was accepted), so the budget goes to rejected-trajectory candidates only while they add tokens the
drafter's top-k does not already hold. Best-first = the budget's nodes with the highest scores
among the candidates of nodes already in the tree (a heap; each popped node pushes its best top-k child,
its next top-k sibling, and its chains' next tokens).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from retrace.errors import RetraceError
from retrace.runtime.device import host_values, read, to_device
from retrace.runtime.draft_space import DraftSpace

SOURCES = ("topk", "suffix", "target")
SOURCE_BITS = {"topk": 1, "suffix": 2, "target": 4}


def parse_sources(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """"topk,suffix,target" -> ("topk", "suffix", "target") (validated, deduplicated, in SOURCES order)."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    names = [s for s in names if s]
    bad = [s for s in names if s not in SOURCES]
    if bad or not names:
        raise RetraceError(f"tree sources {bad or names!r}: choose one or more of {', '.join(SOURCES)}")
    return tuple(s for s in SOURCES if s in names)


def check_budget(budget: int, block_size: int) -> int:
    if not isinstance(budget, int) or budget < 0 or budget == 1:
        raise RetraceError(f"tree budget must be 0 (chain) or >= 2 nodes (root included), got {budget!r}")
    return budget


@dataclass
class DraftTree:
    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    source: torch.Tensor
    size: torch.Tensor
    score: torch.Tensor | None = None

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    def valid(self) -> torch.Tensor:
        """[N, M] bool: real nodes (not padding)."""
        return torch.arange(self.nodes, device=self.size.device).unsqueeze(0) < self.size.unsqueeze(1)

    def truncate(self, budget: int) -> DraftTree:
        """The first `budget` nodes of every row: the tree build_trees makes with that budget (nodes are in
        best-first pop order, parents before children)."""
        if budget >= self.nodes:
            return self
        cut = slice(0, budget)
        return DraftTree(self.tokens[:, cut], self.parent[:, cut], self.depth[:, cut], self.source[:, cut],
                         self.size.clamp_max(budget), None if self.score is None else self.score[:, cut])

    def factor(self) -> torch.Tensor:
        """[N, M] each node's own score factor (score / parent's score; root 1, pads 0): the builder's
        estimate of the node's acceptance given its parent's."""
        par = self.score.gather(1, self.parent)
        f = torch.where(par > 0, self.score / par.clamp_min(1e-30), torch.zeros_like(self.score))
        f[:, 0] = 1.0
        return f

    def ancestor_mask(self) -> torch.Tensor:
        """[N, M, M] bool: mask[n, i, j] = node j is node i or one of its ancestors (tree attention). Pads see
        only themselves. Built depth by depth: row i of the mask is its parent's row plus itself."""
        N, M = self.tokens.shape
        eye = torch.eye(M, dtype=torch.bool, device=self.tokens.device).expand(N, M, M).clone()
        mask = eye.clone()
        valid = self.valid()
        for m in range(1, M):  # parents come before children
            par = mask[torch.arange(N, device=mask.device), self.parent[:, m]] & valid[:, m : m + 1]
            mask[:, m] |= par
        return mask


class SourceRates:
    """Per-source acceptance rate of the tree nodes only that source proposed, whose parent was accepted
    (a running count with a prior)."""

    def __init__(self, prior: float = 0.5, weight: float = 4.0):
        self.hits = {s: prior * weight for s in SOURCES}
        self.tries = {s: weight for s in SOURCES}

    def rate(self, source: str) -> float:
        return self.hits[source] / self.tries[source]

    def observe(self, source: str, tries: int, hits: int) -> None:
        self.hits[source] += hits
        self.tries[source] += tries


def build_trees(draft_probs: torch.Tensor, anchors: torch.Tensor, budget: int, sources: tuple[str, ...],
                chains: dict[str, torch.Tensor] | None = None, rates: SourceRates | None = None,
                sampled: torch.Tensor | None = None, space: DraftSpace | None = None) -> DraftTree:
    """draft_probs [N, S, Vd]: the drafter's distribution at slots 1..S over its draft space (`space`,
    runtime/draft_space.py; None: the target's vocabulary): the top-k is taken there and mapped to target
    ids, a chain token outside it has probability 0 (what the distribution expanded to the target's
    vocabulary gives, without a pass over V); anchors [N] (host ints, or a tensor: one more read); chains:
    source name ->
    [N, S] tokens at new slots 1..S (-1: none; a chain stops at its first -1). sampled [N, S]: the drafts of
    sampling rows (drawn from the drafter's processed distribution; -1 for greedy rows). -> DraftTree of
    <= budget nodes per row (depth <= S).

    A sampling row's tree is independent chains from the root: the sampled drafts (in place of the top-k,
    with the `topk` bit), the suffix and the target chain, each continued only under its own nodes, no
    merging, scored without looking at the sampled tokens (s * rate of `topk` for a sampled node). So the
    tree's shape never depends on the sampled tokens, which the lossless rule of runtime/tree_accept.py
    needs (a sampled child is then a plain draw from q)."""
    N, S, Vd = draft_probs.shape
    space = space if space is not None and not space.full else None
    rates = rates or SourceRates()
    use_topk = "topk" in sources
    chain_names = [s for s in ("suffix", "target") if s in sources and chains is not None and s in chains]
    kmax = min(budget, Vd)
    q = draft_probs.float()
    # what the host walk needs, read at once: the top-k, each chain and the drafter's probability of its
    # tokens (for the score s * max(q, rate)), the sampled drafts; as float64 (token ids and float32
    # probabilities exactly), split back on the host
    parts: dict[str, torch.Tensor] = {}
    if use_topk and S:
        top = torch.topk(q, kmax, dim=-1)
        parts["top_p"], parts["top_t"] = top.values, top.indices if space is None else space.tokens(top.indices)
    for s in chain_names:
        c = chains[s][:, :S]
        at = c.clamp_min(0) if space is None else space.index_of(c.clamp_min(0))
        qc = q.gather(2, at.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        parts[s], parts["q_" + s] = c, qc if space is None else torch.where(at >= 0, qc, 0.0)
    if sampled is not None:
        parts["sampled"] = sampled[:, :S]
    host = _read_rows(parts, N)
    top_p, top_t = host.get("top_p"), host.get("top_t")
    chain_lists = {s: host[s] for s in chain_names}
    chain_q = {s: host["q_" + s] for s in chain_names}
    chain_rate = {s: rates.rate(s) for s in chain_names}
    if sampled is not None and any(row[0] >= 0 for row in host["sampled"] if row):
        chain_lists["sampled"] = host["sampled"]
        chain_q["sampled"] = [[0.0] * S for _ in range(N)]
        chain_rate["sampled"] = rates.rate("topk")
    anchors = host_values(anchors) if isinstance(anchors, torch.Tensor) else anchors
    rows = []
    for n in range(N):
        rows.append(_build_row(n, int(anchors[n]), budget, S, top_p, top_t, chain_lists, chain_q, chain_rate))
    M = max(len(r[0]) for r in rows)
    def padded(i: int) -> list[list]:  # field i of every row, padded with 0 to M nodes
        return [r[i] + [0] * (M - len(r[i])) for r in rows]

    dev = draft_probs.device  # built on the host, one copy per field to the device
    fields = [to_device(padded(i), dev, torch.int64) for i in range(4)]
    score = to_device(padded(4), dev, torch.float64)
    size = to_device([len(r[0]) for r in rows], dev, torch.int64)
    return DraftTree(*fields, size, score)


def _read_rows(parts: dict[str, torch.Tensor], N: int) -> dict[str, list]:
    """name -> [N, ...] tensor => name -> its rows as host lists (integer tensors as ints), one read for all."""
    if not parts:
        return {}
    flat = read(torch.cat([t.reshape(N, -1).double() for t in parts.values()], 1)) if N else []
    out, at = {}, 0
    for name, t in parts.items():
        width, shape, integral = t[0].numel() if N else 0, t.shape[1:], not t.is_floating_point()
        # [N, S, k] rows come back as S lists of k, [N, S] rows as one list
        rows = []
        for row in flat:
            vals = row[at: at + width]
            if integral:
                vals = [int(v) for v in vals]
            rows.append([vals[i: i + shape[1]] for i in range(0, width, shape[1])] if len(shape) == 2 else vals)
        out[name], at = rows, at + width
    return out


def _build_row(n, anchor, budget, S, top_p, top_t, chain_lists, chain_q, chain_rate):
    independent = "sampled" in chain_lists and chain_lists["sampled"][n][0] >= 0  # a sampling row
    if independent:
        top_p = None
    tok, par, dep, src, score = [anchor], [0], [0], [0], [1.0]
    chains_of = [set(chain_lists)]  # the chains whose prefix each node's root path is
    child = {}  # (parent, token) -> node
    heap: list[tuple] = []  # (-score, tie, parent, depth, token, bits, topk rank or -1)
    tie = 0

    def push(sc, p, d, t, bits, rank):
        nonlocal tie
        heapq.heappush(heap, (-sc, tie, p, d, t, bits, rank))
        tie += 1

    def push_children(node: int) -> None:
        d = dep[node]
        if d >= S:
            return
        if top_p is not None:
            push(score[node] * top_p[n][d][0], node, d + 1, top_t[n][d][0], 1, 0)
        for s in chains_of[node]:
            t = chain_lists[s][n][d]
            if t >= 0:
                push(score[node] * max(chain_q[s][n][d], chain_rate[s]), node, d + 1, t, _bit(s), -1)

    push_children(0)
    while heap and len(tok) < budget:
        neg, _, p, d, t, bits, rank = heapq.heappop(heap)
        if rank >= 0 and rank + 1 < len(top_p[n][d - 1]):  # the next top-k sibling
            push(score[p] * top_p[n][d - 1][rank + 1], p, d, top_t[n][d - 1][rank + 1], 1, rank + 1)
        node = None if independent else child.get((p, t))
        if node is not None:  # already in the tree: another source proposes it too
            src[node] |= bits
            continue
        on = {s for s in chains_of[p] if chain_lists[s][n][d - 1] == t}
        if independent:  # only the chain that proposed it
            on = {s for s in on if _bit(s) == bits}
        child[(p, t)] = len(tok)
        tok.append(t)
        par.append(p)
        dep.append(d)
        src.append(bits | sum(_bit(s) for s in on))
        score.append(-neg)
        chains_of.append(on)
        push_children(len(tok) - 1)
    return tok, par, dep, src, score


def _bit(source: str) -> int:
    return SOURCE_BITS.get(source, SOURCE_BITS["topk"])  # "sampled": the drafter's own proposal
