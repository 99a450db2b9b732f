"""Every kernel of the built CUDA variant, on every architecture it carries, needs at most
1024 bytes of stack per thread: CUDA's default limit (exceptions: OVER_LIMIT, empty). A kernel above it makes the driver grow
the limit at its first launch, which waits for the device and cannot happen inside a CUDA
graph capture. Read from the .so by `cuobjdump --dump-resource-usage` (PyPI's
nvidia-cuda-cuobjdump, requirements-dev.txt), which gives each kernel's whole stack, its
callees' frames included (ptxas' "cumulative_stack_size")."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILD, OFFLINE, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import compare_sass  # noqa: E402  (the CUDA tools' lookup)

STACK_LIMIT = 1024  # bytes: cudaLimitStackSize's default
# Known exceptions, each with the ceiling it must stay under, listed only while needed (the
# test fails once one is back within the limit). None since each pass's per-token work is
# compiled once (row_sampler.cuh's for_each_logit): split_draw_kernel had needed 1144 bytes
# on sm_100.
OVER_LIMIT: dict[str, int] = {}
ARCH = re.compile(r"^arch = (sm_\d+)")
FUNCTION = re.compile(r"^\s*Function (\S+):")
USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")

pytestmark = pytest.mark.no_sanitize("reads the CUDA build's machine code and runs no op")


def nvidia_tool(name: str) -> str:
    """A CUDA binary tool (tools/compare_sass.py's nvidia_tool), or this test skipped or failed."""
    found = compare_sass.nvidia_tool(name)
    if not found and OFFLINE:
        # The GPU machine's image has neither tool and .whl/ does not carry them: the artifact
        # it certifies is this commit's build, whose machine code CI reads.
        pytest.skip(f"LP_OFFLINE=1 (certification mode): no {name} on this machine; "
                    "CI reads the machine code of this commit's build")
    if not found:
        pytest.fail(f"no {name}: requirements-dev.txt's nvidia-cuda-{name} is not installed")
    return found


def cuobjdump() -> str:
    return nvidia_tool("cuobjdump")


def kernel_resources(so: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """(arch, demangled kernel) -> (registers, stack bytes) of each kernel in `so`'s cubins."""
    text = subprocess.run([cuobjdump(), "--dump-resource-usage", str(so)], check=True, capture_output=True,
                          text=True).stdout
    arch, name, found = None, None, {}
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
        elif m := FUNCTION.match(line):
            name = m.group(1)
        elif (m := USAGE.search(line)) and name:
            found[(arch, name)] = (int(m.group(1)), int(m.group(2)))
            name = None
    names = subprocess.run(["c++filt"], input="\n".join(n for _, n in found), check=True, capture_output=True,
                           text=True).stdout.splitlines()
    return {(arch, demangled): usage for ((arch, _), usage), demangled in zip(found.items(), names)}


def test_every_kernel_stack_within_the_default_limit():
    variants = sorted(BUILD.glob("torch*-cu*"))
    if not variants:
        pytest.skip("no CUDA variant was built (CPU-only torch or no nvcc)")
    so = next(variants[0].glob("*.abi3.so"))
    resources = kernel_resources(so)
    archs = json.loads((variants[0] / "metadata.json").read_text())["backend"]["archs"]
    carried = {f"sm_{a.removesuffix('+PTX').replace('.', '')}" for a in archs}
    assert {arch for arch, _ in resources} == carried, "cuobjdump's report misses an architecture"
    for arch in carried:  # each .cu's kernels, on each architecture
        assert sum(arch == a for a, _ in resources) >= 18, (arch, sorted(n for a, n in resources if a == arch))
    def limit(name: str) -> int:
        return next((ceiling for kernel, ceiling in OVER_LIMIT.items() if f"::{kernel}<" in name), STACK_LIMIT)

    over = {key: stack for key, (_, stack) in resources.items() if stack > limit(key[1])}
    assert not over, "\n".join(f"{arch} {name}: {stack} bytes of stack" for (arch, name), stack in sorted(over.items()))
    # The exception is listed only while it is needed.
    for kernel in OVER_LIMIT:
        assert any(f"::{kernel}<" in name and stack > STACK_LIMIT for (_, name), (_, stack) in resources.items()), \
            f"{kernel} is back within {STACK_LIMIT} bytes: remove it from OVER_LIMIT"
