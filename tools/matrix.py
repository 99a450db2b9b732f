"""The variant matrix: every variant build.toml describes, for every CUDA toolkit and machine.

  torch-stable-abi210-{cpu,cu125,cu130}-{x86_64,aarch64}-linux

Each is compiled for its own machine (aarch64 with Debian's g++-aarch64-linux-gnu) and each
CUDA variant with its own toolkit (tools/toolkits.py), with the sources, flags and layout of
tools/build.py (`make build`, which builds only this machine's variants, through
torch.utils.cpp_extension; that cannot cross-compile nor use another CUDA than torch's). The
capabilities are build.toml's, cut to what each toolkit can target (toolkits.capabilities), and
metadata.json lists exactly those. Compiling goes through a ninja file per variant; linking is
against this torch's libraries (x86_64) or, for another machine, against stand-ins with the
same sonames that define only the symbols the objects use, so that `--as-needed` leaves the
same NEEDED entries as a link against that machine's torch would.

  python tools/matrix.py [--out DIR] [NAME...]   build those variants (default: all) into DIR
                                                 (inside the repository; default build-matrix/)
  python tools/matrix.py --list                  the matrix, and what each variant needs

Python's headers are this interpreter's (only PyModule_Create of the limited API is used, whose
declarations are the same on every 64-bit Linux); torch's are this torch's, compiled down to the
stable ABI level (TORCH_TARGET_VERSION), as for build.py.

Environment: LP_CUDA_HOME_<MM> (a local CUDA toolkit, see toolkits.py), MAX_JOBS.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (tools/build.py: sources, flags, the variant layout)
import toolkits  # noqa: E402
from toolkits import HOST, MACHINES, TOOLKITS  # noqa: E402

ROOT = build.ROOT
torch = build.torch
CUDA_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                "--expt-relaxed-constexpr"]  # as torch.utils.cpp_extension compiles .cu files
# What build.py links (cpp_extension's list for a CUDA build); --as-needed keeps the used ones.
TORCH_LIBS = {"cpu": ["c10", "torch_cpu", "torch", "torch_python"],
              "cuda": ["c10", "c10_cuda", "torch_cpu", "torch_cuda", "torch", "torch_python"]}


@dataclass(frozen=True)
class Spec:
    """One variant of the matrix."""

    backend: str  # "cpu" or "cuda"
    machine: str  # "x86_64" or "aarch64"
    cuda: str | None = None  # the toolkit's CUDA version, for a CUDA variant

    def name(self, config: dict) -> str:
        stable = build.stable_abi(config, self.backend)
        if stable is None:
            raise SystemExit(f"[matrix] build.toml builds {self.backend} for the running torch only "
                             "([torch.stable-abi]): no matrix across torch versions")
        tag = TOOLKITS[self.cuda].tag if self.cuda else "cpu"
        return f"torch-stable-abi{stable[0]}{stable[1]}-{tag}-{self.machine}-linux"

    @property
    def native(self) -> bool:
        """Whether tools/build.py (`make build`) builds this variant on this machine."""
        torch_cuda = ".".join((torch.version.cuda or "").split(".")[:2])
        return self.machine == HOST and (self.backend == "cpu" or self.cuda == torch_cuda)


def matrix(config: dict) -> list[Spec]:
    specs = []
    for machine in MACHINES:
        for backend in config["general"]["backends"]:
            if backend == "cuda":
                specs += [Spec("cuda", machine, cuda) for cuda in TOOLKITS]
            else:
                specs.append(Spec(backend, machine))
    return specs


def requested_archs(config: dict) -> list[str]:
    """build.toml's CUDA capabilities (all [kernel.*] sections of the CUDA backend)."""
    archs = {a for s in config["kernel"].values() if s["backend"] == "cuda"
             for a in s.get("cuda-capabilities", [])}
    return sorted(archs, key=toolkits._version_key)


def unavailable(spec: Spec) -> str | None:
    """Why `spec` cannot be built here, or None."""
    machine = MACHINES[spec.machine]
    if shutil.which(machine.cxx) is None:
        return f"no {machine.cxx} (Debian: apt-get install {machine.apt_package})"
    if spec.cuda and toolkits.compiler(spec.cuda) is None:
        return toolkits.missing_compiler(spec.cuda)
    return None


