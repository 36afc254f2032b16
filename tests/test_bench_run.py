"""`retrace bench` end to end on a tiny random pair: JSON contract, ratios, plots, markdown, fidelity.

One benchmark run (module fixture) feeds most tests: 2 prompts of two domains, 1 run, 6 new tokens, batch
sizes 1 and 2, one thread. The ONNX Runtime backend is not built here (`--no-build-engine`: the export
takes longer than this whole file) and must show up as skipped with its reason; onnxruntime-genai's build
of the tiny target takes seconds and is kept.
"""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest
from click.testing import CliRunner
from helpers import patch_json, write_drafter, write_target

from retrace.bench.config import PEERS
from retrace.cli import main

N = 6
TEXTS = [
    "def parse(argv):\n    return [a for a in argv if a]\n",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "for i in range(10):\n    print(i, i * i)\n" * 4,
]


def write_bench_pair(root, zero_logits: bool = False):
    """A random Qwen3 target with a byte-level BPE tokenizer (onnxruntime-genai needs tokenizer files) and a
    DFlash drafter with a random ReTrace conditioner. EOS is token 0, pad is 1.

    zero_logits: zero the final norms of target and drafter, so every logit is exactly 0 and every system's
    argmax is token 0 (= EOS): drafts are always right (tau = block size) and EOS must not stop anything."""
    import torch
    from safetensors.torch import load_file, save_file

    from retrace.train.tokenizer import save_tokenizer, train_bpe

    tok = train_bpe(TEXTS, 300, min_frequency=1)
    target = write_target(root / "target", vocab=tok.get_vocab_size(), hidden=32, layers=2, heads=2, kv_heads=1,
                          intermediate=64, max_pos=256, eos_token_id=0, seed=5)
    patch_json(target / "config.json", pad_token_id=1, bos_token_id=0)
    save_tokenizer(tok, target)
    drafter = write_drafter(root / "drafter", target, block_size=4, conditioner="random", seed=6)
    if zero_logits:
        for f, key in ((target / "model.safetensors", "model.norm.weight"),
                       (drafter / "model.safetensors", "norm.weight")):
            w = load_file(f)
            w[key] = torch.zeros_like(w[key])
            save_file(w, f, metadata={"format": "pt"})
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def parse(argv):\n    return", "domain": "code"}) + "\n"
        + json.dumps({"prompt": "The quick brown fox jumps", "domain": "docs"}) + "\n"
        + json.dumps({"prompt": "for i in range(10):", "domain": "code"}) + "\n")
    return target, drafter, prompts


def bench(root, target, drafter, prompts, *extra):
    out = root / "out"
    args = ["bench", "--target", target, "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", N,
            "--batch-sizes", "1,2", "--runs", 1, "--limit", 2, "--threads", 1, "--no-build-engine",
            "--cache-dir", root / "cache", "--json", out / "bench.json", "--plot", out / "bench.png", *extra]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return json.loads((out / "bench.json").read_text()), res, out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("bench")
    target, drafter, prompts = write_bench_pair(root)
    try:
        # the library-default environments (test_bench_peers covers measuring the candidates)
        results, res, out = bench(root, target, drafter, prompts, "--readme-table", "--peer-env", "defaults")
    finally:
        torch.set_num_threads(threads)
    return {"results": results, "res": res, "out": out, "root": root}


def entry(results, name, b):
    return next(s for s in results["systems"] if s["name"] == name and s["batch_size"] == b)


