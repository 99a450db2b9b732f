"""The draw is exact in the far tail, and does not depend on the caller's floating-point mode.

Tail: one logit at 0 and N = 250,000 at -d, T = 1, no filter. A tail token wins with
probability N e^-d / (1 + N e^-d), which needs Gumbel noise above about d: the old 23-bit
uniform capped the noise at 16.6, drawing the tail far too rarely at d = 17 and 18 and never
at d = 20. The expected counts under that old noise are computed exactly here (its 2^23 levels
in float64) to show that the z-test rejects it.
"""

import math

import pytest
import torch

from harness import computed_flushing_denormals
from op_cases import check_top_cell_refined

N_TAIL = 250_000
# d -> draws: d = 18 carries most of the power per draw (see test_tail_test_rejects_the_old_noise).
TAIL_DRAWS = {17: 2000, 18: 10000, 20: 6000}
Z_LIMIT = 4.0


def tail_probability(d: float) -> float:
    mass = N_TAIL * math.exp(-d)
    return mass / (1 + mass)


def old_noise_tail_probability(d: float) -> float:
    """P(a tail token wins) under the old noise, exactly: U = (2k + 1) / 2^24, k < 2^23, so
    G takes 2^23 equally likely values, and the tail wins iff the largest of its N values
    exceeds G_0 + d."""
    k = torch.arange(2**23, dtype=torch.float64)
    levels = -torch.log(-torch.log((2 * k + 1) / 2**24))  # increasing in k
    cdf_at = torch.searchsorted(levels, levels + d, right=True).double() / 2**23
    return 1 - (cdf_at**N_TAIL).mean().item()


def z_score(count: int, draws: int, p: float) -> float:
    return (count - draws * p) / math.sqrt(draws * p * (1 - p))


def tail_row(d: float) -> torch.Tensor:
    row = torch.full((1, N_TAIL + 1), -float(d))
    row[0, 0] = 0.0
    return row


@pytest.mark.no_sanitize("18,000 rows of 250,001 logits: 380 s under ASan; the same draw runs in the sampler tests")
@pytest.mark.parametrize("d", list(TAIL_DRAWS))
def test_far_tail_is_drawn_in_proportion(lp, d):
    draws = TAIL_DRAWS[d]
    # One row repeated without copying it (row stride 0): each row of the batch its own stream.
    tokens = lp.sample(tail_row(d).expand(draws, -1), seed=1000 + d)
    tail = int((tokens > 0).sum())
    assert int((tokens < 0).sum()) == 0
    z = z_score(tail, draws, tail_probability(d))
    print(f"d={d}: {tail} tail draws of {draws}, expected {draws * tail_probability(d):.1f}, z = {z:+.2f}")
    assert abs(z) < Z_LIMIT


def test_tail_test_rejects_the_old_noise():
    """The power of the test above: with the old noise's probabilities, the expected count
    lies far outside the accepted band at d = 18, and a tail draw at d = 20 is impossible
    (d = 20's own count, about 3 expected, is too small to reject zero on its own)."""
    expected_old = {d: TAIL_DRAWS[d] * old_noise_tail_probability(d) for d in TAIL_DRAWS}
    assert abs(old_noise_tail_probability(18) - 5.9e-4) < 0.1e-4  # the figure
    assert z_score(round(expected_old[18]), TAIL_DRAWS[18], tail_probability(18)) < -(Z_LIMIT + 1)
    assert expected_old[20] == 0.0


# --- the top cell (tests/op_cases.py: Philox in Python, the case and its check) ------------------

def test_top_cell_is_refined(lp):
    check_top_cell_refined(lp, "cpu")


# --- floating-point mode --------------------------------------------------------------------

def subnormal_rows(g: torch.Generator) -> torch.Tensor:
    """Rows whose order, scores or keys change if subnormals are flushed: logits that are
    subnormal themselves, and normal ones that become subnormal at a large temperature."""
    tiny = torch.randint(-40, 40, (24, 300), generator=g).float() * 1e-40
    tiny[:, ::7] = 0.0
    small = torch.randn(24, 300, generator=g) * 1e-8
    return torch.cat([tiny, small])


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_k=1), dict(top_k=5), dict(top_p=0.5),
                                    dict(temperature=1e-30), dict(temperature=1e30, top_k=3), dict(min_p=0.9)])
def test_tokens_do_not_depend_on_flush_denormal(lp, kwargs):
    g = torch.Generator().manual_seed(7)
    logits = subnormal_rows(g)
    # One row a call: a 1-row call runs on the calling thread, whose mode set_flush_denormal sets.
    def tokens():
        return torch.cat([lp.sample(row[None], seed=3, offset=b, **kwargs) for b, row in enumerate(logits)])

    assert torch.equal(tokens(), computed_flushing_denormals(tokens))
