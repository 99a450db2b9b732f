"""mirostat v2 (`mirostat_mu`, `update_mirostat_mu_`) against a float64 reference written from
llama.cpp's llama_sampler_mirostat_v2 (src/llama-sampling.cpp: softmax over the candidates,
keep those with -log2 p <= mu and at least the top, renormalise, draw, then
mu -= eta * (-log2 p_drawn - tau) with p_drawn renormalised): the kept set and distribution, a
chi-square over the draws, mu over a run of steps; the edge values of mu; the checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import chi_square_p_value, sampling_reference


def mirostat_reference(logits: torch.Tensor, mu: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float64 [B, V]: llama.cpp's mirostat v2 distribution at `temperature` (its chain: temp,
    then mirostat), each row with its own mu (+inf or NaN: every token)."""
    p = torch.softmax(logits.double() / temperature, -1)
    surprise = -torch.log2(p)
    bound = mu.double().nan_to_num(nan=math.inf).unsqueeze(-1)
    kept = (surprise <= bound) | (p == p.max(-1, keepdim=True).values)
    q = torch.where(kept, p, 0)
    return q / q.sum(-1, keepdim=True)


def test_kept_set_matches_llama_cpp(lp):
    """Per-row mu over its whole range (0 and below: the top alone; +inf and NaN: every token):
    filtered_probs is the reference's distribution on each row whose cut a relative 1e-4 on
    2^-mu does not move; alongside top-k and top-p it is their intersection, as epsilon_cutoff's
    floor 2^-mu would be."""
    g = torch.Generator().manual_seed(950)
    rows, vocab = 40, 2000
    logits = torch.randn(rows, vocab, generator=g) * 3
    mu = torch.rand(rows, generator=g) * 14 + 0.5
    mu[:4] = torch.tensor([0.0, -3.0, math.inf, math.nan])
    got = lp.filtered_probs(logits, 0.9, mirostat_mu=mu).double()
    ref = mirostat_reference(logits, mu, 0.9)
    nudged = mirostat_reference(logits, mu * (1 + 1e-4), 0.9)
    clear = ((ref > 0) == (nudged > 0)).all(-1)
    assert clear.float().mean() > 0.8 and clear[:4].all()
    assert torch.equal(got[clear] > 0, ref[clear] > 0)
    assert torch.allclose(got[clear], ref[clear], rtol=2e-6, atol=0)
    assert (got[0] > 0).sum() == 1 and (got[1] > 0).sum() == 1 and (got[2] > 0).all() and (got[3] > 0).all()
    combined = lp.filtered_probs(logits, 0.9, top_k=30, top_p=0.95, mirostat_mu=mu).double()
    floors = torch.exp2(-mu.double().nan_to_num(nan=math.inf)).clamp(max=1.0)
    joint = sampling_reference(logits, temperature=0.9, top_k=30, top_p=0.95, epsilon_cutoff=floors)
    assert torch.equal(combined[clear] > 0, joint[clear] > 0)


def test_draws_match_the_distribution(lp):
    """400k draws of one row at mu = 3 bits: a chi-square against the reference, which the row
    without mirostat fails; the logprob sample_with_logprobs reports is the reference's."""
    g = torch.Generator().manual_seed(951)
    vocab, n = 40, 400_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    mu = torch.tensor([3.0])
    expected = mirostat_reference(row, mu)[0]
    assert 3 <= int((expected > 0).sum()) < vocab
    tokens = lp.sample(row.expand(n, vocab).contiguous(), mirostat_mu=3.0, seed=5)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    assert chi_square_p_value(counts, expected * n) > 1e-4
    assert chi_square_p_value(counts, torch.softmax(row[0].double(), -1) * n) < 1e-6
    out = lp.sample_with_logprobs(row.expand(8, vocab).contiguous(), mirostat_mu=3.0, seed=6)
    assert torch.allclose(out.logprobs[:, 0].double(), expected[out.tokens].log(), atol=1e-6)
    assert torch.equal(lp.token_logprobs(row.expand(8, vocab).contiguous(), out.tokens, mirostat_mu=3.0),
                       out.logprobs[:, 0])


