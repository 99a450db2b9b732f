"""The CUDA kernels of token_logprobs(..., support=) (support_logprobs_cuda.cu) against the CPU
implementation, bit for bit: the log-probabilities, the entropy and the gradient of the logits,
for both layouts of the support, every dtype, special logits (NaN, +inf, ties, rows all -inf),
empty supports and tokens outside them, on emulated GPUs of any size (grid-stride rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import (DTYPES, SMALL_CASES, SMS, assert_launched, row_params, special_bitmask,
                                  special_logits)
from cuda_emulation.emulation import COUNTS_TRAFFIC
from reference import pack_bitmask, unpack_bitmask

# (rows, vocab); under ThreadSanitizer and ASan smaller ones.
SHAPES = [(5, 1001), (3, 4099)] if SMALL_CASES else [(1, 1), (7, 1001), (20, 32000), (3, 128256)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def replay_case(rows, vocab, dtype, g):
    logits = special_logits(rows, vocab, dtype, g)
    bitmask = special_bitmask(rows, vocab, g)
    if vocab > 4:  # subnormal float16 logits in every support (the conversion's own path)
        logits[:, 1:4] = torch.tensor([1e-6, -3e-6, 2e-5]).to(dtype)
        bitmask[1::2, 0] |= 0b1110
    temperature = torch.rand(rows, generator=g) + 0.3
    temperature[::4] = 0.0
    tokens = torch.randint(-1, vocab + 1, (rows,), generator=g)
    allowed = unpack_bitmask(bitmask, vocab)
    for r in range(rows):
        members = allowed[r].nonzero().squeeze(1)
        if len(members) and r % 3:
            tokens[r] = members[torch.randint(len(members), (1,), generator=g)]
    ids = torch.where(allowed, torch.arange(vocab), -1).sort(-1, descending=True).values
    ids = ids[:, : max(1, int(allowed.sum(-1).max()))]
    weights = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    return logits, bitmask, ids, temperature, tokens, weights


def replay(lp, logits, tokens, temperature, support, weights):
    x = logits.clone().requires_grad_()
    logprobs, entropy = lp.token_logprobs(x, tokens, temperature, support=support, return_entropy=True)
    finite = logprobs.detach() > -math.inf
    (torch.where(finite, logprobs, 0) @ weights[0] + entropy @ weights[1]).backward()
    return logprobs.detach(), entropy.detach(), x.grad


def on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_replay_agrees_with_cpu(cuda_target, lp_cpu, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits, bitmask, ids, temperature, tokens, weights = replay_case(rows, vocab, dtype, g)
    expected = replay(lp_cpu, logits, tokens, temperature, bitmask, weights)
    device = cuda_target.device
    for support in (bitmask, ids):
        got = replay(cuda_target.lp, *on(device, logits, tokens, temperature, support), on(device, *weights))
        for a, b in zip(got, expected):
            assert torch.equal(bits(a.cpu()), bits(b))


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
def test_batch_invariance_emulated(emulation, lp_cpu, sms):
    g = torch.Generator().manual_seed(sms)
    rows, vocab = 40 if SMALL_CASES else 300, 2000
    logits, bitmask, _, temperature, tokens, weights = replay_case(rows, vocab, torch.bfloat16, g)
    expected = replay(lp_cpu, logits, tokens, temperature, bitmask, weights)
    before = emulation.launches()
    with emulation.gpu(sms) as lp:
        for start, size in [(0, rows), (0, 1), (rows // 2, 7), (rows - 5, 5)]:
            index = torch.arange(start, start + size)
            got = replay(lp, logits[index], tokens[index], temperature[index], bitmask[index],
                         (weights[0][index], weights[1][index]))
            for a, b in zip(got, expected):
                assert torch.equal(bits(a), bits(b[index])), (start, size)
    assert_launched(emulation, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 20, 45])
def test_kept_set_agrees_with_cpu(cuda_target, lp_cpu, dtype, k):
    """sample_with_logprobs(..., return_kept=K) on every sampler path (rows cycle through them),
    special logits, fully masked rows, K within one top-N chunk and beyond it."""
    g = torch.Generator().manual_seed(k)
    rows, vocab = (9, 3001) if SMALL_CASES else (21, 9001)
    logits = special_logits(rows, vocab, dtype, g)
    kwargs = dict(row_params(rows, g), bitmask=special_bitmask(rows, vocab, g), num_logprobs=3)
    expected = lp_cpu.sample_with_logprobs(logits, return_kept=k, **kwargs)
    device = cuda_target.device
    got = cuda_target.lp.sample_with_logprobs(logits.to(device), return_kept=k,
                                              **{n: v.to(device) if isinstance(v, torch.Tensor) else v
                                                 for n, v in kwargs.items()})
    for part_got, part_expected in zip(got, expected):
        for a, b in zip(part_got, part_expected):
            assert torch.equal(bits(a.cpu()) if a.is_floating_point() else a.cpu(),
                               bits(b) if b.is_floating_point() else b)


def stepped(rows, vocab, step, g):
    """fp32 logits on a grid of `step`: every score value shared by many tokens (ties)."""
    return (torch.randn(rows, vocab, generator=g) * 3 / step).round() * step


# return_kept's two ways to the K ids on CUDA (logprobs_cuda.cuh): a kept set of at most
# kBinCapacity = 4096 candidates is sorted in shared memory, a larger one found by passes over
# the row. (K, filters, the logits' grid step (0: unrounded), the kept sizes the case is about.)
KEPT_CASES = {
    "k_1024": (1024, dict(top_k=1500), 0, lambda n: n == 1500),
    "k_past_the_set": (1024, dict(top_k=50, top_p=0.9), 0, lambda n: n <= 50),
    "ties_at_the_cutoff": (1024, dict(top_k=700), 0.1, lambda n: 700 < n < 1024),
    "at_capacity": (300, dict(top_k=4096), 0, lambda n: n == 4096),
    "past_capacity": (300, dict(top_k=4097), 0, lambda n: n == 4097),
    "past_capacity_whole": (4200, dict(top_k=4097), 0, lambda n: n == 4097),  # (its cutoff's token too)
    "ties_past_capacity": (64, dict(top_k=4090), 0.1, lambda n: n > 4096),
    "top_p_min_p": (256, dict(top_p=0.95, min_p=0.02, temperature=0.7), 0, lambda n: 256 < n <= 4096),
    "raw": (1024, dict(top_k=1000, logprobs_mode="raw"), 0, lambda n: n == 1000),
    "raw_past_capacity": (30, dict(logprobs_mode="raw"), 0, lambda n: n > 4096),
}


@pytest.mark.emulation
@pytest.mark.parametrize("case", KEPT_CASES)
def test_kept_set_sizes_agree_with_cpu(emulation, lp_cpu, case):
    """The kept outputs bit for bit the CPU's on both sides of shared memory's capacity, K up
    to 1024 and past the set's size, ties at the cutoff (the lower index first), raw rows."""
    k, filters, step, sizes_of_the_case = KEPT_CASES[case]
    rows, vocab = 3, 9001
    g = torch.Generator().manual_seed(len(case))
    logits = stepped(rows, vocab, step, g) if step else torch.randn(rows, vocab, generator=g)
    kwargs = dict(filters, seed=7, num_logprobs=5, return_kept=k)
    expected = lp_cpu.sample_with_logprobs(logits, **kwargs)
    with emulation.gpu(8) as lp:
        got = lp.sample_with_logprobs(logits, **kwargs)
    assert all(sizes_of_the_case(n) for n in expected[-1].size.tolist()), expected[-1].size
    for part_got, part_expected in zip(got, expected):
        for a, b in zip(part_got, part_expected):
            assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
