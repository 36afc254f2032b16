#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a lent GPU machine (no network there):
#   gpu-carry/zoo                 `retrace zoo tiny --size test` pair (cached)
#   gpu-carry/cpu_reference.json  its CPU greedy outputs (ar/dflash/retrace, batch 1 and 8, 8 prompts x 48 tokens)
#   .whl/                         transformers 5.23.0 (the machine has 5.17) + pure-Python fallbacks of its deps
set -eu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
"$PY" -m retrace zoo tiny --size test --out gpu-carry/zoo
"$PY" -m retrace.gpucheck.reference --zoo gpu-carry/zoo --out gpu-carry/cpu_reference.json
rm -rf gpu-carry/zoo/drafter/train_state gpu-carry/zoo/drafter/train_data
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl transformers==5.23.0 regex pyyaml typer shellingham packaging annotated-doc
du -sh gpu-carry .whl
du -cb gpu-carry .whl | tail -1 | awk '{printf "total %.1f MB (the device upload is capped at 64 MB)\n", $1 / 1e6}'
