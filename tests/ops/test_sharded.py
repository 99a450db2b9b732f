"""sample_sharded over real processes: R in {1, 2, 3, 4, 8} ranks (gloo, a file store), each
holding an uneven slice of the vocabulary, must return on every rank the tokens, log-probabilities,
ids and ranks that `sample` / `sample_with_logprobs` return on the whole rows, bit for bit
(tests/sharded_cases.py builds the cases). One launch of 8 processes runs every R, the smaller
ones on groups of the first R ranks (`group=`), R = 8 on the default group. Then the bad inputs,
and the bytes each rank sends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SANITIZED
from harness import names_as_subject, same_bits, schema_order
from sharded_cases import case_inputs, case_logits, field_names, result_fields

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "sharded_cases.py"

ROW_PARAMETERS = {
    "temperature": [1.0, 0.0, 0.7, 2.0, 0.3, 1e-30],
    "top_k": [0, 5, 100, 1, 3000, 10],
    "top_p": [1.0, 0.5, 0.95, 0.0, 0.9, 0.99],
    "min_p": [0.0, 0.1, 0.0, 0.0, 0.05, 0.0],
    "seed": [11, 12, 13, 14, 15, 16],
    "offset": [0, 1, 2, 3, 4, 5],
}

CASES = [
    {"name": "plain", "gen": 1, "rows": 6, "vocab": 3001},
    {"name": "top_k", "gen": 2, "rows": 6, "vocab": 3001, "top_k": 40, "num_logprobs": 0},
    {"name": "top_p", "gen": 3, "rows": 6, "vocab": 3001, "top_p": 0.9, "num_logprobs": 3},
    {"name": "joint", "gen": 4, "rows": 6, "vocab": 3001, "top_k": 50, "top_p": 0.8, "min_p": 0.01,
     "num_logprobs": 4},
    {"name": "top_k_first", "gen": 5, "rows": 6, "vocab": 3001, "top_k": 30, "top_p": 0.7, "min_p": 0.02,
     "filter_apply_order": "top_k_first", "num_logprobs": 3},
    {"name": "per_row", "gen": 6, "rows": 6, "vocab": 4099, **ROW_PARAMETERS, "num_logprobs": 5},
    {"name": "per_row_top_k_first", "gen": 7, "rows": 6, "vocab": 4099, **ROW_PARAMETERS,
     "filter_apply_order": "top_k_first"},
    {"name": "ties", "gen": 8, "rows": 6, "vocab": 2000, "kind": "ties", "dtype": "bfloat16", "top_k": 10,
     "top_p": 0.6, "num_logprobs": 6, "rank_ties": "max", "ids_dtype": "int32"},
    {"name": "special", "gen": 9, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
     "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.9, "num_logprobs": 3},
    {"name": "special_fp32", "gen": 10, "rows": 6, "vocab": 1500, "kind": "special",
     "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_k": 3, "num_logprobs": 2},
    {"name": "bitmask_penalties", "gen": 11, "rows": 5, "vocab": 2500, "bitmask": True, "penalties": True,
     "top_k": 20, "top_p": 0.9, "num_logprobs": 2},
    {"name": "greedy_bitmask", "gen": 12, "rows": 5, "vocab": 2500, "bitmask": True, "temperature": 0.0,
     "num_logprobs": 4},
    {"name": "tokens_int32", "gen": 19, "rows": 5, "vocab": 2500, "bitmask": True, "top_k": 20, "ids_dtype": "int32"},
    {"name": "raw_per_row", "gen": 14, "rows": 6, "vocab": 4099, **ROW_PARAMETERS, "bitmask": True,
     "penalties": True, "logprobs_mode": "raw", "num_logprobs": 7},
    {"name": "raw_special", "gen": 15, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "bfloat16",
     "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_k": 3, "logprobs_mode": "raw", "num_logprobs": 4,
     "rank_ties": "max"},
    # return_kept: greedy rows, sets of 1 and 5 and over K (ids -1), nothing allowed, tokens only,
    # and with raw log-probabilities (the kept set is still the draw's).
    {"name": "kept_per_row", "gen": 16, "rows": 6, "vocab": 4099, **ROW_PARAMETERS, "return_kept": 128,
     "num_logprobs": 2},
    {"name": "kept_special_tokens", "gen": 17, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
     "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.5, "return_kept": 40},
    {"name": "kept_bitmask_penalties_raw", "gen": 18, "rows": 5, "vocab": 2500, "bitmask": True, "penalties": True,
     "top_k": 20, "top_p": 0.9, "filter_apply_order": "top_k_first", "logprobs_mode": "raw", "num_logprobs": 3,
     "return_kept": 20},
    # The whole-row floors (the truncate stage): epsilon, eta (the entropy's sums), top-n-sigma
    # (sigma's) and mirostat's 2^-mu, per row and joined to min-p, top-k and top-p in both orders.
    {"name": "truncation_per_row", "gen": 20, "rows": 6, "vocab": 3001, "epsilon_cutoff": [0.0, 1e-3, 0.0, 0.02, 0.0, 3e-4],
     "eta_cutoff": [0.0, 0.0, 5e-3, 0.0, 0.0, 2e-3], "top_n_sigma": [-1.0, 0.0, 1.5, 0.5, 2.0, 1.0],
     "mirostat_mu": [float("inf"), 4.0, float("inf"), 9.0, 0.0, 6.0], "num_logprobs": 3},
    {"name": "truncation_top_k_first", "gen": 21, "rows": 6, "vocab": 3001, "top_k": 40, "top_p": 0.8, "min_p": 0.01,
     "filter_apply_order": "top_k_first", "epsilon_cutoff": 3e-3, "top_n_sigma": 2.0, "return_kept": 64,
     "num_logprobs": 2},
    {"name": "truncation_special", "gen": 22, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
     "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "eta_cutoff": 0.01, "top_n_sigma": 1.0, "top_p": 0.9,
     "bitmask": True, "penalties": True, "num_logprobs": 2},
    {"name": "llama_vocab", "gen": 13, "rows": 2, "vocab": 128256, "top_k": 50, "top_p": 0.95, "num_logprobs": 1},
]


def test_one_process_is_the_unsharded_sampler(lp_cpu):
    """R = 1 in this process (no torch.distributed): every stage, no exchange."""
    for case in CASES[:-1]:
        kwargs = case_inputs(case, lp_cpu)
        got = lp_cpu.sample_sharded(case_logits(case), 0, case["vocab"], **kwargs, num_logprobs=case.get("num_logprobs"))
        for name, a, b in zip(field_names(case), result_fields(got, case), reference(lp_cpu, case), strict=True):
            assert same_bits(a, b), f"{case['name']}: {name}\n{a}\n!=\n{b}"


def run_worlds(jobs: list[dict], tmp_path: Path) -> list[list[list[tuple]]]:
    """Each job's results ({"world": R, "cases": [...]}), rank by rank, from one launch of as
    many processes as the largest R."""
    world = max(job["world"] for job in jobs)
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    store = tmp_path / "store"
    # One OpenMP thread per rank: up to 8 ranks share the machine's cores (on the 2-core one,
    # R = 8 took 30 s instead of 37 s with torch's default thread count).
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(store), str(spec),
                               str(tmp_path / f"rank{rank}.pt")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} of {world} failed:\n{log}"
    by_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    return [[by_rank[rank][j] for rank in range(job["world"])] for j, job in enumerate(jobs)]


def reference(lp, case: dict) -> tuple:
    """The unsharded result, as result_fields lays out sample_sharded's."""
    logits, kwargs = case_logits(case), case_inputs(case, lp)
    if case.get("num_logprobs") is None and not case.get("return_kept"):
        return (lp.sample(logits, **kwargs),)
    result = lp.sample_with_logprobs(logits, **kwargs, num_logprobs=case.get("num_logprobs") or 0)
    if case.get("num_logprobs") is None:  # (the tokens and the kept set)
        return (result[0].tokens, *result[1])
    return result_fields(result, case)


