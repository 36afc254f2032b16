"""A target call on scattered slots runs over the contiguous range that covers them, when every slot of the
range it does not ask for is free: those rows compute a dummy token each instead of the call gathering the
caches it needs (and writing the new entries back).

Why: the in-place graph binds a contiguous slot range's caches as views; a scattered set (requests that
finished in the middle of a batch: [0, 1, 3]) was gathered, the whole past of every row copied per call. At
the Qwen3-0.6B shape, fp32, past 200, 2 threads: slots [0, 1, 3] took 280-646 ms per call against 141-149 ms
for [0, 1, 2] (the gather alone 123-293 ms for 138 MB of K/V; benchmarks/scattered_slots.py,
docs/onnxruntime-backend.md). A dummy row costs what one more row of the
call's weights pass does (fp32 at batch 3-4: ~5%; int4, compute-bound past two rows: ~0.45 of a decode).

Only calls of at most MAX_TOKENS tokens (decodes, verifies, trees): a prefill gathers nothing from position 0
(the backend binds an empty past) and little for a later chunk, while a dummy row would compute the whole
prompt's width (at that shape ~24 ms per token).

A dummy row: token 0 at positions 0 .. T-1 of its free slot, whose cache holds nothing live (the next request
admitted there is prefilled from position 0 over it). A slot is free from the start and after `release` until
a call names it. The rows the caller asked for come back in their order.
"""

from __future__ import annotations

import itertools

import torch

MAX_TOKENS = 16  # the widest verify (a chain's block, a tree's budget); wider calls gather


class SlotCover:
    def __init__(self, slots: int):
        self.free = set(range(slots))  # slots whose cache holds nothing live

    def release(self, slot: int) -> None:
        self.free.add(slot)

    def plan(self, slots: list[int], tokens: int) -> tuple[list[int], list[int]] | None:
        """The covering range's slots and the caller's rows in it (ascending slots whose gaps are all free), else
        None (already contiguous, unordered, wider than MAX_TOKENS, or a gap holds a live cache: the caller
        gathers)."""
        self.free.difference_update(slots)
        lo, hi = slots[0], slots[-1]
        if tokens > MAX_TOKENS or hi - lo + 1 == len(slots) or any(b <= a for a, b in itertools.pairwise(slots)):
            return None
        gaps = set(range(lo, hi + 1)).difference(slots)
        if not gaps <= self.free:
            return None
        return list(range(lo, hi + 1)), [s - lo for s in slots]

    @staticmethod
    def expand(rows: list[int], width: int, input_ids: torch.Tensor, positions: torch.Tensor,
               logits_index: torch.Tensor, tree_mask: torch.Tensor | None):
        """The call's inputs [N, ..] placed at `rows` of `width` rows; the others dummy rows."""
        T, dev = input_ids.shape[1], input_ids.device
        at = torch.tensor(rows, device=dev)

        def place(x: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
            out = filler.expand(width, *x.shape[1:]).clone()
            out[at] = x
            return out

        ids = place(input_ids, torch.zeros(1, T, dtype=input_ids.dtype, device=dev))
        pos = place(positions, torch.arange(T, dtype=positions.dtype, device=dev).unsqueeze(0))
        index = place(logits_index, torch.zeros(1, logits_index.shape[1], dtype=logits_index.dtype, device=dev))
        mask = None if tree_mask is None else place(
            tree_mask, torch.ones(T, T, dtype=tree_mask.dtype, device=dev).tril().unsqueeze(0))
        return ids, pos, index, mask
