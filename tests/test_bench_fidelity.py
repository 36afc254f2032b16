"""Benchmark pieces that decide what the numbers mean: how tau is counted against transformers' DFlash,
that EOS stops no system early, prompt loading, and the interleaving order."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_bench_run import bench, entry, write_bench_pair

from retrace.bench.analysis import _committed, fidelity
from retrace.bench.prompts import load_prompts
from retrace.bench.runner import _order
from retrace.bench.systems import RunOut, count_dflash_rounds
from retrace.errors import RetraceError


def test_committed_cuts_only_the_final_round_to_the_tokens_kept():
    # n = 10 new tokens: 1 from the prefill, then rounds keeping 4 + 4 + 1 = 9
    assert _committed([3, 3, 3], 10) == [3, 3, 0]
    assert _committed([0, 2, 5], 6) == [0, 2, 0]  # 1 + 1 + 3 + 1 = 6
    assert _committed([], 1) == []


def test_fidelity_explains_the_truncated_final_round():
    ours = RunOut([[0] * 10], 1.0, accepted=[[3, 3, 3]])  # runtime counts a=3 in the last round
    hf = RunOut([[0] * 10], 1.0, accepted=[[3, 3, 0]])  # transformers keeps 1 token there
    f = fidelity({("retrace-torch-dflash-fixed", 1): [ours], ("hf-dflash", 1): [hf]}, 10)
    assert f["tau_ours"] == pytest.approx(4.0) and f["tau_hf"] == pytest.approx(3.0)
    assert f["tau_ours_tokens_kept"] == pytest.approx(3.0) and f["rel_gap_tokens_kept"] == pytest.approx(0.0)
    assert not f["within_1pct"] and f["prompts_identical_rounds"] == 1
    assert "final round" in f["explanation"] and "identical" in f["explanation"]


def test_fidelity_reports_diverging_rounds():
    ours = RunOut([[1] * 7], 1.0, accepted=[[1, 0, 2]])  # 1 + 2 + 1 + 3 = 7
    hf = RunOut([[1] * 7], 1.0, accepted=[[1, 1, 0, 0]])  # 1 + 2 + 2 + 1 + 1 = 7
    f = fidelity({("retrace-torch-dflash-fixed", 1): [ours], ("hf-dflash", 1): [hf]}, 7)
    assert f["prompts_identical_rounds"] == 0
    assert f["diverged"][0]["first_round"] == 1
    assert "argmax" in f["explanation"]


def test_dflash_round_hook_is_restored():
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator as G

    orig = G.update_candidate_strategy
    with count_dflash_rounds() as seen:
        assert G.update_candidate_strategy is not orig
        assert seen == []
    assert G.update_candidate_strategy is orig


def test_interleaving_rotates_the_start_over_runs():
    pairs = list("abcdef")
    orders = [_order(pairs, k, 3) for k in range(3)]
    assert [o[0] for o in orders] == ["a", "c", "e"]
    assert all(sorted(o) == pairs for o in orders)


def test_prompts_round_robin_limit_and_truncation(tmp_path):
    a = tmp_path / "code.jsonl"
    b = tmp_path / "docs.jsonl"
    a.write_text("\n".join(json.dumps({"prompt_ids": [i, i + 1, i + 2]}) for i in range(3)) + "\n")
    b.write_text(json.dumps({"prompt_ids": [7] * 9, "domain": "prose"}) + "\n\n")
    ps = load_prompts([tmp_path], None, limit=3, vocab_size=100, max_prompt_tokens=5)
    assert [p.domain for p in ps] == ["code", "prose", "code"]
    assert ps[1].ids == [7] * 5 and ps[1].truncated == 4
    with pytest.raises(RetraceError, match="tokenizer"):
        b.write_text(json.dumps({"prompt": "hi"}) + "\n")
        load_prompts([b], None)
    with pytest.raises(RetraceError, match=r"\[0, 3\)"):
        load_prompts([a], None, vocab_size=3)
    with pytest.raises(RetraceError, match="not found"):
        load_prompts([tmp_path / "missing.jsonl"], None)


def test_full_acceptance_eos_ignored_and_tau_conventions(tmp_path):
    """Every logit is exactly 0, so every system's greedy token is 0, which is EOS: nothing may stop early,
    every draft is accepted (tau = block size 4), and the final round is truncated by max_new_tokens
    (6 = 1 prefill token + 4 + 1), which our tau counts in full and transformers' does not."""
    import torch

    threads = torch.get_num_threads()
    target, drafter, prompts = write_bench_pair(tmp_path, zero_logits=True)
    try:
        r, _, _ = bench(tmp_path, target, drafter, prompts, "--systems", "hf-*,ortgenai-ar,retrace-torch-dflash-fixed",
                        "--batch-sizes", "1", "--peer-env", "inherit")  # one process: no worker starts
    finally:
        torch.set_num_threads(threads)
    assert r["agreement"]["all_exact_length"] and r["agreement"]["total_mismatched_prompts"] == 0
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        assert entry(r, "ortgenai-ar", 1)["status"] == "ok"
    d = entry(r, "retrace-torch-dflash-fixed", 1)
    assert d["accepted_hist"] == [0, 0, 0, 4]  # 2 prompts x 2 rounds, all drafts (3) accepted
    f = r["fidelity"]
    assert f["tau_ours"] == pytest.approx(4.0)
    assert f["tau_hf"] == pytest.approx(2.5)  # rounds keep 4 and 1 tokens
    assert f["tau_ours_tokens_kept"] == pytest.approx(2.5)
    assert f["prompts_identical_rounds"] == 2 and f["outputs_equal"]
