"""Exactness checks of an inflated pair against the small pair it came from (see retrace.train.inflate)."""

from __future__ import annotations

import torch

from retrace.models.drafter import DFlashDrafter
from retrace.models.target import Qwen3Target
from retrace.train.rollout import make_backend, run_requests


@torch.inference_mode()
def _prefill(target: Qwen3Target, ids: list[int]):
    x = torch.tensor([ids])
    pk, pv = target.empty_past(1)
    logits, _, _, _ = target(x, torch.arange(len(ids)).unsqueeze(0), pk, pv, torch.zeros(1, dtype=torch.long),
                             torch.arange(len(ids)).unsqueeze(0))
    return logits[0]


@torch.inference_mode()
def final_rho_min(target: Qwen3Target, prompts: list[list[int]]) -> float:
    """Smallest rsqrt(mean(x^2) + eps) of the final norm's input over every prompt position."""
    seen: list[float] = []
    norm = target.model.norm

    def hook(_m, args):
        x = args[0].float()
        seen.append(float(torch.rsqrt(x.pow(2).mean(-1) + norm.eps).min()))

    h = norm.register_forward_pre_hook(hook)
    try:
        for p in prompts:
            _prefill(target, p)
    finally:
        h.remove()
    return min(seen)


def logit_parity(small: Qwen3Target, big: Qwen3Target, prompts: list[list[int]]) -> dict:
    """Prefill logits of every prompt position: max |big - small| over real ids relative to max |small|."""
    V = small.config.vocab_size
    worst, scale, margin = 0.0, 0.0, float("inf")
    for p in prompts:
        a, b = _prefill(small, p), _prefill(big, p)
        worst = max(worst, float((b[:, :V] - a).abs().max()))
        scale = max(scale, float(a.abs().max()))
        if b.shape[-1] > V:
            margin = min(margin, float((b[:, :V].max(-1).values - b[:, V:].max(-1).values).min()))
    return {"positions": sum(len(p) for p in prompts), "max_abs_diff": worst, "max_abs_logit": scale,
            "rel_diff": worst / scale, "pad_margin_min": margin}


class MarginBackend:
    """Wraps a backend; records the smallest (best real logit - best padded logit) of every target and
    draft call, i.e. how far below the real ids the padded ids stayed."""

    def __init__(self, inner, vocab: int, keep: int = 0):
        self.inner, self.vocab, self.keep = inner, vocab, keep
        self.margin = {"target": float("inf"), "draft": float("inf")}
        self.kept: list[tuple[str, torch.Tensor]] = []  # the real-id logits of the first `keep` calls

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, kind: str, logits: torch.Tensor) -> None:
        if logits.shape[-1] > self.vocab and logits.numel():
            m = (logits[..., : self.vocab].max(-1).values - logits[..., self.vocab:].max(-1).values).min()
            self.margin[kind] = min(self.margin[kind], float(m))
        if len(self.kept) < self.keep:
            self.kept.append((kind, logits[..., : self.vocab].float().clone()))

    def target(self, slots, input_ids, positions, logits_index):
        logits, taps = self.inner.target(slots, input_ids, positions, logits_index)
        self._note("target", logits)
        return logits, taps

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        hidden, logits = self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        self._note("draft", logits)
        return hidden, logits

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def _backend(target, drafter, prompts, max_new: int, vocab: int, batch: int = 16, keep: int = 0) -> MarginBackend:
    B = drafter.config.block_size
    max_len = max(len(p) for p in prompts) + max_new + B + 2
    return MarginBackend(make_backend(target, drafter, min(batch, len(prompts)), max_len), vocab, keep)


def _call_diff(a: MarginBackend, b: MarginBackend) -> dict:
    """max |big - small| / max |small| over the kept calls' real-id logits, per kind (target / draft)."""
    out = {}
    for kind in ("target", "draft"):
        pairs = [(x, y) for (k, x), (_, y) in zip(a.kept, b.kept, strict=False) if k == kind and x.shape == y.shape]
        if pairs:
            diff = max(float((y - x).abs().max()) for x, y in pairs)
            scale = max(float(x.abs().max()) for x, _ in pairs)
            out[kind] = {"calls": len(pairs), "rel_diff": diff / max(scale, 1e-30)}
    return out


def greedy_identity(small: tuple[Qwen3Target, DFlashDrafter], big: tuple[Qwen3Target, DFlashDrafter],
                    prompts: list[list[int]], max_new: int, keep_calls: int = 64) -> dict:
    """Greedy ar / dflash / retrace outputs and per-round acceptance of both pairs, compared; also the
    real-id logits of the first `keep_calls` target and draft calls (the same calls when outputs agree)."""
    V = small[0].config.vocab_size
    out: dict = {"prompts": len(prompts), "max_new_tokens": max_new, "modes": {}}
    margins = {"target": float("inf"), "draft": float("inf")}
    for mode in ("ar", "dflash", "retrace"):
        res, bes = [], []
        for t, d in (small, big):
            be = _backend(t, d, prompts, max_new, V, keep=keep_calls)
            rolls, _ = run_requests(be, prompts, mode, max_new, 0.0, 0)
            res.append(([r.output_ids for r in rolls], [r.accepted for r in rolls]))
            bes.append(be)
        margins = {k: min(v, bes[1].margin[k]) for k, v in margins.items()}
        (o_s, a_s), (o_b, a_b) = res
        out["modes"][mode] = {"tokens": sum(len(o) for o in o_s), "outputs_identical": o_s == o_b,
                              "acceptance_identical": a_s == a_b, "logits": _call_diff(*bes),
                              "tau": (sum(sum(a) + len(a) for a in a_b) / max(1, sum(len(a) for a in a_b))
                                      if mode != "ar" else None)}
    out["pad_margin_min"] = margins
    out["all_identical"] = all(m["outputs_identical"] and m["acceptance_identical"] for m in out["modes"].values())
    return out


def sampled_padding(big: tuple[Qwen3Target, DFlashDrafter], prompts: list[list[int]], vocab: int,
                    n_tokens: int, max_new: int, mode: str = "ar", batch: int = 64) -> dict:
    """Sample at T=1 until n_tokens tokens came out (the prompts repeated to `batch` rows, a new seed per
    row); count padded ids (>= vocab) among them."""
    rows = (prompts * -(-batch // len(prompts)))[:batch]
    total, padded, seed = 0, 0, 0
    margins = {"target": float("inf"), "draft": float("inf")}
    while total < n_tokens:
        be = _backend(*big, rows, max_new, vocab, batch=batch)
        rolls, _ = run_requests(be, rows, mode, max_new, 1.0, seed)
        outs = [r.output_ids for r in rolls]
        if not any(outs):
            break
        total += sum(len(o) for o in outs)
        padded += sum(t >= vocab for o in outs for t in o)
        margins = {k: min(v, be.margin[k]) for k, v in margins.items()}
        seed += len(rows)
    return {"mode": mode, "temperature": 1.0, "tokens": total, "padded_ids": padded, "pad_margin_min": margins}


__all__ = ["final_rho_min", "logit_parity", "greedy_identity", "sampled_padding"]
