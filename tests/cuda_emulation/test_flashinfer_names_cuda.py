"""FlashInfer's names on the CUDA kernels against the CPU, bit for bit: logits_from_probs_kernel
(ln p of every element: the three dtypes, subnormals, zeros of either sign, NaN, negatives,
+inf, unaligned rows, GPUs of 1, 8 and 132 SMs), and each entry point whole, emulated and on a
GPU where there is one."""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import DTYPES, SMALL_CASES, SMS, assert_launched, to_device, unaligned_rows
from op_cases import assert_same_logits

SHAPES = [(3, 1001)] if SMALL_CASES else [(1, 1), (5, 1001), (3, 40000)]


def special_probs(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Probabilities over many scales, with every special value a caller may pass."""
    p = torch.exp(-torch.rand(rows, vocab, generator=g) * 120) * torch.rand(rows, vocab, generator=g)
    specials = torch.tensor([0.0, -0.0, math.inf, math.nan, -0.5, 1e-45, 1.1754942e-38, 1.0])
    spots = torch.randint(0, vocab, (rows, 8), generator=g)
    p.scatter_(1, spots, specials.expand(rows, -1).contiguous())
    return p.to(dtype)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_logits_from_probs_agrees_with_cpu(emulation, lp_cpu, sms, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab + sms)
    for probs in (special_probs(rows, vocab, dtype, g), unaligned_rows(special_probs(rows, vocab, dtype, g))):
        expected = lp_cpu._flashinfer.logits_from_probs(probs)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp._flashinfer.logits_from_probs(probs)
        assert_launched(emulation, before)
        assert_same_logits(got, expected)


CALLS = {
    "top_k_renorm_probs": dict(top_k=torch.tensor([1, 7, 0, 50000], dtype=torch.int32)),
    "top_p_renorm_probs": dict(top_p=torch.tensor([0.3, 0.9, 1.0, 0.0])),
    "top_k_mask_logits": dict(top_k=5),
    "sampling_from_probs": dict(seed=3, offset=9),
    "top_k_top_p_sampling_from_probs": dict(top_k=20, top_p=0.8, seed=torch.arange(4), offset=torch.ones(4, dtype=torch.int64)),
    "min_p_sampling_from_probs": dict(min_p=torch.tensor([0.0, 0.1, 0.5, 1.0]), seed=4, offset=0),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_entry_point_agrees_with_cpu(cuda_target, lp_cpu, name):
    g = torch.Generator().manual_seed(len(name))
    rows, vocab = 4, 3000
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1)
    probs[3, ::2] = 0
    first = torch.randn(rows, vocab, generator=g) if name == "top_k_mask_logits" else probs
    expected = getattr(lp_cpu, name)(first, **CALLS[name])
    got = getattr(cuda_target.lp, name)(first.to(cuda_target.device), **to_device(CALLS[name], cuda_target.device)).cpu()
    if expected.is_floating_point():
        assert_same_logits(got, expected, name)
    else:
        assert torch.equal(got, expected), name
