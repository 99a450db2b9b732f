"""dynamic_temperature_kernel against the CPU, bit for bit: per-row temperatures, ranges and
exponents (greedy rows, ranges off, rows with one candidate or none), the three dtypes, a bitmask
with fully masked rows, unaligned rows, fused penalties and biases, and more rows than blocks
(GPUs of 1, 8 and 132 SMs); and `sample` with dynatemp_range on it. Emulated, and on a GPU
where there is one."""

from __future__ import annotations

import math

import pytest
import torch

from cuda_emulation.cases import DTYPES, SMALL_CASES, SMS, assert_launched, special_bitmask, special_logits, unaligned_rows
from op_cases import penalty_case

# (Row 8 of special_logits has a +inf logit: its entropy is 0, T_lo.)
SHAPES = [(9, 501)] if SMALL_CASES else [(1, 1), (13, 1001), (3, 40000)]


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
    rows, vocab = (4, 3000) if SMALL_CASES else (12, 3000)
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


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8])
def test_positions_and_verification_agree_with_cpu(emulation, lp_cpu, sms):
    """3-D logits (verify_draft's positions: a bitmask each, penalties counting the drafts before
    each), then verify_draft (point-mass drafts, draft probabilities, block verification) and
    verify_tree (a chain, no penalties) at each position's T': the CPU's values and tokens."""
    g = torch.Generator().manual_seed(1218)
    rows, drafts_count, vocab = (4, 3, 700) if SMALL_CASES else (10, 4, 3000)
    positions = drafts_count + 1
    target = special_logits(rows * positions, vocab, torch.float32, g).view(rows, positions, vocab)
    bitmask = special_bitmask(rows * positions, vocab, g).view(rows, positions, -1)
    drafts = torch.randint(0, vocab, (rows, drafts_count), generator=g)
    state = lp_cpu.penalty_state_from_tokens(torch.randint(0, vocab, (rows, 30), generator=g), drafts[:, :2], vocab)
    values = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    params = dynatemp_params(rows, g)
    q = torch.softmax(torch.randn(rows, drafts_count, vocab, generator=g), -1)
    expected = lp_cpu.dynamic_temperature(target, **params, bitmask=bitmask, penalties=lp_cpu.Penalties(*state, **values),
                                          draft_token_ids=drafts)
    verified = [lp_cpu.verify_draft(target, drafts, **params, **extra, bitmask=bitmask, seed=3,
                                    penalties=lp_cpu.Penalties(*state, **values))
                for extra in ({}, dict(draft_probs=q), dict(draft_probs=q, block_verification=True))]
    chain = (torch.cat([torch.full((rows, 1), -1), drafts], 1), torch.tensor([list(range(1, positions)) + [-1]] * rows),
             torch.full((rows, positions), -1))
    tree = lp_cpu.verify_tree(target, *chain, **params, bitmask=bitmask, seed=3)
    with emulation.gpu(sms) as lp:
        got = lp.dynamic_temperature(target, **params, bitmask=bitmask, penalties=lp.Penalties(*state, **values),
                                     draft_token_ids=drafts)
        got_verified = [lp.verify_draft(target, drafts, **params, **extra, bitmask=bitmask, seed=3,
                                        penalties=lp.Penalties(*state, **values))
                        for extra in ({}, dict(draft_probs=q), dict(draft_probs=q, block_verification=True))]
        got_tree = lp.verify_tree(target, *chain, **params, bitmask=bitmask, seed=3)
    assert torch.equal(got, expected), (got - expected).abs().max()
    for a, b in zip(got_verified, verified):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert all(torch.equal(a, b) for a, b in zip(got_tree, tree))
    assert not torch.equal(expected[:, 0], expected[:, -1])
