# The two commands for a fresh machine: `make demo` and `make test`.
# Every target creates .venv (pinned in requirements-dev.txt) when it is missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: build test demo bench clean

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2> $(VENV)/pip.log || (cat $(VENV)/pip.log; exit 1)
	$(PY) -c "import torch, kernels, xgrammar, pytest"
	touch $@

build: $(STAMP)
	$(PY) tools/build.py

test: build
	$(PY) -m pytest tests

demo: build
	$(PY) examples/demo.py

bench: build
	$(PY) benchmarks/bench.py

clean:
	rm -rf build build-asan
