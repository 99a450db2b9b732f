"""Whether two CUDA objects carry the same machine code for one architecture, kernel by kernel.

    python tools/compare_sass.py A.so B.so [sm_90]

Reads `cuobjdump -sass -arch <sm>` of each (PyPI's nvidia-cuda-cuobjdump, requirements-dev.txt,
else PATH's) and compares the instructions, less what differs between any two compiles of one
source: the header flags naming the PTX's virtual architecture, and the per-compile hash in the
names of anonymous-namespace kernels. Exit status 0 when every kernel's SASS is the same.
Used for tools/build.py's PTX_FROM (docs/development.md#one-ptx-for-80-and-90).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

# _GLOBAL__N__<hash>_<len>_<file>_cu_<hash>[_<n>]: the second hash (and n, where nvcc adds it)
# change with each compile. The next name's length digits may go with n: a name is then reported
# as differing, a false alarm, never a false match (the instructions are compared verbatim).
ANONYMOUS = re.compile(r"(_GLOBAL__N__\w+?_cu_)[0-9a-f]{8}(?:_\d+)?")


def nvidia_tool(name: str) -> str | None:
    """A CUDA binary tool from its PyPI wheel (nvidia-cuda-<name>, requirements-dev.txt), else
    PATH's; None when neither has it."""
    try:
        import nvidia
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    found = [str(p) for root in roots for p in sorted(Path(root).glob(f"*/bin/{name}"))]
    found += [p for p in [shutil.which(name)] if p]
    return found[0] if found else None


def cuobjdump() -> str:
    tool = nvidia_tool("cuobjdump")
    if tool is None:
        raise SystemExit("no cuobjdump: requirements-dev.txt's nvidia-cuda-cuobjdump is not installed")
    return tool


def kernels_sass(shared_object: str, arch: str) -> dict[str, list[str]]:
    """Each kernel's SASS instructions (its name as cuobjdump prints it, the hash dropped)."""
    text = subprocess.run([cuobjdump(), "-sass", "-arch", arch, shared_object], check=True, capture_output=True,
                          text=True).stdout
    kernels: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if "Function :" in line:
            current = kernels.setdefault(ANONYMOUS.sub(r"\1", line.split("Function :")[1].strip()), [])
        elif ".headerflags" not in line and line.strip():
            current.append(line.strip())
    return kernels


def main() -> None:
    a, b, arch = (sys.argv[1:] + ["sm_90"])[:3] if len(sys.argv) in (3, 4) else sys.exit(__doc__)
    left, right = kernels_sass(a, arch), kernels_sass(b, arch)
    if not left:
        raise SystemExit(f"{a} carries no {arch} SASS")
    differ = sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))
    lines = sum(len(v) for v in left.values())
    print(f"{arch}: {len(left)} kernels, {lines} SASS lines; {len(differ)} differ" + "".join(f"\n  {k}" for k in differ))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
