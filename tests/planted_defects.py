"""A pytest plugin that plants one defect in the loaded ops, to show that the tests can fail.

    LP_PLANT_DEFECT=ignore-indices PYTHONPATH=tests pytest -p planted_defects tests/ops/test_bitmask.py

runs the tests against ops with that defect (one of DEFECTS): every kernel package a fixture
returns gets the defective op in place of the real one, behind the package's Python functions.
`tests/reliability/test_planted_defects.py` runs the hand-written tests once per defect and requires a
failure. Each defective op first runs the real op on the caller's arguments, so bad input is
still rejected as before and only the result is wrong; it then redoes or undoes the work.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Callable

import pytest
import torch

ENV = "LP_PLANT_DEFECT"


def _rerun_with(**changed) -> Callable:
    """The op as called, then again with `changed` arguments, whose result stands."""

    def make(real):
        names = [a.name for a in real.default._schema.arguments]

        def op(*args):
            real(*args)
            real(**(dict(zip(names, args)) | changed))

        return op

    return make


def _in_place_with(**changed) -> Callable:
    """An in-place op run as called on a copy of what it writes (so bad input is still rejected
    and nothing is written twice), then for real with `changed` arguments: each a value or a
    function of the call's arguments."""

    def make(real):
        names = [a.name for a in real.default._schema.arguments]

        def op(*args):
            call = dict(zip(names, args))
            real(**(call | {names[0]: call[names[0]].clone()}))
            real(**(call | {k: v(call) if callable(v) else v for k, v in changed.items()}))

        return op

    return make


def _flipped_rows(call):
    return None if call["rows"] is None else call["rows"].flip(0)


def _shard_step_with(**changed) -> Callable:
    """sample_shard_step run as called on copies of what it writes (so bad input is still
    rejected), then for real with `changed` arguments."""

    def make(real):
        names = [a.name for a in real.default._schema.arguments]

        def op(*args):
            call = dict(zip(names, args))
            real(**(call | {name: call[name].clone() for name in ("state", "sums", "picks", "kept_bitmask")}))
            real(**(call | changed))

        return op

    return make


def _copy_only(real):
    """apply_packed_bitmask that leaves `out` an unmasked copy of the logits."""

    def op(logits, bitmask, fill_value, out):
        source = logits.clone()  # out may be logits itself
        real(logits, bitmask, fill_value, out)
        out.copy_(source)

    return op


# name: (the op it replaces, a function of the real op that returns the defective one)
DEFECTS: dict[str, tuple[str, Callable]] = {
    # Masking every row masks the selected ones too: the result is as if indices were None.
    "ignore-indices": ("apply_token_bitmask_inplace", _rerun_with(indices=None)),
    # The default vocab_size covers every column an explicit one may cover.
    "ignore-vocab_size": ("apply_token_bitmask_inplace", _rerun_with(vocab_size=None)),
    "packed-only-copies": ("apply_packed_bitmask", _copy_only),
    "sample-ignores-top_k": ("sample", _rerun_with(top_k=None, top_k_value=0)),
    "sample-ignores-top_p": ("sample", _rerun_with(top_p=None, top_p_value=1.0)),
    "sample-ignores-min_p": ("sample", _rerun_with(min_p=None, min_p_value=0.0)),
    "sample-ignores-bitmask": ("sample", _rerun_with(bitmask=None)),
    "sample-ignores-filter_apply_order": ("sample", _rerun_with(filter_apply_order="joint")),
    "kept-set-ignores-top_p": ("sample_with_kept", _rerun_with(top_p=None, top_p_value=1.0)),
    # vLLM's rank convention dropped: ties never counted against the token.
    "logprobs-ignore-rank_ties": ("sample_with_logprobs", _rerun_with(rank_ties="min")),
    "sharded-ignores-bitmask": ("sample_shard_step", _shard_step_with(bitmask=None)),
    # The fused penalties dropped: sample as if called without penalties=.
    "sample-ignores-penalties": ("sample", _rerun_with(
        prompt_mask=None, output_counts=None, repetition_penalty=None, repetition_penalty_value=1.0,
        frequency_penalty=None, frequency_penalty_value=0.0, presence_penalty=None, presence_penalty_value=0.0,
        logit_bias_ids=None, logit_bias_values=None, penalty_rows=None)),
    "penalties-ignore-bias": ("apply_penalties_", _in_place_with(logit_bias_ids=None, logit_bias_values=None)),
    "penalties-ignore-frequency": ("apply_penalties_",
                                   _in_place_with(frequency_penalty=None, frequency_penalty_value=0.0)),
    "penalties-ignore-prompt": ("apply_penalties_",
                                _in_place_with(prompt_mask=lambda call: torch.zeros_like(call["prompt_mask"]))),
    "penalties-mix-up-rows": ("apply_penalties_", _in_place_with(rows=_flipped_rows)),
    "counts-mix-up-rows": ("update_output_counts_", _in_place_with(rows=_flipped_rows)),
    "counts-first-token-only": ("update_output_counts_",
                                _in_place_with(token_ids=lambda call: call["token_ids"].view(call["token_ids"].shape[0], -1)[:, :1])),
    # A constraint dropped: the n-grams not matched, or min_tokens never holding back the stop ids.
    "constraints-ignore-ngrams": ("constrain_bitmask_",
                                  _in_place_with(no_repeat_ngram_size=None, no_repeat_ngram_size_value=0)),
    "constraints-ignore-min_tokens": ("constrain_bitmask_", _in_place_with(min_tokens=None, min_tokens_value=0)),
}


class _OpsWithDefect:
    """The package's torch.ops namespace with one op replaced."""

    def __init__(self, real, name: str, op: Callable):
        self._real, self._name, self._op = real, name, op

    def __getattr__(self, attr: str):
        return self._op if attr == self._name else getattr(self._real, attr)


def plant(kernel: ModuleType, defect: str) -> None:
    """Route the package's Python functions to the defective op. `kernel._ops.ops` stays the
    real namespace (torch.library.opcheck needs real ops)."""
    if getattr(kernel, "planted_defect", None) == defect:  # the fixtures share one module
        return
    name, make = DEFECTS[defect]
    ops = _OpsWithDefect(kernel._ops.ops, name, make(getattr(kernel._ops.ops, name)))
    for caller in (kernel._bitmask, kernel._sampling, kernel._penalties, kernel._constraints, kernel._sharded):
        caller.ops = ops
    kernel.planted_defect = defect


def pytest_configure(config):
    defect = os.environ.get(ENV)
    if defect not in DEFECTS:
        raise pytest.UsageError(f"{ENV} must name one of {', '.join(DEFECTS)}, got {defect!r}")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    value = yield
    if isinstance(value, ModuleType) and value.__name__.startswith("_logits_processor_"):
        plant(value, os.environ[ENV])
    return value
