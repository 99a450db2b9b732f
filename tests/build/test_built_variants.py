"""Check 2 (tools/variant_checks.py) on what `make build` built for this machine: each .so is
of this machine, needs only what its torch provides, holds in its fatbin exactly what its
metadata.json promises and passes kernel-abi-check's Python-ABI check."""

from __future__ import annotations

import sys

import pytest

from conftest import BUILD, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import variant_checks  # noqa: E402

VARIANTS = sorted(d for d in BUILD.glob("torch-*") if d.is_dir())

pytestmark = pytest.mark.no_sanitize(
    "checks build/'s release variants; build-asan/ holds one instrumented CPU variant, which needs libasan"
)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_variant_objects(variant):
    lines, problems = variant_checks.object_problems(variant)
    assert not problems, "\n".join(problems)
    assert lines


def test_something_was_built():
    assert VARIANTS, f"no variant in {BUILD}: run `make build`"
