"""Sampling (T > 0, top-k, top-p) is lossless: `retrace` mode's output distribution is the target's own.

Setup: a tiny target (vocab 8) with a non-degenerate next-token distribution (entropies ~0.8-1.8 nats),
a random drafter (block 4) with a random conditioner, one fixed 3-token prompt, 5 new tokens, N requests
with seeds 0..N-1. The exact distribution of the 5 new tokens is computed from transformers'
`Qwen3ForCausalLM` probabilities over all 8^4 prefixes, processed by transformers' own temperature /
top-k / top-p warpers. Two chi-square goodness-of-fit tests per configuration, each at alpha = 0.01
(seeds are fixed, so the outcome is deterministic; alpha bounds the chance that a correct sampler fails):
  - the joint of new tokens 2-3 (64 cells): the first round after the prefill (accept / reject /
    residual / bonus, all branches),
  - the joint of new tokens 4-5 (64 cells): later rounds, where the suffix memory conditions the drafts.
Cells with expected count < 5 are pooled. Power: for any alternative at total-variation distance
>= 0.05 from the exact distribution (on the pooled cells) the noncentrality is >= 4 N 0.05^2 (Cauchy-
Schwarz), and the test asserts the asymptotic power at that noncentrality is > 0.9 for the N and degrees
of freedom used (T=1: N = 6000, df <= 63, power ~0.96; top-k/top-p leave fewer cells, N = 5000). The drafts must be
accepted sometimes (tau > 1, every acceptance length occurs),
otherwise the check says nothing about the acceptance rule; and two wrong acceptance rules (always
accept; on rejection resample from p instead of the residual max(0, p - q)) must fail the same check.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from runtime_fixtures import load_hf_target, single_thread, steep_cost_policy, write_pair
from safetensors.torch import load_file, save_file
from scipy.stats import chi2, chisquare, ncx2

import retrace.runtime.verify_accept as verify_module
from retrace.runtime import Runtime, SamplingParams

V = 8
PROMPT = [1, 2, 3]
NEW = 5
ALPHA = 0.01
TV = 0.05
CONFIGS = {  # name -> (sampling parameters, number of samples)
    "T1": (dict(temperature=1.0), 6000),
    "T0.8-top_p0.8": (dict(temperature=0.8, top_p=0.8), 5000),
    "T1-top_k3": (dict(temperature=1.0, top_k=3), 5000),
    "T0.7-top_k4-top_p0.9": (dict(temperature=0.7, top_k=4, top_p=0.9), 5000),  # top-p over top-k's candidates
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with single_thread():
        root = tmp_path_factory.mktemp("sampling")
        target, drafter = write_pair(root, vocab=V, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                     block_size=4, tokenizer=False, seed=2)
        # sharpen the random target a little (entropy ~2.0 -> ~1.3 nats) so that p and the drafter's q
        # differ clearly; the drafter shares the LM head
        sd = load_file(target / "model.safetensors")
        sd["lm_head.weight"] = sd["lm_head.weight"] * 4.0
        save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
        hf = load_hf_target(target)
        with torch.no_grad():
            seqs = torch.tensor([PROMPT + list(t) for t in itertools.product(range(V), repeat=NEW - 1)])
            logits = hf(seqs).logits[:, len(PROMPT) - 1:]  # [V^4, NEW, V]: next-token logits for tokens 1..5
        yield target, drafter, logits


def exact_joint(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """P(t1..t5) [V]*5 from the target's logits, processed by transformers' warpers (its own order)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(params.get("temperature", 1.0))]
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    flat = logits.reshape(-1, V).double()
    for w in warpers:
        flat = w(None, flat)
    probs = flat.softmax(-1).reshape(*[V] * (NEW - 1), NEW, V)
    joint = torch.ones([V] * NEW, dtype=torch.float64)
    for i in range(NEW):  # P(t_{i+1} | t_1..t_i) sits at index [t_1..t_i, 0...] of the prefix grid
        idx = tuple(slice(None) for _ in range(i)) + (0,) * (NEW - 1 - i) + (i,)
        cond = probs[idx]  # [V]*i + [V]
        joint = joint * cond.reshape([V] * (i + 1) + [1] * (NEW - 1 - i))
    assert abs(float(joint.sum()) - 1) < 1e-9
    return joint


