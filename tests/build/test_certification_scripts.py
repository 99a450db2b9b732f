"""The GPU certification's own scripts, tried without a GPU (`--device cpu`): every case of
scripts/sanitizer_cases.py and every check of scripts/graph_check.py runs against the CPU path,
so that the one lent GPU run does not spend itself on a broken script. (What only a GPU shows,
the capture itself and the sanitizers' reports, stays for that run: docs/certification.md.)"""

import json
import os
import subprocess
import sys

from conftest import BUILD, ROOT


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"scripts/{script}", "--device", "cpu", *args], cwd=ROOT,
                          env={**os.environ, "LP_BUILD_DIR": str(BUILD), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def test_sanitizer_cases_run_every_kernel_against_the_cpu():
    result = run("sanitizer_cases.py")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for line in ("bitmask cases done", "sampler cases done", "the other kernels' cases done", "0 failures"):
        assert f"sanitizer_cases: {line}" in result.stdout, result.stdout[-2000:]


def test_graph_check_runs_its_step_eagerly(tmp_path):
    result = run("graph_check.py", "--json", str(tmp_path / "graph.json"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "graph.json").read_text())
    assert record["status"] == "PASS" and record["device"] == "cpu"
    assert set(record["checks"]) == {"capture", "replay equals eager", "replays deterministic",
                                     "new offsets change draws", "tokens allowed by the bitmask",
                                     "every kept set has a token"}
