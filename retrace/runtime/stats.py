"""Acceptance and timing statistics: tau (mean accepted length per round, counting the bonus token)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptStats:
    rounds: int = 0
    tokens: int = 0
    drafted: int = 0  # draft slots the drafter filled for the rounds that drafted (verified or not)
    accepted_hist: list[int] = field(default_factory=list)  # index a = rounds that accepted a drafts
    verify_hist: list[int] = field(default_factory=list)  # index K = rounds that verified K drafts

    def record(self, accepted: int, verified: int = 0, drafted: int = 0) -> None:
        self.rounds += 1
        self.drafted += drafted
        _bump(self.accepted_hist, accepted)
        _bump(self.verify_hist, verified)

    @property
    def tau(self) -> float | None:
        if not self.rounds:
            return None
        return sum((a + 1) * n for a, n in enumerate(self.accepted_hist)) / self.rounds

    def merge(self, other: AcceptStats) -> None:
        self.rounds += other.rounds
        self.tokens += other.tokens
        self.drafted += other.drafted
        for a, n in enumerate(other.accepted_hist):
            _bump(self.accepted_hist, a, n)
        for k, n in enumerate(other.verify_hist):
            _bump(self.verify_hist, k, n)

    def to_dict(self) -> dict:
        return {"tau": self.tau, "rounds": self.rounds, "tokens": self.tokens, "drafted": self.drafted,
                "accepted_hist": list(self.accepted_hist),
                "verify_hist": list(self.verify_hist)}


def _bump(hist: list[int], index: int, n: int = 1) -> None:
    if index >= len(hist):
        hist.extend([0] * (index + 1 - len(hist)))
    hist[index] += n


@dataclass
class Timing:
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    wall: float = 0.0

    @property
    def other(self) -> float:
        return max(0.0, self.wall - self.prefill - self.draft - self.verify)

    def to_dict(self) -> dict:
        w = self.wall or 1e-12
        return {
            "wall_s": self.wall, "prefill_s": self.prefill, "draft_s": self.draft, "verify_s": self.verify,
            "other_s": self.other, "other_share": self.other / w,
        }
