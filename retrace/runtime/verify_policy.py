"""How many drafts each row sends to the target this round (K in 0..B-1); the loop calls nothing else.

`fixed`: K = B-1 always (the whole block; what `retrace eval` measures).
`adaptive`: maximise the round's expected committed tokens per second,
    rate(K) = sum_i (1 + E_i[a | K]) / (t_draft(N, S) + t_verify(N, K + 1)),   K <= S,
    E_i[a | K] = sum_{k<=K} prod_{j<=k} p_ij   (slot k is accepted only if every earlier one was),
with p_ij the acceptance probability of row i's draft j from the drafter's own confidence through an
online calibration (runtime/calibration.py) and the times from a cost model of this machine and backend
(runtime/cost_model.py), both kept current from the rounds' own outcomes and timings. S, the draft slots the
drafter fills (the block [anchor, MASK x S], S <= B-1), is chosen before drafting from the same costs and the
recent per-slot acceptance (`plan`, runtime/draft_width.py): a narrower block is a cheaper draft call.

One K for all rows of the call (`ragged=False`, the default). The verify of a padded batch costs the time
of its longest row and E_i[a | K] never decreases with K, so once the call verifies K drafts for one row,
verifying them for every row is free and can only add tokens; a per-row K (`ragged=True`: each row keeps
K_i = argmax 1 + E_i[a | K] - lambda t(K) / N, lambda the round's best rate) only throws those away. The
ragged variant stays for measurement (benchmarks/verify_policy.py).

Auto-off: K = 0 is plain decoding. The draft call itself is decided before drafting (its confidences do
not exist yet), from the recent gain g = best rate / plain-decoding rate N / t_verify(N, 1) of drafted
rounds (an EMA): when g < 1 the next `backoff` rounds of that mode skip the draft call (K = 0 for every
row); then one round drafts again (a probe: it verifies at least one draft per row, so the calibration keeps
learning) and its g restarts the average. A probe after a pause drafts the narrowest block (3 slots): the
cheapest call that re-measures, and the only way a width that the cost model's prior priced out gets timed
(at batch 4, fp32, the 0.6B shape: the whole block's 64 rows cost a decode step, its 4-slot block ~0.3 of
one; probing with the whole block, drafting never came back). Each failed probe doubles
the backoff (up to `max_backoff` rounds), a paying round resets it, so a drafter that never pays costs one
draft call every `max_backoff` rounds and one that starts paying is back on within that many rounds.

Tree rounds (tree_budget N > 0): `choose_tree` picks how many of the tree's best-first nodes (<= N) the
round verifies, `observe_tree` learns from it (runtime/tree_budget.py): fixed = all N, adaptive = the budget
of the best expected rate, through the same cost model and auto-off, with its own calibration of the
nodes' best-first factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from retrace.errors import RetraceError
from retrace.runtime.calibration import Calibration
from retrace.runtime.candidates import Candidates
from retrace.runtime.cost_model import CostModel, probe
from retrace.runtime.device import index_tensor, read, to_device
from retrace.runtime.draft_tree import DraftTree
from retrace.runtime.draft_width import DraftWidth
from retrace.runtime.tree_budget import best_budget, node_outcomes

POLICIES = ("adaptive", "fixed")


class VerifyPolicy(Protocol):
    name: str

    def plan(self, mode: str, rows: int) -> int:
        """Before drafting: how many draft slots can be useful this round (0 = no draft call)."""
        ...

    def drafting_gain(self, mode: str) -> float | None:
        """The expected commit rate over plain decoding's of this mode's recent drafted rounds (None: not
        known; what runtime/proposers/lookup_first.py weighs prompt lookup against)."""
        ...

    def choose(self, mode: str, draft_logits: torch.Tensor, drafts: torch.Tensor,
               q: list[torch.Tensor | None]) -> torch.Tensor:
        """After drafting: K per row [N] (int64, each <= drafts.shape[1], built with device.index_tensor:
        the loop reads K on the host). draft_logits [N,S,V] raw, drafts [N,S], q[i] the processed proposal
        distribution of sampling row i (None: greedy row)."""
        ...

    def observe(self, mode: str, rows: int, verify_tokens: int, verify_s: float, draft_s: float | None,
                verified: torch.Tensor | None, accepted: torch.Tensor) -> None:
        """After the verify: the round's timings and outcome (verified None: no draft call this round;
        draft_s None: no draft call, or one whose time is not drafting's alone: round_outcome.PolicyObserver)."""
        ...

    def choose_tree(self, mode: str, tree: DraftTree) -> int:
        """Tree rounds, after drafting: how many of the tree's best-first nodes to verify (root counted)."""
        ...

    def observe_tree(self, mode: str, rows: int, verify_tokens: int, verify_s: float, draft_s: float | None,
                     tree: DraftTree, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a tree verify of `tree` (as verified): timings (draft_s as in `observe`), each row's round path
        and accepted length."""
        ...


class FixedPolicy:
    name = "fixed"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def plan(self, mode: str, rows: int) -> int:
        return self.block_size - 1

    def drafting_gain(self, mode: str) -> float | None:
        return None  # no cost model: the drafter always drafts

    def choose(self, mode, draft_logits, drafts, q):
        return index_tensor([drafts.shape[1]] * drafts.shape[0], drafts.device)

    def observe(self, mode, rows, verify_tokens, verify_s, draft_s, verified, accepted) -> None:
        pass

    def choose_tree(self, mode, tree) -> int:
        return tree.nodes

    def observe_tree(self, mode, rows, verify_tokens, verify_s, draft_s, tree, path, accepted) -> None:
        pass


def draft_confidence(draft_logits: torch.Tensor, q: list[Candidates | torch.Tensor | None]) -> torch.Tensor:
    """[N, S]: the drafter's processed probability of its most likely token at each slot (greedy rows:
    softmax of the argmax = 1 / sum exp(l - max), which is the proposed token; sampling rows: max q).

    Never the probability of a SAMPLED draft: K then depends on the sampled token itself, a slot is
    verified more often when its draft is one the drafter likes, and speculative sampling's output is no
    longer the target's distribution (tests/test_runtime_sampling.py measured it: chi-square p ~ 1e-95).
    q is a function of the committed context only (the block is drafted in parallel), so a K chosen from
    it is a stopping rule that never looks at the drafts it stops."""
    # torch's softmax kernel, not exp() of (l - max): exp's CPU kernel takes a slow path where l - max < ~-87
    # (results that underflow), which a padded or masked vocabulary hits at most entries (2.5 vs 0.18 ms for
    # [2, 15, 8192] logits of the 0.6B-shape zoo pair, whose padded ids sit at -901)
    conf = draft_logits.float().softmax(-1).amax(-1)
    for i, qi in enumerate(q):
        if qi is not None:  # max q over its candidates (runtime/candidates.py)
            conf[i] = Candidates.of(qi).top()
    return conf


def _row_groups(q: list[torch.Tensor | None]) -> dict[bool, list[int]]:
    """greedy (True) / sampling (False) -> the rows of that kind (host lists: no read to know them)."""
    groups: dict[bool, list[int]] = {}
    for i, qi in enumerate(q):
        groups.setdefault(qi is None, []).append(i)
    return groups


def _take(rows: list[int], n: int, device) -> slice | torch.Tensor:
    """An index for `rows` of n: every row as a view, else an index tensor."""
    return slice(None) if len(rows) == n else to_device(rows, device)


@dataclass
class _ModeState:
    off: int = 0  # rounds left without a draft call
    backoff: int = 0
    gain: float | None = None  # EMA of best rate / plain-decoding rate over drafted rounds
    paused: bool = False  # drafting was off: the next drafted round is a probe of the narrowest block


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, block_size: int, cost: CostModel | None = None, ragged: bool = False,
                 min_backoff: int = 8, max_backoff: int = 256, gain_alpha: float = 0.3,
                 learn_cost: bool = True):
        self.block_size = block_size
        self.cost = cost or CostModel(block_size=block_size)
        self.ragged = ragged
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.gain_alpha = gain_alpha
        self.learn_cost = learn_cost  # False: a fixed injected cost model (deterministic decisions in tests)
        self.calib: dict[tuple[str, bool], Calibration] = {}
        self.state: dict[str, _ModeState] = {}
        self._last: tuple[torch.Tensor, dict] | None = None  # (conf, greedy/sampling rows) of the round
        self._last_tree: torch.Tensor | None = None  # the best-first factors of a tree round's nodes
        self.width = DraftWidth(block_size)  # the draft slots of a chain round (runtime/draft_width.py)
        self._slots = 0  # the draft slots of the round being chosen / observed

    def _calibration(self, mode: str, greedy: bool, device: torch.device) -> Calibration:
        key = (mode, greedy)
        if key not in self.calib:  # made where the round's confidences live
            self.calib[key] = Calibration(device=device)
        return self.calib[key]

    def _state(self, mode: str) -> _ModeState:
        return self.state.setdefault(mode, _ModeState(backoff=self.min_backoff))

    def plan(self, mode: str, rows: int) -> int:
        st = self._state(mode)
        if st.off > 0:
            st.off -= 1
            return 0
        if st.paused:  # the probe after a pause
            st.paused = False
            return self.width.candidates[-1]
        return self.width.choose(mode, rows, self.cost)

    def drafting_gain(self, mode: str) -> float | None:
        return self._state(mode).gain

    def choose(self, mode, draft_logits, drafts, q):
        # on the device, up to the one read of the chosen K (and the gain) at the end
        N, S = drafts.shape
        dev = drafts.device
        conf = draft_confidence(draft_logits, q)
        groups = _row_groups(q)
        p = torch.empty(N, S, dtype=torch.float64, device=dev)
        for g, rows in groups.items():
            p[_take(rows, N, dev)] = self._calibration(mode, g, dev).prob(conf[_take(rows, N, dev)])
        self._last = (conf, groups)
        gain = torch.cat([torch.zeros(N, 1, dtype=torch.float64, device=dev), p.cumprod(1).cumsum(1)], 1)  # E[a | K]
        t_draft = self.cost.draft(N, S)
        t_verify = to_device([self.cost.verify(N, k + 1) for k in range(S + 1)], dev, torch.float64)
        t_round = t_draft + t_verify
        rate = (N + gain.sum(0)) / t_round
        best = rate.argmax()
        picked = [best.double().unsqueeze(0), (rate[best] * t_verify[0] / N).unsqueeze(0)]
        if self.ragged:
            picked.append((1 + gain - rate[best] * t_round.unsqueeze(0) / N).argmax(1).double())
        counts = self.width.pending(mode)  # the draft width's acceptance counts (draft_width.py), same read
        host = read(torch.cat(picked if counts is None else [*picked, counts]))
        probe = self._state(mode).gain is None  # the first drafted round after a pause (or ever)
        self._update_gain(mode, host[1])
        if counts is not None:
            self.width.absorb(mode, host[len(host) - counts.numel():])
        self._slots = S
        k = [int(x) for x in host[2:2 + N]] if self.ragged else [int(host[0])] * N
        # a probe judges at least one draft per row, so the calibration keeps learning while drafting is off
        return index_tensor([max(x, min(1, S)) for x in k] if probe else k, dev)

    def _update_gain(self, mode: str, g: float) -> None:
        st = self._state(mode)
        st.gain = g if st.gain is None else st.gain + self.gain_alpha * (g - st.gain)
        if st.gain < 1.0:
            st.off, st.gain, st.paused = st.backoff, None, True  # the probe after the pause starts a fresh average
            st.backoff = min(2 * st.backoff, self.max_backoff)
        else:
            st.backoff = self.min_backoff

    def observe(self, mode, rows, verify_tokens, verify_s, draft_s, verified, accepted) -> None:
        if self.learn_cost:
            self.cost.observe_verify(rows, verify_tokens, verify_s)
            if draft_s is not None:
                self.cost.observe_draft(rows, draft_s, self._slots)
        if verified is None or self._last is None:
            return
        self.width.observe(mode, self._slots, verified, accepted)
        conf, groups = self._last
        self._last = None
        for g, rows in groups.items():
            take = _take(rows, conf.shape[0], conf.device)
            self._calibration(mode, g, conf.device).observe(conf[take], verified[take], accepted[take])

    def choose_tree(self, mode, tree):
        factor = tree.factor()
        b, rate, plain = best_budget(tree, self._calibration(f"{mode}/tree", True, factor.device).prob(factor),
                                     self.cost)
        probe = self._state(mode).gain is None
        self._update_gain(mode, rate / plain)
        self._last_tree = factor
        return max(b, min(2, tree.nodes)) if probe else b  # a probe judges at least one node

    def observe_tree(self, mode, rows, verify_tokens, verify_s, draft_s, tree, path, accepted) -> None:
        if self.learn_cost:
            self.cost.observe_verify(rows, verify_tokens, verify_s)
            if draft_s is not None:  # None: a call that also caught up on earlier rounds (round_outcome.py)
                self.cost.observe_draft(rows, draft_s, self.block_size - 1)  # a tree drafts the whole block
        factor, self._last_tree = self._last_tree, None
        if factor is None:
            return
        judged, hit = node_outcomes(tree, path, accepted)
        self._calibration(f"{mode}/tree", True, factor.device).observe_pairs(factor[:, : tree.nodes][judged],
                                                                             hit[judged])

    def to_dict(self) -> dict:
        return {"cost": self.cost.to_dict(),
                "calibration": {f"{m}/{'greedy' if g else 'sample'}": c.to_dict() for (m, g), c in self.calib.items()}}


def make_policy(name: str | VerifyPolicy, backend, block_size: int, probe_costs: bool = False) -> VerifyPolicy:
    """A policy by name, or the object given. `adaptive` learns its costs from the rounds' own timings
    (probe_costs: start from a probe of the backend on slot 0, cost_model.probe)."""
    if not isinstance(name, str):
        return name
    if name == "fixed":
        return FixedPolicy(block_size)
    if name == "adaptive":
        cost = probe(backend, block_size) if probe_costs else CostModel(block_size=block_size)
        return AdaptivePolicy(block_size, cost)
    raise RetraceError(f"unknown verify policy {name!r} (choose from {', '.join(POLICIES)})")
