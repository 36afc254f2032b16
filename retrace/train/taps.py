"""The frozen target's side of drafter training: load it with its taps, and the taps [S, k*d] (the hidden states
of the drafter's tap layers, concatenated) of whole sequences, batched with right padding."""

from __future__ import annotations

from pathlib import Path

import torch

from retrace.models.target import Qwen3Target


def load_target(target_dir: str | Path, tap_layers, device: torch.device, bf16: bool) -> Qwen3Target:
    dtype = torch.bfloat16 if (bf16 and device.type == "cuda") else torch.float32
    return Qwen3Target.from_pretrained(target_dir, tap_layers=tuple(tap_layers), dtype=dtype, device=device)


@torch.no_grad()
def compute_taps(target: Qwen3Target, seqs: list[list[int]], batch: int, device: torch.device,
                 store_dtype=torch.float16, keep_device: bool = False) -> list[torch.Tensor]:
    """Clean target taps [L, k*d] per sequence (one causal forward each, batched with right padding)."""
    out: list[torch.Tensor] = []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: dict[int, torch.Tensor] = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        ids, lengths = pad_tokens([seqs[i] for i in idx], device)
        taps = target_taps(target, ids)
        for j, i in enumerate(idx):
            t = taps[j, : lengths[j]].to(store_dtype)
            res[i] = t if keep_device else t.cpu()
    out = [res[i] for i in range(len(seqs))]
    return out


def target_taps(target: Qwen3Target, ids: torch.Tensor, logits_at: torch.Tensor | None = None):
    """Taps [N, S, k*d] of one causal forward; with logits_at [N, K] also the logits there, as (taps, logits)."""
    N, S = ids.shape
    pk, pv = target.empty_past(N)
    pk = [t.to(ids.device) for t in pk]
    pv = [t.to(ids.device) for t in pv]
    index = logits_at if logits_at is not None else torch.zeros(N, 1, dtype=torch.long, device=ids.device)
    logits, taps, _, _ = target(ids, torch.arange(S, device=ids.device).expand(N, S), pk, pv,
                                torch.zeros(N, dtype=torch.long, device=ids.device), logits_index=index)
    return (taps, logits) if logits_at is not None else taps


def pad_tokens(seqs: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids.to(device), [len(s) for s in seqs]


def pad_taps(taps: list[torch.Tensor], device, dtype=torch.float32) -> torch.Tensor:
    S = max(t.shape[0] for t in taps)
    out = torch.zeros(len(taps), S, taps[0].shape[-1], dtype=dtype, device=device)
    for i, t in enumerate(taps):
        out[i, : t.shape[0]] = t.to(device=device, dtype=dtype)
    return out


__all__ = ["load_target", "compute_taps", "target_taps", "pad_tokens", "pad_taps"]
