"""What the engine tests share: running requests, comparing logprobs, the chi-square test."""

from __future__ import annotations

import math
import time

import torch

from conftest import TIMINGS

PROMPTS = [
    "The sampler draws one token per row",
    "A grammar bitmask in XGrammar's layout",
    "def sample(logits, temperature):",
    "Penalties and logit biases from per-request state",
    "1, 2, 3,",
    "Log-probabilities from the sampler's own pass",
]


def generate(llm, prompts, params, label: str):
    """llm.generate, timed; `params` one SamplingParams or one per prompt."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    TIMINGS.append((f"{label}: {len(prompts)} requests, {tokens} tokens", seconds))
    return outputs


def plugin_stats() -> dict:
    """vllm_logits_processor.stats() of the one live in-process engine."""
    import vllm_logits_processor

    (s,) = vllm_logits_processor.stats()
    return s


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def compare_logprob_dicts(mine, theirs, atol: float = 1e-5) -> float:
    """Two requests' per-position {token id: Logprob} dicts: the same ids, values within atol
    (both -inf, or both finite), the same ranks. Returns the largest difference seen."""
    worst = 0.0
    assert len(mine) == len(theirs)
    for position, (a, b) in enumerate(zip(mine, theirs)):
        finite_a = {t: v for t, v in a.items() if math.isfinite(v.logprob)}
        finite_b = {t: v for t, v in b.items() if math.isfinite(v.logprob)}
        assert finite_a.keys() == finite_b.keys(), f"position {position}: ids {sorted(finite_a)} vs {sorted(finite_b)}"
        for t in finite_a:
            diff = abs(finite_a[t].logprob - finite_b[t].logprob)
            worst = max(worst, diff)
            assert diff <= atol, f"position {position} token {t}: {finite_a[t].logprob} vs {finite_b[t].logprob}"
            assert finite_a[t].rank == finite_b[t].rank, f"position {position} token {t}: rank {finite_a[t].rank} vs {finite_b[t].rank}"
    return worst


def full_rows(tensors, rows: int):
    """A shadow record's LogprobsTensors with every token (columns 1..V) as per-row dicts
    {id: value}, and column 0 (the token, its value, its rank)."""
    ids = tensors.logprob_token_ids.tolist()
    values = tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    out = []
    for r in range(rows):
        out.append(({i: v for i, v in zip(ids[r][1:], values[r][1:])}, ids[r][0], values[r][0], ranks[r]))
    return out


def compare_shadow(records, atol: float = 1e-5, logits_mode: bool = False) -> dict:
    """Every step's two full distributions (the plugin's and vLLM's own sampler's, on the same
    logits and SamplingMetadata): the same support, values within atol (relative for logits),
    greedy rows the same token, each row's token at vLLM's rank and value. Returns counts."""
    seen = {"steps": 0, "rows": 0, "greedy_rows": 0, "worst": 0.0}
    for record in records:
        rows = len(record["req_ids"])
        mine = full_rows(record["plugin"], rows)
        theirs = full_rows(record["vllm"], rows)
        tokens = record["tokens"].tolist()
        vllm_tokens = record["vllm_tokens"].tolist()
        seen["steps"] += 1
        for r in range(rows):
            (dist_a, tok_a, val_a, rank_a), (dist_b, _, _, _) = mine[r], theirs[r]
            assert tok_a == tokens[r], "the full-distribution call must draw the step's token"
            if record["greedy"][r]:
                seen["greedy_rows"] += 1
                assert tokens[r] == vllm_tokens[r], f"greedy row {record['req_ids'][r]}: {tokens[r]} vs {vllm_tokens[r]}"
            sup_a = {t for t, v in dist_a.items() if math.isfinite(v)}
            sup_b = {t for t, v in dist_b.items() if math.isfinite(v)}
            assert sup_a == sup_b, f"row {record['req_ids'][r]}: supports differ: {sorted(sup_a ^ sup_b)[:10]}"
            for t in sup_a:
                diff = abs(dist_a[t] - dist_b[t])
                scale = max(1.0, abs(dist_b[t])) if logits_mode else 1.0
                seen["worst"] = max(seen["worst"], diff / scale)
                assert diff <= atol * scale, f"row {record['req_ids'][r]} token {t}: {dist_a[t]} vs {dist_b[t]}"
            assert tok_a in sup_b, f"row {record['req_ids'][r]}: token {tok_a} outside vLLM's support"
            assert abs(val_a - dist_b[tok_a]) <= atol * (max(1.0, abs(val_a)) if logits_mode else 1.0)
            vllm_rank = sum(1 for v in dist_b.values() if v >= dist_b[tok_a])
            assert rank_a == vllm_rank, f"row {record['req_ids'][r]}: rank {rank_a} vs vLLM's {vllm_rank}"
            seen["rows"] += 1
    return seen


def chi_square_p(counts: dict[int, int], probs: dict[int, float], n: int, min_expected: float = 5.0):
    """Pearson's chi-square of `counts` (n draws) against `probs`: bins with an expected count
    of at least min_expected, the rest pooled. Returns (statistic, dof, p-value)."""
    big = [t for t, p in probs.items() if p * n >= min_expected]
    expected = [probs[t] * n for t in big]
    observed = [counts.get(t, 0) for t in big]
    rest_expected = n - sum(expected)
    rest_observed = n - sum(observed)
    if rest_expected >= min_expected:
        expected.append(rest_expected)
        observed.append(rest_observed)
    elif rest_observed:  # draws where the reference has (almost) no mass
        expected.append(max(rest_expected, 1e-9))
        observed.append(rest_observed)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(expected) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p
