# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh (needs NAME, OUT and ROOT; reads the script's "$@").
# Sets PY ($PYTHON or python3), makes OUT absolute, the offline environment, DRY (1 with --dry-run). Not a dry run: the carried wheels in .whl/ whose distribution is missing or too
# old (always transformers) go to a private --target dir put first on PYTHONPATH; the machine's torch is kept.
# Defines run_driver NAME JSON CMD...: runs the driver; exit 0 when it wrote JSON (failed sections are in it).
PY="${PYTHON:-python3}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=true
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "[$NAME] $(date -u +%FT%TZ) root $ROOT python $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
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
    echo "[$NAME] installing carried wheels into $SITE: $(echo $NEED | xargs -n1 basename | tr '\n' ' ')"
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $NEED \
      && export PYTHONPATH="$SITE:$PYTHONPATH" \
      || echo "[$NAME] WARNING: wheel install failed; continuing with the machine's packages"
  fi
fi
$PY -c 'import transformers, retrace; print("['"$NAME"'] transformers", transformers.__version__, "from", transformers.__file__); print("['"$NAME"'] retrace from", retrace.__file__)' \
  || echo "[$NAME] WARNING: import check failed (the driver records the details)"


run_driver() {
  local name="$1" json="$2"
  shift 2
  cd "$ROOT"
  "$@"
  local rc=$?
  if [ -s "$json" ]; then
    [ "$rc" = 0 ] || echo "[$name] driver exited $rc, but the JSON exists"
    exit 0
  fi
  echo "[$name] ERROR: no $json (driver exit $rc)"
  exit "${rc/#0/1}"
}
