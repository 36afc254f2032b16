#!/usr/bin/env bash
# The prepared GPU benchmark of the runtime (issue 24).  Usage: scripts/gpu_bench.sh OUTDIR [--dry-run] [--shapes S]
#   On a lent H200 (no network, no pip): Qwen3-8B- and Qwen3-0.6B-shaped random bf16 pairs built on the device,
#   rounds at fixed K and at controlled tau, against a static-cache CUDA-graph reference, transformers eager and
#   the weights' bandwidth roofline; CUDA-event timings and per-round launches / syncs / host reads
#   (python -m retrace.gpucheck.bench --help).  --dry-run: the same steps on the CPU at toy size (the tests run it).
# Installs nothing into the machine's torch (carried wheels as in scripts/gpu_check.sh).
# Writes OUTDIR/gpu_bench.json (rewritten after every section). Exit 0 when the JSON was written.
set -u
OUT="${1:?usage: scripts/gpu_bench.sh OUTDIR [--dry-run] [--shapes S]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME=gpu_bench
. "$ROOT/scripts/gpu_common.sh"

run_driver "$NAME" "$OUT/gpu_bench.json" $PY -m retrace.gpucheck.bench "$OUT" "$@"
