"""Prompt lookup (retrace.runtime.prompt_lookup): drafts copied from a request's own tokens in the rounds the
drafter sits out. The index finds the most recent earlier occurrence of the longest matching tail; the
number verified follows the cost curve; decoding with it stays the target's own greedy decode, on torch
and on ONNX Runtime, and it does find and keep accepted tokens."""

from __future__ import annotations

import pytest
import torch
from export_fixtures import pair_and_bundle
from runtime_fixtures import LinearCost, hf_greedy, load_hf_target

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.verify_policy import AdaptivePolicy

pytestmark = pytest.mark.usefixtures("one_thread")


class _Req:
    def __init__(self, prompt, out=(), slot=0, temperature=0.0):
        self.prompt_ids, self.output_ids, self.slot = list(prompt), list(out), slot
        self.params = SamplingParams(temperature=temperature)


def test_index_finds_the_most_recent_longest_match():
    lk = PromptLookup(max_ngram=3, min_ngram=1, max_tokens=4, max_rows=4)
    r = _Req([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2])
    drafts, lengths = lk.propose([r], 8)
    assert drafts.tolist() == [[3, 7, 8, 1]] and lengths.tolist() == [4]  # "1 2" last seen before "3 7 8"
    r.output_ids = [3]  # the index follows the output incrementally: tail "1 2 3" -> "7 8 1 2"
    assert lk.propose([r], 8)[0].tolist() == [[7, 8, 1, 2]]
    assert lk.propose([r], 2)[0].tolist() == [[7, 8]]
    none = _Req([1, 2, 3, 4], slot=1)
    sampling = _Req([1, 2, 1], slot=2, temperature=1.0)
    drafts, lengths = lk.propose([none, sampling], 8)
    assert lengths.tolist() == [0, 2] and drafts[1].tolist() == [2, 1]  # no earlier occurrence; "1" -> "2 1"
    assert lk._sampling == [False, True]  # a sampling row's lookup is weighed by its own estimate
    assert PromptLookup(max_rows=1).propose([r, none], 8)[1].tolist() == [0, 0]  # rounds of more rows: none
    assert PromptLookup().max_rows == 8  # the default (docs/bench/prompt-lookup.md, 2026-12-06)
    lk.clear(0)
    assert 0 not in lk.index
    with pytest.raises(RetraceError, match="n-gram sizes"):
        PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(RetraceError, match="prior"):
        PromptLookup(prior=(0.0, 0.0))


def test_the_number_verified_follows_the_cost_curve():
    lk = PromptLookup()
    lengths = torch.tensor([4, 2])
    assert lk.choose(lengths, LinearCost(0.0, 1.0)) == 4  # flat: all of it
    assert lk.choose(lengths, LinearCost(5.0, 1.0)) == 0  # steep: a plain step
    assert lk.choose(lengths, None) == 4  # no cost model: all
    lk.observe(torch.tensor([4, 2]), torch.tensor([0, 0]))
    for _ in range(20):
        lk.observe(torch.tensor([4, 2]), torch.tensor([0, 0]))
    assert lk.accept_rate < 0.1 and lk.choose(lengths, LinearCost(0.15, 1.0)) == 0  # it stops when it never hits


def test_acceptance_is_kept_per_matched_ngram_size():
    """A row's proposal is weighed by how often matches of its size were accepted: here 3-token matches
    always, 1-token matches never."""
    lk = PromptLookup(max_rows=2)
    long, short = _Req([4, 5, 6, 7, 8, 4, 5, 6], slot=0), _Req([9, 3, 2, 1, 9], slot=1)
    for _ in range(30):
        drafts, lengths = lk.propose([long, short], 8)
        assert lk._matched == [3, 1] and lengths.tolist() == [5, 4]
        lk.observe([4, 4], [4, 0])
    assert lk.size_rate(3) > 0.9 and lk.size_rate(1) < 0.1 and 0.7 < lk.accept_rate < 0.9  # pooled: 4 hits, 1 miss
    cost = LinearCost(0.1, 1.0)
    lk.propose([long], 8)
    k_long, rate_long = lk.best(torch.tensor([5]), cost)
    lk.propose([short], 8)
    k_short, rate_short = lk.best(torch.tensor([4]), cost)
    assert k_long == 5 and rate_long > 2.5 and (k_short, rate_short) == (0, 1.0)
    assert lk.to_dict()["accept_rate_by_ngram"][3] > 0.9


