"""The truncation samplers decided on the whole row once its top is known: epsilon_cutoff and
eta_cutoff keep the tokens with p >= a floor (epsilon itself, or eta's min(eta, sqrt(eta) e^-H), H
the row's entropy), top_n_sigma the logits within n standard deviations of the top; the most
likely always.

Against transformers' own EpsilonLogitsWarper and EtaLogitsWarper (on the float32 scores x / T)
and a float64 top-n-sigma written from llama.cpp's definition (reference.py's sigma_threshold),
on random rows, with the floor or threshold between two of a row's values so that float rounding
cannot decide; the exhaustive check that makes the kernels' binary search for the floor's key
exact (token_mass monotone in the score); a chi-square of `sample`'s draws against
`filtered_probs`; the edge cases (ties at the top, a floor of 1, one candidate, per-row values
that disable them, masked tokens outside sigma, the cap on a distance). Their composition with
the other filters, in both orders, is in test_filtered.py (FILTERS); CPU = emulated CUDA in
tests/cuda_emulation/.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT
from harness import bits
from reference import SIGMA_CAP, entropy, random_bitmask, sigma_threshold, truncation_floor, unpack_bitmask

# Every float x in [-87.3, -0.0] (below, lp_exp_nonpositive's select gives 0): e^x must never
# grow as x falls. The same loop over a deliberately non-monotone copy must find violations,
# or the check could not fail.
MONOTONE_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include "logits_processor/fast_math.h"
using namespace logits_processor;

template <typename Exp>
static uint64_t violations(Exp exp, uint32_t first, uint32_t last) {
  uint64_t count = 0;
  float previous = exp(bits_float(first));
  for (uint32_t b = first + 1; b <= last; ++b) {
    const float e = exp(bits_float(b));
    count += e > previous;
    previous = e;
  }
  return count;
}

int main() {
  const uint64_t real = violations([](float x) { return lp_exp_nonpositive(x); }, 0x80000000u, float_bits(-87.3f));
  // (16 ulps up at every 4096th float: a polynomial's wobble; over 2^22 floats from -2)
  const uint64_t planted = violations([](float x) {
    const float e = lp_exp_nonpositive(x);
    return (float_bits(x) & 4095u) == 0 ? bits_float(float_bits(e) + 16) : e;
  }, float_bits(-2.0f), float_bits(-2.0f) + (1u << 22));
  const float below = lp_exp_nonpositive(-87.30001f);
  std::printf("%llu %llu %g\n", (unsigned long long)real, (unsigned long long)planted, below);
  return 0;
}
"""


@pytest.mark.no_sanitize("compiles and runs a program of its own, which ASan does not instrument")
def test_token_mass_is_monotone_in_the_score(tmp_path):
    """sampling.h's epsilon_key finds t_eps by a binary search over the keys, exact only if
    token_mass(s, s_max) = floor(2^32 e^(s - s_max)) never falls as s rises: s - s_max is one
    IEEE subtraction (monotone), the scaling by 2^32 exact, so lp_exp_nonpositive is checked
    here over every float it is given."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source, program = tmp_path / "monotone.cpp", tmp_path / "monotone"
    source.write_text(MONOTONE_CHECK)
    # (the CPU build's float flags: no contraction into fma, as build.toml sets)
    subprocess.run([compiler, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{ROOT}", str(source), "-o",
                    str(program)], check=True)
    real, planted, below = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout.split()
    assert int(planted) > 0, "the check cannot see a violation"
    assert int(real) == 0, f"lp_exp_nonpositive grows as x falls at {real} floats"
    assert float(below) == 0.0


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float64 softmax of the float32 scores x / T, as the kernels score them."""
    return torch.softmax((logits / temperature).double(), -1)


def between_two_probabilities(p: torch.Tensor, g: torch.Generator, low: float = 1e-6, high: float = 0.2) -> float:
    """A floor halfway (geometrically) between two of the row's probabilities at least 1e-3
    apart relatively, in [low, high]: no token's p lies within float rounding of it."""
    values = torch.sort(p, descending=True).values
    ratio = values[:-1] / values[1:]
    fit = ((ratio > 1.001) & (values[1:] > low) & (values[:-1] < high)).nonzero()[:, 0]
    fit = fit[fit > 0]  # (below the top two: more than one token kept)
    if len(fit) == 0:
        raise IndexError("no two probabilities far enough apart in the window")
    i = int(fit[torch.randint(len(fit), (1,), generator=g)])
    return math.sqrt(float(values[i]) * float(values[i + 1]))


