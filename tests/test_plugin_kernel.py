"""GatedSuffixFusion Triton kernels vs the torch reference, run by Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton (and our kernels) are imported and must not leak into
other test modules, so the comparison runs once in a child process that reports max abs diffs as
JSON; the tests below assert on that report. The AOT-compile tests run here too: triton compiles
PTX for an explicit GPU target without a GPU (its bundled ptxas).

Tolerances (max |kernel - reference|, both against the float64 reference of the same inputs):
fp32 <= 2e-5 (+ the reference's own fp32 error); fp16 <= 4e-3 and bf16 <= 4e-2, each also within
3x the error of the torch reference computed in that dtype (one output ulp can
split them). fp32 kernel vs fp32 reference directly: <= 1e-5. Invalid slots must equal x bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retrace.gpucheck.kernels import ABS_TOL  # the GPU check uses the same tolerances

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, torch
from retrace.plugins import triton_kernel as tk
from retrace.plugins.gated_suffix_fusion import gated_suffix_fusion_reference as ref

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SMALL = tk.Tile(99, 16, 16, 16, 1, 1)  # d=24 -> partial tiles along N and along K

def make(n, b, d, f, dtype, valid_mode, seed):
    """The op's inputs and weights (the GPU check builds its cases with the same function)."""
    from retrace.gpucheck.kernels import make as make_case

    return make_case(n, b, d, f, dtype, valid_mode, seed, "cpu")

out = {}
for name, (n, b, d, f, dt, valid_mode, tile) in json.loads(sys.argv[1]).items():
    dtype = DT[dt]
    args = make(n, b, d, f, dtype, valid_mode, seed=len(out))
    t = SMALL if tile == "small" else tk.DEFAULT_TILE
    got = tk.run_gated_suffix_fusion(*args, eps=1e-6, tile=t)
    exact = ref(*(a.double() for a in args))
    same_dtype = ref(*args)
    valid = args[4] != 0
    vm = valid.unsqueeze(-1).expand_as(got)
    def diff(a):
        return (a.double() - exact).abs()[vm].max().item() if vm.any() else 0.0
    out[name] = {
        "kernel_err": diff(got),
        "ref_err": diff(same_dtype),
        "vs_ref": (got.double() - same_dtype.double()).abs()[vm].max().item() if vm.any() else 0.0,
        "invalid_exact": bool(torch.equal(got[~valid], args[0][~valid])),
        "finite": bool(torch.isfinite(got).all()),
        "dtype_ok": got.dtype == dtype and got.shape == args[0].shape,
    }
