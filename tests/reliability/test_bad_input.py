"""The bad-input matrix: every kind of wrong call, each in a child process.

Each case must raise a Python exception whose message names the wrong argument, and leave
every input tensor bit for bit as it was. The cases run in child processes (one per variant,
restarted after a crash), so a crash fails exactly the case that caused it instead of the
test run. Per-row sampler tensors holding NaN or values outside [0, 1] are not bad input: they are
documented (greedy / clamped, as no host check may read a device tensor) and covered by
tests/reliability/test_properties_sampling.py. Sampler cases skip only if the build has no `sample` op.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from harness import backends, load, names_as_subject, same_bits

EXPECTED_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
B, V = 4, 64


def inputs() -> SimpleNamespace:
    """Fresh valid inputs; a case passes a wrong one, often a view of these (so a write through
    it would show)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g)
    return SimpleNamespace(
        logits=logits,
        half=logits.half(),
        f64=logits.double(),
        mask=torch.randint(-(2**31), 2**31, (B, 2), generator=g, dtype=torch.int64).to(torch.int32),
        wide_mask=torch.zeros(B, 4, dtype=torch.int32),
        out=torch.full((B, V), 7.0),
        out_t=torch.full((V, B), 7.0),
        big=torch.randn(B + 1, V, generator=g),
        ids=torch.full((B,), 5, dtype=torch.int64),
        ids2=torch.full((2 * B,), 5, dtype=torch.int64),
        row_f32=torch.full((B,), 0.5),
        row_i64=torch.full((B,), 3, dtype=torch.int64),
        # verify_draft: two drafts per row
        target=torch.randn(B, 3, V, generator=g),
        drafts=torch.full((B, 2), 5, dtype=torch.int64),
        draft_probs=torch.full((B, 2, V), 1 / V),
        position_mask=torch.full((B, 3, 2), -1, dtype=torch.int32),
        verified=torch.full((B, 3), 7, dtype=torch.int64),
        prompt_mask=torch.randint(-(2**31), 2**31, (B + 2, 2), generator=g, dtype=torch.int64).to(torch.int32),
        counts=torch.randint(0, 3, (B + 2, V), generator=g, dtype=torch.int32),
        state_rows=torch.tensor([5, 0, 2, 1]),
        bias_ids=torch.tensor([[1, -1], [V - 1, 3], [0, 0], [-1, -1]]),
        bias_values=torch.randn(B, 2, generator=g),
        token_ids=torch.randint(-1, V, (B, 2), generator=g),
        # verify_tree: three nodes, the root's two children (1 then 2)
        tree_drafts=torch.full((B, 3), 5, dtype=torch.int64),
        next_token=torch.tensor([[1, -1, -1]] * B),
        next_sibling=torch.tensor([[-1, 2, -1]] * B),
        tree_out=torch.full((B, 3), 7, dtype=torch.int64),
    )


@dataclass(frozen=True)
class Case:
    id: str
    arg: str  # the argument the message must name
    call: Callable  # (lp, inputs) -> anything


def _op(name: str, *args, **kwargs) -> Callable:
    """A call of lp.<name>; each argument is a value or a function of the inputs."""
    def value(v, t):
        return v(t) if callable(v) else v
    return lambda lp, t: getattr(lp, name)(*(value(v, t) for v in args),
                                           **{k: value(v, t) for k, v in kwargs.items()})


def inplace(logits=lambda t: t.logits, bitmask=lambda t: t.mask, **kwargs) -> Callable:
    return _op("apply_token_bitmask_inplace", logits, bitmask, **kwargs)


def packed(logits=lambda t: t.logits, bitmask=lambda t: t.mask, **kwargs) -> Callable:
    return _op("apply_packed_bitmask", logits, bitmask, **kwargs)


def sample(logits=lambda t: t.logits, **kwargs) -> Callable:
    return _op("sample", logits, **kwargs)


def penalties(logits=lambda t: t.logits, prompt_mask=lambda t: t.prompt_mask, output_counts=lambda t: t.counts,
              **kwargs) -> Callable:
    kwargs.setdefault("rows", lambda t: t.state_rows)
    return _op("apply_penalties_", logits, prompt_mask, output_counts, **kwargs)


def fused(op: str = "sample", **kwargs) -> Callable:
    """A sampler op with penalties=Penalties(...): the inputs' state and rows unless given."""
    def call(lp, t):
        fields = {"prompt_mask": t.prompt_mask, "output_counts": t.counts, "rows": t.state_rows}
        fields |= {k: v(t) if callable(v) else v for k, v in kwargs.items()}
        penalties = lp.Penalties(**fields)
        if op == "token_logprobs":
            return lp.token_logprobs(t.logits, t.ids, penalties=penalties)
        if op == "verify_draft":
            return lp.verify_draft(t.target, t.drafts, penalties=penalties)
        return getattr(lp, op)(t.logits, penalties=penalties)
    return call


def count_update(output_counts=lambda t: t.counts, token_ids=lambda t: t.token_ids, **kwargs) -> Callable:
    kwargs.setdefault("rows", lambda t: t.state_rows)
    return _op("update_output_counts_", output_counts, token_ids, **kwargs)


def state_from_tokens(prompt=lambda t: t.token_ids, output=lambda t: t.token_ids, vocab_size=V) -> Callable:
    return _op("penalty_state_from_tokens", prompt, output, vocab_size)


