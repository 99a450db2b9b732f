"""A positive temperature of any size samples softmax(x / T), or its argmax limit where x / T
overflows (sampling.h's score_origin): through the loader, against the argmax and the ties.

Where the largest logit over T overflows (T down to the smallest subnormal, 2^-149, or logits
near FLT_MAX at T < 1), the scores are taken from that logit, (x - x_max) / T: the draw is
then uniform over the logits equal to x_max, every other one scoring below -2^100. Clamped
quotients would tie every logit whose x / T overflows at FLT_MAX, and the lowest index would
win: test_clamped_scores_would_draw_the_lowest_overflowed_index shows these rows would catch that.
"""

import math

import pytest
import torch

from op_cases import CHI_SQUARE_LIMIT, TIE_FILTERS, TIED, chi_square
from reference import pack_bitmask

SMALLEST_SUBNORMAL = 2.0**-149
TINY = [1e-30, 1e-38, 1e-44, SMALLEST_SUBNORMAL]  # 1e-30: x / T still finite (the control)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FILTERS = dict(TIE_FILTERS, top_k_1=dict(top_k=1), top_p_0=dict(top_p=0.0))
VOCAB = 300


def repeated(row: torch.Tensor, rows: int, offset: int = 0):
    """The row [1, V] repeated, each copy its own seed."""
    seed = torch.arange(rows, dtype=torch.int64) * 7919 + 11
    return row.expand(rows, -1), dict(seed=seed, offset=torch.full_like(seed, offset))


def random_row(dtype: torch.dtype, seed: int, negative: bool = False) -> torch.Tensor:
    """Logits of a unique maximum (ties below it allowed), NaN and -inf among them."""
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(1, VOCAB, generator=g) * 3).to(dtype)
    if negative:
        row = -row.abs() - 1
    row[0, [0, 77]] = math.nan
    row[0, [5, 150]] = -math.inf
    return row


