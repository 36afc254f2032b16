"""The ONNX Runtime backend end to end: `Runtime.from_bundle` decodes exactly what `Runtime.from_dirs` (torch)
and transformers' greedy `generate` do, in ar / dflash / retrace modes, batch 1 and ragged batches, with
drafts that are mostly rejected (random drafter) and mostly accepted (oracle drafter: every acceptance
length occurs, so K/V rewinds, ragged acceptance and slot reuse all run through ORT); and
`retrace generate --engine` through click's CliRunner.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from export_fixtures import BLOCK, MAX_BATCH, MAX_SEQ, VOCAB, pair_and_bundle
from runtime_fixtures import OracleDrafter, hf_greedy, load_hf_target, steep_cost_policy, words

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
from retrace.runtime.row_invariance import SPARE, RowWidths, rows_matching_decodes
from retrace.runtime.tokenizer import TextCodec

MAX_NEW = 64
PROMPT_LENS = [6, 1, 13, 3, 21, 9]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(one_thread):
    built = pair_and_bundle()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]
    hf = load_hf_target(built.target)
    greedy = [hf_greedy(hf, p, MAX_NEW + BLOCK + 2) for p in prompts]
    return built, prompts, greedy


def ort_runtime(built, oracle_seqs=None, policy="fixed", **kw) -> Runtime:
    be = OnnxRuntimeBackend.from_bundle(built.bundle, threads=1, **kw)
    if oracle_seqs is not None:
        be = OracleDrafter(be, oracle_seqs, seed=3)
    return Runtime(be, TextCodec.find(built.bundle / "tokenizer"), verify_policy=policy)


def check(results, want, label):
    for i, (r, w) in enumerate(zip(results, want, strict=True)):
        assert r.token_ids == w, f"{label}, prompt {i}: got {r.token_ids[:12]}..., want {w[:12]}..."


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["ar", "dflash", "retrace"])
def test_greedy_equals_torch_backend_and_transformers(world, mode, batch):
    """The default (adaptive) verify policy on ONNX Runtime, the fixed one on torch: same tokens; the
    fixed policy's rounds are the same on both backends."""
    built, prompts, greedy = world
    params = SamplingParams(max_new_tokens=MAX_NEW)
    want = [g[:MAX_NEW] for g in greedy[:batch]]
    ort_res = Runtime.from_bundle(built.bundle, max_batch=MAX_BATCH, threads=1).generate(prompts[:batch], params, mode)
    check(ort_res, want, f"onnxruntime {mode} batch {batch}")
    fixed = {}
    for name, rt in (("torch", Runtime.from_dirs(built.target, built.drafter, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ,
                                                 verify_policy="fixed")),
                     ("onnxruntime", Runtime.from_bundle(built.bundle, max_batch=MAX_BATCH, threads=1,
                                                         verify_policy="fixed"))):
        fixed[name] = rt.generate(prompts[:batch], params, mode)
        assert [r.token_ids for r in fixed[name]] == [r.token_ids for r in ort_res]
    assert ([r.stats["accepted_hist"] for r in fixed["onnxruntime"]]
            == [r.stats["accepted_hist"] for r in fixed["torch"]])
    assert all(r.text == words(r.token_ids) for r in ort_res)  # the bundle's tokenizer


@pytest.mark.parametrize("mode", ["ar", "retrace"])
def test_one_lm_head_session_decodes_exactly(world, mode):
    """The LM head of both graphs in one session of its own (retrace.runtime.lm_head_split; forced on: the
    tiny table is under the size that turns it on by default), with ragged acceptance and slot reuse
    (oracle drafter, 6 requests through 4 slots): transformers' greedy tokens."""
    built, prompts, greedy = world
    seqs = {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}
    rt = ort_runtime(built, seqs if mode != "ar" else None, lm_head_session=True)
    assert (rt.backend.inner if mode != "ar" else rt.backend).head is not None
    check(rt.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), mode), [g[:MAX_NEW] for g in greedy],
          f"lm_head session {mode}")


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_accepted_drafts_slot_reuse_and_ragged_acceptance(world, mode, policy):
    """6 requests through 4 slots with an oracle drafter: finished requests free slots mid-run (the
    next call's slots are no longer a contiguous range); fixed: every acceptance length 0..B-1 occurs;
    adaptive (a fixed cost model): K varies, outputs the same."""
    built, prompts, greedy = world
    seqs = {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}
    rt = ort_runtime(built, seqs, policy="fixed" if policy == "fixed" else steep_cost_policy(BLOCK))
    res = rt.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)
    check(res, [g[:MAX_NEW] for g in greedy], f"oracle {mode} {policy}")
    stats = rt.run_stats()
    assert stats["tau"] > 1.5 and stats["backend"].startswith("oracle(onnxruntime")
    if policy == "fixed":
        assert len(stats["accepted_hist"]) == BLOCK and all(n > 0 for n in stats["accepted_hist"])
    else:
        assert len([n for n in stats["verify_hist"] if n]) >= 3, stats["verify_hist"]
    if mode == "retrace":
        assert rt.backend.suffix_valid_slots > 0