def _bitmask_cases() -> list[Case]:
    cases = [
        # logits: dtype, rank, layout, device
        ("logits-float64", "logits", inplace(logits=lambda t: t.f64)),
        ("logits-int32-view", "logits", inplace(logits=lambda t: t.logits.view(torch.int32))),
        ("logits-bool-view", "logits", inplace(logits=lambda t: t.logits.view(torch.bool))),
        ("logits-3d", "logits", inplace(logits=lambda t: t.logits.view(2, 2, V))),
        ("logits-0d", "logits", inplace(logits=lambda t: t.logits[0, 0])),
        ("logits-transposed", "logits", inplace(logits=lambda t: t.logits.t())),
        ("logits-column-stride-2", "logits", inplace(logits=lambda t: t.logits[:, ::2], bitmask=lambda t: t.mask[:, :1])),
        ("logits-expanded-rows", "logits", inplace(logits=lambda t: t.logits[:1].expand(B, V))),
        ("logits-not-a-tensor", "logits", inplace(logits=lambda t: t.logits.tolist())),
        ("logits-meta-device", "logits", inplace(logits=lambda t: t.logits.to("meta"))),
        # bitmask
        ("bitmask-int64", "bitmask", inplace(bitmask=lambda t: t.mask.long())),
        ("bitmask-uint32-view", "bitmask", inplace(bitmask=lambda t: t.mask.view(torch.uint32))),
        ("bitmask-float32-view", "bitmask", inplace(bitmask=lambda t: t.mask.view(torch.float32))),
        ("bitmask-3d", "bitmask", inplace(bitmask=lambda t: t.mask.view(2, 2, 2))),
        ("bitmask-0d", "bitmask", inplace(bitmask=lambda t: t.mask[0, 0])),
        ("bitmask-too-few-rows", "bitmask", inplace(bitmask=lambda t: t.mask[:3])),
        ("bitmask-too-narrow", "bitmask", inplace(bitmask=lambda t: t.mask[:, :1], vocab_size=V)),
        ("bitmask-word-stride-2", "bitmask", inplace(bitmask=lambda t: t.wide_mask[:, ::2])),
        ("bitmask-meta-device", "bitmask", inplace(bitmask=lambda t: t.mask.to("meta"))),
        # vocab_size
        ("vocab_size-negative", "vocab_size", inplace(vocab_size=-1)),
        ("vocab_size-past-width", "vocab_size", inplace(vocab_size=V + 1)),
        ("vocab_size-2^40", "vocab_size", inplace(vocab_size=2**40)),
        ("vocab_size-2^70", "vocab_size", inplace(vocab_size=2**70)),
        ("vocab_size-float", "vocab_size", inplace(vocab_size=3.0)),
        ("vocab_size-str", "vocab_size", inplace(vocab_size="64")),
        # indices
        ("indices-past-rows", "indices", inplace(indices=[0, B])),
        ("indices-negative", "indices", inplace(indices=[-1])),
        ("indices-tensor-past-rows", "indices", inplace(indices=lambda t: t.ids)),
        ("indices-past-bitmask-rows", "indices", inplace(logits=lambda t: t.big, indices=[B])),
        ("indices-float-list", "indices", inplace(indices=[0.5])),
        ("indices-overflowing-int", "indices", inplace(indices=[2**64])),
        ("indices-not-a-sequence", "indices", inplace(indices=3)),
        ("indices-strings", "indices", inplace(indices=["a"])),
        ("indices-float-tensor", "indices", inplace(indices=lambda t: t.row_f32)),
        ("indices-bool-tensor", "indices", inplace(indices=lambda t: t.row_f32 > 0)),
        ("indices-2d-tensor", "indices", inplace(indices=lambda t: t.row_i64.view(2, 2))),
        ("indices-0d-tensor", "indices", inplace(indices=lambda t: t.row_i64[0])),
        ("indices-meta-device", "indices", inplace(indices=lambda t: t.row_i64.to("meta"))),
        # fill_value
        ("fill_value-str", "fill_value", inplace(fill_value="-inf")),
        ("fill_value-none", "fill_value", inplace(fill_value=None)),
        # apply_packed_bitmask: its own checks of out, and the shared ones of logits and bitmask
        ("packed-logits-float64", "logits", packed(logits=lambda t: t.f64)),
        ("packed-bitmask-too-few-rows", "bitmask", packed(bitmask=lambda t: t.mask[:3])),
        ("packed-bitmask-meta-device", "bitmask", packed(bitmask=lambda t: t.mask.to("meta"))),
        ("out-wrong-shape", "out", packed(out=lambda t: t.out[:, : V - 1])),
        ("out-1d", "out", packed(out=lambda t: t.out.view(-1))),
        ("out-wrong-dtype", "out", packed(out=lambda t: t.half)),
        ("out-int32-view", "out", packed(out=lambda t: t.out.view(torch.int32))),
        ("out-transposed", "out", packed(out=lambda t: t.out_t.t())),
        ("out-expanded-rows", "out", packed(out=lambda t: t.out[:1].expand(B, V))),
        ("out-overlaps-logits", "out", packed(logits=lambda t: t.big[:B], out=lambda t: t.big[1:])),
        ("out-meta-device", "out", packed(out=lambda t: t.out.to("meta"))),
        # the Python helpers
        ("allocate-negative-batch_size", "batch_size", lambda lp, t: lp.allocate_token_bitmask(-1, V)),
        ("allocate-negative-vocab_size", "vocab_size", lambda lp, t: lp.allocate_token_bitmask(B, -V)),
    ]
    return [Case(*c) for c in cases]


