"""The index space of the drafter's logits: its draft vocabulary (retrace.models.draft_vocab), or the
target's whole vocabulary.

A backend with a draft vocabulary returns the draft call's logits over the subset only ([N, B-1, Vd]) and
says which target ids they are (`draft_ids`, [Vd] sorted, on its device); without one (`draft_ids` None or
absent) they are over the whole vocabulary. The round works in that space: the drafts' argmax, the
verify policy's confidence and the rejected suffix's draft probabilities are over Vd entries, not V
(Qwen3: 151,936; an 8192-id subset is 18x less to scan per pass, and no pass meets the -inf entries of
an expanded tensor, whose exp is CPU torch's slow path). Ids cross into the target's space here only:
`tokens` maps draft indices to target ids, `index_of` target ids to draft indices (-1 outside), and a
sampling row's proposal q stays over draft indices until the verify judges its first K rows, whose ids then
become target ids with q = 0 outside the subset (`to_target`; `probs_full` for a dense [.., Vd] row), so
speculative sampling's min(1, p/q) and max(0, p - q) are the target's as before (lossless).

Glossary: V the target's vocabulary, Vd the draft vocabulary's size (V when there is none), a draft
index an index into the logits' last dimension.
"""

from __future__ import annotations

import torch

from retrace.errors import RetraceError
from retrace.models.draft_vocab import expand_rows
from retrace.runtime.candidates import Candidates


class DraftSpace:
    def __init__(self, ids: torch.Tensor | None, vocab_size: int):
        self.ids = ids  # [Vd] int64 sorted target ids, on the backend's device; None: the whole vocabulary
        self.vocab_size = vocab_size  # V
        self._index: torch.Tensor | None = None

    @classmethod
    def of(cls, backend) -> DraftSpace:
        return cls(getattr(backend, "draft_ids", None), backend.target_config.vocab_size)

    @property
    def full(self) -> bool:
        return self.ids is None

    @property
    def size(self) -> int:
        """Vd: the entries of the draft logits' last dimension."""
        return self.vocab_size if self.ids is None else int(self.ids.numel())

    def check(self, logits: torch.Tensor, backend) -> None:
        """A backend's draft logits must be over its draft space (a wrapper that drops `draft_ids` would
        otherwise have draft indices read as target ids)."""
        if logits.shape[-1] != self.size:
            raise RetraceError(f"{getattr(backend, 'name', type(backend).__name__)}: the draft call returned logits "
                               f"over {logits.shape[-1]} ids, its draft space has {self.size} (draft_ids "
                               f"{'absent' if self.ids is None else 'set'}; runtime/draft_space.py)")

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Draft indices (any shape) -> target ids."""
        return index if self.ids is None else self.ids[index]

    def index_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape, >= 0) -> draft indices, -1 for an id outside the draft vocabulary."""
        if self.ids is None:
            return tokens
        if self._index is None:
            self._index = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=self.ids.device)
            self._index[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)
        return self._index[tokens]

    def probs_full(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] probabilities -> [..., V], 0 outside the draft vocabulary."""
        return probs if self.ids is None else expand_rows(probs, self.ids, self.vocab_size, 0.0)

    def to_target(self, dist: Candidates) -> Candidates:
        """A distribution over draft indices (runtime/candidates.py) -> the same over target ids (0 outside the
        draft vocabulary): the candidates' ids mapped, or the dense form's ids made explicit."""
        if self.ids is None:
            return dist
        if dist.ids is None:
            return Candidates(dist.probs, self.ids.expand(dist.probs.shape))
        return Candidates(dist.probs, self.ids[dist.ids])

    def logits_full(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] logits -> [..., V] float32, -inf outside the draft vocabulary."""
        return logits if self.ids is None else expand_rows(logits.float(), self.ids, self.vocab_size, float("-inf"))
