"""sample_sharded's CUDA shard kernels against the CPU ones, bit for bit, in the CUDA
emulation: R shards (uneven, in one process: the collectives are a sum and a stack here) run
every stage through both variants, whose sums, picks and state must agree at each stage, and
whose outputs must be `sample_with_logprobs`' on the whole rows. Every filter path per row,
both filter orders, bitmask, penalties, special logits, a top-N past one pass of kTopChunk,
rows of a padded buffer, on GPUs of 1 and 132 SMs."""

import pytest
import torch

from cuda_emulation.cases import SANITIZED, row_params
from sharded_cases import case_inputs, case_logits, shard_bounds


def stage_arguments(lp, kwargs: dict, num_logprobs: int) -> tuple:
    """The driver's own argument handling (the package's _sharded module): the op's
    sampler and penalty arguments, and the plan."""
    sharded = lp._sharded
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=0)  # (sample_sharded's)
    arguments = sharded.sampler_arguments(**{k: kwargs.get(k, v) for k, v in defaults.items()})
    penalty = sharded.fused_penalty_arguments(kwargs.get("penalties"))
    order = kwargs.get("filter_apply_order", "joint")
    plan = sharded._Plan(arguments["top_k"] is not None or arguments["top_k_value"] > 0,
                         arguments["top_p"] is not None or arguments["top_p_value"] < 1.0,
                         order == "top_k_first", num_logprobs)
    return arguments, penalty, order, plan


def run_stages(lp, shards, cuts, vocab, kwargs, num_logprobs, check=None):
    """Every stage of every shard through `lp`'s ops, merged as the driver merges them; then
    finish. check(stage, q, outputs) sees each shard's (state, sums, picks)."""
    sharded = lp._sharded
    arguments, penalty, order, plan = stage_arguments(lp, kwargs, num_logprobs)
    rows, world = shards[0].shape[0], len(shards)
    words = lambda *shape: torch.full(shape, -7, dtype=torch.int64)  # noqa: E731 (garbage, not zeros)
    states = [words(rows, sharded._STATE_WORDS) for _ in shards]
    sums_in, picks_in = words(rows, 0), words(world, rows, 0)
    draw_picks = draw_sums = None
    for stage in range(plan.stages):
        sums_width, picks_width = plan.widths(stage)
        merged_sums, gathered = torch.zeros(rows, sums_width, dtype=torch.int64), []
        for q, shard in enumerate(shards):
            sums, picks = words(rows, sums_width), words(rows, picks_width)
            sharded.call(sharded.ops, "sample_shard_step", logits=shard, vocab_offset=cuts[q], vocab_size=vocab,
                         **arguments, filter_apply_order=order, bitmask=kwargs.get("bitmask"), **penalty,
                         num_logprobs=num_logprobs, stage=stage, state=states[q], sums_in=sums_in,
                         picks_in=picks_in, sums=sums, picks=picks)
            if check:
                check(stage, q, (states[q].clone(), sums, picks))
            merged_sums += sums
            gathered.append(picks)
        sums_in, picks_in = merged_sums, torch.stack(gathered)
        if stage == plan.draw:
            draw_picks, draw_sums = picks_in, sums_in
    n = num_logprobs
    out = lp.SampleWithLogprobs(words(rows), torch.full((rows, 1 + n), 5.0), words(rows, 1 + n), words(rows))
    sharded.call(sharded.ops, "sample_shard_finish", *out, state=states[0], draw_picks=draw_picks,
                 draw_sums=draw_sums, rank_sums=sums_in, num_logprobs=n)
    return out, plan


CASES = [
    # (name, case, world, num_logprobs)
    ("per_row", {"gen": 21, "rows": 14, "vocab": 3001}, 3, 4),
    ("top_k_first", {"gen": 22, "rows": 14, "vocab": 2500, "filter_apply_order": "top_k_first"}, 2, 2),
    ("ties_bf16", {"gen": 23, "rows": 7, "vocab": 2000, "kind": "ties", "dtype": "bfloat16", "top_k": 10,
                   "top_p": 0.6}, 4, 6),
    ("special_fp16", {"gen": 24, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
                      "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.9}, 3, 3),
    ("bitmask_penalties", {"gen": 25, "rows": 5, "vocab": 2500, "bitmask": True, "penalties": True,
                           "top_k": 20, "top_p": 0.9}, 2, 45),  # the top-N: 20 + 20 + 5
    ("greedy_bitmask", {"gen": 26, "rows": 5, "vocab": 2500, "bitmask": True, "temperature": 0.0}, 3, 4),
    ("unfiltered", {"gen": 27, "rows": 4, "vocab": 1000}, 2, 0),
]
if SANITIZED:
    CASES = [(name, {**case, "rows": min(case["rows"], 6), "vocab": min(case["vocab"], 700)}, world, n)
             for name, case, world, n in CASES[:5]]


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SANITIZED else [1, 132])
@pytest.mark.parametrize("name,case,world,num_logprobs", CASES, ids=[c[0] for c in CASES])
def test_cuda_shard_kernels_agree_with_cpu(emulation, lp_cpu, sms, name, case, world, num_logprobs):
    logits = case_logits(case)
    rows, vocab = case["rows"], case["vocab"]
    per_row = row_params(rows, torch.Generator().manual_seed(case["gen"])) if "gen" in case and (
        name == "per_row" or name == "top_k_first") else {}
    kwargs = {**case_inputs(case, lp_cpu), **per_row}
    emulated_kwargs = {**case_inputs(case, emulation.lp), **per_row}  # (its own Penalties type)
    cuts = shard_bounds(vocab, world, case["gen"])
    # Each shard a slice of a padded buffer: rows the kernels must step by the stride.
    buffer = torch.full((rows, vocab + 9), float("nan"), dtype=logits.dtype)
    buffer[:, 4 : vocab + 4] = logits
    shards = [buffer[:, 4 + cuts[q] : 4 + cuts[q + 1]] for q in range(world)]
    expected = {}
    run_stages(lp_cpu, shards, cuts, vocab, kwargs, num_logprobs,
               check=lambda stage, q, outputs: expected.__setitem__((stage, q), outputs))
    mismatches = []

    def check(stage, q, outputs):
        for what, got, want in zip(("state", "sums", "picks"), outputs, expected[(stage, q)]):
            if not torch.equal(got, want):
                mismatches.append((stage, q, what, (got != want).nonzero()[:4].tolist()))

    before = emulation.launches()
    with emulation.gpu(sms):
        got, plan = run_stages(emulation.lp, shards, cuts, vocab, emulated_kwargs, num_logprobs, check=check)
    assert emulation.launches() == before + plan.stages * world + 1  # a launch per stage and shard, one to finish
    assert not mismatches, mismatches
    reference = lp_cpu.sample_with_logprobs(logits, num_logprobs=num_logprobs, **kwargs)
    assert torch.equal(got.tokens, reference.tokens), (got.tokens, reference.tokens)
    assert torch.equal(got.logprobs.view(torch.int32), reference.logprobs.view(torch.int32))
    assert torch.equal(got.logprob_token_ids, reference.logprob_token_ids)
    assert torch.equal(got.ranks, reference.ranks)