WORLDS = [1, 2, 3, 4, 8]
MISMATCHES = [("batch", "local_logits' batch size differs across the ranks"), ("temperature", "temperature differs"),
              ("overlap", "vocab_offset: the shards must tile")]
DISAGREEING = [{"name": m, "gen": 20 + i, "rows": 3, "vocab": 500, "temperature": 1.0, "mismatch": m}
               for i, (m, _) in enumerate(MISMATCHES)]
# (the ranks inherit the sanitizer: under ASan R = 1 and 2 run every case, a third of the time)
SANITIZED_WORLDS = [1, 2]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    """Every R's results for CASES, and R = 2's for the disagreeing ranks ("disagree")."""
    sizes = SANITIZED_WORLDS if SANITIZED else WORLDS
    jobs = [{"world": r, "cases": CASES} for r in sizes] + [{"world": 2, "cases": DISAGREEING}]
    results = run_worlds(jobs, tmp_path_factory.mktemp("sharded"))
    return {**dict(zip(sizes, results)), "disagree": results[-1]}


# (one xdist worker for the tests that read the launch: it runs once)
@pytest.mark.xdist_group("sharded-launch")
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_the_unsharded_result(lp_cpu, world, worlds):
    if SANITIZED and world not in SANITIZED_WORLDS:
        pytest.skip("under ASan only R = 1 and 2: the same code, a third of the time")
    results = worlds[world]
    for i, case in enumerate(CASES):
        expected = reference(lp_cpu, case)
        for rank in range(world):
            got = results[rank][i]
            for name, a, b in zip(field_names(case), got, expected, strict=True):
                assert same_bits(a, b), f"{case['name']}, rank {rank} of {world}: {name}\n{a}\n!=\n{b}"


