"""Sampling parameters, logit processing and lossless acceptance (greedy and speculative sampling).

A minimum length (``min_tokens``) masks the EOS logits of every position that would produce a token
before the minimum, in the target's logits (prefill and verify) before acceptance, exactly as
transformers' ``min_new_tokens`` does, so the output stays the target's own (EOS-suppressed) decode.

Greedy (T=0): accept the longest prefix with d_k == argmax p_{k-1}; the bonus is argmax p_a.
Sampling (T>0): drafts are sampled from the drafter's processed distribution q_k; d_k is accepted with
probability min(1, p(d_k)/q(d_k)); at the first rejection the bonus is sampled from norm(max(0, p - q)),
after a full accept from p_K (Leviathan et al. 2022). p and q go through the same temperature / top-k /
top-p processing, so the output distribution is exactly the target's processed sampling distribution.
"""

from __future__ import annotations

import torch

from retrace.runtime.argmax_op import argmax as argmax_op
from retrace.runtime.candidates import Candidates, sample_index  # noqa: F401 (sample_index re-exported)
from retrace.runtime.device import to_device
from retrace.runtime.sampling_params import SamplingParams  # re-exported (defined without torch)
from retrace.runtime.top_p_op import by_sort, top_k_top_p, top_p_candidates


def processed(logits: torch.Tensor, params: SamplingParams) -> Candidates:
    """Temperature, then top-k, then top-p (transformers' order) -> the distribution over [..., V] logits as
    its candidates (runtime/candidates.py): with top-k, the top-k's ids only (the temperature divides those
    alone, runtime/top_p_op.py); top-p alone on the CPU, the candidates its kernel grew until they held the
    nucleus; otherwise the dense form (float32; on CUDA top-p sorts the vocabulary)."""
    if params.top_k and params.top_k < logits.shape[-1]:
        return Candidates(*top_k_top_p(logits.float(), params.top_k, params.top_p, params.temperature))
    logits = logits.float() / params.temperature
    if params.top_p < 1.0 and logits.device.type == "cpu":
        return Candidates(*top_p_candidates(logits, params.top_p))  # runtime/top_p_op.py: no full sort
    if params.top_p < 1.0:
        return Candidates(by_sort(logits, params.top_p))
    return Candidates(logits.softmax(-1))


