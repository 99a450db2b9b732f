"""The CUDA kernels of token_logprobs(..., support=) (support_logprobs_cuda.cu) against the CPU
implementation, bit for bit: the log-probabilities, the entropy and the gradient of the logits,
for both layouts of the support, every dtype, special logits (NaN, +inf, ties, rows all -inf),
empty supports and tokens outside them, on emulated GPUs of any size (grid-stride rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import DTYPES, SANITIZED, SMS, assert_launched, special_bitmask, special_logits
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


@pytest.mark.emulation
def test_return_kept_is_refused_on_the_cuda_path(emulation):
    """The CUDA sampler does not write the kept set yet: the op says so, never leaves it unwritten."""
    with pytest.raises(RuntimeError, match="return_kept is not implemented for CUDA tensors"):
        emulation.lp.sample_with_logprobs(torch.randn(2, 100), return_kept=3)


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
