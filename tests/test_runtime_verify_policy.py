"""The verify policy's parts: calibration (confidence -> acceptance), cost model, the choice of K and the
auto-off / re-probe of the draft call (retrace/runtime/{calibration,cost_model,verify_policy}.py).
Losslessness with the policy is checked in test_runtime_greedy.py, test_runtime_sampling.py and
test_runtime_suffix_memory.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from runtime_fixtures import LinearCost

from retrace.runtime.calibration import Calibration
from retrace.runtime.cost_model import CostModel
from retrace.runtime.verify_policy import AdaptivePolicy, FixedPolicy, draft_confidence


def test_calibration_counts_slots_up_to_the_first_rejection():
    cal = Calibration(bins=4, prior_weight=0.0 + 1e-9)
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1], [0.6, 0.6, 0.6, 0.6]])
    # row 0: K=4, a=2 -> slots 1,2 accepted, 3 rejected, 4 unseen; row 1: K=1, a=1 -> slot 1 accepted;
    # row 2: K=0 -> nothing judged
    cal.observe(conf, torch.tensor([4, 1, 0]), torch.tensor([2, 1, 0]))
    assert cal.trials.round().tolist() == [1, 0, 0, 3]
    assert cal.hits.round().tolist() == [1, 0, 0, 2]
    assert float(cal.prob(torch.tensor([0.95]))) == pytest.approx(2 / 3)


def test_calibration_prior_is_the_identity_and_learns():
    cal = Calibration(bins=10)
    assert float(cal.prob(torch.tensor([0.95]))) == pytest.approx(0.95)
    for _ in range(200):  # a drafter that is confident and always wrong
        cal.observe(torch.tensor([[0.95, 0.95]]), torch.tensor([2]), torch.tensor([0]))
    assert float(cal.prob(torch.tensor([0.95]))) < 0.05


def test_cost_model_does_not_learn_a_shape_s_first_call():
    """The first call at a new shape pays one-off costs (memory planning, a compile, a graph capture): it is not
    learned, the bucket's second call seeds it; `warm=True` (a probe that warmed up) learns at once."""
    cm = CostModel(rel_slope=0.0, base_s=1.0)
    cm.observe_verify(4, 2, 100.0)  # a compile
    assert cm.verify(4, 2) == pytest.approx(1.0)  # still the prior
    cm.observe_verify(4, 2, 0.2)
    assert cm.verify(4, 2) == pytest.approx(0.2)
    cm.observe_draft(4, 50.0, 3)
    cm.observe_draft(4, 0.1, 3)
    assert cm.draft(4, 3) == pytest.approx(0.1)
    cm.observe_verify(4, 3, 0.3, warm=True)
    assert cm.verify(4, 3) == pytest.approx(0.3)