def unsampleable(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., V] -> bool [...]: the rows that are no distribution (a non-finite entry, or no mass), which
    no sampler can draw from. One reduction per row: the check costs one sum, not one pass per element."""
    mass = probs.sum(-1)
    return ~(torch.isfinite(mass) & (mass > 0))


def guard_rows(dist: Candidates) -> tuple[Candidates, torch.Tensor]:
    """dist [N, ..., C] -> (dist with every unsampleable row replaced by a one-hot on token 0, so the
    round can go on for its batch-mates; bad [N] bool, which rows those were), on the device: no read (the
    round's one read brings `bad` back, runtime/round_outcome.py)."""
    probs = dist.probs
    N, C = probs.shape[0], probs.shape[-1]
    bad = unsampleable(probs).reshape(N, -1).any(-1)
    hot = torch.zeros(C, dtype=probs.dtype, device=probs.device)
    hot[0] = 1.0  # the first candidate, whose id becomes 0
    at = bad.view(N, *[1] * (probs.dim() - 1))
    return Candidates(torch.where(at, hot, probs), None if dist.ids is None else torch.where(at, 0, dist.ids)), bad


def unsampleable_error(params: SamplingParams) -> str:
    """Why a request whose distribution could not be sampled failed (it fails alone, at its commit)."""
    return (f"the sampling distribution of this request cannot be sampled (non-finite probabilities at "
            f"temperature {params.temperature:g}, top_k {params.top_k}, top_p {params.top_p:g})")


def flag_errors(reqs: list, bad: list) -> None:
    """After a read: each request whose flag in `bad` is set gets its error; every pending flag is cleared."""
    for r, b in zip(reqs, bad, strict=True):
        if b and r.error is None:
            r.error = unsampleable_error(r.params)
        r.unsampleable = None


def pending_flags(reqs: list, device) -> torch.Tensor | None:
    """[N] bool: the requests' pending unsampleable flags (row_probs), None when no row has one (known on the
    host: greedy rounds build nothing)."""
    if all(getattr(r, "unsampleable", None) is None for r in reqs):
        return None
    none = torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([none if r.unsampleable is None else r.unsampleable for r in reqs])


def mask_early_eos(logits: torch.Tensor, produced: list[int], min_tokens: list[int],
                   eos_ids: set[int] | tuple[int, ...], offsets: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, T, V]; position j of row i scores new token produced[i] + offsets[i, j] (default j; a
    tree's node depth). EOS logits become -inf where that token would come before min_tokens[i] (a copy;
    the input itself when nothing is masked)."""
    if not eos_ids or all(m <= n for m, n in zip(min_tokens, produced, strict=True)):
        return logits  # the common case, checked without tensors: every round calls this
    dev = logits.device
    need = to_device([m - n for m, n in zip(min_tokens, produced, strict=True)], dev)  # before EOS may come
    at = torch.arange(logits.shape[1], device=dev).unsqueeze(0) if offsets is None else offsets
    early = at < need.unsqueeze(1)  # [N, T]
    eos = to_device(sorted(eos_ids), dev)
    out = logits.clone()
    out[..., eos] = out[..., eos].masked_fill(early.unsqueeze(-1), float("-inf"))
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximal index on ties, as `max(-1).indices`): one operator whose
    CPU kernel is numpy's vectorised argmax (runtime/argmax_op.py: 10-14x faster than torch's there)."""
    return argmax_op(logits)


def greedy_accept(verify_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_logits [N, K+1, V], drafts [N, K] -> (accepted a [N], bonus [N], target argmax [N, K+1])."""
    post = argmax(verify_logits)
    if not drafts.shape[1]:  # plain decoding (ar, a round the policy sent no drafts): the bonus is all
        return torch.zeros(drafts.shape[0], dtype=torch.int64, device=post.device), post[:, 0].clone(), post
    match = (drafts == post[:, :-1]).to(torch.int64)
    a = match.cumprod(dim=1).sum(dim=1)
    bonus = post.gather(1, a.unsqueeze(1)).squeeze(1)
    return a, bonus, post


def speculative_accept(p: Candidates | torch.Tensor, q: Candidates | torch.Tensor | None, drafts: torch.Tensor,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One row. p [K+1] rows of the target's processed distribution, q [K] rows of the proposal's, over target
    ids (runtime/candidates.py, or dense [.., V] tensors; q None: each draft a point mass, q(d) = 1: prompt
    lookup's copied tokens), drafts [K] -> (accepted a, bonus token), 0-dim tensors on p's device (no read
    back: the loop reads the round once). Every pass is over p's candidates: max(0, p - q) is 0 wherever p is."""
    p, q = Candidates.of(p), None if q is None else Candidates.of(q)
    dev, K = p.probs.device, drafts.shape[0]
    if not K:
        return torch.zeros((), dtype=torch.int64, device=dev), p[0].sample(gen)
    p_d = p[:K].prob(drafts)
    q_d = q[:K].prob(drafts) if q is not None else torch.ones_like(p_d)
    u = torch.rand(K, generator=gen, device=dev)
    a = (u * q_d <= p_d).to(torch.int64).cumprod(0).sum()
    # rejected at slot a < K: norm(max(0, p_a - q_a)) (p_a where that is all zero); all accepted: p_K
    pa = p[a]
    if q is None:  # q_a: the point mass at d_a (none after the last draft)
        d_a, on = torch.cat([drafts, drafts[:1]])[a], (a < K).to(pa.probs.dtype)
        q_at = (torch.zeros_like(pa.probs).scatter(0, d_a.view(1), on.view(1)) if pa.ids is None
                else (pa.ids == d_a).to(pa.probs.dtype) * on)
    else:
        q_a = Candidates(torch.cat([q.probs[:K], torch.zeros_like(q.probs[:1])])[a],
                         None if q.ids is None else torch.cat([q.ids[:K], q.ids[:1]])[a])
        q_at = q_a.on(pa.ids, pa.probs.shape[-1])
    residual = (pa.probs - q_at).clamp_min(0)
    total = residual.sum()
    dist = torch.where((a < K) & (total > 0), residual / total.clamp_min(1e-30), pa.probs)
    return a, Candidates(dist, pa.ids).sample(gen)


def row_probs(logits: torch.Tensor, reqs: list) -> list[Candidates | None]:
    """processed(logits[i], params of row i) for the sampling rows, None for greedy rows; one call
    per distinct (temperature, top_k, top_p) rather than one per row. A row that is no distribution gets
    a one-hot in its place and its request a pending flag (`r.unsampleable`, a device bool), which the
    round's read turns into the request's `error` (`flag_errors`)."""
    out: list[torch.Tensor | None] = [None] * len(reqs)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        if not r.params.greedy:
            groups.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(i)
    for rows in groups.values():
        # consecutive rows (every row of a batch of one setting) as a view: a list index copies [rows, T, V]
        pick = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows
        probs, bad = guard_rows(processed(logits[pick], reqs[rows[0]].params))
        for j, i in enumerate(rows):
            out[i] = probs[j]
            r = reqs[i]
            r.unsampleable = bad[j] if getattr(r, "unsampleable", None) is None else r.unsampleable | bad[j]
    return out
