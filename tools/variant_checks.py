"""The checks every variant of the matrix passes (`make release`, tests/build/).

1. Resolution: the loader's own resolver (kernels.variants) is asked, for each environment of
   ENVIRONMENTS on each machine, which variant of a bundle it loads; the answer must be the
   one named there (the newest compatible CUDA minor), and no environment is left without one.
2. Objects: each variant's .so is of its machine (ELF e_machine), needs no shared library but
   those its environment provides (readelf's NEEDED) and has no RPATH/RUNPATH, holds in its fatbin exactly the code
   metadata.json's backend.archs promises (tools/fatbin.py), and passes kernel-abi-check's
   Python-ABI check (abi3, 3.9).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernel_abi_check import ObjectFile
from kernels.backends import CPU, CUDA
from kernels.variants import _resolve_variant_for_system, get_variants_local
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkits  # noqa: E402
from fatbin import fatbin_entries  # noqa: E402
from toolkits import MACHINES  # noqa: E402

PYTHON_ABI = "3.9"
# (torch release, its CUDA or None for a CPU build, the backend tag of the variant it must load):
# the CUDA 12.6/12.8 wheel indexes (cu125 serves both: tools/toolkits.py), PyPI's 2.11+ (CUDA
# 13.0), 2.12's CUDA 13.2 build, a CPU torch.
ENVIRONMENTS = [("2.10", "12.6", "cu125"), ("2.10", "12.8", "cu125"), ("2.11", "13.0", "cu130"),
                ("2.14", "13.0", "cu130"), ("2.12", "13.2", "cu130"), ("2.13", None, "cpu")]

# What a torch of each kind has loaded before a kernel loads, beside the C and C++ runtimes.
SYSTEM_LIBRARIES = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1"}
TORCH_LIBRARIES = {"libc10.so", "libtorch_cpu.so", "libtorch.so"}
TORCH_CUDA_LIBRARIES = {"libc10_cuda.so", "libtorch_cuda.so"}


def metadata_only_bundle(config: dict, folder: Path, names: list[str]) -> Path:
    """Variant folders as the loader lists them, without a .so: the metadata.json that
    tools/matrix.py writes for each of `names` (archs cut to its toolkit)."""
    import matrix  # (imports torch, which the object checks do not need)

    specs = {spec.name(config): spec for spec in matrix.matrix(config)}
    for name in names:
        spec = specs[name]
        archs = toolkits.capabilities(matrix.requested_archs(config), spec.cuda) if spec.cuda else None
        (folder / name).mkdir(parents=True)
        (folder / name / "metadata.json").write_text(json.dumps(
            {"id": f"_logits_processor_{spec.backend}_0000000", "name": config["general"]["name"],
             "version": config["general"]["version"], "license": config["general"]["license"],
             "python-depends": [], "backend": {"type": spec.backend, **({"archs": archs} if archs else {})}}))
    return folder


def resolved(bundle: Path, torch: str, cuda: str | None, machine: str) -> str | None:
    """The variant of `bundle` that kernels' resolver loads for that torch on that machine
    (Linux, the C++11 ABI, no tvm-ffi), as get_kernel does: a CUDA torch selects the CUDA
    backend, whether or not a GPU is present."""
    backend = CUDA(version=Version(cuda)) if cuda else CPU()
    chosen, _ = _resolve_variant_for_system(
        variants=get_variants_local(bundle), selected_backend=backend, cpu=machine, os="linux",
        torch_version=Version(torch), torch_cxx11_abi=True, tvm_ffi_version=None)
    return chosen[0].variant_str if chosen else None


def resolution_problems(bundle: Path, framework: str, missing: set[str] = frozenset()
                        ) -> tuple[list[str], list[str]]:
    """(report lines, problems) of check 1 over ENVIRONMENTS x MACHINES: each must load
    `<framework>-<tag>-<machine>-linux` (framework: "torch-stable-abi210"). An environment whose
    expected variant is in `missing` (left out of a partial release) is reported, not a problem."""
    lines, problems = [], []
    for machine in MACHINES:
        for torch, cuda, tag in ENVIRONMENTS:
            got = resolved(bundle, torch, cuda, machine)
            environment = f"torch {torch}+{'cu' + cuda.replace('.', '') if cuda else 'cpu'} on {machine}"
            lines.append(f"{environment}: {got or 'NOTHING LOADS'}")
            expected = f"{framework}-{tag}-{machine}-linux"
            if got != expected and expected not in missing:
                problems.append(f"{environment} loads {got or 'nothing'}, expected {expected}")
    return lines, problems


def needed(so: Path) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", str(so)], check=True, capture_output=True, text=True).stdout
    return [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]


def elf_machine(so: Path) -> str:
    header = subprocess.run(["readelf", "-h", str(so)], check=True, capture_output=True, text=True).stdout
    return next(line.split(":", 1)[1].strip() for line in header.splitlines() if "Machine:" in line)


def promised_code(archs: list[str]) -> set[tuple[str, int]]:
    """The fatbin entries backend.archs promises: SASS for each, PTX too for "+PTX"."""
    code = set()
    for arch in archs:
        sm = int(arch.removesuffix("+PTX").replace(".", ""))
        code.add(("sass", sm))
        if arch.endswith("+PTX"):
            code.add(("ptx", sm))
    return code


def object_problems(variant_dir: Path, code: set[tuple[str, int]] | None = None) -> tuple[list[str], list[str]]:
    """(report lines, problems) of check 2 for one variant folder, named
    torch-stable-abi<MM>-<cpu|cuXY>-<machine>-linux. `code` overrides what the fatbin must
    hold (a PTX-only check build); by default it is what metadata.json promises."""
    _, tag, machine, _ = variant_dir.name.rsplit("-", 3)
    metadata = json.loads((variant_dir / "metadata.json").read_text())
    allowed = SYSTEM_LIBRARIES | {MACHINES[machine].dynamic_loader} | TORCH_LIBRARIES
    if tag.startswith("cu"):
        allowed |= TORCH_CUDA_LIBRARIES | {f"libcudart.so.{tag[2:4]}"}
    lines, problems = [], []
    for so in sorted(variant_dir.glob("*.so")):
        name = f"{variant_dir.name}/{so.name}"
        found = elf_machine(so)
        if found != MACHINES[machine].elf_machine:
            problems.append(f"{name}: ELF machine {found}, expected {MACHINES[machine].elf_machine}")
        dynamic = subprocess.run(["readelf", "-d", str(so)], check=True, capture_output=True, text=True).stdout
        if "(RPATH)" in dynamic or "(RUNPATH)" in dynamic:  # kernel-builder clears it (patchelf)
            problems.append(f"{name}: has an RPATH/RUNPATH, a path of the machine that built it")
        libraries = needed(so)
        if set(libraries) - allowed:
            problems.append(f"{name}: NEEDED {sorted(set(libraries) - allowed)}, which a torch of "
                            f"this kind does not provide")
        entries = fatbin_entries(so)
        wanted = code if code is not None else promised_code(metadata["backend"].get("archs") or [])
        if entries != wanted:
            problems.append(f"{name}: fatbin holds {sorted(entries)}, metadata promises {sorted(wanted)}")
        abi = ObjectFile(so).check_python_abi(PYTHON_ABI)
        if abi:
            problems.append(f"{name}: Python ABI (abi3, {PYTHON_ABI}) violations: {abi}")
        lines.append(f"  - `{so.name}`: {so.stat().st_size / 1e6:.1f} MB, {found}, NEEDED "
                     f"{', '.join(libraries)}; fatbin {' '.join(f'{k} {sm}' for k, sm in sorted(entries)) or 'none'}; "
                     f"abi3 {PYTHON_ABI} {'passes' if not abi else 'FAILS'}")
    if not lines:
        problems.append(f"{variant_dir.name}: no .so")
    return lines, problems
