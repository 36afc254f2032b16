"""The previous round's rejected trajectory per slot, aligned to the next block: the `suffix` and `target`
sources of a draft tree (runtime/draft_tree.py).

After a round with anchor at p that accepted a drafts, the next anchor sits at p + a + 1 and old block slot j
lines up with new slot k = j - a - 1 (the alignment of runtime/suffix_memory.py). For new slots k >= 1:
  suffix[k] = old d_j, the round's block token at old slot j: the round path's token (runtime/tree_accept.py:
              the accepted path continued by each node's best child as far as the tree goes), then the
              drafter's top-1 token (drafted-but-unverified slots included);
  target[k] = the target's argmax at old slot j - 1 of the round path, -1 where the path did not reach
              old slot j - 1.
Stored as [slots, B-1] token ids at new slots 1..B-1 (index k - 1), -1 = none. A round without a draft,
admission and release leave the slot empty.
"""

from __future__ import annotations

import torch


class RejectedTrajectory:
    def __init__(self, slots: int, block_size: int, device: torch.device | str = "cpu"):
        S = block_size - 1
        self.suffix = torch.full((slots, S), -1, dtype=torch.int64, device=device)
        self.target = torch.full((slots, S), -1, dtype=torch.int64, device=device)

    def clear(self, slot: int) -> None:
        self.suffix[slot] = -1
        self.target[slot] = -1

    def write(self, slots: torch.Tensor, top1: torch.Tensor, path_argmax: torch.Tensor,
              path_len: torch.Tensor, accepted: torch.Tensor) -> None:
        """top1 [N, S]: the round's block tokens at old slots 1..S; path_argmax [N, L+1]: the target's argmax
        at the round path's nodes (old slots 0..L, padded); path_len [N]: each row's L; accepted [N]."""
        N, S = top1.shape
        width = self.suffix.shape[1]
        k = torch.arange(1, width + 1, device=top1.device).unsqueeze(0)
        j = k + accepted.unsqueeze(1) + 1  # old slot of new slot k
        ok = j <= S
        self.suffix[slots] = torch.where(ok, top1.gather(1, (j - 1).clamp(0, S - 1)), -1)
        L = path_argmax.shape[1] - 1
        ok = (j - 1) <= path_len.unsqueeze(1)
        self.target[slots] = torch.where(ok, path_argmax.gather(1, (j - 1).clamp(0, L)), -1)

    def read(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"suffix": self.suffix[slots], "target": self.target[slots]}
