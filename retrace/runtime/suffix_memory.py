"""Persistent rejected-suffix buffers: one per batch slot, preallocated, one round deep.

After the verify of round r (anchor at p, a drafts accepted) the next anchor is p' = p + a + 1. The draft
at old block slot j (absolute p + j) lines up with new slot k = j - a - 1 (same absolute position, so RoPE
already matches). Valid new slots: k = 1 .. B-2-a (slot 0 is the new anchor, never fused); the memory is
empty after prefill and when a >= B-2. For slot k we keep:
  memory      = the drafter's final hidden state at old slot j,
  correction  = the verify-pass taps at old slot j-1 (the target state that scored d_j); they are part of
                the next draft call's context taps, so we keep their index there (a + k), not a copy,
  features    = [target argmax at j-1 == d_j, target prob of d_j at j-1, drafter prob of d_j at j].
"""

from __future__ import annotations

import torch

from retrace.models.conditioner import FEATURES
from retrace.models.drafter import SuffixInputs


def align(accepted: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accepted [N] -> (old slot j [N,B], valid [N,B] bool, correction index [N,B]) for new slots k=0..B-1."""
    k = torch.arange(block_size).unsqueeze(0)
    a = accepted.unsqueeze(1)
    valid = (k >= 1) & (k <= block_size - 2 - a)
    old_slot = torch.where(valid, k + a + 1, 0)
    corr_index = torch.where(valid, k + a, 0)
    return old_slot, valid, corr_index


def suffix_features(block_tokens: torch.Tensor, verify_logits: torch.Tensor,
                    draft_logits: torch.Tensor, target_argmax: torch.Tensor | None = None) -> torch.Tensor:
    """Reliability of each draft d_j as [N, B, 3] at old slot j (slot 0 zero): whether the target's argmax
    at j-1 is d_j, the target's probability of d_j at j-1, the drafter's own probability of d_j at j.
    Temperature-1 softmaxes, whatever the sampling parameters, so training and serving see the same.
    target_argmax [N, B]: verify_logits.argmax(-1) when the caller has it already (greedy acceptance)."""
    N, B = block_tokens.shape
    d = block_tokens[:, 1:].unsqueeze(-1)
    if target_argmax is None:
        target_argmax = verify_logits.argmax(-1)
    feats = verify_logits.new_zeros(N, B, len(FEATURES))
    feats[:, 1:, 0] = (target_argmax[:, :-1] == block_tokens[:, 1:]).float()
    feats[:, 1:, 1] = verify_logits[:, :-1].float().softmax(-1).gather(2, d).squeeze(-1)
    feats[:, 1:, 2] = draft_logits.float().softmax(-1).gather(2, d).squeeze(-1)
    return feats


class SuffixMemory:
    def __init__(self, slots: int, block_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        B, d, F = block_size, hidden_size, len(FEATURES)
        self.block_size = B
        self.memory = torch.zeros(slots, B, d, dtype=dtype)
        self.features = torch.zeros(slots, B, F, dtype=torch.float32)
        self.valid = torch.zeros(slots, B, dtype=torch.float32)
        self.corr_index = torch.zeros(slots, B, dtype=torch.int64)
        self.count = torch.zeros(slots, dtype=torch.int64)  # valid slots 1..count
        self.position = torch.full((slots,), -1, dtype=torch.int64)  # absolute position of new slot 0
        # align() for every accepted length, looked up per row in write()
        self._old_slot, self._valid, self._corr_index = align(torch.arange(B), B)

    def clear(self, slot: int) -> None:
        # corr_index too: the drafter gathers with it even where valid == 0, and a stale index from the
        # slot's previous request can point past a new request's (shorter) context
        self.memory[slot] = 0
        self.features[slot] = 0
        self.corr_index[slot] = 0
        self.valid[slot] = 0
        self.count[slot] = 0
        self.position[slot] = -1

    def write(self, slots: torch.Tensor, hidden: torch.Tensor, block_tokens: torch.Tensor,
              verify_logits: torch.Tensor, draft_logits: torch.Tensor, accepted: torch.Tensor,
              anchor_pos: torch.Tensor, target_argmax: torch.Tensor | None = None) -> None:
        """After a verify. hidden [N,B,d] drafter states; block_tokens [N,B] = [anchor, d_1..d_{B-1}];
        verify_logits [N,B,V]; draft_logits [N,B-1,V] (slots 1..B-1); accepted [N]; anchor_pos [N] = p;
        target_argmax [N,B] optional (verify_logits.argmax(-1), if the caller has it)."""
        old, valid, corr = self._old_slot[accepted], self._valid[accepted], self._corr_index[accepted]
        feats = suffix_features(block_tokens, verify_logits, draft_logits, target_argmax)
        v = valid.to(self.memory.dtype).unsqueeze(-1)
        self.memory[slots] = torch.gather(hidden, 1, old.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])).to(v.dtype) * v
        self.features[slots] = torch.gather(feats, 1, old.unsqueeze(-1).expand(-1, -1, feats.shape[-1])) * v.float()
        self.valid[slots] = valid.float()
        self.corr_index[slots] = corr
        self.count[slots] = valid.sum(1)
        self.position[slots] = anchor_pos + accepted + 1

    def read(self, slots: torch.Tensor) -> SuffixInputs:
        return SuffixInputs(self.memory[slots], self.features[slots], self.valid[slots], self.corr_index[slots])
