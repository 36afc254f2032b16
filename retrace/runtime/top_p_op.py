"""Top-p (nucleus) filtering as one torch operator, `torch.ops.retrace.top_p(logits, top_p)` -> the processed
probabilities [..., V]: the smallest prefix of the logits sorted high to low whose mass reaches top_p is kept
(a token is dropped when the mass before it already reaches top_p, transformers' rule), renormalised.

Why an operator: the plain form sorts every logit of every row, 12 ms a row at Qwen3's 151,936 ids on 2 CPU
cores (a 16-row verify ~100 ms, more than its forward). The CPU kernel sorts only candidates: the row's top 256
by `torch.topk`, then 4x more until the candidates' mass (in the whole row's softmax) reaches top_p in
every row; the nucleus then lies among them, since every token outside has at least that mass before it. At
most a few candidate rounds, each a check of a host value below the dispatcher (as retrace::argmax's numpy
kernel: not a host read of the round). Other devices (CUDA, where a sort of the vocabulary is cheap and a host
check would synchronise) keep the sort. The same kept tokens either way, ties apart (which of several tokens
tied at the nucleus' edge stays is the sort's order in both).
"""

from __future__ import annotations

import torch

FIRST_CANDIDATES = 256

_lib = torch.library.Library("retrace", "FRAGMENT")
_lib.define("top_p(Tensor logits, float top_p) -> Tensor")


def _sorted_nucleus(vals: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """vals [..., C] logits sorted high to low, probs their probabilities -> vals with the dropped ones -inf."""
    return vals.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))


def by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus from a sort of every logit (other devices; and the reference of the tests)."""
    vals, order = torch.sort(logits, dim=-1, descending=True)
    kept = _sorted_nucleus(vals, vals.softmax(-1), top_p)
    return torch.zeros_like(logits).scatter(-1, order, kept.softmax(-1))


def by_candidates(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus from growing top-k candidates (the CPU kernel)."""
    V = logits.shape[-1]
    if V <= FIRST_CANDIDATES:
        return by_sort(logits, top_p)
    # the row's probabilities from torch's softmax kernel: logsumexp's exp takes CPU torch's slow path where
    # logits sit ~87 below the maximum (a padded vocabulary: 2.8 against 0.1 ms a row)
    p_all = logits.softmax(-1)
    c = FIRST_CANDIDATES
    while True:
        vals, idx = torch.topk(logits, c, dim=-1)
        probs = p_all.gather(-1, idx)
        if c == V or bool((probs.sum(-1) >= top_p).all()):
            break
        c = min(V, 4 * c)
    return torch.zeros_like(logits).scatter(-1, idx, _sorted_nucleus(vals, probs, top_p).softmax(-1))


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return (by_candidates if logits.device.type == "cpu" else by_sort)(logits, top_p)


_lib.impl("top_p", _top_p, "CompositeExplicitAutograd")
_lib.impl("top_p", lambda logits, top_p: torch.empty_like(logits), "Meta")  # shapes only
top_p_probs = torch.ops.retrace.top_p.default
