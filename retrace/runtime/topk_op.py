"""Sampling's top-k as one torch operator, `torch.ops.retrace.topk(x, k)` -> (values, indices) of the k largest
entries along the last dimension, largest first (as `torch.topk(x, k)`; which of several entries tied at the k-th
comes back is either's own order). Its CPU kernel selects with numpy over the same memory.

Why: a sampled token's top-k (and top-p's candidates, runtime/top_p_op.py) scans the whole vocabulary every
step; `torch.topk` of k = 36 over Qwen3's 151,936 logits takes 0.44 ms a row on 2 CPU cores, a fifth of a
sampled step's host work at the 0.6B shape. The kernel takes a threshold that at least k entries reach from a
strided sample (its k-th largest: the sample is a subset of the row, so the row has at least k entries there),
keeps the entries above it (at or above it where fewer than k are above: a tie-heavy row) with one vectorised
comparison and selects among those few thousand (`argpartition`, then a sort of the k). A row with a NaN, or
too short to sample, goes to `torch.topk`.
Registered with torch.library as runtime/argmax_op.py's argmax is: the kernel runs below the dispatcher, so
reading a CPU tensor's memory is not a host read of the round; other devices run `torch.topk`.
"""

from __future__ import annotations

import numpy as np
import torch

STRIDE = 64  # one sampled entry in STRIDE: the threshold lets through about STRIDE x k entries

_lib = torch.library.Library("retrace", "FRAGMENT")
_lib.define("topk(Tensor x, int k) -> (Tensor, Tensor)")


def _select(row: np.ndarray, k: int) -> np.ndarray | None:
    """The indices of row's k largest entries, largest first; None where numpy cannot decide (a NaN)."""
    sample = row[::STRIDE]
    t = np.partition(sample, len(sample) - k)[len(sample) - k]  # the sample's k-th largest: >= k entries reach it
    if np.isnan(t) or np.isnan(row.max()):
        return None
    cand = np.flatnonzero(row > t)  # strictly above first: a tie-heavy row (a padded vocabulary) lets few through
    if len(cand) < k:
        cand = np.flatnonzero(row >= t)
    top = cand[np.argpartition(row[cand], len(cand) - k)[len(cand) - k:]]
    return top[np.argsort(-row[top], kind="stable")]


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    V = x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < k <= V // STRIDE:
        return torch.topk(x, k, dim=-1)
    found = [_select(row, k) for row in x.detach().reshape(-1, V).numpy()]
    if any(f is None for f in found):
        return torch.topk(x, k, dim=-1)
    idx = torch.from_numpy(np.stack(found)).reshape(*x.shape[:-1], k)
    return x.gather(-1, idx), idx


_lib.impl("topk", _topk, "CompositeExplicitAutograd")
_lib.impl("topk", lambda x, k: torch.topk(x, k, dim=-1), "Meta")  # shapes only
topk = torch.ops.retrace.topk.default
