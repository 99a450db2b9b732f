"""The CUDA kernels of token_logprobs(..., support=) (support_logprobs_cuda.cu) against the CPU
implementation, bit for bit: the log-probabilities, the entropy and the gradient of the logits,
for both layouts of the support, every dtype, special logits (NaN, +inf, ties, rows all -inf),
empty supports and tokens outside them, on emulated GPUs of any size (grid-stride rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import (DTYPES, SANITIZED, SMS, assert_launched, row_params, special_bitmask,
                                  special_logits)
from cuda_emulation.emulation import COUNTS_TRAFFIC
from reference import pack_bitmask, unpack_bitmask

# (rows, vocab); under ThreadSanitizer and ASan smaller ones.
SHAPES = [(5, 1001), (3, 4099)] if SANITIZED else [(1, 1), (7, 1001), (20, 32000), (3, 128256)]


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
    rows, vocab = 40 if SANITIZED else 300, 2000
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
    rows, vocab = (9, 3001) if SANITIZED else (21, 9001)
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
    assert forward[1] == rows * (4 + 4 + 16), forward
    assert backward[1] == rows * vocab * 2, backward
    saved = 16 + 4 + 4 + 4 + 4 + 8  # normaliser, logprob, entropy, both incoming gradients, token id
    assert backward[0] == rows * (4 * vocab + 2 * kept + 256 * saved), backward


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
@pytest.mark.parametrize("k", [20, 64])
def test_kept_set_traffic(emulation, k):
    """What return_kept=K adds to sample_with_logprobs: one more pass over the row (fp32, top-k 50
    + top-p 0.9, no bitmask) per kTopChunk = 20 kept ids (up to the set's size), and the kept
    outputs' writes (the
    bitmask's words, zeroed then set by atomics, the ids and the size)."""
    rows, vocab = 4, 128256
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(k))
    counted = []
    with emulation.gpu(8) as lp:
        for extra in ({}, dict(return_kept=k)):
            emulation.reset_traffic()
            lp.sample_with_logprobs(logits, top_k=50, top_p=0.9, seed=1, **extra)
            counted.append(emulation.traffic())
    extra_passes = (counted[1][0] - counted[0][0]) / (rows * vocab * 4)
    # (The passes stop at a chunk the set does not fill: its 50 tokens take 3 for K = 64.)
    expected = min(math.ceil(k / 20), 50 // 20 + 1)
    assert expected - 0.01 <= extra_passes <= expected + 0.01, extra_passes
