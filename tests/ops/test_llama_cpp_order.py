"""filter_apply_order="llama_cpp": llama.cpp's chain (src/llama-sampling.cpp's default sequence
top_k, typ_p, top_p, min_p, xtc), each sampler over what the last one left, renormalised, against
a float64 reference built stage by stage from the package's independent references
(reference.py's sampling_reference for top-k, top-p and min-p on the previous stage's
distribution, keep_typical for typical-p); draws against `filtered_probs`; what the order
changes; the ops that refuse it.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import chi_square_p_value, keep_typical, sampling_reference


def llama_chain_reference(logits, temperature, top_k, typical_p, top_p, min_p, nudge=0.0):
    """float64 [B, V]: top-k at the temperature, typical_p, top-p, min-p, each renormalised over
    what the stage before kept (per-row values; `nudge` scales the mass parameters by 1 + nudge)."""
    rows = logits.shape[0]
    out = []
    for b in range(rows):
        def value(v):
            return float(v[b]) if isinstance(v, torch.Tensor) else float(v)

        q = sampling_reference(logits[b:b + 1], temperature=value(temperature), top_k=int(value(top_k)))[0]
        q = keep_typical(q, min(1.0, value(typical_p) * (1 + nudge)))
        q = sampling_reference(q.log()[None], top_p=min(1.0, value(top_p) * (1 + nudge)))[0]
        q = sampling_reference(q.log()[None], min_p=value(min_p) * (1 + nudge))[0]
        out.append(q)
    return torch.stack(out)


def random_case(g, rows, vocab):
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    temperature = torch.rand(rows, generator=g) + 0.5
    pick = lambda *values: torch.tensor(values)[torch.randint(0, len(values), (rows,), generator=g)]  # noqa: E731
    return logits, dict(temperature=temperature, top_k=pick(0, 40, 200), typical_p=pick(1.0, 0.9, 0.6),
                        top_p=pick(1.0, 0.9, 0.7), min_p=pick(0.0, 0.02, 0.1))


def test_kept_sets_and_probabilities_match_llama_cpp_chain(lp):
    """Per-row top-k, typical_p, top-p and min-p in every combination: filtered_probs equals the
    chain's float64 distribution on the rows whose cuts a relative 1e-6 on the mass parameters
    does not move (probabilities within 2e-6 relative)."""
    g = torch.Generator().manual_seed(2400)
    logits, params = random_case(g, 160, 3000)
    got = lp.filtered_probs(logits, **params, filter_apply_order="llama_cpp").double()
    ref = llama_chain_reference(logits, **params)
    clear = torch.ones(logits.shape[0], dtype=torch.bool)
    for nudge in (1e-6, -1e-6):
        clear &= ((llama_chain_reference(logits, **params, nudge=nudge) > 0) == (ref > 0)).all(-1)
    assert clear.float().mean() > 0.8
    assert torch.equal(got[clear] > 0, ref[clear] > 0)
    assert torch.allclose(got[clear], ref[clear], rtol=2e-6, atol=0)


def test_the_order_changes_the_kept_set(lp):
    """With typical_p beside top-p or min-p the chain keeps other tokens than the default order
    (top-p and min-p first, typical over what they keep); without typical_p and min-p it is
    "top_k_first"; with typical_p alone it is the default."""
    g = torch.Generator().manual_seed(2401)
    logits, params = random_case(g, 96, 2000)
    params |= dict(typical_p=torch.full((96,), 0.7), top_p=torch.full((96,), 0.8))
    llama = lp.filtered_probs(logits, **params, filter_apply_order="llama_cpp")
    joint = lp.filtered_probs(logits, **params)
    assert ((llama > 0) != (joint > 0)).any(-1).float().mean() > 0.3
    plain = dict(temperature=params["temperature"], top_k=params["top_k"], top_p=params["top_p"])
    assert torch.equal(lp.filtered_probs(logits, **plain, filter_apply_order="llama_cpp"),
                       lp.filtered_probs(logits, **plain, filter_apply_order="top_k_first"))
    alone = dict(temperature=params["temperature"], top_k=params["top_k"], typical_p=0.7)
    assert torch.equal(lp.filtered_probs(logits, **alone, filter_apply_order="llama_cpp"),
                       lp.filtered_probs(logits, **alone))


def test_draws_follow_the_chain(lp):
    """200k draws of one row in the chain fit filtered_probs' distribution (chi-square), which the
    default order's fails; the logprobs, rank and kept set are the chain's."""
    g = torch.Generator().manual_seed(2405)  # (a row where the two orders keep different sets)
    vocab, n = 60, 200_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    params = dict(temperature=0.9, top_k=40, typical_p=0.8, top_p=0.85, min_p=0.03)
    expected = lp.filtered_probs(row, **params, filter_apply_order="llama_cpp")[0].double()
    default = lp.filtered_probs(row, **params)[0].double()
    assert not torch.equal(expected > 0, default > 0)
    tokens = lp.sample(row.expand(n, vocab).contiguous(), **params, seed=3, filter_apply_order="llama_cpp")
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert chi_square_p_value(counts, expected * n) > 1e-4
    assert (counts[default == 0] > 0).any() or chi_square_p_value(counts, default * n) < 1e-6
    out, kept = lp.sample_with_logprobs(row.expand(8, vocab).contiguous(), **params, seed=4,
                                        filter_apply_order="llama_cpp", return_kept=vocab)
    assert torch.allclose(out.logprobs[:, 0].double(), expected[out.tokens].log(), rtol=0, atol=1e-6)
    assert (kept.size == int((expected > 0).sum())).all()


def test_refused_where_not_taken(lp):
    logits = torch.randn(2, 100)
    with pytest.raises(RuntimeError, match="^filter_apply_order must be 'joint', 'top_k_first' or 'llama_cpp', got 'llama'"):
        lp.sample(logits, filter_apply_order="llama")
    with pytest.raises(RuntimeError, match='^filter_apply_order "llama_cpp" is not supported by sample_sharded'):
        lp.sample_sharded(logits, 0, 100, top_p=0.9, filter_apply_order="llama_cpp")
    assert math.isfinite(float(lp.sample_with_logprobs(logits, top_p=0.9, filter_apply_order="llama_cpp").logprobs[0, 0]))