def test_full_kv_mode_decodes_the_same(world):
    built, prompts, greedy = world
    seqs = {tuple(p): p + g for p, g in zip(prompts, greedy, strict=True)}
    rt = ort_runtime(built, seqs, kv_mode="full")
    res = rt.generate(prompts[:4], SamplingParams(max_new_tokens=32), "retrace")
    check(res, [g[:32] for g in greedy[:4]], "kv_mode=full")


def test_smaller_block_and_limits(world):
    built, prompts, greedy = world
    rt = Runtime.from_bundle(built.bundle, block_size=4, threads=1)
    check(rt.generate(prompts[:2], SamplingParams(max_new_tokens=24), "dflash"), [g[:24] for g in greedy[:2]],
          "block 4")
    be = rt.backend
    assert be.name == "onnxruntime" and be.max_batch == MAX_BATCH and be.max_seq_len == MAX_SEQ
    assert be.has_conditioner and be.drafter_config.block_size == BLOCK
    assert be.active_providers[-1] == "CPUExecutionProvider"
    with pytest.raises(RetraceError, match="exceeds the bundle's limit"):
        OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=MAX_BATCH + 1, verify=False)
    with pytest.raises(RetraceError, match="max_seq_len=.* exceeds the bundle's limit"):
        OnnxRuntimeBackend.from_bundle(built.bundle, max_seq_len=MAX_SEQ + 1, verify=False)
    with pytest.raises(RetraceError, match="exceeds the configured max length"):
        rt.generate([prompts[0]], SamplingParams(max_new_tokens=MAX_SEQ), "ar")
    with pytest.raises(RetraceError, match="unknown kv_mode"):
        OnnxRuntimeBackend.from_bundle(built.bundle, kv_mode="paged", verify=False)