def sample(target, drafter, params: dict, n: int, policy="fixed"):
    rt = Runtime.from_dirs(target, drafter, max_batch=64, max_seq_len=16, verify_policy=policy)
    sched = rt.scheduler()
    reqs = [sched.add(PROMPT, SamplingParams(max_new_tokens=NEW, seed=i, **params), "retrace") for i in range(n)]
    while sched.has_work:
        sched.step()
    outs = [tuple(r.output_ids) for r in reqs]
    assert all(len(o) == NEW for o in outs)
    return outs, rt.run_stats()


def chi_square(outcomes: list[tuple[int, ...]], probs: dict[tuple[int, ...], float]):
    """Pearson chi-square with cells of expected count < 5 pooled -> (p-value, df, power at TV 0.05)."""
    n = len(outcomes)
    counts = Counter(outcomes)
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, "sampled an outcome of probability 0"
    big = [k for k, p in probs.items() if n * p >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [n * probs[k] for k in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    df = len(obs) - 1
    p_value = float(chisquare(obs, exp).pvalue)
    power = float(ncx2.sf(chi2.isf(ALPHA, df), df, 4 * n * TV**2))
    return p_value, df, power


def marginals(joint: torch.Tensor):
    first = joint.sum(dim=(0, 3, 4))
    last = joint.sum(dim=(0, 1, 2))
    as_dict = lambda t: {k: float(t[k]) for k in itertools.product(range(V), repeat=t.dim())}  # noqa: E731
    return as_dict(first), as_dict(last)


def check(outs, joint):
    first, last = marginals(joint)
    res = {}
    for name, probs, pick in (("tokens 2-3", first, lambda o: o[1:3]), ("tokens 4-5", last, lambda o: o[3:])):
        res[name] = chi_square([pick(o) for o in outs], probs)
    return res


@pytest.mark.parametrize("config", [c for c in CONFIGS if "top_k4" not in c])  # its sharp q keeps K below 3
def test_adaptive_verify_policy_sampling_matches_target_distribution(pair, config):
    """The same check with the adaptive verify policy, per-row K (ragged: each row judges only its own
    first K_i drafts of a padded verify) from a fixed injected cost model, so K is a deterministic
    function of the drafter's confidences and every K 0..B-1 occurs."""
    target, drafter, logits = pair
    params, n = CONFIGS[config]
    with single_thread():
        # top-k 3: K = 3 was 2 rounds in 16,000 at slope 0.15 (and 0 after candidates changed the draws)
        slope = 0.13 if "top_k3" in config else 0.15
        outs, stats = sample(target, drafter, params, n, policy=steep_cost_policy(4, ragged=True, slope=slope))
    for name, (p_value, df, _) in check(outs, exact_joint(logits, params)).items():
        assert p_value > ALPHA, f"adaptive {config} {name}: chi-square p={p_value:.2e} (df {df})"
    assert stats["tau"] > 1.05, stats["tau"]
    assert len(stats["verify_hist"]) == 4 and all(c > 0 for c in stats["verify_hist"]), stats["verify_hist"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_retrace_sampling_matches_target_distribution(pair, config):
    target, drafter, logits = pair
    params, n = CONFIGS[config]
    with single_thread():
        outs, stats = sample(target, drafter, params, n)
    joint = exact_joint(logits, params)
    for name, (p_value, df, power) in check(outs, joint).items():
        assert power > 0.9, f"{name}: N={n} too small for df={df} (power {power:.3f})"
        assert p_value > ALPHA, f"{config} {name}: chi-square p={p_value:.2e} (df {df})"
    # the acceptance rule was exercised: drafts accepted, every acceptance length 0..B-1 seen
    assert stats["tau"] > 1.1, stats["tau"]
    assert len(stats["accepted_hist"]) == 4 and all(c > 0 for c in stats["accepted_hist"])


def _always_accept(p, q, drafts, gen):
    K, p = drafts.shape[0], p.dense(V)  # the runtime passes candidates (runtime/candidates.py)
    return K, int(torch.multinomial(p[K], 1, generator=gen))


def _resample_from_p(p, q, drafts, gen):
    K, p, q = drafts.shape[0], p.dense(V), q.dense(V)  # the runtime passes candidates (runtime/candidates.py)
    idx = torch.arange(K)
    ok = (torch.rand(K, generator=gen) * q[idx, drafts] <= p[idx, drafts]).to(torch.int64)
    a = int(ok.cumprod(0).sum())
    return a, int(torch.multinomial(p[a], 1, generator=gen))  # wrong: p, not norm(max(0, p - q))


@pytest.mark.parametrize("rule", [_always_accept, _resample_from_p], ids=["always-accept", "resample-from-p"])
def test_wrong_acceptance_rule_fails_the_same_check(pair, monkeypatch, rule):
    target, drafter, logits = pair
    params, n = CONFIGS["T1"]
    monkeypatch.setattr(verify_module, "speculative_accept", rule)
    with single_thread():
        outs, _ = sample(target, drafter, params, n)
    results = check(outs, exact_joint(logits, params))
    assert min(p for p, _, _ in results.values()) < ALPHA, results


def test_top_p_over_the_top_k_candidates_is_the_full_sort():
    """With top-k set, top-p runs over the top-k's candidates (no sort over the vocabulary): the same kept tokens
    and probabilities as top-k's mask followed by a sort of every logit (the path without top-k), ties with the
    k-th logit kept; where tokens tie inside the nucleus, the same number of them."""
    from retrace.runtime.sampling import processed

    def processed_probs(logits, params):  # the candidates as probabilities [..., V]
        return processed(logits, params).dense(logits.shape[-1])

    def full_sort(logits, k, top_p):
        logits = logits / 0.7
        logits = logits.masked_fill(logits < torch.topk(logits, k, dim=-1).values[..., -1:], float("-inf"))
        return processed_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))

    g = torch.Generator().manual_seed(0)
    for vocab, k, top_p in itertools.product((8, 50, 4096), (1, 3, 5), (0.3, 0.8, 0.95)):
        x = torch.randn(4, 3, vocab, generator=g) * 3
        x[0, 0, : k + 3] = x[0, 0].max() + 1  # k + 3 logits tied at the top
        got = processed_probs(x, SamplingParams(temperature=0.7, top_k=k, top_p=top_p))
        want = full_sort(x, k, top_p)
        assert torch.equal((got > 0).sum(-1), (want > 0).sum(-1)), (vocab, k, top_p)
        assert torch.equal(got[1:] > 0, want[1:] > 0) and torch.allclose(got[1:], want[1:], atol=1e-6)


def test_sample_index_draws_the_distribution_and_never_a_zero():
    """The inverse-CDF sampler behind every draw (runtime/sampling.py sample_index): [V] and [K, V] rows,
    unnormalised rows, zeros anywhere (first, last, between) never drawn, frequencies the distribution's."""
    from retrace.runtime.sampling import sample_index

    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    draws = torch.stack([sample_index(probs, g) for _ in range(20000)])  # [20000, 3]
    assert draws.shape == (20000, 3) and sample_index(probs[0], g).shape == ()
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=6).tolist()
        want = (probs[row] / probs[row].sum()).tolist()
        assert all(c == 0 for c, w in zip(counts, want, strict=True) if w == 0), (row, counts)
        obs = [c for c, w in zip(counts, want, strict=True) if w > 0]
        exp = [20000 * w for w in want if w > 0]
        if len(obs) > 1:
            assert chisquare(obs, exp).pvalue > ALPHA, (row, counts)


