"""Top-p (nucleus) filtering without a sort of the vocabulary: with top-k, over its candidates (`top_k_top_p`);
alone on the CPU, as one torch operator, `torch.ops.retrace.top_p_candidates(logits, top_p)` -> the nucleus
as candidates, probabilities and ids [..., C] (runtime/candidates.py); on other devices `by_sort`, the
processed probabilities [..., V]. Either way the smallest prefix of the logits sorted high to low whose mass
reaches top_p is kept (a token is dropped when the mass before it already reaches top_p, transformers' rule),
renormalised.

Why an operator: the plain form sorts every logit of every row, 12 ms a row at Qwen3's 151,936 ids on 2 CPU
cores (a 16-row verify ~100 ms, more than its forward). The CPU kernel sorts only candidates: the row's top 256
by retrace::topk (runtime/topk_op.py), then 4x more until the candidates' mass (in the whole row's softmax)
reaches top_p in every row; the nucleus then lies among them, since every token outside has at least that mass
before it. At most a few candidate rounds, each a check of a host value below the dispatcher (as retrace::argmax's numpy
kernel: not a host read of the round). Other devices (CUDA, where a sort of the vocabulary is cheap and a host
check would synchronise) keep the sort. The same kept tokens either way, ties apart (which of several tokens
tied at the nucleus' edge stays is the sort's order in both).
"""

from __future__ import annotations

import torch

from retrace.runtime.topk_op import topk

FIRST_CANDIDATES = 256
TIE_ROOM = 16  # top-k with top-p: candidates beyond the k-th kept for logits tied with it

_lib = torch.library.Library("retrace", "FRAGMENT")
_lib.define("top_p_candidates(Tensor logits, float top_p) -> (Tensor, Tensor)")


def _sorted_nucleus(vals: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """vals [..., C] logits sorted high to low, probs their probabilities -> vals with the dropped ones -inf."""
    return vals.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))


def by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus from a sort of every logit, as probabilities [..., V] (other devices; the tests' reference)."""
    probs, order = _sort_nucleus(logits, top_p)
    return torch.zeros_like(logits).scatter(-1, order, probs)


def _sort_nucleus(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (probabilities [..., V] in descending order of the logits, that order)."""
    vals, order = torch.sort(logits, dim=-1, descending=True)
    return _sorted_nucleus(vals, vals.softmax(-1), top_p).softmax(-1), order


def nucleus(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus from growing top-k candidates -> (probabilities [..., C], ids [..., C]), C >= the largest
    row's nucleus (the rows' other candidates at probability 0; runtime/candidates.py); C = V sorted where V <=
    FIRST_CANDIDATES."""
    V = logits.shape[-1]
    if V <= FIRST_CANDIDATES:
        return _sort_nucleus(logits, top_p)
    # the row's probabilities from torch's softmax kernel: logsumexp's exp takes CPU torch's slow path where
    # logits sit ~87 below the maximum (a padded vocabulary: 2.8 against 0.1 ms a row)
    p_all = logits.softmax(-1)
    c = FIRST_CANDIDATES
    while True:
        vals, idx = topk(logits, c)
        probs = p_all.gather(-1, idx)
        if c == V or bool((probs.sum(-1) >= top_p).all()):
            break
        c = min(V, 4 * c)
    return _sorted_nucleus(vals, probs, top_p).softmax(-1), idx


def top_k_top_p(logits: torch.Tensor, k: int, top_p: float = 1.0,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p over the top-k's candidates only -> (probabilities [..., C], their ids [..., C]): the
    k largest logits (and up to TIE_ROOM more tied with the k-th, which top-k keeps too), already in descending
    order, so top-p needs no sort of the vocabulary on any device (at 151,936 ids: 4.8 -> ~0.7 ms a row on 2 CPU
    cores), and nothing is scattered back into the vocabulary (runtime/candidates.py). The same distribution as
    top-k's mask followed by the full sort, unless more than TIE_ROOM logits tie with the k-th. `temperature`
    divides the candidates only (the order of the logits is the order of logits / temperature); top_p 1: top-k
    alone."""
    vals, idx = topk(logits, min(logits.shape[-1], k + TIE_ROOM))
    vals = vals / temperature
    vals = vals.masked_fill(vals < vals[..., k - 1: k], float("-inf"))  # top-k: every logit >= the k-th
    if top_p < 1.0:
        vals = _sorted_nucleus(vals, vals.softmax(-1), top_p)
    return vals.softmax(-1), idx


# the CPU kernel (the caller keeps it for the CPU: elsewhere `by_sort`, whose C would be the vocabulary)
_lib.impl("top_p_candidates", nucleus, "CompositeExplicitAutograd")
_lib.impl("top_p_candidates", lambda logits, top_p: (torch.empty_like(logits),  # shapes only: C <= V
                                                      torch.empty_like(logits, dtype=torch.int64)), "Meta")
top_p_candidates = torch.ops.retrace.top_p_candidates.default
