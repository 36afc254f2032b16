"""The torch backend's steps under torch.compile(fullgraph=True): no graph break, token-exact.

One small compile (a 2-layer target, a 1-layer drafter; the `eager` compiler: dynamo traces the same
fullgraph inductor compiles, without generating C++): dflash and retrace at batch 2, ragged prompts, equal
transformers' greedy decode, and dynamo counted no graph break. `retrace generate --device cpu --compile`
(inductor) runs the same step functions.
"""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import hf_greedy, load_hf_target, write_pair

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.compiled_step import CompiledStep

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compiled_steps_have_no_graph_break_and_are_token_exact(tmp_path):
    from torch._dynamo.utils import counters

    target, drafter = write_pair(tmp_path, vocab=96, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                 block_size=6, conditioner="random", seed=4)
    prompts = [[5, 9, 2, 40, 41], [7, 3]]
    hf = load_hf_target(target)
    want = [hf_greedy(hf, p, 16) for p in prompts]
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime.from_dirs(target, drafter, max_batch=2, max_seq_len=64, verify_policy="fixed", compile="eager")
    assert isinstance(rt.backend.target_step, CompiledStep) and isinstance(rt.backend.draft_step, CompiledStep)
    for mode in ("dflash", "retrace"):
        out = [r.token_ids for r in rt.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True), mode)]
        assert out == want, mode
    assert not rt.backend.target_step.fallback and not rt.backend.draft_step.fallback
    assert counters["stats"]["unique_graphs"] >= 2  # both steps really went through dynamo
    assert not counters["graph_break"], dict(counters["graph_break"])