def test_json_has_every_system_and_field(run):
    r = run["results"]
    for key in ("systems", "ratios", "fidelity", "machine", "command", "agreement", "per_domain", "goals"):
        assert key in r
    assert r["command"].startswith("retrace bench --target")
    m = r["machine"]
    assert m["cpu"] and m["threads"] == 1 and m["versions"]["torch"] and m["logical_cores"] >= 1
    names = {s["name"] for s in r["systems"]}
    expected = {"hf-ar", "hf-dflash", "ortgenai-ar", *(f"retrace-{b}-{m}" for b in ("torch", "onnxruntime")
                                                      for m in ("ar", "dflash", "retrace"))}
    assert expected <= names
    for s in r["systems"]:
        for key in ("name", "batch_size", "tokens_per_s", "tokens_per_s_runs", "tau", "time_split", "status"):
            assert key in s, (s["name"], key)
    genai = importlib.util.find_spec("onnxruntime_genai") is not None  # the `bench` extra
    if not genai:
        assert entry(r, "ortgenai-ar", 1)["status"] == "skipped"
    for b in (1, 2):
        for name in ("hf-ar", "ortgenai-ar" if genai else "hf-ar", "retrace-torch-ar", "retrace-torch-dflash",
                     "retrace-torch-retrace"):
            s = entry(r, name, b)
            assert s["status"] == "ok", s
            assert len(s["tokens_per_s_runs"]) == 1 and s["tokens_per_s"] > 0
            assert s["tokens_per_run"] == 2 * N and s["exact_length"]
        assert entry(r, "hf-ar", b)["tau"] is None and entry(r, "retrace-torch-ar", b)["tau"] is None
        assert entry(r, "retrace-torch-dflash", b)["tau"] >= 1.0
        d = entry(r, "retrace-torch-dflash", b)  # tau per prompt beside the pooled one: 2 prompts
        per = d["tau_per_prompt"]
        assert len(per) == 2 and min(per) <= d["tau"] <= max(per)
        assert d["tau_prompt_mean"] == pytest.approx(sum(per) / 2)
        ts = entry(r, "retrace-torch-retrace-fixed", b)["time_split"]  # (adaptive: maybe no draft call)
        assert ts["draft_s"] > 0 and ts["verify_s"] > 0 and 0 <= ts["outside_forward_share"] <= 1
        fixed, adaptive = entry(r, "retrace-torch-retrace-fixed", b), entry(r, "retrace-torch-retrace", b)
        assert fixed["verify_hist"] == [0, 0, 0, fixed["rounds"]]  # block 4: always 3 drafts
        assert sum(adaptive["verify_hist"]) == adaptive["rounds"]
        for name in ("retrace-onnxruntime-ar", "retrace-onnxruntime-retrace"):
            s = entry(r, name, b)
            assert s["status"] == "skipped" and s["reason"] and s["tokens_per_s"] is None
    assert entry(r, "hf-dflash", 1)["status"] == "ok" and entry(r, "hf-dflash", 1)["tau"] >= 1.0
    na = entry(r, "hf-dflash", 2)
    assert na["status"] == "n/a" and "batch 1" in na["reason"] and na["tokens_per_s"] is None


def test_greedy_outputs_agree_across_systems(run):
    r = run["results"]
    assert r["agreement"]["reference"] == "hf-ar@b1"
    assert r["agreement"]["all_exact_length"]
    assert r["agreement"]["total_mismatched_prompts"] == 0, r["agreement"]


def test_ratios_are_tokens_per_s_over_the_peer_at_the_same_batch(run):
    r = run["results"]
    ok = {(s["name"], s["batch_size"]): s for s in r["systems"] if s["status"] == "ok"}
    assert r["ratios"]
    for x in r["ratios"]:
        assert x["system"].startswith("retrace-") and (x["peer"] in PEERS or x["peer"] == "fastest-peer")
        peer = ok.get((x.get("peer_name") or x["peer"], x["batch_size"]))
        if peer is None:
            assert x["ratio"] is None
        else:
            want = ok[(x["system"], x["batch_size"])]["tokens_per_s"] / peer["tokens_per_s"]
            assert x["ratio"] == pytest.approx(want)
    assert any(x["peer"] == "hf-dflash" and x["batch_size"] == 2 and x["ratio"] is None for x in r["ratios"])
    # the per-round analysis uses the same ratio, against the fastest AR peer present
    for a in r["analysis"]:
        want = ok[(a["system"], a["batch_size"])]["tokens_per_s"] / ok[(a["peer"], a["batch_size"])]["tokens_per_s"]
        assert a["ratio"] == pytest.approx(want)
        # a round's wall time holds its two forwards (verify_ms is per target call, prefills included, and
        # draft_ms per draft call, which adaptive rounds skip: their sum bounds nothing)
        assert a["outside_forward_ms_per_round"] >= -1e-9


def test_fidelity_line_compares_dflash_with_transformers(run):
    f = run["results"]["fidelity"]
    assert f["rounds_ours"] > 0 and f["rounds_hf"] > 0
    assert f["tau_ours_tokens_kept"] == pytest.approx(f["tau_hf"], rel=1e-9) or f["diverged"]
    assert f["explanation"]
    assert "fidelity" in run["res"].output


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_pngs(run):
    out = run["out"]
    for name in ("bench.png", "bench-throughput.png", "bench-accept.png", "bench-domains.png"):
        w, h = _png_size(out / name)
        assert w > 200 and h > 200
    assert set(run["results"]["plots"]) == {"combined", "throughput", "accept", "domains"}