def stand_in_libraries(spec: Spec, objects: list[Path], folder: Path) -> Path:
    """lib<name>.so for each torch library the link names, built for spec.machine: each defines
    those symbols of the objects that this torch's library of that name exports (the first
    library in link order wins, as for the linker), as empty functions or bytes."""
    nm = MACHINES[spec.machine].cxx.replace("g++", "nm") if spec.machine != HOST else "nm"
    undefined = set()
    for obj in objects:
        out = subprocess.run([nm, "-u", "--format=posix", str(obj)], check=True, capture_output=True,
                             text=True).stdout
        undefined |= {line.split()[0] for line in out.splitlines() if line.strip()}
    folder.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(build.cpp_extension.library_paths()[0])
    for name in TORCH_LIBS[spec.backend]:
        exported = subprocess.run(["nm", "-D", "--defined-only", "--format=posix",
                                   str(torch_lib / f"lib{name}.so")], check=True, capture_output=True,
                                  text=True).stdout
        lines = []
        for line in exported.splitlines():
            symbol, kind = line.split()[:2]
            if symbol in undefined:
                undefined.discard(symbol)
                stand_in = f"s{len(lines)}"
                lines.append(f'void {stand_in}(void) __asm__("{symbol}"); void {stand_in}(void) {{}}'
                             if kind in "TWi" else f'char {stand_in}[16] __asm__("{symbol}");')
        source = folder / f"lib{name}.c"
        source.write_text("\n".join(lines) + "\n")
        subprocess.run([MACHINES[spec.machine].cxx, "-x", "c", "-shared", "-fPIC", f"-Wl,-soname,lib{name}.so",
                        str(source), "-o", str(folder / f"lib{name}.so")], check=True)
    return folder


def compile_flags(config: dict, spec: Spec, archs: list[str], ops_name: str, include_dir: Path,
                  cuda_target: toolkits.Target | None, quick: bool) -> tuple[list[str], list[str]]:
    """The host compiler's and nvcc's flags, as tools/build.py (torch.utils.cpp_extension) has
    them for the running machine."""
    includes = [f"-I{include_dir}", f"-I{ROOT}"]
    system = list(build.cpp_extension.include_paths())
    if cuda_target:
        system += [str(p) for p in cuda_target.includes]
    system.append(sysconfig.get_paths()["include"])
    common = ([f"-DTORCH_EXTENSION_NAME={ops_name}", "-DTORCH_API_INCLUDE_EXTENSION_H"] + includes
              + [arg for path in system for arg in ("-isystem", path)])
    stable = build.stable_abi(config, spec.backend)
    cflags = common + ["-fPIC", "-std=c++20"] + build.host_flags(config, spec.backend)
    if spec.backend != "cuda":
        return cflags, []
    cuda_flags = (common + CUDA_DEFINES + ["--compiler-options", "-fPIC", "-ccbin", MACHINES[spec.machine].cxx]
                  + build.CUDA_FLAGS + [build.backend_define("cuda")] + build.stable_abi_flags(stable)
                  + build.gencode_flags(archs) + [build.supported_archs_flag(archs)]
                  + build.section_flags(config, "cuda", "cuda-flags"))
    if quick:
        # A check, not a release: PTX only (no ptxas) and cicc's optimiser off, seconds instead
        # of minutes for the sampler's kernels and one capability. What it is for: the front end (CCCL's
        # templates), the host code through the target's compiler, the link.
        cuda_flags = [f for f in cuda_flags if not f.startswith("-gencode")] + ["-Xcicc", "-O0"] + [
            f"-gencode=arch=compute_{n},code=compute_{n}" for n in (a.removesuffix("+PTX").replace(".", "") for a in archs)]
    return cflags, cuda_flags


def ninja_file(cxx: str, nvcc: Path | None, cflags: list[str], cuda_flags: list[str],
               sources: list[Path]) -> tuple[str, list[str]]:
    quote = lambda flags: " ".join(shlex.quote(f) for f in flags)  # noqa: E731
    lines = ["ninja_required_version = 1.3", f"cxx = {cxx}", f"cflags = {quote(cflags)}",
             "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc"]
    if nvcc:
        lines += [f"nvcc = {nvcc}", f"cuda_flags = {quote(cuda_flags)}", "rule cuda_compile",
                  "  command = $nvcc -MD -MF $out.d $cuda_flags -c $in -o $out",
                  "  depfile = $out.d", "  deps = gcc"]
    objects = []
    for source in sources:
        obj = source.stem + (".cuda.o" if source.suffix == ".cu" else ".o")
        lines.append(f"build {obj}: {'cuda_compile' if source.suffix == '.cu' else 'compile'} {source}")
        objects.append(obj)
    return "\n".join(lines) + "\n", objects


