"""`make release`: build the variant matrix, assemble what `kernel-builder upload` would push,
check it, print the upload.

The matrix is tools/matrix.py's: torch-stable-abi210-{cpu,cu125,cu130}-{x86_64,aarch64}-linux.
This machine's own variants come from build/ (`make build`, which `make release` runs first);
the others are built by tools/matrix.py into build-matrix/ (kept between runs: a variant whose
sources and flags did not change is not rebuilt), each with its own toolkit.

Refuses (exit 1) when the git tree is dirty, when a variant of the matrix cannot be built here
(a missing CUDA toolkit; LP_RELEASE_PARTIAL=1 writes the bundle without it, saying so), when a
variant fails tools/variant_checks.py (the loader's resolution over the bundle; each object's
ELF machine, NEEDED entries, fatbin and Python ABI), or when a variant's metadata.json or name
is not what the loader (kernels 0.17.2, offline) accepts. Otherwise it writes

  release/build/<variant>/   every variant of the matrix
  release/benchmarks/        the benchmark scripts
  release/custom_generate/   transformers' generate(custom_generate=...) loop (integrations/transformers/)
  release/README.md          CARD.md, the Hub card

and release-report.md (the report below, also printed), and prints the upload commands without
running them. The manylinux_2_28 verdict is reported as it is: objects built on this host link
glibc symbols newer than manylinux_2_28 allows, so they are for local testing; the build to
publish is kernel-builder's Nix build (`kernel-builder build-and-upload`), which links against
an old glibc.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from kernel_abi_check import ObjectFile
from kernels._rust import Build, Metadata
from kernels.backends import CPU, CUDA
from kernels.validate import AllValidator, default_metadata_validators
from kernels.variants import ArchVariant, TorchStableAbi, _resolve_variant_for_system, parse_variant
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix  # noqa: E402
import toolkits  # noqa: E402
import variant_checks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
MATRIX_BUILD = ROOT / "build-matrix"
RELEASE = ROOT / "release"
REPORT = ROOT / "release-report.md"
CUSTOM_GENERATE = ROOT / "integrations" / "transformers" / "custom_generate"
PYTHON_ABI = variant_checks.PYTHON_ABI
MANYLINUX = "manylinux_2_28"
# Torch releases the resolution check runs against: each stable-ABI variant must be accepted
# from its ABI version on and rejected below it.
TORCH_RELEASES = [Version(f"2.{minor}") for minor in range(9, 16)]


class Refusal(Exception):
    pass


def git_dirty() -> list[str]:
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    return status.splitlines()


def public_api(package: Path) -> list[str]:
    """`__all__` of the package's __init__.py, read without importing it."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise Refusal(f"{package}/__init__.py has no __all__")


