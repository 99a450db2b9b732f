"""Tests load the package through the Hub loader from build/ (run `make build` first).

Rules for every test here, old and new:
- Copy before the op. On the CPU `t.to("cpu")` (so `t.to(device)` with device "cpu") is t
  itself, not a copy: an in-place op then overwrites the test's "original", and comparing
  with it compares the op's output with itself. Hand the op `t.to(device, copy=True)` or
  `t.clone()`, and compute what it must return (the reference, XGrammar) from an untouched copy.
- Compare with an independent reference on fresh random inputs. A check such as
  `torch.equal(x, x.clone())` cannot fail: keep a copy from before the op instead.
- tests/reliability/test_planted_defects.py plants defects in the ops (tests/planted_defects.py) and
  requires the hand-written tests to fail on each: a test of a new behaviour should come with a
  defect that it catches.
"""

import os
from dataclasses import dataclass
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

SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "")  # this process runs under ASan


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers
def pytest_collection_modifyitems(config, items):
    """A test that uses the `emulation` fixture is an emulation test (marker `emulation`, so that
    the emulation's parts run it and `-m "not emulation"` leaves it out): one without the marker
    had run in no part of a fresh clone's `make test`, skipped in cpu-tests for want of the
    emulation build. Under ASan (`make sanitize` runs every test there) a test marked
    no_sanitize(reason) skips, saying why: each test is sanitized unless it opts out."""
    for item in items:
        if "emulation" in getattr(item, "fixturenames", ()) and item.get_closest_marker("emulation") is None:
            item.add_marker(pytest.mark.emulation)
    if not SANITIZED:
        return
    for item in items:
        marker = item.get_closest_marker("no_sanitize")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"not under ASan: {marker.args[0]}"))

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


@pytest.fixture(scope="session")
def emulation():
    """The CUDA emulation build (tests/cuda_emulation/emulation.py): its ops run the CUDA path
    of the binding and the CUDA kernels, emulated, on CPU tensors. Without the build, the
    tests using it skip, unless LP_EMULATION says which build to test (as `make emulate` does)."""
    from cuda_emulation.emulation import BUILD, Emulation

    if not BUILD.is_dir() and "LP_EMULATION" not in os.environ:
        pytest.skip(f"no CUDA emulation build in {BUILD} (make emulate)")
    return Emulation()


@dataclass
class CudaTarget:
    """Where a CUDA test runs the CUDA kernels: a GPU, or the emulation on CPU tensors."""

    lp: object
    device: str


def cuda_targets():
    """The GPU where there is one, and always the emulation (marked `emulation`)."""
    return (["gpu"] if HAS_CUDA else []) + [pytest.param("emulated", marks=pytest.mark.emulation)]


@pytest.fixture(scope="session", params=cuda_targets())
def cuda_target(request, lp):
    if request.param == "gpu":
        return CudaTarget(lp, "cuda")
    return CudaTarget(request.getfixturevalue("emulation").lp, "cpu")
