"""The hand-written tests fail on each defect that tests/planted_defects.py plants in the ops.

A test that passes whatever the op does proves nothing; these runs show that the hand-written
op tests (not only the property tests) catch a kernel that ignores an argument or skips its
work. Each defect runs the op's test file in a child pytest, stopping at the first failure.
The bad-input tests are left out: the defects keep the real validation, so a failure there
would mean the plant itself is broken, not that a test caught the defect.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from planted_defects import DEFECTS, ENV

pytestmark = pytest.mark.no_sanitize("reruns the op tests with Python-level defects: 220 s under ASan for nothing new")

TEST_FILE = {
    "apply_token_bitmask_inplace": "tests/ops/test_bitmask.py",
    "apply_packed_bitmask": "tests/ops/test_bitmask.py",
    "sample": "tests/ops/test_sampling.py",
    "sample_with_kept": "tests/ops/test_kept_set.py",
    "sample_shard_step": "tests/ops/test_sharded.py",
    "apply_penalties_": "tests/ops/test_penalties.py",
    "update_output_counts_": "tests/ops/test_penalties.py",
}
# Defects whose tests live with another op's.
DEFECT_TEST_FILE = {"sample-ignores-penalties": "tests/ops/test_penalties.py"}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_hand_written_tests_catch_the_planted_defect(defect):
    op, _ = DEFECTS[defect]
    test_file = DEFECT_TEST_FILE.get(defect, TEST_FILE[op])
    # tests/ for the plugin, ahead of the caller's PYTHONPATH (certification's carried packages).
    python_path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = os.environ | {ENV: defect, "PYTHONPATH": python_path}
    command = [sys.executable, "-m", "pytest", "-p", "planted_defects", "-p", "no:cacheprovider",
               "-x", "-q", "-k", "not bad_input", test_file]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    caught = re.findall(r"^FAILED (\S+)", child.stdout, re.MULTILINE)
    assert child.returncode == 1 and re.search(r"\b1 failed\b", summary) and "error" not in summary, (
        f"{test_file} does not catch {defect}:\n{child.stdout[-3000:]}\n{child.stderr[-2000:]}")
    print(f"{defect}: caught by {caught[0]}")
