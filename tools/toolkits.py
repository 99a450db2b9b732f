"""The CUDA toolkits and target machines of the variant matrix, and where each piece comes from.

Every CUDA variant is compiled by the nvcc of its own CUDA version, against that version's
runtime headers and CCCL (CUB, libcu++), for its own target machine, and linked against that
version's shared runtime, libcudart.so.<major>: kernel-builder links `CUDA::cudart` (the shared
runtime) the same way, and a torch of that CUDA major has loaded it before any kernel loads.

The CUDA 12 toolkit is 12.5: the newest CUDA 12 whose whole compiler can be fetched here (see
below). The loader takes a variant of the running torch's CUDA major whose minor is not above
torch's (kernels.variants), so cu125 serves every CUDA 12 torch from 12.5 on: the 12.6, 12.8 and
12.9 wheel indexes, PyPI's torch 2.10. A CUDA 12 toolkit cannot target 10.0 or 12.0 before
12.8; the 9.0 PTX it carries is JIT-compiled by the driver on Blackwell.

Where the pieces come from (downloads go once into the cache, keyed by version and machine:
${XDG_CACHE_HOME:-~/.cache}/logits-processor/cuda-<version>-<what>/):
- The compiler (nvcc, cicc, cudafe++, fatbinary, ptxas and its crt/ headers, one release, run on
  this x86_64 machine): a local toolkit of exactly that CUDA version (LP_CUDA_HOME_<MM>, e.g.
  LP_CUDA_HOME_125, else /usr/local/cuda-<M.m>, else /usr/local/cuda), else PyPI's wheels where
  they make a whole compiler: CUDA 13's nvidia-cuda-nvcc + nvidia-nvvm + nvidia-cuda-crt.
  CUDA 12's wheel (nvidia-cuda-nvcc-cu12) holds only ptxas, libnvvm, libdevice and crt/: no
  nvcc driver, no cicc, cudafe++ or fatbinary. Those four come from Debian's non-free
  nvidia-cuda-toolkit package of the same release (NVIDIA's binaries repackaged, built for
  glibc 2.34+), fetched from Debian's archive by URL and checksum, no apt configuration needed:
  Debian has CUDA 12.4 (trixie, sid) and 12.5 (experimental), none later.
- The target's runtime headers, libcudart and CCCL: for x86_64 a local toolkit's own; else (for
  aarch64, and for a compiler assembled from packages) PyPI's wheels of the same releases for
  the target (nvidia-cuda-runtime[-cu12], nvidia-cuda-cccl[-cu12]), with the compiler's own
  crt/ and fatbinary_section.h beside them.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "logits-processor"
HOST = platform.machine()


DEBIAN = ("https://deb.debian.org/debian/", "https://snapshot.debian.org/file/")


@dataclass(frozen=True)
class Deb:
    """A Debian package whose files complete a compiler that PyPI's wheels leave incomplete:
    fetched from Debian's archive (DEBIAN: its pool path, else snapshot.debian.org by sha1)."""

    pool_path: str  # "pool/non-free/n/<source>/<name>_<version>_<arch>.deb"
    sha1: str  # snapshot.debian.org's key
    sha256: str  # as Debian's Packages index lists it
    files: tuple[tuple[str, str], ...]  # (path in the package, path under the compiler's root)


@dataclass(frozen=True)
class Toolkit:
    cuda: str  # "12.5"
    runtime: str  # the runtime wheel (headers, libcudart.so.<major>), pinned
    cccl: str  # the CCCL wheel, pinned to the same release
    compiler_wheels: tuple[str, ...]  # wheels that (with compiler_debs) make a whole nvcc; () where PyPI has none
    # kernel-builder's CUDA_DEFAULT_KERNEL_ARCHS for this toolkit (templates/torch/preamble.cmake):
    # the capabilities it can target, which build.toml's list is intersected with.
    archs: tuple[str, ...]
    compiler_debs: tuple[Deb, ...] = ()  # what the compiler wheels lack

    @property
    def tag(self) -> str:
        return "cu" + self.cuda.replace(".", "")

    @property
    def major(self) -> int:
        return int(self.cuda.split(".")[0])

    @property
    def compiler_root(self) -> str:
        """Where the compiler wheels put the toolkit's root: one folder per major from CUDA 13
        on (nvidia/cu13/), the nvcc package's folder before (nvidia/cuda_nvcc/)."""
        return f"nvidia/cu{self.major}" if self.major >= 13 else "nvidia/cuda_nvcc"


