"""A processed sampling distribution kept as its candidates: the ids that top-k (and top-p inside it), or top-p
alone on the CPU, leave a probability, not a [..., V] row of zeros around them.

Why: with top-k (Qwen3's suggested sampling: top-k 20, top-p 0.8, temperature 0.7) a target row has at most
k + TIE_ROOM ids with probability > 0, yet the dense form scattered them into 151,936 zeros, and every step
after it (the unsampleable check, speculative sampling's p(d), the residual max(0, p - q) and its normalisation,
the inverse-CDF draw's float64 cumulative sum) passed over the whole vocabulary again: ~1.3 ms a round of 3 rows
on 2 CPU cores, more than the top-k itself. Over the candidates each of those is a pass over ~36 entries, on
any device, with no host read.

Glossary (shapes for one request's rows; a batch adds a leading N):
  probs   [..., C] float32: the candidates' probabilities; a row sums to 1 (entries may be 0: a candidate that
          top-k's ties or top-p dropped); the dense form has C = V.
  ids     [..., C] int64: which ids those are: vocabulary ids, or draft indices while the distribution is the
          drafter's over its draft space (DraftSpace.to_target maps them); None: the dense form (probs covers
          the whole last dimension: sampling with neither top-k nor top-p).
  p, q    the target's and the proposal's distributions of speculative sampling (runtime/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrace.runtime.argmax_op import argmax


def sample_index(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [..., V] (non-negative, any positive total) -> indices [...] int64: the inverse
    of the row's cumulative distribution, in float64, at a uniform draw. Never an index of probability 0. What
    torch.multinomial(probs, 1) samples, 22x faster at 151,936 ids on the CPU (0.17 against 3.7 ms a row:
    benchmarks of 2026-12-07, docs/bench/prompt-lookup.md)."""
    cdf = probs.double().cumsum(-1)
    u = (1 - torch.rand(*probs.shape[:-1], 1, generator=gen, dtype=torch.float64, device=probs.device))
    return torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1)  # the first index whose cdf reaches it


@dataclass(frozen=True)
class Candidates:
    probs: torch.Tensor  # [..., C] float32
    ids: torch.Tensor | None = None  # [..., C] int64; None: dense (C = V)

    @classmethod
    def of(cls, x: Candidates | torch.Tensor) -> Candidates:
        """A dense probability tensor [..., V] as the dense form; Candidates as they are."""
        return x if isinstance(x, Candidates) else cls(x)

    def __getitem__(self, i) -> Candidates:
        """Rows (any index of the leading dimensions: an int, a slice, a 0-dim tensor)."""
        return Candidates(self.probs[i], None if self.ids is None else self.ids[i])

    def prob(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] (one id per row) -> their probabilities [...] (0 for an id that is no candidate)."""
        if self.ids is None:
            return self.probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return torch.where(self.ids == tokens.unsqueeze(-1), self.probs, 0.0).sum(-1)

    def on(self, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
        """Probabilities at `ids` [..., M] -> [..., M] (0 for an id that is no candidate); ids None: at every id,
        [..., vocab_size]. A lookup in the sorted candidates: O((M + C) log C), whatever the two widths (top-p's
        candidates can be thousands)."""
        if ids is None:
            return self.dense(vocab_size)
        if self.ids is None:
            return self.probs.gather(-1, ids)
        sorted_ids, order = torch.sort(self.ids, dim=-1, stable=True)  # stable: a repeated id finds its first
        at = torch.searchsorted(sorted_ids, ids).clamp_max(sorted_ids.shape[-1] - 1)
        found = sorted_ids.gather(-1, at) == ids
        return torch.where(found, self.probs.gather(-1, order.gather(-1, at)), 0.0)

    def dense(self, vocab_size: int) -> torch.Tensor:
        """[..., vocab_size]: the probabilities scattered at their ids (the trees' walk reads this form)."""
        if self.ids is None:
            return self.probs
        out = self.probs.new_zeros(*self.probs.shape[:-1], vocab_size)
        return out.scatter_add_(-1, self.ids, self.probs)  # add: a padded candidate may repeat an id at 0

    def sample(self, gen: torch.Generator) -> torch.Tensor:
        """One draw per row -> ids [...] (never one of probability 0)."""
        index = sample_index(self.probs, gen)
        return index if self.ids is None else self.ids.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    def top(self) -> torch.Tensor:
        """[...]: each row's largest probability (the verify policy's confidence of a sampling row)."""
        if self.ids is None:  # retrace::argmax: numpy's vectorised argmax on the CPU (torch's max reduction is not)
            return self.probs.gather(-1, argmax(self.probs).unsqueeze(-1)).squeeze(-1)
        return self.probs.amax(-1)