def test_replay_traffic(emulation):
    """What the kernels move per row, counted: the forward reads the support's words and its
    tokens' logits twice each (s_max, then the sums) plus a few per-row values, and writes 24
    bytes (and each thread reads the row's token id); the backward writes the gradient row once and reads, per token, its support word
    (each thread reads the word of its own token: an L1 hit on a GPU, counted here) and the
    supported tokens' logits, plus each thread's copy of the row's saved values."""
    rows, vocab, kept = 4, 128256, 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:kept] for _ in range(rows)])
    allowed = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, ids, True)
    bitmask = pack_bitmask(allowed)
    tokens = ids[:, 0].clone()
    words = bitmask.shape[1]
    x = logits.clone().requires_grad_()
    with emulation.gpu(8) as lp:
        emulation.reset_traffic()
        logprobs = lp.token_logprobs(x, tokens, 0.8, support=bitmask)
        forward = emulation.traffic()
        emulation.reset_traffic()
        logprobs.sum().backward()
        backward = emulation.traffic()
    token_ids = 256 * 8  # each thread's copy of the row's token id (a scalar temperature: none)
    assert forward[0] == rows * (2 * (4 * words + 2 * kept) + token_ids), forward
    assert forward[1] == rows * (4 + 4 + 24), forward
    assert backward[1] == rows * vocab * 2, backward
    saved = 24 + 4 + 4 + 4 + 4 + 8  # normaliser, logprob, entropy, both incoming gradients, token id
    assert backward[0] == rows * (4 * vocab + 2 * kept + 256 * saved), backward