def test_one_slow_round_does_not_price_a_width_out_for_good():
    """A verify bucket seeded by one slow round (another process, a page fault) was priced high for good: a
    width priced out is never called again. Until 3 rounds timed it, it is priced at the lowest of its timings
    and what the row count's other widths say for it, then seeded with the median of the three; a width that
    really costs more is confirmed as such. Warm (probed) timings count at once."""
    cm = CostModel()
    for t in (1, 2, 4):
        cm.observe_verify(1, t, 1.0 + 0.1 * (t - 1), warm=True)
    cm.observe_verify(1, 3, 9.0)  # the shape's first call: not learned
    cm.observe_verify(1, 3, 5.0)  # a slow round seeds it
    assert cm.verify(1, 3) == pytest.approx(1.2)  # what widths 2 and 4 say
    cm.observe_verify(1, 3, 1.25)
    assert cm.verify(1, 3) == pytest.approx(1.2)
    cm.observe_verify(1, 3, 1.22)
    assert cm.verify(1, 3) == pytest.approx(1.25)  # confirmed: the median of 5.0, 1.25, 1.22
    cm.observe_verify(1, 3, 1.2)
    assert cm.verify(1, 3) == pytest.approx(1.25 + 0.2 * (1.2 - 1.25))  # then the EMA
    for s in (0.0, 3.0, 3.2, 2.9):  # a width that does cost more (its first call not learned)
        cm.observe_verify(1, 8, s)
    assert cm.verify(1, 8) == pytest.approx(3.0)
    cm.observe_verify(2, 1, 2.0)
    cm.observe_verify(2, 1, 2.5)  # nothing else timed at 2 rows: its own timing
    assert cm.verify(2, 1) == pytest.approx(2.5)
    cm.observe_verify(2, 4, 9.0, warm=True)
    assert cm.verify(2, 4) == pytest.approx(9.0)  # warm: trusted at once
    for s in (0.0, 0.45, 0.3, 0.31, 0.32):  # draft widths too: 15 slots timed (confirmed), 7 seeded slow
        cm.observe_draft(1, s, 15)
    assert cm.draft(1, 15) == pytest.approx(0.31 + 0.2 * (0.32 - 0.31))
    for s in (0.0, 5.0):
        cm.observe_draft(1, s, 7)
    assert cm.draft(1, 7) == pytest.approx(cm.draft(1, 15) * cm._width_scale(7, 15))  # 15's, scaled
    one = CostModel(confirm=1)  # the rule before: one timing seeds the bucket
    one.observe_verify(1, 1, 1.0, warm=True)
    for s in (9.0, 5.0):
        one.observe_verify(1, 3, s)
    assert one.verify(1, 3) == pytest.approx(5.0)


def test_cost_model_draft_prior_scales_with_the_block_width():
    """Nothing drafted timed yet: `draft_rel` of a one-token verify is the whole block's draft; a narrower
    block's prior is scaled by (DRAFT_WIDTH_BASE + width) as timed widths are."""
    from retrace.runtime.cost_model import DRAFT_WIDTH_BASE as W0

    cm = CostModel(base_s=1.0, draft_rel=0.5, block_size=16)
    assert cm.draft(4, 15) == pytest.approx(0.5) and cm.draft(4) == pytest.approx(0.5)
    assert cm.draft(4, 3) == pytest.approx(0.5 * (W0 + 4) / (W0 + 16))


def test_cost_model_buckets_interpolation_and_prior_slope():
    cm = CostModel(rel_slope=0.1, base_s=2.0)
    assert cm.verify(1, 3) == pytest.approx(2.0 * 1.2)  # nothing measured: the prior
    cm.observe_verify(2, 1, 1.0, warm=True)
    assert cm.verify(2, 3) == pytest.approx(1.0 * (1 + 0.2 * 2))  # prior slope scaled to the measurement
    assert cm.verify(4, 1) == pytest.approx(1.0)  # an unmeasured row count borrows the nearest
    cm.observe_verify(2, 5, 3.0, warm=True)
    assert cm.verify(2, 3) == pytest.approx(2.0)  # piecewise linear between measured token counts
    assert cm.verify(2, 7) == pytest.approx(4.0)  # past the last: the measured slope
    cm.observe_verify(2, 5, 4.0, warm=True)
    assert cm.verify(2, 5) == pytest.approx(3.0 + 0.2 * 1.0)  # EMA
    assert cm.draft(2) == pytest.approx(0.5 * 1.0)  # prior: half a one-token verify
    cm.observe_draft(2, 0.25, warm=True)
    assert cm.draft(2) == pytest.approx(0.25)


def best_k_brute_force(p: torch.Tensor, cost: LinearCost) -> int:
    """argmax over shared K of (N + sum_i sum_{k<=K} prod_{j<=k} p_ij) / (t_draft + t_verify(N, K+1))."""
    N, S = p.shape
    rates = []
    for K in range(S + 1):
        tokens = N + sum(float(p[i, :k].prod()) for i in range(N) for k in range(1, K + 1))
        rates.append(tokens / (cost.draft(N) + cost.verify(N, K + 1)))
    return max(range(S + 1), key=lambda k: (rates[k], -k))


