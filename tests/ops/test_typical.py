"""Locally typical sampling (`typical_p`) against transformers' own TypicalLogitsWarper (alone and
after its top-k and top-p warpers, its chain's order) and a float64 transcription of it
(tests/reference.py's keep_typical) beside every other filter, decided over what they keep and
before XTC; a chi-square over the draws; the log-probabilities, rank and kept set under it; the
speculative ops; the edge values and the checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper,
                                                    TypicalLogitsWarper)

from reference import (assert_clear_rows_equal, chi_square_p_value, keep_typical, sampling_reference,
                       vllm_sampling_reference)


def warped(logits: torch.Tensor, temperature: float, warpers: list) -> torch.Tensor:
    """float64 [B, V]: softmax of transformers' warpers applied in turn to the float64 scores (the
    kernels' float32 x / T, so that the scores are the same)."""
    scores = (logits / temperature).double()
    return LogitsProcessorList(warpers)(None, scores).softmax(-1)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.97])
def test_matches_transformers_typical_warper(lp, mass):
    """Alone, after TopKLogitsWarper, and after TopK and TopP (filter_apply_order="top_k_first":
    transformers' chain renormalises top-p over top-k's set): filtered_probs is the warpers'
    distribution on every clear row."""
    g = torch.Generator().manual_seed(970 + int(mass * 100))
    rows, vocab, temperature = 40, 2000, 0.8
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    chains = [(dict(), []), (dict(top_k=50), [TopKLogitsWarper(50)]),
              (dict(top_k=50, top_p=0.9, filter_apply_order="top_k_first"), [TopKLogitsWarper(50), TopPLogitsWarper(0.9)])]
    for filters, before in chains:
        got = lp.filtered_probs(logits, temperature, typical_p=mass, **filters).double()
        ref = warped(logits, temperature, [*before, TypicalLogitsWarper(mass)])
        nudged = [warped(logits, temperature, [*before, TypicalLogitsWarper(m)]) for m in (mass * (1 + 1e-6),
                                                                                             mass * (1 - 1e-6))]
        assert_clear_rows_equal(got, ref, *nudged)
        plain = warped(logits, temperature, before)
        assert ((ref > 0).sum(-1) < (plain > 0).sum(-1)).float().mean() > 0.9  # typical_p cut most rows


@pytest.mark.parametrize("order", ["joint", "top_k_first"])
def test_beside_every_filter_and_xtc(lp, order):
    """Per-row masses from 0 (the nearest tokens alone) to 1 (off), beside each other filter and
    before XTC: the float64 reference's distribution on every clear row."""
    g = torch.Generator().manual_seed(975)
    rows, vocab = 48, 3000
    logits = torch.randn(rows, vocab, generator=g) * 2
    mass = torch.rand(rows, generator=g) * 0.9 + 0.05
    mass[:2] = torch.tensor([0.0, 1.0])
    reference = sampling_reference if order == "joint" else vllm_sampling_reference
    for filters in [dict(top_k=200), dict(top_p=0.95, min_p=0.01), dict(epsilon_cutoff=1e-4, top_n_sigma=2.0),
                    dict(top_k=100, xtc_probability=1.0, xtc_threshold=0.02)]:
        got = lp.filtered_probs(logits, 0.9, typical_p=mass, filter_apply_order=order, **filters).double()
        ref = reference(logits, temperature=0.9, typical_p=mass, **filters)
        nudged = [reference(logits, temperature=0.9, typical_p=mass * f, **filters) for f in (1 + 1e-4, 1 - 1e-4)]
        assert_clear_rows_equal(got, ref, *nudged)
        assert (got[0] > 0).sum() >= 1


def test_drops_the_most_likely_token_where_it_is_atypical(lp):
    """A row whose top token is far more likely than its entropy says (a peak over a flat tail):
    typical_p keeps the tail's tokens and drops the top, as the warper does; sample never draws
    it and its log-probability is -inf."""
    vocab = 1000
    logits = torch.zeros(2, vocab)
    logits[:, 0] = 5.0
    probs = lp.filtered_probs(logits, typical_p=0.5)
    ref = warped(logits, 1.0, [TypicalLogitsWarper(0.5)])
    assert probs[0, 0] == 0 and ref[0, 0] == 0
    assert torch.allclose(probs.double(), ref, rtol=2e-6, atol=0)
    tokens = lp.sample(logits[:1].expand(4000, vocab).contiguous(), typical_p=0.5, seed=3)
    assert (tokens != 0).all()
    assert lp.token_logprobs(logits, torch.tensor([0, 1]), typical_p=0.5)[0] == float("-inf")


