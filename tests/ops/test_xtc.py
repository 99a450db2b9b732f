"""XTC, exclude top choices (`xtc_probability`, `xtc_threshold`), against a float64 reference
written from llama.cpp's llama_sampler_xtc (src/llama-sampling.cpp; tests/reference.py's
exclude_top_choices), decided last over what the other filters keep: the kept set and
distribution in both filter orders, the coin (its rate, its keying by (seed, offset), the same in
the ops that draw nothing), chi-squares over the draws, the log-probabilities and kept set under
it, the speculative ops, the edge values and the checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import (assert_clear_rows_equal, chi_square_p_value, exclude_top_choices, sampling_reference,
                       vllm_sampling_reference)

FILTERS = [dict(), dict(top_k=20), dict(top_p=0.9), dict(min_p=0.05, top_p=0.8),
           dict(top_k=50, epsilon_cutoff=1e-3), dict(top_n_sigma=1.5)]


@pytest.mark.parametrize("order", ["joint", "top_k_first"])
def test_kept_set_matches_llama_cpp(lp, order):
    """With the coin always falling, filtered_probs is the reference's distribution on every row
    whose cut a relative 1e-4 on the threshold does not move, per-row thresholds from 0 (only
    the least likely kept token stays) to above 0.5 (off), beside each other filter."""
    g = torch.Generator().manual_seed(960)
    rows, vocab = 48, 3000
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    threshold = torch.rand(rows, generator=g) * 0.2 + 0.01
    threshold[:2] = torch.tensor([0.0, 0.6])
    reference = sampling_reference if order == "joint" else vllm_sampling_reference
    for filters in FILTERS:
        got = lp.filtered_probs(logits, 0.8, xtc_probability=1.0, xtc_threshold=threshold, filter_apply_order=order,
                                **filters).double()
        ref = reference(logits, temperature=0.8, xtc_probability=1.0, xtc_threshold=threshold, **filters)
        nudged = reference(logits, temperature=0.8, xtc_probability=1.0, xtc_threshold=threshold * (1 + 1e-4),
                           **filters)
        assert assert_clear_rows_equal(got, ref, nudged)[:2].all(), filters
        without = reference(logits, temperature=0.8, **filters)
        assert (ref != without).any(-1).float().mean() > 0.3, filters  # XTC did cut most rows
        assert (got[0] > 0).sum() == 1 and torch.allclose(got[1], without[1], rtol=2e-6, atol=0)


def test_coin_falls_at_its_probability_keyed_like_the_draw(lp):
    """4000 rows that XTC cuts whenever its coin falls (two top choices): the coin falls on
    xtc_probability of them (within 5 standard deviations, for these fixed seeds), each row's
    decision follows its (seed, offset) whatever its place in the batch, and sample,
    sample_with_logprobs, token_logprobs and filtered_probs given the same seed and offset all
    see the same coin."""
    g = torch.Generator().manual_seed(961)
    rows, vocab, chance = 4000, 64, 0.3
    logits = torch.randn(rows, vocab, generator=g) * 0.3
    logits[:, 0], logits[:, 1] = 4.0, 3.5
    seed = torch.randint(0, 2**62, (rows,), generator=g)
    offset = torch.randint(0, 2**40, (rows,), generator=g)
    probs = lp.filtered_probs(logits, xtc_probability=chance, seed=seed, offset=offset)
    fell = probs[:, 0] == 0
    assert (probs[fell, 1] > 0).all() and (probs[~fell, 0] > 0).all()
    assert abs(int(fell.sum()) - rows * chance) < 5 * math.sqrt(rows * chance * (1 - chance))
    perm = torch.randperm(rows, generator=g)
    again = lp.filtered_probs(logits[perm], xtc_probability=chance, seed=seed[perm], offset=offset[perm])
    assert torch.equal(again, probs[perm])
    moved = lp.filtered_probs(logits, xtc_probability=chance, seed=seed, offset=offset + 1)
    assert not torch.equal(moved[:, 0] == 0, fell)
    out = lp.sample_with_logprobs(logits, xtc_probability=chance, seed=seed, offset=offset)
    assert (out.tokens[fell] != 0).all()
    assert torch.equal(lp.sample(logits, xtc_probability=chance, seed=seed, offset=offset), out.tokens)
    assert torch.equal(lp.token_logprobs(logits, out.tokens, xtc_probability=chance, seed=seed, offset=offset),
                       out.logprobs[:, 0])
    assert torch.allclose(out.logprobs[:, 0].double(), probs.gather(1, out.tokens[:, None])[:, 0].double().log(),
                          atol=1e-5)
    # A shared seed keys row b by (seed, b, offset).
    shared = lp.filtered_probs(logits, xtc_probability=chance, seed=7, offset=3)[:, 0] == 0
    assert abs(int(shared.sum()) - rows * chance) < 5 * math.sqrt(rows * chance * (1 - chance))
    assert not torch.equal(shared, fell)


def test_draws_match_the_distribution(lp):
    """200k draws of one row (offsets 0..n-1): with the coin always falling, a chi-square
    against the reference, which the row without XTC fails; with probability 0.5, against the
    even mixture of the two, which each alone fails."""
    g = torch.Generator().manual_seed(962)
    vocab, n = 40, 200_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    plain = sampling_reference(row)[0]
    cut = exclude_top_choices(plain, 1.0, 0.05)
    assert int((plain >= 0.05).sum()) >= 3
    logits, offset = row.expand(n, vocab).contiguous(), torch.arange(n)
    seed = torch.full((n,), 11)
    always = torch.bincount(lp.sample(logits, xtc_probability=1.0, xtc_threshold=0.05, seed=seed, offset=offset),
                            minlength=vocab).double()
    assert always[cut == 0].sum() == 0
    assert chi_square_p_value(always, cut * n) > 1e-4
    assert chi_square_p_value(always, plain * n) < 1e-6
    half = torch.bincount(lp.sample(logits, xtc_probability=0.5, xtc_threshold=0.05, seed=seed, offset=offset),
                          minlength=vocab).double()
    assert chi_square_p_value(half, (plain + cut) / 2 * n) > 1e-4
    assert chi_square_p_value(half, plain * n) < 1e-6


def test_logprobs_rank_and_kept_set_are_the_cut_distributions(lp):
    """sample_with_logprobs under XTC: column 0 is log filtered_probs of the token, the top-N
    are the cut set's, the kept set is filtered_probs' support, the rank counts only the kept
    tokens above; raw log-probabilities ignore XTC."""
    g = torch.Generator().manual_seed(963)
    rows, vocab = 32, 1000
    logits = torch.randn(rows, vocab, generator=g) * 2
    args = dict(temperature=0.9, top_k=100, xtc_probability=1.0, xtc_threshold=0.02, seed=5, offset=9)
    out, kept = lp.sample_with_logprobs(logits, num_logprobs=3, return_kept=vocab, **args)
    probs = lp.filtered_probs(logits, **args).double()
    assert torch.equal(kept.bitmask, lp.sample_with_logprobs(logits, return_kept=1, **args)[1].bitmask)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for b in range(rows):
        allowed[b, kept.ids[b, :int(kept.size[b])]] = True
    assert torch.equal(allowed, probs > 0)
    assert torch.allclose(out.logprobs[:, 0].double(), probs.gather(1, out.tokens[:, None])[:, 0].log(), atol=1e-5)
    assert torch.allclose(out.logprobs[:, 1:].double().exp(), probs.topk(3).values, rtol=1e-5, atol=0)
    p_token = probs.gather(1, out.tokens[:, None])
    assert torch.equal(out.ranks, 1 + (probs > p_token).sum(-1))
    assert (probs.max(-1).values < sampling_reference(logits, temperature=0.9, top_k=100).max(-1).values).all()
    raw = lp.sample_with_logprobs(logits, num_logprobs=0, logprobs_mode="raw", **args)
    assert torch.allclose(raw.logprobs[:, 0], torch.log_softmax(logits, -1).gather(1, raw.tokens[:, None])[:, 0],
                          atol=1e-5)


def test_speculative_ops_verify_against_the_cut_distribution(lp):
    """verify_draft and verify_tree with XTC: a draft of the top token, which the coin drops,
    is always rejected, and the token emitted in its place lies in the cut set."""
    g = torch.Generator().manual_seed(964)
    rows, vocab = 16, 200
    target = torch.randn(rows, 2, vocab, generator=g)
    target[:, 0, 0], target[:, 0, 1], target[:, 0, 2] = 6.0, 5.8, 5.6
    drafts = torch.zeros(rows, 1, dtype=torch.int64)
    args = dict(xtc_probability=1.0, xtc_threshold=0.05, seed=torch.arange(rows), offset=torch.zeros(rows, dtype=torch.int64))
    cut = lp.filtered_probs(target[:, 0].contiguous(), **args)
    assert (cut[:, 0] == 0).all()
    out = lp.verify_draft(target, drafts, **args)
    assert (out.num_accepted == 0).all()
    assert (cut.gather(1, out.tokens[:, :1]) > 0).all()
    without = lp.verify_draft(target, drafts, seed=torch.arange(rows), offset=torch.zeros(rows, dtype=torch.int64))
    assert (without.num_accepted > 0).any()
    next_token = torch.tensor([[1, -1]] * rows)
    next_sibling = torch.tensor([[-1, -1]] * rows)
    tree = lp.verify_tree(target, torch.cat([torch.zeros(rows, 1, dtype=torch.int64), drafts], 1), next_token,
                          next_sibling, **args)
    assert (tree.num_accepted == 0).all()
    assert (cut.gather(1, tree.tokens[:, :1]) > 0).all()


def test_edge_values(lp):
    """Tied top choices are kept together (nothing dropped where every top choice ties at the
    top); one candidate, nothing allowed and greedy rows are untouched; a threshold above 0.5,
    probability 0, or NaN per row is off; per-row probability above 1 counts as 1."""
    vocab = 50
    logits = torch.full((6, vocab), -2.0)
    logits[0, :2] = 3.0                   # two tied top choices: nothing to drop
    logits[1, :2], logits[1, 2] = 3.0, 2.0  # two tied above a third: the two go
    logits[2, 5] = 1.0
    bitmask = torch.zeros(6, 2, dtype=torch.int32)
    bitmask[:, :] = -1
    bitmask[2] = torch.tensor([1 << 5, 0], dtype=torch.int32)  # one candidate
    bitmask[3] = 0                                             # nothing allowed
    logits[4, 7], logits[4, 8] = 2.5, 2.4
    logits[5, 7], logits[5, 8] = 2.5, 2.4
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    probs = lp.filtered_probs(logits, temperature, xtc_probability=1.0, xtc_threshold=0.05, bitmask=bitmask)
    plain = lp.filtered_probs(logits, temperature, bitmask=bitmask)
    assert torch.equal(probs[0], plain[0])
    assert probs[1, :2].eq(0).all() and probs[1, 2] > 0
    assert torch.equal(probs[2:5], plain[2:5])
    assert probs[5, 7] == 0 and probs[5, 8] > 0
    tokens = lp.sample(logits, temperature, xtc_probability=1.0, xtc_threshold=0.05, bitmask=bitmask)
    assert tokens[3] == -1 and tokens[4] == 7 and tokens[2] == 5
    for off in (dict(xtc_probability=1.0, xtc_threshold=0.6), dict(xtc_probability=0.0, xtc_threshold=0.05),
                dict(xtc_probability=torch.full((6,), math.nan)), dict(xtc_probability=1.0,
                                                                        xtc_threshold=torch.full((6,), math.nan))):
        assert torch.equal(lp.filtered_probs(logits, temperature, bitmask=bitmask, **off), plain), off
    assert torch.equal(lp.filtered_probs(logits, temperature, bitmask=bitmask, xtc_probability=torch.full((6,), 7.0),
                                         xtc_threshold=0.05), probs)


def test_bad_arguments_name_the_argument(lp):
    logits = torch.randn(2, 100)
    for name, value in (("xtc_probability", 1.5), ("xtc_probability", -0.1), ("xtc_probability", math.nan),
                        ("xtc_threshold", 2.0), ("xtc_threshold", -0.5), ("xtc_threshold", math.nan)):
        with pytest.raises(RuntimeError, match=f"^{name} must be in \\[0, 1\\]"):
            lp.sample(logits, **{name: value})
    with pytest.raises(RuntimeError, match="xtc_threshold"):
        lp.filtered_probs(logits, xtc_probability=1.0, xtc_threshold=torch.tensor([0.1]))  # one row short
    with pytest.raises(TypeError, match="xtc_probability"):
        lp.sample_sharded(logits, 0, 100, xtc_probability=1.0)
    with pytest.raises(RuntimeError, match="xtc_probability is not supported by sample_sharded"):
        lp.sample_sharded(logits, 0, 100, check_shards=False, controls=lp.SamplingControls(xtc_probability=0.5))