def check_metadata(variant_dir: Path, config: dict) -> list[str]:
    """Checks one variant the way the loader reads it; returns report lines."""
    name = variant_dir.name
    try:
        variant = parse_variant(name)
    except ValueError as e:
        raise Refusal(f"{name}: not a variant name the loader parses ({e})") from e
    if not isinstance(variant, ArchVariant):
        raise Refusal(f"{name}: expected a compiled (arch) variant")
    try:
        metadata = Metadata.read_from_file(variant_dir / "metadata.json")
    except ValueError as e:
        raise Refusal(f"{name}: metadata.json rejected by the loader: {e}") from e
    AllValidator(default_metadata_validators()).validate_metadata(metadata=metadata, variant=name)
    so_files = sorted(variant_dir.glob("*.abi3.so"))
    problems = []
    if str(metadata.name) != config["general"]["name"]:
        problems.append(f"name {metadata.name} != build.toml's {config['general']['name']}")
    if metadata.version != config["general"]["version"]:
        problems.append(f"version {metadata.version} != build.toml's {config['general']['version']}")
    if [so.name for so in so_files] != [f"{metadata.id}.abi3.so"]:
        problems.append(f"expected exactly {metadata.id}.abi3.so, found {[so.name for so in so_files]}")
    if f"torch.ops.{metadata.id}" not in (variant_dir / "_ops.py").read_text():
        problems.append(f"_ops.py does not bind torch.ops.{metadata.id}")
    backend = metadata.backend
    if str(backend.backend_type) != variant.arch.backend.name:
        problems.append(f"metadata backend {backend.backend_type} != the name's {variant.arch.backend.name}")
    if variant.arch.backend.name == "cuda":
        cuda = f"{variant.arch.backend.version.major}.{variant.arch.backend.version.minor}"
        wanted = toolkits.capabilities(matrix.requested_archs(config), cuda)
        if list(backend.archs or []) != wanted:
            problems.append(f"built for CUDA archs {backend.archs}, build.toml's cut to CUDA {cuda} "
                            f"is {wanted} (rebuild without LP_CUDA_ARCHS)")
    if problems:
        raise Refusal(f"{name}: " + "; ".join(problems))

    lines = [f"- `{name}`: metadata accepted (id `{metadata.id}`, version {metadata.version}, "
             f"backend {backend.backend_type}"
             + (f" archs {', '.join(backend.archs)}" if backend.archs else "") + ")",
             f"  - `__all__`: {', '.join(public_api(variant_dir))}"]
    if isinstance(variant.framework, TorchStableAbi):
        accepted = [v for v in TORCH_RELEASES if resolves(variant, v)]
        expected = [v for v in TORCH_RELEASES if v >= variant.framework.version]
        if accepted != expected:
            raise Refusal(f"{name}: the loader accepts it for torch {accepted}, expected {expected}")
        lines.append(f"  - loader resolution: chosen for torch {', '.join(map(str, accepted))}; "
                     f"rejected for torch {', '.join(str(v) for v in TORCH_RELEASES if v not in accepted)}")
    return lines


def resolves(variant: ArchVariant, torch_version: Version) -> bool:
    """Whether the loader picks `variant` first for a torch of that version (with the variant's
    own CUDA for a CUDA variant, the CPU backend otherwise), on the variant's CPU and OS."""
    backend = CUDA(version=variant.arch.backend.version) if variant.arch.backend.name == "cuda" else CPU()
    chosen, _ = _resolve_variant_for_system(
        variants=[variant], selected_backend=backend, cpu=variant.arch.platform, os=variant.arch.os,
        torch_version=torch_version, torch_cxx11_abi=True, tvm_ffi_version=None)
    return chosen == [variant]


def check_objects(variant_dir: Path) -> tuple[list[str], bool]:
    """variant_checks' object checks (refuses on any problem), then kernel-abi-check's manylinux
    verdict on each object; returns report lines and whether every object passes manylinux."""
    lines, problems = variant_checks.object_problems(variant_dir)
    if problems:
        raise Refusal("; ".join(problems))
    manylinux_ok = True
    for so in sorted(variant_dir.glob("*.so")):
        manylinux = ObjectFile(so).check_manylinux(MANYLINUX)
        manylinux_ok &= not manylinux
        verdict = "passes" if not manylinux else "FAILS: " + ", ".join(
            f"{v.name} ({v.dep} {v.version})" for v in manylinux)
        lines.append(f"    {MANYLINUX} {verdict}")
    return lines, manylinux_ok


def matrix_variants(config: dict) -> tuple[list[Path], list[str], dict[str, str]]:
    """Every variant of the matrix that can be built here: this machine's from build/, the
    others built into build-matrix/. Returns their folders, report lines (how each was built,
    in how long) and {name: why it cannot be built} for the rest."""
    folders, lines, missing = [], [], {}
    for spec in matrix.matrix(config):
        name = spec.name(config)
        if spec.native:
            if not (BUILD / name).is_dir():
                raise Refusal(f"build/ has no {name}: run `make build`")
            folders.append(BUILD / name)
            lines.append(f"- `{name}`: from build/ (`make build`)")
            continue
        reason = toolkits.install_compiler(spec.machine) or matrix.unavailable(spec)
        if reason:
            missing[name] = reason
            continue
        start, before = time.monotonic(), set((MATRIX_BUILD / name).glob("*.so"))
        try:
            folders.append(matrix.build_variant(config, spec, MATRIX_BUILD))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            raise Refusal(f"{name}: the build failed: {e}") from e
        so = next(folders[-1].glob("*.so"))
        how = "up to date" if so in before else f"built in {time.monotonic() - start:.0f} s"
        lines.append(f"- `{name}`: tools/matrix.py into build-matrix/, {how}, {so.stat().st_size / 1e6:.1f} MB")
    return folders, lines, missing