def assert_rows_match(ours: torch.Tensor, logits: torch.Tensor, temperature: float, warpers: list) -> None:
    """Row b of `ours` (filtered_probs) is warpers[b]'s softmax of the row's float32 scores x / T:
    the same kept set, probabilities within 2e-6."""
    for b, warper in enumerate(warpers):
        theirs = warper(None, (logits[b:b + 1] / temperature).double()).softmax(-1)[0]
        assert torch.equal(ours[b] > 0, theirs > 0), b
        assert torch.allclose(ours[b], theirs, rtol=2e-6, atol=0), b


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_matches_transformers_epsilon_warper(lp, scale):
    from transformers.generation.logits_process import EpsilonLogitsWarper

    g = torch.Generator().manual_seed(int(400 + scale))
    rows, vocab, temperature = 24, 4000, 0.8
    logits = torch.randn(rows, vocab, generator=g) * scale
    p = probabilities(logits, temperature)
    epsilon = torch.tensor([between_two_probabilities(p[b], g) for b in range(rows)])
    ours = lp.filtered_probs(logits, temperature=temperature, epsilon_cutoff=epsilon).double()
    assert_rows_match(ours, logits, temperature, [EpsilonLogitsWarper(float(e)) for e in epsilon])
    assert ((ours > 0).sum(-1) > 1).all() and ((ours > 0).sum(-1) < vocab).all()  # (each row cut, not to one)


def eta_for_floor(p: torch.Tensor, g: torch.Generator, entropy_side: bool) -> float:
    """An eta whose floor min(eta, sqrt(eta) e^-H) lies between two of the row's probabilities:
    on the entropy's side, eta = (floor e^H)^2 for a floor in (e^-2H, e^-H) (then eta > floor);
    else eta itself, a floor below e^-2H (then sqrt(eta) e^-H >= eta). The other side where the
    row has no room for the one asked for."""
    h = entropy(p)
    for side in (entropy_side, not entropy_side):
        if side:
            low, high = max(1e-6, 1.01 * math.exp(-2 * h)), 0.99 * math.exp(-h)
        else:
            low, high = 1e-6, 0.99 * math.exp(-2 * h)
        try:
            floor = between_two_probabilities(p, g, low, min(high, 0.2))
        except IndexError:
            continue
        return (floor * math.exp(h)) ** 2 if side else floor
    raise AssertionError("no room for an eta floor in this row")


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_matches_transformers_eta_warper(lp, scale):
    """eta between two probabilities on either side of its min (odd rows: eta itself), against
    EtaLogitsWarper; and with epsilon_cutoff too, the larger of the two floors."""
    from transformers.generation.logits_process import EtaLogitsWarper

    g = torch.Generator().manual_seed(int(420 + scale))
    rows, vocab, temperature = 24, 4000, 0.8
    logits = torch.randn(rows, vocab, generator=g) * scale
    p = probabilities(logits, temperature)
    eta = torch.tensor([eta_for_floor(p[b], g, b % 2 == 0) for b in range(rows)])
    ours = lp.filtered_probs(logits, temperature=temperature, eta_cutoff=eta).double()
    assert_rows_match(ours, logits, temperature, [EtaLogitsWarper(float(e)) for e in eta])
    kept = ours > 0
    assert ((kept.sum(-1) > 1) & (kept.sum(-1) < vocab)).float().mean() > 0.8  # (cut, not to one token)
    floors = torch.tensor([truncation_floor(p[b], 0.0, float(eta[b])) for b in range(rows)])
    sides = floors < eta  # the entropy's side
    assert sides.any() and (not sides.all() or scale == 1.0)  # (scale 1: H ~ 8, no room below e^-2H)
    # epsilon at half eta's floor changes nothing; at twice it, epsilon decides.
    assert torch.equal(lp.filtered_logits(logits, temperature=temperature, eta_cutoff=eta,
                                          epsilon_cutoff=floors * 0.5) > -math.inf, kept)
    higher = lp.filtered_logits(logits, temperature=temperature, eta_cutoff=eta, epsilon_cutoff=floors * 2)
    alone = lp.filtered_logits(logits, temperature=temperature, epsilon_cutoff=floors * 2)
    assert torch.equal(bits(higher), bits(alone))


