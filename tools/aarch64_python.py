"""An aarch64 CPython with PyPI's aarch64 torch, run on this x86_64 machine under qemu-user.

  python tools/aarch64_python.py [ARGS...]   runs that Python (as `python ARGS...`)

What it is made of, cached once (about 800 MB, a minute or two) under
${XDG_CACHE_HOME:-~/.cache}/logits-processor/aarch64-python/:
- sysroot/: Debian bookworm's arm64 python3.11 and every library it needs (libc, libstdc++,
  libffi, ...), downloaded by apt-get with a configuration of its own (arm64 only, its own
  package lists in the cache: this machine's dpkg and apt state are untouched) and unpacked
  with dpkg-deb -x;
- site/: PyPI's aarch64 wheels of torch (TORCH, a CPU build), kernels and what both import
  (not sigstore, which only `kernels verify` uses), installed by this machine's pip with
  --platform/--target;
- qemu-aarch64 from Debian's qemu-user (installed with apt-get when missing).
The process sees platform.machine() == "aarch64": the loader picks aarch64 variants by itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toolkits import CACHE, MACHINES, apt_install  # noqa: E402

HOME = CACHE / "aarch64-python"
PYTHON = "python3.11"
TORCH = "torch==2.10.0"
WHEELS = [TORCH, "kernels==0.17.2"]  # installed without their dependencies (torch's name CUDA wheels)
DEPENDENCIES = ["filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec",
                "huggingface-hub", "packaging", "pyyaml", "tomlkit"]
DEBIAN = ["python3.11-minimal", "libpython3.11-stdlib", "libstdc++6"]  # apt adds their dependencies
SOURCES = """\
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Architectures: arm64
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def _sysroot() -> Path:
    sysroot = HOME / "sysroot"
    if (sysroot / ".complete").exists():
        return sysroot
    apt = HOME / "apt"
    for folder in ("lists/partial", "cache/archives/partial"):
        (apt / folder).mkdir(parents=True, exist_ok=True)
    (apt / "arm64.sources").write_text(SOURCES)
    options = [f"-o{option}" for option in (
        "APT::Architecture=arm64", "APT::Architectures::=arm64", f"Dir::Etc::SourceList={apt}/arm64.sources",
        "Dir::Etc::SourceParts=/dev/null", f"Dir::State::Lists={apt}/lists", f"Dir::Cache={apt}/cache",
        "Dir::State::Status=/dev/null", "Debug::NoLocking=1")]
    subprocess.run(["apt-get", "-q", *options, "update"], check=True, capture_output=True)
    subprocess.run(["apt-get", "-q", *options, "install", "--download-only", "--no-install-recommends", "-y",
                    *DEBIAN], check=True, capture_output=True)
    if sysroot.exists():
        shutil.rmtree(sysroot)
    for deb in sorted((apt / "cache" / "archives").glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(sysroot)], check=True)
    (sysroot / ".complete").write_text(" ".join(DEBIAN) + "\n")
    return sysroot


def _site() -> Path:
    site = HOME / "site"
    if (site / ".complete").exists():
        return site
    if site.exists():
        shutil.rmtree(site)
    platforms = [arg for tag in MACHINES["aarch64"].wheel_platforms + ("any",) for arg in ("--platform", tag)]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(site),
           "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
           "--abi", "cp311", "--abi", "abi3", "--abi", "none", *platforms]
    # Dependency markers are evaluated for this x86_64 machine, so torch's own would name its
    # x86_64 CUDA wheels: torch and kernels come without theirs, which are listed instead.
    subprocess.run(pip + ["--no-deps", *WHEELS], check=True)
    subprocess.run(pip + ["--upgrade", *DEPENDENCIES], check=True)
    (site / ".complete").write_text(" ".join(WHEELS + DEPENDENCIES) + "\n")
    return site


def command() -> tuple[list[str], dict[str, str]]:
    """The command line that starts the aarch64 Python, and its environment; made on first use."""
    missing = apt_install("qemu-aarch64", "qemu-user")
    if missing:
        raise RuntimeError(missing)
    start = time.monotonic()
    fresh = not ((HOME / "sysroot" / ".complete").exists() and (HOME / "site" / ".complete").exists())
    sysroot, site = _sysroot(), _site()
    if fresh:
        print(f"[aarch64-python] made {HOME} in {time.monotonic() - start:.0f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    return ["qemu-aarch64", "-L", str(sysroot), str(sysroot / "usr" / "bin" / PYTHON)], env


if __name__ == "__main__":
    cmd, environment = command()
    sys.exit(subprocess.run(cmd + sys.argv[1:], env=environment).returncode)