@pytest.mark.xdist_group("sharded-launch")
def test_ranks_that_disagree_all_raise(worlds):
    results = worlds["disagree"]
    for i, (_, message) in enumerate(MISMATCHES):
        for rank in range(2):
            assert results[rank][i][0] == "error" and message in results[rank][i][1], (rank, results[rank][i])


def test_shards_must_tile_the_vocabulary(lp_cpu):
    logits = torch.randn(3, 100)
    with pytest.raises(ValueError, match="vocab_offset: the shards cover"):
        lp_cpu.sample_sharded(logits, 0, 120)
    with pytest.raises(ValueError, match="vocab_offset: the shards must tile"):
        lp_cpu.sample_sharded(logits, 20, 120)
    with pytest.raises(RuntimeError) as e:  # the op's own check, without the exchange
        lp_cpu.sample_sharded(logits, 30, 120, check_shards=False)
    assert names_as_subject(str(e.value), "vocab_offset")


@pytest.mark.parametrize("bad, argument", [
    ({"num_logprobs": -1}, "num_logprobs"),
    ({"vocab_size": 2**31}, "vocab_size"),
    ({"top_p": 1.5}, "top_p"),
    ({"num_logprobs": 2, "logprobs_mode": "log"}, "logprobs_mode"),
    ({"num_logprobs": 2, "rank_ties": "average"}, "rank_ties"),
    ({"return_kept": 0}, "return_kept"),
    ({"return_kept": 101}, "return_kept"),
    ({"bitmask": torch.zeros(3, 4, dtype=torch.int64)}, "bitmask"),
])
def test_bad_arguments_are_named(lp_cpu, bad, argument):
    logits = torch.randn(3, 100)
    kwargs = {"vocab_offset": 0, "vocab_size": 100, **bad}
    with pytest.raises((ValueError, RuntimeError)) as e:
        lp_cpu.sample_sharded(logits, kwargs.pop("vocab_offset"), kwargs.pop("vocab_size"), check_shards=False,
                              **kwargs)
    assert names_as_subject(str(e.value), argument), str(e.value)


def plan_bytes(lp, **filters) -> int:
    """The bytes one rank sends per row (the exchanged tensors' sizes), from the driver's plan."""
    plan = sys.modules[lp.sample_sharded.__module__]._Plan(**filters)
    return 8 * sum(sum(plan.widths(stage)) for stage in range(plan.stages))


