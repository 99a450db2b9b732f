"""What the built shared objects hold: the CUDA variant machine code for every architecture it
lists, and sanitizer instrumentation exactly in a sanitizer run (`make sanitize`)."""

from pathlib import Path

import pytest

from conftest import BUILD, ROOT, SANITIZED


def test_cuda_build_carries_all_architectures():
    """The CUDA .so holds machine code for every capability metadata.json lists, and that is
    every capability of build.toml, or exactly those of LP_CUDA_ARCHS where a narrowed build
    is tested."""
    import json
    import os
    import sys
    import tomllib

    sys.path.insert(0, str(ROOT / "tools"))
    from fatbin import fatbin_entries
    from variant_checks import promised_code

    variants = sorted(BUILD.glob("torch*-cu*"))
    if not variants:
        pytest.skip("no CUDA variant was built (CPU-only torch or no nvcc)")
    archs = json.loads((variants[0] / "metadata.json").read_text())["backend"]["archs"]
    found = fatbin_entries(next(variants[0].glob("*.abi3.so")))
    assert found == promised_code(archs)
    narrowed = os.environ.get("LP_CUDA_ARCHS")
    if narrowed:
        assert sorted(archs) == sorted(a.strip() for a in narrowed.split(",") if a.strip()), \
            "the build does not carry exactly the capabilities LP_CUDA_ARCHS names"
    else:
        config = tomllib.loads((ROOT / "build.toml").read_text())
        assert archs == config["kernel"]["logits_processor_cuda"]["cuda-capabilities"]
        assert {"8.0", "9.0", "10.0", "12.0+PTX"} <= set(archs)


def test_make_test_and_test_archs_build_every_capability():
    """tests/run.py's split of build.toml's capabilities: make test's (build/) and make
    test-archs' (build-archs/), each of build.toml, together all of them, and one PTX for make
    test's (tools/build.py's PTX_FROM: cicc once)."""
    import sys
    import tomllib

    import run
    sys.path.insert(0, str(ROOT / "tools"))
    import build

    config = tomllib.loads((ROOT / "build.toml").read_text())
    capabilities = config["kernel"]["logits_processor_cuda"]["cuda-capabilities"]
    assert run.TEST_ARCHS and run.LATER_ARCHS and not set(run.TEST_ARCHS) & set(run.LATER_ARCHS)
    assert sorted(run.TEST_ARCHS + run.LATER_ARCHS) == sorted(capabilities), (run.TEST_ARCHS, capabilities)
    virtual = {flag.split("arch=")[1].split(",")[0] for flag in build.gencode_flags(run.TEST_ARCHS)}
    assert virtual == {"compute_80"}, build.gencode_flags(run.TEST_ARCHS)


def test_sanitizer_run_loads_the_instrumented_build(lp):
    """Under ASan (`make sanitize`) the ops come from the instrumented .so of build-asan/; in
    any other run from an uninstrumented one (a sanitizer run against a plain build would
    check nothing)."""
    (so,) = Path(lp.__file__).parent.glob("*.abi3.so")
    symbols = so.read_bytes()
    assert (b"__asan_report_load" in symbols, b"__ubsan_handle" in symbols) == (SANITIZED, SANITIZED), so
