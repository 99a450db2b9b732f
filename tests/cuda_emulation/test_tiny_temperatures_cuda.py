"""Tiny temperatures and overflowing quotients (tests/ops/test_tiny_temperatures.py) in the
emulated CUDA kernels: the CPU's tokens bit for bit with one block per row and with rows split
over blocks (whose rows with a saturated s_max go to one block: split_rows.cuh), the CPU's
log-probabilities, and token_logprobs(support=)'s forward and gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import DTYPES, SMALL_CASES, logprobs_agree_with_cpu, sample_agrees_with_cpu
from op_cases import TIE_FILTERS
from reference import pack_bitmask

# (0.5: the huge logits' case. Sanitized builds: fewer cases.)
TEMPERATURES = [1e-38, 0.5] if SMALL_CASES else [1e-38, 2.0**-149, 0.5]
FILTERS = ["unfiltered", "top_k", "top_p"] if SMALL_CASES else list(TIE_FILTERS)
# (rows, vocab, SMs): one block per row, and split rows (few rows, V > 16384, 132 SMs).
WHOLE = (12, 300, 8) if SMALL_CASES else (40, 300, 8)
SPLIT = (2, 33000, 132) if SMALL_CASES else (4, 40000, 132)


def batch(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits whose rows cycle through: a unique maximum, four tied maxima, all
    negative, and (for T = 0.5) maxima near FLT_MAX with +inf among them; NaN and -inf too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[1::4, [vocab // 7, vocab // 3, vocab // 2, vocab - 2]] = 12.0
    x[2::4] = -x[2::4].abs() - 1
    x[3::4] = x[3::4].clamp(-5, 5) * 6e37  # up to 3e38
    x[3::8, vocab // 5] = math.inf
    x[:, [0, vocab // 4]] = math.nan
    x[:, [3, vocab // 6]] = -math.inf
    return x.to(dtype)


def seeds(rows: int, offset: int = 0) -> dict:
    seed = torch.arange(rows, dtype=torch.int64) * 7919 + 11
    return dict(seed=seed, offset=torch.full_like(seed, offset))


def agrees_with_cpu(emulation, lp_cpu, shape, dtype, temperature, filters):
    rows, vocab, sms = shape
    logits = batch(rows, vocab, dtype, 7)
    got = sample_agrees_with_cpu(emulation, lp_cpu, sms, logits, **seeds(rows), temperature=temperature,
                                 **TIE_FILTERS[filters])
    if temperature < 1e-30:  # the argmax limit: one of the row's largest logits
        top = torch.nan_to_num(logits.float(), nan=-math.inf)
        assert bool((top.gather(1, got[:, None]) == top.max(1, keepdim=True).values).all())


@pytest.mark.emulation
@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [WHOLE, SPLIT], ids=["whole_rows", "split_over_blocks"])
def test_tiny_temperatures_agree_with_cpu(emulation, lp_cpu, shape, dtype, temperature, filters):
    agrees_with_cpu(emulation, lp_cpu, shape, dtype, temperature, filters)


@pytest.mark.emulation
@pytest.mark.parametrize("filters", ["unfiltered", "top_p", "all"])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_tiny_temperature_logprobs_agree_with_cpu(emulation, lp_cpu, temperature, filters):
    logits = batch(16, 300, torch.float32, 8)
    logprobs_agree_with_cpu(emulation, lp_cpu, 8, logits, num_logprobs=5, **seeds(16), temperature=temperature,
                            **TIE_FILTERS[filters])


@pytest.mark.emulation
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_tiny_temperature_support_logprobs_agree_with_cpu(emulation, lp_cpu, dtype, temperature):
    logits = batch(8, 300, dtype, 9)
    g = torch.Generator().manual_seed(10)
    support = pack_bitmask(torch.rand(8, 300, generator=g) < 0.7)
    tokens = torch.nan_to_num(logits, nan=-math.inf).argmax(1)

    def replay(lp):
        x = logits.clone().requires_grad_()
        logprobs, entropy = lp.token_logprobs(x, tokens, temperature, support=support, return_entropy=True)
        (torch.where(logprobs > -math.inf, logprobs, 0).sum() + entropy.sum()).backward()
        return logprobs.detach(), entropy.detach(), x.grad

    expected = replay(lp_cpu)
    with emulation.gpu(8) as lp:
        got = replay(lp)
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                           b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))