def _sampler_cases() -> list[Case]:
    nan = float("nan")
    cases = [
        ("sample-logits-float64", "logits", sample(logits=lambda t: t.f64)),
        ("sample-logits-int32-view", "logits", sample(logits=lambda t: t.logits.view(torch.int32))),
        ("sample-logits-3d", "logits", sample(logits=lambda t: t.logits.view(2, 2, V))),
        ("sample-logits-transposed", "logits", sample(logits=lambda t: t.logits.t())),
        # (all-meta calls are legitimate tracing; a meta tensor among real ones is not)
        ("sample-bitmask-meta-device", "bitmask", sample(bitmask=lambda t: t.mask.to("meta"))),
        ("sample-temperature-nan", "temperature", sample(temperature=nan)),
        ("sample-top_p-nan", "top_p", sample(top_p=nan)),
        ("sample-top_p-negative", "top_p", sample(top_p=-0.1)),
        ("sample-top_p-above-1", "top_p", sample(top_p=1.5)),
        ("sample-min_p-nan", "min_p", sample(min_p=nan)),
        ("sample-min_p-above-1", "min_p", sample(min_p=1.5)),
        ("sample-epsilon_cutoff-nan", "epsilon_cutoff", sample(epsilon_cutoff=nan)),
        ("sample-epsilon_cutoff-negative", "epsilon_cutoff", sample(epsilon_cutoff=-1e-4)),
        ("sample-epsilon_cutoff-above-1", "epsilon_cutoff", sample(epsilon_cutoff=1.5)),
        ("sample-epsilon_cutoff-rows-wrong-length", "epsilon_cutoff", sample(epsilon_cutoff=lambda t: t.row_f32[:3])),
        ("sample-epsilon_cutoff-rows-bool", "epsilon_cutoff", sample(epsilon_cutoff=lambda t: t.row_f32 > 0)),
        ("sample-eta_cutoff-nan", "eta_cutoff", sample(eta_cutoff=nan)),
        ("sample-eta_cutoff-negative", "eta_cutoff", sample(eta_cutoff=-1e-4)),
        ("sample-eta_cutoff-above-1", "eta_cutoff", sample(eta_cutoff=1.5)),
        ("sample-eta_cutoff-rows-wrong-length", "eta_cutoff", sample(eta_cutoff=lambda t: t.row_f32[:3])),
        ("sample-top_n_sigma-nan", "top_n_sigma", sample(top_n_sigma=nan)),
        ("sample-top_n_sigma-str", "top_n_sigma", sample(top_n_sigma="2")),
        ("sample-top_n_sigma-rows-wrong-length", "top_n_sigma", sample(top_n_sigma=lambda t: t.row_f32[:3])),
        ("sample-top_n_sigma-rows-int", "top_n_sigma", sample(top_n_sigma=lambda t: t.row_i64)),
        ("sample-xtc_probability-above-1", "xtc_probability", sample(xtc_probability=1.5)),
        ("sample-xtc_probability-nan", "xtc_probability", sample(xtc_probability=nan)),
        ("sample-xtc_probability-str", "xtc_probability", sample(xtc_probability="0.5")),
        ("sample-xtc_probability-rows-wrong-length", "xtc_probability",
         sample(xtc_probability=lambda t: t.row_f32[:3])),
        ("sample-xtc_threshold-negative", "xtc_threshold", sample(xtc_probability=0.5, xtc_threshold=-0.1)),
        ("sample-xtc_threshold-nan", "xtc_threshold", sample(xtc_threshold=nan)),
        ("sample-xtc_threshold-rows-int", "xtc_threshold", sample(xtc_threshold=lambda t: t.row_i64)),
        ("sample-filter_apply_order-unknown", "filter_apply_order", sample(filter_apply_order="vllm")),
        ("sample-filter_apply_order-int", "filter_apply_order", sample(filter_apply_order=1)),
        ("sample-temperature_last-int", "temperature_last", sample(temperature_last=1)),
        ("sample-temperature_last-rows-float", "temperature_last", sample(temperature_last=lambda t: t.row_f32)),
        ("sample-temperature_last-rows-wrong-length", "temperature_last",
         sample(temperature_last=lambda t: t.row_f32[:3] > 0)),
        ("sample-seed-float", "seed", sample(seed=1.5)),
        ("sample-seed-rows-float", "seed", sample(seed=lambda t: t.row_f32)),
        ("sample-offset-rows-wrong-length", "offset", sample(offset=lambda t: t.row_i64[:3])),
        ("sample-top_k-float", "top_k", sample(top_k=1.5)),
        ("sample-temperature-rows-wrong-length", "temperature", sample(temperature=lambda t: t.row_f32[:3])),
        ("sample-temperature-rows-2d", "temperature", sample(temperature=lambda t: t.row_f32.view(2, 2))),
        ("sample-top_p-rows-meta-device", "top_p", sample(top_p=lambda t: t.row_f32.to("meta"))),
        ("sample-top_p-rows-bool", "top_p", sample(top_p=lambda t: t.row_f32 > 0)),
        ("sample-top_k-rows-wrong-length", "top_k", sample(top_k=lambda t: t.row_i64[:3])),
        ("sample-top_k-rows-float", "top_k", sample(top_k=lambda t: t.row_f32)),
        ("sample-min_p-rows-wrong-length", "min_p", sample(min_p=lambda t: t.big[:, 0])),
        ("sample-bitmask-int64", "bitmask", sample(bitmask=lambda t: t.mask.long())),
        ("sample-bitmask-too-few-rows", "bitmask", sample(bitmask=lambda t: t.mask[:3])),
        ("sample-out-wrong-length", "out", sample(out=lambda t: t.row_i64[:3])),
        ("sample-out-float", "out", sample(out=lambda t: t.row_f32)),
        ("sample-out-int16", "out", sample(out=lambda t: t.row_i64.view(torch.int16)[:B])),
        ("sample-ids_dtype-int16", "ids_dtype", sample(ids_dtype=torch.int16)),
        ("sample-ids_dtype-float", "ids_dtype", sample(ids_dtype=torch.float32)),
        ("sample-out-strided", "out", sample(out=lambda t: t.ids2[::2])),
    ]
    return [Case(*c) for c in cases]


def with_logprobs(logits=lambda t: t.logits, **kwargs) -> Callable:
    return _op("sample_with_logprobs", logits, **kwargs)


def token_logprobs(logits=lambda t: t.logits, token_ids=lambda t: t.ids, **kwargs) -> Callable:
    return _op("token_logprobs", logits, token_ids, **kwargs)


def _logprobs_outputs(t, **wrong):
    """Valid outputs for num_logprobs = 2 in SampleWithLogprobs order, with `wrong` replacing some."""
    fields = dict(tokens=t.row_i64.clone(), logprobs=torch.empty(B, 3),
                  logprob_token_ids=torch.empty(B, 3, dtype=torch.int64), ranks=t.row_i64.clone())
    fields.update({k: v(t) for k, v in wrong.items()})
    return tuple(fields.values())


