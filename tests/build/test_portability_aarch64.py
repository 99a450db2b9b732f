"""Check 4 (opt-in: `make portability`): the aarch64 CPU variant runs, and replays x86_64's draws.

Under qemu-user, an aarch64 CPython with PyPI's aarch64 torch 2.10.0 (tools/aarch64_python.py;
made once, about 800 MB) loads build-ci/ through the loader, which picks the aarch64 CPU variant
by itself (its platform.machine() is aarch64), and runs the smoke set (tests/build/smoke_child.py:
bitmask, sample, sample_with_logprobs, penalties, in float32, float16 and bfloat16). Every token,
log-probability and penalised logit must equal, bit for bit, what this machine's x86_64 CPU
variant (build/, under this torch) returns: the CPU replay promise across CPU architectures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import BUILD, OFFLINE, ROOT

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).parent))
import aarch64_python  # noqa: E402
import matrix  # noqa: E402
import smoke_child  # noqa: E402
import toolkits  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("LP_PORTABILITY") != "1",
                                reason="opt-in: make portability (LP_PORTABILITY=1)")
CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
CHILD = Path(smoke_child.__file__)


def test_aarch64_cpu_variant_replays_x86_64(tmp_path):
    if OFFLINE:
        pytest.skip("LP_OFFLINE=1 (certification mode, no network): the aarch64 Python needs package indexes")
    missing = toolkits.install_compiler("aarch64")
    assert not missing, missing
    bundle = matrix.build_variant(CONFIG, matrix.Spec("cpu", "aarch64"), ROOT / "build-ci").parent
    command, env = aarch64_python.command()
    torch.save(smoke_child.make_inputs(), tmp_path / "inputs.pt")

    here = subprocess.run([sys.executable, str(CHILD), str(BUILD), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "x86_64.pt"), "cpu"], capture_output=True, text=True)
    assert here.returncode == 0, here.stdout + here.stderr
    there = subprocess.run(command + [str(CHILD), str(bundle), str(tmp_path / "inputs.pt"),
                                      str(tmp_path / "aarch64.pt"), "default"], capture_output=True, text=True, env=env)
    assert there.returncode == 0, there.stdout + there.stderr
    ours, theirs = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (here, there))
    assert ours["variant"] == "torch-stable-abi210-cpu-x86_64-linux", ours
    assert theirs == {"torch": aarch64_python.TORCH.split("==")[1] + "+cpu", "cuda": None, "machine": "aarch64",
                      "variant": "torch-stable-abi210-cpu-aarch64-linux"}, theirs
    x86, arm = torch.load(tmp_path / "x86_64.pt"), torch.load(tmp_path / "aarch64.pt")
    assert len(x86) > 80
    assert not smoke_child.differences(x86, arm)
