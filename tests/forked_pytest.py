"""Runs pytest several times from one process: it imports torch, pytest and the libraries the
tests use once, then runs each pytest in a child forked from it, with that run's environment
variables set before the child loads anything of this repository. A start of Python with torch
(about 2 s on the 2-core machine) was most of a short run. A child has memory of its own, as a
process per run had: a run that corrupts memory cannot reach the next one. The mutation check's
fibers mutants (tests/cuda_emulation/mutations.py) and the planted defects
(tests/reliability/test_planted_defects.py) run this way. (Not under a sanitizer: its runtime is
loaded before main, and ThreadSanitizer's verdicts are its own process's.)

  python tests/forked_pytest.py RUNS.json

RUNS.json: [[{variable: value}, [pytest argument, ...]], ...]. Prints one JSON line per run, as
each ends: [exit status, seconds, its output]. `run_forked` is the caller's side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TIMEOUT = 900  # s a run may take (then SIGALRM ends it)


def run_forked(runs: list[tuple[dict[str, str], list[str]]], env: dict[str, str], cwd: Path) -> list[tuple[int, float, str]]:
    """Each run's (exit status, seconds, output), from one process of this file started with
    `env`; a run it did not finish gets exit status -1 and that process's own output."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "runs.json"
        spec.write_text(json.dumps(runs))
        proc = subprocess.run([sys.executable, __file__, str(spec)], cwd=cwd, env=env, capture_output=True, text=True)
    done = [tuple(json.loads(line)) for line in proc.stdout.splitlines()]
    lost = (-1, 0.0, f"forked_pytest.py ended (exit status {proc.returncode}) before this run:\n{proc.stderr[-3000:]}")
    return done + [lost] * (len(runs) - len(done))


def run_child(environment: dict[str, str], arguments: list[str]) -> None:
    signal.alarm(TIMEOUT)
    os.environ.update(environment)
    import pytest  # (the parent's)

    try:
        status = int(pytest.main(arguments))
    except BaseException:  # (SystemExit included: whatever ends the run is its verdict)
        traceback.print_exc()
        status = 99
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter exit: a child writes no coverage counts (coverage.py's are the parts' own
    # runs') and runs none of the parent's exit handlers.
    os._exit(status)


def run(environment: dict[str, str], arguments: list[str]) -> tuple[int, float, str]:
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", errors="replace") as output:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            run_child(environment, arguments)
        _, status = os.waitpid(pid, 0)
        output.seek(0)
        return os.waitstatus_to_exitcode(status), time.monotonic() - start, output.read()


def main() -> None:
    # Imported once, here, before the forks.
    import hypothesis  # noqa: F401
    import kernels  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401

    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for environment, arguments in runs:
        print(json.dumps(run(environment, arguments)), flush=True)


if __name__ == "__main__":
    main()
