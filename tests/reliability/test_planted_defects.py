"""The hand-written tests fail on each defect that tests/planted_defects.py plants in the ops.

A test that passes whatever the op does proves nothing; these runs show that the hand-written
op tests (not only the property tests) catch a kernel that ignores an argument or skips its
work. Each defect runs the op's test file in a child pytest, stopping at the first failure:
first the test that caught it when CAUGHT_BY was written (one test instead of the file, which
is most of the time), then, if that one passes or this build lacks it, the whole file. The bad-input tests are left out: the
defects keep the real validation, so a failure there would mean the plant itself is broken,
not that a test caught the defect. The children are forked from one process that imported
torch once (tests/forked_pytest.py), all the defects' runs in one module fixture.
"""

from __future__ import annotations

import os
import re

import pytest

from conftest import ROOT
from forked_pytest import run_forked
from planted_defects import DEFECTS, ENV

pytestmark = pytest.mark.no_sanitize("reruns the op tests with Python-level defects: 220 s under ASan for nothing new")

TEST_FILE = {
    "apply_token_bitmask_inplace": "tests/ops/test_bitmask.py",
    "apply_packed_bitmask": "tests/ops/test_bitmask.py",
    "sample": "tests/ops/test_sampling.py",
    "sample_with_kept": "tests/ops/test_kept_set.py",
    "sample_with_logprobs": "tests/ops/test_logprobs.py",
    "sample_shard_step": "tests/ops/test_sharded.py",
    "apply_penalties_": "tests/ops/test_penalties.py",
    "update_output_counts_": "tests/ops/test_penalties.py",
    "constrain_bitmask_": "tests/ops/test_constraints.py",
}
# Defects whose tests live with another op's.
DEFECT_TEST_FILE = {"sample-ignores-penalties": "tests/ops/test_penalties.py"}
# The test of each defect's file that caught it when this was written (the first to fail).
CAUGHT_BY = {
    "ignore-indices": "test_indices_select_rows[False-cpu]",
    "ignore-vocab_size": "test_padded_vocab_leaves_tail_untouched[dtype0-cpu]",
    "packed-only-copies": "test_matches_reference_and_xgrammar[default-cpu-1-dtype0]",
    "sample-ignores-top_k": "test_distribution_matches_float64_reference[default-top_k]",
    "sample-ignores-top_p": "test_distribution_matches_float64_reference[default-top_p]",
    "sample-ignores-min_p": "test_distribution_matches_float64_reference[default-min_p]",
    "sample-ignores-bitmask": "test_token_always_in_reference_kept_set[default-1-dtype0]",
    "sample-ignores-filter_apply_order": "test_top_k_first_distribution_matches_vllm_chain[top_k_top_p]",
    "kept-set-ignores-top_p": "test_kept_set_matches_float64_reference[top_p-dtype0]",
    "logprobs-ignore-rank_ties": "test_per_row_parameters_bitmask_ties_and_greedy[dtype0-processed]",
    "sharded-ignores-bitmask": "test_one_process_is_the_unsharded_sampler",
    "sample-ignores-penalties": "test_fused_equals_unfused[33-dtype0]",
    "penalties-ignore-bias": "test_apply_penalties_matches_reference[1-dtype0]",
    "penalties-ignore-frequency": "test_apply_penalties_matches_reference[1-dtype0]",
    "penalties-ignore-prompt": "test_apply_penalties_matches_reference[33-dtype0]",
    "penalties-mix-up-rows": "test_apply_penalties_matches_reference[33-dtype0]",
    "counts-mix-up-rows": "test_update_output_counts_equals_bincount",
    "counts-first-token-only": "test_update_output_counts_equals_bincount",
    "constraints-ignore-ngrams": "test_matches_reference[5-dtype0-per_row]",
    "constraints-ignore-min_tokens": "test_matches_reference[5-dtype0-per_row]",
}


def test_each_defect_names_the_test_that_caught_it():
    assert sorted(CAUGHT_BY) == sorted(DEFECTS)


def defect_test_file(defect: str) -> str:
    return DEFECT_TEST_FILE.get(defect, TEST_FILE[DEFECTS[defect][0]])


# No plugin autoloading (the installed plugins, xdist's, hypothesis' and others: about a third of
# a child's time here); an op test that needed one would error, a verdict the assert refuses.
PYTEST_RUN = ["-p", "planted_defects", "-p", "no:cacheprovider", "-x", "-q", "-k", "not bad_input"]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, float, str]]:
    """Each defect's verdict run: (exit status, seconds, output) of its CAUGHT_BY test, or of
    its whole test file where that one passed or is not in this build's parameters."""
    # tests/ for the plugin, ahead of the caller's PYTHONPATH (certification's carried packages).
    python_path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": python_path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def run(defects: list[str], target) -> dict[str, tuple[int, float, str]]:
        results = run_forked([({ENV: d}, PYTEST_RUN + [target(d)]) for d in defects], env, ROOT)
        return dict(zip(defects, results))

    first = run([d for d in DEFECTS if d in CAUGHT_BY], lambda d: f"{defect_test_file(d)}::{CAUGHT_BY[d]}")
    # caught (1), or an error: decided; else (passed, or no such test) the whole file
    again = [d for d in DEFECTS if d not in first or first[d][0] in (0, 4, 5)]
    return first | run(again, defect_test_file)


# (one xdist worker for the defects: their runs are one fixture's)
@pytest.mark.xdist_group("planted-defects")
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_hand_written_tests_catch_the_planted_defect(defect, runs):
    status, _, output = runs[defect]
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    caught = re.findall(r"^FAILED (\S+)", output, re.MULTILINE)
    assert status == 1 and re.search(r"\b1 failed\b", summary) and "error" not in summary, (
        f"{defect_test_file(defect)} does not catch {defect}:\n{output[-5000:]}")
    print(f"{defect}: caught by {caught[0]}")
