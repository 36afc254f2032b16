"""Tree verification (runtime/draft_tree.py, tree_accept.py, suffix_memory.py's trajectory view): the tree is
the best-first one, the mask and the greedy acceptance match brute force, and the runtime's output with a tree
is token-exact with transformers' greedy decode for every source combination, budgets 4..64, batch 1..8,
`dflash` and `retrace`, with a random drafter and an oracle one (accepted drafts), requests joining and
leaving."""

from __future__ import annotations

import itertools

import pytest
import test_runtime_sampling as ts
import torch
from runtime_fixtures import OracleDrafter, hf_greedy, load_hf_target, single_thread, write_pair
from test_runtime_sampling import pair  # noqa: F401  (the vocab-8 pair of the sampling tests)

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.draft_tree import SOURCE_BITS, SourceRates, build_trees, parse_sources
from retrace.runtime.suffix_memory import SuffixMemory
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend
from retrace.runtime.tree_accept import (
    continue_path,
    greedy_tree_accept,
    root_path,
    sample_tree_accept,
    source_counts,
)

VOCAB = 128
MAX_NEW = 48
PROMPT_LENS = [6, 1, 13, 3, 21, 8, 2, 10]


def paths(tree, n) -> list[tuple[int, ...]]:
    """Row n's nodes as token paths from the root (root excluded)."""
    out = []
    for m in range(int(tree.size[n])):
        p, cur = [], m
        while cur:
            p.append(int(tree.tokens[n, cur]))
            cur = int(tree.parent[n, cur])
        out.append(tuple(reversed(p)))
    return out


# -- construction ------------------------------------------------------------------------------------------
def test_topk_tree_is_the_best_first_tree():
    """topk only: the budget's nodes are the highest cumulative draft probabilities (brute force over
    every path of a small vocabulary), parents before children, distinct sibling tokens."""
    g = torch.Generator().manual_seed(0)
    N, S, V = 3, 3, 5
    probs = torch.rand(N, S, V, generator=g).softmax(-1)
    for budget in (2, 7, 20):
        tree = build_trees(probs, torch.tensor([9, 8, 7]), budget, ("topk",))
        for n in range(N):
            scores = {}
            for d in range(1, S + 1):
                for p in itertools.product(range(V), repeat=d):
                    scores[p] = float(torch.prod(probs[n, torch.arange(d), torch.tensor(p)]))
            best = sorted(scores, key=scores.get, reverse=True)[: budget - 1]
            got = paths(tree, n)
            assert got[0] == () and int(tree.tokens[n, 0]) == [9, 8, 7][n]
            assert set(got[1:]) == set(best) and len(got) == budget
            for m in range(1, int(tree.size[n])):
                assert int(tree.parent[n, m]) < m
                assert int(tree.depth[n, m]) == int(tree.depth[n, tree.parent[n, m]]) + 1
            assert len(set(got)) == len(got)  # distinct sibling tokens


def test_chains_join_the_tree_along_their_prefix():
    """suffix/target chains hang from the root; a chain continues only under its own prefix; a node
    proposed by several sources keeps all their bits; a chain stops at -1."""
    N, S, V = 1, 4, 10
    probs = torch.full((N, S, V), 1.0 / V)
    chains = {"suffix": torch.tensor([[1, 2, 3, -1]]), "target": torch.tensor([[1, 5, 6, 7]])}
    rates = SourceRates(prior=0.99)
    tree = build_trees(probs, torch.tensor([0]), 10, ("suffix", "target"), chains, rates)
    got = dict(zip(paths(tree, 0), tree.source[0].tolist(), strict=False))
    assert set(got) == {(), (1,), (1, 2), (1, 2, 3), (1, 5), (1, 5, 6), (1, 5, 6, 7)}
    assert got[(1,)] == SOURCE_BITS["suffix"] | SOURCE_BITS["target"]
    assert got[(1, 2, 3)] == SOURCE_BITS["suffix"] and got[(1, 5, 6, 7)] == SOURCE_BITS["target"]
    # with topk too the budget is shared and every node is still unique
    tree = build_trees(probs, torch.tensor([0]), 8, ("topk", "suffix", "target"), chains, rates)
    assert int(tree.size[0]) == 8 and len(set(paths(tree, 0))) == 8


