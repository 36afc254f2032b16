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
PY="${PYTHON:-python3}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=true
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "[gpu_check] $(date -u +%FT%TZ) root $ROOT python $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"

DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
if [ "$DRY" = 0 ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  SITE="${GC_SITE:-/tmp/retrace-site}"
  # which carried wheels are needed: transformers always (the machine's is outside our pinned range),
  # the others only if their distribution is not importable at all
  NEED=$($PY - "$ROOT/.whl" <<'PYEOF'
import sys, pathlib, importlib.metadata as md
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    dist = w.name.split("-")[0].replace("_", "-").lower()
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        have = None
    if dist == "transformers" or have is None:
        print(w)
PYEOF
)
  if [ -n "$NEED" ]; then
    echo "[gpu_check] installing carried wheels into $SITE: $(echo $NEED | xargs -n1 basename | tr '\n' ' ')"
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $NEED \
      && export PYTHONPATH="$SITE:$PYTHONPATH" \
      || echo "[gpu_check] WARNING: wheel install failed; continuing with the machine's packages"
  fi
fi
$PY -c 'import transformers, retrace; print("[gpu_check] transformers", transformers.__version__, "from", transformers.__file__); print("[gpu_check] retrace from", retrace.__file__)' \
  || echo "[gpu_check] WARNING: import check failed (the driver records the details)"

cd "$ROOT"
$PY -m retrace.gpucheck "$OUT" "$@"
RC=$?
if [ -s "$OUT/gpu_check.json" ]; then
  [ "$RC" = 0 ] || echo "[gpu_check] driver exited $RC, but the JSON exists"
  exit 0
fi
echo "[gpu_check] ERROR: no $OUT/gpu_check.json (driver exit $RC)"
exit "${RC/#0/1}"
