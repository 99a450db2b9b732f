"""Builds the CUDA emulation (tests/cuda_emulation/): the binding and the .cu kernels (as
build.toml lists them) compiled by the host compiler against the emulation header, with
-DLP_CUDA_EMULATION, which makes the binding take its CUDA path (validation, launch
configuration, scratch, launch) on CPU tensors. Each flavor is a CPU variant the loader reads:
build-emulation/<flavor>/torch-stable-abi210-cpu-x86_64-linux/.

Flavors (a block's threads run as fibers in each, runtime.cpp):
  fibers   the kernels as they are: the fast one, for the agreement tests in both orders
  traffic  the kernels with ThreadSanitizer's instrumentation, linked with tests/cuda_emulation/
           traffic.cpp instead of the sanitizer: its hooks count the global-memory bytes
  tsan     the kernels under ThreadSanitizer, each CUDA thread a TSan fiber
  concurrent  tsan's, with a launch's blocks running at the same time on OS threads
  asan     the kernels and the runtime under AddressSanitizer + UBSan
The binding and the CPU oracle's sources are compiled once, uninstrumented, for all of them;
the kernels of fibers, tsan and asan carry gcov counters (COVERAGE). The kernels of every flavor
but traffic are compiled from the mutant schemata (tests/cuda_emulation/mutations.py:
build-emulation/.schema/logits_processor/, every planted bug behind a switch that is off unless
LP_MUTANT names it); traffic's from logits_processor/ itself, since a switch's read would be
counted as global memory.

  python tools/build_emulation.py [FLAVOR ...]        (default: all)

Environment: MAX_JOBS (parallel compiles), CXX (default c++).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (tools/build.py: the variant layout and the build.toml reading)

sys.path.insert(0, str(build.ROOT / "tests" / "cuda_emulation"))
import mutations  # noqa: E402  (the mutants, written into the schema the kernels compile from)
from torch.utils import cpp_extension  # noqa: E402

ROOT = build.ROOT
EMULATION = ROOT / "tests" / "cuda_emulation"
OUT = ROOT / "build-emulation"
SHARED_OBJ = OUT / ".obj" / "shared"
SCHEMA = OUT / ".schema" / "logits_processor"  # the kernels with the mutants' switches
# The venv's ninja (requirements-dev.txt), as torch's extension builds use, else PATH's.
NINJA = shutil.which("ninja", path=str(Path(sys.executable).parent)) or "ninja"

SANITIZE_ADDRESS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer"]
# Line coverage of the kernels' own sources (logits_processor/, not the emulation's headers)
# (tests/cuda_emulation/coverage.py compares the sanitizer runs' with the fibers runs'). The
# kernels of those flavors are all built at -O2 -g: gcov counts a line in the function it was
# inlined into early, which depends on the optimisation level.
COVERAGE = ["--coverage", f"-fprofile-filter-files={SCHEMA}/"]
MUTANT_SWITCH = ["-include", str(EMULATION / "mutant_switch.h")]
FLAVORS = {
    # kernels, runtime: the flags of the kernels and of the emulation's runtime; link: of the
    # .so; extra: sources of the flavor's own; coverage: how its kernels count lines (of the
    # schema's copies, which keep the sources' lines); schema: its kernels carry the mutants
    "fibers": dict(kernels=["-O2", "-g"], runtime=["-O2"], link=[], extra=[],
                   coverage=COVERAGE + ["-fprofile-update=single"], schema=True),
    # The kernels compiled with ThreadSanitizer's instrumentation but linked with traffic.cpp
    # instead of the sanitizer: its hooks count the global-memory bytes. (-Wno-tsan: the
    # instrumentation ignores __threadfence, which only orders writes between blocks.)
    "traffic": dict(kernels=["-O2", "-fsanitize=thread", "-Wno-tsan"], runtime=["-O2"], link=[],
                    extra=["tests/cuda_emulation/traffic.cpp"], coverage=[], schema=False),
    # The runtime is not instrumented: it tells ThreadSanitizer what the block's threads, its
    # fibers, synchronise on (runtime.cpp). Coverage counters are updated atomically: the
    # threads' plain increments would be races to it.
    "tsan": dict(kernels=["-O2", "-g", "-fsanitize=thread", "-Wno-tsan"], runtime=["-O1", "-g", "-DLP_EMULATION_TSAN"],
                 link=["-fsanitize=thread"], extra=[], coverage=COVERAGE + ["-fprofile-update=atomic"], schema=True),
    # tsan's, with each block on an OS thread of its own, blocks at the same time (runtime.cpp).
    "concurrent": dict(kernels=["-O2", "-g", "-fsanitize=thread", "-Wno-tsan", "-DLP_EMULATION_CONCURRENT"],
                       runtime=["-O1", "-g", "-DLP_EMULATION_TSAN", "-DLP_EMULATION_CONCURRENT"],
                       link=["-fsanitize=thread"], extra=[], coverage=[], schema=True),
    "asan": dict(kernels=["-O2", "-g"] + SANITIZE_ADDRESS, runtime=["-O1", "-g"] + SANITIZE_ADDRESS,
                 link=["-fsanitize=address,undefined"], extra=[], coverage=COVERAGE + ["-fprofile-update=single"],
                 schema=True),
}


def config() -> dict:
    return tomllib.loads((ROOT / "build.toml").read_text())


def emulated_kernels(cfg: dict) -> list[str]:
    """The CUDA variant's .cu files (build.toml), which the emulation compiles with -x c++."""
    return sources_ending(cfg, "cuda", ".cu")


