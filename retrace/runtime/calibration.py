"""Drafter confidence -> acceptance probability, measured online from the rounds' own outcomes.

Confidence of draft slot k: the drafter's processed probability of the token it proposed there (greedy
rows: the softmax probability of its argmax; sampling rows: q of the sampled token). Acceptance of slot k
is conditional on slots 1..k-1 being accepted (the target never judges a draft after a rejection), so one
verified row gives one observation per slot up to and including its first rejection: slots 1..a accepted,
slot a+1 rejected when a < K; the slots after it say nothing.

Binned: `bins` equal-width confidence bins, each a (hits, trials) pair that starts from a prior of
`prior_weight` pseudo-trials at the prior rate (default: the bin's centre, i.e. a calibrated drafter), and
is halved once it holds more than `window` trials, so it follows a drift of the drafter's reliability.
"""

from __future__ import annotations

import torch


class Calibration:
    def __init__(self, bins: int = 10, prior: torch.Tensor | None = None, prior_weight: float = 4.0,
                 window: float = 500.0, device: torch.device | str = "cpu"):
        centres = (torch.arange(bins, dtype=torch.float64, device=device) + 0.5) / bins
        rate = centres if prior is None else torch.as_tensor(prior, dtype=torch.float64, device=device)
        self.bins = bins
        self.window = window
        self.trials = torch.full((bins,), float(prior_weight), dtype=torch.float64, device=device)
        self.hits = rate * self.trials

    def _bin(self, conf: torch.Tensor) -> torch.Tensor:
        if self.hits.device != conf.device:  # the counts live where the confidences are computed
            self.hits, self.trials = self.hits.to(conf.device), self.trials.to(conf.device)
        return (conf.double() * self.bins).long().clamp(0, self.bins - 1)

    def prob(self, conf: torch.Tensor) -> torch.Tensor:
        """Acceptance probability of each slot given the earlier ones were accepted, same shape as conf."""
        return (self.hits / self.trials)[self._bin(conf)]

    def observe(self, conf: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """conf [N, S] of the drafted slots; verified [N] drafts the target judged (K); accepted [N] (a)."""
        if conf.numel() == 0:
            return
        k = torch.arange(conf.shape[1], device=conf.device).unsqueeze(0)
        a, K = accepted.unsqueeze(1), verified.unsqueeze(1)
        hit = k < a
        seen = hit | ((k == a) & (a < K))
        self._add(conf.reshape(-1), hit.reshape(-1).double(), seen.reshape(-1).double())

    def to_dict(self) -> dict:
        return {"rate": [round(float(x), 4) for x in self.hits / self.trials],
                "trials": [round(float(x), 1) for x in self.trials]}

    def observe_pairs(self, conf: torch.Tensor, hit: torch.Tensor) -> None:
        """One observation per element: conf [n] and whether that candidate was accepted, hit [n] (tree nodes
        whose parent was accepted)."""
        if conf.numel() == 0:
            return
        self._add(conf, hit.double(), torch.ones_like(conf, dtype=torch.float64))

    def _add(self, conf: torch.Tensor, hit: torch.Tensor, weight: torch.Tensor) -> None:
        """Add weight[i] trials (weight[i] * hit[i] hits) to conf[i]'s bin; halve the bins past the window.
        Scatter-adds and a where: no data-dependent shape, so nothing waits for the device."""
        idx = self._bin(conf)
        self.trials = self.trials.scatter_add(0, idx, weight)
        self.hits = self.hits.scatter_add(0, idx, weight * hit)
        half = torch.where(self.trials > self.window, 0.5, 1.0)
        self.trials, self.hits = self.trials * half, self.hits * half