@pytest.mark.parametrize("slope", [0.02, 0.15, 0.6])
def test_adaptive_choice_maximises_expected_tokens_per_second(slope):
    """Calibration = identity (the prior): p = confidence. The chosen K is the brute-force optimum."""
    cost = LinearCost(slope, 0.05)
    g = torch.Generator().manual_seed(int(slope * 100))
    for N in (1, 3):
        policy = AdaptivePolicy(8, cost, learn_cost=False)
        conf = torch.rand(N, 7, generator=g) ** 0.3
        logits = torch.log(torch.stack([conf, 1 - conf], -1))  # greedy: confidence max(conf, 1 - conf)
        K = policy.choose("dflash", logits, logits.argmax(-1), [None] * N)
        p = policy.calib[("dflash", True)].prob(draft_confidence(logits, [None] * N))
        assert K.tolist() == [best_k_brute_force(p, cost)] * N


def test_ragged_choice_is_per_row_and_never_longer_than_shared():
    cost = LinearCost(0.15, 0.02)
    logits = torch.zeros(2, 7, 50)  # row 1: uniform, confidence 0.02
    logits[0, :, 3] = 10.0  # row 0: confidence 0.99
    chosen = {}
    for ragged in (False, True):
        policy = AdaptivePolicy(8, cost, ragged=ragged, learn_cost=False)
        for _ in range(2):  # the first drafted round is a probe (K >= 1 for every row)
            chosen[ragged] = policy.choose("dflash", logits, logits.argmax(-1), [None] * 2)
    shared, ragged = chosen[False], chosen[True]
    assert shared[0] == shared[1] > 0
    assert ragged[0] > 0 and ragged[1] == 0 and int(ragged.max()) <= 7


def test_sampling_confidence_ignores_the_sampled_token():
    """A K that depends on the sampled drafts would bias speculative sampling: max q, not q(d)."""
    q = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    logits = torch.zeros(2, 2, 3)
    conf = draft_confidence(logits, [None, q])
    assert conf[0].tolist() == pytest.approx([1 / 3, 1 / 3])
    assert conf[1].tolist() == pytest.approx([0.7, 0.6])


def test_drafting_turns_off_backs_off_and_comes_back():
    cost = LinearCost(0.1, 0.5)  # a draft costs half a decode
    policy = AdaptivePolicy(4, cost, min_backoff=2, max_backoff=8, learn_cost=False)
    hopeless = torch.log(torch.tensor([[[0.45, 0.55]] * 3]))  # confidence 0.55, always wrong
    plans, ks = [], []
    for _ in range(60):
        S = policy.plan("dflash", 1)
        plans.append(S)
        if S:
            K = policy.choose("dflash", hopeless, hopeless.argmax(-1), [None])
            ks.append(int(K[0]))
            policy.observe("dflash", 1, int(K.max()) + 1, 1.0, 0.5, K, torch.zeros(1, dtype=torch.int64))
    drafted = [i for i, s in enumerate(plans) if s]
    gaps = [b - a - 1 for a, b in itertools.pairwise(drafted)]
    gaps = gaps[next(i for i, g in enumerate(gaps) if g):]  # once the calibration has learnt it is wrong
    assert gaps[:3] == [2, 4, 8] and set(gaps[3:]) == {8}, gaps  # exponential backoff, capped
    assert ks[-4:] == [1] * 4  # a probe judges one draft even when it expects nothing from it
    # the drafter becomes confident (and right): the next probe pays and drafting stays on
    good = torch.log(torch.tensor([[[0.01, 0.99]] * 3]))
    while not policy.plan("dflash", 1):
        pass
    for _ in range(30):
        K = policy.choose("dflash", good, good.argmax(-1), [None])
        policy.observe("dflash", 1, int(K.max()) + 1, 1.0, 0.5, K, K.clone())
        assert policy.plan("dflash", 1) > 0  # drafting stays on (the width: the whole block, or exploring)
    assert int(K[0]) == 3