def test_the_tree_builder_reads_the_host_once():
    """build_trees brings the top-k, the chains, their drafter probabilities and the sampled drafts back in
    one read (float64: the ids and float32 probabilities exactly), and with the anchors as host ints reads
    nothing else; the tree is the one built from the anchors as a tensor."""
    from test_runtime_device import HostReads

    g = torch.Generator().manual_seed(5)
    N, S, V = 3, 6, 40
    probs = torch.softmax(torch.randn(N, S, V, generator=g) * 3, -1)
    chains = {s: torch.randint(-1, V, (N, S), generator=g) for s in ("suffix", "target")}
    sampled = torch.where(torch.tensor([[True], [False], [True]]), torch.randint(0, V, (N, S), generator=g), -1)
    anchors = [4, 9, 17]
    for kw in ({}, {"sampled": sampled}):
        reads = HostReads()
        with reads:
            tree = build_trees(probs, anchors, 7, ("topk", "suffix", "target"), chains, **kw)
        assert reads.count == 1
        ref = build_trees(probs, torch.tensor(anchors), 7, ("topk", "suffix", "target"), chains, **kw)
        for f in ("tokens", "parent", "depth", "source", "size", "score"):
            assert torch.equal(getattr(tree, f), getattr(ref, f)), f
        assert tree.tokens[:, 0].tolist() == anchors


def test_a_tree_over_a_draft_vocabulary_is_the_tree_over_its_expansion():
    """With a draft vocabulary the tree takes its top-k in the draft space and maps it to target ids, and a
    chain token outside the subset scores probability 0: the same tree as from the distribution expanded to
    the target's vocabulary (0 outside), built without a pass over V."""
    from retrace.runtime.draft_space import DraftSpace

    g = torch.Generator().manual_seed(11)
    N, S, V, Vd = 3, 5, 60, 12
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    space = DraftSpace(ids, V)
    probs = torch.softmax(torch.randn(N, S, Vd, generator=g) * 3, -1)
    outside = torch.tensor([t for t in range(V) if t not in set(ids.tolist())])
    chains = {"suffix": ids[torch.randint(0, Vd, (N, S), generator=g)],  # in the subset
              "target": torch.where(torch.rand(N, S, generator=g) < 0.5, ids[torch.randint(0, Vd, (N, S), generator=g)],
                                    outside[torch.randint(0, len(outside), (N, S), generator=g)])}
    chains["target"][1, 3:] = -1
    for budget in (4, 9, 16):
        tree = build_trees(probs, [1, 2, 3], budget, ("topk", "suffix", "target"), chains, space=space)
        ref = build_trees(space.probs_full(probs), [1, 2, 3], budget, ("topk", "suffix", "target"), chains)
        for f in ("tokens", "parent", "depth", "source", "size"):
            assert torch.equal(getattr(tree, f), getattr(ref, f)), (budget, f)
        assert torch.allclose(tree.score, ref.score)