def _logprobs_cases() -> list[Case]:
    cases = [
        # sample_with_logprobs: the sampler's checks are shared; its own arguments
        ("logprobs-logits-float64", "logits", with_logprobs(logits=lambda t: t.f64)),
        ("logprobs-top_p-above-1", "top_p", with_logprobs(top_p=1.5)),
        ("logprobs-filter_apply_order-unknown", "filter_apply_order", with_logprobs(filter_apply_order="joint ")),
        ("logprobs-seed-rows-float", "seed", with_logprobs(seed=lambda t: t.row_f32)),
        ("logprobs-bitmask-too-few-rows", "bitmask", with_logprobs(bitmask=lambda t: t.mask[:3])),
        ("logprobs-num_logprobs-negative", "num_logprobs", with_logprobs(num_logprobs=-1)),
        ("logprobs-num_logprobs-past-vocab", "num_logprobs", with_logprobs(num_logprobs=V + 1)),
        ("logprobs-num_logprobs-float", "num_logprobs", with_logprobs(num_logprobs=2.5)),
        ("logprobs-logprobs_mode-unknown", "logprobs_mode", with_logprobs(logprobs_mode="logits")),
        ("logprobs-logprobs_mode-int", "logprobs_mode", with_logprobs(logprobs_mode=1)),
        ("logprobs-rank_ties-unknown", "rank_ties", with_logprobs(rank_ties="dense")),
        ("logprobs-rank_ties-none", "rank_ties", with_logprobs(rank_ties=None)),
        ("logprobs-out-tokens-int16", "tokens", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, tokens=lambda t: t.row_i64.view(torch.int16)[:B]))),
        ("logprobs-out-ids-uint32", "logprob_token_ids", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(
                t, logprob_token_ids=lambda t: torch.empty(B, 3, dtype=torch.uint32)))),
        ("logprobs-ids_dtype-uint8", "ids_dtype", with_logprobs(ids_dtype=torch.uint8)),
        ("logprobs-out-logprobs-wrong-columns", "logprobs", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, logprobs=lambda t: t.out[:, :4]))),
        ("logprobs-out-logprobs-float16", "logprobs", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, logprobs=lambda t: t.half[:, :3]))),
        ("logprobs-out-ids-float", "logprob_token_ids", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, logprob_token_ids=lambda t: t.out[:, :3]))),
        ("logprobs-out-ids-strided", "logprob_token_ids", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(
                t, logprob_token_ids=lambda t: torch.empty(B, 6, dtype=torch.int64)[:, ::2]))),
        ("logprobs-out-ranks-wrong-length", "ranks", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, ranks=lambda t: t.ids2))),
        ("logprobs-out-ranks-meta-device", "ranks", with_logprobs(
            num_logprobs=2, out=lambda t: _logprobs_outputs(t, ranks=lambda t: t.row_i64.to("meta")))),
        # token_logprobs
        ("token_logprobs-logits-3d", "logits", token_logprobs(logits=lambda t: t.logits.view(2, 2, V))),
        ("token_logprobs-token_ids-wrong-length", "token_ids", token_logprobs(token_ids=lambda t: t.ids2)),
        ("token_logprobs-token_ids-float", "token_ids", token_logprobs(token_ids=lambda t: t.row_f32)),
        ("token_logprobs-filter_apply_order-unknown", "filter_apply_order",
         token_logprobs(filter_apply_order="TOP_K_FIRST")),
        ("token_logprobs-token_ids-2d", "token_ids", token_logprobs(token_ids=lambda t: t.row_i64.view(2, 2))),
        ("token_logprobs-token_ids-list", "token_ids", token_logprobs(token_ids=[1, 2, 3, 4])),
        ("token_logprobs-token_ids-meta-device", "token_ids", token_logprobs(token_ids=lambda t: t.ids.to("meta"))),
        ("token_logprobs-temperature-nan", "temperature", token_logprobs(temperature=float("nan"))),
        ("token_logprobs-top_k-rows-float", "top_k", token_logprobs(top_k=lambda t: t.row_f32)),
        ("token_logprobs-logprobs_mode-unknown", "logprobs_mode", token_logprobs(logprobs_mode="")),
        ("token_logprobs-out-int64", "out", token_logprobs(out=lambda t: t.row_i64)),
        ("token_logprobs-out-wrong-length", "out", token_logprobs(out=lambda t: t.big[:, 0])),
        # filtered_probs, filtered_logits
        ("filtered_probs-logits-3d", "logits", _op("filtered_probs", lambda t: t.logits.view(2, 2, V))),
        ("filtered_probs-logits-float64", "logits", _op("filtered_probs", lambda t: t.f64)),
        ("filtered_probs-top_p-above-1", "top_p", _op("filtered_probs", lambda t: t.logits, top_p=1.5)),
        ("filtered_logits-top_k-rows-float", "top_k", _op("filtered_logits", lambda t: t.logits, top_k=lambda t: t.row_f32)),
        ("filtered_logits-bitmask-int64", "bitmask", _op("filtered_logits", lambda t: t.logits, bitmask=lambda t: t.mask.long())),
        ("filtered_probs-out-transposed", "out", _op("filtered_probs", lambda t: t.logits, out=lambda t: t.out_t.t())),
        ("filtered_probs-out-wrong-rows", "out", _op("filtered_probs", lambda t: t.logits, out=lambda t: t.big)),
        ("filtered_logits-out-float16", "out", _op("filtered_logits", lambda t: t.logits, out=lambda t: t.half)),
        ("filtered_logits-out-is-logits", "out", _op("filtered_logits", lambda t: t.logits, out=lambda t: t.logits)),
    ]
    return [Case(*c) for c in cases]


def verify(target=lambda t: t.target, drafts=lambda t: t.drafts, **kwargs) -> Callable:
    return _op("verify_draft", target, drafts, **kwargs)