def test_returns_torch_tensors_without_copies(world):
    built, prompts, _ = world
    be = OnnxRuntimeBackend.from_bundle(built.bundle, threads=1, verify=False)
    ids = torch.tensor([prompts[0]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    logits, taps = be.target(torch.tensor([1]), ids, pos, torch.tensor([[ids.shape[1] - 1]]))
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.shape == (1, 1, VOCAB)
    assert taps.shape == (1, ids.shape[1], be.drafter_config.num_taps * be.target_config.hidden_size)
    # the K/V landed in slot 1 at positions 0..T-1 (and at most a pad row's at T, retrace.runtime.row_invariance:
    # the next call overwrites it), nothing elsewhere
    k0, T = be.tcache.k[0], ids.shape[1]
    assert (k0[1, :, :T].abs().sum() > 0 and k0[0].abs().sum() == 0 and k0[1, :, T + SPARE:].abs().sum() == 0)


def test_verify_rows_are_bit_identical_to_the_decode_steps(world):
    """fp32: GroupQueryAttention's one-token path differs from its wider one (retrace.runtime.row_invariance),
    so the in-place graph gives it a pad row: each row of a T-token call then equals the decode step's
    logits bit for bit (T = 2..9), with no padding of the call itself (float MatMul is row-invariant)."""
    be = OnnxRuntimeBackend.from_bundle(world[0].bundle, threads=1, verify=False)
    assert be.inplace.pad and be.widths == RowWidths(tokens="any", rows="any")
    got = rows_matching_decodes(be)
    assert got == {w: w for w in got}, got
    plain = Runtime.from_bundle(world[0].bundle, threads=1, verify_bundle=False, row_invariant=False).backend
    assert plain.widths is None and not plain.inplace.pad  # --no-row-invariance: the calls at their own widths
    # model dirs: the torch backend's own row invariance (tests/test_torch_row_invariance.py)
    assert not Runtime.from_dirs(world[0].target, world[0].drafter, row_invariant=False).backend.row_invariant


def test_lazy_drafter_opens_at_the_first_draft_and_decodes_the_same(world):
    """lazy_drafter: plain decoding never makes the drafter's session; the first draft call makes it, and a
    request that drafts after plain ones decodes exactly as on an eagerly loaded backend."""
    built, prompts, greedy = world
    rt = Runtime.from_bundle(built.bundle, threads=1, lazy_drafter=True)
    be = rt.backend
    check(rt.generate(prompts[:2], SamplingParams(max_new_tokens=24), "ar"), [g[:24] for g in greedy[:2]], "ar")
    assert be._dgraph is None and be._dcache is None
    check(rt.generate(prompts[:3], SamplingParams(max_new_tokens=24), "retrace"), [g[:24] for g in greedy[:3]],
          "retrace after ar")
    assert be._dgraph is not None and be.open_drafter() is be._dgraph  # made once


# -- the CLI ----------------------------------------------------------------------------------------------
def test_generate_cli_with_engine_matches_dirs(world):
    from retrace.cli import main

    built, prompts, greedy = world
    common = ["--prompt", words(prompts[2]), "--max-new-tokens", "20", "--json", "--threads", "1",
              "--max-batch", str(MAX_BATCH)]
    out = {}
    for name, src in (("engine", ["--engine", str(built.bundle)]),
                      ("plain", ["--engine", str(built.bundle), "--no-row-invariance"]),
                      ("dirs", ["--target", str(built.target), "--drafter", str(built.drafter), "--max-seq-len",
                                str(MAX_SEQ)])):
        res = CliRunner().invoke(main, ["generate", *src, *common])
        assert res.exit_code == 0, (res.output, res.exception)
        out[name] = json.loads(res.stdout)
    e, d = out["engine"], out["dirs"]
    assert set(e) == set(d) and set(e["outputs"][0]) == set(d["outputs"][0]) and set(e["stats"]) == set(d["stats"])
    assert e["outputs"][0]["token_ids"] == d["outputs"][0]["token_ids"] == greedy[2][:20]
    assert out["plain"]["outputs"][0]["token_ids"] == greedy[2][:20]
    assert e["outputs"][0]["text"] == words(greedy[2][:20])
    assert e["stats"]["backend"] == "onnxruntime" and d["stats"]["backend"] == "torch"


def test_generate_cli_engine_errors_are_one_line(world, tmp_path):
    from retrace.cli import main

    res = CliRunner().invoke(main, ["generate", "--engine", str(tmp_path), "--prompt-ids", "1,2", "--json"])
    assert res.exit_code == 2 and res.output.startswith("error:") and "no manifest.json" in res.output


def test_cache_matches_torch_kvcache_semantics():
    """The ORT backend's cache writes/reads exactly like the torch backend's KVCache, for consecutive
    positions (slice path), clamped pad positions (index path), contiguous and scattered slots."""
    from retrace.runtime.onnxruntime_backend import _Cache
    from retrace.runtime.torch_backend import KVCache

    g = torch.Generator().manual_seed(0)
    ours, ref = _Cache(2, 5, 2, 12, 4, torch.float32), KVCache(2, 5, 2, 12, 4, torch.float32)
    steps = [
        (torch.tensor([0, 1, 2]), torch.arange(4).expand(3, 4)),                 # prefill, contiguous slots
        (torch.tensor([4, 1]), torch.tensor([[4, 5, 6], [8, 9, 10]])),           # scattered slots
        (torch.tensor([2, 0]), torch.tensor([[9, 10, 11], [10, 11, 11]])),       # clamped at max_seq_len - 1
    ]
    for slots, pos in steps:
        new = [torch.randn(len(slots), 2, pos.shape[1], 4, generator=g) for _ in range(4)]
        ours.write(slots, pos, torch.stack(new))
        ref.write(slots, pos, new[0::2], new[1::2])
    for a, b in zip(ours.k + ours.v, ref.k + ref.v, strict=True):
        assert torch.equal(a, b)
    for slots in (torch.tensor([1, 2]), torch.tensor([4, 0, 2])):
        for mode in ("gather", "full"):
            got = ours.past(slots, 7, mode)
            pk, pv = ref.past(slots, 7)
            want = [t for kv in zip(pk, pv, strict=True) for t in kv]
            for x, y in zip(got, want, strict=True):
                assert x.is_contiguous()
                assert torch.equal(x[:, :, :7], y)
