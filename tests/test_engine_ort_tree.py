"""Tree verification on the ONNX Runtime backend: a bundle built with `--tree-mask` gives the same tokens
as the torch backend and as transformers' greedy decode (the build's own parity check covers a random
tree's logits, taps and K/V); a bundle without the input keeps serving chains and refuses trees clearly."""

from __future__ import annotations

import pytest
import torch
from export_fixtures import BLOCK, MAX_BATCH, MAX_SEQ, VOCAB, pair_and_bundle
from runtime_fixtures import OracleDrafter, call_both, hf_greedy, load_hf_target, single_thread

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
from retrace.runtime.torch_backend import TorchBackend

pytest.importorskip("onnxruntime")
MAX_NEW = 40


@pytest.fixture(scope="module")
def tree_bundle():
    """export_fixtures' session pair built with `--tree-mask` (max batch 4, max seq 160): test_draft_vocab's
    session bundle, whose drafter directory adds a draft vocabulary; the backends here open it with
    `draft_vocab=False`, the drafter graph's full head."""
    from test_draft_vocab import shared_world

    w = shared_world()
    assert (BLOCK, MAX_BATCH, MAX_SEQ) == (8, 4, 160)  # what test_draft_vocab builds
    return w["target"], w["drafter"], w["bundle"]


def test_tree_on_onnxruntime_equals_torch_and_transformers(tree_bundle):
    target, drafter, bundle = tree_bundle
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 1, 9, 3)]
    hf = load_hf_target(target)
    greedy = [hf_greedy(hf, p, MAX_NEW + 40) for p in prompts]
    seqs = {tuple(p): p + q for p, q in zip(prompts, greedy, strict=True)}
    with single_thread():
        for mode in ("dflash", "retrace"):
            outs = {}
            for name in ("torch", "onnxruntime"):
                be = (TorchBackend.from_dirs(target, drafter, max_batch=3, max_seq_len=MAX_SEQ) if name == "torch"
                      else OnnxRuntimeBackend.from_bundle(bundle, max_batch=3, draft_vocab=False))
                rt = Runtime(OracleDrafter(be, seqs, seed=1), verify_policy="fixed", tree_budget=12)
                res = rt.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)
                outs[name] = [r.token_ids for r in res]
                assert rt.run_stats()["tau"] > 1.5
            assert outs["onnxruntime"] == outs["torch"] == [q[:MAX_NEW] for q in greedy], mode


def test_bundle_without_tree_mask_refuses_trees_and_serves_chains():
    built = pair_and_bundle()
    be = OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=2)
    rt = Runtime(be, verify_policy="fixed", tree_budget=8)
    with pytest.raises(RetraceError, match="--tree-mask"):
        rt.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), "dflash")
    rt = Runtime(OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=2), verify_policy="fixed")
    (res,) = rt.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), "dflash")
    assert len(res.token_ids) == 4


def test_inplace_kv_tree_verify_matches_the_portable_graph(tree_bundle):
    """Siblings that must not see each other: on the in-place K/V graph (the default) the tree's mask
    reaches GroupQueryAttention as attention_bias; logits, taps and cache entries as the portable graph's."""
    _, _, bundle = tree_bundle
    ref, new = (OnnxRuntimeBackend.from_bundle(bundle, max_batch=2, threads=1, verify=False, kv_mode=m,
                                               draft_vocab=False)
                for m in ("gather", None))
    assert new.inplace.tree
    g = torch.Generator().manual_seed(3)
    for s, n in ((0, 9), (1, 5)):
        call_both(ref, new, torch.tensor([s]), torch.randint(0, VOCAB, (1, n), generator=g), torch.arange(n)[None],
                   torch.tensor([[n - 1]]))
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2, 2])
    past = torch.tensor([9, 5])
    call_both(ref, new, torch.tensor([0, 1]), torch.randint(0, VOCAB, (2, 5), generator=g), past[:, None] + depth,
               torch.arange(5).expand(2, 5).contiguous(), mask.expand(2, 5, 5).contiguous())
    for s, n in ((0, 14), (1, 10)):  # the entries written (past them: a pad row's, retrace.runtime.row_invariance)
        assert torch.allclose(ref.tcache.kv[:, s, :, :n], new.tcache.kv[:, s, :, :n], atol=1e-5)
