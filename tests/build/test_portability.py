"""What the build and the tests need beyond this machine's torch and network.

- The sources that include torch's headers (the binding) compile against the headers of the
  oldest torch the stable ABI promises (tools/check_torch_headers.py: the first GPU-machine dry
  run found the binding using a macro only torch 2.14 defines). The headers are downloaded once into a cache outside the repository;
  in certification mode (LP_OFFLINE=1) without that cache the check skips.
- Certification mode skips every test that needs a package index instead of erroring.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET

import pytest

from conftest import OFFLINE, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import check_torch_headers  # noqa: E402

# (one xdist worker for the file: it creates the shared torch-2.10-headers cache)
pytestmark = [
    pytest.mark.no_sanitize("compiles the sources against torch's headers and runs no op"),
    pytest.mark.xdist_group("torch-2.10-headers"),
]

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
OLDEST = check_torch_headers.oldest_torch(CONFIG)


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    cached = (check_torch_headers.CACHE / f"torch-{OLDEST}-include" / ".complete").exists()
    if OFFLINE and not cached:
        pytest.skip(f"LP_OFFLINE=1 (certification mode, no network): torch {OLDEST}'s headers "
                    "need a package index")
    return check_torch_headers.check(OLDEST)


def failures(results: dict[str, str], backend: str) -> dict[str, str]:
    return {name: result for name, result in results.items()
            if name.startswith(f"{backend}:") and result != "ok"}


def test_oldest_torch_is_the_stable_abi_level():
    assert OLDEST == "2.10.0", OLDEST  # build.toml's [torch.stable-abi]; the README promises 2.10


def test_cpu_sources_compile_against_the_oldest_torch(compiled):
    assert any(name.startswith("cpu:torch-ext/") for name in compiled), compiled
    assert not failures(compiled, "cpu"), "\n\n".join(failures(compiled, "cpu").values())


def test_cuda_binding_compiles_against_the_oldest_torch(compiled):
    if compiled.get("cuda", "").startswith("skipped"):
        pytest.skip(compiled["cuda"])
    assert any(name.startswith("cuda:torch-ext/") for name in compiled), compiled
    assert not failures(compiled, "cuda"), "\n\n".join(failures(compiled, "cuda").values())


def test_only_the_sources_that_include_torch_are_compiled(tmp_path):
    """The kernel sources are left out because they include no torch header, directly or
    through a header of theirs: a source that does is found."""
    (tmp_path / "plain.h").write_text("#pragma once\n#include <cstdint>\n")
    (tmp_path / "uses_torch.h").write_text('#pragma once\n#include "plain.h"\n  #  include <ATen/Tensor.h>\n')
    (tmp_path / "kernel.cpp").write_text('#include "plain.h"\n')
    (tmp_path / "binding.cpp").write_text('#include "plain.h"\n#include "uses_torch.h"\n')
    assert not check_torch_headers.includes_torch(tmp_path / "kernel.cpp")
    assert check_torch_headers.includes_torch(tmp_path / "binding.cpp")
    kernels = [f for f in (ROOT / "logits_processor").glob("*.cpp")]
    assert kernels and not any(map(check_torch_headers.includes_torch, kernels))


def test_offline_mode_skips_the_network_tests(tmp_path):
    """As on the GPU machine: no index, no torch 2.13 environment yet. The tests that would
    create it must skip, naming the switch; an error here is what the first dry run saw."""
    env = {**os.environ, "LP_OFFLINE": "1", "PIP_NO_INDEX": "1",
           "LP_OTHER_VENV": str(tmp_path / "missing-venv")}
    network_tests = ["tests/build/test_stable_abi.py::test_cpu_variant_runs_unchanged_under_torch_2_13",
                     "tests/build/test_stable_abi.py::test_cuda_variant_needs_a_cuda_torch"]
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *network_tests], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outcomes = {case.get("name"): [(child.tag, child.get("message", "")) for child in case]
                for case in ET.parse(junit).getroot().iter("testcase")}
    assert sorted(outcomes) == sorted(t.split("::")[1] for t in network_tests), outcomes
    for name, children in outcomes.items():
        assert [tag for tag, _ in children] == ["skipped"], (name, children)
        assert "LP_OFFLINE=1 (certification mode, no network)" in children[0][1], (name, children)
    assert not (tmp_path / "missing-venv").exists()