def test_ancestor_mask_and_greedy_accept_match_brute_force():
    g = torch.Generator().manual_seed(3)
    N, S, V = 4, 5, 3
    probs = torch.rand(N, S, V, generator=g).softmax(-1)
    tree = build_trees(probs, torch.tensor([0, 1, 2, 0]), 12, ("topk",))
    tree.size[3] = 5  # a ragged row (its nodes 5.. become padding)
    mask = tree.ancestor_mask()
    logits = torch.randn(N, tree.nodes, V, generator=g) * 3
    accepted, bonus, node, post = greedy_tree_accept(tree, logits)
    for n in range(N):
        size = int(tree.size[n])
        anc = [{0}]
        for m in range(1, tree.nodes):
            anc.append(anc[int(tree.parent[n, m])] | {m} if m < size else {m})
        for i in range(tree.nodes):
            assert {j for j in range(tree.nodes) if mask[n, i, j]} == anc[i]
        ok = [m for m in range(size) if all(m2 == 0 or int(tree.tokens[n, m2]) == int(post[n, tree.parent[n, m2]])
                                            for m2 in anc[m])]
        deepest = max(ok, key=lambda m: int(tree.depth[n, m]))
        assert int(accepted[n]) == int(tree.depth[n, deepest]) and int(node[n]) == deepest
        assert int(bonus[n]) == int(post[n, deepest])
    path = root_path(tree, node)
    for n in range(N):
        a = int(accepted[n])
        p = path[n, : a + 1].tolist()
        assert p[0] == 0 and p[-1] == int(node[n])
        assert all(int(tree.parent[n, p[d]]) == p[d - 1] for d in range(1, a + 1))
    counts = source_counts(tree, path, accepted)
    assert counts["topk"][1] == counts["topk"][3] == int(accepted.sum()) and counts["suffix"] == (0, 0, 0, 0)
    end = continue_path(tree, node)
    assert bool((tree.depth.gather(1, end.unsqueeze(1)).squeeze(1) >= accepted).all())


def test_rejected_trajectory_alignment():
    """old slot j -> new slot k = j - a - 1: suffix = the drafter's top-1 at j (unverified slots too),
    target = the round path's target argmax at j - 1 (only where the verify reached it)."""
    tr = SuffixMemory(2, 6, 4)  # S = 5
    top1 = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    post = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 42]])  # old slots 0..3 (row 1 padded past L=2)
    tr.write_trajectory(torch.tensor([0, 1]), top1, post, torch.tensor([3, 2]), torch.tensor([1, 0]))
    got = tr.trajectory(torch.tensor([0, 1]))
    assert got["suffix"].tolist() == [[13, 14, 15, -1, -1], [22, 23, 24, 25, -1]]
    assert got["target"].tolist() == [[32, 33, -1, -1, -1], [41, 42, -1, -1, -1]]


def test_bad_tree_options():
    with pytest.raises(RetraceError, match="tree sources"):
        parse_sources("topk,beam")
    with pytest.raises(RetraceError, match="tree budget"):
        Runtime(None, tree_budget=1)


# -- losslessness ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with single_thread():
        root = tmp_path_factory.mktemp("tree")
        target, drafter = write_pair(root, vocab=VOCAB, block_size=8, conditioner="random", seed=1)
        hf = load_hf_target(target)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]
        greedy = [hf_greedy(hf, p, MAX_NEW + 80) for p in prompts]
        yield target, drafter, prompts, greedy


def run(world, budget, sources, mode, batch, oracle, max_batch=8, block=None):
    target, drafter, prompts, greedy = world
    be = TorchBackend.from_dirs(target, drafter, max_batch=max_batch, max_seq_len=256)
    if oracle:
        be = OracleDrafter(be, {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}, seed=budget)
    rt = Runtime(be, TextCodec.find(target), block_size=block, verify_policy="fixed", tree_budget=budget,
                 tree_sources=sources)
    with single_thread():
        res = rt.generate(prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), mode)
    for i, r in enumerate(res):
        assert r.token_ids == greedy[i][:MAX_NEW], (budget, sources, mode, batch, oracle, i)
    return rt.run_stats()


@pytest.mark.parametrize("sources", ["topk", "suffix", "target", "topk,suffix", "topk,target", "suffix,target",
                                     "topk,suffix,target"])
def test_tree_equals_transformers_every_source_combination(world, sources):
    """Oracle drafter (accepted drafts, rejected suffixes that are partly right) and a random one.
    `target` alone never starts: the target's argmax beyond the anchor exists only where an earlier tree
    verified something, so its trees stay the root (plain decoding, still exact)."""
    st = run(world, 16, sources, "retrace", 3, oracle=True)
    used = st["tree"]["source_counts"]
    if sources == "target":
        assert st["tau"] == 1.0 and used["target"]["tries"] == 0
    else:
        assert st["tau"] > 1.5
        for s in sources.split(","):
            assert used[s]["tries"] > 0, used
    run(world, 16, sources, "dflash", 2, oracle=False)