# Debian's nvidia-cuda-toolkit 12.5.40~12.5.0-2+b1 (experimental, non-free; 88 MB): CUDA 12.5.0's
# driver and front end, the same release as PyPI's 12.5.40 nvcc and 12.5.39 runtime wheels.
DEBIAN_NVCC_12_5 = Deb(
    "pool/non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.5.40~12.5.0-2+b1_amd64.deb",
    "49d27d0c42da4fbe36f3e9e25bc0bebbef300318",
    "88573e2a8626687cd201af953ed3086f2929c8c8914667d552f27b602f2cad68",
    (("usr/lib/nvidia-cuda-toolkit/bin/nvcc", "bin/nvcc"), ("usr/bin/cudafe++", "bin/cudafe++"),
     ("usr/bin/fatbinary", "bin/fatbinary"), ("usr/lib/nvidia-cuda-toolkit/bin/cicc", "nvvm/bin/cicc")))

TOOLKITS = {
    "12.5": Toolkit("12.5", "nvidia-cuda-runtime-cu12==12.5.39", "nvidia-cuda-cccl-cu12==12.5.39.post1",
                    ("nvidia-cuda-nvcc-cu12==12.5.40",),
                    ("7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0+PTX"), (DEBIAN_NVCC_12_5,)),
    "13.0": Toolkit("13.0", "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85",
                    ("nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88"),
                    ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "11.0", "12.0", "12.1+PTX")),
}
# nvcc reads this beside itself (bin/nvcc.profile) for where cicc, ptxas and libdevice are; the
# CUDA 13 wheels bring their own, Debian's refers to Debian's paths. NVIDIA's, for one target.
NVCC_PROFILE = """TOP = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib:
PATH += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib$(_TARGET_SIZE_)/stubs" "-L$(TOP)/lib$(_TARGET_SIZE_)"
"""


@dataclass(frozen=True)
class Machine:
    name: str  # as in a variant name and platform.machine()
    cxx: str  # the C++ compiler that targets it from this machine
    apt_package: str  # the Debian package that provides cxx
    elf_machine: str  # e_machine as readelf -h prints it
    dynamic_loader: str  # the ELF interpreter's soname (libc's loader)
    wheel_platforms: tuple[str, ...]  # pip --platform tags for its wheels


MACHINES = {
    "x86_64": Machine("x86_64", "g++" if HOST == "x86_64" else "x86_64-linux-gnu-g++",
                      "g++" if HOST == "x86_64" else "g++-x86-64-linux-gnu",
                      "Advanced Micro Devices X86-64", "ld-linux-x86-64.so.2",
                      ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                       "manylinux2014_x86_64")),
    "aarch64": Machine("aarch64", "g++" if HOST == "aarch64" else "aarch64-linux-gnu-g++",
                       "g++" if HOST == "aarch64" else "g++-aarch64-linux-gnu",
                       "AArch64", "ld-linux-aarch64.so.1",
                       ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64",
                        "manylinux2014_aarch64")),
}