print("RESULT" + json.dumps(out))
'''

# name: (N, B, d, F, dtype, valid, tile)
CASES = {
    "fp32_partial_all": (2, 5, 24, 3, "fp32", "all", "small"),
    "fp32_partial_mixed": (3, 7, 24, 3, "fp32", "mixed", "small"),  # 21 rows: 2 row tiles
    "fp32_partial_empty": (2, 5, 24, 3, "fp32", "none", "small"),
    "fp32_default_tile": (1, 16, 40, 3, "fp32", "mixed", "default"),
    "fp16_partial_all": (2, 5, 24, 3, "fp16", "all", "small"),
    "fp16_partial_mixed": (3, 7, 24, 3, "fp16", "mixed", "small"),
    "fp16_partial_empty": (2, 5, 24, 3, "fp16", "none", "small"),
    "bf16_partial_mixed": (2, 5, 24, 3, "bf16", "mixed", "small"),
    "fp32_no_features": (2, 4, 24, 0, "fp32", "mixed", "small"),
}


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(interpreted, case):
    r = interpreted[case]
    dt = CASES[case][4]
    assert r["dtype_ok"]
    assert r["invalid_exact"], "slots with valid == 0 must return x exactly"
    assert r["finite"]
    assert r["kernel_err"] <= ABS_TOL[dt] + r["ref_err"], r
    if dt == "fp32":
        assert r["vs_ref"] <= 1e-5, r  # direct kernel vs torch reference, both fp32
    else:
        assert r["kernel_err"] <= 3 * r["ref_err"] + 1e-6, r


def test_empty_memory_is_identity(interpreted):
    # every slot invalid (and its memory NaN): the output is x, bit for bit
    for case in ("fp32_partial_empty", "fp16_partial_empty"):
        assert interpreted[case]["invalid_exact"] and interpreted[case]["finite"]


def test_interpret_flag_did_not_leak():
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# ---- tile table / signatures / AOT compilation (no interpreter needed) ----


def test_tile_table():
    from retrace.plugins import triton_kernel as tk

    assert [t.tactic for t in tk.TILES] == list(range(1, len(tk.TILES) + 1))
    assert tk.DEFAULT_TILE is tk.TILES[0]
    for t in tk.TILES:
        assert min(t.block_m, t.block_n, t.block_k) >= 16  # tl.dot minimum on GPUs
        for v in (t.block_m, t.block_n, t.block_k, t.num_warps):
            assert v & (v - 1) == 0


def test_kernel_signatures_follow_tensorrt_aot_order():
    from retrace.plugins import triton_kernel as tk

    sig = tk.kernel_signature("refine", torch.float16)
    assert list(sig.items()) == [
        ("memory_ptr", "*fp16"), ("correction_ptr", "*fp16"), ("w_refine_ptr", "*fp16"),
        ("n_rows", "i32"), ("d", "i32"), ("refined_ptr", "*fp32"),
        ("BLOCK_M", "constexpr"), ("BLOCK_N", "constexpr"), ("BLOCK_K", "constexpr"), ("DOT_DTYPE", "constexpr"),
    ]
    sig = tk.kernel_signature("fuse", torch.float32)
    runtime = [(k, v) for k, v in sig.items() if v != "constexpr"]
    assert runtime == [
        ("x_ptr", "*fp32"), ("refined_ptr", "*fp32"), ("features_ptr", "*fp32"), ("valid_ptr", "*fp32"),
        ("w_gate_ptr", "*fp32"), ("b_gate_ptr", "*fp32"), ("norm_weight_ptr", "*fp32"),
        ("w_value_ptr", "*fp32"), ("n_rows", "i32"), ("d", "i32"), ("n_feat", "i32"), ("out_ptr", "*fp32"),
    ]
    # the signature names are the kernels' own parameter names, in declaration order
    for stage, fn in tk.kernels().items():
        assert list(tk.kernel_signature(stage, torch.float32)) == list(fn.arg_names)
    mixed = tk.kernel_signature("fuse", torch.float16, {"valid": torch.float32, "features": torch.float32})
    assert (mixed["x_ptr"], mixed["valid_ptr"], mixed["features_ptr"], mixed["w_gate_ptr"]) == (
        "*fp16", "*fp32", "*fp32", "*fp16")
    with pytest.raises(TypeError):
        tk.kernel_signature("fuse", torch.int32)


@pytest.mark.parametrize("stage,dtype", [("refine", torch.float16), ("fuse", torch.float32)])
def test_aot_compile_to_ptx_without_gpu(stage, dtype):
    from triton.backends.compiler import GPUTarget

    from retrace.plugins import triton_kernel as tk

    c = tk.compile_stage(stage, dtype, tk.TILES[0], eps=1e-6, target=GPUTarget("cuda", 90, 32))
    inputs, scalars, outputs = tk.KERNEL_ARGS[stage]
    assert c.name == tk.KERNEL_NAMES[stage]
    assert f".entry {c.name}(" in c.ptx and ".target sm_90" in c.ptx
    # runtime args + Triton's two trailing scratch pointers (TensorRT passes null for those)
    assert c.n_params == len(inputs) + len(scalars) + len(outputs) + 2
    assert c.num_warps == tk.TILES[0].num_warps and 0 < c.shared_mem <= tk.SHARED_MEM_LIMIT


def test_dispatch_routes_by_device_and_grad(monkeypatch):
    from retrace.plugins import gated_suffix_fusion as gsf
    from retrace.plugins.triton_kernel import gated_suffix_fusion_triton

    assert gsf._cuda_impl() is gsf.gated_suffix_fusion_reference  # the faster one on an H200
    gsf._cuda_impl.cache_clear()
    monkeypatch.setenv("RETRACE_SUFFIX_FUSION", "triton")
    assert gsf._cuda_impl() is gated_suffix_fusion_triton  # triton is installed in dev envs
    gsf._cuda_impl.cache_clear()
    calls = []
    monkeypatch.setattr(gsf, "_cuda_impl", lambda: lambda *a, **k: calls.append("triton") or "T")
    monkeypatch.setattr(gsf, "gated_suffix_fusion_reference", lambda *a, **k: calls.append("ref") or "R")

    class FakeCuda:
        is_cuda = True

    assert gsf.gated_suffix_fusion(FakeCuda()) == "T"
    assert gsf.gated_suffix_fusion(torch.zeros(1)) == "R"  # CPU
    w = torch.zeros(1, requires_grad=True)
    assert gsf.gated_suffix_fusion(FakeCuda(), w) == "R"  # autograd needs the reference
    with torch.no_grad():
        assert gsf.gated_suffix_fusion(FakeCuda(), w) == "T"
    assert calls == ["triton", "ref", "ref", "triton"]


def test_wrapper_rejects_bad_shapes():
    from retrace.plugins import triton_kernel as tk

    d, f = 8, 3
    x = torch.zeros(1, 2, d)
    ws = [torch.zeros(d, 2 * d), torch.zeros(d, 2 * d + f), torch.zeros(d), torch.ones(d), torch.zeros(d, d + 1)]
    with pytest.raises(ValueError, match="w_value"):
        tk.run_gated_suffix_fusion(x, x, x, torch.zeros(1, 2, f), torch.zeros(1, 2), *ws)
