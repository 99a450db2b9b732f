"""The suite's xdist groups hold: tests marked `xdist_group(name)` run on one worker under
`--dist loadgroup` (tests/run.py), so that a module fixture that builds or launches something
(the cross-compiles, the torch 2.10 headers, the sharded ranks' launch) runs once. With pytest
9.2 and pytest-xdist 3.8 the mark was silently ignored (pytest-dev/pytest-xdist#1386): each
worker built its own copy. requirements-dev.txt pins a pytest that keeps them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_sanitize("runs pytest on a test file of its own, which calls no op")

# The check is of the development environment's pin: elsewhere (the GPU machine's image, the
# certification's dry run) another pytest may be installed, whose xdist groups this suite does
# not rely on.
PINNED = re.search(r"^pytest==(\S+)", (Path(__file__).resolve().parents[2] / "requirements-dev.txt").read_text(),
                   re.M).group(1)

GROUPED = '''
import os
import pytest

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    print("worker", os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''


@pytest.mark.skipif(pytest.__version__ != PINNED, reason=f"checks requirements-dev.txt's pytest {PINNED}; this "
                    f"environment has {pytest.__version__}")
def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    # (xdist alone of the installed plugins: a shorter start)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "-v", "test_grouped.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers = re.findall(r"\[(gw\d+)\].*PASSED test_grouped\.py::test_grouped\[", run.stdout)
    assert len(workers) == 6, run.stdout[-3000:]
    assert len(set(workers)) == 1, f"the group ran on {sorted(set(workers))}:\n{run.stdout[-3000:]}"
