"""`make test` and its parts, each timed, with the timing table at the end (also on failure) and
the parts over their budgets (BUDGETS) named.

  python tests/run.py [PART | GROUP ...]        (default: the group `test`, every part)

Parts, in the order they run:
  build            build/: the CPU variant and the CUDA variant for 8.0 and 9.0 (TEST_ARCHS)
  cpu-tests        every test outside the emulation, through the loader, on both variants
  build-asan       build-asan/: the CPU variant under AddressSanitizer + UBSan
  sanitize         every test but the emulated ones against it (opt-out: no_sanitize(reason))
  build-emulation  build-emulation/: the CUDA kernels built by the host compiler, three flavors
  forward          the CUDA kernels' tests (-m emulation) on fibers, threads in forward order
  reversed         the same in their smaller cases (the sanitizers'), threads in reversed order
                   (an order can hide a missing barrier)
  traffic          the tests that count global-memory bytes, in the build that counts them
  tsan             their smaller cases under ThreadSanitizer (one TSan fiber per CUDA thread)
  asan             the same under AddressSanitizer + UBSan
  coverage         the sanitizer runs reach every line the fibers runs reach (coverage.py)
  mutants          the mutation check: planted kernel bugs must be caught (mutations.py)
and, not in `make test` (`make test-archs`, CI's step after it):
  build-archs      build-archs/: the CUDA variant for build.toml's other capabilities
  archs            their machine code: every architecture carried, stacks, no CAS loops
Groups: test (every part above but the last two), sanitize (build-asan, sanitize), emulate
(build, build-emulation and the emulation's parts), archs (build-archs, archs). Any failure or
sanitizer report fails the run. Tests run on every core (pytest-xdist); LP_TEST_JOBS overrides
the count.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
JOBS = os.environ.get("LP_TEST_JOBS", str(os.cpu_count() or 1))
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", JOBS, "--dist", "loadgroup"]
# The emulation's runs: native sanitizer reports go to the terminal, not to pytest's captured fd 2.
EMULATED = PYTEST + ["-m", "emulation", "--capture=sys"]
# Every part's processes (unless the caller says otherwise): an idle OpenMP thread sleeps
# instead of spinning (libgomp's default), since pytest-xdist already runs a worker per core and
# torch's spinning threads took the other worker's core (the fibers runs: a fifth of their time).
DEFAULT_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
# Set for every part, whatever the caller's environment says: the tests' bytecode and pytest's
# rewritten asserts are written (__pycache__/, ignored by git) and read by the next process.
# Under PYTHONDONTWRITEBYTECODE=1 (this machine's image sets it) each pytest worker of every
# part compiled them again: about 4 CPU seconds a worker, 16 workers.
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}


def compiler_library(name: str) -> str:
    return subprocess.run([os.environ.get("CXX", "c++"), f"-print-file-name={name}"], check=True,
                          capture_output=True, text=True).stdout.strip()


def sanitizer_environment(sanitizer: str) -> dict[str, str]:
    """What a process needs to run code built with `sanitizer` ("tsan" or "asan"): its runtime
    first in the process, and a stop at the first report."""
    if sanitizer == "tsan":
        # torch's OpenMP threads synchronise in uninstrumented libgomp, which ThreadSanitizer
        # cannot see: one torch thread, so that only the emulation's threads are concurrent.
        return {"LD_PRELOAD": compiler_library("libtsan.so"), "TSAN_OPTIONS": "halt_on_error=1",
                "OMP_NUM_THREADS": "1"}
    # libstdc++ preloaded too: ASan intercepts __cxa_throw and needs it loaded first;
    # detect_leaks=0 because CPython itself leaks at exit.
    return {"LD_PRELOAD": f"{compiler_library('libasan.so')} {compiler_library('libstdc++.so')}",
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def emulation_environment(flavor: str) -> dict[str, str]:
    """What a process needs to load the emulation build of `flavor`."""
    sanitizer = {"tsan": "tsan", "concurrent": "tsan", "asan": "asan"}.get(flavor)
    return {"LP_EMULATION": flavor, **(sanitizer_environment(sanitizer) if sanitizer else {})}


# The CUDA capabilities `make test` builds (build/): one PTX, compute_80's, for the two
# (tools/build.py's PTX_FROM), the GPUs most of these kernels' users run. build.toml's others
# (LATER_ARCHS: PTX and ptxas runs of their own, docs/testing.md#make-test) are built into
# build-archs/ and their machine code checked by `make test-archs` (group archs), which CI runs
# after `make test`: make test stays within its 30 minutes, CI checks every capability. Every
# test that runs ops loads build/.
TEST_ARCHS = ["8.0", "9.0"]
_CAPABILITIES = tomllib.loads((ROOT / "build.toml").read_text())["kernel"]["logits_processor_cuda"]["cuda-capabilities"]
LATER_ARCHS = [a for a in _CAPABILITIES if a not in TEST_ARCHS]
NARROWED = {"LP_CUDA_ARCHS": ",".join(TEST_ARCHS)}
LATER = {"LP_CUDA_ARCHS": ",".join(LATER_ARCHS), "LP_BUILD_OUT": "build-archs", "LP_BUILD_DIR": "build-archs"}
# What reads a CUDA build's machine code (any build's: what it carries, from its metadata).
MACHINE_CODE_TESTS = ["tests/build/test_build_contents.py::test_cuda_build_carries_all_architectures",
                      "tests/build/test_kernel_resources.py", "tests/build/test_kernel_atomics.py"]

CUDA_EMULATION_TESTS = ["tests/cuda_emulation"]
PARTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "build": ([PY, "tools/build.py"], NARROWED),
    "cpu-tests": (PYTEST + ["-m", "not emulation", "tests"], NARROWED),
    "build-asan": ([PY, "tools/build.py"], {**sanitizer_environment("asan"), "LP_SANITIZE": "1"}),
    "sanitize": (PYTEST + ["-m", "not emulation", "tests"],
                 {**sanitizer_environment("asan"), "LP_BUILD_DIR": "build-asan"}),
    "build-emulation": ([PY, "tools/build_emulation.py"], {}),
    "forward": (EMULATED + ["tests"], {**emulation_environment("fibers"), "LP_EMULATION_SCHEDULE": "forward"}),
    "reversed": (EMULATED + ["tests"], {**emulation_environment("fibers"), "LP_EMULATION_SCHEDULE": "reversed"}),
    "tsan": (EMULATED + CUDA_EMULATION_TESTS, emulation_environment("tsan")),
    # The small-batch split rows, whose blocks exchange results: their blocks at the same time.
    "concurrent": (EMULATED + ["-k", "split", *CUDA_EMULATION_TESTS], emulation_environment("concurrent")),
    "asan": (EMULATED + CUDA_EMULATION_TESTS, emulation_environment("asan")),
    "traffic": (PYTEST + ["-m", "emulation and traffic", "--capture=sys", "tests/cuda_emulation"],
                emulation_environment("traffic")),
    "coverage": ([PY, "tests/cuda_emulation/coverage.py", "check"], {}),
    "mutants": ([PY, "tests/cuda_emulation/mutations.py"], {}),
    "build-archs": ([PY, "tools/build.py"], {**LATER, "LP_BACKENDS": "cuda"}),
    "archs": (PYTEST + MACHINE_CODE_TESTS, LATER),
}
# Each part's budget in wall seconds: about a quarter over its time alone on the 2-core machine
# (the README's table). A part over it is named after the table, as a hint of where the time
# went; the verdict stays the tests' (a loaded machine overruns them all).
BUDGETS = {"build": 320, "cpu-tests": 450, "build-asan": 75, "sanitize": 245, "build-emulation": 140,
           "forward": 120, "reversed": 33, "traffic": 16, "tsan": 170, "concurrent": 125, "asan": 46,
           "coverage": 5, "mutants": 110, "build-archs": 530, "archs": 30}
EMULATION_PARTS = ["build-emulation", "forward", "reversed", "traffic", "tsan", "concurrent", "asan", "coverage",
                   "mutants"]
GROUPS = {
    "test": [p for p in PARTS if p not in ("build-archs", "archs")],
    "sanitize": ["build-asan", "sanitize"],
    "emulate": ["build", *EMULATION_PARTS],
    "archs": ["build-archs", "archs"],
}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(times: dict[str, tuple[float, float]], failed: str | None) -> str:
    """Each part's wall seconds and the CPU seconds its processes used (user + system): their
    ratio over the core count says how busy the machine was kept."""
    width = max(len(p) for p in PARTS)
    rows = [f"[test] {part:<{width}}  {wall:6.0f} s  {cpu:7.0f} s" for part, (wall, cpu) in times.items()]
    total = sum(wall for wall, _ in times.values())
    cpu = sum(c for _, c in times.values())
    verdict = f"FAILED in {failed}" if failed else "passed"
    over = [f"{part} {wall:.0f} s (budget {BUDGETS[part]} s)" for part, (wall, _) in times.items()
            if wall > BUDGETS.get(part, float("inf"))]
    return "\n".join(["[test] part" + " " * (width - 3) + "    wall      cpu", *rows,
                      f"[test] {'total':<{width}}  {total:6.0f} s  {cpu:7.0f} s ({total / 60:.1f} min): {verdict}",
                      *([f"[test] over budget: {', '.join(over)}"] if over else [])])


def main() -> None:
    wanted = sys.argv[1:] or ["test"]
    unknown = [w for w in wanted if w not in PARTS and w not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; parts: {list(PARTS)}; groups: {list(GROUPS)}")
    selected = {p for w in wanted for p in GROUPS.get(w, [w])}
    parts = [p for p in PARTS if p in selected]
    times: dict[str, tuple[float, float]] = {}
    for part in parts:
        if part == "forward":
            # (the runs' coverage starts here: the fibers runs' counts, then the sanitizers')
            subprocess.run([PY, "tests/cuda_emulation/coverage.py", "reset"], cwd=ROOT, check=True)
        command, env = PARTS[part]
        print(f"[test] {part}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(command[1:])}",
              flush=True)
        start, start_cpu = time.monotonic(), children_cpu_seconds()
        result = subprocess.run(command, cwd=ROOT, env={**DEFAULT_ENVIRONMENT, **os.environ, **WRITE_BYTECODE, **env})
        times[part] = (time.monotonic() - start, children_cpu_seconds() - start_cpu)
        if result.returncode != 0:
            print(table(times, part), flush=True)
            raise SystemExit(f"[test] {part} failed (exit status {result.returncode})")
    print(table(times, None), flush=True)


if __name__ == "__main__":
    main()
