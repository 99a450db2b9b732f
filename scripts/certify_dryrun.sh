#!/usr/bin/env bash
# The certification's dry run (`make certify-dryrun`): the GPU machine's software rebuilt here,
# and scripts/certify.sh run in it end to end, its CPU parts. Run it before any GPU call: the
# first one found three failures that would each have wasted the one GPU attempt. Not in CI
# (it downloads torch 2.11, 530 MB, on its first run).
#
#   scripts/certify_dryrun.sh [OUT_DIR]     default: certification/ (the committed no-gpu record)
#
# 1. An environment like the GPU machine's (shared/docs/gpu-runs.md), created once in
#    $LP_DRYRUN_ENV (default ~/.cache/logits-processor/dryrun-py3.12-torch2.11.0): CPython 3.12,
#    torch 2.11.0 from the index (the cu130 build), the image's packages. Every package that
#    .whl/ carries is then uninstalled from it, so the carried wheels alone must serve.
# 2. The tree as the device tool sends it: tracked and untracked-not-ignored files plus the
#    carried .whl/ (scripts/fetch_wheels.sh, fetched when missing) and .artifact/ (`make
#    artifact`), copied to a scratch folder without .git, build/ or .venv.
# 3. There, with pip cut off from any index (PIP_NO_INDEX=1): the no-pip install path
#    (`certify.sh --wheels-only` with the environment's pip hidden), then the whole
#    `certify.sh` with pip, as on the GPU machine. The record (no-gpu.json, no-gpu.md) is
#    copied to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR="${1:-certification}"
# CPython 3.12: $PY312, else python3.12 if it runs (a pyenv shim may not), else pyenv's.
PY312="${PY312:-}"
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if [ -z "$PY312" ] && "$candidate" --version > /dev/null 2>&1; then PY312=$candidate; fi
done
[ -n "$PY312" ] || { echo "[dryrun] no CPython 3.12 found: set PY312" >&2; exit 1; }
ENV_DIR="${LP_DRYRUN_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/logits-processor/dryrun-py3.12-torch2.11.0}"
IMAGE_PACKAGES=(torch==2.11.0 numpy pytest pytest-xdist hypothesis huggingface-hub transformers
                pyyaml packaging tqdm tabulate)
start=$(date +%s)

if [ ! -f "$ENV_DIR/.installed" ]; then
  echo "[dryrun] creating $ENV_DIR: $("$PY312" --version), ${IMAGE_PACKAGES[*]}"
  rm -rf "$ENV_DIR"
  "$PY312" -m venv "$ENV_DIR"
  "$ENV_DIR/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}"
  echo "${IMAGE_PACKAGES[*]}" > "$ENV_DIR/.installed"
fi
[ -d .whl ] || scripts/fetch_wheels.sh
if [ ! -f .artifact/ARTIFACT.json ]; then
  echo "[dryrun] no .artifact/: run \`make -o .venv/.installed artifact\` first" >&2
  exit 1
fi

# The carried packages only from the carry (the wheels' names, as pip spells them).
carried=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr _ -)
# shellcheck disable=SC2086
PIP_NO_INDEX=1 "$ENV_DIR/bin/python" -m pip uninstall -y -q $carried 2>&1 | grep -v "not installed" || true

TREE=$(mktemp -d "${TMPDIR:-/tmp}/certify-dryrun.XXXXXX")
PIP_DIR=$("$ENV_DIR/bin/python" -c "import pip, os; print(os.path.dirname(pip.__file__))")
cleanup() {
  [ -d "$PIP_DIR.hidden" ] && mv "$PIP_DIR.hidden" "$PIP_DIR"
  rm -rf "$TREE"
}
trap cleanup EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$TREE" 2>/dev/null || true
cp -r .whl .artifact "$TREE/"
COMMIT=$(git rev-parse HEAD)$( [ -z "$(git status --porcelain --untracked-files=no)" ] || echo -dirty)
# The device tool sends the tree and the carried folders together, 64 MiB at most: over it the
# one GPU attempt would not start.
bytes=$(du -sb "$TREE" | cut -f1)
echo "[dryrun] tree for commit $COMMIT: $((bytes / 1048576)) MiB (the carry's limit: 64) in $TREE"
if [ "$bytes" -gt $((64 * 1048576)) ]; then
  echo "[dryrun] FAIL: the tree with .whl/ and .artifact/ is $((bytes / 1048576)) MiB, over the device tool's 64 MiB" >&2
  exit 1
fi

export PIP_NO_INDEX=1 PATH="$ENV_DIR/bin:$PATH" CERTIFY_COMMIT="$COMMIT" TMPDIR="$TREE/tmp"
unset VIRTUAL_ENV PYTHONPATH
mkdir -p "$TMPDIR"
cd "$TREE"

echo "[dryrun] the no-pip path: wheels unpacked with zipfile, pip hidden"
mv "$PIP_DIR" "$PIP_DIR.hidden"
PYTHON=python3 scripts/certify.sh --wheels-only "$TREE/out-nopip"
grep -q "no pip: .* unpacked with zipfile" "$TREE/out-nopip/certify.log"
mv "$PIP_DIR.hidden" "$PIP_DIR"

echo "[dryrun] the certification, with pip (offline)"
status=0
PYTHON=python3 scripts/certify.sh "$TREE/out" || status=$?
cd "$ROOT"
mkdir -p "$OUT_DIR"
cp "$TREE/out/no-gpu.json" "$TREE/out/no-gpu.md" "$OUT_DIR/"
echo "[dryrun] exit $status after $(( $(date +%s) - start )) s; record: $OUT_DIR/no-gpu.json and .md"
exit $status