def _verify_cases() -> list[Case]:
    cases = [
        ("verify-target-2d", "target_logits", verify(target=lambda t: t.logits)),
        ("verify-target-float64", "target_logits", verify(target=lambda t: t.target.double())),
        ("verify-target-strided-vocab", "target_logits", verify(target=lambda t: t.target[..., ::2])),
        ("verify-target-too-many-positions", "target_logits", verify(target=torch.zeros(1, 258, 1))),
        ("verify-drafts-one-too-few", "draft_token_ids", verify(drafts=lambda t: t.drafts[:, :1])),
        ("verify-drafts-wrong-rows", "draft_token_ids", verify(drafts=lambda t: t.drafts[:3])),
        ("verify-drafts-int16", "draft_token_ids", verify(drafts=lambda t: t.drafts.short())),
        ("verify-drafts-past-vocab", "draft_token_ids", verify(drafts=torch.full((B, 2), V))),
        ("verify-drafts-negative", "draft_token_ids", verify(drafts=torch.full((B, 2), -1))),
        ("verify-drafts-meta-device", "draft_token_ids", verify(drafts=lambda t: t.drafts.to("meta"))),
        ("verify-num_draft_tokens-above-drafts", "num_draft_tokens", verify(num_draft_tokens=torch.full((B,), 3))),
        ("verify-num_draft_tokens-negative", "num_draft_tokens", verify(num_draft_tokens=torch.full((B,), -1))),
        ("verify-num_draft_tokens-wrong-length", "num_draft_tokens", verify(num_draft_tokens=lambda t: t.ids2)),
        ("verify-num_draft_tokens-float", "num_draft_tokens", verify(num_draft_tokens=lambda t: t.row_f32)),
        ("verify-block_verification-without-draft_probs", "block_verification", verify(block_verification=True)),
        ("verify-draft_probs-narrow", "draft_probs", verify(draft_probs=lambda t: t.draft_probs[..., :V - 1])),
        ("verify-draft_probs-one-position", "draft_probs", verify(draft_probs=lambda t: t.draft_probs[:, :1])),
        ("verify-draft_probs-float16", "draft_probs", verify(draft_probs=lambda t: t.draft_probs.half())),
        ("verify-draft_probs-strided-vocab", "draft_probs", verify(
            draft_probs=lambda t: torch.full((B, 2, 2 * V), 0.5)[..., ::2])),
        ("verify-bitmask-2d", "bitmask", verify(bitmask=lambda t: t.mask)),
        ("verify-bitmask-two-positions", "bitmask", verify(bitmask=lambda t: t.position_mask[:, :2])),
        ("verify-bitmask-int64", "bitmask", verify(bitmask=lambda t: t.position_mask.long())),
        ("verify-top_p-above-1", "top_p", verify(top_p=1.5)),
        ("verify-temperature-nan", "temperature", verify(temperature=float("nan"))),
        ("verify-seed-rows-wrong-length", "seed", verify(seed=lambda t: t.ids2)),
        ("verify-out-tokens-one-column-short", "tokens", verify(
            out=lambda t: (t.verified[:, :2], t.row_i64))),
        ("verify-out-tokens-float", "tokens", verify(out=lambda t: (t.target[:, :, 0], t.row_i64))),
        ("verify-out-num_accepted-int32", "num_accepted", verify(
            out=lambda t: (t.verified, t.row_i64.view(torch.int32)[:B]))),
    ]
    return [Case(*c) for c in cases]


