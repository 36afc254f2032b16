"""int4 / int8 bundles with a draft vocabulary: the drafter's head over the subset is a MatMulNBits head over
the subset's packed rows and scales (retrace.runtime.lm_head_nbits), so it scores exactly what the full
quantized head scores at those ids; speculative decoding stays the bundle's own `ar` output token for token
(batch 1 and 2, dflash and retrace), and every draft is a subset token.
"""

from __future__ import annotations

import json

import pytest
import torch
from export_fixtures import BLOCK, VOCAB
from test_draft_vocab import DraftSpy

from retrace.models.draft_vocab import from_counts
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 24


def _subset(vocab_size: int):
    """Every even id: a subset that leaves out about half of what the target produces."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    counts[0::2] = 1
    return from_counts(counts, size=(vocab_size + 1) // 2)


def _quantized_with_vocab(dst, weights: str, block: int):
    """A copy of the session's fp32 bundle quantized as `retrace-export build --weights` quantizes
    (retrace.export.quantize.quantize_graph: every linear layer and the LM head, the nbits fusions), its draft
    vocabulary added as the build adds it (retrace.export.draft_vocab.copy_draft_vocab; the build does
    nothing else with the map) -> (bundle, vocab, prompts, the bundle's own ar outputs)."""
    from export_fixtures import copy_bundle

    from retrace.engines.bundle import write_manifest
    from retrace.export.draft_vocab import copy_draft_vocab
    from retrace.export.quantize import WeightQuant, quantize_graph
    from retrace.runtime.shared_weights import shared_pairs

    bundle = copy_bundle(dst / "bundle")
    m = json.loads((bundle / "manifest.json").read_text())
    for name in ("target", "drafter"):
        assert quantize_graph(bundle / name / "model.onnx", WeightQuant(weights, block))["lm_head"]
    pairs = shared_pairs(bundle / "target" / "model.onnx", bundle / "drafter" / "model.onnx")
    assert any(k.endswith("_scales") for k in pairs)  # the packed head and its scales: one mapped copy
    m["graphs"]["drafter"]["shared_initializers"] = pairs
    vocab = _subset(VOCAB)
    vocab.save(dst / "map")
    m["models"]["drafter"]["draft_vocab"] = copy_draft_vocab(dst / "map", bundle, VOCAB)
    m.pop("files")
    write_manifest(bundle, m)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 9)]
    own = Runtime.from_bundle(bundle, threads=1).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), "ar")
    return bundle, vocab, prompts, [r.token_ids for r in own]


def _draft_logits(be: OnnxRuntimeBackend, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hidden = be.drafter_config.hidden_size
    ctx = torch.randn(1, 3, be.drafter_config.num_taps * hidden, generator=g)
    block = torch.randint(0, be.target_config.vocab_size - 1, (1, BLOCK), generator=g)
    _, logits = be.draft(torch.tensor([0]), ctx, torch.arange(3)[None], block, torch.arange(3, 3 + BLOCK)[None], None)
    return logits


def _assert_subset_head(bundle, vocab) -> None:
    """The subset head is a MatMulNBits head over the subset's rows: its logits are the full quantized
    head's at the subset's ids (the same packed rows and scales), over the subset only; the full head again on the
    same backend after use_draft_vocab(None)."""
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1)
    full = OnnxRuntimeBackend.from_bundle(bundle, threads=1, draft_vocab=False)
    assert be.draft_head is not None and be.draft_head.vocab == vocab.size
    assert list(be.draft_head.op_types) == ["MatMulNBits"]
    sub, want = _draft_logits(be), _draft_logits(full).float()
    ids = vocab.ids
    assert be.draft_ids.tolist() == ids.tolist() and sub.shape[-1] == ids.numel()  # the subset's logits only
    torch.testing.assert_close(sub.float(), want[..., ids], rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert not torch.isinf(sub).any()
    be.use_draft_vocab(None)
    torch.testing.assert_close(_draft_logits(be).float(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _assert_lossless(bundle, vocab, prompts, own, monkeypatch) -> None:
    params = SamplingParams(max_new_tokens=MAX_NEW)
    subset = set(vocab.ids.tolist())
    # the head in each graph (the default), and cut into one MatMulNBits session for the target (forced)
    for mode, batch, head in (("dflash", 1, None), ("dflash", 2, None), ("retrace", 1, None), ("retrace", 2, None),
                              ("retrace", 2, True)):
        spy = DraftSpy(monkeypatch)
        rt = Runtime.from_bundle(bundle, threads=1, verify_policy="fixed", lm_head_session=head)
        assert (rt.backend.head is not None) == bool(head)
        res = rt.generate(prompts[:batch], params, mode)
        assert [r.token_ids for r in res] == own[:batch], (mode, batch, head)
        assert spy.drafts and spy.drafts <= subset, sorted(spy.drafts - subset)
    assert {t for o in own for t in o} - subset  # the target produced tokens the drafter cannot draft


@pytest.mark.parametrize("weights, block", [("int4", 16), ("int8", 32)])
def test_quantized_bundle_with_a_draft_vocab(tmp_path, monkeypatch, weights, block):
    bundle, vocab, prompts, own = _quantized_with_vocab(tmp_path, weights, block)
    _assert_subset_head(bundle, vocab)
    _assert_lossless(bundle, vocab, prompts, own, monkeypatch)
