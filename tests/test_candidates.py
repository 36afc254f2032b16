"""A processed distribution kept as its candidates (runtime/candidates.py): the same distribution as the dense
[..., V] form, and speculative sampling over it the same law as over the dense rows."""

from collections import Counter

import pytest
import torch

from retrace.runtime.candidates import Candidates
from retrace.runtime.draft_space import DraftSpace
from retrace.runtime.sampling import SamplingParams, guard_rows, processed, speculative_accept

V = 50


def _reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k's mask, top-p over a full sort: the textbook dense form."""
    x = logits.float() / params.temperature
    if params.top_k:
        x = x.masked_fill(x < x.topk(params.top_k).values[..., -1:], float("-inf"))
    if params.top_p < 1.0:
        vals, order = x.sort(-1, descending=True)
        p = vals.softmax(-1)
        vals = vals.masked_fill(p.cumsum(-1) - p >= params.top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, vals)
    return x.softmax(-1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_k=9, top_p=0.8),
                                    SamplingParams(temperature=0.9, top_p=0.7), SamplingParams(temperature=1.0)],
                         ids=["top-k", "top-k-top-p", "top-p", "temperature"])
def test_processed_is_the_dense_distribution(params):
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0)) * 2
    c = processed(logits, params)
    want = _reference(logits, params)
    assert (c.ids is None) == (not params.top_k and params.top_p == 1.0)  # temperature alone: the dense form
    assert torch.allclose(c.dense(V), want, atol=1e-6)
    tok = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(c.prob(tok), want.gather(-1, tok.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    ids = torch.randint(0, V, (3, 4, 7), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(c.on(ids, V), want.gather(-1, ids), atol=1e-6)
    assert torch.allclose(c.top(), want.amax(-1), atol=1e-6)
    assert torch.equal(c[1].dense(V), c.dense(V)[1]) and torch.equal(c[:, 2:].dense(V), c.dense(V)[:, 2:])


def test_a_wide_nucleus_is_looked_up():
    """top-p alone over flat logits: tens of thousands of candidates, looked up at thousands of ids."""
    big = 40000
    logits = torch.randn(2, big, generator=torch.Generator().manual_seed(9)) * 0.05
    params = SamplingParams(temperature=1.0, top_p=0.99)
    c = processed(logits, params)
    assert c.ids.shape[-1] >= 16384
    want = _reference(logits, params)
    ids = torch.randint(0, big, (2, 3000), generator=torch.Generator().manual_seed(10))
    assert torch.allclose(c.on(ids, big), want.gather(-1, ids), atol=1e-7)
    assert torch.allclose(c.dense(big), want, atol=1e-7)


def test_sample_draws_the_distribution_and_never_a_dropped_candidate():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    c = processed(logits, SamplingParams(temperature=1.0, top_k=6, top_p=0.9))
    gen = torch.Generator().manual_seed(4)
    n = 30000
    counts = Counter(int(c.sample(gen)) for _ in range(n))
    want = c.dense(V)
    assert all(want[t] > 0 for t in counts)
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - float(want[t])) for t in range(V))
    assert tv < 0.02, tv


def test_draft_space_maps_candidates_to_target_ids():
    ids = torch.tensor([1, 4, 6, 9, 20, 33, 41, 48])
    space = DraftSpace(ids, V)
    logits = torch.randn(2, len(ids), generator=torch.Generator().manual_seed(5))
    for params in (SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=0.8)):
        q = processed(logits, params)
        assert torch.allclose(space.to_target(q).dense(V), space.probs_full(q.dense(len(ids))), atol=1e-7)


def _joint(p, q, drafts, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return Counter(tuple(int(x) for x in speculative_accept(p, q, drafts, gen)) for _ in range(n))


@pytest.mark.parametrize("proposal", ["drafter", "point-mass"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=5, top_p=0.95),
                                    SamplingParams(temperature=0.5, top_p=0.9)], ids=["top-k-top-p", "top-p"])
def test_speculative_sampling_over_candidates_is_the_dense_law(proposal, params):
    """The same (accepted, bonus) law whether p and q come as candidates or as dense rows: the acceptance
    draws are the same (same generator, same p(d) and q(d)), the bonus is drawn from the same residual."""
    g = torch.Generator().manual_seed(6)
    p = processed(torch.randn(3, V, generator=g) * 1.5, params)
    q = processed(torch.randn(2, V, generator=g) * 1.5, params) if proposal == "drafter" else None
    drafts = (q if q is not None else p[:2]).sample(torch.Generator().manual_seed(7))
    n = 20000
    sparse = _joint(p, q, drafts, n, 8)
    dense = _joint(p.dense(V), None if q is None else q.dense(V), drafts, n, 8)
    assert Counter(a for a, _ in sparse) == Counter(a for a, _ in dense)  # the same acceptance draws
    support = p.dense(V)
    assert all(support[a if a < 2 else 2, b] > 0 for a, b in sparse)
    tv = 0.5 * sum(abs(sparse.get(k, 0) - dense.get(k, 0)) for k in set(sparse) | set(dense)) / n
    assert tv < 0.03, tv


def test_an_unsampleable_candidate_row_becomes_token_zero():
    c = processed(torch.randn(2, 3, V), SamplingParams(temperature=1.0, top_k=4))
    bad_probs = c.probs.clone()
    bad_probs[1, 2, 0] = float("nan")
    guarded, bad = guard_rows(Candidates(bad_probs, c.ids))
    assert bad.tolist() == [False, True]
    assert torch.equal(guarded[0].dense(V), c[0].dense(V))
    assert guarded[1].sample(torch.Generator()).tolist() == [0, 0, 0]