@pytest.mark.parametrize("filters", [
    {"top_k": False, "top_p": False, "top_k_first": False, "num_logprobs": -1},
    {"top_k": True, "top_p": True, "top_k_first": False, "num_logprobs": -1},
    {"top_k": True, "top_p": True, "top_k_first": True, "num_logprobs": -1},
    {"top_k": True, "top_p": True, "top_k_first": False, "num_logprobs": 20},
    {"top_k": True, "top_p": True, "top_k_first": False, "num_logprobs": 20, "raw_logprobs": True},
])
def test_bytes_per_row_within_two_percent_of_the_gather(lp_cpu, filters):
    """At V = 128256 the gather moves 4V bytes of fp32 logits per row; every path sends at most 2% of that."""
    sent = plan_bytes(lp_cpu, **filters)
    assert sent <= 0.02 * 4 * 128256, (filters, sent)


def test_shard_ops_opcheck(lp_cpu):
    """sample_shard_step at every stage of one call (two ranks' shards: the collectives are a sum
    and a stack here) and sample_shard_finish under torch.library.opcheck (schema, fake and
    dispatch), each on copies of what it writes; the stages' real results driven on, and the
    outputs `sample_with_logprobs`' on the whole rows."""
    sharded = sys.modules[lp_cpu.sample_sharded.__module__]
    ops = lp_cpu._ops.ops
    g = torch.Generator().manual_seed(77)
    rows, vocab, cut, n, k = 3, 300, 130, 2, 4
    logits = torch.randn(rows, vocab, generator=g)
    shards = [logits[:, :cut].contiguous(), logits[:, cut:].contiguous()]
    params = dict(temperature=torch.rand(rows, generator=g) + 0.5, top_k=20, top_p=0.9, min_p=0.0,
                  seed=torch.arange(rows), offset=1)
    arguments = lp_cpu.SamplingControls(**params).arguments(*sharded.SAMPLER_CONTROLS)
    plan = sharded._plan(arguments, n, "processed", k, "max")
    words = lambda *shape: torch.zeros(shape, dtype=torch.int64)  # noqa: E731
    states = [words(rows, sharded._STATE_WORDS) for _ in shards]
    sums_in, picks_in = words(rows, 0), words(2, rows, 0)
    kept_bitmask = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    for stage in range(plan.stages):
        widths = plan.widths(stage)
        merged, gathered = words(rows, widths[0]), []
        for q, shard in enumerate(shards):
            sums, picks, kept = words(rows, widths[0]), words(rows, widths[1]), torch.zeros_like(kept_bitmask)
            step = dict(logits=shard, vocab_offset=(0, cut)[q], vocab_size=vocab, **arguments,
                        num_logprobs=n, logprobs_mode="processed", rank_ties="max", kept_k=k,
                        stage=stage, state=states[q], sums_in=sums_in, picks_in=picks_in, sums=sums, picks=picks,
                        kept_bitmask=kept)
            written = ("state", "sums", "picks", "kept_bitmask")
            torch.library.opcheck(ops.sample_shard_step, schema_order(
                ops.sample_shard_step, **step | {name: step[name].clone() for name in written}))
            ops.sample_shard_step(*schema_order(ops.sample_shard_step, **step))
            merged += sums
            gathered.append(picks)
            if stage == plan.draw:
                kept_bitmask += kept
        sums_in, picks_in = merged, torch.stack(gathered)
        if stage == plan.draw:
            draw_sums, draw_picks = sums_in, picks_in
    ids = lambda *shape: torch.zeros(shape, dtype=torch.int32)  # noqa: E731 (vLLM's ids)
    finish = dict(state=states[0], draw_picks=draw_picks, draw_sums=draw_sums, rank_sums=sums_in, num_logprobs=n,
                  kept_k=k, rank_ties="max", tokens=ids(rows), logprobs=torch.zeros(rows, 1 + n),
                  logprob_token_ids=ids(rows, 1 + n), ranks=words(rows), kept_ids=words(rows, k),
                  kept_size=words(rows))
    torch.library.opcheck(ops.sample_shard_finish, schema_order(ops.sample_shard_finish, **finish))
    ops.sample_shard_finish(*schema_order(ops.sample_shard_finish, **finish))
    expected, expected_kept = lp_cpu.sample_with_logprobs(logits, **params, num_logprobs=n, rank_ties="max",
                                                          return_kept=k, ids_dtype=torch.int32)
    for name, want in zip(expected._fields, expected):
        assert same_bits(finish[name], want), name
    assert torch.equal(finish["kept_ids"], expected_kept.ids) and torch.equal(kept_bitmask, expected_kept.bitmask)

