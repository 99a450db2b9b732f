#!/usr/bin/env bash
# One-command certification (`make certify`): on a machine with a CUDA GPU, a CUDA torch and
# nvcc, and no internet, build for that GPU, run the tests, compute-sanitizer, the CUDA-graph
# check and the benchmarks, and write a record; without a GPU, the CPU parts only, and it says
# that nothing was certified. Details in scripts/certify.py.
#
#   scripts/certify.sh [OUT_DIR]        default: $OUT if set, else certification/out
#
# Python: the project's .venv when it has one, else python3 (the device machine's torch).
# Packages that python lacks (kernels, xgrammar, flashinfer...) come as wheels in .whl/
# (filled here by scripts/fetch_wheels.sh and carried along): installed into a scratch
# folder and put on PYTHONPATH, never into the interpreter's own site-packages.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${1:-${OUT:-certification/out}}"
mkdir -p "$OUT_DIR"

certify() {
  local py="${PYTHON:-}"
  if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  if ! "$py" -c "import kernels, xgrammar" 2>/dev/null; then
    if compgen -G ".whl/*.whl" > /dev/null; then
      local site="${TMPDIR:-/tmp}/certify-site"
      echo "[certify.sh] installing $(ls .whl/*.whl | wc -l) carried wheels into $site"
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || echo "[certify.sh] WARNING: installing the wheels failed"
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "[certify.sh] WARNING: $py lacks kernels/xgrammar and .whl/ is empty (run scripts/fetch_wheels.sh)"
    fi
  fi
  "$py" scripts/certify.py "$OUT_DIR"
}

# Everything also goes to certify.log beside the record.
certify 2>&1 | tee "$OUT_DIR/certify.log"
exit "${PIPESTATUS[0]}"
