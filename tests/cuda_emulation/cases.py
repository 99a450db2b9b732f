"""Inputs and helpers shared by the CUDA tests (tests/cuda_emulation/test_*_cuda.py): the
sampler's paths, per-row parameters and special logits, and the smaller cases of a sanitized
emulation build."""

from __future__ import annotations

import math

import torch

from cuda_emulation.emulation import SMALL_CASES
from reference import random_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMS = [1, 8] if SMALL_CASES else [1, 8, 132]

# Every path of the sampler; rows of a batch cycle through them.
PATHS = {
    "greedy": dict(temperature=0.0),
    "unfiltered": dict(),
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "top_k_top_p": dict(top_k=40, top_p=0.9),
    "all": dict(top_k=50, top_p=0.9, min_p=0.05),
    "epsilon": dict(epsilon_cutoff=1e-3),
    "eta": dict(eta_cutoff=2e-3),
    "top_n_sigma": dict(top_n_sigma=1.5),
    "mirostat": dict(mirostat_mu=4.0),
    "xtc": dict(xtc_probability=1.0, xtc_threshold=0.02),
    "xtc_filtered": dict(top_k=50, top_p=0.95, xtc_probability=0.6, xtc_threshold=0.05),
    "typical": dict(typical_p=0.9),
    "typical_xtc": dict(top_k=100, typical_p=0.7, xtc_probability=1.0, xtc_threshold=0.05),
}

# Where filter_apply_order="top_k_first" decides differently (top-p over what top-k and min-p
# keep): its own cut paths, with top-k in one block, gathered (top-k set) or selected first (a
# top-k set past the gathered entries' capacity), and without top-k.
TOP_K_FIRST_PATHS = {
    "top_k_top_p": dict(top_k=40, top_p=0.9),
    "top_p_min_p": dict(top_p=0.8, min_p=0.05),
    "all": dict(top_k=50, top_p=0.9, min_p=0.05),
    "large_top_k": dict(top_k=5000, top_p=0.95),
    "epsilon_eta": dict(top_k=40, top_p=0.9, epsilon_cutoff=1e-3, eta_cutoff=2e-3),
    "top_n_sigma": dict(top_p=0.9, min_p=0.01, top_n_sigma=2.0),
    "xtc": dict(top_k=40, top_p=0.9, xtc_probability=1.0, xtc_threshold=0.03),
    "typical": dict(top_k=40, top_p=0.9, typical_p=0.8),
}

# filter_apply_order="llama_cpp" (llama.cpp's chain: top-k, typical, top-p, min-p, each over what
# the last left): its chained top-p and min-p after the cut, with and without typical's band.
LLAMA_CPP_PATHS = {
    "top_p": dict(top_p=0.8),
    "top_k_top_p_min_p": dict(top_k=50, top_p=0.9, min_p=0.05),
    "typical_top_p": dict(top_k=100, typical_p=0.5, top_p=0.8),  # (a band that often drops the top)
    "typical_min_p_xtc": dict(typical_p=0.9, min_p=0.05, xtc_probability=1.0, xtc_threshold=0.05),
    "floors": dict(epsilon_cutoff=1e-3, top_n_sigma=2.0, top_p=0.9),
}
# Each order's own paths, where it decides differently from "joint".
ORDER_PATHS = {"top_k_first": TOP_K_FIRST_PATHS, "llama_cpp": LLAMA_CPP_PATHS}
# temperature_last (the cut at T = 1, the draw at T): llama.cpp's whole chain, the other orders'
# cuts, the whole-row floors (sigma in logit units either way), a temperature at which every
# score is 0 (only the cut's own bounds keep its set: sampling.h's within_cut) and two at
# which the scores are taken from the kept set's top (score_origin; XTC may drop the row's),
# and an unfiltered row.
TEMPERATURE_LAST_PATHS = {
    "llama_cpp": dict(temperature=0.7, top_k=50, typical_p=0.9, top_p=0.9, min_p=0.05, filter_apply_order="llama_cpp"),
    "llama_cpp_xtc": dict(temperature=1.6, top_k=100, top_p=0.95, xtc_probability=1.0, xtc_threshold=0.05,
                          filter_apply_order="llama_cpp"),
    "joint": dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
    "top_k_first": dict(temperature=0.6, top_k=40, top_p=0.8, filter_apply_order="top_k_first"),
    "floors": dict(temperature=0.5, top_n_sigma=1.5, epsilon_cutoff=1e-3, top_p=0.95),
    "infinite": dict(temperature=math.inf, top_k=7, top_p=0.9),
    "tiny": dict(temperature=1e-30, top_p=0.9, min_p=0.01),
    "tiny_xtc": dict(temperature=1e-40, xtc_probability=1.0, xtc_threshold=0.05),  # (scores from the kept set's top)
    "unfiltered": dict(temperature=0.8),
}
# PATHS, every order's paths, each with its filter_apply_order ("<path>_<order>"), and the
# temperature_last paths ("<path>_temperature_last").
ORDERED_PATHS = {**PATHS, **{f"{name}_{order}": dict(filters, filter_apply_order=order)
                             for order, paths in ORDER_PATHS.items() for name, filters in paths.items()},
                 **{f"{name}_temperature_last": dict(filters, temperature_last=True)
                    for name, filters in TEMPERATURE_LAST_PATHS.items()}}


