"""examples/grpo_replay.py: a GRPO step on the tiny offline model, whose importance ratios are
exactly 1 on the rollout's own logits, close to 1 for a bf16 trainer replaying the kept set,
and visibly off for the full-vocabulary log_softmax."""

import math
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import grpo_replay  # noqa: E402


def test_grpo_step_ratios():
    result = grpo_replay.main(["--groups", "2", "--group-size", "3", "--tokens", "12"])
    assert result["exact_ratio_max_deviation"] == 0.0
    assert result["bf16_ratio_mean_abs_log"] < 0.1
    # The full-vocabulary ratio misses the kept set's renormalisation: several times further off.
    assert result["full_vocab_ratio_mean_abs_log"] > 2 * result["bf16_ratio_mean_abs_log"]
    assert result["full_vocab_ratio_mean"] < 0.95
    assert math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"]) and result["grad_norm"] > 0
