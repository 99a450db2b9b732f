"""Compile the sources against the headers of the oldest torch the stable ABI promises.

Both variants are built at the stable-ABI level 2.10 (build.toml), so their .so must load into
every torch from 2.10 on, and the sources must also compile there: kernel-builder and the GPU
machine build them against their own (older) torch. The development torch is newer, and a
macro or function that only its headers have (STABLE_TORCH_ERROR_CODE_CHECK, 2.14) compiles
here and breaks there. This compiles, syntax only, every .cpp of both backends that includes a
torch header (the binding, torch-ext/) with the flags tools/build.py uses, against torch/include
of that release and nothing else of torch. The kernel sources include none (checked here too:
one that did would be compiled), so older torch headers cannot change what they compile to.

The headers come from the index's torch wheel (`pip download --no-deps`, about 900 MB, under a
minute on a fast link), of which only torch/include is unpacked (about 40 MB) into a cache
outside the repository, keyed by the version, and reused by later runs:
  ${XDG_CACHE_HOME:-~/.cache}/logits-processor/torch-<version>-include/

The .cu sources are not compiled here for the same reason (nvcc sees no torch header); CI's full
build compiles them.
The CUDA backend's binding (-DCUDA_KERNEL, the current-stream shim) needs cuda_runtime.h:
it is compiled when a CUDA toolkit is found, else reported as skipped.

  python tools/check_torch_headers.py [VERSION]     default: the stable-ABI level's 2.<m>.0
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (tools/build.py: the flags and sources of a real build)

ROOT = build.ROOT
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "logits-processor"


def oldest_torch(config: dict) -> str:
    """The lowest stable-ABI level in build.toml, as a release: "2.10" -> "2.10.0"."""
    levels = [build.stable_abi(config, backend) for backend in config["general"]["backends"]]
    major, minor = min(level for level in levels if level)
    return f"{major}.{minor}.0"


def torch_include(version: str) -> Path:
    """torch/include of that torch release, downloaded and unpacked once into the cache."""
    target = CACHE / f"torch-{version}-include"
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        start = time.monotonic()
        # The wheel's headers do not depend on the Python version or the CUDA build: one fixed
        # tag, so the same file is fetched from any interpreter.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "-d", scratch, f"torch=={version}"],
                       check=True)
        wheel = next(Path(scratch).glob("torch-*.whl"))
        size = wheel.stat().st_size
        unpacked = Path(scratch) / "unpacked"
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("torch/include/")]
            archive.extractall(unpacked, members)
        wheel.unlink()
        if target.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(target)
        (unpacked / "torch" / "include").rename(target)
        (target / ".complete").write_text(f"torch {version}: {len(members)} files\n")
        print(f"[headers] torch {version}: {size / 1e6:.0f} MB wheel, {len(members)} headers "
              f"unpacked into {target} in {time.monotonic() - start:.0f} s", flush=True)
    return target


def cuda_include() -> Path | None:
    home = build.cpp_extension.CUDA_HOME
    include = Path(home) / "include" if home else None
    return include if include and (include / "cuda_runtime.h").exists() else None


TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](?:torch|ATen|c10)/', re.MULTILINE)


def includes_torch(source: Path) -> bool:
    """Whether `source` or a header of this repository it includes (transitively) includes a
    torch header."""
    seen, stack = set(), [source]
    while stack:
        path = stack.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        text = path.read_text()
        if TORCH_INCLUDE.search(text):
            return True
        for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, re.MULTILINE):
            stack += [path.parent / name, ROOT / name]
    return False


def compile_commands(config: dict, include: Path, generated: Path) -> dict[str, list[str] | str]:
    """name -> the g++ command for one source of one backend, or the reason it is skipped."""
    python_include = sysconfig.get_paths()["include"]
    commands: dict[str, list[str] | str] = {}
    for backend in config["general"]["backends"]:
        extra = []
        if backend == "cuda":
            cuda = cuda_include()
            if cuda is None:
                commands["cuda"] = "no CUDA toolkit (cuda_runtime.h) found for the CUDA binding"
                continue
            extra = [f"-I{cuda}"]
        for source in build.sources(config, backend):
            if source.suffix != ".cpp" or not includes_torch(source):
                continue
            # As torch.utils.cpp_extension compiles them (its include paths and defines).
            commands[f"{backend}:{source.relative_to(ROOT)}"] = [
                os.environ.get("CXX", "g++"), "-fsyntax-only", "-fPIC", *build.host_flags(config, backend),
                "-D_GLIBCXX_USE_CXX11_ABI=1", "-DTORCH_EXTENSION_NAME=_logits_processor_check",
                f"-I{generated}", f"-I{ROOT}", f"-I{include}",
                f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", *extra,
                f"-I{python_include}", str(source)]
    return commands


def check(version: str) -> dict[str, str]:
    """name -> "ok", the reason it was skipped ("skipped: ..."), or the compiler's errors."""
    config = tomllib.loads((ROOT / "build.toml").read_text())
    include = torch_include(version)
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as generated:
        (Path(generated) / "registration.h").write_text(build.REGISTRATION_H)
        for name, command in compile_commands(config, include, Path(generated)).items():
            if isinstance(command, str):
                results[name] = f"skipped: {command}"
                continue
            proc = subprocess.run(command, capture_output=True, text=True)
            results[name] = "ok" if proc.returncode == 0 else proc.stderr.strip()
    return results


def main() -> int:
    config = tomllib.loads((ROOT / "build.toml").read_text())
    version = sys.argv[1] if len(sys.argv) > 1 else oldest_torch(config)
    results = check(version)
    for name, result in results.items():
        print(f"[headers] torch {version} {name}: {result}")
    return 0 if all(r == "ok" or r.startswith("skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
