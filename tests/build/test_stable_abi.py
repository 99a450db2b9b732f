"""The stable-ABI claim: what build/ holds, built here once with this torch (2.14), loads and
runs under another torch release through the loader.

The other torch is 2.13.0, a CPU build, in its own virtual environment .venv-torch213/
(ignored by git), created on first use from this interpreter with `torch==2.13.0+cpu` and
`kernels==0.17.2` (about 20 s on two cores from a local wheel; pip's configuration decides
where the wheel comes from: this machine's /opt/wheels, or on a networked CI machine
PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). In certification mode (LP_OFFLINE=1,
the GPU machine without network) the tests that need it skip unless it already exists.

What works and what does not, as these tests record it:
- the CPU variant torch-stable-abi210-cpu-... loads under torch 2.13 and gives bit-identical
  results to the same .so under 2.14 (the loader picks it by itself: a CPU torch selects the
  CPU backend);
- the CUDA variant torch-stable-abi210-cu130-... cannot load under a CPU torch at any setting:
  it needs libtorch_cuda.so (the current CUDA stream comes from torch's CUDA shim), which only
  a CUDA build of torch has; putting the 2.14 environment's CUDA runtime on LD_LIBRARY_PATH
  resolves libcudart.so.13 but not that. Under a CUDA torch >= 2.10 of the same CUDA major it
  is the variant the loader prefers; no such second torch is at hand here to run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from kernels import get_local_kernel
from kernels.variants import ArchVariant, TorchStableAbi, get_variants_local, resolve_variant

from conftest import BUILD, ROOT, skip_if_offline

# (one xdist worker for the file: it creates the shared torch-2.13-venv cache)
pytestmark = [
    pytest.mark.no_sanitize("checks build/'s release variants; build-asan/ holds one instrumented CPU variant"),
    pytest.mark.xdist_group("torch-2.13-venv"),
]

# LP_OTHER_VENV puts it elsewhere (test_offline_mode_skips_the_network_tests: a missing one).
OTHER_VENV = Path(os.environ.get("LP_OTHER_VENV", ROOT / ".venv-torch213"))
OTHER_TORCH = "2.13.0"
OTHER_REQUIREMENTS = [f"torch=={OTHER_TORCH}+cpu", "kernels==0.17.2"]
CUDA_LIBS = Path(torch.__file__).parent.parent / "nvidia" / "cu13" / "lib"


def stable_variant(backend: str | None) -> Path:
    variant, _ = resolve_variant(get_variants_local(BUILD), backend)
    assert variant is not None, f"no variant in {BUILD} for backend {backend}"
    return BUILD / variant.variant_str


def test_loader_picks_the_stable_abi_variants():
    for backend in (None, "cpu"):
        variant, _ = resolve_variant(get_variants_local(BUILD), backend)
        assert isinstance(variant, ArchVariant) and isinstance(variant.framework, TorchStableAbi), (
            backend, variant)
        assert str(variant.framework.version) == "2.10"
        lp = get_local_kernel(BUILD, backend=backend)
        assert Path(lp.__file__).parent.name == variant.variant_str


def test_stable_objects_do_not_link_libtorch_python():
    for so in BUILD.glob("torch-stable-abi*/*.so"):
        dynamic = subprocess.run(["readelf", "-d", str(so)], check=True, capture_output=True,
                                 text=True).stdout
        assert "libtorch_python" not in dynamic, so


@pytest.fixture(scope="session")
def other_python() -> Path:
    """The interpreter of the torch 2.13 environment, created when missing."""
    python = OTHER_VENV / "bin" / "python"
    stamp = OTHER_VENV / ".installed"
    if not stamp.exists():
        skip_if_offline(f"creating {OTHER_VENV.name} ({' '.join(OTHER_REQUIREMENTS)})")
        start = time.monotonic()
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--clear", str(OTHER_VENV)], check=True)
        # (--no-compile: the children import a few of torch's modules, not the thousands pip would compile)
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile",
                              "--disable-pip-version-check", *OTHER_REQUIREMENTS],
                             capture_output=True, text=True)
        assert pip.returncode == 0, f"creating {OTHER_VENV.name} failed:\n{pip.stdout}{pip.stderr}"
        stamp.write_text(" ".join(OTHER_REQUIREMENTS) + "\n")
        print(f"\n[stable-abi] created {OTHER_VENV.name} in {time.monotonic() - start:.0f} s")
    return python


# Runs in either environment: loads build/ for the CPU backend through the loader, runs every
# op on fixed inputs, checks one error, and saves what it produced.
CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from kernels import get_local_kernel

    build, inputs_path, out_path = map(Path, sys.argv[1:4])
    lp = get_local_kernel(build, backend=None if sys.argv[4] == "default" else sys.argv[4])
    inp = torch.load(inputs_path)
    logits, mask = inp["logits"], inp["mask"]
    inplace = logits.clone()
    lp.apply_token_bitmask_inplace(inplace, mask, indices=[2, 0])
    results = {
        "inplace": inplace,
        "packed": lp.apply_packed_bitmask(logits, mask, -7.5),
        "packed_bf16": lp.apply_packed_bitmask(logits.bfloat16(), mask),
        "sample": lp.sample(logits, temperature=0.8, top_k=20, top_p=0.9, seed=11, bitmask=mask),
        "sample_rows": lp.sample(logits.half(), temperature=torch.full((4,), 0.5),
                                 min_p=torch.full((4,), 0.05), seed=torch.arange(4), offset=3),
    }
    try:
        lp.sample(logits, top_p=2.0)
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.save(results, out_path)
    print(json.dumps({"torch": torch.__version__, "variant": Path(lp.__file__).parent.name,
                      "error": error}))
""")


def run_child(python: Path, inputs: Path, out: Path, backend: str, env=None) -> dict:
    proc = subprocess.run([str(python), "-c", CHILD, str(BUILD), str(inputs), str(out), backend],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_variant_runs_unchanged_under_torch_2_13(other_python, tmp_path):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g)
    mask = torch.randint(-(2**31), 2**31, (4, 10), generator=g, dtype=torch.int64).to(torch.int32)
    torch.save({"logits": logits, "mask": mask}, tmp_path / "inputs.pt")

    here = run_child(Path(sys.executable), tmp_path / "inputs.pt", tmp_path / "here.pt", "cpu")
    there = run_child(other_python, tmp_path / "inputs.pt", tmp_path / "there.pt", "default")

    assert here["torch"].startswith("2.14") and there["torch"].startswith(OTHER_TORCH)
    # On a CPU torch the loader chooses the CPU backend by itself: the stable CPU variant.
    assert here["variant"] == there["variant"] == stable_variant("cpu").name
    assert there["error"] == here["error"] and "top_p" in there["error"]
    ours, theirs = torch.load(tmp_path / "here.pt"), torch.load(tmp_path / "there.pt")
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def load_so_error(python: Path, so: Path, env=None) -> str:
    proc = subprocess.run([str(python), "-c", f"import torch, ctypes; ctypes.CDLL({str(so)!r})"],
                          capture_output=True, text=True, env=env)
    return "" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def test_cuda_variant_needs_a_cuda_torch(other_python):
    cuda = [d for d in BUILD.glob("torch-stable-abi*-cu*") if d.is_dir()]
    if not cuda:
        pytest.skip("no CUDA stable-ABI variant built")
    so = next(cuda[0].glob("*.so"))
    env = dict(os.environ, LD_LIBRARY_PATH=str(CUDA_LIBS))
    for error in (load_so_error(other_python, so), load_so_error(other_python, so, env)):
        assert "libtorch_cuda.so" in error, error
