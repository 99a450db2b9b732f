# The two commands for a fresh machine: `make demo` and `make test`.
# Every target creates .venv (pinned in requirements-dev.txt) when it is missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: build test demo bench clean sanitize certify artifact certify-dryrun emulation-build emulate traffic portability

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2> $(VENV)/pip.log || (cat $(VENV)/pip.log; exit 1)
	$(PY) -c "import torch, kernels, xgrammar, pytest"
	touch $@

build: $(STAMP)
	$(PY) tools/build.py

# Every test through the loader, then the CPU tests again under ASan + UBSan (sanitize), then
# the CUDA kernels in the CUDA emulation (emulate).
test: build
	$(PY) -m pytest -m "not emulation" tests
	$(MAKE) sanitize
	$(MAKE) emulate

demo: build
	$(PY) examples/demo.py

bench: build emulation-build
	$(PY) benchmarks/bench.py

clean:
	rm -rf build build-asan build-emulation build-ci build-matrix

# The CUDA emulation (tests/cuda_emulation/): the .cu kernels built by the host compiler and
# run on CPU threads, through the binding's CUDA path, against the CPU variant of build/.
emulation-build: $(STAMP)
	$(PY) tools/build_emulation.py

# The CUDA tests on fibers (both thread orders), under ThreadSanitizer and ASan + UBSan, and the
# mutation check, each part timed (tests/cuda_emulation/check.py).
emulate: build emulation-build
	$(PY) tests/cuda_emulation/check.py

# Global-memory bytes per row of each CUDA path, in passes over the row: `<path> <passes> B=<b>`.
traffic: emulation-build
	$(PY) tests/cuda_emulation/traffic.py

# GPU certification (scripts/certify.sh): no .venv prerequisite, since the GPU machine has no
# internet to create one; its python3 and the wheels carried in .whl/ are used there.
certify:
	scripts/certify.sh

# The artifact that certification certifies: build/'s stable-ABI variants (all architectures)
# copied into .artifact/ (ignored by git; sent with the device tool's carry beside .whl/).
artifact: build
	$(PY) tools/pack_artifact.py

# The certification's dry run in a copy of the GPU machine's software (scripts/certify_dryrun.sh;
# not in CI: it downloads torch 2.11 once). Needs `make artifact` first.
certify-dryrun:
	scripts/certify_dryrun.sh

# The CPU variant built with AddressSanitizer + UBSan into build-asan/, and the CPU reliability
# tests run against it; any report aborts the run. The ASan runtime must come first in the
# process, so it is preloaded (also for the build, which imports the module it built), with
# libstdc++ (ASan intercepts __cxa_throw and needs it loaded first, or every C++ exception
# aborts);
# detect_leaks=0 because CPython itself leaks at exit.
ASAN_ENV = LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

sanitize: $(STAMP)
	$(ASAN_ENV) LP_SANITIZE=1 $(PY) tools/build.py
	$(ASAN_ENV) LP_BUILD_DIR=build-asan $(PY) -m pytest tests/test_bitmask.py tests/test_sampling.py tests/test_penalties.py \
		tests/test_properties_bitmask.py tests/test_properties_sampling.py tests/test_bad_input.py \
		tests/test_scale.py tests/test_logprobs.py tests/test_properties_logprobs.py tests/test_verify.py

# The Hub bundle (release/: build/<variant>/ for the whole variant matrix, benchmarks/, CARD.md
# as README.md) and its report (release-report.md). This machine's variants come from build/,
# the others (tools/matrix.py: cpu, cu126, cu128, cu130 x x86_64, aarch64, each with its own
# toolkit) are built into build-matrix/. Refuses on a dirty tree, a variant it cannot build
# (LP_RELEASE_PARTIAL=1 releases without it), a failed check (tools/variant_checks.py) or
# metadata the loader rejects; prints the upload commands and runs none.
.PHONY: release
release: build
	$(PY) tools/release.py

# The checks of the matrix that download gigabytes (not in `make test`; cached outside the repo):
# the aarch64 CPU variant under qemu-user against x86_64's results (tools/aarch64_python.py), and
# PyPI's torch 2.10.0 (CUDA 12.8) picking and running the cu128 variant of release/build/.
portability: build
	LP_PORTABILITY=1 $(PY) -m pytest tests/build
