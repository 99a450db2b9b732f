"""Runs several mutants' tests (mutations.py) from one process: it imports torch, pytest and the
libraries the tests use once, then runs each mutant's tests in a child forked from it, with
LP_MUTANT set before the child loads the emulation build. A start of Python with torch (about
3 s on the 2-core machine) was most of a fibers mutant's run. A child has memory of its own, as a
process per mutant had: a mutant that corrupts memory cannot reach the next one's run. (Only for
the fibers flavor: the sanitizers' runtimes are loaded before main, and ThreadSanitizer's
verdicts are its own process's.)

  python tests/cuda_emulation/mutant_runner.py RUNS.json

RUNS.json: [[mutant id, test file, pytest -k expression], ...]. Prints one JSON line per run, as
each ends: [mutant id, exit status, seconds, its output].
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

import hypothesis  # noqa: F401  (imported once, here, before the forks)
import kernels  # noqa: F401
import pytest
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (the package's own import of it: about 2 s)

TIMEOUT = 900  # s a mutant's run may take (then SIGALRM ends it: not caught)


def run_child(mutant_id: int, test_file: str, tests: str) -> None:
    signal.alarm(TIMEOUT)
    os.environ["LP_MUTANT"] = str(mutant_id)
    try:
        status = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--capture=sys", "-m", "emulation",
                                  test_file, "-k", tests]))
    except BaseException:  # (SystemExit included: whatever ends the run is its verdict)
        traceback.print_exc()
        status = 99
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter exit: a mutant's run writes no coverage counts (coverage.py's are the
    # unmutated runs').
    os._exit(status)


def run(mutant_id: int, test_file: str, tests: str) -> tuple[int, float, str]:
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as output:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            run_child(mutant_id, test_file, tests)
        _, status = os.waitpid(pid, 0)
        output.seek(0)
        return os.waitstatus_to_exitcode(status), time.monotonic() - start, output.read()


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for mutant_id, test_file, tests in runs:
        status, seconds, output = run(mutant_id, test_file, tests)
        print(json.dumps([mutant_id, status, seconds, output]), flush=True)


if __name__ == "__main__":
    main()