def build_variant(config: dict, spec: Spec, out_root: Path, archs: list[str] | None = None,
                  quick: bool = False) -> Path:
    """Build `spec` into out_root/<variant>/ (objects in out_root/.obj/<variant>/) and return
    that folder; up to date when its ops name (a hash of sources and flags) already exists.
    `archs` narrows the CUDA capabilities; `quick` makes a check build: PTX only, unoptimised
    (compile_flags), written with no archs in metadata.json (it has no word for PTX alone).
    Builds of one variant wait for each other (test workers in parallel share out_root)."""
    (out_root / ".obj").mkdir(parents=True, exist_ok=True)
    with open(out_root / ".obj" / f"{spec.name(config)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_variant(config, spec, out_root, archs, quick)


def _build_variant(config: dict, spec: Spec, out_root: Path, archs: list[str] | None, quick: bool) -> Path:
    reason = unavailable(spec)
    if reason:
        raise RuntimeError(f"{spec.name(config)}: {reason}")
    machine = MACHINES[spec.machine]
    home = toolkits.compiler(spec.cuda) if spec.cuda else None
    cuda_target = toolkits.target(spec.cuda, spec.machine, home) if spec.cuda else None
    if spec.cuda:
        archs = archs or toolkits.capabilities(requested_archs(config), spec.cuda)
    files = build.sources(config, spec.backend)
    compiled = [f for f in files if f.suffix in (".cpp", ".cu")]
    variant_dir = out_root / spec.name(config)
    obj_dir = out_root / ".obj" / variant_dir.name
    include_dir = obj_dir / "include"
    # The hash covers what decides the object code: sources, flags (with the toolkit's release
    # and the machine), and these build scripts.
    cflags, cuda_flags = compile_flags(config, spec, archs or [], "OPS", Path("/INCLUDE"), cuda_target, quick)
    identity = cflags + cuda_flags + [machine.cxx, str(home)]
    digest = build.source_hash(files + [Path(__file__), Path(toolkits.__file__)], identity)
    ops_name = f"_logits_processor_{spec.backend}_{digest}"
    so_path = variant_dir / f"{ops_name}.abi3.so"
    if so_path.exists():
        shutil.copytree(build.PACKAGE, variant_dir, ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
        print(f"[matrix] {variant_dir.name} is up to date ({ops_name})", flush=True)
        return variant_dir

    start = time.monotonic()
    print(f"[matrix] {variant_dir.name}: compiling {len(compiled)} sources with {machine.cxx}"
          + (f" and nvcc {spec.cuda} ({home}) for CUDA {', '.join(archs)}" if spec.cuda else "")
          + (" (quick: device code unoptimised)" if quick else ""), flush=True)
    include_dir.mkdir(parents=True, exist_ok=True)
    (include_dir / "registration.h").write_text(build.REGISTRATION_H)
    cflags, cuda_flags = compile_flags(config, spec, archs or [], ops_name, include_dir, cuda_target, quick)
    text, objects = ninja_file(machine.cxx, home / "bin" / "nvcc" if home else None, cflags, cuda_flags,
                               compiled)
    (obj_dir / "build.ninja").write_text(text)
    ninja = shutil.which("ninja", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # The compilers' output (nvcc's ptxas report) only with LP_VERBOSE=1 or on failure.
    verbose = os.environ.get("LP_VERBOSE") == "1"
    proc = subprocess.run([ninja, "-C", str(obj_dir), "-j", os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))],
                          stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise RuntimeError(f"{variant_dir.name}: compiling failed:\n{(proc.stdout or '')[-20000:]}")
    objects = [obj_dir / o for o in objects]

    if spec.machine == HOST:
        lib_dir = Path(build.cpp_extension.library_paths()[0])
    else:
        lib_dir = stand_in_libraries(spec, objects, obj_dir / "stand-ins")
    link = [machine.cxx, *map(str, objects), "-shared", "-Wl,--as-needed", f"-L{lib_dir}",
            *(f"-l{name}" for name in TORCH_LIBS[spec.backend])]
    if cuda_target:
        link += [f"-L{cuda_target.libcudart.parent}", f"-l:{cuda_target.libcudart.name}"]
    built = obj_dir / f"{ops_name}.so"
    subprocess.run(link + ["-o", str(built)], check=True)
    if "libtorch_python.so" in build.linked_libraries(built):
        raise RuntimeError(f"{built} links libtorch_python: not a stable-ABI build")
    build.write_variant(config, variant_dir, built, ops_name,
                        # A quick build holds PTX only, which metadata has no word for: no archs.
                        {"type": "cuda", "archs": [] if quick else archs} if spec.cuda else {"type": "cpu"},
                        strip=spec.machine == HOST)
    if spec.machine != HOST:
        subprocess.run([machine.cxx.replace("g++", "strip"), "--strip-debug", str(so_path)], check=True)
    print(f"[matrix] {variant_dir.name}: built in {time.monotonic() - start:.0f} s, "
          f"{so_path.stat().st_size / 1e6:.1f} MB", flush=True)
    return variant_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="variant names (default: the whole matrix)")
    parser.add_argument("--out", type=Path, default=ROOT / "build-matrix")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    config = tomllib.loads((ROOT / "build.toml").read_text())
    specs = {spec.name(config): spec for spec in matrix(config)}
    if args.list:
        for name, spec in specs.items():
            archs = toolkits.capabilities(requested_archs(config), spec.cuda) if spec.cuda else []
            print(f"{name}: {' '.join(archs) or 'cpu'}; {unavailable(spec) or 'can be built here'}"
                  + ("; `make build` builds it" if spec.native else ""))
        return 0
    unknown = [n for n in args.names if n not in specs]
    if unknown:
        raise SystemExit(f"[matrix] not in the matrix: {', '.join(unknown)}")
    for name in args.names or specs:
        build_variant(config, specs[name], args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
