"""The torch backend: the models of `retrace.models` over preallocated per-slot K/V caches."""

from __future__ import annotations

from pathlib import Path

import torch

from retrace.models.drafter import DFlashDrafter, SuffixInputs, load_pair
from retrace.models.target import Qwen3Target
from retrace.runtime.backend import contiguous_range


class KVCache:
    """Per-layer K/V [S, Hkv, L, hd] for S slots; rows are written at absolute positions."""

    def __init__(self, layers: int, slots: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype):
        shape = (slots, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]

    def past(self, slots: torch.Tensor, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rows = contiguous_range(slots)
        if rows is not None:  # the common case: a view, nothing copied
            return [k[rows, :, :length] for k in self.k], [v[rows, :, :length] for v in self.v]
        return [k[slots, :, :length] for k in self.k], [v[slots, :, :length] for v in self.v]

    def write(self, slots: torch.Tensor, positions: torch.Tensor, new_k: list[torch.Tensor],
              new_v: list[torch.Tensor]) -> None:
        rows = slots[:, None]
        for cache, new in zip(self.k + self.v, new_k + new_v, strict=True):
            cache[rows, :, positions] = new.transpose(1, 2).to(cache.dtype)  # [N, T, Hkv, hd] at (slot, position)

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at indices src [N, L] to dst [N, L] of each slot (all read before any is written)."""
        rows = slots[:, None]
        for cache in self.k + self.v:
            cache[rows, :, dst] = cache[rows, :, src]


class TorchBackend:
    name = "torch"

    def __init__(self, target: Qwen3Target, drafter: DFlashDrafter | None, max_batch: int = 8,
                 max_seq_len: int = 2048, threads: int | None = None, device: torch.device | str = "cpu"):
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)  # where the K/V caches live (the models must be there too)
        self.target_model = target
        self.drafter_model = drafter
        self.target_config = target.config
        self.drafter_config = drafter.config if drafter is not None else None
        self.has_conditioner = drafter is not None and drafter.conditioner is not None
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        dtype = target.lm_head.weight.dtype
        tc = target.config.layers
        with self.device:
            self.tcache = KVCache(tc.num_hidden_layers, max_batch, tc.num_key_value_heads, max_seq_len, tc.head_dim,
                                  dtype)
            self.dcache = None
            if drafter is not None:
                dc = drafter.config.layers
                self.dcache = KVCache(dc.num_hidden_layers, max_batch, dc.num_key_value_heads, max_seq_len,
                                      dc.head_dim, drafter.fc.weight.dtype)

    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None, dtype: torch.dtype = torch.float32,
                  **kwargs) -> TorchBackend:
        target, drafter = load_pair(target_dir, drafter_dir, dtype=dtype)
        return cls(target, drafter, **kwargs)

    @torch.inference_mode()
    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        past_len = positions[:, 0]
        pk, pv = self.tcache.past(slots, int(past_len.max()))
        logits, taps, nk, nv = self.target_model(input_ids, positions, pk, pv, past_len, logits_index,
                                                  tree_mask=tree_mask)
        if tree_mask is not None:  # node m's K/V at scratch index positions[:, 0] + m (see commit_path)
            positions = past_len.unsqueeze(1) + torch.arange(input_ids.shape[1], device=positions.device)
        self.tcache.write(slots, positions, nk, nv)
        return logits, taps

    @torch.inference_mode()
    def commit_path(self, slots, src_index, dst_pos):
        self.tcache.move(slots, src_index, dst_pos)

    @torch.inference_mode()
    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix: SuffixInputs | None):
        past_len = ctx_positions[:, 0]
        pk, pv = self.dcache.past(slots, int(past_len.max()))
        dt = self.drafter_model.fc.weight.dtype
        if suffix is not None and suffix.memory.dtype != dt:  # the loop keeps the memory in fp32
            suffix = SuffixInputs(suffix.memory.to(dt), suffix.features.to(dt), suffix.valid.to(dt),
                                  suffix.corr_index)
        hidden, logits, nk, nv = self.drafter_model(ctx_taps.to(dt), ctx_positions,
                                                    pk, pv, past_len, block_ids, block_positions, suffix)
        self.dcache.write(slots, ctx_positions, nk, nv)
        return hidden.float(), logits

    def release(self, slot: int) -> None:
        pass
