"""scripts/gpu_bench.sh --dry-run: every step of the prepared GPU benchmark runs on the CPU at toy size.

Checks what the real run is for: every section finished and wrote its figures; the controlled-tau rounds
(drafts from a greedy pre-pass) reach the tau they were built for and stay token-exact; the in-script
static-cache reference and transformers' eager decode produce our `ar` tokens on the same weights; a round
reads the host at most twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_bench.json").read_text())
    sec = data["sections"]["toy"]
    assert sec["status"] == "ok", sec.get("traceback")
    r = sec["result"]
    assert r["reference_static_cuda_graph"]["same_tokens_as_ar"] and r["transformers_eager"]["same_tokens_as_ar"]
    assert r["roofline"]["weight_bytes"] > 0 and r["roofline"]["read_all_weights_ms"] > 0
    for part in (r["drafter1"], r["drafter2"]):
        assert set(part["fixed_k"]) == {"0", "3", "7", "15"}
        assert all(v["ms_per_round"] > 0 for v in part["fixed_k"].values())
        assert {"target_T1_ms", "target_T16_ms", "draft_ms"} <= set(part["calls"])
        taus = part["controlled_tau"]
        assert all(t["lossless"] for t in taus.values())
        assert taus["1"]["tau"] == 1.0 and taus["3"]["tau"] > 2.5  # 8 tokens: the last round is cut short
        assert part["profile"]["retrace_k15"]["host_reads_per_round"] <= 2
    graphs = r["drafter1"]["graphs"]  # the CPU: no CUDA graphs; the padded steps eagerly, the same tokens
    assert set(graphs) == {"unpadded_eager", "padded_eager", "same_tokens"} and graphs["same_tokens"]
    assert graphs["padded_eager"]["buckets"] >= 3 and graphs["padded_eager"]["captures"] == 0
    win = r["drafter1"]["windows"]  # batch 8: the placed and the gathered step, each in its own bucket variant
    assert win["placed_T1_ms"] > 0 and win["gathered_T4_ms"] > 0
    assert {tuple(b) for b in win["buckets"]} >= {(8, 1, 64, True), (8, 1, 64, False), (8, 4, 64, True)}
    inv = r["drafter1"]["row_invariance"]  # on: every verify row the decode step's bits; lossless both ways here
    assert all(int(w) == n for w, n in inv["on"]["rows_matching_decodes"].items())
    assert all(t["lossless"] for side in ("on", "off") for t in inv[side]["controlled_tau_k15"].values())


def _ev(name, parent=None, stack=()):
    return SimpleNamespace(name=name, cpu_parent=parent, stack=list(stack))


def test_sync_sources_attributes_each_sync_to_its_retrace_line():
    from retrace.gpucheck.bench import sync_sources

    # torch 2.11 style: the frames in the aten op's stack (innermost first; a torch frame before ours)
    item = _ev("aten::_local_scalar_dense", _ev("aten::item"),
               ["torch/_tensor.py(40): item", "/work/main/retrace/runtime/loop.py(10): step",
                "retrace/runtime/runtime.py(3): generate"])
    # torch 2.13 style: the frames are events in the cpu_parent chain; HostReads' frame is skipped
    caller = _ev("retrace/runtime/device.py(5): to_device", _ev("retrace/runtime/loop.py(99): step"))
    copy = _ev("aten::copy_", _ev("aten::to", _ev("retrace/gpucheck/bench.py(142): __torch_function__", caller)))
    events = [_ev("cudaStreamSynchronize", item), _ev("aten::mm"), _ev("cudaStreamSynchronize", copy),
              _ev("cudaStreamSynchronize", item), _ev("cudaDeviceSynchronize")]
    assert sync_sources(events, rounds=2) == [
        {"kind": "cudaStreamSynchronize", "op": "aten::_local_scalar_dense", "where": "retrace/runtime/loop.py:10 step",
         "per_round": 1.0},
        {"kind": "cudaStreamSynchronize", "op": "aten::copy_", "where": "retrace/runtime/device.py:5 to_device",
         "per_round": 0.5},
        {"kind": "cudaDeviceSynchronize", "op": "(no aten op)", "where": "(no python frame)", "per_round": 0.5}]
    # memcpy: counted under a blocking copy op only; frames outside the package (a checkout named retrace) ignored
    venv = _ev("aten::add", None, ["/home/u/retrace/.venv/lib/site-packages/torch/x.py(1): f"])
    memcpys = [_ev("cudaMemcpyAsync", copy), _ev("cudaMemcpyAsync", venv), _ev("cudaLaunchKernel", copy)]
    assert sync_sources(memcpys, rounds=1, top=5) == [
        {"kind": "cudaMemcpyAsync", "op": "aten::copy_", "where": "retrace/runtime/device.py:5 to_device",
         "per_round": 1.0}]


def test_sync_sources_on_a_real_cpu_profile():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from retrace.gpucheck.bench import sync_sources

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        (x @ x).sum().item()
    assert sync_sources(prof.events(), rounds=1) == []  # no Synchronize events on the CPU
