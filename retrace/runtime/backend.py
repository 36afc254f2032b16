"""The small interface every backend implements; the loop calls nothing else.

Caches are preallocated per slot and indexed by absolute position (see docs/INTERFACES.md): a call that
feeds tokens at positions p..p+T-1 writes their K/V there and attends to entries < p, so "cropping" after a
partial accept is only the next call's start position. Tensors in and out live on the backend's `device`
(an optional attribute, default cpu: runtime/device.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from retrace.models.config import DrafterConfig, Qwen3Config
from retrace.models.drafter import SuffixInputs
from retrace.runtime.device import host_values


@runtime_checkable
class Backend(Protocol):
    name: str
    target_config: Qwen3Config
    drafter_config: DrafterConfig | None
    max_batch: int
    max_seq_len: int
    has_conditioner: bool

    def target(self, slots: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               logits_index: torch.Tensor, tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [N,K,V] f32 at logits_index, taps [N,T,k*d]); writes K/V at `positions`.

        tree_mask [N,T,T] bool (a draft tree's verify; only passed in tree mode): the new tokens attend to
        the past (< positions[:, 0]) and to the new tokens the mask allows; positions are per node (the
        root's, positions[:, 0], is the smallest). Their K/V go to the scratch indices positions[:, 0] + m
        (node order), not to `positions`, which collide; commit_path then moves the accepted path's K/V
        to its absolute positions. A backend without tree support raises RetraceError."""
        ...

    def commit_path(self, slots: torch.Tensor, src_index: torch.Tensor, dst_pos: torch.Tensor) -> None:
        """After a tree verify: copy the target K/V at cache indices src_index [N,L] to dst_pos [N,L] in each
        slot (every source read before any destination is written)."""
        ...

    def draft(self, slots: torch.Tensor, ctx_taps: torch.Tensor, ctx_positions: torch.Tensor,
              block_ids: torch.Tensor, block_positions: torch.Tensor,
              suffix: SuffixInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [N,B,d], logits [N,B-1,Vd] f32); writes the context K/V at `ctx_positions`. Vd = V, or
        with a draft vocabulary its size, the backend's optional `draft_ids` [Vd] naming the target ids the
        logits are for (runtime/draft_space.py; absent or None: the whole vocabulary)."""
        ...

    def release(self, slot: int) -> None:
        """The request in `slot` finished or was preempted (caches need no clearing: positions mask them)."""
        ...


def contiguous_range(slots: torch.Tensor) -> slice | None:
    """slots == [a, a+1, ..., a+N-1] -> slice(a, a+N) (a view, no gather), else None."""
    values = host_values(slots)  # the host copy when the loop built the tensor (no device read)
    first, n = values[0], len(values)
    return slice(first, first + n) if values == list(range(first, first + n)) else None
