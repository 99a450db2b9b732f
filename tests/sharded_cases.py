"""sample_sharded's test cases and the rank process that runs them (tests/ops/test_sharded.py).

A case is a dict of plain values; `case_inputs` builds the same whole-vocabulary logits and
parameters from it in every process, so each rank slices its own shard and the test computes the
reference (`sample` / `sample_with_logprobs` on the whole rows) without sending tensors around.

  python tests/sharded_cases.py RANK WORLD STORE JOBS.json OUT.pt   (one rank, gloo over a file store)

JOBS.json lists {"world": R, "cases": [...]}: ranks 0 .. R - 1 run the cases on a group of R
ranks (the default group where R is the whole world, else a new_group), so one launch of
processes serves every group size: each process imports torch and loads the kernel once.
"""

from __future__ import annotations

import json
import sys

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def shard_bounds(vocab: int, world: int, seed: int) -> list[int]:
    """Uneven cut points 0 = c_0 < ... < c_world = vocab (every shard at least one token)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(vocab - 1, generator=g)[: world - 1].add(1).tolist())
    return [0, *cuts, vocab]


def case_logits(case: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["gen"])
    rows, vocab = case["rows"], case["vocab"]
    x = torch.randn(rows, vocab, generator=g) * case.get("scale", 3.0)
    kind = case.get("kind", "random")
    if kind == "ties":  # few distinct values: ties at every cutoff and at the top, across shards
        x = (x * 0.5).round()
    elif kind == "special":
        x[0, ::7] = float("nan")
        x[1, :] = float("-inf")  # nothing allowed
        x[2, 3] = x[2, vocab - 2] = float("inf")  # two +inf, far apart
        x[3, :] = 0.0
        x[3, 1::2] = -0.0  # the top is +-0.0
        x[4, : vocab // 2] = float("nan")  # the low shards hold nothing
        x[5, :] = x[5, :].abs() * 1e30  # saturated scores at small temperatures
    return x.to(DTYPES[case.get("dtype", "float32")])


def case_inputs(case: dict, lp) -> dict:
    """The keyword arguments of `sample` (or `sample_with_logprobs`) for the case (the whole rows'
    bitmask and penalties)."""
    rows, vocab = case["rows"], case["vocab"]
    g = torch.Generator().manual_seed(case["gen"] + 1)
    kwargs: dict = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "offset", "epsilon_cutoff", "eta_cutoff",
                 "top_n_sigma", "mirostat_mu"):
        value = case.get(name)
        if value is None:
            continue
        if isinstance(value, list):
            dtype = torch.int64 if name in ("top_k", "seed", "offset") else torch.float32
            value = torch.tensor(value, dtype=dtype)
        kwargs[name] = value
    if case.get("bitmask"):
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
        mask[0] = -1
        mask[1 % rows] = 0  # a row with nothing allowed
        if rows > 2:
            mask[2, : words // 2] = 0  # the low half masked: whole shards with nothing allowed
        kwargs["bitmask"] = mask
    if case.get("penalties"):
        prompt = torch.randint(0, vocab, (rows, 12), generator=g)
        output = torch.randint(0, vocab, (rows, 20), generator=g)
        state = lp.penalty_state_from_tokens(prompt, output, vocab)
        bias_ids = torch.randint(-1, vocab, (rows, 6), generator=g)
        bias_values = torch.randn(rows, 6, generator=g) * 4
        kwargs["penalties"] = lp.Penalties(*state, repetition_penalty=1.3, frequency_penalty=0.25,
                                           presence_penalty=0.5, logit_bias_ids=bias_ids,
                                           logit_bias_values=bias_values)
    if case.get("filter_apply_order"):
        kwargs["filter_apply_order"] = case["filter_apply_order"]
    for name in ("logprobs_mode", "rank_ties", "return_kept"):  # (sample_with_logprobs' and sample_sharded's)
        if case.get(name):
            kwargs[name] = case[name]
    if case.get("ids_dtype"):  # (a name in the case: the cases travel as JSON)
        kwargs["ids_dtype"] = getattr(torch, case["ids_dtype"])
    return kwargs


def result_fields(result, case: dict) -> tuple:
    """sample_sharded's result for the case as a flat tuple: the tokens (or the four fields of
    SampleWithLogprobs), then with return_kept the KeptSet's three."""
    main, kept = result if case.get("return_kept") else (result, ())
    return ((main,) if case.get("num_logprobs") is None else tuple(main)) + tuple(kept)


def field_names(case: dict) -> tuple:
    names = ("tokens",) if case.get("num_logprobs") is None else ("tokens", "logprobs", "logprob_token_ids", "ranks")
    return names + (("kept bitmask", "kept ids", "kept size") if case.get("return_kept") else ())


def run_cases(lp, rank: int, world: int, group, cases: list[dict]) -> list:
    """This rank's results for `cases` on `group`, a group of `world` ranks."""
    results = []
    for case in cases:
        logits = case_logits(case)
        bounds = shard_bounds(case["vocab"], world, case["gen"] + world)
        start = bounds[rank]
        shard = logits[:, bounds[rank]: bounds[rank + 1]].contiguous()
        kwargs = case_inputs(case, lp)
        # A mismatch planted on rank 1: every rank must raise, naming it.
        mismatch = case.get("mismatch") if rank == 1 else None
        if mismatch == "batch":
            shard = shard[:-1]
        elif mismatch == "temperature":
            kwargs["temperature"] = 0.5
        elif mismatch == "overlap":
            start, shard = 0, logits[:, : shard.shape[1]].contiguous()
        try:
            result = lp.sample_sharded(shard, start, case["vocab"], **kwargs, num_logprobs=case.get("num_logprobs"),
                                       group=group)
        except ValueError as e:
            results.append(("error", str(e)))
            continue
        results.append(result_fields(result, case))
    return results


def run_rank(rank: int, world: int, store: str, jobs: list[dict], out: str) -> None:
    import torch.distributed as dist
    from kernels import get_local_kernel

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from conftest import BUILD

    lp = get_local_kernel(BUILD, backend="cpu")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # (every rank creates every group, in the same order: new_group is collective)
    groups = [None if job["world"] == world else dist.new_group(list(range(job["world"]))) for job in jobs]
    results = [run_cases(lp, rank, job["world"], group, job["cases"]) if rank < job["world"] else []
               for job, group in zip(jobs, groups)]
    dist.destroy_process_group()
    torch.save(results, out)


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(open(sys.argv[4]).read()), sys.argv[5])
