"""Many draft blocks per sequence in one drafter forward (DFlash training attention), and the DFlash loss.

For a sequence with target taps at positions 0..S-1 and anchors p_1..p_nb, block b is
[token(p_b), MASK x (B-1)] at positions p_b..p_b+B-1. In every drafter layer the context K/V
(k_norm(k_proj(ctx)), v_proj(ctx), ctx = hidden_norm(fc(taps))) are computed ONCE per sequence; block b's
queries see the context positions < p_b and the B tokens of block b (bidirectionally); blocks never see
each other. That is exactly what `DFlashDrafter.forward` computes for one block whose context is the
committed prefix, so one forward trains all blocks (tests check the logits are equal).

Optionally each block carries the previous round's rejected suffix (`BlockSuffix`), fused into its input
embeddings by the drafter's ReTrace conditioner exactly as at serving time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrace.models.drafter import DFlashDrafter
from retrace.models.layers import rope_cos_sin
from retrace.train import objectives

IGNORE = -100


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash slot weights w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 -> [B-1]."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """gamma ~7 for B=16; scaled with the block for other sizes."""
    return 7.0 * (block_size - 1) / 15.0


@dataclass
class BlockSuffix:
    """Rejected-suffix inputs per training block (what `SuffixMemory.read` gave the drafter at serving)."""

    memory: torch.Tensor  # [N, nb, B, d]
    features: torch.Tensor  # [N, nb, B, F]
    valid: torch.Tensor  # [N, nb, B] float 0/1
    corr_taps: torch.Tensor  # [N, nb, B, k*d] raw verify taps at the corr_index of each slot (project() applied here)


def block_inputs(seq: torch.Tensor, anchor_pos: torch.Tensor, block_size: int, mask_id: int,
                 lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """seq [N, S] tokens, anchor_pos [N, nb] -> (block ids [N, nb, B], labels [N, nb, B-1]).

    Labels are the sequence's own tokens at p+1..p+B-1 (IGNORE past its length)."""
    N, S = seq.shape
    B = block_size
    lengths = torch.full((N,), S, dtype=torch.long, device=seq.device) if lengths is None else lengths
    ids = torch.full((*anchor_pos.shape, B), mask_id, dtype=torch.long, device=seq.device)
    ids[..., 0] = torch.gather(seq, 1, anchor_pos.clamp(0, S - 1))
    pos = anchor_pos.unsqueeze(-1) + torch.arange(1, B, device=seq.device)  # [N, nb, B-1]
    ok = pos < lengths.view(N, 1, 1)
    lab = torch.gather(seq, 1, pos.clamp_max(S - 1).view(N, -1)).view_as(pos)
    return ids, torch.where(ok, lab, torch.full_like(lab, IGNORE))