def test_draws_match_the_distribution(lp):
    """200k draws of one row: a chi-square against the reference, which the row without
    typical_p fails."""
    g = torch.Generator().manual_seed(976)
    vocab, n = 40, 200_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    expected = keep_typical(sampling_reference(row)[0], 0.6)
    assert 3 <= int((expected > 0).sum()) < vocab
    counts = torch.bincount(lp.sample(row.expand(n, vocab).contiguous(), typical_p=0.6, seed=7),
                            minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    assert chi_square_p_value(counts, expected * n) > 1e-4
    assert chi_square_p_value(counts, sampling_reference(row)[0] * n) < 1e-6


def test_logprobs_rank_and_kept_set_are_the_band_distributions(lp):
    """sample_with_logprobs under typical_p: column 0 and the top-N are log filtered_probs, the
    kept set is its support, the rank counts the kept tokens above."""
    g = torch.Generator().manual_seed(977)
    rows, vocab = 32, 1000
    logits = torch.randn(rows, vocab, generator=g) * 2
    args = dict(temperature=0.9, top_k=300, typical_p=0.7, seed=5, offset=9)
    out, kept = lp.sample_with_logprobs(logits, num_logprobs=3, return_kept=vocab, **args)
    probs = lp.filtered_probs(logits, **args).double()
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for b in range(rows):
        allowed[b, kept.ids[b, :int(kept.size[b])]] = True
    assert torch.equal(allowed, probs > 0)
    assert torch.allclose(out.logprobs[:, 0].double(), probs.gather(1, out.tokens[:, None])[:, 0].log(), atol=1e-5)
    assert torch.allclose(out.logprobs[:, 1:].double().exp(), probs.topk(3).values, rtol=1e-5, atol=0)
    assert torch.equal(out.ranks, 1 + (probs > probs.gather(1, out.tokens[:, None])).sum(-1))
    assert torch.equal(lp.token_logprobs(logits, out.tokens, **{k: v for k, v in args.items()}), out.logprobs[:, 0])


def test_speculative_ops_verify_against_the_band(lp):
    """verify_draft and verify_tree with typical_p: a draft of the atypical top token is always
    rejected, and the token emitted in its place lies in the band."""
    rows, vocab = 16, 500
    target = torch.zeros(rows, 2, vocab)
    target[:, :, 0] = 5.0
    drafts = torch.zeros(rows, 1, dtype=torch.int64)
    args = dict(typical_p=0.5, seed=torch.arange(rows), offset=torch.zeros(rows, dtype=torch.int64))
    band = lp.filtered_probs(target[:, 0].contiguous(), **args)
    assert (band[:, 0] == 0).all()
    out = lp.verify_draft(target, drafts, **args)
    assert (out.num_accepted == 0).all() and (band.gather(1, out.tokens[:, :1]) > 0).all()
    assert (lp.verify_draft(target, drafts, seed=torch.arange(rows)).num_accepted > 0).any()
    chain = torch.tensor([[1, -1]] * rows), torch.tensor([[-1, -1]] * rows)
    tree = lp.verify_tree(target, torch.cat([drafts, drafts], 1), *chain, **args)
    assert (tree.num_accepted == 0).all() and (band.gather(1, tree.tokens[:, :1]) > 0).all()


def test_edge_values(lp):
    """typical_p 0 keeps the nearest tokens alone (ties all kept); 1, or NaN per row, is off; one
    candidate, nothing allowed and greedy rows are untouched; a row of equal logits keeps all."""
    g = torch.Generator().manual_seed(978)
    vocab = 64
    logits = torch.randn(5, vocab, generator=g)
    logits[3] = 0.25
    bitmask = torch.full((5, 2), -1, dtype=torch.int32)
    bitmask[1] = torch.tensor([1 << 4, 0], dtype=torch.int32)
    bitmask[2] = 0
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    plain = lp.filtered_probs(logits, temperature, bitmask=bitmask)
    nearest = lp.filtered_probs(logits, temperature, typical_p=0.0, bitmask=bitmask)
    ref = warped(logits[:1], 1.0, [TypicalLogitsWarper(1e-9)])
    assert torch.equal(nearest[0] > 0, ref[0] > 0) and int((nearest[0] > 0).sum()) == 1
    assert torch.equal(nearest[1:], plain[1:])
    for off in (1.0, torch.full((5,), math.nan)):
        assert torch.equal(lp.filtered_probs(logits, temperature, typical_p=off, bitmask=bitmask), plain)
    tokens = lp.sample(logits, temperature, typical_p=0.3, bitmask=bitmask)
    assert tokens[1] == 4 and tokens[2] == -1 and tokens[4] == logits[4].argmax()


def test_bad_arguments_name_the_argument(lp):
    logits = torch.randn(2, 100)
    for value in (1.5, -0.1, math.nan):
        with pytest.raises(RuntimeError, match="^typical_p must be in \\[0, 1\\]"):
            lp.sample(logits, typical_p=value)
    with pytest.raises(RuntimeError, match="typical_p"):
        lp.filtered_probs(logits, typical_p=torch.tensor([0.5]))  # one row short
    with pytest.raises(TypeError, match="typical_p"):
        lp.sample_sharded(logits, 0, 100, typical_p=0.5)
    with pytest.raises(RuntimeError, match="typical_p is not supported by sample_sharded"):
        lp.sample_sharded(logits, 0, 100, check_shards=False, controls=lp.SamplingControls(typical_p=0.5))
