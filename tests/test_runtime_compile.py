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


def test_padded_static_steps_compile_without_graph_break(tmp_path):
    """The static-shape steps a CUDA graph captures (runtime/step_buckets.py), padded to their buckets and
    compiled (fullgraph, dynamic): no graph break, token-exact. 4 query / 2 KV heads: grouped-query attention
    with symbolic head counts (the SDPA flag comes from the config, not from a symbolic comparison)."""
    from torch._dynamo.utils import counters

    from retrace.models.drafter import load_pair
    from retrace.runtime.options import RuntimeOptions
    from retrace.runtime.torch_backend import TorchBackend

    target, drafter = write_pair(tmp_path, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48,
                                 block_size=6, conditioner="random", seed=4)
    prompts = [[5, 9, 2, 40, 41], [7, 3], [1, 2, 3, 4]]
    hf = load_hf_target(target)
    want = [hf_greedy(hf, p, 16) for p in prompts]
    torch._dynamo.reset()
    counters.clear()
    be = TorchBackend(*load_pair(target, drafter), max_batch=4, max_seq_len=64, compile="eager", static_shapes=True)
    rt = Runtime(be, None, RuntimeOptions(verify_policy="fixed"))
    for mode in ("dflash", "retrace"):
        out = [r.token_ids for r in rt.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True), mode)]
        assert out == want, mode
    assert isinstance(be.slot_target_step, CompiledStep) and isinstance(be.slot_draft_step, CompiledStep)
    assert not be.slot_target_step.fallback and not be.slot_draft_step.fallback
    assert sum(be.runner.calls.values()) > 4  # the padded steps ran
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_inductor_frozen_steps_are_token_exact(tmp_path):
    """`--compile` on the CPU as users run it: inductor's generated C++ with freezing (the weights prepacked as
    constants, runtime/compiled_step.py), plain decoding and retrace at batch 1 equal transformers' greedy, and
    a one-token decode runs as two identical rows (TwoRowDecode), never as a one-row graph. (Batch 2 traces
    the same step functions: the `eager`-compiler test above; each inductor graph costs ~15 s to build here.)"""
    from torch._dynamo.utils import counters

    target, drafter = write_pair(tmp_path, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48,
                                 block_size=4, conditioner="random", seed=5)
    prompts = [[5, 9, 2, 40, 41], [7, 3]]
    hf = load_hf_target(target)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime.from_dirs(target, drafter, max_batch=2, max_seq_len=64, verify_policy="fixed", compile=True)
    be = rt.backend
    assert be.target_step.freeze and be.draft_step.freeze
    widths, inner, bound = [], be.target_step.compiled, len(be.target_step.bound)
    be.target_step.compiled = lambda *a: (widths.append(tuple(a[bound].shape)), inner(*a))[1]
    for mode in ("ar", "retrace"):
        for prompt, expected in zip(prompts, want, strict=True):
            got = rt.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True), mode)[0].token_ids
            assert got == expected, (mode, prompt)
    assert (1, 2) in widths and (1, 1) not in widths
    assert not be.target_step.fallback and not be.draft_step.fallback
    aot = counters["aot_autograd"]  # every compile done on its first trace: no float specialised by a restart
    assert aot["total"] == aot["ok"], dict(aot)


def test_sizes_equal_by_chance_do_not_recompile(tmp_path):
    """A batch of 4 beside 4 K/V heads: with dynamo's duck sizing the first compile ties the two sizes, and
    every other batch size recompiled the steps (at Qwen3's shapes: a verify width of 8 and 8 K/V heads, a
    128-column window and the head dimension). The steps compile without it: a batch of 3 afterwards, same
    prompts otherwise, compiles nothing new. Each step also has its own graph cache (runtime/compiled_step.py)."""
    from torch._dynamo.utils import counters

    target, drafter = write_pair(tmp_path, vocab=96, hidden=32, layers=2, heads=4, kv_heads=4, intermediate=48,
                                 block_size=4, conditioner="random", seed=6)
    prompts = [[5, 9, 2, 40, 41], [7, 3, 8, 1, 2], [11, 12, 13, 14, 15], [20, 21, 22, 23, 24]]
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime.from_dirs(target, drafter, max_batch=4, max_seq_len=64, verify_policy="fixed", compile="eager")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = rt.generate(prompts, params, "retrace")
    graphs = counters["stats"]["unique_graphs"]
    again = rt.generate(prompts[:3], params, "retrace")
    assert counters["stats"]["unique_graphs"] == graphs, "a batch of 3 recompiled a step"
    assert [r.token_ids for r in again] == [r.token_ids for r in first[:3]]
    code = {step.compiled._torchdynamo_orig_callable for step in (rt.backend.target_step, rt.backend.draft_step)}
    assert len(code) == 2  # the target's and the drafter's step functions, each compiled on its own
