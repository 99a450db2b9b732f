"""Check 3 (opt-in: `make portability`): a new user's torch, PyPI's torch==2.10.0 (CUDA 12.8).

In a virtual environment of its own (VENV, outside the repository; made on first use: about
3 GB of wheels, 7 GB installed), with that torch and kernels 0.17.2:
- the loader, under that real CUDA 12.8 torch (no GPU needed: a CUDA torch selects the CUDA
  backend), picks from the whole matrix (metadata-only folders) the cu125 variant by itself (the
  matrix's CUDA 12 variant: same major, minor not above torch's; tools/toolkits.py);
- get_local_kernel on the release bundle (release/build/, `make release`) loads the cu125 variant
  by itself and its ops on CPU tensors (tests/build/smoke_child.py) equal the CPU variant's under
  this torch bit for bit. Without a cu12 variant in the bundle nothing at all loads under this
  torch; the test skips, saying so, when release/build/ lacks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import BUILD, ROOT, skip_if_offline

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).parent))
import matrix  # noqa: E402
import smoke_child  # noqa: E402
import toolkits  # noqa: E402
import variant_checks  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("LP_PORTABILITY") != "1",
                                reason="opt-in: make portability (LP_PORTABILITY=1)")
CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
REQUIREMENTS = ["torch==2.10.0", "kernels==0.17.2"]
VENV = toolkits.CACHE / "venv-torch-2.10.0"
RELEASE = ROOT / "release" / "build"
CU125 = "torch-stable-abi210-cu125-x86_64-linux"


@pytest.fixture(scope="module")
def torch210() -> Path:
    python, stamp = VENV / "bin" / "python", VENV / ".installed"
    if not stamp.exists():
        skip_if_offline(f"creating {VENV} ({' '.join(REQUIREMENTS)})")
        start = time.monotonic()
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", str(VENV)],
                       check=True)
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              *REQUIREMENTS], capture_output=True, text=True)
        assert pip.returncode == 0, pip.stdout + pip.stderr
        stamp.write_text(" ".join(REQUIREMENTS) + "\n")
        print(f"\n[portability] made {VENV} in {time.monotonic() - start:.0f} s")
    return python


def test_the_loader_under_torch_2_10_cu128_picks_cu125(torch210, tmp_path):
    bundle = variant_checks.metadata_only_bundle(CONFIG, tmp_path, [s.name(CONFIG) for s in matrix.matrix(CONFIG)])
    probe = textwrap.dedent("""
        import json, sys, torch
        from pathlib import Path
        from kernels.variants import get_variants_local, resolve_variant
        variant, _ = resolve_variant(get_variants_local(Path(sys.argv[1])))
        print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                          "variant": variant and variant.variant_str}))
    """)
    proc = subprocess.run([str(torch210), "-c", probe, str(bundle)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"torch": "2.10.0+cu128", "cuda": "12.8",
                                                                "variant": CU125}


def test_cu125_variant_runs_under_torch_2_10_cu128(torch210, tmp_path):
    if not (RELEASE / CU125).is_dir():
        pytest.skip(f"release/build/ has no {CU125} (`make release` builds it); under torch "
                    "2.10.0+cu128 a bundle without a CUDA 12 variant loads nothing at all")
    torch.save(smoke_child.make_inputs(), tmp_path / "inputs.pt")
    child = Path(smoke_child.__file__)
    here = subprocess.run([sys.executable, str(child), str(BUILD), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "cpu.pt"), "cpu"], capture_output=True, text=True)
    there = subprocess.run([str(torch210), str(child), str(RELEASE), str(tmp_path / "inputs.pt"),
                            str(tmp_path / "cu125.pt"), "default"], capture_output=True, text=True)
    for proc in (here, there):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(there.stdout.strip().splitlines()[-1])["variant"] == CU125
    assert not smoke_child.differences(torch.load(tmp_path / "cpu.pt"), torch.load(tmp_path / "cu125.pt"))
