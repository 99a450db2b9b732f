"""dynamic_temperature_kernel against the CPU, bit for bit: per-row temperatures, ranges and
exponents (greedy rows, ranges off, rows with one candidate or none), the three dtypes, a bitmask
with fully masked rows, unaligned rows, fused penalties and biases, and more rows than blocks
(GPUs of 1, 8 and 132 SMs); and `sample` with dynatemp_range on it. Emulated, and on a GPU
where there is one."""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import DTYPES, SANITIZED, SMS, assert_launched, special_bitmask, special_logits, unaligned_rows
from op_cases import penalty_case

# (Row 8 of special_logits has a +inf logit: its entropy is 0, T_lo.)
SHAPES = [(9, 501)] if SANITIZED else [(1, 1), (13, 1001), (3, 40000)]


def dynatemp_params(rows: int, g: torch.Generator) -> dict:
    """Per-row values: row 0 greedy, row 1 range off, row 2 exponent 0; the rest random."""
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    dynatemp_range = torch.rand(rows, generator=g) * 1.2
    exponent = torch.rand(rows, generator=g) * 2
    for row, (t, r, k) in enumerate([(0.0, 0.5, 1.0), (0.8, 0.0, 1.0), (0.8, 0.5, 0.0)][:rows]):
        temperature[row], dynatemp_range[row], exponent[row] = t, r, k
    return dict(temperature=temperature, dynatemp_range=dynatemp_range, dynatemp_exponent=exponent)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_dynamic_temperature_agrees_with_cpu(emulation, lp_cpu, sms, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab + sms)
    params = dynatemp_params(rows, g)
    logits = special_logits(rows, vocab, dtype, g)
    bitmask = special_bitmask(rows, vocab, g)
    for x, extra in [(logits, {}), (unaligned_rows(logits), dict(bitmask=bitmask))]:
        expected = lp_cpu.dynamic_temperature(x, **params, **extra)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.dynamic_temperature(x, **params, **extra)
        assert_launched(emulation, before)
        assert torch.equal(got, expected), (got - expected).abs().max()
    if rows > 3:
        assert not torch.equal(expected, params["temperature"])  # (the random rows are not left alone)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8])
def test_dynamic_temperature_with_penalties_and_sample_agree_with_cpu(emulation, lp_cpu, sms):
    """Fused penalties and biases read as the sampler reads them (block_row_penalty_view), and the
    draw at the dynamic temperature, with filters."""
    g = torch.Generator().manual_seed(1215)
    rows, vocab = (4, 3000) if SANITIZED else (12, 3000)
    logits, prompt_mask, counts, kwargs = penalty_case(rows, vocab, torch.float32, (True, True, True, True), True,
                                                       False, g)
    params = dynatemp_params(rows, g)
    draw = dict(top_k=40, top_p=0.95, seed=torch.arange(rows), offset=2)
    penalties = lp_cpu.Penalties(prompt_mask, counts, **kwargs)
    expected = lp_cpu.dynamic_temperature(logits, **params, penalties=penalties)
    tokens = lp_cpu.sample(logits, **params, **draw, penalties=penalties)
    with emulation.gpu(sms) as lp:
        penalties = lp.Penalties(prompt_mask, counts, **kwargs)  # (the emulated package's own type)
        got = lp.dynamic_temperature(logits, **params, penalties=penalties)
        got_tokens = lp.sample(logits, **params, **draw, penalties=penalties)
    assert torch.equal(got, expected)
    assert torch.equal(got_tokens, tokens)
    assert not math.isclose(float(expected[-1]), float(params["temperature"][-1]), rel_tol=1e-3)  # (a random row)
