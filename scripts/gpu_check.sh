#!/usr/bin/env bash
# The one prepared GPU check (issue 17).  Usage: scripts/gpu_check.sh OUTDIR [--dry-run] [driver flags]
#   driver flags (python -m retrace.gpucheck --help): --sections, --target-seconds, --dflash-seconds,
#   --cond-seconds, --eval-prompts, --headroom-prompts, --kernels-timeout, --carry DIR, --work DIR
#   (or env GC_TARGET_S, GC_DFLASH_S, GC_COND_S, GC_EVAL_PROMPTS, GC_HEADROOM_PROMPTS, GC_KERNELS_TIMEOUT).
# Installs nothing into the machine's torch: retrace runs from this checkout (PYTHONPATH), and only the carried
# wheels in .whl/ whose distribution is missing or too old (always transformers) go to a private --target dir.
# Sections: environment, parity, kernels, scale, ort_cuda (ONNX Runtime's CUDA provider: skipped without
# onnxruntime-gpu), tensorrt (TensorRT plans built and run: skipped without tensorrt); each engine section
# reports what ran and token-exactness against the torch backend on the device.
# Writes OUTDIR/gpu_check.json (rewritten after every section) and OUTDIR/gpu_check.md.
# Exit 0 when the JSON was written (failed sections are recorded in it), nonzero otherwise.
set -u
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR [--dry-run] [flags]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME=gpu_check
. "$ROOT/scripts/gpu_common.sh"  # sets DRY; on a GPU machine: the carried wheels (.whl/) it lacks

run_driver "$NAME" "$OUT/gpu_check.json" $PY -m retrace.gpucheck "$OUT" "$@"