def shared_sources(cfg: dict) -> list[str]:
    """The CPU variant's .cpp files (build.toml: the binding and the CPU kernels, which the
    emulated tests compare against), compiled once for every flavor."""
    return sources_ending(cfg, "cpu", ".cpp")


def sources_ending(cfg: dict, backend: str, suffix: str) -> list[str]:
    """`backend`'s sources ending in `suffix`, relative to the root.
    Their objects are named by stem, so two of one stem would overwrite each other's."""
    files = [p.relative_to(ROOT).as_posix() for p in build.sources(cfg, backend) if p.suffix == suffix]
    stems = [Path(f).stem for f in files]
    clashes = sorted({s for s in stems if stems.count(s) > 1})
    if clashes:
        raise SystemExit(f"[emulation] {backend} sources share the object names {clashes}")
    return files


def ops_name(cfg: dict, flags: list[str]) -> str:
    """One name for every flavor: they share the binding's object."""
    files = build.sources(cfg, "cuda") + sorted(p for p in EMULATION.rglob("*") if p.suffix in (".h", ".cuh", ".cpp"))
    return f"_logits_processor_emulated_{build.source_hash(files, flags)}"


def common_flags(cfg: dict) -> list[str]:
    stable = build.stable_abi(cfg, "cuda")
    archs = build.cuda_archs(cfg)
    return (["-fPIC", "-std=c++20", "-DPy_LIMITED_API=0x03090000", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-DCUDA_KERNEL", "-DLP_CUDA_EMULATION", build.supported_archs_flag(archs),
             "-fno-strict-aliasing"]  # the kernels move logits as uint4, as nvcc allows
            + (build.stable_abi_flags(stable) if stable else [])
            + build.section_flags(cfg, "cuda", "cxx-flags")
            + [f"-I{EMULATION / 'include'}", f"-I{OUT / '.obj' / 'include'}", f"-I{ROOT}"]
            + [f"-isystem{p}" for p in cpp_extension.include_paths()]
            + [f"-isystem{sysconfig.get_paths()['include']}"])