def test_markdown_table_renders_and_regenerates_from_json(run):
    from retrace.bench import render_markdown

    r = run["results"]
    md = render_markdown(r)
    lines = md.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| system"))
    assert set(lines[header + 1]) <= set("|-:")
    rows = [line for line in lines[header + 2:] if line.startswith("| `")]
    assert len(rows) == len(r["systems"])
    assert all(line.count("|") == lines[header].count("|") for line in rows)
    assert "| `retrace-torch-retrace` | 1 |" in md and "fidelity" in md
    assert "| system |" in run["res"].output  # --readme-table printed it
    # regenerate the table (and plots) from the saved JSON, without running anything
    res = CliRunner().invoke(main, ["bench", "--from-json", str(run["out"] / "bench.json"), "--readme-table",
                                    "--plot", str(run["root"] / "again.png")])
    assert res.exit_code == 0, res.output
    assert md in res.output
    _png_size(run["root"] / "again.png")


def test_user_errors_are_one_line(tmp_path):
    res = CliRunner().invoke(main, ["bench", "--target", str(tmp_path), "--drafter", str(tmp_path)])
    assert res.exit_code == 2 and "--prompts" in res.output
    res = CliRunner().invoke(main, ["bench", "--from-json", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "cannot read" in res.output


@pytest.mark.slow
def test_onnxruntime_backend_from_engine_bundle(tmp_path):
    """--engine: the ONNX Runtime backend's three modes run and agree with transformers token for token
    (the session's shared test bundle; building it costs ~30 s when no export test ran before)."""
    import torch
    from export_fixtures import MAX_BATCH, pair_and_bundle

    built = pair_and_bundle()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p, "domain": d}) + "\n"
                               for p, d in (([5, 9, 13, 2], "a"), ([40, 41], "b"), ([7] * 6, "a"))))
    threads = torch.get_num_threads()
    try:
        r, res, _ = bench(tmp_path, built.target, built.drafter, prompts, "--engine", built.bundle,
                          "--systems", "hf-ar,retrace-onnxruntime-*", "--limit", 3,
                          "--batch-sizes", f"1,{min(2, MAX_BATCH)}", "--profile", tmp_path / "prof.out",
                          "--peer-env", "defaults")
    finally:
        torch.set_num_threads(threads)
    for b in (1, 2):
        for m in ("ar", "dflash", "retrace"):
            s = entry(r, f"retrace-onnxruntime-{m}", b)
            assert s["status"] == "ok" and s["tokens_per_run"] == 3 * N, s
            assert s["time_split"]["forward_s"] > 0
            assert any(x["system"] == s["name"] and x["peer"] == "hf-ar" and x["ratio"] for x in r["ratios"])
    assert r["agreement"]["total_mismatched_prompts"] == 0, r["agreement"]
    assert r["builds"]["onnxruntime_bundle"]["given"]
    assert r["profile"]["system"] == "retrace-onnxruntime-retrace" and (tmp_path / "prof.out").is_file()
    assert r["goals"]["system"] == "retrace-onnxruntime-retrace"


def test_tree_systems_run_under_the_policy_and_at_fixed_budgets(tmp_path):
    """--tree-budget 6 adds retrace-<backend>-<mode>-tree (the verify policy picks <= 6 nodes a round),
    --tree-fixed 3 adds -tree3-fixed (exactly 3: at most 2 verified beyond the root); same tokens as ar."""
    import torch

    threads = torch.get_num_threads()
    target, drafter, prompts = write_bench_pair(tmp_path)
    try:
        results, _, _ = bench(tmp_path, target, drafter, prompts, "--systems",
                              "retrace-torch-ar,retrace-torch-dflash-tree*",
                              "--tree-budget", 6, "--tree-fixed", 3, "--peer-env", "inherit")
    finally:
        torch.set_num_threads(threads)
    names = {s["name"] for s in results["systems"] if s["status"] == "ok"}
    assert names == {"retrace-torch-ar", "retrace-torch-dflash-tree", "retrace-torch-dflash-tree3-fixed"}, names
    for b in (1, 2):
        fixed = entry(results, "retrace-torch-dflash-tree3-fixed", b)
        assert len(fixed["verify_hist"]) <= 3 and fixed["agreement"]["prompts_mismatched"] == 0, fixed
        assert entry(results, "retrace-torch-dflash-tree", b)["agreement"]["prompts_mismatched"] == 0


