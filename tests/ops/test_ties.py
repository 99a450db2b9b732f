"""Equal logits are drawn uniformly at any magnitude (sampling.h's draw origin).

Four equal top logits at 0, 255, 256, 1e6, 1e30, 3e38, +inf (the largest finite value) and
-1e30, the rest of the row far below (with NaN and -inf), without and with filters that keep
exactly the four: drawn uniformly over many seeds (a chi-square), and sample_with_logprobs
gives each -ln 4. Before the origin moved to s_max, s + G rounded to s for |s| >= 2^24 and
the lowest tied index won every draw: test_chi_square_rejects_the_lowest_index shows the
limit rejects that.
"""

import math

import pytest
import torch

from op_cases import CHI_SQUARE_LIMIT, TIE_FILTERS, TIE_VALUES, TIED, chi_square, tie_dtypes, tie_row

DRAWS = 2000
VOCAB = 40
CASES = [pytest.param(value, dtype, id=f"{value}-{str(dtype)[6:]}") for value in TIE_VALUES
         for dtype in tie_dtypes(value)]


def draws(lp, row: torch.Tensor, temperature: float, filters: dict, rows: int = DRAWS):
    """The row repeated (row stride 0), each copy its own seed."""
    seed = torch.arange(rows, dtype=torch.int64) * 7919 + 11
    return row.expand(rows, -1), dict(filters, temperature=temperature, seed=seed, offset=torch.zeros_like(seed))


@pytest.mark.parametrize("filters", list(TIE_FILTERS))
@pytest.mark.parametrize("value,dtype", CASES)
def test_ties_are_drawn_uniformly(lp, value, dtype, filters):
    row, tied = tie_row(value, VOCAB, dtype)
    for temperature in [1.0, 0.7]:
        logits, kwargs = draws(lp, row, temperature, TIE_FILTERS[filters])
        tokens = lp.sample(logits, **kwargs)
        statistic = chi_square(tokens, tied)
        print(f"{value} {dtype} {filters} T={temperature}: chi-square {statistic:.2f}")
        assert statistic < CHI_SQUARE_LIMIT, (temperature, statistic)


@pytest.mark.parametrize("filters", ["unfiltered", "top_p", "all"])
@pytest.mark.parametrize("value,dtype", CASES)
def test_ties_have_the_logprob_of_the_draw(lp, value, dtype, filters):
    """Column 0 (the drawn token's) and the top-4 columns are -ln 4, the tokens those of sample."""
    row, tied = tie_row(value, VOCAB, dtype)
    logits, kwargs = draws(lp, row, 1.0, TIE_FILTERS[filters], rows=64)
    out = lp.sample_with_logprobs(logits, num_logprobs=TIED, **kwargs)
    assert torch.equal(out.tokens, lp.sample(logits, **kwargs))
    expected = torch.tensor(-math.log(TIED), dtype=torch.float32)
    assert torch.allclose(out.logprobs, expected.expand_as(out.logprobs), rtol=0, atol=1e-6), out.logprobs[0]
    assert torch.equal(out.logprob_token_ids[:, 1:], torch.tensor(tied).expand(64, -1))
    given = lp.token_logprobs(logits, out.tokens, **{k: v for k, v in kwargs.items() if k not in ("seed", "offset")})
    assert torch.equal(given, out.logprobs[:, 0])


def test_chi_square_rejects_the_lowest_index():
    """The limit's power: the old draw (the lowest tied index every time) lies far above it,
    and so would a draw that only ever picks two of the four."""
    tied = [4, 13, 21, 37]
    assert chi_square(torch.full((DRAWS,), tied[0]), tied) > 100 * CHI_SQUARE_LIMIT
    assert chi_square(torch.tensor(tied[:2]).repeat(DRAWS // 2), tied) > 50 * CHI_SQUARE_LIMIT


def test_moderate_ties_draw_as_before(lp):
    """From 2^8 on, the draw is taken from the top score: rows with the same integer gaps
    (exact at both magnitudes) draw the same tokens at 256 and at 2^20, and with top-k at 512
    and 2^22, where s + G would have lost most of the noise's bits."""
    g = torch.Generator().manual_seed(5)
    gaps = torch.randint(0, 8, (1, 300), generator=g).float()  # integers: exact at both magnitudes
    logits, kwargs = draws(lp, gaps, 1.0, {}, rows=500)
    assert torch.equal(lp.sample(logits + 256.0, **kwargs), lp.sample(logits + 2.0**20, **kwargs))
    assert torch.equal(lp.sample(logits + 512.0, top_k=20, **kwargs), lp.sample(logits + 2.0**22, top_k=20, **kwargs))