# return_kept's filters for the traffic test (fp32, V = 128256, random normal logits, no
# bitmask), with the kept set's size: up to kBinCapacity = 4096 the set is sorted in shared
# memory, larger (min-p 0.05: 6000-10000 tokens, more than K: no ids) it is in the bitmask
# only; a raw row's set takes one pass of its own (its log-probabilities' pass is over another
# set).
KEPT_TRAFFIC = {"top_k_50_top_p": dict(top_k=50, top_p=0.9), "top_k_2000": dict(top_k=2000),
                "min_p_past_capacity": dict(min_p=0.05), "raw": dict(top_k=2000, logprobs_mode="raw")}


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
@pytest.mark.parametrize("filters", KEPT_TRAFFIC)
def test_kept_set_traffic(emulation, filters):
    """What return_kept=K adds to sample_with_logprobs, K in {1, 20, 64, 256, 1024}: no pass over
    the row (read: only the bitmask word of each kept token's atomicOr), whether the set fits
    in shared memory or is larger than K (no ids then), a raw row one pass; and the kept
    outputs' writes (the bitmask's words, zeroed then set by atomics, the ids padded with -1,
    then written for a set of at most K, the size)."""
    rows, vocab = 4, 128256
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    kwargs = dict(KEPT_TRAFFIC[filters], seed=1)
    with emulation.gpu(8) as lp:
        emulation.reset_traffic()
        lp.sample_with_logprobs(logits, **kwargs)
        plain = emulation.traffic()
        for k in [1, 20, 64, 256, 1024]:
            emulation.reset_traffic()
            kept = lp.sample_with_logprobs(logits, return_kept=k, **kwargs)[-1]
            read, written = (a - b for a, b in zip(emulation.traffic(), plain))
            sizes = kept.size.tolist()
            atomics = 4 * sum(sizes)  # each kept token's word, read and written by its atomicOr
            fits = max(sizes) <= 4096
            assert fits == (filters != "min_p_past_capacity"), sizes
            passes = (read - atomics) / (rows * vocab * 4)
            expected = 1 if filters == "raw" else 0
            assert expected - 0.005 <= passes <= expected + 0.005, (k, passes)
            ids = sum(size for size in sizes if size <= k)
            assert written == rows * (4 * words + 8 * k + 8) + atomics + 8 * ids, (k, written)