def test_ratios_compare_at_the_same_weight_precision():
    """An int4 system is compared with the peer of the same precision (its name's suffix), never with the
    fp32 peer; a precision the peer lacks gives no ratio."""
    from retrace.bench.analysis import ratios
    from retrace.bench.precision import of_name

    assert (of_name("retrace-onnxruntime-ar-int4b256"), of_name("ortgenai-ar-int8"), of_name("hf-ar")) == (
        "-int4b256", "-int8", "")

    def system(name, tps, family="retrace"):
        return {"name": name, "family": family, "status": "ok", "batch_size": 1, "tokens_per_s": tps}

    got = {(r["system"], r["peer"]): r["ratio"] for r in ratios([
        system("retrace-onnxruntime-ar-int4b256", 40.0), system("retrace-onnxruntime-ar", 10.0),
        system("retrace-onnxruntime-ar-int8", 20.0), system("ortgenai-ar-int4b256", 50.0, "ortgenai"),
        system("ortgenai-ar", 12.5, "ortgenai")])}
    assert got["retrace-onnxruntime-ar-int4b256", "ortgenai-ar"] == pytest.approx(0.8)
    assert got["retrace-onnxruntime-ar", "ortgenai-ar"] == pytest.approx(0.8)
    assert got["retrace-onnxruntime-ar-int8", "ortgenai-ar"] is None


def test_the_fastest_peer_is_whoever_ran_fastest_at_the_same_batch_and_width():
    """"x fastest peer": over the fastest peer system of the same batch size and weight width, onnxruntime-genai's
    or llama.cpp's (its GGUF type names the width), never one of ours and never another width."""
    from retrace.bench.analysis import ratios
    from retrace.bench.precision import width_of

    assert [width_of(n) for n in ("llamacpp-dflash-q4_k_m", "llamacpp-ar-q8_0", "ortgenai-ngram-int4b256",
                                  "retrace-onnxruntime-ar", "hf-ar")] == ["int4", "int8", "int4", "fp32", "fp32"]

    def system(name, tps, family="peer", b=1):
        return {"name": name, "family": family, "status": "ok", "batch_size": b, "tokens_per_s": tps}

    got = {(r["system"], r["batch_size"]): r for r in ratios([
        system("retrace-onnxruntime-retrace-int4b256", 80.0, "retrace"),
        system("retrace-onnxruntime-ar", 9.0, "retrace"),
        system("retrace-onnxruntime-ar-int4b256", 60.0, "retrace", b=4),
        system("ortgenai-ngram-int4b256", 64.0), system("llamacpp-server-ngram-q4_k_m", 40.0),
        system("llamacpp-dflash-q4_k_m", 30.0, b=4), system("ortgenai-ar", 12.0), system("llamacpp-ar-q8_0", 99.0),
    ]) if r["peer"] == "fastest-peer"}
    assert got["retrace-onnxruntime-retrace-int4b256", 1]["peer_name"] == "ortgenai-ngram-int4b256"
    assert got["retrace-onnxruntime-retrace-int4b256", 1]["ratio"] == pytest.approx(1.25)
    assert got["retrace-onnxruntime-ar", 1]["peer_name"] == "ortgenai-ar"
    assert got["retrace-onnxruntime-ar-int4b256", 4]["peer_name"] == "llamacpp-dflash-q4_k_m"



def test_draft_call_is_reported_against_the_decode_step_of_the_same_backend_and_precision():
    """Issue 26's measure in every bench: a drafting system's forward time per draft call over plain decoding's
    per decode step (its target calls after one prefill call per prompt), same backend and weight width."""
    from retrace.bench.report import draft_cost_lines

    def system(name, backend, **split):
        return {"name": name, "family": "retrace", "backend": backend, "status": "ok", "batch_size": 1,
                "time_split": split}

    ar = dict(target_forward_s=12.0, prefill_s=2.0, target_calls=504.0, draft_calls=0.0, draft_ms_per_call=None)
    results = {"config": {"n_prompts": 4}, "systems": [
        system("retrace-onnxruntime-ar-int4b256", "onnxruntime", **ar),  # 500 decode steps of 20 ms
        system("retrace-onnxruntime-retrace-int4b256", "onnxruntime", draft_calls=100.0, draft_ms_per_call=5.0),
        system("retrace-onnxruntime-retrace", "onnxruntime", draft_calls=100.0, draft_ms_per_call=5.0),  # no fp32 ar
        system("retrace-torch-ar", "torch", **{**ar, "target_calls": 4.0})]}  # no decode step to compare with
    assert draft_cost_lines(results) == ["retrace-onnxruntime-retrace-int4b256 5.00 ms = 0.25 of "
                                         "retrace-onnxruntime-ar-int4b256's 20.00 ms decode step (100 calls a run)"]