# The speculative kernels' rows (verify_draft, verify_tree): row r on path r % 9.
VERIFY_PATHS = [dict(temperature=0.0), dict(), dict(top_k=7), dict(top_p=0.8, min_p=0.05),
                dict(temperature=0.6, top_k=40, top_p=0.9), dict(top_p=0.95, epsilon_cutoff=1e-3, eta_cutoff=2e-3),
                dict(top_n_sigma=1.0), dict(top_k=40, xtc_probability=1.0, xtc_threshold=0.02),
                dict(typical_p=0.8)]

# The filters' per-row values where a path leaves them out (the value that disables each).
FILTER_DEFAULTS = dict(top_k=0, top_p=1.0, min_p=0.0, epsilon_cutoff=0.0, eta_cutoff=0.0, top_n_sigma=-1.0,
                       mirostat_mu=math.inf, typical_p=1.0, xtc_probability=0.0, xtc_threshold=0.1)
# Those sample_sharded does not take.
UNSHARDED = ("epsilon_cutoff", "eta_cutoff", "top_n_sigma", "mirostat_mu", "typical_p", "xtc_probability",
             "xtc_threshold")


def path_params(paths: list[dict], temperature: torch.Tensor) -> dict:
    """Per-row filters, row r on paths[r % len(paths)] (its temperature where the path has one);
    each filter some path uses is a per-row tensor, at FILTER_DEFAULTS' value on the other rows."""
    rows = len(temperature)
    used = {name for path in paths for name in path} | {"top_k", "top_p", "min_p"}
    params = {"temperature": temperature} | {
        name: torch.full((rows,), value, dtype=torch.int64 if name == "top_k" else torch.float32)
        for name, value in FILTER_DEFAULTS.items() if name in used}
    for r in range(rows):
        for name, value in paths[r % len(paths)].items():
            params[name][r] = value
    return params


def verify_row_params(rows: int, g: torch.Generator) -> dict:
    """Per-row temperature and filters of the speculative kernels' tests, row r on VERIFY_PATHS[r % 9]."""
    return path_params(VERIFY_PATHS, torch.rand(rows, generator=g) + 0.4)


def mirostat_path(rows: int, g: torch.Generator) -> dict:
    """verify_draft's and verify_tree's mirostat arguments: mu per row in [1, 9] bits (some +inf,
    NaN and 0), tau per row, eta 0.3. The ops advance mu in place: give each call
    `with_fresh_mu`'s copy."""
    mu = torch.rand(rows, generator=g) * 8 + 1
    mu[1::7], mu[5::11], mu[3::13] = math.inf, math.nan, 0.0
    return dict(mirostat_mu=mu, mirostat_tau=torch.rand(rows, generator=g) * 3 + 1, mirostat_eta=0.3)


def with_fresh_mu(kwargs: dict) -> dict:
    """`kwargs` with a copy of its mirostat_mu, if any (the state a verify op advances in place)."""
    return kwargs | {"mirostat_mu": kwargs["mirostat_mu"].clone()} if "mirostat_mu" in kwargs else kwargs


def same_mu(got: dict, expected: dict) -> bool:
    """Whether two calls' mirostat states ended bit for bit equal (NaN rows included)."""
    if "mirostat_mu" not in got:
        return True
    a, b = got["mirostat_mu"], expected["mirostat_mu"]
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def row_params(rows: int, g: torch.Generator) -> dict:
    """Per-row parameters, row r on path r % 15 with its own temperature, seed and offset."""
    return path_params(list(PATHS.values()), torch.rand(rows, generator=g) + 0.3) | dict(
        seed=torch.randint(0, 2**62, (rows,), generator=g), offset=torch.randint(0, 2**40, (rows,), generator=g))