def apt_install(program: str, package: str) -> str | None:
    """Make sure `program` is on PATH: Debian's `package` is installed with apt-get when it is
    missing (as root, online). Returns None, or why it is not there."""
    if shutil.which(program):
        return None
    if os.environ.get("LP_OFFLINE") == "1" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"no {program} (Debian: apt-get install {package})"
    start = time.monotonic()
    # One apt-get at a time: tests on other pytest-xdist workers install packages too, and a
    # second apt-get fails at once on dpkg's lock (the lock timeout covers any other apt user).
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    install = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", package]
    with open("/tmp/logits-processor-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which(program):  # installed by another worker meanwhile
            return None
        if subprocess.run(install, capture_output=True).returncode:  # no package lists yet
            subprocess.run(["apt-get", *wait, "update", "-q"], capture_output=True)
            proc = subprocess.run(install, capture_output=True, text=True)
            if proc.returncode:
                return f"apt-get install {package} failed: {proc.stderr.strip()[-500:]}"
    print(f"[toolkits] installed {package} in {time.monotonic() - start:.0f} s", flush=True)
    return None


def install_compiler(machine: str) -> str | None:
    """apt_install of the C++ compiler that targets `machine` (Debian's cross compiler)."""
    return apt_install(MACHINES[machine].cxx, MACHINES[machine].apt_package)


def _version_key(arch: str) -> tuple[int, int]:
    major, minor = arch.removesuffix("+PTX").split(".")
    return int(major), int(minor)


def capabilities(requested: list[str], cuda: str) -> list[str]:
    """build.toml's capabilities as the toolkit of `cuda` can build them: kernel-builder's loose
    intersection (utils.cmake, cuda_archs_loose_intersection): for each capability the toolkit
    targets, the highest requested one at or below it of the same major (or one carrying PTX),
    so 12.0+PTX stays on CUDA 13.0, and 10.0 and 12.0 fall away on CUDA 12.5.
    One rule of ours on top: when the PTX that build.toml asks for falls away with its
    capability, the highest capability kept carries PTX instead (as the toolkit's own default
    list does, 9.0+PTX on 12.5), so GPUs newer than the toolkit still get code to JIT."""
    ptx = {a.removesuffix("+PTX") for a in requested if a.endswith("+PTX")}
    source = sorted({a.removesuffix("+PTX") for a in requested}, key=_version_key)
    if any(not re.fullmatch(r"\d+\.\d+", a) for a in source):
        raise ValueError(f"capabilities {requested}: only M.m and M.m+PTX are understood here")
    kept: list[str] = []
    for target in (a.removesuffix("+PTX") for a in TOOLKITS[cuda].archs):
        best = None
        for arch in source:
            if _version_key(arch) > _version_key(target):
                break
            if arch in ptx or _version_key(arch)[0] == _version_key(target)[0]:
                best = arch
        if best and best not in kept:
            kept.append(best)
    kept.sort(key=_version_key)
    if ptx and kept and not ptx & set(kept):
        ptx = {kept[-1]}
    return [a + ("+PTX" if a in ptx else "") for a in kept]


def nvcc_version(home: Path) -> str | None:
    """"13.0" for a toolkit whose bin/nvcc is release 13.0, None without a working nvcc."""
    nvcc = home / "bin" / "nvcc"
    if not nvcc.exists():
        return None
    proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    found = re.search(r"release (\d+\.\d+)", proc.stdout)
    return found.group(1) if proc.returncode == 0 and found else None


def _local_homes(cuda: str) -> list[Path]:
    env = os.environ.get(f"LP_CUDA_HOME_{cuda.replace('.', '')}")
    return ([Path(env)] if env else []) + [Path(f"/usr/local/cuda-{cuda}"), Path("/usr/local/cuda")]


def compiler(cuda: str) -> Path | None:
    """The root of a whole nvcc of exactly that CUDA version (bin/nvcc, nvvm/bin/cicc, crt/),
    local or assembled from PyPI's wheels (and Debian's packages); None where neither exists
    (see missing_compiler). Offline, an assembled one is used once it is cached."""
    for home in _local_homes(cuda):
        if nvcc_version(home) == cuda:
            return home
    toolkit = TOOLKITS[cuda]
    name = f"cuda-{cuda}-compiler-{HOST}"
    if not toolkit.compiler_wheels or (os.environ.get("LP_OFFLINE") == "1"
                                       and not (CACHE / name / ".complete").exists()):
        return None
    root = unpacked_wheels(name, list(toolkit.compiler_wheels), MACHINES[HOST], toolkit.compiler_debs,
                           toolkit.compiler_root)
    home = root / toolkit.compiler_root
    profile = home / "bin" / "nvcc.profile"
    if not profile.exists():
        profile.write_text(NVCC_PROFILE)
    return home if nvcc_version(home) == cuda else None


def missing_compiler(cuda: str) -> str:
    """Why compiler(cuda) is None, naming every place that was looked at."""
    looked = ", ".join(f"{home} ({nvcc_version(home) or 'no nvcc'})" for home in _local_homes(cuda))
    toolkit = TOOLKITS[cuda]
    if not toolkit.compiler_wheels:
        return f"no nvcc {cuda}: looked at {looked}; set LP_CUDA_HOME_{cuda.replace('.', '')} to a CUDA {cuda} toolkit"
    packages = [*toolkit.compiler_wheels, *(deb.pool_path.rsplit("/", 1)[1] for deb in toolkit.compiler_debs)]
    offline = " (LP_OFFLINE=1 and not cached)" if os.environ.get("LP_OFFLINE") == "1" else ""
    return f"no nvcc {cuda}: looked at {looked}, and {', '.join(packages)}{offline}"


def compiler_includes(home: Path) -> Path:
    """A folder with only the compiler's own headers (crt/, fatbinary_section.h), for a target
    whose runtime headers come from elsewhere: nvcc looks for them beside the target's."""
    include = next(p for p in (home / "include", home / "targets" / f"{HOST}-linux" / "include")
                   if (p / "crt" / "host_config.h").exists())
    version = nvcc_version(home)
    folder = CACHE / f"cuda-{version}-compiler-include"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("crt", "fatbinary_section.h"):
        link = folder / name
        if not link.exists() or link.resolve() != (include / name).resolve():
            link.unlink(missing_ok=True)
            link.symlink_to(include / name)
    return folder


@dataclass(frozen=True)
class Target:
    """What a CUDA variant for one machine compiles against and links."""

    includes: list[Path]  # runtime headers, CCCL, then the compiler's own headers
    libcudart: Path  # libcudart.so.<major> of the target machine


def target(cuda: str, machine: str, home: Path) -> Target:
    """The runtime headers, CCCL and libcudart of `cuda` for `machine`: a local toolkit's own
    for this machine, else the target's PyPI wheels of the same releases."""
    major = TOOLKITS[cuda].major
    own = [p for p in (home / "include", home / "targets" / f"{HOST}-linux" / "include")
           if (p / "cuda_runtime.h").exists()]
    if machine == HOST and own:
        libs = [p for p in (home / "lib64", home / "lib", home / "targets" / f"{HOST}-linux" / "lib")
                if (p / f"libcudart.so.{major}").exists()]
        return Target([own[0], own[0] / "cccl"], libs[0] / f"libcudart.so.{major}")
    toolkit = TOOLKITS[cuda]
    root = unpacked_wheels(f"cuda-{cuda}-target-{machine}", [toolkit.runtime, toolkit.cccl],
                           MACHINES[machine])
    nvidia = root / "nvidia"
    if major >= 13:  # one folder per major: nvidia/cu13/{include,include/cccl,lib}
        include, lib = nvidia / f"cu{major}" / "include", nvidia / f"cu{major}" / "lib"
        includes = [include, include / "cccl"]
    else:  # one folder per package: nvidia/cuda_runtime/..., nvidia/cuda_cccl/include
        includes = [nvidia / "cuda_runtime" / "include", nvidia / "cuda_cccl" / "include"]
        lib = nvidia / "cuda_runtime" / "lib"
    return Target(includes + [compiler_includes(home)], lib / f"libcudart.so.{major}")


def unpacked_wheels(name: str, requirements: list[str], machine: Machine, debs: tuple[Deb, ...] = (),
                    deb_root: str = "") -> Path:
    """The wheels of `requirements` for `machine`, downloaded (pip, no dependencies) and
    unpacked once into CACHE/name, with the files of `debs` under CACHE/name/deb_root; later
    calls return the cached folder."""
    folder = CACHE / name
    if (folder / ".complete").exists():
        return folder
    if os.environ.get("LP_OFFLINE") == "1":
        raise RuntimeError(f"LP_OFFLINE=1 and {folder} is not cached ({' '.join(requirements)})")
    CACHE.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        platforms = [arg for tag in machine.wheel_platforms for arg in ("--platform", tag)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--disable-pip-version-check", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platforms, "-d", scratch, *requirements], check=True)
        unpacked = Path(scratch) / "unpacked"
        size = 0
        for wheel in sorted(Path(scratch).glob("*.whl")):
            size += wheel.stat().st_size
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.infolist():
                    path = Path(archive.extract(member, unpacked))
                    if member.external_attr >> 16 & 0o111:  # zip keeps the executable bits
                        path.chmod(path.stat().st_mode | 0o755)
        for deb in debs:
            size += unpack_deb(deb, unpacked / deb_root)
        if folder.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(folder)
        unpacked.rename(folder)
        (folder / ".complete").write_text(" ".join([*requirements, *(d.pool_path for d in debs)]) + "\n")
    print(f"[toolkits] {name}: {size / 1e6:.0f} MB of {'packages' if debs else 'wheels'} unpacked in "
          f"{time.monotonic() - start:.0f} s ({folder})", flush=True)
    return folder


def unpack_deb(deb: Deb, root: Path) -> int:
    """deb.files of the Debian package `deb`, downloaded and checked against its sha256, into
    root; returns the package's size. A .deb is an ar archive whose data.tar.* holds the files."""
    errors = []
    for url in (DEBIAN[0] + deb.pool_path, DEBIAN[1] + deb.sha1):
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                package = response.read()
            break
        except OSError as e:
            errors.append(f"{url}: {e}")
    else:
        raise RuntimeError("cannot download " + "; ".join(errors))
    if hashlib.sha256(package).hexdigest() != deb.sha256:
        raise RuntimeError(f"{url}: sha256 {hashlib.sha256(package).hexdigest()}, expected {deb.sha256}")
    if not package.startswith(b"!<arch>\n"):
        raise RuntimeError(f"{url}: not a Debian package")
    offset, data = 8, None
    while offset < len(package) and data is None:
        member, size = package[offset:offset + 16].decode().strip().rstrip("/"), int(package[offset + 48:offset + 58])
        if member.startswith("data.tar"):
            data = package[offset + 60:offset + 60 + size]
        offset += 60 + size + size % 2  # ar pads members to an even length
    wanted = {f"./{source}": target for source, target in deb.files}
    with tarfile.open(fileobj=io.BytesIO(data or b"")) as archive:
        for member in archive:  # in order: the xz stream is read once
            if member.name in wanted:
                path = root / wanted.pop(member.name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.extractfile(member).read())
                path.chmod(0o755)
    if wanted:
        raise RuntimeError(f"{url}: has no {', '.join(wanted)}")
    return len(package)
