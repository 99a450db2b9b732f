"""Ties at any magnitude (tests/ops/test_ties.py) in the emulated CUDA kernels: the CPU's
tokens, bit for bit, with one block per row, with rows split over blocks (132 SMs, few rows,
V > 16384: the unfiltered rows whose s_max is 2^8 or more from 0 drawn a second time by the
second kernel, the filtered ones taking the origin from the cut), and the CPU's
log-probabilities. The CPU's draws are uniform over the ties (test_ties.py); here the
emulated draws are checked to be the same, and uniform themselves where there are enough.
"""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES, logprobs_agree_with_cpu, sample_agrees_with_cpu
from op_cases import CHI_SQUARE_LIMIT, TIE_FILTERS, TIE_VALUES, chi_square, tie_dtypes, tie_row

# (Sanitized builds: one case on each side of the origin's threshold, and +inf, in the three
# dtypes; +inf saturates s_max, which sends split rows to one block: 256 in float16 too, whose
# split rows are drawn again over their chunks.)
SMALL_TIE_CASES = {("256", torch.float32), ("1e30", torch.bfloat16), ("inf", torch.float16), ("256", torch.float16)}
CASES = [pytest.param(value, dtype, id=f"{value}-{str(dtype)[6:]}") for value in TIE_VALUES
         for dtype in tie_dtypes(value) if not SMALL_CASES or (value, dtype) in SMALL_TIE_CASES]
FILTERS = ["unfiltered", "top_k", "top_p", "top_k_first"] if SMALL_CASES else list(TIE_FILTERS)
# (rows, vocab, SMs): one block per row (more rows than blocks at 8 SMs), and split rows.
WHOLE = (48, 300, 8) if SMALL_CASES else (200, 300, 8)
SPLIT = (2, 33000, 132) if SMALL_CASES else (6, 40000, 132)


def tie_batch(value, dtype, rows, vocab, offset=0):
    row, tied = tie_row(value, vocab, dtype)
    seed = torch.arange(rows, dtype=torch.int64) * 7919 + 11
    return row.expand(rows, -1).contiguous(), tied, dict(seed=seed, offset=torch.full_like(seed, offset))


@pytest.mark.emulation
@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("value,dtype", CASES)
def test_ties_agree_with_cpu(emulation, lp_cpu, value, dtype, filters):
    rows, vocab, sms = WHOLE
    logits, tied, kwargs = tie_batch(value, dtype, rows, vocab)
    got = sample_agrees_with_cpu(emulation, lp_cpu, sms, logits, **kwargs, **TIE_FILTERS[filters])
    if not SMALL_CASES:
        assert chi_square(got, tied) < CHI_SQUARE_LIMIT


@pytest.mark.emulation
@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("value,dtype", CASES)
def test_ties_split_over_blocks_agree_with_cpu(emulation, lp_cpu, value, dtype, filters):
    rows, vocab, sms = SPLIT
    for offset in range(2 if SMALL_CASES else 4):  # 6 rows x 4 offsets: 24 draws of the tie
        logits, tied, kwargs = tie_batch(value, dtype, rows, vocab, offset)
        kwargs |= TIE_FILTERS[filters]
        expected = lp_cpu.sample(logits, **kwargs)
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits, **kwargs)
        assert torch.equal(got, expected), (offset, (got != expected).nonzero().flatten().tolist())
        assert bool(torch.isin(got, torch.tensor(tied)).all())


@pytest.mark.emulation
@pytest.mark.parametrize("filters", ["unfiltered", "top_p", "all"])
@pytest.mark.parametrize("value,dtype", CASES)
def test_tie_logprobs_agree_with_cpu(emulation, lp_cpu, value, dtype, filters):
    logits, tied, kwargs = tie_batch(value, dtype, 32, 300)
    logprobs_agree_with_cpu(emulation, lp_cpu, 8, logits, num_logprobs=4, **kwargs, **TIE_FILTERS[filters])
