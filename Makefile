# The two commands for a fresh machine: `make demo` and `make test`.
# Every target creates .venv (pinned in requirements-dev.txt) when it is missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: build test test-archs demo bench clean sanitize certify artifact certify-dryrun emulation-build emulate traffic portability \
	vllm-env test-vllm bench-vllm

# --no-compile: pip's bytecode for every module of every package took about 20 s of the install's
# 75 on the 2-core machine; the import check writes it for what the tests import (whatever
# PYTHONDONTWRITEBYTECODE says), and the rest is compiled when first imported.
$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -r requirements-dev.txt 2> $(VENV)/pip.log || (cat $(VENV)/pip.log; exit 1)
	PYTHONDONTWRITEBYTECODE= $(PY) -c "import torch, kernels, xgrammar, transformers, pytest"
	touch $@

build: $(STAMP)
	$(PY) tools/build.py

# Builds, then every test through the loader, the CPU tests under ASan + UBSan (sanitize) and
# the CUDA kernels in the CUDA emulation (emulate), each part timed: tests/run.py.
test: $(STAMP)
	$(PY) tests/run.py test

# The CUDA capabilities make test does not build (build.toml's beyond tests/run.py's TEST_ARCHS)
# into build-archs/, and their machine code checked: every architecture carried, stacks, no
# compare-and-swap loops (tests/run.py's group archs). CI runs it after make test.
test-archs: $(STAMP)
	$(PY) tests/run.py archs

# Only what this machine runs (no GPU: the CPU variant; else CUDA for its GPUs), then the demo.
demo: $(STAMP)
	$(PY) tools/build.py --this-machine
	$(PY) examples/demo.py

bench: build emulation-build
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/bench_replay.py
	$(PY) benchmarks/bench_filtered.py
	$(PY) benchmarks/bench_constraints.py
	$(PY) benchmarks/bench_samplers.py
	$(PY) benchmarks/bench_tree.py
	$(PY) benchmarks/bench_sharded.py
	$(PY) benchmarks/bench_generate.py
	$(MAKE) bench-vllm

# The vLLM integration (integrations/vllm/): its own environment .venv-vllm (vLLM's CPU build
# from PyPI with torch 2.13.0+cpu, pinned in integrations/vllm/requirements.txt, the plugin
# installed editable; a no-op when up to date), then vLLM's real engine with and without the
# plugin on a tiny random Llama, against this checkout's CPU variant in build/.
vllm-env:
	integrations/vllm/setup_env.sh

test-vllm: $(STAMP) vllm-env
	LP_BACKENDS=cpu $(PY) tools/build.py
	.venv-vllm/bin/python -m pytest -c integrations/vllm/pytest.ini --rootdir integrations/vllm integrations/vllm/tests

# The sampling step, vLLM's Sampler vs the plugin's on the same SamplingMetadata, and engine
# tokens per second with and without the plugin.
bench-vllm: $(STAMP) vllm-env
	LP_BACKENDS=cpu $(PY) tools/build.py
	.venv-vllm/bin/python integrations/vllm/bench_sampler.py
	.venv-vllm/bin/python integrations/vllm/bench_engine.py

clean:
	rm -rf build build-asan build-archs build-emulation build-ci build-matrix

# The CUDA emulation (tests/cuda_emulation/): the .cu kernels built by the host compiler and
# run on fibers, through the binding's CUDA path, against the CPU variant of build/.
emulation-build: $(STAMP)
	$(PY) tools/build_emulation.py

# The CUDA tests on fibers (both thread orders), under ThreadSanitizer and ASan + UBSan, their
# coverage and the mutation check (tests/run.py's emulation parts).
emulate: $(STAMP)
	$(PY) tests/run.py emulate

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

# The CPU variant built with AddressSanitizer + UBSan into build-asan/, and every test
# but the emulated ones run against it (a test unsuited to it opts out:
# @pytest.mark.no_sanitize(reason)); any report aborts the run (tests/run.py's sanitize group).
sanitize: $(STAMP)
	$(PY) tests/run.py sanitize

# The Hub bundle (release/: build/<variant>/ for the whole variant matrix, benchmarks/, CARD.md
# as README.md) and its report (release-report.md). This machine's variants come from build/,
# the others (tools/matrix.py: cpu, cu125, cu130 x x86_64, aarch64, each with its own
# toolkit) are built into build-matrix/. Refuses on a dirty tree, a variant it cannot build
# (LP_RELEASE_PARTIAL=1 releases without it), a failed check (tools/variant_checks.py) or
# metadata the loader rejects; prints the upload commands and runs none.
.PHONY: release
release: build
	$(PY) tools/release.py

# The checks of the matrix that download gigabytes (not in `make test`; cached outside the repo):
# the aarch64 CPU variant under qemu-user against x86_64's results (tools/aarch64_python.py), and
# PyPI's torch 2.10.0 (CUDA 12.8) picking and running the cu125 variant of release/build/.
portability: build
	LP_PORTABILITY=1 $(PY) -m pytest tests/build
