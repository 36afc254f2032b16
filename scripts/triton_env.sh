#!/usr/bin/env bash
# Create (once) the CPU tritonserver (from the nvidia-pytriton 0.7.0 wheel, tritonserver 2.51) and the
# python-backend model environment (numpy<2, torch 2.13 CPU, onnxruntime, transformers) under
# $RETRACE_TRITON_CACHE (default ~/.cache/retrace/triton). A second run returns at once.
#   scripts/triton_env.sh            # build / check, print the paths
#   eval "$(scripts/triton_env.sh --shell)"   # TRITON_TRITONSERVER=..., TRITON_MODEL_ENV=..., ...
# Extra pip arguments for the model env (e.g. a PyTorch CPU index off this network):
#   RETRACE_TRITON_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" scripts/triton_env.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then py="$here/.venv/bin/python"; else py="python3"; fi
fi
cd "$here"
exec "$py" -m retrace.export.triton.env "$@"