@pytest.mark.parametrize("budget,batch", [(4, 1), (9, 8), (64, 4)])
def test_tree_equals_transformers_budgets_and_batches(world, budget, batch):
    for mode in ("dflash", "retrace"):
        st = run(world, budget, "topk,suffix,target", mode, batch, oracle=True)
        assert st["tau"] > 1.2
    run(world, budget, "topk,suffix,target", "retrace", batch, oracle=False)


def test_tree_requests_join_and_leave(world):
    """8 requests in 3 slots: freed slots (and their rejected trajectory) are reused mid-run."""
    run(world, 12, "topk,suffix,target", "retrace", 8, oracle=True, max_batch=3)


def _walks(tree, p, n, rule):
    g = torch.Generator().manual_seed(0)
    return [rule(tree, 0, p, g) for _ in range(n)]


def test_tree_sampling_is_the_target_distribution():
    """The sampling walk: the first emitted token ~ p(root), and after accepting child c the next ~ p(c)
    (chi-square at alpha 0.01, N = 6000); a wrong rule (accept the best child whenever it is sampled
    or with probability 1/2 otherwise) fails the same check."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(1)
    V = 6
    tree = build_trees(torch.rand(1, 3, V, generator=g).softmax(-1), torch.tensor([0]), 5, ("topk",))
    p = torch.rand(tree.nodes, V, generator=g).pow(2)
    p = p / p.sum(-1, keepdim=True)
    child = {int(tree.tokens[0, m]): m for m in range(1, int(tree.size[0])) if int(tree.parent[0, m]) == 0}

    def emitted(res):
        """(first token, second token or None) of each walk."""
        out = []
        for _a, bonus, node in res:
            path = root_path(tree, torch.tensor([node]))[0].tolist()
            toks = [int(tree.tokens[0, m]) for m in path[1:]] + [bonus]
            out.append((toks[0], toks[1] if len(toks) > 1 else None))
        return out

    def check(res) -> bool:
        em = emitted(res)
        n = len(em)
        first = torch.bincount(torch.tensor([f for f, _ in em]), minlength=V).float()
        ok = chisquare(first, p[0] * n).pvalue > 0.01
        for t, m in child.items():
            second = [s for f, s in em if f == t]
            counts = torch.bincount(torch.tensor(second), minlength=V).float()
            ok &= chisquare(counts, p[m] * len(second)).pvalue > 0.01
        return ok

    assert check(_walks(tree, p, 6000, sample_tree_accept))

    def greedy_biased(tree, row, p, gen):
        a, b, node = sample_tree_accept(tree, row, p, gen)
        if a == 0 and torch.rand(1, generator=gen) < 0.5:  # wrong: force the first child
            m = min(child.values())
            return 1, int(torch.multinomial(p[m], 1, generator=gen)), m
        return a, b, node

    assert not check(_walks(tree, p, 6000, greedy_biased))


def test_sampled_tree_rule_is_the_target_distribution():
    """A sampling row's tree: a freshly sampled draft chain (x ~ q) beside fixed suffix and target chains;
    the recursive rule gives token 1 ~ p(root) and token 2 | token 1 ~ p(token 1) (chi-square, alpha
    0.01 Bonferroni-corrected over the checks, N = 4000); the shape does not depend on the draws."""
    from scipy.stats import chisquare

    V, S, n = 5, 2, 4000
    g = torch.Generator().manual_seed(2)
    q = torch.rand(S, V, generator=g).pow(2)
    q = q / q.sum(-1, keepdim=True)
    dist = {}

    def p_of(path: tuple) -> torch.Tensor:  # the target's distribution after a path (fixed random)
        if path not in dist:
            x = torch.rand(V, generator=g).pow(3) + 0.01
            dist[path] = x / x.sum()
        return dist[path]

    chains = {"suffix": torch.tensor([[1, 2]]), "target": torch.tensor([[3, 1]])}
    draws = torch.Generator().manual_seed(3)
    em, shapes = [], set()
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=draws).T  # [1, S]
        tree = build_trees(q.unsqueeze(0), torch.tensor([0]), 6, ("topk", "suffix", "target"), chains,
                           SourceRates(prior=0.6), sampled=x)
        shapes.add((tuple(tree.parent[0].tolist()), tuple(tree.source[0].tolist())))
        paths_ = paths(tree, 0)
        p = torch.stack([p_of(pt) for pt in paths_])
        a, bonus, node = sample_tree_accept(tree, 0, p, draws, q)
        toks = list(paths_[node]) + [bonus]
        em.append((toks[0], toks[1] if len(toks) > 1 else None))
    assert len(shapes) == 1  # the same shape whatever was sampled
    checks = [([f for f, _ in em], p_of(()))]
    for t in range(V):
        second = [b for f, b in em if f == t and b is not None]
        if len(second) > 200:
            checks.append((second, p_of((t,))))
    for obs, want in checks:  # Bonferroni: alpha 0.01 over all the checks
        counts = torch.bincount(torch.tensor(obs), minlength=V).double()
        want = want.double() / want.double().sum()
        assert chisquare(counts, want * len(obs)).pvalue > 0.01 / len(checks), (counts, want)


def test_tree_sampling_runs_in_the_runtime(world):
    """T>0 with a tree: seeded runs repeat, drafts get accepted (oracle drafter at low temperature)."""
    target, drafter, prompts, greedy = world
    outs = []
    for _ in range(2):
        be = OracleDrafter(TorchBackend.from_dirs(target, drafter, max_batch=4, max_seq_len=256),
                           {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}, seed=0)
        rt = Runtime(be, verify_policy="fixed", tree_budget=12)
        with single_thread():
            res = rt.generate(prompts[:4], SamplingParams(max_new_tokens=24, temperature=0.3, seed=7), "retrace")
        outs.append([r.token_ids for r in res])
        assert rt.run_stats()["tau"] > 1.0 and all(len(r.token_ids) == 24 for r in res)
    assert outs[0] == outs[1]


def test_tree_budget_zero_is_the_chain(world):
    """Budget 0 = the chain: same tokens, same acceptance histogram as without the option."""
    a = run(world, 0, "topk", "retrace", 3, oracle=True)
    target, drafter, prompts, greedy = world
    be = OracleDrafter(TorchBackend.from_dirs(target, drafter, max_batch=8, max_seq_len=256),
                       {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}, seed=0)
    rt = Runtime(be, verify_policy="fixed")
    with single_thread():
        rt.generate(prompts[:3], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    assert rt.run_stats()["accepted_hist"] == a["accepted_hist"] and "tree" not in a





def test_tree_sampling_matches_target_distribution_end_to_end(pair):  # noqa: F811
    """The runtime with trees at T=1: the chi-square check of tests/test_runtime_sampling.py (exact joint of
    new tokens 2-3 and 4-5 from transformers' probabilities) on the same tiny vocab-8 pair."""
    target, drafter, logits = pair
    params, n = ts.CONFIGS["T1"]
    with single_thread():
        rt = Runtime.from_dirs(target, drafter, max_batch=64, max_seq_len=24, verify_policy="fixed", tree_budget=6)
        sched = rt.scheduler()
        reqs = [sched.add(ts.PROMPT, SamplingParams(max_new_tokens=ts.NEW, seed=i, **params), "retrace")
                for i in range(n)]
        while sched.has_work:
            sched.step()
    outs = [tuple(r.output_ids) for r in reqs]
    for name, (p_value, df, power) in ts.check(outs, ts.exact_joint(logits, params)).items():
        assert power > 0.9 and p_value > ts.ALPHA, f"tree T1 {name}: chi-square p={p_value:.2e} (df {df})"
    assert rt.run_stats()["tau"] > 1.1