def upload_commands(repo_id: str, version: int) -> list[str]:
    branch = f"v{version}"
    return [
        "# kernel-builder (pushes build/ and benchmarks/ to the version branch, the card to main):",
        f"kernel-builder upload {RELEASE.relative_to(ROOT)} --repo-id {repo_id} --branch {branch} --repo-type kernel",
        "# or the hf CLI:",
        f"hf repos create {repo_id} --repo-type kernel --exist-ok",
        f"hf repos branch create {repo_id} {branch} --repo-type kernel --exist-ok",
        f"hf upload {repo_id} release/build build --repo-type kernel --revision {branch}",
        f"hf upload {repo_id} release/benchmarks benchmarks --repo-type kernel --revision {branch}",
        f"hf upload {repo_id} release/README.md README.md --repo-type kernel --revision main",
    ]


def main() -> int:
    try:
        dirty = git_dirty()
        if dirty:
            raise Refusal("the git tree is dirty (commit or remove these first):\n  " + "\n  ".join(dirty))
        Build.open(ROOT)  # build.toml as the loader's own parser reads it
        config = tomllib.loads((ROOT / "build.toml").read_text())
        variants, built, missing = matrix_variants(config)
        if missing and os.environ.get("LP_RELEASE_PARTIAL") != "1":
            raise Refusal("these variants of the matrix cannot be built here (LP_RELEASE_PARTIAL=1 "
                          "releases without them):\n  " + "\n  ".join(f"{n}: {r}" for n, r in missing.items()))
        report = [f"# Release report: {config['general']['name']} version {config['general']['version']}",
                  "", f"Commit {subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()}",
                  "", "## Builds", "", *built, *(f"- `{n}`: NOT BUILT: {r}" for n, r in missing.items()),
                  "", "## Variants", ""]
        manylinux_ok = True
        for variant_dir in variants:
            report += check_metadata(variant_dir, config)
            lines, ok = check_objects(variant_dir)
            report += lines
            manylinux_ok &= ok
    except Refusal as refusal:
        print(f"[release] refused: {refusal}", file=sys.stderr)
        return 1

    if RELEASE.exists():
        shutil.rmtree(RELEASE)
    for variant_dir in variants:
        shutil.copytree(variant_dir, RELEASE / "build" / variant_dir.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks", RELEASE / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # generate(custom_generate="<repo>", trust_remote_code=True) runs the repo's custom_generate/generate.py.
    shutil.copytree(CUSTOM_GENERATE, RELEASE / "custom_generate", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "CARD.md", RELEASE / "README.md")

    framework = matrix.matrix(config)[0].name(config).rsplit("-", 3)[0]
    lines, problems = variant_checks.resolution_problems(RELEASE / "build", framework, set(missing))
    if problems:
        shutil.rmtree(RELEASE)
        print("[release] refused: the loader's resolution over the bundle:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    report += ["", "## Loader resolution (kernels' resolver over release/build)", "",
               *(f"- {line}" for line in lines)]
    report += ["", "## manylinux", ""]
    if manylinux_ok:
        report.append(f"Every object passes {MANYLINUX}.")
    else:
        report.append(
            f"Not publishable as built: these objects were built on this host and link glibc "
            f"symbols newer than {MANYLINUX} allows, so they load only on systems with as new a "
            f"glibc. Publish the output of kernel-builder's Nix build instead (`kernel-builder "
            f"build-and-upload`, or `kernel-builder build` then the upload below on its build/), "
            f"which links against an old glibc and passes {MANYLINUX}.")
    report += ["", f"## Bundle: {RELEASE.relative_to(ROOT)}/", ""]
    report += [f"- {p.relative_to(RELEASE)}" for p in sorted(RELEASE.iterdir())]
    report += ["", "## Upload (not run)", "", "```sh",
               *upload_commands(config["general"]["hub"]["repo-id"], config["general"]["version"]),
               "```"]
    REPORT.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