def test_mu_over_a_run_follows_llama_cpp(lp):
    """Forty steps of 16 requests whose untruncated surprise is about 8 bits (tau 5 bits, eta 0.3,
    mu from 2 tau): each drawn token lies in the reference's kept set for the row's mu, mu after
    update_mirostat_mu_ is the reference's update from the reference's p of that token, and the
    controller brings the surprise of the last twenty steps' tokens to tau."""
    g = torch.Generator().manual_seed(952)
    rows, vocab, tau, eta = 16, 500, 5.0, 0.3
    mu = torch.full((rows,), 2 * tau)
    surprises = []
    for step in range(40):
        logits = torch.randn(rows, vocab, generator=g)
        out = lp.sample_with_logprobs(logits, 0.8, mirostat_mu=mu, seed=torch.arange(rows), offset=torch.full((rows,), step))
        ref = mirostat_reference(logits, mu, 0.8)
        p = ref.gather(1, out.tokens[:, None])[:, 0]
        assert (p > 0).all(), step
        expected = mu.double() - eta * (-torch.log2(p) - tau)
        lp.update_mirostat_mu_(mu, out.logprobs[:, 0], tau, eta)
        assert torch.allclose(mu.double(), expected, rtol=0, atol=1e-4), step
        surprises.append(-torch.log2(p))
    late = torch.stack(surprises[20:]).mean()
    assert abs(float(late) - tau) < 0.5, float(late)


def test_update_is_elementwise_and_keeps_rows_without_a_token(lp):
    mu = torch.tensor([10.0, 10.0, 10.0, 4.0])
    logprobs = torch.tensor([-math.log(2.0) * 7, float("-inf"), float("nan"), 0.0])
    tau = torch.tensor([5.0, 5.0, 5.0, 3.0])
    lp.update_mirostat_mu_(mu, logprobs, tau, 0.5)
    assert torch.allclose(mu, torch.tensor([10.0 - 0.5 * 2, 10.0, 10.0, 4.0 + 0.5 * 3]))


def test_bad_arguments_name_the_argument(lp):
    logits = torch.randn(2, 100)
    with pytest.raises(RuntimeError, match="mirostat_mu must not be NaN"):
        lp.sample(logits, mirostat_mu=math.nan)
    with pytest.raises(RuntimeError, match="mirostat_mu"):
        lp.sample(logits, mirostat_mu=torch.tensor([1.0]))  # one row short
    # (verify_draft's and verify_tree's: tests/ops/test_verify_mirostat.py; their raw filter
    # argument stays off, mu being their state.)
    target = torch.randn(2, 3, 100)
    drafts = torch.randint(0, 100, (2, 2))
    with pytest.raises(RuntimeError, match="^mirostat_mu of verify_draft is its state"):
        lp._ops.ops.verify_draft(target, drafts, None, None, None, 1.0, None, 0, None, 1.0, None, 0.0, "joint", None, False, None,
                                 0.0, None, 0.0, None, -1.0, None, 3.0, None, 1.0, None, 0.0, None, 0.1, None, 0, None,
                                 0, None, None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None, None,
                                 None, None, 5.0, None, 0.1, False, torch.empty(2, 3, dtype=torch.int64),
                                 torch.empty(2, dtype=torch.int64))
    mu = torch.full((2,), 10.0)
    with pytest.raises(TypeError, match="mirostat_mu must be a float32 1-D tensor"):
        lp.update_mirostat_mu_(mu.double(), torch.zeros(2), 5.0, 0.1)
    with pytest.raises(ValueError, match="token_logprobs must have mirostat_mu's shape"):
        lp.update_mirostat_mu_(mu, torch.zeros(3), 5.0, 0.1)
    with pytest.raises(TypeError, match="mirostat_tau must be a finite number"):
        lp.update_mirostat_mu_(mu, torch.zeros(2), math.inf, 0.1)
    with pytest.raises(ValueError, match="mirostat_eta must be at least 0"):
        lp.update_mirostat_mu_(mu, torch.zeros(2), 5.0, -0.1)
    assert torch.equal(mu, torch.full((2,), 10.0))  # nothing written
