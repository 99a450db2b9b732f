"""The CUDA kernels' float arithmetic is IEEE's, as the CPU's, whatever the environment adds.

build.toml's cuda-flags pin -ftz=false -prec-div=true -prec-sqrt=true --fmad=false, and nvcc
lets explicit options win over what --use_fast_math implies. No macro tells device code that
fast math is on, so this reads the result: each .cu of the CUDA variant compiled to PTX for
compute_80 (the PTX sm_80's and sm_90's machine code come from; cicc only, no ptxas; the
sampler's sampling_cuda.cu takes most of the time) with
NVCC_APPEND_FLAGS=--use_fast_math and the build's flags must hold none of FLOAT_MODES. The
whole PTX is checked: every float instruction of these files is decision code (the sampler's
scores, masses and noise, the penalties' values), compared bit for bit with the CPU's.

At cicc's full optimisation, as the build: contraction of a * b + c into an fma happens in the
optimiser (-Xcicc -O0, tools/matrix.py's quick build, would let the fma check pass blind).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import build  # noqa: E402

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
CUDA_SOURCES = [f for f in build.sources(CONFIG, "cuda") if f.suffix == ".cu"]

# What a float instruction must not carry (PTX ISA names), and which flag puts it there.
FLOAT_MODES = {
    # flush-to-zero on any float instruction: -ftz=true (the CPU keeps subnormals)
    "ftz": re.compile(r"\.ftz\b"),
    # approximate div / sqrt / rcp / rsqrt / ex2 / lg2 / sin / cos: -prec-div=false,
    # -prec-sqrt=false, or fast math's library intrinsics (expf as __expf)
    "approx": re.compile(r"\.approx\b"),
    # division to 2 ulp: -prec-div=false without ftz
    "div.full": re.compile(r"\bdiv\.full\b"),
    # a fused multiply-add in float or double: --fmad=true's contraction (integer mad.lo.s32
    # and mad.wide are not float)
    "fma": re.compile(r"\b(?:fma|mad)(?:\.\w+)*\.f(?:16|32|64)\b"),
}

pytestmark = [
    pytest.mark.no_sanitize("compiles with nvcc, which segfaults under ASan's LD_PRELOAD, and runs no op"),
    pytest.mark.skipif(not build.nvcc_available(), reason="no nvcc (CUDA toolkit) on this machine"),
]


def float_mode_hits(ptx: str) -> dict[str, list[str]]:
    """FLOAT_MODES' matches in the instructions of `ptx` (comments and .loc lines left out)."""
    instructions = [line.split("//")[0].strip() for line in ptx.splitlines()]
    instructions = [line for line in instructions if line and not line.startswith((".loc", ".file"))]
    return {name: hits for name, pattern in FLOAT_MODES.items()
            if (hits := [line for line in instructions if pattern.search(line)])}


def ptx_under_fast_math(source: Path, flags: list[str], out: Path, appended: str = "--use_fast_math") -> str:
    nvcc = Path(build.cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    subprocess.run([str(nvcc), "-arch=compute_80", "-ptx", *flags, f"-I{ROOT}", str(source), "-o", str(out)],
                   check=True, env={**os.environ, "NVCC_APPEND_FLAGS": appended})
    return out.read_text()


def build_device_flags() -> list[str]:
    """tools/build.py's nvcc flags that shape the PTX (not ptxas' or the job count's), with
    build.toml's cuda-flags."""
    common = [f for f in build.CUDA_FLAGS if not f.startswith(("-Xptxas", "--threads"))]
    return common + [build.backend_define("cuda")] + build.section_flags(CONFIG, "cuda", "cuda-flags")


def test_build_toml_pins_ieee_float_flags():
    flags = build.section_flags(CONFIG, "cuda", "cuda-flags")
    assert {"-ftz=false", "-prec-div=true", "-prec-sqrt=true", "--fmad=false"} <= set(flags), flags


def test_the_check_sees_fast_math(tmp_path):
    """Without the pinned flags the same check finds every mode (a check that cannot fail
    would prove nothing): x / t * y + z + sqrtf(w) under --use_fast_math, and -prec-div=false
    alone."""
    source = tmp_path / "fast.cu"
    source.write_text("__global__ void k(float* o, const float* a, float t) {\n"
                      "  o[0] = a[0] / t * a[1] + a[2] + sqrtf(a[3]);\n}\n")
    fast = float_mode_hits(ptx_under_fast_math(source, ["-O3"], tmp_path / "fast.ptx"))
    assert set(fast) == {"ftz", "approx", "fma"}, fast
    pinned = build.section_flags(CONFIG, "cuda", "cuda-flags")
    assert float_mode_hits(ptx_under_fast_math(source, ["-O3", *pinned], tmp_path / "pinned.ptx")) == {}
    slow_div = float_mode_hits(ptx_under_fast_math(source, ["-O3", *pinned], tmp_path / "div.ptx", "-prec-div=false"))
    assert set(slow_div) == {"div.full"}, slow_div


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda f: f.name)
def test_fast_math_from_the_environment_changes_no_float_instruction(source, tmp_path):
    hits = float_mode_hits(ptx_under_fast_math(source, build_device_flags(), tmp_path / "out.ptx"))
    assert not hits, "\n".join(f"{name}: {len(lines)}, e.g. {lines[0]}" for name, lines in hits.items())


def test_build_refuses_environment_flags_that_undo_the_pinned_ones():
    pinned = build.section_flags(CONFIG, "cuda", "cuda-flags")
    assert build.overridden_flags(pinned, "--use_fast_math -O3 -ftz=false") == []
    assert build.overridden_flags(pinned, "-ftz=true --prec-div false --fmad=true") == [
        "-ftz=true", "--prec-div false", "--fmad=true"]
