"""The torch backend over a dense past: the models' own forwards, the past concatenated per layer.

`ConcatTorchBackend` is the torch backend as it was before its static caches (runtime/torch_backend.py):
each call takes a view of the slots' past [N, Hkv, P, hd] (P: the longest past), `Qwen3Target.forward` /
`DFlashDrafter.forward` concatenate it with the new K/V in every layer, and the new K/V are written to the
cache after the call. Same interface, same tokens; its floats differ from the static path's in the last
bits (attention sums over a different set of masked columns). Training rollouts use it
(`train/rollout.make_backend`): the shipped zoo's conditioner was trained on rollouts with these numerics,
so a retrain rebuilds its bytes exactly. The runtime uses `TorchBackend`.
"""

from __future__ import annotations

import torch

from retrace.models.drafter import DFlashDrafter, SuffixInputs
from retrace.models.target import Qwen3Target
from retrace.runtime.device import host_values
from retrace.runtime.torch_backend import TorchBackend


def _longest_past(positions: torch.Tensor) -> int:
    """max over rows of positions[:, 0] (from the host copy when the loop built the tensor)."""
    return max(row[0] for row in host_values(positions))


class ConcatTorchBackend(TorchBackend):
    padded_steps = False  # the dense past: no static shapes, so no CUDA graphs on any device
    subset_draft_logits = False  # the model's forward: draft logits at target ids (-inf outside a draft vocab)

    def _steps(self, target: Qwen3Target, drafter: DFlashDrafter | None):
        return target, drafter, 0

    @torch.inference_mode()
    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        P = _longest_past(positions)
        pk, pv = self.tcache.past(slots, P)
        slots, input_ids, positions, logits_index, tree_mask = self._on_device(slots, input_ids, positions,
                                                                               logits_index, tree_mask)
        past_len = positions[:, 0]
        with self._autocast():
            logits, taps, nk, nv = self.target_step(input_ids, positions, pk, pv, past_len, logits_index.contiguous(),
                                                    tree_mask=tree_mask)
        if tree_mask is not None:  # node m's K/V at scratch index positions[:, 0] + m (see commit_path)
            positions = past_len.unsqueeze(1) + torch.arange(input_ids.shape[1], device=positions.device)
        self.tcache.write(slots, positions, nk, nv)
        return logits, taps

    @torch.inference_mode()
    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix: SuffixInputs | None):
        P = _longest_past(ctx_positions)
        pk, pv = self.dcache.past(slots, P)
        slots, ctx_taps, ctx_positions, block_ids, block_positions = self._on_device(
            slots, ctx_taps, ctx_positions, block_ids, block_positions)
        dt = self.drafter_model.fc.weight.dtype
        suffix = self._suffix_on_device(suffix, dt)
        with self._autocast():
            hidden, logits, nk, nv = self.draft_step(ctx_taps.to(dt), ctx_positions, pk, pv,
                                                     ctx_positions[:, 0], block_ids, block_positions, suffix)
        self.dcache.write(slots, ctx_positions, nk, nv)
        return hidden.float(), logits.float()
