"""`python -m retrace.gpucheck OUTDIR [--dry-run] [budgets]`: see the package docstring."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

SECTIONS = ("environment", "parity", "kernels", "scale", "ort_cuda", "tensorrt")


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    return float(v) if v else None


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m retrace.gpucheck", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes (what the test suite runs)")
    ap.add_argument("--carry", type=Path, default=Path("gpu-carry"),
                    help="dir with zoo/ (test-size pair) and cpu_reference.json")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--parity-dtypes", default="fp32,bf16")
    ap.add_argument("--parity-new-tokens", type=int, default=None,
                    help="decode fewer tokens than the reference and compare prefixes (default: all; dry run 12)")
    ap.add_argument("--kernels-timeout", type=float, default=_env_float("GC_KERNELS_TIMEOUT") or 240.0)
    ap.add_argument("--target-seconds", type=float, default=_env_float("GC_TARGET_S"))
    ap.add_argument("--dflash-seconds", type=float, default=_env_float("GC_DFLASH_S"))
    ap.add_argument("--cond-seconds", type=float, default=_env_float("GC_COND_S"))
    ap.add_argument("--eval-prompts", type=int, default=int(os.environ.get("GC_EVAL_PROMPTS", 0)) or None)
    ap.add_argument("--headroom-prompts", type=int, default=int(os.environ.get("GC_HEADROOM_PROMPTS", 0)) or None)
    ap.add_argument("--max-train-chars", type=int, default=int(os.environ.get("GC_TRAIN_CHARS", 0)) or None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the target's training step")
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch dir of the scale section (default: a new dir under $TMPDIR, outside OUTDIR so "
                         "that only the report files sit in OUTDIR)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    a.outdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from retrace.gpucheck import engines, environment, kernels, parity, report_md, scale
    from retrace.gpucheck.record import Report, log

    work = a.work or Path(tempfile.mkdtemp(prefix="retrace-gpucheck-"))
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(f"unknown sections {sorted(unknown)} (choose from {SECTIONS})", file=sys.stderr)
        return 2
    sc = scale.with_overrides(scale.DRY if a.dry_run else scale.GPU, target_seconds=a.target_seconds,
                              dflash_seconds=a.dflash_seconds, cond_seconds=a.cond_seconds,
                              eval_prompts=a.eval_prompts, headroom_prompts=a.headroom_prompts,
                              max_train_chars=a.max_train_chars, compile=a.compile or None)
    rep = Report(a.outdir / "gpu_check.json", {"dry_run": a.dry_run, "device": str(device), "sections": sections,
                                                "carry": str(a.carry), "argv": sys.argv[1:] if argv is None else argv},
                 report_md.render)
    if not cuda and not a.dry_run:
        log("WARNING: CUDA is not available: every section runs on CPU (recorded as device cpu)")
    plan = {
        "environment": lambda r: environment.collect(r, device),
        "parity": lambda r: parity.run(r, a.carry / "zoo", a.carry / "cpu_reference.json", device,
                                       tuple(a.parity_dtypes.split(",")),
                                       a.parity_new_tokens or (12 if a.dry_run else None)),
        "kernels": lambda r: kernels.run(r, device, a.kernels_timeout, a.dry_run),
        "scale": lambda r: scale.run(r, sc, work, device, save=rep.write),
        "ort_cuda": lambda r: engines.run_ort_cuda(r, a.carry / "zoo", a.carry / "cpu_reference.json",
                                                   work / "engines", device, a.dry_run),
        "tensorrt": lambda r: engines.run_tensorrt(r, a.carry / "zoo", a.carry / "cpu_reference.json",
                                                   work / "engines", device),
    }
    # the engine sections need their runtime: without it they are skipped with the reason
    missing = {"ort_cuda": lambda: engines.ort_cuda_unavailable(a.dry_run), "tensorrt": engines.tensorrt_unavailable}
    for name in SECTIONS:
        why = missing[name]() if name in sections and name in missing else None
        if name not in sections:
            rep.skip(name, "not in --sections")
        elif why:
            rep.skip(name, why)
        else:
            rep.run(name, plan[name])
    rep.write()
    log(f"done in {rep.data['elapsed_s']:.0f}s: {a.outdir / 'gpu_check.json'}, {a.outdir / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