def test_a_size_priced_out_by_its_mean_is_still_tried_and_corrected():
    """8 rows whose 3-token matches are always accepted, a verify where each row's extra token costs 0.6 of a
    decode: at the prior's mean (0.5) a lookup token never pays, so a lookup weighed by the mean never verifies
    one and never learns otherwise. Weighed by a draw from its posterior it tries, learns the size's real rate and
    then takes nearly every round; the draws come from its own seeded generator (the same choices every run)."""
    reqs = [_Req([4, 5, 6, 7, 8, 4, 5, 6], slot=i) for i in range(8)]
    cost = LinearCost(0.6, 1.0)

    def run(lk):
        ks = []
        for _ in range(60):
            _, lengths = lk.propose(reqs, 8)
            k = lk.choose(lengths, cost)
            if k:
                verified = [min(n, k) for n in lengths.tolist()]
                lk.observe(verified, verified)  # every lookup token accepted
            ks.append(k)
        return ks

    assert run(PromptLookup(max_rows=8, explore=False)) == [0] * 60
    explored = PromptLookup(max_rows=8)
    ks = run(explored)
    assert explored.rounds > 0 and explored.size_rate(3) > 0.9
    assert sum(k > 0 for k in ks[30:]) >= 28  # once corrected, it keeps verifying
    assert run(PromptLookup(max_rows=8)) == ks
    never = PromptLookup(max_rows=8, prior=(0.0, 1.0))  # a zero count (betavariate refuses it): floored
    _, lengths = never.propose(reqs, 8)
    assert never.choose(lengths, cost) == 0


def _never_drafts(block_size):
    """Drafting never pays (a draft costs 50 verifies): after the first probe round the drafter sits out."""
    return AdaptivePolicy(block_size, LinearCost(0.1, 50.0), learn_cost=False)


@pytest.fixture(scope="module")
def pair():
    """The session's pair and bundle (export_fixtures: block 8, max batch 4): repetitive prompts, greedy."""
    built = pair_and_bundle()
    target, drafter = built.target, built.drafter
    g = torch.Generator().manual_seed(1)
    base = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (4, 6, 3)]
    prompts = [b * 3 for b in base]  # repetitive prompts; random tiny targets also loop in their output
    hf = load_hf_target(target)
    return target, drafter, prompts, [hf_greedy(hf, p, 48) for p in prompts], built.bundle


@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_greedy_with_lookup_is_the_targets_own_decode_on_torch(pair, mode):
    target, drafter, prompts, greedy, _ = pair
    rt = Runtime.from_dirs(target, drafter, max_batch=3, max_seq_len=128, verify_policy=_never_drafts(8),
                           prompt_lookup=PromptLookup(max_rows=3))
    res = rt.generate(prompts, SamplingParams(max_new_tokens=48), mode)
    assert [r.token_ids for r in res] == greedy
    st = rt.run_stats()["prompt_lookup"]
    assert st["rounds"] > 0 and st["accepted"] > 0, st
    tokens = sum(len(r.token_ids) for r in res)
    assert rt.run_stats()["rounds"] < tokens  # lookup rounds kept more than one token


def test_lookup_on_onnxruntime_and_sampling_rows(pair):
    *_, prompts, greedy, bundle = pair
    rt = Runtime.from_bundle(bundle, threads=1, verify_policy=_never_drafts(8),
                             prompt_lookup=PromptLookup(max_rows=4))
    out = rt.generate(prompts, SamplingParams(max_new_tokens=48), "retrace")
    assert [r.token_ids for r in out] == greedy
    assert rt.run_stats()["prompt_lookup"]["accepted"] > 0
    sampled = rt.generate(prompts[:2], SamplingParams(max_new_tokens=16, temperature=1.0, seed=3), "dflash")
    assert all(len(r.token_ids) == 16 for r in sampled)


