"""Loading the kernel imports no more of torch than its ops need: torch._dynamo (1.5 s of a load
on the 2-core machine, the decorator torch.compiler.assume_constant_result imports it) only when
the caller compiles. Each variant that serves this machine, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import BUILD, HAS_CUDA_VARIANT

LOAD = """
import sys
import torch
from kernels import get_local_kernel
lp = get_local_kernel(__import__("pathlib").Path(sys.argv[1]), backend=None if sys.argv[2] == "default" else "cpu")
assert callable(lp.sample)
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


@pytest.mark.parametrize("backend", ["default", "cpu"] if HAS_CUDA_VARIANT else ["cpu"])
def test_loading_does_not_import_dynamo(backend):
    run = subprocess.run([sys.executable, "-c", LOAD, str(BUILD), backend], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", f"loading imported {run.stdout.strip()}"