def test_the_top_is_always_kept(lp):
    """epsilon above every p keeps the most likely token (all of them on a tie), as transformers'
    min_tokens_to_keep=1 does; epsilon 1 likewise; 0 (per row too) disables the filter."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(410))
    logits[1, [7, 200]] = 9.0  # a tie at the top
    logits[2] = 0.25  # every token tied
    logits[3] = float("-inf")
    logits[3, 42] = -5.0  # one candidate
    for floor in (dict(epsilon_cutoff=0.9), dict(epsilon_cutoff=1.0), dict(eta_cutoff=1.0, epsilon_cutoff=0.5)):
        kept = lp.filtered_logits(logits, **floor) > -math.inf
        assert torch.equal(kept[0].nonzero()[:, 0], logits[0].argmax().view(1))
        assert torch.equal(kept[1].nonzero()[:, 0], torch.tensor([7, 200]))
        assert kept[2].all()
        assert torch.equal(kept[3].nonzero()[:, 0], torch.tensor([42]))
    per_row = torch.tensor([0.0, 0.9, 0.9, 0.9, 0.0])
    for name in ("epsilon_cutoff", "eta_cutoff"):
        assert torch.equal(bits(lp.filtered_probs(logits, **{name: per_row})[[0, 4]]),
                           bits(lp.filtered_probs(logits[[0, 4]])))
    tokens = lp.sample(logits, epsilon_cutoff=1.0, seed=3)
    assert torch.equal(tokens[[0, 3]], torch.tensor([int(logits[0].argmax()), 42]))


@pytest.mark.parametrize("floor", [dict(epsilon_cutoff=0.02), dict(eta_cutoff=0.3), dict(top_n_sigma=1.0)])
def test_sample_draws_from_filtered_probs(lp, floor):
    """A million draws of `sample` against filtered_probs: a chi-square, which the same kept set
    at another temperature (1 instead of 0.9) fails."""
    rows, vocab = 1 << 20, 16
    row = torch.linspace(-3, 3, vocab).view(1, vocab)
    kwargs = dict(temperature=0.9, **floor)
    p = lp.filtered_probs(row, **kwargs)[0].double()
    tokens = lp.sample(row.expand(rows, vocab).contiguous(), **kwargs, seed=17)
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = p > 0
    assert 3 < int(kept.sum()) < vocab and counts[~kept].sum() == 0

    def chi2(probs):
        expected = probs[kept] / probs[kept].sum() * rows
        return float(((counts[kept] - expected) ** 2 / expected).sum())

    dof = int(kept.sum()) - 1
    bound = dof + 8 * math.sqrt(2 * dof)  # beyond 8 sigma: a real bias
    assert chi2(p) < bound, (chi2(p), dof)
    assert chi2(probabilities(row[0], 1.0)) > 10 * bound


# --- top_n_sigma ------------------------------------------------------------------------------

def sigma_between_two_logits(x: torch.Tensor, candidates: torch.Tensor, g: torch.Generator) -> float:
    """An n whose threshold x_max - n sigma (sigma_threshold's, in float64) lies halfway between
    two of the row's candidate logits at least 1e-3 apart, below the top two and within 4 sigma:
    no logit lies within float rounding of it."""
    xs = x[candidates].double()
    top = xs.max()
    sigma = float((top - xs).clamp(max=SIGMA_CAP).std(unbiased=False))
    values = torch.sort(xs.unique(), descending=True).values
    middle = (values[:-1] + values[1:]) / 2
    fit = (((values[:-1] - values[1:]) > 1e-3) & (top - middle < 4 * sigma)).nonzero()[:, 0]
    fit = fit[fit > 0]
    i = int(fit[torch.randint(len(fit), (1,), generator=g)])
    return float(top - middle[i]) / sigma


def sigma_rows(rows: int, vocab: int, scale: float, g: torch.Generator):
    """Random logits with NaN and -inf columns, a random bitmask, and each row's n between two of
    its candidates' logits (sigma_between_two_logits)."""
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
    logits[torch.rand(rows, vocab, generator=g) < 0.01] = float("-inf")
    bitmask = random_bitmask(rows, vocab, g, "words")
    candidates = unpack_bitmask(bitmask, vocab) & (logits > float("-inf"))
    n = torch.tensor([sigma_between_two_logits(logits[b], candidates[b], g) for b in range(rows)])
    return logits, bitmask, candidates, n


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_top_n_sigma_matches_its_definition(lp, scale):
    """The kept set is {x >= x_max - n sigma} over the allowed, finite logits (llama.cpp's
    top_n_sigma, masked and -inf tokens outside sigma), whatever the temperature; greedy rows
    take the argmax."""
    g = torch.Generator().manual_seed(int(440 + scale))
    rows, vocab = 24, 4000
    logits, bitmask, candidates, n = sigma_rows(rows, vocab, scale, g)
    expected = torch.stack([candidates[b] & (logits[b].double() >= sigma_threshold(logits[b], candidates[b], float(n[b])))
                            for b in range(rows)])
    assert ((expected.sum(-1) > 1) & (expected.sum(-1) < candidates.sum(-1))).all()  # (each row cut)
    for temperature in (0.3, 1.0, torch.rand(rows, generator=g) * 2 + 0.2):
        kept = lp.filtered_logits(logits, temperature=temperature, top_n_sigma=n, bitmask=bitmask) > -math.inf
        assert torch.equal(kept, expected)
    greedy = lp.sample(logits, temperature=0.0, top_n_sigma=n, bitmask=bitmask)
    assert torch.equal(greedy, lp.sample(logits, temperature=0.0, bitmask=bitmask))


def test_top_n_sigma_leaves_masked_tokens_out(lp):
    """A row with masked, NaN and -inf tokens keeps what the row of its candidates alone keeps:
    they are outside sigma, not counted as far below."""
    g = torch.Generator().manual_seed(450)
    logits, bitmask, candidates, n = sigma_rows(8, 3000, 3.0, g)
    kept = lp.filtered_logits(logits, top_n_sigma=n, bitmask=bitmask) > -math.inf
    for b in range(8):
        alone = lp.filtered_logits(logits[b][candidates[b]].view(1, -1), top_n_sigma=float(n[b])) > -math.inf
        assert torch.equal(kept[b][candidates[b]], alone[0]), b
        assert not kept[b][~candidates[b]].any()


def test_top_n_sigma_caps_distances(lp):
    """A candidate more than SIGMA_CAP logits below the top counts as SIGMA_CAP below (sampling.h's
    kSigmaCap): half a row biased down by 1e5 keeps the set of the capped definition, which is not
    llama.cpp's uncapped one there."""
    g = torch.Generator().manual_seed(460)
    logits = torch.randn(1, 2000, generator=g) * 3
    logits[0, 1000:] -= 1e5
    candidates = torch.ones_like(logits, dtype=torch.bool)
    n = sigma_between_two_logits(logits[0], candidates[0], g)
    kept = lp.filtered_logits(logits, top_n_sigma=n) > -math.inf
    capped = logits[0].double() >= sigma_threshold(logits[0], candidates[0], n)
    assert torch.equal(kept[0], capped) and 1 < int(capped.sum()) < 1000
    x = logits[0].double()
    uncapped = x >= x.max() - n * x.std(unbiased=False)  # (sigma about 5e4, not 1.6e4)
    assert int(uncapped.sum()) > 2 * int(capped.sum())


def test_top_n_sigma_edge_rows(lp):
    """Ties at the top all kept; every token tied (sigma 0) all kept; one candidate; a row with
    nothing allowed samples -1; n <= 0, NaN (per row) disable it, +inf keeps every candidate."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(470))
    logits[1, [7, 200]] = 9.0
    logits[2] = 0.25
    logits[3] = float("-inf")
    logits[3, 42] = -5.0
    logits[4] = float("nan")
    kept = lp.filtered_logits(logits, top_n_sigma=1e-6) > -math.inf
    assert torch.equal(kept[0].nonzero()[:, 0], logits[0].argmax().view(1))
    assert torch.equal(kept[1].nonzero()[:, 0], torch.tensor([7, 200]))
    assert kept[2].all()
    assert torch.equal(kept[3].nonzero()[:, 0], torch.tensor([42]))
    assert not kept[4].any()
    assert lp.sample(logits, top_n_sigma=1.0, seed=5)[4] == -1
    unfiltered = lp.filtered_probs(logits)
    for off in (0.0, -1.0, float("nan")):
        assert torch.equal(bits(lp.filtered_probs(logits, top_n_sigma=torch.full((5,), off))), bits(unfiltered))
    assert torch.equal(bits(lp.filtered_probs(logits, top_n_sigma=math.inf)), bits(unfiltered))
