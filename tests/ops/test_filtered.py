"""filtered_probs and filtered_logits: the distribution `sample` draws from, as a tensor.

Against independent references: the float64 sort-based kept sets of tests/reference.py (the
intersection, and vLLM's torch chain for "top_k_first"), transformers' own warpers
(TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper; EpsilonLogitsWarper in
test_truncation.py), the draw itself (the kept set of
`sample_with_logprobs(return_kept=)`, and a chi-square over a million draws of `sample`), the
penalties applied first by `apply_penalties_`; and the edge cases (ties, -0.0, NaN, +-inf, rows
with nothing allowed, one token left, tiny temperatures).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import bits
from op_cases import random_bias, random_state, zero_top_logits
from reference import random_bitmask, sampling_reference, unpack_bitmask, vllm_sampling_reference

FILTERS = {
    "unfiltered": dict(),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "top_k_top_p": dict(top_k=40, top_p=0.9),
    "all": dict(top_k=50, top_p=0.9, min_p=0.02),
    "epsilon": dict(epsilon_cutoff=3e-4),
    "epsilon_all": dict(top_k=50, top_p=0.95, min_p=0.002, epsilon_cutoff=3e-3),
    "eta": dict(eta_cutoff=2e-3),
    "eta_all": dict(top_k=50, top_p=0.95, min_p=0.002, eta_cutoff=0.1),
    "top_n_sigma": dict(top_n_sigma=1.5),
    "top_n_sigma_all": dict(top_k=50, top_p=0.95, min_p=0.002, top_n_sigma=2.5),
}
ORDERS = ["joint", "top_k_first"]


def reference_probs(logits, order, slack=0.0, **kwargs):
    if order == "joint":
        return sampling_reference(logits, slack=slack, **kwargs)
    return vllm_sampling_reference(logits, **kwargs)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(FILTERS))
def test_probs_match_float64_reference(lp, order, name):
    g = torch.Generator().manual_seed(300 + len(name))
    logits = torch.randn(64, 3000, generator=g) * 3
    kwargs = dict(FILTERS[name], temperature=0.8)
    got = lp.filtered_probs(logits, **kwargs, filter_apply_order=order).double()
    ref = reference_probs(logits, order, **kwargs)
    # Rows whose kept set a relative 1e-4 at the top-p and min-p cutoffs does not change.
    loose = reference_probs(logits, order, slack=1e-4, **kwargs) if order == "joint" else ref
    good = ((ref > 0) == (loose > 0)).all(-1)
    assert good.float().mean() >= 0.8, f"only {int(good.sum())} rows unambiguous"
    assert torch.equal(got[good] > 0, ref[good] > 0)
    assert torch.allclose(got[good], ref[good], rtol=2e-6, atol=0)
    assert torch.allclose(got.sum(-1), torch.ones(64, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(FILTERS))
def test_kept_set_is_the_draws(lp, order, name):
    """The tokens with p > 0 and the finite scores are the kept set the draw reports, and each
    kept token's log p is its log-probability; greedy rows are one-hot at sample's token."""
    g = torch.Generator().manual_seed(310 + len(name))
    rows, vocab = 40, 2000
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[::7, :300] = 1.5  # ties at the cutoffs
    kwargs = dict(FILTERS[name], temperature=torch.rand(rows, generator=g) + 0.3,
                  bitmask=random_bitmask(rows, vocab, g, "mixed"), filter_apply_order=order)
    kwargs["temperature"][::5] = 0.0
    probs = lp.filtered_probs(logits, **kwargs)
    scores = lp.filtered_logits(logits, **kwargs)
    drawn, kept = lp.sample_with_logprobs(logits, **kwargs, seed=1, num_logprobs=0, return_kept=1)
    allowed = unpack_bitmask(kept.bitmask, vocab)
    assert torch.equal(probs > 0, allowed)
    assert torch.equal(scores > -math.inf, allowed)
    greedy = kwargs["temperature"] == 0
    assert torch.equal(probs[greedy], torch.nn.functional.one_hot(drawn.tokens[greedy], vocab).float())
    assert torch.equal(scores[greedy].argmax(-1), drawn.tokens[greedy])
    sampled = ~greedy
    taken = probs[sampled].gather(1, drawn.tokens[sampled, None])[:, 0]
    assert torch.allclose(taken.log(), drawn.logprobs[sampled, 0], atol=2e-6)


@pytest.mark.parametrize("order", ORDERS)
def test_logits_are_the_scores_and_softmax_to_the_probs(lp, order):
    g = torch.Generator().manual_seed(320)
    rows, vocab = 16, 5000
    logits = torch.randn(rows, vocab, generator=g) * 4
    temperature = torch.rand(rows, generator=g) + 0.2
    kwargs = dict(temperature=temperature, top_k=100, top_p=0.95, min_p=0.01, filter_apply_order=order)
    scores = lp.filtered_logits(logits, **kwargs)
    kept = scores > -math.inf
    quotient = logits / temperature[:, None]  # float32 IEEE division, as the kernels divide
    assert torch.equal(bits(scores[kept]), bits(quotient[kept]))
    probs = lp.filtered_probs(logits, **kwargs)
    assert torch.allclose(torch.softmax(scores.double(), -1), probs.double(), rtol=2e-6, atol=1e-30)


TRANSFORMERS_CHAINS = {
    "top_k": dict(top_k=25),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.1),
    "top_k_top_p": dict(top_k=60, top_p=0.8),
}


@pytest.mark.parametrize("name", list(TRANSFORMERS_CHAINS))
def test_agrees_with_transformers_warpers(lp, name):
    """transformers chains temperature, top-k, top-p, then min-p, each on the previous one's
    output (top-p renormalised over what top-k left): filter_apply_order="top_k_first"'s
    kept set. (With min-p and top-p together the orders differ: transformers applies top-p before
    min-p, vLLM's order after; docs/semantics-sampling.md.)"""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(330 + len(name))
    rows, vocab = 32, 4000
    logits = torch.randn(rows, vocab, generator=g) * 3
    kwargs = dict(TRANSFORMERS_CHAINS[name], temperature=0.7)
    chain = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    if "top_k" in kwargs:
        chain.append(TopKLogitsWarper(kwargs["top_k"]))
    if "top_p" in kwargs:
        chain.append(TopPLogitsWarper(kwargs["top_p"]))
    if "min_p" in kwargs:
        chain.append(MinPLogitsWarper(kwargs["min_p"]))
    theirs = chain(torch.zeros(rows, 1, dtype=torch.long), logits.double()).softmax(-1)
    ours = lp.filtered_probs(logits, **kwargs, filter_apply_order="top_k_first").double()
    # transformers' top-p compares a float cumulative sum with 1 - top_p: a token at the boundary
    # may fall either way; every other row has the same kept set.
    same = ((theirs > 0) == (ours > 0)).all(-1)
    assert same.float().mean() >= 0.9, f"{int((~same).sum())} rows differ"
    assert torch.allclose(ours[same], theirs[same], rtol=2e-6, atol=1e-30)


def test_penalties_as_apply_penalties_leaves_them(lp):
    g = torch.Generator().manual_seed(340)
    rows, vocab = 6, 3001
    logits = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    prompt_mask, counts = random_state(rows, vocab, g)
    penalty = dict(repetition_penalty=torch.rand(rows, generator=g) + 0.8, frequency_penalty=0.3,
                   presence_penalty=torch.rand(rows, generator=g) - 0.5, **random_bias(rows, vocab, g))
    kwargs = dict(temperature=0.9, top_k=50, top_p=0.9)
    penalised = logits.clone()
    lp.apply_penalties_(penalised, prompt_mask, counts, **penalty)
    for output in ("filtered_probs", "filtered_logits"):
        fused = getattr(lp, output)(logits, **kwargs, penalties=lp.Penalties(prompt_mask, counts, **penalty))
        assert torch.equal(bits(fused), bits(getattr(lp, output)(penalised, **kwargs))), output


def test_sample_draws_from_filtered_probs(lp):
    """A million draws of `sample` (one stream per row) against filtered_probs: a chi-square,
    which the same kept set at another temperature (1 instead of 0.9) fails."""
    rows, vocab = 1 << 20, 12
    g = torch.Generator().manual_seed(350)
    row = torch.randn(1, vocab, generator=g)
    kwargs = dict(temperature=0.9, top_k=9, top_p=0.95, min_p=0.02)
    p = lp.filtered_probs(row, **kwargs)[0].double()
    tokens = lp.sample(row.expand(rows, vocab).contiguous(), **kwargs, seed=12)
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = p > 0
    assert counts[~kept].sum() == 0

    def chi2(probs):
        expected = probs[kept] / probs[kept].sum() * rows
        return float(((counts[kept] - expected) ** 2 / expected).sum())

    dof = int(kept.sum()) - 1
    bound = dof + 8 * math.sqrt(2 * dof)  # beyond 8 sigma: a real bias
    assert dof >= 5 and chi2(p) < bound, (chi2(p), dof)
    assert chi2(torch.softmax(row[0].double(), -1)) > 10 * bound


def test_edge_rows(lp):
    """Nothing allowed, all NaN, one token left, a tie across the whole row, +inf, -0.0 at the top."""
    vocab = 64
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(360))
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[2, 17] = -3.0
    logits[3] = 0.5
    logits[4, 9] = float("inf")
    logits[4, 40] = float("inf")
    logits[5] = -1.0
    logits[5, 3] = -0.0
    bitmask = torch.full((8, 2), -1, dtype=torch.int32)
    bitmask[6] = 0  # nothing allowed by the grammar
    probs = lp.filtered_probs(logits, temperature=0.8, top_k=1, bitmask=bitmask)
    scores = lp.filtered_logits(logits, temperature=0.8, top_k=1, bitmask=bitmask)
    for r in (0, 1, 6):
        assert torch.equal(probs[r], torch.zeros(vocab)) and (scores[r] == -math.inf).all()
    assert probs[2, 17] == 1 and probs[2].sum() == 1
    assert torch.equal(probs[3], torch.full((vocab,), 1 / vocab))  # ties at the k-th all kept
    assert torch.equal(probs[4].nonzero()[:, 0], torch.tensor([9, 40])) and probs[4, 9] == 0.5
    assert scores[4, 9] == 0.0  # FLT_MAX / 0.8 overflows: scores from the row's largest logit, (x - x_max) / T
    assert probs[5, 3] == 1 and bits(scores[5, 3:4]) == bits(torch.tensor([-0.0 / 0.8]))
    assert torch.equal(lp.sample(logits, temperature=0.8, top_k=1, bitmask=bitmask)[[0, 1, 6]],
                       torch.full((3,), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_top_scores_greedy_and_tiny_temperatures(lp, dtype):
    logits = zero_top_logits(40, dtype, torch.Generator().manual_seed(370))
    greedy = lp.filtered_logits(logits, temperature=0.0)
    tokens = lp.sample(logits, temperature=0.0)
    assert torch.equal(greedy.argmax(-1), tokens)
    at_token = greedy.gather(1, tokens[:, None])[:, 0]
    assert torch.equal(bits(at_token), bits(logits.float().gather(1, tokens[:, None])[:, 0]))
    # x / T overflows: the scores from the row's largest logit, (x - x_max) / T; the top keeps 1.
    huge = torch.tensor([[1e30, 3e38, 2.9e38, -1e30]])
    probs = lp.filtered_probs(huge, temperature=1e-30)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert lp.filtered_logits(huge, temperature=1e-30)[0, 1] == 0.0


@pytest.mark.parametrize("shape", [(0, 10), (3, 0), (0, 0)])
def test_empty_logits(lp, shape):
    """No rows or no vocabulary: an empty result (an empty `out` may have no data pointer)."""
    for op in ("filtered_probs", "filtered_logits"):
        result = getattr(lp, op)(torch.randn(*shape), top_k=2, bitmask=torch.zeros(shape[0], 1, dtype=torch.int32))
        assert result.shape == shape and result.dtype == torch.float32


def test_batch_invariance_and_out(lp):
    g = torch.Generator().manual_seed(380)
    logits = torch.randn(30, 1500, generator=g)
    kwargs = dict(temperature=torch.rand(30, generator=g) + 0.5, top_k=torch.randint(0, 90, (30,), generator=g),
                  top_p=torch.rand(30, generator=g), min_p=0.01)
    whole = lp.filtered_probs(logits, **kwargs)
    for r in (0, 13, 29):
        alone = lp.filtered_probs(logits[r:r + 1], **{k: v[r:r + 1] if isinstance(v, torch.Tensor) else v
                                                       for k, v in kwargs.items()})
        assert torch.equal(bits(alone[0]), bits(whole[r]))
    out = torch.full((30, 1500), 7.0)
    assert lp.filtered_probs(logits, **kwargs, out=out) is out and torch.equal(bits(out), bits(whole))


def test_bad_arguments(lp):
    logits = torch.randn(3, 100)
    with pytest.raises(RuntimeError, match="out must be float32"):
        lp.filtered_probs(logits, out=torch.empty(3, 100, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous tensor of shape \[3, 100\]"):
        lp.filtered_logits(logits, out=torch.empty(3, 99))
    with pytest.raises(RuntimeError, match="out must not share memory with logits"):
        lp.filtered_logits(logits, out=logits)
    with pytest.raises(RuntimeError, match="top_p must be in"):
        lp.filtered_probs(logits, top_p=1.5)
    with pytest.raises(RuntimeError, match="filter_apply_order"):
        lp.filtered_probs(logits, filter_apply_order="sideways")
    with pytest.raises(RuntimeError, match="output"):
        lp._ops.ops.filtered_distribution(logits, None, 1.0, None, 0, None, 1.0, None, 0.0, "joint", None, False, None, 0.0,
                                          None, 0.0, None, -1.0, None, float("inf"), None, 1.0, None, 0.0, None, 0.1, None, 0, None, 0, None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None,
                                          "tokens", torch.empty(3, 100))


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(390)
    logits = torch.randn(4, 300, generator=g)
    bitmask = random_bitmask(4, 300, g, "mixed")
    no_penalties = (None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None)
    for output in ("probs", "logits"):
        torch.library.opcheck(lp._ops.ops.filtered_distribution,
                              (logits, torch.rand(4) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0, "joint", None, False, None, 1e-4, None, 2e-3,
                               torch.full((4,), 2.0), -1.0, torch.full((4,), 4.0), float("inf"), None, 0.9, torch.full((4,), 0.5), 0.0, None, 0.1,
                               torch.arange(4), 0, None, 3, bitmask,
                               *no_penalties, output, torch.empty(4, 300)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, m):
        return lp.filtered_probs(x * 1.0, temperature=0.7, top_k=20, top_p=0.9, bitmask=m)

    assert torch.equal(step(logits, bitmask), lp.filtered_probs(logits, temperature=0.7, top_k=20, top_p=0.9,
                                                                bitmask=bitmask))
