"""The drafter's context per request: the target taps it has not seen yet.

After a prefill the prompt's taps, after a round the verify's taps (the verified chain, or a tree's round
path), and after rounds without a drafter call all of theirs since the last one: the drafter conditions on
every committed position exactly once. An `ar` request never calls the drafter: it keeps no taps (at the
Qwen3-0.6B shape they would be 20 KB per token for the request's life, and an op per row per round).
"""

from __future__ import annotations

import torch

from retrace.runtime.device import index_tensor
from retrace.runtime.proposers.base import ranges


def start_context(r, prompt_taps: torch.Tensor) -> None:
    """After the prefill: the prompt's taps [P, H] are the drafter's first context (an `ar` request: none)."""
    r.ctx_taps = None if r.mode == "ar" else prompt_taps
    r.ctx_parts, r.ctx_parts_len, r.ctx_pos0 = [], 0, 0


def continue_context(r, chunk_taps: torch.Tensor) -> None:
    """A later chunk of a chunked prefill (runtime/prefill_chunks.py): its taps follow the earlier chunks'."""
    if r.mode == "ar":
        return
    r.ctx_parts.append(r.ctx_taps)
    r.ctx_parts_len += r.ctx_taps.shape[0]
    r.ctx_taps = chunk_taps


def extend_context(r, taps: torch.Tensor, drafted: bool) -> None:
    """The verify taps of this round become the drafter's next context. A round without a draft call
    gave the drafter nothing: its pending taps (up to the anchor) stay and the new ones follow."""
    if r.mode == "ar":
        return
    if drafted:
        r.ctx_parts, r.ctx_pos0 = [], r.anchor_pos
    else:  # the valid part of the last taps: up to the anchor (the parts before it are all valid)
        r.ctx_parts.append(r.ctx_taps[: r.anchor_pos - r.ctx_pos0 - r.ctx_parts_len])
        r.ctx_parts_len += r.ctx_parts[-1].shape[0]
    if not r.ctx_parts:
        r.ctx_parts_len = 0
    r.ctx_taps = taps


def context(reqs: list, max_seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pending target taps per row (prompt after prefill, the verify slots after a round, all the
    rounds' since the last draft call), right-padded -> (taps [N, C, H], positions [N, C]). Pad entries sit
    at positions >= the anchor, where the drafter masks them."""
    for r in reqs:
        if r.ctx_parts:
            r.ctx_taps = torch.cat(r.ctx_parts + [r.ctx_taps])
            r.ctx_parts, r.ctx_parts_len = [], 0
    C = max(r.ctx_taps.shape[0] for r in reqs)
    if all(r.ctx_taps.shape[0] == C for r in reqs):
        taps = torch.stack([r.ctx_taps for r in reqs])
    else:
        taps = reqs[0].ctx_taps.new_zeros(len(reqs), C, reqs[0].ctx_taps.shape[-1])
        for i, r in enumerate(reqs):
            taps[i, : r.ctx_taps.shape[0]] = r.ctx_taps
    last = max_seq_len - 1
    positions = index_tensor([[min(p, last) for p in row] for row in ranges([r.ctx_pos0 for r in reqs], C)], device)
    return taps, positions