def block_forward(drafter: DFlashDrafter, taps: torch.Tensor, anchor_pos: torch.Tensor, block_ids: torch.Tensor,
                  suffix: BlockSuffix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All blocks of N sequences in one forward.

    taps [N, S, k*d] target taps at positions 0..S-1 (right padding is harmless: a block only sees
    positions < its anchor); anchor_pos [N, nb]; block_ids [N, nb, B]; suffix: optional per-block memory.
    Returns (hidden [N, nb, B, d] after the final norm, logits [N, nb, B-1, V] float32)."""
    lc = drafter.config.layers
    N, S = taps.shape[:2]
    nb, B = block_ids.shape[1:]
    dev = taps.device
    ctx = drafter.project(taps.to(drafter.fc.weight.dtype))
    x = drafter.target.embed(block_ids).to(drafter.fc.weight.dtype)  # fp32 residual stream under autocast
    if suffix is not None and drafter.conditioner is not None:
        correction = drafter.project(suffix.corr_taps.to(drafter.fc.weight.dtype))
        x = drafter.conditioner(x, suffix.memory.to(x.dtype), correction.to(x.dtype), suffix.features.to(x.dtype),
                                suffix.valid)
    x = x.reshape(N, nb * B, -1)
    block_pos = (anchor_pos.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(N, nb * B)
    ctx_pos = torch.arange(S, device=dev).expand(N, S)
    cos_c, sin_c = rope_cos_sin(ctx_pos, lc.head_dim, lc.rope_theta, x.dtype)
    cos_b, sin_b = rope_cos_sin(block_pos, lc.head_dim, lc.rope_theta, x.dtype)
    ctx_ok = torch.arange(S, device=dev).view(1, 1, 1, S) < anchor_pos.view(N, nb, 1, 1)  # [N, nb, 1, S]
    ctx_ok = ctx_ok.expand(N, nb, B, S).reshape(N, 1, nb * B, S)
    blk = torch.arange(nb, device=dev).repeat_interleave(B)
    same = (blk.view(-1, 1) == blk.view(1, -1)).expand(N, 1, nb * B, nb * B)
    mask = torch.cat([ctx_ok, same], dim=-1)
    for layer in drafter.layers:
        kc, vc = layer.self_attn.key_value(ctx, cos_c, sin_c)
        x, _, _ = layer(x, cos_b, sin_b, kc, vc, mask)
    h = drafter.norm(x).view(N, nb, B, -1)
    return h, drafter.target.logits(h[:, :, 1:])


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               block_weight: torch.Tensor | None = None,
               target_logits: torch.Tensor | None = None,
               objective: str = objectives.DEFAULT) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy over slots 1..B-1. logits [N, nb, B-1, V], labels [N, nb, B-1] (IGNORE = none),
    weights [B-1], block_weight [N, nb] (0 drops a padding block). With target_logits [N, nb, B-1, V] (the
    target's own distribution for each slot's token) the per-slot loss is KL(target || drafter) instead: soft
    labels that calibrate the drafter's proposal for sampling. `objective` sets the slots' weights
    (retrace.train.objectives; the default: `weights` alone). Returns (loss, sums for logging): `acc_len`
    counts, per block with all labels present, the leading slots whose argmax is the label (the greedy
    accepted length if the labels are the target's greedy continuation)."""
    V = logits.shape[-1]
    if target_logits is None:
        per_slot = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp_min(0), reduction="none")
    else:
        per_slot = F.kl_div(logits.reshape(-1, V).float().log_softmax(-1),
                            target_logits.reshape(-1, V).float().log_softmax(-1), log_target=True,
                            reduction="none").sum(-1)
    per_slot = per_slot.view_as(labels)
    present = (labels != IGNORE).float()
    if block_weight is not None:
        present = present * block_weight.unsqueeze(-1).float()
    label_logp = None
    if objective != objectives.DEFAULT:
        if target_logits is None:
            label_logp = -per_slot.detach()
        elif objective == "accept-overlap":
            label_logp = objectives.overlap_logp(logits, target_logits)
        else:
            label_logp = logits.detach().float().log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1))[..., 0]
    w = objectives.slot_weights(objective, weights, present, label_logp)
    wsum = w.sum()
    loss = (per_slot * w).sum() / wsum.clamp_min(1e-8)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & (present > 0)
        full = (present > 0).all(-1)
        acc_len = correct.long().cumprod(-1).sum(-1)
        stats = {
            "loss_sum": float((per_slot * w).sum()), "weight_sum": float(wsum),
            "acc_len_sum": float(acc_len[full].sum()), "full_blocks": int(full.sum()),
            "top1_slot1": float(correct[..., 0].float().sum()), "slot1_n": float(present[..., 0].sum()),
        }
    return loss, stats


def merge_stats(total: dict, s: dict) -> dict:
    for k, v in s.items():
        total[k] = total.get(k, 0.0) + v
    return total


def summarize(total: dict) -> dict:
    """loss (weighted CE), tau_est (1 + mean greedy accepted length on full blocks), slot-1 top-1."""
    out = {}
    if total.get("weight_sum"):
        out["loss"] = total["loss_sum"] / total["weight_sum"]
    if total.get("full_blocks"):
        out["tau_est"] = 1.0 + total["acc_len_sum"] / total["full_blocks"]
    if total.get("slot1_n"):
        out["top1_slot1"] = total["top1_slot1"] / total["slot1_n"]
    return {k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v) for k, v in out.items()}


class BlockModel(torch.nn.Module):
    """`block_forward` as a module's forward, so DDP / FSDP can wrap the drafter (its trainable parameters;
    the target stays outside, frozen and unwrapped)."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, taps, anchor_pos, block_ids, suffix: BlockSuffix | None = None):
        return block_forward(self.drafter, taps, anchor_pos, block_ids, suffix)
