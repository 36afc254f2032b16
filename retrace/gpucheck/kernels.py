"""Section `kernels`: the GatedSuffixFusion Triton kernels compiled and run against the torch reference.

Runs in a child process (`python -m retrace.gpucheck.kernels`), so a faulting kernel cannot poison the CUDA
context of the other sections, and so that on CPU (--dry-run) TRITON_INTERPRET=1 is set before triton loads.
Tolerances are those of tests/test_plugin_kernel.py: max |kernel - float64 reference| on valid slots
<= ABS_TOL[dtype] + the same-dtype torch reference's own error, and for fp16/bf16 also <= 3x that error;
fp32 kernel vs fp32 reference <= 1e-5; invalid slots return x bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ABS_TOL = {"fp32": 2e-5, "fp16": 4e-3, "bf16": 4e-2}
# name: (N, B, d, F, dtype, valid, tile); "small" = 16x16x16 tiles (partial tiles at d=24/40)
CASES = {
    "fp32_partial_mixed": (3, 7, 24, 3, "fp32", "mixed", "small"),
    "fp32_empty_memory": (2, 5, 24, 3, "fp32", "none", "small"),
    "fp32_default_tile": (2, 16, 200, 3, "fp32", "mixed", "default"),
    "fp16_partial_all": (2, 5, 24, 3, "fp16", "all", "small"),
    "fp16_default_tile": (2, 16, 200, 3, "fp16", "mixed", "default"),
    "fp16_empty_memory": (2, 5, 40, 3, "fp16", "none", "default"),
    "bf16_partial_mixed": (2, 5, 24, 3, "bf16", "mixed", "small"),
    "bf16_default_tile": (4, 16, 520, 3, "bf16", "mixed", "default"),
    "fp32_no_features": (2, 4, 24, 0, "fp32", "mixed", "small"),
}
TIMING_SHAPE = (8, 16, 4096, 3)  # N requests x B slots x d, F features: a Qwen3-8B-wide drafter at batch 8


def make(n, b, d, f, dtype, valid_mode, seed, device):
    import torch

    g = torch.Generator().manual_seed(seed)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=g) * sc).to(dtype)

    x, m, c = r(n, b, d), r(n, b, d, sc=2.0), r(n, b, d)
    feats = torch.rand(n, b, f, generator=g).to(dtype)
    if valid_mode == "all":
        v = torch.ones(n, b)
    elif valid_mode == "none":
        v = torch.zeros(n, b)
    else:
        v = (torch.rand(n, b, generator=g) > 0.4).float()
        v[:, 0] = 0.0
        v[0, 1] = 1.0
    v = v.to(dtype)
    if valid_mode != "all":  # stale memory in invalid slots must not reach the output
        m[v == 0] = float("nan")
    ws = [r(d, 2 * d, sc=d ** -0.5), r(d, 2 * d + f, sc=d ** -0.5), r(d), 1 + r(d, sc=0.1), r(d, d, sc=d ** -0.5)]
    return [t.to(device) for t in (x, m, c, feats, v, *ws)]


def check_case(name, spec, device, tk, ref) -> dict:
    import torch

    n, b, d, f, dt, valid_mode, tile = spec
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    args = make(n, b, d, f, dtype, valid_mode, len(name), device)
    got = tk.run_gated_suffix_fusion(*args, eps=1e-6, tile=tk.Tile(99, 16, 16, 16, 1, 1) if tile == "small"
                                     else tk.DEFAULT_TILE)
    exact = ref(*(a.double().cpu() for a in args))
    same = ref(*args).double().cpu()
    got_c = got.double().cpu()
    valid = args[4].cpu() != 0
    vm = valid.unsqueeze(-1).expand_as(got_c)

    def err(a):
        return (a - exact).abs()[vm].max().item() if vm.any() else 0.0

    r = {"kernel_err": err(got_c), "ref_err": err(same),
         "vs_ref": (got_c - same).abs()[vm].max().item() if vm.any() else 0.0,
         "invalid_exact": bool(torch.equal(got.cpu()[~valid], args[0].cpu()[~valid])),
         "finite": bool(torch.isfinite(got).all()), "tol": ABS_TOL[dt]}
    ok = r["invalid_exact"] and r["finite"] and r["kernel_err"] <= ABS_TOL[dt] + r["ref_err"]
    ok = ok and (r["vs_ref"] <= 1e-5 if dt == "fp32" else r["kernel_err"] <= 3 * r["ref_err"] + 1e-6)
    r["ok"] = bool(ok)
    return r


def time_case(dt: str, shape, device, tk, ref, reps: int) -> dict:
    import torch

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    n, b, d, f = shape
    args = make(n, b, d, f, dtype, "mixed", 7, device)
    fns = {"kernel": lambda: tk.run_gated_suffix_fusion(*args, eps=1e-6), "reference": lambda: ref(*args)}
    out = {"shape": {"N": n, "B": b, "d": d, "F": f}}
    for k, fn in fns.items():
        if device.type == "cuda":
            import triton.testing

            out[f"{k}_ms"] = round(float(triton.testing.do_bench(fn, warmup=10, rep=max(reps, 20))), 4)
        else:
            fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            out[f"{k}_ms"] = round((time.perf_counter() - t) / reps * 1e3, 3)
    out["speedup"] = round(out["reference_ms"] / out["kernel_ms"], 3) if out["kernel_ms"] else None
    # weight bytes streamed once per call (5 d^2 + biases): the op's floor on a bandwidth-bound GPU
    out["weight_mb"] = round((5 * d * d + 2 * d * f) * args[0].element_size() / 2**20, 2)
    return out


def child(device_name: str, timing_shape, reps: int, quick: bool = False) -> dict:
    import torch

    from retrace.plugins import triton_kernel as tk
    from retrace.plugins.gated_suffix_fusion import gated_suffix_fusion_reference as ref

    device = torch.device(device_name)
    res = {"interpret": tk.interpreting(), "cases": {}, "timing": {}}
    for name, spec in CASES.items():
        if quick and spec[2] > 40:  # the interpreter: small widths only
            continue
        try:
            res["cases"][name] = check_case(name, spec, device, tk, ref)
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
            res["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(f"[kernels] {name}: {res['cases'][name]}", file=sys.stderr, flush=True)
    dts = ("fp32", "fp16", "bf16") if device.type == "cuda" else ("fp32",)
    for dt in dts:
        try:
            res["timing"][dt] = time_case(dt, timing_shape, device, tk, ref, reps)
        except Exception as e:  # noqa: BLE001
            res["timing"][dt] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(f"[kernels] timing {dt}: {res['timing'][dt]}", file=sys.stderr, flush=True)
    res["all_ok"] = all(c.get("ok") for c in res["cases"].values())
    return res


def run(result: dict, device, timeout_s: float, dry_run: bool) -> None:
    """Run the child process; its JSON (last stdout line) becomes the section's result."""
    env = dict(os.environ)
    shape = TIMING_SHAPE
    if dry_run or device.type != "cuda":
        env["TRITON_INTERPRET"] = "1"
        shape = (1, 4, 32, 3)
    cmd = [sys.executable, "-m", "retrace.gpucheck.kernels", "--device", str(device),
           "--timing-shape", ",".join(map(str, shape)), "--reps", "50" if device.type == "cuda" else "1"]
    if "TRITON_INTERPRET" in env:
        cmd.append("--quick")
    result["command"] = " ".join(cmd)
    result["timing_shape"] = shape
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    result["stderr_tail"] = proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"kernel child exited {proc.returncode}: {proc.stderr[-1500:]}")
    result.update(json.loads(lines[-1][len("RESULT"):]))
    if not result["all_ok"]:
        bad = [k for k, v in result["cases"].items() if not v.get("ok")]
        raise AssertionError(f"kernel cases outside tolerance or failing: {bad}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timing-shape", default=",".join(map(str, TIMING_SHAPE)))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="only the small-width cases (interpreter)")
    a = ap.parse_args()
    res = child(a.device, tuple(int(x) for x in a.timing_shape.split(",")), a.reps, a.quick)
    print("RESULT" + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
