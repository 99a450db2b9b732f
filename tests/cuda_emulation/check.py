"""`make emulate`: every check of the CUDA emulation, each part timed (expects the builds of
`make build` and tools/build_emulation.py):

  forward   the tests marked `emulation` on fibers, threads in forward order
  reversed  the same in reversed order (an order can hide a missing barrier)
  tsan      the emulated tests of every kernel family (SANITIZED_FILES) under ThreadSanitizer,
            an OS thread per CUDA thread, on their smaller cases
  asan      the same under AddressSanitizer + UBSan
  mutants   the mutation check (mutations.py): the emulation must catch planted bugs

Any failure or sanitizer report fails the run.   python tests/cuda_emulation/check.py [PART ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "emulation",
          # native sanitizer reports go to the terminal, not to pytest's captured fd 2
          "--capture=sys"]


def compiler_library(name: str) -> str:
    return subprocess.run([os.environ.get("CXX", "c++"), f"-print-file-name={name}"], check=True,
                          capture_output=True, text=True).stdout.strip()


def sanitizer_environment(flavor: str) -> dict[str, str]:
    """The environment a process needs to load the flavor's build: the sanitizer's runtime
    first in the process, and stop at the first report."""
    if flavor == "tsan":
        # torch's OpenMP threads synchronise in uninstrumented libgomp, which ThreadSanitizer
        # cannot see: one torch thread, so that only the emulation's threads run concurrently.
        return {"LD_PRELOAD": compiler_library("libtsan.so"), "TSAN_OPTIONS": "halt_on_error=1",
                "OMP_NUM_THREADS": "1", "LP_EMULATION": "tsan"}
    if flavor == "asan":
        # libstdc++ preloaded too: ASan intercepts __cxa_throw and needs it loaded first.
        return {"LD_PRELOAD": f"{compiler_library('libasan.so')} {compiler_library('libstdc++.so')}",
                "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
                "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "LP_EMULATION": "asan"}
    return {"LP_EMULATION": "fibers"}


# One file per kernel family (test_*_cuda.py) and the emulator's own (test_emulation.py).
SANITIZED_FILES = ["tests/cuda_emulation"]

PARTS = {
    "forward": (PYTEST + ["tests"], {**sanitizer_environment("fibers"), "LP_EMULATION_SCHEDULE": "forward"}),
    "reversed": (PYTEST + ["tests"], {**sanitizer_environment("fibers"), "LP_EMULATION_SCHEDULE": "reversed"}),
    "tsan": (PYTEST + SANITIZED_FILES, sanitizer_environment("tsan")),
    "asan": (PYTEST + SANITIZED_FILES, sanitizer_environment("asan")),
    "mutants": ([sys.executable, "tests/cuda_emulation/mutations.py"], {}),
}


def main() -> None:
    parts = sys.argv[1:] or list(PARTS)
    times = {}
    for part in parts:
        command, env = PARTS[part]
        print(f"[emulate] {part}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(command[1:])}",
              flush=True)
        start = time.monotonic()
        result = subprocess.run(command, cwd=ROOT, env={**os.environ, **env})
        times[part] = time.monotonic() - start
        if result.returncode != 0:
            raise SystemExit(f"[emulate] {part} failed (exit status {result.returncode})")
    print("[emulate] passed: " + ", ".join(f"{part} {seconds:.0f} s" for part, seconds in times.items()))


if __name__ == "__main__":
    main()