def shard_row_params(rows: int, g: torch.Generator) -> dict:
    """row_params without the filters sample_sharded does not take (UNSHARDED: their paths' rows
    unfiltered)."""
    return {k: v for k, v in row_params(rows, g).items() if k not in UNSHARDED}


def special_logits(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random logits with NaN columns, ties, and rows all -inf, all NaN but one, or with +inf."""
    x = torch.randn(rows, vocab, generator=g) * 3
    x[::9, ::5] = float("nan")
    x[1::6, : vocab // 2] = x[1::6, :1]  # ties at every cutoff
    for r in range(rows):
        if r % 11 == 3:
            x[r] = float("-inf")
        elif r % 11 == 5:
            x[r] = float("nan")
            x[r, vocab - 1] = 1.0
        elif r % 11 == 8:
            x[r, vocab // 3] = float("inf")
    return x.to(dtype)


def special_bitmask(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    bitmask = random_bitmask(rows, vocab, g, "words")
    bitmask[4::13] = 0  # fully masked rows
    return bitmask


def to_device(value, device: str):
    """A call's argument on `device`: tensors moved, named tuples (Penalties) field by field,
    dicts value by value, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def assert_launched(emulation, before: int) -> None:
    assert emulation.launches() > before, "the op did not launch an emulated kernel"


def sample_agrees_with_cpu(emulation, lp_cpu, sms: int, logits: torch.Tensor, **kwargs) -> torch.Tensor:
    """`sample` on a GPU of `sms` SMs (launching an emulated kernel) returns the CPU's tokens
    bit for bit; returns them."""
    expected = lp_cpu.sample(logits, **kwargs)
    before = emulation.launches()
    with emulation.gpu(sms) as lp:
        got = lp.sample(logits, **kwargs)
    assert_launched(emulation, before)
    assert torch.equal(got, expected), (got != expected).nonzero().flatten().tolist()
    return got


def logprobs_agree_with_cpu(emulation, lp_cpu, sms: int, logits: torch.Tensor, **kwargs) -> None:
    """`sample_with_logprobs` on a GPU of `sms` SMs returns the CPU's tensors bit for bit."""
    expected = lp_cpu.sample_with_logprobs(logits, **kwargs)
    with emulation.gpu(sms) as lp:
        got = lp.sample_with_logprobs(logits, **kwargs)
    for name, a, b in zip(expected._fields, got, expected):
        assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                           b.view(torch.int32) if b.is_floating_point() else b), name



# The cutoffs' key bins (the top 12 bits of the score key): filters whose cutoffs fall inside
# one crowded bin (crowded_logits).
BIN_PATHS = {
    "top_k_1": dict(top_k=1),
    "top_k_50": dict(top_k=50),
    "top_k_1024": dict(top_k=1024),
    "top_k_in_crowd": dict(top_k=2500),
    "top_p": dict(top_p=0.5),
    "top_p_0.99": dict(top_p=0.99),
    "min_p": dict(min_p=0.9),
    "top_k_top_p": dict(top_k=2500, top_p=0.7),
    "all": dict(top_k=2000, top_p=0.9, min_p=0.95),
    "top_k_first": dict(top_k=2500, top_p=0.7, filter_apply_order="top_k_first"),
    "top_k_first_all": dict(top_k=2000, top_p=0.9, min_p=0.95, filter_apply_order="top_k_first"),
    "top_k_first_top_p_min_p": dict(top_p=0.5, min_p=0.9, filter_apply_order="top_k_first"),
}


def crowded_logits(rows: int, vocab: int, crowd: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """`crowd` logits of each row in one key bin, [1, 1.125) (at temperature 1), above the
    rest, rounded to 2^-12 so that many tie; some exactly at the bin's edges 1 and 1.125 (the
    next bin's first key), the rest of the row far below."""
    x = torch.randn(rows, vocab, generator=g) - 4
    crowd_values = torch.floor((1 + torch.rand(rows, crowd, generator=g) / 8) * 4096) / 4096
    crowd_values[:, :7] = 1.0
    crowd_values[:, 7:10] = 1.125
    for r in range(rows):
        x[r, torch.randperm(vocab, generator=g)[:crowd]] = crowd_values[r]
    return x.to(dtype)


def unaligned_rows(logits: torch.Tensor) -> torch.Tensor:
    """The same values as rows of a buffer whose row stride is odd, starting one element in."""
    rows, vocab = logits.shape
    buffer = torch.zeros(rows, vocab + 3, dtype=logits.dtype)
    buffer[:, 1 : 1 + vocab] = logits
    return buffer[:, 1 : 1 + vocab]
