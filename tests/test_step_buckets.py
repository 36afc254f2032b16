"""The static-shape steps (runtime/step_buckets.py, models/cached_step.py slot steps, runtime/cuda_graphs.py),
run eagerly on the CPU: what a CUDA graph per bucket replays on a GPU.

- The bucket of every (N, T): rows padded to 1, 2, 4, a multiple of 8 or max_batch, verify widths to 1, 2,
  4, 8, 16;
  wider calls (prefill) and drafter contexts longer than the block are not padded.
- Padding never changes a real row: the padded step's logits, taps and drafter outputs equal the unpadded
  step's (relative 1e-5; the same argmax), and the caches' real rows and columns hold the same K/V
  (padding writes only the scratch slot and the scratch columns).
- Token-exact against transformers' greedy decode through the padded path: ar, dflash, retrace at batch
  1 and 8 with accepted drafts (an oracle drafter), 8 requests joining and leaving 3 slots, the adaptive
  policy (K varies), and tree rounds.
- The CUDA-graph layer without CUDA: it refuses to be built, the option refuses clearly, and a capture that
  fails (here: CUDA calls on a CPU-only torch) warns once and falls back to the eager padded step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from runtime_fixtures import OracleDrafter, hf_greedy, load_hf_target, steep_cost_policy, write_pair

from retrace.cli_options import options_from_flags
from retrace.errors import RetraceError
from retrace.models.conditioner import FEATURES
from retrace.models.drafter import SuffixInputs, load_pair
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.cuda_graphs import CUDAGraphSteps, EagerSteps, steps_runner
from retrace.runtime.device import index_tensor
from retrace.runtime.options import RuntimeOptions
from retrace.runtime.step_buckets import VERIFY_WIDTHS, batch_bucket, batch_buckets, verify_width
from retrace.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ, MAX_NEW = 128, 128, 40
PROMPT_LENS = [6, 1, 13, 3, 21, 8, 2, 10]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    target, drafter = write_pair(tmp_path_factory.mktemp("buckets"), vocab=VOCAB, block_size=8,
                                 conditioner="random", seed=3)
    hf = load_hf_target(target)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]
    greedy = [hf_greedy(hf, p, MAX_NEW + 10) for p in prompts]
    return target, drafter, prompts, greedy


def test_the_bucket_of_every_batch_and_verify_width():
    assert [verify_width(T) for T in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8 + [None]
    assert VERIFY_WIDTHS == (1, 2, 4, 8, 16)
    assert batch_buckets(8) == (1, 2, 4, 8) and batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(1) == (1,)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32) and batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [batch_bucket(n, 32) for n in (8, 9, 17, 25, 32)] == [8, 16, 24, 32, 32]


def _pair_of_backends(world, max_batch=4):
    t, d = load_pair(*world[:2])
    return (TorchBackend(t, d, max_batch=max_batch, max_seq_len=SEQ),
            TorchBackend(t, d, max_batch=max_batch, max_seq_len=SEQ, static_shapes=True))


def _same(a, b, what):
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert a.shape == b.shape and rel < 1e-5, (what, rel)
    return rel


@pytest.mark.parametrize("max_batch,slot_ids,placed", [(4, [3, 0, 2], True), (8, [6, 0, 2], False)])
def test_padding_never_changes_a_real_rows_outputs_or_cache(world, max_batch, slot_ids, placed):
    """3 rows -> the 4-row bucket, slots not one range: placed at their own slots (every slot < 4) or, with
    slot 6, gathered (padded rows in the scratch slot)."""
    plain, padded = _pair_of_backends(world, max_batch)
    g = torch.Generator().manual_seed(0)
    slots = index_tensor(slot_ids, CPU)
    lens = [9, 5, 12]
    ids = torch.randint(0, VOCAB - 1, (3, 12), generator=g)
    pos = index_tensor([list(range(12))] * 3, CPU)  # prefill (T=12 -> the 16 bucket), ragged lengths via logits
    li = index_tensor([[n - 1] for n in lens], CPU)
    for be in (plain, padded):
        be.out = be.target(slots, ids, pos, li)
    _same(plain.out[0], padded.out[0], "prefill logits")
    _same(plain.out[1], padded.out[1], "prefill taps")
    for T in (1, 3, 5, 16):  # chains at ragged pasts
        ids = torch.randint(0, VOCAB - 1, (3, T), generator=g)
        pos = index_tensor([list(range(n, n + T)) for n in lens], CPU)
        li = index_tensor([list(range(T))] * 3, CPU)
        a, b = plain.target(slots, ids, pos, li), padded.target(slots, ids, pos, li)
        _same(a[0], b[0], f"T={T} logits")
        _same(a[1], b[1], f"T={T} taps")
        assert torch.equal(a[0].argmax(-1), b[0].argmax(-1))
        lens = [n + 1 for n in lens]  # one token accepted: the rest is overwritten next call
    tree = torch.tril(torch.ones(3, 5, 5, dtype=torch.bool))
    tree[:, 3, 1:3] = False  # node 3 hangs off the root's first child only
    tree[:, 4, 1:4] = False
    ids = torch.randint(0, VOCAB - 1, (3, 5), generator=g)
    pos = index_tensor([[n, n + 1, n + 2, n + 1, n + 1] for n in lens], CPU)
    li = index_tensor([list(range(5))] * 3, CPU)
    a, b = plain.target(slots, ids, pos, li, tree), padded.target(slots, ids, pos, li, tree)
    _same(a[0], b[0], "tree logits")
    assert torch.equal(a[0].argmax(-1), b[0].argmax(-1))
    for ca, cb in zip(plain.tcache.k + plain.tcache.v, padded.tcache.k + padded.tcache.v, strict=True):
        assert torch.allclose(ca, cb[:max_batch, :, :SEQ], atol=1e-5)  # real slots and columns: the same K/V
    # the drafter: context C < B padded to B, with and without the conditioner's suffix inputs
    dc = plain.drafter_config
    B, d = dc.block_size, dc.layers.hidden_size
    C = 3
    taps = torch.randn(3, C, plain.target_config.hidden_size * dc.num_taps, generator=g)
    cpos = index_tensor([list(range(n - C, n)) for n in lens], CPU)
    block = torch.randint(0, VOCAB - 1, (3, B), generator=g)
    bpos = index_tensor([list(range(n, n + B)) for n in lens], CPU)
    suffix = SuffixInputs(torch.randn(3, B, d, generator=g), torch.randn(3, B, len(FEATURES), generator=g),
                          (torch.rand(3, B, generator=g) > 0.5).float(), torch.randint(0, C, (3, B), generator=g))
    for s in (None, suffix):
        a, b = plain.draft(slots, taps, cpos, block, bpos, s), padded.draft(slots, taps, cpos, block, bpos, s)
        _same(a[0], b[0], "draft hidden")
        _same(a[1], b[1], "draft logits")
    for ca, cb in zip(plain.dcache.k + plain.dcache.v, padded.dcache.k + padded.dcache.v, strict=True):
        assert torch.allclose(ca[:, :, B:], cb[:max_batch, :, B:B + SEQ], atol=1e-5)  # context (block: scratch)
    calls = padded.runner.calls
    assert {b.variant[-1] for b in calls} == {placed}
    assert {(b.step, b.rows, b.width) for b in calls} == {
        ("target", 4, 16), ("target", 4, 1), ("target", 4, 4), ("target", 4, 8), ("drafter", 4, B)}
    assert sum(calls.values()) == 8  # every call above went through a bucket (prefill T=12 too)


def test_a_placed_call_computes_the_same_bits_as_a_gathered_one(world):
    """The same request in slot 0 (a one-row call, placed: attention over a view of the cache's first row) and
    in slot 3 (gathered into a copy of its window): every logit, tap, drafter output and cache entry is
    bit-identical, so which path a call takes never changes a token (row invariance relies on it)."""
    _, padded = _pair_of_backends(world)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (1, 30), generator=g)
    dc = padded.drafter_config
    B = dc.block_size
    taps = torch.randn(1, 3, padded.target_config.hidden_size * dc.num_taps, generator=g)
    block = torch.randint(0, VOCAB - 1, (1, B), generator=g)
    outs = {}
    for slot in (0, 3):
        s = index_tensor([slot], CPU)
        got = [padded.target(s, ids[:, :12], index_tensor([list(range(12))], CPU), index_tensor([[11]], CPU))]
        for start, T in ((12, 1), (13, 5), (18, 16)):  # a decode step, verifies (their own buckets)
            got.append(padded.target(s, ids[:, start:start + T], index_tensor([list(range(start, start + T))], CPU),
                                     index_tensor([list(range(T))], CPU)))
        got.append(padded.draft(s, taps, index_tensor([[31, 32, 33]], CPU), block,
                                index_tensor([list(range(34, 34 + B))], CPU), None))
        outs[slot] = [t for pair in got for t in pair]
    for a, b in zip(outs[0], outs[3], strict=True):
        assert torch.equal(a, b)
    for cache in (padded.tcache, padded.dcache):
        for c in cache.k + cache.v:
            assert torch.equal(c[0, :, :SEQ], c[3, :, :SEQ])
    assert {b.variant[-1] for b in padded.runner.calls} == {True, False}


def _runtime(world, max_batch=8, oracle=True, **opts):
    t, d = load_pair(*world[:2])
    be = TorchBackend(t, d, max_batch=max_batch, max_seq_len=SEQ, static_shapes=True)
    if oracle:
        be = OracleDrafter(be, {tuple(p): p + g for p, g in zip(world[2], world[3], strict=True)})
    return Runtime(be, None, RuntimeOptions(**opts))


@pytest.mark.parametrize("batch", [1, 8])
def test_padded_steps_are_token_exact(world, batch):
    _, _, prompts, greedy = world
    want = [g[:MAX_NEW] for g in greedy[:batch]]
    for mode in ("ar", "dflash", "retrace"):
        rt = _runtime(world, verify_policy="fixed")
        out = rt.generate(prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), mode)
        assert [r.token_ids for r in out] == want, mode
        if mode != "ar":
            assert rt.run_stats()["tau"] > 1.5  # drafts were accepted: verify widths and contexts vary
    runner = rt.backend.inner.runner
    assert {b.width for b in runner.calls if b.step == "target"} <= set(VERIFY_WIDTHS)
    assert {b.rows for b in runner.calls} <= set(batch_buckets(8))


def test_padded_steps_exact_with_requests_joining_and_leaving_adaptive_and_trees(world):
    _, _, prompts, greedy = world
    want = [g[:MAX_NEW] for g in greedy]
    rt = _runtime(world, max_batch=3, verify_policy=steep_cost_policy(8))  # 8 requests in 3 slots, K varies
    for mode in ("dflash", "retrace"):
        assert [r.token_ids for r in rt.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)] == want
    ks = {b.width for b in rt.backend.inner.runner.calls if b.step == "target"}
    assert len(ks) >= 3, ks  # several verify widths were padded to their buckets
    rt = _runtime(world, max_batch=4, oracle=False, tree_budget=6, verify_policy="fixed")
    out = rt.generate(prompts[:4], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    assert [r.token_ids for r in out] == want[:4]
    assert any(b.variant[0] for b in rt.backend.runner.calls)  # tree verifies went through a bucket


def test_cuda_graphs_refused_without_cuda(world):
    assert isinstance(steps_runner(CPU, None), EagerSteps) and isinstance(steps_runner(CPU, False), EagerSteps)
    with pytest.raises(RetraceError, match="CUDA graphs need a CUDA device"):
        CUDAGraphSteps(CPU)
    with pytest.raises(RetraceError, match="CUDA graphs need a CUDA device .*--no-cuda-graphs"):
        Runtime.from_dirs(*world[:2], max_batch=2, max_seq_len=64, cuda_graphs=True)
    with pytest.raises(RetraceError, match="cuda_graphs applies to the torch backend"):
        Runtime.from_bundle(world[0], options=RuntimeOptions(cuda_graphs=True))
    rt = Runtime.from_dirs(*world[:2], max_batch=2, max_seq_len=64)  # the default on the CPU: unpadded, eager
    assert isinstance(rt.backend.runner, EagerSteps) and not rt.backend.static_shapes
    assert rt.backend.tcache.k[0].shape[0] == 2  # no scratch slot without static shapes
    from retrace.runtime.torch_concat import ConcatTorchBackend  # training's dense past has no padded steps

    with pytest.raises(RetraceError, match="ConcatTorchBackend has no padded steps"):
        ConcatTorchBackend(*load_pair(*world[:2]), max_batch=2, max_seq_len=64, static_shapes=True)
    assert options_from_flags({"no_cuda_graphs": True}).cuda_graphs is False
    assert options_from_flags({"no_cuda_graphs": False}).cuda_graphs is None  # the backend's default


def test_a_failed_capture_warns_once_and_runs_the_padded_steps_eagerly(world, monkeypatch):
    """A CPU-only torch claiming CUDA: the capture's first CUDA call fails, as a real capture failure would."""
    _, _, prompts, greedy = world
    rt = _runtime(world, oracle=False, verify_policy="fixed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runner = CUDAGraphSteps(torch.device("cuda"))
    rt.backend.runner = runner
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rt.generate(prompts[:2], SamplingParams(max_new_tokens=12), "retrace")
    assert [r.token_ids for r in out] == [g[:12] for g in greedy[:2]]
    said = [w for w in caught if "CUDA graph capture" in str(w.message)]
    assert len(said) == 1 and "running the steps eagerly" in str(said[0].message)
    assert runner.failed and runner.captures == 0 and sum(runner.calls.values()) > 2
