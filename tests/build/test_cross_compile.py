"""What CI builds beyond this machine's variants, because it breaks silently elsewhere: the
aarch64 cross-compile of the CPU variant and of one CUDA capability, and the CUDA sources
under the oldest toolkit of the matrix (CUDA 12.5: CCCL and CUB change their API between
releases). Each build then passes check 2 (tools/variant_checks.py: ELF machine, NEEDED
entries, fatbin, Python ABI). Builds go to build-ci/ (kept: an unchanged variant is not rebuilt).

The CUDA build is a quick one (tools/matrix.py's quick=True): PTX for 8.0 only, cicc's
optimiser off, seconds for the sampler's kernels instead of minutes. It proves that the front end
accepts the sources with that toolkit's CCCL and runtime headers, that the host code compiles
with the aarch64 compiler and that the whole links into an aarch64 .so needing only what a CUDA
torch provides; not the optimised device code (the x86_64 build of `make build` compiles that,
for every capability, with CUDA 13.0), nor anything at run time.

CUDA 12.5's compiler is assembled from PyPI's nvcc wheel and Debian's nvidia-cuda-toolkit package
(tools/toolkits.py), its aarch64 runtime and CCCL are PyPI's wheels: 114 MB, downloaded once into
the cache (4 s here), then the quick build takes 30 s. Offline (LP_OFFLINE=1) without that cache,
the CUDA cross-compile uses the oldest toolkit that is here and the 12.5 test skips, saying so.
"""

from __future__ import annotations

import sys
import tomllib

import pytest

from conftest import OFFLINE, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import matrix  # noqa: E402
import toolkits  # noqa: E402
import variant_checks  # noqa: E402

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
CI_BUILD = ROOT / "build-ci"
OLDEST = next(iter(toolkits.TOOLKITS))  # "12.5"

# Under ASan's LD_PRELOAD nvcc itself segfaults; these tests build with other toolchains and run
# no op of this machine's build, so ASan has nothing to see in them.
pytestmark = [
    pytest.mark.no_sanitize("cross-compiles with other toolchains and runs no op of this machine's build"),
    # one worker for the module: its fixtures build each variant once (matrix.build_variant
    # also locks a variant against a second build of it)
    pytest.mark.xdist_group("cross-compile"),
]


@pytest.fixture(scope="module")
def aarch64_compiler():
    missing = toolkits.install_compiler("aarch64")
    if missing:
        if OFFLINE:
            pytest.skip(f"LP_OFFLINE=1 (certification mode, no network): {missing}")
        pytest.fail(missing)


def cached_or_online(spec: matrix.Spec) -> None:
    if OFFLINE and spec.cuda and not (toolkits.CACHE / f"cuda-{spec.cuda}-target-{spec.machine}" / ".complete").exists():
        pytest.skip(f"LP_OFFLINE=1 (certification mode, no network): CUDA {spec.cuda}'s "
                    f"{spec.machine} wheels need a package index")


def test_aarch64_cpu_variant(aarch64_compiler):
    variant = matrix.build_variant(CONFIG, matrix.Spec("cpu", "aarch64"), CI_BUILD)
    lines, problems = variant_checks.object_problems(variant)
    assert not problems, "\n".join(problems)
    assert "AArch64" in lines[0] and "libtorch_cpu.so" in lines[0], lines


@pytest.fixture(scope="module")
def aarch64_cuda_variant(aarch64_compiler):
    """The aarch64 CUDA variant, quick, for 8.0, with CUDA 12.5, else the oldest toolkit here."""
    cuda = next((c for c in toolkits.TOOLKITS if toolkits.compiler(c)), None)
    if cuda is None:
        missing = "no CUDA toolkit at all: " + "; ".join(map(toolkits.missing_compiler, toolkits.TOOLKITS))
        if OFFLINE:  # the CUDA 13 compiler wheels need an index
            pytest.skip(f"LP_OFFLINE=1 (certification mode, no network): {missing}")
        pytest.fail(missing)
    spec = matrix.Spec("cuda", "aarch64", cuda)
    cached_or_online(spec)
    return cuda, matrix.build_variant(CONFIG, spec, CI_BUILD, archs=["8.0"], quick=True)


def test_aarch64_cuda_variant_one_capability(aarch64_cuda_variant):
    cuda, variant = aarch64_cuda_variant
    lines, problems = variant_checks.object_problems(variant, code={("ptx", 80)})
    assert not problems, "\n".join(problems)
    assert f"libcudart.so.{toolkits.TOOLKITS[cuda].major}" in lines[0], lines


def test_cuda_sources_compile_with_the_oldest_toolkit(aarch64_cuda_variant):
    cuda, variant = aarch64_cuda_variant
    if cuda != OLDEST:
        pytest.skip(f"compiled with CUDA {cuda} instead: {toolkits.missing_compiler(OLDEST)}")
    assert "libcudart.so.12" in variant_checks.needed(next(variant.glob("*.so")))