def argmax_of(row: torch.Tensor) -> int:
    return int(torch.nan_to_num(row.float(), nan=-math.inf).argmax())


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_samples_the_argmax(lp, temperature, dtype, filters):
    for seed, negative in [(1, False), (2, True)]:
        row = random_row(dtype, seed, negative)
        logits, kwargs = repeated(row, 64)
        tokens = lp.sample(logits, temperature=temperature, **FILTERS[filters], **kwargs)
        assert bool((tokens == argmax_of(row)).all()), (negative, tokens.unique().tolist(), argmax_of(row))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_tiny_temperature_obeys_the_bitmask_and_penalties(lp, dtype):
    row = random_row(dtype, 3)
    best = argmax_of(row)
    allowed = torch.ones(1, VOCAB, dtype=torch.bool)
    allowed[0, best] = False  # the argmax forbidden: the best allowed one instead
    logits, kwargs = repeated(row, 32)
    masked = row.float().masked_fill(~allowed, -math.inf)
    tokens = lp.sample(logits, temperature=1e-40, bitmask=pack_bitmask(allowed.expand(32, -1)), **kwargs)
    assert bool((tokens == argmax_of(masked)).all())
    bias = lp.Penalties(prompt_mask=torch.zeros(32, (VOCAB + 31) // 32, dtype=torch.int32),
                        output_counts=torch.zeros(32, VOCAB, dtype=torch.int32), repetition_penalty=1.5,
                        logit_bias_ids=torch.tensor([[7]] * 32), logit_bias_values=torch.tensor([[1e4]] * 32))
    tokens = lp.sample(logits, temperature=1e-40, penalties=bias, **kwargs)
    assert bool((tokens == 7).all())


@pytest.mark.parametrize("filters", ["unfiltered", "top_k", "top_p", "all"])
@pytest.mark.parametrize("temperature", [1e-38, SMALLEST_SUBNORMAL])
def test_tiny_temperature_draws_ties_uniformly_with_their_logprobs(lp, temperature, filters):
    """Four equal maxima among random logits below them: each drawn about as often, each -ln 4."""
    g = torch.Generator().manual_seed(4)
    row = torch.rand(1, VOCAB, generator=g) * 18 - 10  # in [-10, 8)
    tied = [20, 100, 101, 290]
    row[0, tied] = 9.0
    logits, kwargs = repeated(row, 2000)
    tokens = lp.sample(logits, temperature=temperature, **FILTERS[filters], **kwargs)
    assert chi_square(tokens, tied) < CHI_SQUARE_LIMIT
    out = lp.sample_with_logprobs(logits[:64], temperature=temperature, num_logprobs=TIED + 1, **FILTERS[filters],
                                  seed=kwargs["seed"][:64], offset=kwargs["offset"][:64])
    assert torch.equal(out.tokens, tokens[:64])
    assert torch.allclose(out.logprobs[:, 0], torch.tensor(-math.log(TIED)), atol=1e-6)
    assert torch.allclose(out.logprobs[:, 1:TIED + 1], torch.tensor(-math.log(TIED)), atol=1e-6)
    assert torch.equal(out.logprob_token_ids[:, 1:TIED + 1], torch.tensor(tied).expand(64, -1))
    # The fifth most likely is far below (kept by no filter but the unfiltered row's).
    assert bool((out.logprobs[:, TIED + 1] < -1e30).all()), out.logprobs[0]
    assert torch.equal(out.ranks, torch.ones(64, dtype=out.ranks.dtype))
    given = lp.token_logprobs(logits[:64], out.tokens, temperature=temperature, **FILTERS[filters])
    assert torch.equal(given, out.logprobs[:, 0])


@pytest.mark.parametrize("filters", ["unfiltered", "top_k", "min_p"])
def test_huge_logits_at_moderate_temperatures_sample_the_argmax(lp, filters):
    """x / T overflows for every top logit at T = 0.5: 3e38 beats 2e38 and 1e38; +inf (the
    largest finite value) beats 3e38; and T = 1 (no overflow) still draws all of them."""
    row = torch.full((1, VOCAB), -1.0)
    row[0, [3, 60]] = 1e38
    row[0, [10, 200]] = 2e38
    row[0, 150] = 3e38
    logits, kwargs = repeated(row, 256)
    assert bool((lp.sample(logits, temperature=0.5, **FILTERS[filters], **kwargs) == 150).all())
    with_inf = row.clone()
    with_inf[0, [40, 250]] = math.inf
    tokens = lp.sample(with_inf.expand(2000, -1), temperature=0.5, **FILTERS[filters],
                       **repeated(with_inf, 2000)[1])
    assert set(tokens.tolist()) == {40, 250}
    assert abs(int((tokens == 40).sum()) - 1000) < 4 * math.sqrt(500)  # binomial(2000, 1/2): 4 sigma


def test_clamped_scores_would_draw_the_lowest_overflowed_index():
    """The rows above catch the clamp: at T = 1e-38 every logit above about 3.4 overflows, so
    clamped scores would tie them all and (lowest index on ties, no noise left) draw the
    first of them, not the argmax."""
    row = random_row(torch.float32, 1)[0]
    overflowed = (torch.nan_to_num(row, nan=-math.inf) / 1e-38).isinf() & (row > 0)
    first = int(overflowed.nonzero()[0])
    assert overflowed.sum() > 1 and first != argmax_of(row[None])


def test_support_logprobs_at_tiny_temperatures(lp):
    """token_logprobs(support=) takes its scores from the same origin: 0 for the support's
    argmax, below -1e30 for the others, entropy 0, finite gradients (zero for a point mass)."""
    row = random_row(torch.float32, 5)
    best = argmax_of(row)
    logits = row.expand(2, -1).clone().requires_grad_(True)
    support = torch.ones(2, VOCAB, dtype=torch.bool)
    tokens = torch.tensor([best, (best + 1) % VOCAB])
    logprobs, entropy = lp.token_logprobs(logits, tokens, temperature=1e-38, support=pack_bitmask(support),
                                         return_entropy=True)
    assert logprobs[0].item() == 0.0 and logprobs[1].item() < -1e30
    assert torch.equal(entropy.detach(), torch.zeros(2))
    logprobs[0].backward()
    assert bool(torch.isfinite(logits.grad).all()) and bool((logits.grad == 0).all())
