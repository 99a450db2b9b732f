"""The GPU certification's own scripts, tried without a GPU (`--device cpu`): every case of
scripts/sanitizer_cases.py and every check of scripts/graph_check.py runs against the CPU path,
so that the one lent GPU run does not spend itself on a broken script; and they cover the
package: every CUDA kernel of logits_processor/ is named in scripts/device_package.py's KERNELS
with the public ops that launch it, sanitizer_cases.py runs every one of those ops and
graph_check.py captures all but two it names. (What only a GPU shows, the capture itself and the
sanitizers' reports, stays for that run: docs/certification.md.)"""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from device_package import KERNELS  # noqa: E402

# The public names that launch no kernel of ours (types, a constant, torch's own fills and shapes,
# mirostat's update in torch ops).
NO_KERNEL = {"KeptSet", "SampleWithLogprobs", "SamplingControls", "VerifiedDraft", "VerifiedTree", "Penalties",
             "PenaltyState", "bitmask_dtype", "allocate_token_bitmask", "reset_token_bitmask", "get_bitmask_shape",
             "update_mirostat_mu_"}
# What a captured decode step leaves out: sample_sharded's exchanges go through torch.distributed
# and the host; penalty_state_from_tokens builds a request's state at its admission.
NOT_CAPTURED = {"sample_sharded", "penalty_state_from_tokens"}

# (40 s under ASan for no op that the op tests do not run there)
pytestmark = pytest.mark.no_sanitize("dry runs of the GPU scripts: their ops run under ASan in the op tests")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"scripts/{script}", "--device", "cpu", *args], cwd=ROOT,
                          env={**os.environ, "LP_BUILD_DIR": str(BUILD), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def test_every_kernel_and_public_op_is_in_the_map():
    """KERNELS' kernels are the sources' __global__ functions, and its ops the public functions
    outside NO_KERNEL: a new kernel or op fails here until the map (and so the record) has it."""
    sources = "".join(path.read_text() for path in sorted((ROOT / "logits_processor").glob("*.cu*")))
    kernels = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", sources))
    assert len(kernels) >= 18 and {k for ks in KERNELS.values() for k in ks} == kernels
    tree = ast.parse((ROOT / "torch-ext" / "logits_processor" / "__init__.py").read_text())
    public = next({e.value for e in node.value.elts} for node in tree.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")
    assert set(KERNELS) == public - NO_KERNEL and NO_KERNEL <= public


def test_sanitizer_cases_run_every_op_against_the_cpu(tmp_path):
    result = run("sanitizer_cases.py", "--json", str(tmp_path / "cases.json"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for line in ("bitmask cases done", "sampler cases done", "the other kernels' cases done", "0 failures"):
        assert f"sanitizer_cases: {line}" in result.stdout, result.stdout[-2000:]
    record = json.loads((tmp_path / "cases.json").read_text())
    assert record["covers"]["ops"] == sorted(KERNELS) and record["failures"] == []
    assert record["covers"]["kernels"] == sorted({k for ks in KERNELS.values() for k in ks})


def test_graph_check_runs_its_step_eagerly(tmp_path):
    result = run("graph_check.py", "--json", str(tmp_path / "graph.json"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "graph.json").read_text())
    assert record["status"] == "PASS" and record["device"] == "cpu"
    assert set(record["checks"]) == {"capture", "replay equals eager", "replays deterministic",
                                     "new offsets change draws", "tokens allowed by the bitmask",
                                     "every kept set has a token"}
    assert record["covers"]["ops"] == sorted(set(KERNELS) - NOT_CAPTURED)