def test_top_p_from_growing_candidates_is_the_full_sort():
    """retrace::top_p_candidates's CPU kernel (runtime/top_p_op.py): candidates from top-k, grown until they
    hold top_p of the mass, give the sort's nucleus: peaked rows (256 candidates suffice) and flat ones (they
    grow), logits with -inf entries (min_tokens' EOS mask), rows of another shape; ties at the top keep the same
    number."""
    from retrace.runtime.candidates import Candidates
    from retrace.runtime.top_p_op import by_sort, nucleus

    g = torch.Generator().manual_seed(1)
    for vocab, scale, top_p in itertools.product((300, 5000, 40000), (0.05, 1.0, 6.0), (0.5, 0.9, 0.99)):
        x = torch.randn(2, 3, vocab, generator=g) * scale
        x[0, 1, :7] = float("-inf")
        x[1, 2, :4] = x[1, 2].max() + 1  # four logits tied at the top
        got, want = Candidates(*nucleus(x, top_p)).dense(vocab), by_sort(x, top_p)
        assert torch.equal((got > 0).sum(-1), (want > 0).sum(-1)), (vocab, scale, top_p)
        rest = torch.ones(2, 3, dtype=torch.bool)
        rest[1, 2] = False
        assert torch.equal(got[rest] > 0, want[rest] > 0) and torch.allclose(got[rest], want[rest], atol=1e-6)
