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
# - jsonschema and its dependencies, attrs included (the image's recorded package list of
#   Nov 2026 in shared/docs/gpu-runs.md does not show it; the first dry run found
#   tests/examples/test_demo.py failing at collection without it): the demo test validates with it.
# - flashinfer.sampling's imports the image's list may lack: nvidia-ml-py (pynvml) and
#   requests with urllib3, idna, charset-normalizer and certifi. Carried duplicates of image
#   packages are harmless: pure-Python wheels, first on PYTHONPATH.
# - kernel-abi-check (an abi3 wheel, no requirements): tools/variant_checks.py reads the
#   artifact's objects with it, and tests/build/ imports that at collection (the dry run of
#   b9845cc stopped there without it).
# At the end every carried wheel's requirements (Requires-Dist, for CPython 3.12 on Linux) are checked:
# each must be carried, in IMAGE (what gpu-runs.md says the image has) or in UNNEEDED (with why).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

WHEELS=(
  kernels==0.17.2
  kernel-abi-check==0.14.1
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
  attrs==26.1.0
  nvidia-ml-py==13.615.71
  requests==2.34.2
  urllib3==2.8.0
  idna==3.20
  charset-normalizer==3.5.3
  certifi==2026.10.19.post1
)
# What gpu-runs.md says the GPU image has (with their own requirements).
IMAGE="torch triton numpy pytest pytest-xdist hypothesis huggingface-hub transformers pyyaml
packaging tqdm tabulate ninja click einops"
# Required by a carried wheel but not carried, and why that is safe.
# flashinfer.sampling imports without the first two; kernels' imports without the other two
# (only its CLI uses them; see above).
UNNEEDED="nvidia-cudnn-frontend nvidia-cutlass-dsl sigstore tomlkit"

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
"$PY" - "$IMAGE $UNNEEDED" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement

# The GPU machine's interpreter, for the requirements' environment markers.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wheels = sorted(Path(".whl").glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
known = carried | {norm(n) for n in sys.argv[1].split()}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        if any("/" in m and m.split("/")[0].endswith(".data") for m in archive.namelist()):
            missing.append(f"{wheel.name} has a .data/ folder: unpacking it is not an install")
        metadata = next(m for m in archive.namelist() if m.endswith(".dist-info/METADATA"))
        for line in archive.read(metadata).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                requirement = Requirement(line.split(":", 1)[1])
                if requirement.marker and not requirement.marker.evaluate(TARGET):
                    continue  # an extra, or another Python or platform
                name = norm(requirement.name)
                if name not in known:
                    missing.append(f"{wheel.name} requires {name}: neither carried nor in the image")
print("\n".join(missing) or "every requirement of the carried wheels is carried or in the image")
sys.exit(1 if missing else 0)
PYEOF
echo "total: $(du -ch .whl/*.whl | tail -1 | cut -f1) in $(ls .whl/*.whl | wc -l) wheels (the working tree may carry 64 MiB in all)"
