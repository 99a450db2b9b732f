#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the CPython 3.12 x86-64 wheels that the GPU machine's
# image lacks, for scripts/certify.sh to install there without internet. Versions are those
# of the development .venv. That image already has torch, triton, numpy, pytest, pytest-xdist,
# hypothesis, huggingface-hub, pyyaml, packaging, transformers, typing-extensions, click,
# einops, ninja, nvidia-ml-py, requests, tabulate and tqdm.
#
#   scripts/fetch_wheels.sh
#
# - kernels: `import kernels` and get_local_kernel need huggingface_hub, packaging and pyyaml
#   only (checked here with sigstore, cryptography and tomlkit made unimportable). sigstore is
#   imported by the `kernels` CLI (signature checks), so `kernels benchmark` cannot run there.
# - xgrammar imports pydantic at import time: pydantic and its dependencies come along, with
#   typing-extensions, which pydantic 2.14 needs at 4.16 or newer (the image's is not known).
# - flashinfer-python 0.6.1, 7.6 MB (the newest release, 62 MB, would not fit in the 64 MiB
#   the working tree may take): flashinfer.sampling imports without nvidia-cudnn-frontend and
#   nvidia-cutlass-dsl (checked here), and JIT-compiles its sampling kernels with nvcc at first
#   use (certify.py starts that early, in the background).
# - jsonschema and its dependencies (attrs is in the image): tests/test_demo.py validates the
#   demo's JSON outputs with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

WHEELS=(
  kernels==0.17.2
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  flashinfer-python==0.6.1
  jsonschema==4.25.1
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
)

# One version of each package: two would stop the whole install there.
rm -rf .whl
mkdir -p .whl
# (grep drops the warnings about this machine's unreachable local index folders)
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

ls -l .whl
echo "total: $(du -ch .whl/*.whl | tail -1 | cut -f1) in $(ls .whl/*.whl | wc -l) wheels (the working tree may carry 64 MiB in all)"
