#!/usr/bin/env bash
# One-command certification (`make certify`): on the GPU machine (no internet), certify the
# artifact carried in .artifact/ (`make artifact`) with the wheels carried in .whl/
# (scripts/fetch_wheels.sh); without a GPU, the CPU parts only, saying that nothing was
# certified. Stages and record: scripts/certify.py.
#
#   scripts/certify.sh [OUT_DIR]        default: $OUT if set, else certification/out
#   scripts/certify.sh --wheels-only    install the wheels and import what they carry, only
#
# Python: $PYTHON, else the project's .venv when it has one, else python3 (the GPU machine's
# torch). Packages that python lacks come as wheels in .whl/: installed into a scratch folder
# put first on PYTHONPATH, never into the interpreter's own site-packages; with pip when that
# python has it, else by unpacking them with Python's zipfile (a wheel without a .data/ folder
# is a zip of what an install puts into site-packages). How it went is recorded.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS_ONLY=0
if [ "${1:-}" = "--wheels-only" ]; then WHEELS_ONLY=1; shift; fi
OUT_DIR="${1:-${OUT:-certification/out}}"
mkdir -p "$OUT_DIR"

install_wheels() {  # $1: python, $2: target folder; sets CERTIFY_WHEELS
  local py="$1" site="$2" count
  count=$(ls .whl/*.whl | wc -l)
  if "$py" -m pip --version > /dev/null 2>&1; then
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target "$site" .whl/*.whl; then
      CERTIFY_WHEELS="$count wheels installed with pip into $site"
    else
      CERTIFY_WHEELS="pip FAILED to install the $count wheels into $site"
    fi
  else
    if "$py" - "$site" .whl/*.whl <<'EOF'
import sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        data = [m for m in archive.namelist() if m.split("/")[0].endswith(".data")]
        if data:  # scripts or headers outside site-packages: only pip places them right
            print(f"[certify.sh] WARNING: {wheel} has {data[0].split('/')[0]}/: unpacked as is")
        archive.extractall(site)
EOF
    then
      CERTIFY_WHEELS="no pip: $count wheels unpacked with zipfile into $site"
    else
      CERTIFY_WHEELS="no pip, and unpacking the $count wheels into $site FAILED"
    fi
  fi
  echo "[certify.sh] $CERTIFY_WHEELS"
}

certify() {
  local py="${PYTHON:-}"
  if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  CERTIFY_WHEELS="none needed ($py imports kernels and xgrammar)"
  if ! "$py" -c "import kernels, xgrammar" 2>/dev/null; then
    if compgen -G ".whl/*.whl" > /dev/null; then
      local site="${TMPDIR:-/tmp}/certify-site"
      rm -rf "$site"
      install_wheels "$py" "$site"
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
      CERTIFY_WHEELS="MISSING: $py lacks kernels/xgrammar and .whl/ is empty (run scripts/fetch_wheels.sh)"
      echo "[certify.sh] WARNING: $CERTIFY_WHEELS"
    fi
  fi
  export CERTIFY_WHEELS
  if [ "$WHEELS_ONLY" = 1 ]; then
    "$py" -c "import kernels, xgrammar, jsonschema, flashinfer.sampling; print('[certify.sh] the carried packages import')"
    return
  fi
  "$py" scripts/certify.py "$OUT_DIR"
  local rc=$?
  # certify.py writes its record even when a stage crashes; only an interpreter that cannot
  # start at all leaves none, and then this one says so.
  if ! compgen -G "$OUT_DIR/*.json" > /dev/null; then
    printf '{"certified": false, "complete": false, "error": "%s scripts/certify.py exited %s without a record; see certify.log"}\n' \
      "$py" "$rc" > "$OUT_DIR/no-record.json"
  fi
  return $rc
}

# Everything also goes to certify.log beside the record.
certify 2>&1 | tee "$OUT_DIR/certify.log"
exit "${PIPESTATUS[0]}"
