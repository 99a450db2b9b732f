"""No kernel of the built CUDA variant holds a compare-and-swap loop (its sm_90 code, below).
sm_80-sm_120 have no native 64-bit shared-memory atomicAdd: nvcc makes one a loop of
`ATOMS.CAST.SPIN.64` (a shared CAS retried until it wins), and where a warp's tokens share a key
bin (flat rows, 16-bit logits with few distinct values) the whole warp retries on one address.
The kernels' shared bins take 32-bit atomics instead (key_bins.cuh's add_to_bin, add_one_to_bin).
64-bit global atomicAdd is native (`RED.E.ADD.64`), but through a pointer nvcc cannot prove
global it gets the same loop behind a shared-address test (QSPC), dead code that would still
count here: block_primitives.cuh's global_add tells nvcc the address is global. Read from the
.so by `cuobjdump -sass` (with nvdisasm, PyPI's nvidia-cuda-nvdisasm) for sm_90, the
architecture the issue's count was taken on and every full build carries (the SASS of one
architecture is ~240 MB of text and a minute to dump; sm_80's has the same atomics)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import BUILD
from test_kernel_resources import cuobjdump, nvidia_tool

ARCH = re.compile(r"^arch = (sm_\d+)")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
# A compare-and-swap, shared (ATOMS.CAS, ATOMS.CAST.SPIN: the loop's body) or global
# (ATOM.E.CAS, ATOMG.E.CAS): what nvcc emits for an atomic the hardware lacks.
CAS = re.compile(r"\b(ATOM[SG]?(?:\.\w+)*?\.CAST?\b(?:\.\w+)*)")

pytestmark = pytest.mark.no_sanitize("reads the CUDA build's machine code and runs no op")


def compare_and_swaps(sass) -> dict[tuple[str, str], Counter]:
    """(arch, mangled kernel) -> the count of each CAS instruction in `sass` (cuobjdump -sass
    output: its lines), with an empty Counter for each kernel that has none."""
    arch, name, found = None, None, {}
    for line in sass:
        if "ATOM" in line:  # (the quick test first: most of the text is other instructions)
            if name and (m := CAS.search(line)):
                found[(arch, name)][m.group(1)] += 1
        elif m := FUNCTION.match(line):
            name = m.group(1)
            found[(arch, name)] = Counter()
        elif m := ARCH.match(line):
            arch = m.group(1)
    return found


def kernel_compare_and_swaps(so: Path, arch: str) -> dict[tuple[str, str], Counter]:
    """compare_and_swaps of `so`'s cubins for `arch`, the kernels demangled."""
    env = {**os.environ, "NVDISASM_PATH": str(Path(nvidia_tool("nvdisasm")).parent)}
    with subprocess.Popen([cuobjdump(), "-sass", "-arch", arch, str(so)], stdout=subprocess.PIPE, text=True,
                          env=env) as dump:
        found = compare_and_swaps(dump.stdout)
    assert dump.returncode == 0, f"cuobjdump -sass failed ({dump.returncode})"
    names = subprocess.run(["c++filt"], input="\n".join(n for _, n in found), check=True, capture_output=True,
                           text=True).stdout.splitlines()
    short = [n.replace("logits_processor::", "").replace("(anonymous namespace)::", "") for n in names]
    return {(arch, demangled): cas for ((arch, _), cas), demangled in zip(found.items(), short)}


def test_the_reader_finds_a_compare_and_swap_loop():
    # sm_90 SASS of a 64-bit shared atomicAdd, as nvcc 13.0 emits it, and a native 32-bit one.
    sass = """
arch = sm_90
		Function : _Z6kernelv
        /*0100*/                   ATOMS.CAST.SPIN.64 P0, [R3], R4, R6 ;                    /* 0x0000000403007d8d */
        /*0110*/              @!P0 BRA 0x100 ;                                              /* 0x000000fc0000a947 */
        /*0120*/                   ATOMS.ADD R5, [R3+0x4], R7 ;                              /* 0x0000000703057d8c */
		Function : _Z5otherv
        /*0100*/                   RED.E.ADD.64.STRONG.GPU desc[UR4][R2.64], R4 ;             /* 0x000000040200798e */
        /*0110*/                   ATOMG.E.CAS.STRONG.GPU PT, R7, [R2], R4, R6 ;             /* 0x000000040207798e */
"""
    assert compare_and_swaps(sass.splitlines()) == {("sm_90", "_Z6kernelv"): Counter({"ATOMS.CAST.SPIN.64": 1}),
                                       ("sm_90", "_Z5otherv"): Counter({"ATOMG.E.CAS.STRONG.GPU": 1})}


def test_no_kernel_has_a_compare_and_swap_loop():
    variants = sorted(BUILD.glob("torch*-cu*"))
    if not variants:
        pytest.skip("no CUDA variant was built (CPU-only torch or no nvcc)")
    archs = json.loads((variants[0] / "metadata.json").read_text())["backend"]["archs"]
    carried = sorted(f"sm_{a.removesuffix('+PTX').replace('.', '')}" for a in archs)
    arch = "sm_90" if "sm_90" in carried else carried[0]  # (a narrowed build: what it has)
    found = kernel_compare_and_swaps(next(variants[0].glob("*.abi3.so")), arch)
    assert len(found) >= 18, sorted(n for _, n in found)  # the reader saw each .cu's kernels
    loops = {key: cas for key, cas in found.items() if cas}
    assert not loops, "\n".join(f"{arch} {name}: {sum(cas.values())} ({', '.join(f'{n} {op}' for op, n in sorted(cas.items()))})"
                                for (arch, name), cas in sorted(loops.items()))