class _Planned:
    """A verify policy stub: plans `slots` draft slots, reports `gain` as its drafting gain."""

    def __init__(self, slots, gain):
        self.slots, self.gain = slots, gain

    def plan(self, mode, rows):
        return self.slots

    def drafting_gain(self, mode):
        return self.gain


def test_lookup_first_takes_the_rounds_it_is_expected_to_commit_faster_in():
    from types import SimpleNamespace

    from retrace.runtime.proposers import LookupFirstPlan, LookupProposer, RoundBatch

    drafter = object()
    lookup = LookupProposer(PromptLookup(explore=False), LinearCost(0.1, 1.0), 8)  # weighed by the mean: 0.5
    hit = RoundBatch.of([SimpleNamespace(**vars(_Req([5, 1, 2, 3, 9, 1, 2])), mode="retrace", anchor=2,
                                         anchor_pos=6)], torch.device("cpu"))
    miss = RoundBatch.of([SimpleNamespace(**vars(_Req([1, 2, 3, 4], slot=1)), mode="retrace", anchor=4, anchor_pos=3)],
                         torch.device("cpu"))
    rate = lookup.gain(hit)  # prior acceptance 0.5, verify 1 + 0.1 (T - 1): K = 2 or 3 pays ~1.5x plain
    assert 1.3 < rate < 1.7
    assert lookup.gain(miss) == 1.0  # no earlier occurrence: nothing beats plain decoding
    for gain, want in ((1.2, lookup), (2.5, drafter), (None, drafter)):
        plan = LookupFirstPlan(_Planned(7, gain), drafter, lookup)
        assert plan.pick(hit) == ((lookup, 0) if want is lookup else (drafter, 7))
        assert plan.pick(miss) == (drafter, 7)
    assert LookupFirstPlan(_Planned(0, 1.2), drafter, lookup).pick(hit) == (lookup, 0)  # the policy's pause
    plan = LookupFirstPlan(_Planned(7, 1.2), drafter, lookup)
    assert plan.pick(SimpleNamespace(mode="ar", rows=1)) == (plan.none, 0)
    lookup.gain(hit)
    p = lookup.propose(hit, 0)  # the offer weighed is the one verified
    assert p.drafts.tolist()[0] == [3, 9, 1, 2, 3, 9, 1][: p.drafts.shape[1]] and p.drafts.shape[1] >= 1
    assert lookup._offer is None


@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_greedy_with_lookup_first_is_the_targets_own_decode(pair, mode):
    """Rounds where the policy planned a draft call and the lookup took them, and drafted rounds, in one
    generate (free drafts and a flat verify here: drafting never pauses, a lookup with a match pays more than
    this random drafter), batch 1 and 3: the target's own greedy decode."""
    target, drafter, prompts, greedy, _ = pair
    rt = Runtime.from_dirs(target, drafter, max_batch=3, max_seq_len=128,
                           verify_policy=AdaptivePolicy(8, LinearCost(0.0, 0.0), learn_cost=False),
                           prompt_lookup=PromptLookup(max_rows=3, first=True))
    plan = rt.scheduler().plan
    picks = _recording(plan)
    for batch in (prompts[:1], prompts):
        res = rt.generate(batch, SamplingParams(max_new_tokens=48), mode)
        assert [r.token_ids for r in res] == greedy[: len(batch)]
    assert (plan.lookup, True) in picks and (plan.drafter, True) in picks, picks
    assert rt.run_stats()["prompt_lookup"]["first"] is True and rt.run_stats()["prompt_lookup"]["explore"] is True


def _recording(plan) -> list:
    """plan.pick and plan.policy.plan wrapped: [(the proposer picked, whether the policy planned a draft call)]."""
    picks, planned = [], []
    pick, policy_plan = plan.pick, plan.policy.plan

    def plan_slots(mode, rows):
        planned.append(policy_plan(mode, rows))
        return planned[-1]

    def rec(batch):
        planned.clear()
        proposer, slots = pick(batch)
        picks.append((proposer, bool(planned and planned[-1] > 0)))
        return proposer, slots

    plan.pick, plan.policy.plan = rec, plan_slots
    return picks