def ninja_file(cfg: dict, cxx: str, flags: list[str], ops: str, flavors: list[str]) -> str:
    lines = [
        f"cxx = {cxx}",
        f"flags = {' '.join(flags)} -DTORCH_EXTENSION_NAME={ops}",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $flags $extra -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx $in -shared -Wl,--as-needed $ldflags -o $out",
        "",
    ]
    shared_files = shared_sources(cfg)
    shared = [SHARED_OBJ / (Path(s).stem + ".o") for s in shared_files]
    for source, obj in zip(shared_files, shared):
        lines += [f"build {obj}: compile {ROOT / source}", "  extra = -O2", ""]
    torch_lib = Path(cpp_extension.include_paths()[0]).parent / "lib"
    for flavor in flavors:
        spec = FLAVORS[flavor]
        obj_dir = OUT / ".obj" / flavor
        objects = list(shared)
        kernels = emulated_kernels(cfg)
        kernel_dir = SCHEMA if spec["schema"] else ROOT / "logits_processor"
        for source in kernels + ["tests/cuda_emulation/runtime.cpp"] + spec["extra"]:
            obj = obj_dir / (Path(source).stem + ".o")
            # (A kernel's quoted includes resolve next to it first: the schema's headers are the schema's.)
            path = kernel_dir / Path(source).name if source in kernels else ROOT / source
            kind = "runtime" if source.startswith("tests/") else "kernels"
            language = "-x c++ " if path.suffix == ".cu" else ""
            own = spec["coverage"] + (MUTANT_SWITCH if spec["schema"] else []) if kind == "kernels" else []
            lines += [f"build {obj}: compile {path}", f"  extra = {language}{' '.join(spec[kind] + own)}", ""]
            objects.append(obj)
        linked = ["--coverage"] if spec["coverage"] else []
        lines += [f"build {obj_dir / (ops + '.so')}: link {' '.join(map(str, objects))}",
                  f"  ldflags = -L{torch_lib} -lc10 -ltorch_cpu -ltorch {' '.join(spec['link'] + linked)}", ""]
    return "\n".join(lines)


def undefined_symbols(so: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], check=True, capture_output=True,
                         text=True).stdout
    return [line.split()[-1] for line in out.splitlines()]


def build_emulation(flavors: list[str]) -> dict[str, Path]:
    """Builds the flavors into build-emulation/<flavor>/<variant>/; returns the variant dirs."""
    cfg = config()
    flags = common_flags(cfg)
    ops = ops_name(cfg, flags)
    include = OUT / ".obj" / "include"
    include.mkdir(parents=True, exist_ok=True)
    registration = include / "registration.h"
    if not registration.exists() or registration.read_text() != build.REGISTRATION_H:
        registration.write_text(build.REGISTRATION_H)
    mutations.write_schema(SCHEMA)
    cxx = os.environ.get("CXX", "c++")
    (OUT / "build.ninja").write_text(ninja_file(cfg, cxx, flags, ops, flavors))
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
    print(f"[emulation] {', '.join(flavors)} into {OUT.relative_to(ROOT)}", flush=True)
    subprocess.run([NINJA, "-C", str(OUT), "-j", jobs, "--quiet"], check=True)
    stable = build.stable_abi(cfg, "cuda")
    variants = {}
    for flavor in flavors:
        so = OUT / ".obj" / flavor / f"{ops}.so"
        if flavor == "traffic":
            # Every instrumentation hook the kernels call must come from traffic.cpp, or the
            # loader would fail (or, worse, find a sanitizer's).
            missing = [s for s in undefined_symbols(so) if s.startswith("__tsan_")]
            if missing:
                raise SystemExit(f"[emulation] traffic.cpp lacks the hooks {', '.join(missing)}")
        variant_dir = OUT / flavor / build.variant_name("cpu", stable)
        build.write_variant(cfg, variant_dir, so, ops, {"type": "cpu"}, strip=False)
        variants[flavor] = variant_dir
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("flavors", nargs="*", help="fibers, traffic, tsan, concurrent, asan (default: all)")
    args = parser.parse_args()
    unknown = set(args.flavors) - set(FLAVORS)
    if unknown:
        raise SystemExit(f"unknown flavors {sorted(unknown)}; known: {list(FLAVORS)}")
    build_emulation(args.flavors or list(FLAVORS))


if __name__ == "__main__":
    main()
