"""Check 1 of the variant matrix: which variant the loader loads for each torch users run.

On a bundle of metadata-only variant folders (the names and metadata.json that tools/matrix.py
writes, no .so), kernels' own resolver (tools/variant_checks.py) is asked for each torch of
variant_checks.ENVIRONMENTS on x86_64 and aarch64: each must get the variant of its CUDA major
with the newest minor not above its own, a CPU torch the CPU variant, and none may get nothing.
Also: the capabilities each toolkit's variant carries (kernel-builder's cut of build.toml's).
"""

from __future__ import annotations

import sys
import tomllib

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import matrix  # noqa: E402
import toolkits  # noqa: E402
import variant_checks  # noqa: E402

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
FRAMEWORK = "torch-stable-abi210"
MATRIX = [f"{FRAMEWORK}-{tag}-{machine}-linux" for machine in ("x86_64", "aarch64")
          for tag in ("cpu", "cu125", "cu130")]


def metadata_bundle(folder, names):
    return variant_checks.metadata_only_bundle(CONFIG, folder, names)


def test_the_matrix_is_every_toolkit_on_every_machine():
    assert sorted(spec.name(CONFIG) for spec in matrix.matrix(CONFIG)) == sorted(MATRIX)


def test_every_environment_loads_its_variant(tmp_path):
    bundle = metadata_bundle(tmp_path, MATRIX)
    lines, problems = variant_checks.resolution_problems(bundle, FRAMEWORK)
    assert not problems, "\n".join(problems)
    assert len(lines) == 12
    # The loader's own answer, not only its agreement with ENVIRONMENTS: spot checks.
    assert variant_checks.resolved(bundle, "2.10", "12.8", "aarch64") == f"{FRAMEWORK}-cu125-aarch64-linux"
    assert variant_checks.resolved(bundle, "2.10", "12.4", "x86_64") is None  # older than the toolkit
    assert variant_checks.resolved(bundle, "2.12", "13.2", "x86_64") == f"{FRAMEWORK}-cu130-x86_64-linux"
    assert variant_checks.resolved(bundle, "2.9", "12.8", "x86_64") is None  # below the stable ABI level


@pytest.mark.parametrize("left_out, environments", [
    ("cu125", ["2.10+cu126", "2.10+cu128"]),  # nothing else serves CUDA 12 (cu130 is another major)
    ("cu130", ["2.11+cu130", "2.14+cu130", "2.12+cu132"]),
])
def test_a_missing_variant_is_found(tmp_path, left_out, environments):
    names = [n for n in MATRIX if f"-{left_out}-x86_64-" not in n]
    lines, problems = variant_checks.resolution_problems(metadata_bundle(tmp_path, names), FRAMEWORK)
    assert problems == [f"torch {e} on x86_64 loads nothing, expected {FRAMEWORK}-{left_out}-x86_64-linux"
                        for e in environments], lines
    # Leaving it out on purpose (a partial release) reports it and is no problem.
    _, problems = variant_checks.resolution_problems(
        tmp_path, FRAMEWORK, {f"{FRAMEWORK}-{left_out}-x86_64-linux"})
    assert not problems


def test_each_toolkit_carries_what_it_can_target():
    requested = matrix.requested_archs(CONFIG)
    assert requested == ["8.0", "9.0", "10.0", "12.0+PTX"]  # build.toml's
    assert toolkits.capabilities(requested, "12.5") == ["8.0", "9.0+PTX"]
    assert toolkits.capabilities(requested, "13.0") == requested
    # kernel-builder's loose intersection: the highest requested capability of the same major
    # at or below each one the toolkit targets (8.7 is served by 8.6's code).
    assert toolkits.capabilities(["8.0", "8.6", "9.0"], "12.5") == ["8.0", "8.6", "9.0"]
    # Our rule on top: PTX asked for beyond the toolkit moves to the highest capability kept.
    assert toolkits.capabilities(["8.0", "12.0+PTX"], "12.5") == ["8.0+PTX"]
