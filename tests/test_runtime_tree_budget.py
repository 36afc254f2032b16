"""Cost-aware tree budget (runtime/tree_budget.py, AdaptivePolicy.choose_tree): the first b nodes of a tree
are the tree of budget b, the expected accepted length is the path-product sum, the chosen budget follows an
injected cost curve (flat: deep trees; steep: small ones; too steep: plain decoding without a draft call),
and the output stays token-exact with transformers' greedy decode."""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import LinearCost, OracleDrafter, hf_greedy, load_hf_target, single_thread, write_pair

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.draft_tree import DraftTree, SourceRates, build_trees
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend
from retrace.runtime.tree_budget import best_budget, expected_accepted
from retrace.runtime.verify_policy import AdaptivePolicy

VOCAB = 96
MAX_NEW = 40
B = 8


def test_truncated_tree_is_the_smaller_budget_tree():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(3, B - 1, VOCAB, generator=g).mul(3).softmax(-1)
    chains = {"suffix": torch.randint(0, VOCAB, (3, B - 1), generator=g),
              "target": torch.randint(0, VOCAB, (3, B - 1), generator=g)}
    anchors = torch.tensor([1, 2, 3])
    big = build_trees(probs, anchors, 24, ("topk", "suffix", "target"), chains, SourceRates())
    for b in (1, 2, 5, 11):
        small = build_trees(probs, anchors, b, ("topk", "suffix", "target"), chains, SourceRates())
        cut = big.truncate(b)
        for f in ("tokens", "parent", "depth", "source", "size", "score"):
            assert torch.equal(getattr(cut, f), getattr(small, f)), (b, f)
    assert torch.allclose(big.score.gather(1, big.parent) * big.factor(), big.score.where(torch.arange(24) > 0, 1.0))


def test_expected_accepted_is_the_path_product_sum():
    # root -> a (0.8) -> c (0.5); root -> b (0.1)
    tree = DraftTree(tokens=torch.tensor([[9, 1, 2, 3]]), parent=torch.tensor([[0, 0, 0, 1]]),
                     depth=torch.tensor([[0, 1, 1, 2]]), source=torch.tensor([[0, 1, 1, 1]]),
                     size=torch.tensor([4]))
    p = torch.tensor([[1.0, 0.8, 0.1, 0.5]], dtype=torch.float64)
    assert torch.allclose(expected_accepted(tree, p), torch.tensor([0.0, 0.8, 0.9, 1.3], dtype=torch.float64))
    assert best_budget(tree, p, LinearCost(0.0, 0.0))[0] == 4  # free verify tokens: take every node
    assert best_budget(tree, p, LinearCost(0.5, 0.0))[0] == 2  # (1 + 0.8) / 1.5 beats (1 + 1.3) / 2.5
    assert best_budget(tree, p, LinearCost(5.0, 0.0))[0] == 1  # nothing pays


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with single_thread():
        root = tmp_path_factory.mktemp("tree_budget")
        target, drafter = write_pair(root, vocab=VOCAB, block_size=B, conditioner="random", seed=2)
        hf = load_hf_target(target)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 1, 12)]
        greedy = [hf_greedy(hf, p, MAX_NEW + 2 * B) for p in prompts]
        yield target, drafter, prompts, greedy


def run(world, slope, mode="retrace", oracle=True, batch=3):
    target, drafter, prompts, greedy = world
    be = TorchBackend.from_dirs(target, drafter, max_batch=4, max_seq_len=128)
    if oracle:
        be = OracleDrafter(be, {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}, seed=3)
    policy = AdaptivePolicy(B, LinearCost(slope, 0.02), learn_cost=False)
    rt = Runtime(be, TextCodec.find(target), verify_policy=policy, tree_budget=16)
    with single_thread():
        res = rt.generate(prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), mode)
    for i, r in enumerate(res):
        assert r.token_ids == greedy[i][:MAX_NEW], (slope, mode, oracle, i)
    hist = rt.run_stats()["verify_hist"]  # index: tree nodes verified beyond the root per row and round
    drafted = sum(hist[1:]) or 1
    return hist, sum(k * n for k, n in enumerate(hist)) / drafted


def test_budget_follows_the_cost_curve(world):
    flat, flat_mean = run(world, 0.001)
    steep, steep_mean = run(world, 0.3)
    wall, _ = run(world, 3.0)
    assert flat_mean > 10 and max(i for i, n in enumerate(flat) if n) >= 7, flat
    assert 1 <= steep_mean < 0.75 * flat_mean, (steep, flat)
    assert wall[0] > 0.7 * sum(wall), wall  # verifying never pays: mostly plain decoding, no draft call


@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_real_drafter_stays_exact(world, mode):
    run(world, 0.05, mode, oracle=False)
    run(world, 0.3, mode, oracle=True, batch=2)
