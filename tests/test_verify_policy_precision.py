"""The adaptive verify policy on an int4 target's cost curve: it verifies fewer drafts than on fp32 for the
same drafter confidence, and skips drafting where it no longer pays on int4 but still does on fp32.

The curves are the T-token forward costs of the Qwen3-0.6B-shape graphs measured on a 2-core Xeon
(issue 25; benchmarks/precision_cost_curves.py measures them on any machine): fp32 stays nearly flat up to
T=16 (memory-bound), int4 turns compute-bound early. Both policies get the same cost model form, fed with
those timings as a round would feed it (learn_cost=False: deterministic decisions)."""

from __future__ import annotations

import math

import pytest
import torch

from retrace.runtime.cost_model import CostModel
from retrace.runtime.verify_policy import AdaptivePolicy

B, V = 16, 32
CURVES = {  # precision -> (seconds of a one-token verify, cost of T tokens relative to T = 1)
    "fp32": (88.3e-3, {1: 1.0, 2: 1.06, 4: 1.14, 8: 1.38, 16: 1.59}),
    "int4": (25.5e-3, {1: 1.0, 2: 1.17, 4: 1.51, 8: 2.23, 16: 3.60}),
}


def _policy(precision: str, draft_rel: float) -> AdaptivePolicy:
    t1, rel = CURVES[precision]
    cost = CostModel()
    for tokens, r in rel.items():
        cost.observe_verify(1, tokens, t1 * r, warm=True)
    cost.observe_draft(1, draft_rel * t1, warm=True)
    return AdaptivePolicy(B, cost, learn_cost=False)


def _confident(p: float) -> torch.Tensor:
    """Draft logits [1, B-1, V] whose top token has probability p at every slot."""
    logits = torch.full((1, B - 1, V), math.log((1 - p) / (V - 1)))
    logits[..., 0] = math.log(p)
    return logits


def _k(policy: AdaptivePolicy, p: float) -> int:
    return int(policy.choose("dflash", _confident(p), torch.zeros(1, B - 1, dtype=torch.int64), [None])[0])


@pytest.mark.parametrize("p", [0.5, 0.7, 0.8])
def test_int4_verifies_fewer_drafts_than_fp32(p):
    k = {precision: _k(_policy(precision, 0.1), p) for precision in CURVES}
    assert 1 <= k["int4"] < k["fp32"], k
    assert k["int4"] <= 5, k  # small widths: a 16-token int4 verify costs 3.6 one-token ones


def test_drafting_is_skipped_on_int4_where_it_still_pays_on_fp32():
    fp32, int4 = _policy("fp32", 0.1), _policy("int4", 0.1)
    for policy in (fp32, int4):
        _k(policy, 0.3)
    assert fp32.state["dflash"].gain > 1.0 and fp32.plan("dflash", 1) == B - 1
    # int4: the best rate is below plain decoding's, so the next rounds make no draft call at all
    assert int4.state["dflash"].off > 0
    assert [int4.plan("dflash", 1) for _ in range(int4.min_backoff)] == [0] * int4.min_backoff
    assert int4.plan("dflash", 1) == int4.width.candidates[-1] == 3  # then a probe drafts again: the narrowest block