def test_a_probe_after_a_pause_drafts_the_narrowest_block():
    """The first drafted round drafts the whole block (every slot's acceptance gets counted); once drafting
    paused, the probe that ends the pause drafts the narrowest block (the cheapest re-measure: at batch 4 the
    whole block can cost a decode step and so never pay, while a narrow one would), and the rounds after it
    choose their width again."""
    cost = LinearCost(0.1, 1.2)  # a whole-block draft costs more than a decode: the first rounds cannot pay
    policy = AdaptivePolicy(16, cost, min_backoff=2, max_backoff=8, learn_cost=False)
    wrong = torch.log(torch.tensor([[[0.45, 0.55]] * 15]))
    assert policy.plan("retrace", 4) == 15
    policy.choose("retrace", wrong, wrong.argmax(-1), [None])
    assert policy.plan("retrace", 4) == 0  # paused
    plans = [policy.plan("retrace", 4) for _ in range(2)]
    assert plans == [0, 3], plans  # the backoff's rounds, then the narrowest block (slots 3 of 15, 7)
    good = torch.log(torch.tensor([[[0.01, 0.99]] * 3]))
    policy.choose("retrace", good, good.argmax(-1), [None])
    assert policy.plan("retrace", 4) in policy.width.candidates  # drafting on, its width chosen again


def test_fixed_policy_is_the_whole_block():
    p = FixedPolicy(16)
    assert p.plan("retrace", 5) == 15
    assert p.choose("retrace", torch.zeros(5, 15, 3), torch.zeros(5, 15, dtype=torch.int64),
                    [None] * 5).tolist() == [15] * 5


def test_draft_width_is_the_cheapest_rate_and_explores():
    """runtime/draft_width.py: with draft calls as dear as the block is wide and drafts past the first rarely
    accepted, the narrow block wins; with the draft's cost flat in the width, the whole block; a narrower
    block's own counts are what judge it (a drafter worse in a narrow block is moved off it); every 16th
    choice drafts a neighbour of the best width."""
    from retrace.runtime.cost_model import CostModel
    from retrace.runtime.draft_width import DraftWidth

    def counts(width: DraftWidth, slots: int, accepted: list[int], rounds: int = 40) -> None:
        for _ in range(rounds):
            width.observe("retrace", slots, torch.full((len(accepted),), slots), torch.tensor(accepted))
        width.absorb("retrace", width.pending("retrace").tolist())

    cost = CostModel()
    for t in (1, 2, 4, 8, 16):
        cost.observe_verify(1, t, 1.0 + 0.1 * (t - 1), warm=True)
    cost.observe_draft(1, 0.6, 15, warm=True)  # widths 7 and 3 scaled from it: 0.4 and 0.3
    w = DraftWidth(16)
    assert w.candidates == [15, 7, 3] and w.choose("retrace", 1, cost) == 15  # nothing drafted yet
    counts(w, 15, [1, 0, 0, 2])  # a draft or two at most
    assert [w.choose("retrace", 1, cost) for _ in range(15)] == [3] * 15 and w.choose("retrace", 1, cost) == 7
    counts(w, 3, [0, 0, 0, 0])  # but the narrow block's own drafts are never accepted
    assert w.choose("retrace", 1, cost) != 3
    flat = CostModel()
    for t in (1, 2, 4, 8, 16):
        flat.observe_verify(1, t, 1.0 + 0.1 * (t - 1), warm=True)
    for S in (15, 7, 3):
        flat.observe_draft(1, 0.6, S, warm=True)
    w2 = DraftWidth(16)
    counts(w2, 15, [1, 0, 0, 2])
    assert [w2.choose("retrace", 1, flat) for _ in range(16)] == [15] * 15 + [7]
