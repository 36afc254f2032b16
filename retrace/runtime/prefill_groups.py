"""Which of the prompts admitted together share a prefill call.

A prefill call takes [N, T] tokens: every prompt padded to the call's longest. Past a few rows a prefill is
compute-bound (on a CPU from about 8 rows at int4, on a GPU from a few hundred), so a padded position costs
what a real one does, and admitting prompts of different lengths together wasted that much: the 0.6B bench's
32 held-out prompts (64-196 tokens), admitted four at a time, were 3,884 tokens padded to 5,052 (+30%), with a
third of batch 4's wall time in prefill (docs/bench/qwen3-0.6b-int4-intel-2026-12-07.md). One call per prompt
wastes nothing, but each call also streams the weights once, which is what padded rows are worth below the
compute-bound regime. Measured there: prefill -9%, prompt lookup first +4% at batch 4, the same tokens.

So the prompts are sorted by length and each call takes a run of them while the padding it adds stays within
`free_rows` positions (about one weight pass worth of rows: `free_rows_for` the device) or `slack` of the
call's real tokens. Each call's rows are computed as before (the backends' row rules make a row's result
independent of its call's other rows), so the grouping changes no token.
"""

from __future__ import annotations

import torch

CPU_FREE_ROWS = 8  # an int4 decode step (~22 ms on 2 cores) costs about 7 prefill rows (~3 ms each); fp32 ~19
CUDA_FREE_ROWS = 256  # a bf16 GPU prefill is memory-bound up to a few hundred rows


def free_rows_for(device: torch.device) -> int:
    """Padded positions one call may add for free on `device` (about one pass over the weights' worth)."""
    return CUDA_FREE_ROWS if device.type == "cuda" else CPU_FREE_ROWS


def prefill_groups(lengths: list[int], free_rows: int = CPU_FREE_ROWS, slack: float = 0.125) -> list[list[int]]:
    """lengths [N] prompt lengths -> the prefill calls, as lists of indices into `lengths` (each in ascending
    order; every index once). Prompts are taken shortest first; a call grows while N x T (T its longest) is at
    most its real tokens plus max(free_rows, slack x real tokens)."""
    if any(n <= 0 for n in lengths):
        raise ValueError(f"prompt lengths must be positive, got {lengths}")
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n - (real + n) <= max(free_rows, slack * (real + n)):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return [sorted(g) for g in groups]