def _penalty_cases() -> list[Case]:
    nan = float("nan")
    bias = dict(logit_bias_ids=lambda t: t.bias_ids, logit_bias_values=lambda t: t.bias_values)
    cases = [
        ("penalties-logits-float64", "logits", penalties(logits=lambda t: t.f64)),
        ("penalties-penalty_order-unknown", "penalty_order", penalties(penalty_order="openai")),
        ("penalties-logits-1d", "logits", penalties(logits=lambda t: t.logits[0])),
        ("penalties-logits-transposed", "logits", penalties(logits=lambda t: t.logits.t())),
        ("penalties-logits-expanded-rows", "logits", penalties(logits=lambda t: t.logits[:1].expand(B, V))),
        ("penalties-prompt_mask-int64", "prompt_mask", penalties(prompt_mask=lambda t: t.prompt_mask.long())),
        ("penalties-prompt_mask-too-narrow", "prompt_mask", penalties(prompt_mask=lambda t: t.prompt_mask[:, :1])),
        ("penalties-prompt_mask-too-wide", "prompt_mask", penalties(prompt_mask=lambda t: t.wide_mask)),
        ("penalties-prompt_mask-meta-device", "prompt_mask", penalties(prompt_mask=lambda t: t.prompt_mask.to("meta"))),
        ("penalties-output_counts-float", "output_counts", penalties(output_counts=lambda t: t.counts.float())),
        ("penalties-output_counts-wrong-width", "output_counts", penalties(output_counts=lambda t: t.counts[:, 1:])),
        ("penalties-output_counts-fewer-rows-than-prompt_mask", "output_counts",
         penalties(output_counts=lambda t: t.counts[:B + 1])),
        ("penalties-output_counts-rows-unmapped", "output_counts", penalties(rows=None)),
        ("penalties-rows-past-state", "rows", penalties(rows=[0, 1, 2, B + 2])),
        ("penalties-rows-negative", "rows", penalties(rows=[0, 1, -1, 2])),
        ("penalties-rows-wrong-length", "rows", penalties(rows=[0, 1])),
        ("penalties-rows-float-tensor", "rows", penalties(rows=lambda t: t.row_f32)),
        ("penalties-rows-meta-device", "rows", penalties(rows=lambda t: t.state_rows.to("meta"))),
        ("penalties-repetition_penalty-zero", "repetition_penalty", penalties(repetition_penalty=0.0)),
        ("penalties-repetition_penalty-negative", "repetition_penalty", penalties(repetition_penalty=-1.0)),
        ("penalties-repetition_penalty-nan", "repetition_penalty", penalties(repetition_penalty=nan)),
        ("penalties-repetition_penalty-rows-zero", "repetition_penalty",
         penalties(repetition_penalty=lambda t: t.row_f32 * torch.tensor([1.0, 0.0, 1.0, 1.0]))),
        ("penalties-repetition_penalty-rows-nan", "repetition_penalty",
         penalties(repetition_penalty=lambda t: t.row_f32 + torch.tensor([0.0, 0.0, nan, 0.0]))),
        ("penalties-repetition_penalty-rows-int", "repetition_penalty", penalties(repetition_penalty=lambda t: t.row_i64)),
        ("penalties-frequency_penalty-nan", "frequency_penalty", penalties(frequency_penalty=nan)),
        ("penalties-frequency_penalty-str", "frequency_penalty", penalties(frequency_penalty="0.5")),
        ("penalties-frequency_penalty-rows-wrong-length", "frequency_penalty",
         penalties(frequency_penalty=lambda t: t.row_f32[:3])),
        ("penalties-presence_penalty-nan", "presence_penalty", penalties(presence_penalty=nan)),
        ("penalties-presence_penalty-rows-nan", "presence_penalty",
         penalties(presence_penalty=lambda t: t.row_f32 + torch.tensor([nan, 0.0, 0.0, 0.0]))),
        ("penalties-presence_penalty-rows-meta-device", "presence_penalty",
         penalties(presence_penalty=lambda t: t.row_f32.to("meta"))),
        ("penalties-logit_bias_ids-past-vocab", "logit_bias_ids",
         penalties(**bias | dict(logit_bias_ids=lambda t: t.bias_ids + torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0]])))),
        ("penalties-logit_bias_ids-below-padding", "logit_bias_ids",
         penalties(**bias | dict(logit_bias_ids=lambda t: t.bias_ids - 1))),
        ("penalties-logit_bias_ids-int16", "logit_bias_ids",
         penalties(**bias | dict(logit_bias_ids=lambda t: t.bias_ids.short()))),
        ("penalties-logit_bias_ids-wrong-rows", "logit_bias_ids",
         penalties(logit_bias_ids=lambda t: t.bias_ids[:3], logit_bias_values=lambda t: t.bias_values[:3])),
        ("penalties-logit_bias_ids-1d", "logit_bias_ids",
         penalties(logit_bias_ids=lambda t: t.bias_ids[0], logit_bias_values=lambda t: t.bias_values[0])),
        ("penalties-logit_bias_ids-alone", "logit_bias_values", penalties(logit_bias_ids=lambda t: t.bias_ids)),
        ("penalties-logit_bias_values-alone", "logit_bias_ids", penalties(logit_bias_values=lambda t: t.bias_values)),
        ("penalties-logit_bias_values-nan", "logit_bias_values",
         penalties(**bias | dict(logit_bias_values=lambda t: t.bias_values + torch.tensor([[0.0, 0.0], [0.0, nan], [0.0, 0.0], [0.0, 0.0]])))),
        ("penalties-logit_bias_values-wrong-shape", "logit_bias_values",
         penalties(**bias | dict(logit_bias_values=lambda t: t.bias_values[:, :1]))),
        ("penalties-logit_bias_values-int", "logit_bias_values",
         penalties(**bias | dict(logit_bias_values=lambda t: t.bias_ids))),
        ("penalties-logit_bias_values-meta-device", "logit_bias_values",
         penalties(**bias | dict(logit_bias_values=lambda t: t.bias_values.to("meta")))),
        # the sampler ops' fused penalties: the same validation as apply_penalties_
        ("fused-prompt_mask-too-narrow", "prompt_mask", fused(prompt_mask=lambda t: t.prompt_mask[:, :1])),
        ("fused-prompt_mask-meta-device", "prompt_mask", fused(prompt_mask=lambda t: t.prompt_mask.to("meta"))),
        ("fused-output_counts-wrong-width", "output_counts", fused(output_counts=lambda t: t.counts[:, 1:])),
        ("fused-output_counts-rows-unmapped", "output_counts", fused(rows=None)),
        ("fused-rows-past-state", "rows", fused(rows=[0, 1, 2, B + 2])),
        ("fused-rows-negative", "rows", fused("sample_with_logprobs", rows=[0, 1, -1, 2])),
        ("fused-repetition_penalty-zero", "repetition_penalty", fused(repetition_penalty=0.0)),
        ("fused-repetition_penalty-rows-nan", "repetition_penalty",
         fused("token_logprobs", repetition_penalty=lambda t: t.row_f32 + torch.tensor([0.0, 0.0, nan, 0.0]))),
        ("fused-frequency_penalty-nan", "frequency_penalty", fused("sample_with_logprobs", frequency_penalty=nan)),
        ("fused-filtered-presence_penalty-nan", "presence_penalty", fused("filtered_probs", presence_penalty=nan)),
        ("fused-presence_penalty-rows-wrong-length", "presence_penalty",
         fused(presence_penalty=lambda t: t.row_f32[:3])),
        ("fused-logit_bias_ids-past-vocab", "logit_bias_ids",
         fused(**bias | dict(logit_bias_ids=lambda t: t.bias_ids + torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0]])))),
        ("fused-logit_bias_ids-alone", "logit_bias_values", fused(logit_bias_ids=lambda t: t.bias_ids)),
        ("fused-logit_bias_values-nan", "logit_bias_values", fused(
            "token_logprobs", **bias | dict(logit_bias_values=lambda t: t.bias_values + torch.tensor([[0.0, nan]] * B)))),
        # verify_draft's penalties: the sampler's validation, against a position's [B, V]
        ("verify-penalties-prompt_mask-too-narrow", "prompt_mask",
         fused("verify_draft", prompt_mask=lambda t: t.prompt_mask[:, :1])),
        ("verify-penalties-output_counts-wrong-width", "output_counts",
         fused("verify_draft", output_counts=lambda t: t.counts[:, 1:])),
        ("verify-penalties-output_counts-rows-unmapped", "output_counts", fused("verify_draft", rows=None)),
        ("verify-penalties-rows-wrong-length", "rows", fused("verify_draft", rows=[0, 1])),
        ("verify-penalties-rows-past-state", "rows", fused("verify_draft", rows=[0, 1, 2, B + 2])),
        ("verify-penalties-presence_penalty-rows-wrong-length", "presence_penalty",
         fused("verify_draft", presence_penalty=lambda t: t.row_f32[:3])),
        ("verify-penalties-logit_bias_ids-wrong-rows", "logit_bias_ids",
         fused("verify_draft", logit_bias_ids=lambda t: t.bias_ids[:3], logit_bias_values=lambda t: t.bias_values[:3])),
        ("verify-penalties-logit_bias_values-wrong-shape", "logit_bias_values", fused(
            "verify_draft", **bias | dict(logit_bias_values=lambda t: t.bias_values[:, :1]))),
        ("verify-penalties-output_counts-meta-device", "output_counts",
         fused("verify_draft", output_counts=lambda t: t.counts.to("meta"))),
        ("verify-penalties-not-a-tuple", "penalties", lambda lp, t: lp.verify_draft(
            t.target, t.drafts, penalties=(t.prompt_mask, t.counts))),
        # update_output_counts_
        ("counts-output_counts-int64", "output_counts", count_update(output_counts=lambda t: t.counts.long())),
        ("counts-output_counts-1d", "output_counts", count_update(output_counts=lambda t: t.counts[0])),
        ("counts-output_counts-expanded-rows", "output_counts",
         count_update(output_counts=lambda t: t.counts[:1].expand(B + 2, V))),
        ("counts-output_counts-meta-device", "output_counts", count_update(output_counts=lambda t: t.counts.to("meta"))),
        ("counts-output_counts-rows-unmapped", "output_counts", count_update(rows=None)),
        ("counts-token_ids-past-vocab", "token_ids", count_update(token_ids=lambda t: t.token_ids.clamp(min=0) + V - 1)),
        ("counts-token_ids-below-none", "token_ids", count_update(token_ids=lambda t: t.token_ids - V)),
        ("counts-token_ids-int16", "token_ids", count_update(token_ids=lambda t: t.token_ids.short())),
        ("counts-token_ids-3d", "token_ids", count_update(token_ids=lambda t: t.token_ids.view(B, 2, 1))),
        ("counts-token_ids-float", "token_ids", count_update(token_ids=lambda t: t.token_ids.float())),
        ("counts-rows-past-state", "rows", count_update(rows=[0, 1, 2, B + 2])),
        ("counts-rows-wrong-length", "rows", count_update(rows=lambda t: t.state_rows[:3])),
        ("counts-rows-floats", "rows", count_update(rows=[0.5, 1, 2, 3])),
        # penalty_state_from_tokens
        ("state-vocab_size-negative", "vocab_size", state_from_tokens(vocab_size=-1)),
        ("state-vocab_size-float", "vocab_size", state_from_tokens(vocab_size=64.0)),
        ("state-vocab_size-too-small-for-ids", "prompt_token_ids", state_from_tokens(vocab_size=V // 2)),
        ("state-prompt_token_ids-1d", "prompt_token_ids", state_from_tokens(prompt=lambda t: t.token_ids[0])),
        ("state-prompt_token_ids-list", "prompt_token_ids", state_from_tokens(prompt=lambda t: t.token_ids.tolist())),
        ("state-prompt_token_ids-int16", "prompt_token_ids", state_from_tokens(prompt=lambda t: t.token_ids.short())),
        ("state-output_token_ids-float", "output_token_ids", state_from_tokens(output=lambda t: t.token_ids.float())),
        ("state-output_token_ids-wrong-rows", "output_token_ids", state_from_tokens(output=lambda t: t.token_ids[:3])),
        ("state-output_token_ids-below-none", "output_token_ids", state_from_tokens(output=lambda t: t.token_ids - V)),
        ("state-output_token_ids-meta-device", "output_token_ids",
         state_from_tokens(output=lambda t: t.token_ids.to("meta"))),
    ]
    return [Case(*c) for c in cases]


def tree(target=lambda t: t.target, drafts=lambda t: t.tree_drafts, next_token=lambda t: t.next_token,
         next_sibling=lambda t: t.next_sibling, **kwargs) -> Callable:
    return _op("verify_tree", target, drafts, next_token, next_sibling, **kwargs)


def sharded(logits=lambda t: t.logits, vocab_offset=0, vocab_size=V, **kwargs) -> Callable:
    """sample_sharded in one process (the world of one: no process group needed)."""
    return _op("sample_sharded", logits, vocab_offset, vocab_size, check_shards=False, **kwargs)


def _tree_sharded_and_support_cases() -> list[Case]:
    cases = [
        # verify_tree
        ("tree-target-2d", "target_logits", tree(target=lambda t: t.logits)),
        ("tree-target-float64", "target_logits", tree(target=lambda t: t.target.double())),
        ("tree-drafts-int16", "draft_token_ids", tree(drafts=lambda t: t.tree_drafts.short())),
        ("tree-drafts-one-node-short", "draft_token_ids", tree(drafts=lambda t: t.tree_drafts[:, :2])),
        ("tree-drafts-past-vocab", "draft_token_ids", tree(drafts=torch.full((B, 3), V))),
        ("tree-next_token-float", "next_token", tree(next_token=lambda t: t.next_token.float())),
        ("tree-next_token-past-nodes", "next_token", tree(next_token=torch.tensor([[3, -1, -1]] * B))),
        ("tree-next_sibling-of-root", "next_sibling", tree(next_sibling=torch.tensor([[1, 2, -1]] * B))),
        ("tree-next_token-cycle", "next_token", tree(next_token=torch.tensor([[1, 0, -1]] * B))),
        ("tree-draft_probs-narrow", "draft_probs", tree(draft_probs=torch.full((B, 3, V - 1), 1 / V))),
        ("tree-bitmask-2d", "bitmask", tree(bitmask=lambda t: t.mask)),
        ("tree-top_p-above-1", "top_p", tree(top_p=1.5)),
        ("tree-filter_apply_order-unknown", "filter_apply_order", tree(filter_apply_order="first")),
        ("tree-temperature_last-str", "temperature_last", tree(temperature_last="True")),
        ("tree-out-tokens-float", "tokens", tree(out=lambda t: (t.tree_out.float(), t.tree_out, t.row_i64))),
        ("tree-out-num_accepted-wrong-length", "num_accepted", tree(out=lambda t: (t.tree_out, t.tree_out, t.ids2))),
        # sample_sharded, one process
        ("sharded-local_logits-1d", "local_logits", sharded(logits=lambda t: t.logits[0])),
        ("sharded-vocab_offset-negative", "vocab_offset", sharded(vocab_offset=-1)),
        ("sharded-vocab_offset-past-vocab", "vocab_offset", sharded(vocab_offset=1)),
        ("sharded-vocab_size-float", "vocab_size", sharded(vocab_size=float(V))),
        ("sharded-top_p-above-1", "top_p", sharded(top_p=1.5)),
        ("sharded-epsilon_cutoff-above-1", "epsilon_cutoff", sharded(epsilon_cutoff=1.5)),
        ("sharded-top_n_sigma-nan", "top_n_sigma", sharded(top_n_sigma=float("nan"))),
        # (not a keyword of sample_sharded; given in controls=, it refuses it)
        ("sharded-dynatemp_range-in-controls", "dynatemp_range",
         lambda lp, t: lp.sample_sharded(t.logits, 0, V, check_shards=False,
                                         controls=lp.SamplingControls(dynatemp_range=0.5))),
        ("sharded-xtc_probability-in-controls", "xtc_probability",
         lambda lp, t: lp.sample_sharded(t.logits, 0, V, check_shards=False,
                                         controls=lp.SamplingControls(xtc_probability=0.5))),
        ("sharded-temperature_last-in-controls", "temperature_last",
         lambda lp, t: lp.sample_sharded(t.logits, 0, V, check_shards=False,
                                         controls=lp.SamplingControls(temperature_last=True))),
        ("sharded-num_logprobs-negative", "num_logprobs", sharded(num_logprobs=-2)),
        ("sharded-rank_ties-unknown", "rank_ties", sharded(num_logprobs=2, rank_ties="dense")),
        ("sharded-ids_dtype-int16", "ids_dtype", sharded(ids_dtype=torch.int16)),
        ("sharded-bitmask-int64", "bitmask", sharded(bitmask=lambda t: t.mask.long())),
        ("sharded-return_kept-zero", "return_kept", sharded(return_kept=0)),
        # token_logprobs(support=): the replay
        ("support-float", "support", token_logprobs(support=lambda t: t.row_f32.view(B, 1))),
        ("support-bitmask-wrong-words", "support", token_logprobs(support=lambda t: t.wide_mask)),
        ("support-ids-1d", "support", token_logprobs(support=lambda t: t.ids)),
        ("support-with-top_k", "top_k", token_logprobs(support=lambda t: t.mask, top_k=5)),
        ("support-with-penalties-out", "out", token_logprobs(support=lambda t: t.mask, out=lambda t: t.row_f32)),
        ("support-return_entropy-without-support", "return_entropy", token_logprobs(return_entropy=True)),
        ("support-temperature-list", "temperature", token_logprobs(support=lambda t: t.mask, temperature=[1.0])),
    ]
    return [Case(*c) for c in cases]


CASES = {c.id: c for c in _bitmask_cases() + _sampler_cases() + _penalty_cases() + _logprobs_cases()
         + _verify_cases() + _tree_sharded_and_support_cases()}
# Not part of the matrix: checks that the harness turns a crash into that case's failure.
PROBES = {"crash-probe": Case("crash-probe", "-", lambda lp, t: os.abort())}


def run_one(lp, case: Case) -> dict:
    """Run one case in this process: what it raised, and whether the inputs kept their bits."""
    if case.id.startswith("sample-") and not hasattr(lp, "sample"):
        return {"missing": "sample"}
    t = inputs()
    before = {k: v.clone() for k, v in vars(t).items()}
    result = {"raised": None, "message": ""}
    try:
        case.call(lp, t)
    except Exception as e:  # noqa: BLE001: the matrix reports any exception and judges it in the parent
        result = {"raised": type(e).__name__, "expected_type": isinstance(e, EXPECTED_ERRORS),
                  "message": str(e).splitlines()[0] if str(e) else "", "where": traceback.format_exc(limit=-3)}
    result["changed"] = [k for k, v in vars(t).items() if not same_bits(v, before[k])]
    return result


def child_main(backend: str, ids: list[str]) -> None:
    lp = load(None if backend == "default" else backend)
    for case_id in ids:
        print(f"BEGIN {case_id}", flush=True)
        case = CASES.get(case_id) or PROBES[case_id]
        print("RESULT " + json.dumps({"id": case_id, **run_one(lp, case)}), flush=True)


def run_children(backend: str, ids: list[str]) -> dict[str, dict]:
    """All cases through child processes; a crash records the case it hit and a new child
    takes the rest."""
    outcomes: dict[str, dict] = {}
    remaining = list(ids)
    # this folder for this module, tests/ for the harness it imports
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import test_bad_input as m; "
            "m.child_main(sys.argv[3], sys.argv[4:])")
    here = Path(__file__).resolve().parent
    while remaining:
        proc = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent), backend, *remaining],
                              capture_output=True, text=True, timeout=600, env=os.environ.copy())
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("BEGIN "):
                current = line.removeprefix("BEGIN ")
            elif line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
                outcomes[result.pop("id")] = result
                current = None
        if current is None and proc.returncode != 0:
            raise RuntimeError(f"the child failed outside any case (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        if current is not None:
            outcomes[current] = {"crashed": proc.returncode, "stderr": proc.stderr[-3000:]}
        remaining = [i for i in ids if i not in outcomes]
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return {backend: run_children(backend, list(CASES)) for backend in [b or "default" for b in backends()]}


@pytest.mark.parametrize("backend", [b or "default" for b in backends()])
@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_call_raises_naming_the_argument(outcomes, backend, case_id):
    result = outcomes[backend][case_id]
    if "missing" in result:
        pytest.skip(f"this build has no `{result['missing']}` op yet")
    assert "crashed" not in result, f"the child process died (exit {result['crashed']}):\n{result['stderr']}"
    assert result["raised"] is not None, "no exception: the bad call was accepted"
    assert result["expected_type"], f"raised {result['raised']}: {result['message']}\n{result['where']}"
    assert names_as_subject(result["message"], CASES[case_id].arg), \
        f"the message does not name {CASES[case_id].arg!r} as its subject: {result['message']}"
    assert not result["changed"], f"inputs changed: {result['changed']}"


def test_the_matrix_detects_a_crash():
    """The harness itself: a case that kills its process is reported as that case's crash,
    and the cases after it still run in a new child."""
    got = run_children("cpu", ["logits-float64", "crash-probe", "vocab_size-negative"])
    assert got["crash-probe"]["crashed"] != 0
    assert got["logits-float64"]["raised"] and got["vocab_size-negative"]["raised"]
