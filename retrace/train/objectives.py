"""The drafter's training objective: how much each block slot's loss counts (`slot_weights`).

A draft block is accepted up to its first wrong slot, so slot k only matters if slots 1..k-1 were accepted.
With p_j the drafter's probability of slot j's label (its chance to propose the target's token there),

* ``decay`` (DFlash's, the default): a fixed w_k = exp(-(k-1)/gamma), the same for every block.
* ``accept``: w_k = prod_{j<k} p_j (stop-gradient), the drafter's own estimate that slot k is reached. The
  weighted cross-entropy sum_k w_k * -log p_k has the gradient sum_k w_k * d(-log p_k): each slot is trained as
  much as it can still lengthen the accepted prefix (the per-position weights of an expected-accepted-length
  surrogate, in the spirit of D-PACE, arXiv 2605.18810). Slot 1 always weighs 1.
* ``accept-decay``: both factors, exp(-(k-1)/gamma) * prod_{j<k} p_j.
* ``first-error``: prod_{j<k} p_j * (1 - p_k)^2: the reached slots the drafter still gets wrong, a focal loss on
  the block's first error (after arXiv 2606.11552).
* ``accept-overlap``: the ``accept`` weights with p_j the overlap sum_x min(p_j(x), q_j(x)) of the drafter's
  distribution q_j and the slot's label distribution p_j: the probability that slot j is accepted when sampling
  at T=1 (1 - total variation). With soft labels (the target's distribution) that is the T=1 reach; with hard
  labels the overlap is q_j(label), so it equals ``accept``.

Weights are computed without gradient; `blocks.block_loss` normalises the weighted sum by their total.
"""

from __future__ import annotations

import torch

from retrace.train.config import DEFAULT_OBJECTIVE as DEFAULT
from retrace.train.config import OBJECTIVES

FOCAL_POWER = 2.0


def slot_weights(objective: str, decay: torch.Tensor, present: torch.Tensor,
                 label_logp: torch.Tensor | None = None) -> torch.Tensor:
    """decay [B-1] (blocks.loss_weights), present [N, nb, B-1] float (0: no label or a padding block),
    label_logp [N, nb, B-1]: log p of each slot's label (needed by every objective but ``decay``)
    -> weights [N, nb, B-1], no gradient."""
    if objective == "decay":
        return decay.view(1, 1, -1) * present
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown drafter objective {objective!r} (choose from {', '.join(OBJECTIVES)})")
    if label_logp is None:
        raise ValueError(f"objective {objective!r} needs the labels' log-probabilities")
    p = label_logp.detach().float().exp() * present
    reach = torch.cumprod(torch.cat([torch.ones_like(p[..., :1]), p[..., :-1]], dim=-1), dim=-1)
    if objective in ("accept", "accept-overlap"):
        w = reach
    elif objective == "accept-decay":
        w = decay.view(1, 1, -1) * reach
    else:  # first-error
        w = reach * (1.0 - p).clamp_min(0.0) ** FOCAL_POWER
    return w * present


def overlap_logp(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """log sum_x min(p(x), q(x)) over the last dim: drafter logits -> q, target logits -> p (no gradient); the
    probability that a draft sampled from q is accepted against p (the ``accept-overlap`` slot probability)."""
    with torch.no_grad():
        q, p = logits.float().softmax(-1), target_logits.float().softmax(-1)
        return torch.minimum(p, q).sum(-1).clamp_min(1e-30).log()


def expected_accepted(label_logp: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """sum_k prod_{j<=k} p_j per block [N, nb]: the expected number of accepted slots if each slot is accepted
    with the drafter's probability of its label (the quantity the ``accept`` weights follow)."""
    p = label_logp.float().exp() * present
    return torch.cumprod(p, dim=-1).sum(-1)


__all__ = ["OBJECTIVES", "DEFAULT", "slot_weights", "overlap_logp", "expected_accepted"]
