"""Tests load the package through the Hub loader from build/ (run `make build` first)."""

import os
from pathlib import Path

import pytest
import torch
from kernels import get_local_kernel

ROOT = Path(__file__).resolve().parent.parent
# LP_BUILD_DIR picks another build, e.g. build-asan/ (`make sanitize`), which has only the
# CPU variant: then every test runs against that.
BUILD = Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")).resolve()
HAS_CUDA_VARIANT = any(BUILD.glob("torch*-cu*"))

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Certification mode: the GPU machine has no network (scripts/certify.py sets LP_OFFLINE=1), so
# a test that would fetch from a package index skips there, saying so, instead of erroring.
OFFLINE = os.environ.get("LP_OFFLINE") == "1"


def skip_if_offline(what: str) -> None:
    """Skip the calling test or fixture in certification mode: `what` needs a package index."""
    if OFFLINE:
        pytest.skip(f"LP_OFFLINE=1 (certification mode, no network): {what} needs a package index")


@pytest.fixture(scope="session")
def lp():
    """The variant the loader picks for this torch (on a CUDA torch: the CUDA variant)."""
    return get_local_kernel(BUILD, backend=None if HAS_CUDA_VARIANT else "cpu")


@pytest.fixture(scope="session")
def lp_cpu():
    """The CPU variant."""
    return get_local_kernel(BUILD, backend="cpu")


@pytest.fixture(scope="session", params=["default", "cpu"] if HAS_CUDA_VARIANT else ["cpu"])
def lp_variant(request):
    """Each variant that serves CPU tensors: the default one and the CPU-only one."""
    backend = None if request.param == "default" else "cpu"
    return get_local_kernel(BUILD, backend=backend)


def devices():
    return ["cpu", "cuda"] if HAS_CUDA else ["cpu"]
