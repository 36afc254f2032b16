"""The draft width: how many draft slots S the drafter fills this round (the block [anchor, MASK x S], S <=
B - 1), chosen before drafting by the adaptive verify policy (runtime/verify_policy.py `plan`).

A narrower block is a cheaper draft call (fewer rows through the drafter and its head: at the Qwen3-0.6B
shape, int4, batch 1, 2 threads, a block of 4 / 8 / 16 cost 0.22 / 0.29 / 0.46 of a decode step) and offers
fewer drafts. For each candidate S in {B-1, B/2-1, B/4-1} the width takes the best expected rate over
K <= S drafts verified,

    rate(S) = max_K N (1 + G(K)) / (t_draft(N, S) + t_verify(N, K + 1)),   G(K) = c_1 + .. + c_K,

c_k the recent chance that draft k is accepted at that width: c_k = h_1 .. h_k, h_j the observed rate at
which draft j is accepted once drafts 1..j-1 were (rounds that verified it, each row; decayed counts kept on
the device and read with the verify policy's one read of the round), t from the cost model (a width never
timed is scaled from the nearest timed one, runtime/cost_model.py). The counts are kept per width because
acceptance depends on it: the block is drafted in parallel, each slot attending to the whole block, and a
drafter trained on blocks of 16 drafts worse in a narrower one (0.6B shape, int4: a 3rd draft accepted in
17% of the rounds at width 8, 6-8% at width 4). A slot with few counts at a width leans on the same slot's
rate pooled over the widths (PRIOR pseudo-counts). Every `explore`-th drafted round drafts a neighbour of
the best width (narrower and wider in turn), so the others stay measured; before any drafted round, the
whole block. The output never depends on the width: any drafts are verified.
"""

from __future__ import annotations

import torch

PRIOR = 2.0  # pseudo-counts of the pooled rate behind each width's own counts


class DraftWidth:
    def __init__(self, block_size: int, explore: int = 16, decay: float = 0.05):
        self.candidates = sorted({max(1, (block_size >> i) - 1) for i in range(3)}, reverse=True)  # 15, 7, 3
        self.explore, self.decay = explore, decay
        self.counts: dict[str, torch.Tensor] = {}  # mode -> [widths, 2, B-1] float64 (tries, hits) per slot
        self.accept: dict[tuple[str, int], list[float]] = {}  # (mode, S) -> c_1 .. c_S as last read
        self._rounds: dict[str, int] = {}  # mode -> widths chosen

    def observe(self, mode: str, slots: int, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a drafted chain round of `slots` draft slots: verified / accepted [N] (device; no read)."""
        if slots not in self.candidates:
            return
        c = self.counts.get(mode)
        if c is None:
            c = self.counts[mode] = torch.zeros(len(self.candidates), 2, self.candidates[0], dtype=torch.float64,
                                                device=accepted.device)
        k = torch.arange(1, slots + 1, device=accepted.device)
        a, v = accepted.unsqueeze(1), verified.to(accepted.device).unsqueeze(1)
        row = c[self.candidates.index(slots)]
        row.mul_(1 - self.decay)
        row[0, :slots] += ((v >= k) & (a >= k - 1)).sum(0)
        row[1, :slots] += (a >= k).sum(0)

    def pending(self, mode: str) -> torch.Tensor | None:
        """The counts to bring back with the round's read (flat), None before any."""
        c = self.counts.get(mode)
        return None if c is None else c.flatten()

    def absorb(self, mode: str, values: list[float]) -> None:
        """The read-back `pending` values -> each width's c_k."""
        W, S = len(self.candidates), self.candidates[0]
        tries = [values[(w * 2) * S:(w * 2 + 1) * S] for w in range(W)]
        hits = [values[(w * 2 + 1) * S:(w * 2 + 2) * S] for w in range(W)]
        pooled = [sum(h[k] for h in hits) / n if (n := sum(t[k] for t in tries)) > 0 else 0.5 for k in range(S)]
        for w, width in enumerate(self.candidates):
            c, acc = [], 1.0
            for k in range(width):
                acc *= (hits[w][k] + PRIOR * pooled[k]) / (tries[w][k] + PRIOR)
                c.append(acc)
            self.accept[mode, width] = c

    def choose(self, mode: str, rows: int, cost) -> int:
        if (mode, self.candidates[0]) not in self.accept:
            return self.candidates[0]
        rates = {S: self._rate(self.accept[mode, S], S, rows, cost) for S in self.candidates}
        top = max(rates.values())
        best = max(S for S in self.candidates if rates[S] >= top * (1 - 1e-6))  # ties keep the wider block
        n = self._rounds[mode] = self._rounds.get(mode, 0) + 1
        if n % self.explore:
            return best
        i, step = self.candidates.index(best), 1 if (n // self.explore) % 2 else -1  # narrower, wider in turn
        if not 0 <= i + step < len(self.candidates):
            step = -step  # the best is at an end: its one neighbour
        return self.candidates[i + step] if 0 <= i + step < len(self.candidates) else best

    @staticmethod
    def _rate(c: list[float], S: int, rows: int, cost) -> float:
        t_draft, gain, rate = cost.draft(rows, S), 0.0, 0.0
        for K in range(S + 1):
            gain += c[K - 1] if K else 0.0
            rate = max(rate, (1 + gain) / (t_draft + cost.verify(rows, K + 1)))
        return rate
