"""filter_apply_order="llama_cpp": llama.cpp's chain (src/llama-sampling.cpp's default sequence
top_k, typ_p, top_p, min_p, xtc, temperature), each sampler over what the last one left,
renormalised, against a float64 reference built stage by stage from the package's independent
references (reference.py's sampling_reference for top-k, top-p and min-p on the previous stage's
distribution, keep_typical for typical-p); temperature_last (the temperature after the filters,
as llama.cpp's chain has it), exact where the scores at T round together; draws against
`filtered_probs`; what the order changes; the ops that refuse it.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import chi_square_p_value, keep_typical, sampling_reference


def llama_chain_reference(logits, temperature, top_k, typical_p, top_p, min_p, nudge=0.0, temperature_last=False):
    """float64 [B, V]: top-k at the temperature, typical_p, top-p, min-p, each renormalised over
    what the stage before kept (per-row values; `nudge` scales the mass parameters by 1 + nudge).
    temperature_last: the stages at temperature 1, then the kept tokens' softmax at the
    temperature (llama.cpp's llama_sampler_temp last: p_i^(1/T) renormalised, uniform at T = inf)."""
    rows = logits.shape[0]
    out = []
    for b in range(rows):
        def value(v):
            return float(v[b]) if isinstance(v, torch.Tensor) else float(v)

        first = 1.0 if temperature_last else value(temperature)
        q = sampling_reference(logits[b:b + 1], temperature=first, top_k=int(value(top_k)))[0]
        q = keep_typical(q, min(1.0, value(typical_p) * (1 + nudge)))
        q = sampling_reference(q.log()[None], top_p=min(1.0, value(top_p) * (1 + nudge)))[0]
        q = sampling_reference(q.log()[None], min_p=value(min_p) * (1 + nudge))[0]
        if temperature_last:
            q = at_temperature(q, value(temperature))
        out.append(q)
    return torch.stack(out)


def at_temperature(q, temperature):
    """float64: the distribution q's support at `temperature` (q ∝ e^x: e^(x / T) renormalised)."""
    scaled = torch.where(q > 0, q.log() / temperature if math.isfinite(temperature) else 0.0, -math.inf)
    return torch.softmax(scaled, -1)


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


def test_temperature_last_is_llama_cpps_default_chain(lp):
    """temperature_last with "llama_cpp": the stages at temperature 1, then the temperature over
    what they kept, equal to the float64 chain on the rows whose cuts a relative 1e-6 does not
    move; the kept sets differ from the temperature-first chain's on many rows (T != 1)."""
    g = torch.Generator().manual_seed(2410)
    logits, params = random_case(g, 160, 3000)
    got = lp.filtered_probs(logits, **params, filter_apply_order="llama_cpp", temperature_last=True).double()
    ref = llama_chain_reference(logits, **params, temperature_last=True)
    clear = torch.ones(logits.shape[0], dtype=torch.bool)
    for nudge in (1e-6, -1e-6):
        clear &= ((llama_chain_reference(logits, **params, nudge=nudge, temperature_last=True) > 0) == (ref > 0)).all(-1)
    assert clear.float().mean() > 0.8
    assert torch.equal(got[clear] > 0, ref[clear] > 0)
    assert torch.allclose(got[clear], ref[clear], rtol=2e-6, atol=0)
    first = lp.filtered_probs(logits, **params, filter_apply_order="llama_cpp")
    assert ((first > 0) != (got > 0)).any(-1).float().mean() > 0.2


def test_temperature_last_leaves_alone_what_the_temperature_does_not_move(lp):
    """At T = 1, on unfiltered rows, greedy rows and with top-k or top_n_sigma alone (sets the
    temperature does not change), temperature_last gives the same bits as temperature first, in
    every order; with top-p it does not."""
    g = torch.Generator().manual_seed(2411)
    logits = torch.randn(24, 4000, generator=g) * 2.5
    temperature = torch.rand(24, generator=g) + 0.5
    temperature[::4] = 1.0
    temperature[1::6] = 0.0
    for order in ("joint", "top_k_first", "llama_cpp"):
        for filters in (dict(), dict(top_k=30), dict(top_n_sigma=1.5)):
            kwargs = dict(filters, temperature=temperature, filter_apply_order=order, seed=5)
            for op in (lp.filtered_probs, lp.filtered_logits, lp.sample):
                assert torch.equal(op(logits, **kwargs, temperature_last=True), op(logits, **kwargs)), (order, filters)
    ones = dict(temperature=1.0, top_p=0.8, min_p=0.05, typical_p=0.9)
    assert torch.equal(lp.filtered_probs(logits, **ones, temperature_last=True), lp.filtered_probs(logits, **ones))
    moved = dict(temperature=temperature, top_p=0.8)
    assert not torch.equal(lp.filtered_probs(logits, **moved, temperature_last=True), lp.filtered_probs(logits, **moved))


def test_temperature_last_per_row(lp):
    """A bool [B] tensor: each row as the call with its flag for every row, in every op."""
    g = torch.Generator().manual_seed(2414)
    logits, params = random_case(g, 32, 2000)
    flags = torch.rand(32, generator=g) < 0.5
    kwargs = dict(params, filter_apply_order="llama_cpp", seed=9)
    for op in (lp.filtered_probs, lp.sample):
        mixed = op(logits, **kwargs, temperature_last=flags)
        last, first = op(logits, **kwargs, temperature_last=True), op(logits, **kwargs)
        assert torch.equal(mixed, torch.where(flags.view(-1, *[1] * (mixed.dim() - 1)), last, first)), op
    assert not torch.equal(last, first)
    out = lp.sample_with_logprobs(logits, **kwargs, temperature_last=flags, num_logprobs=3)
    expected = [lp.sample_with_logprobs(logits, **kwargs, temperature_last=v, num_logprobs=3) for v in (True, False)]
    for column in range(4):
        assert torch.equal(out[column], torch.where(flags.view(-1, *[1] * (out[column].dim() - 1)),
                                                    expected[0][column], expected[1][column]))


def merged_pair(temperature):
    """Two adjacent float32 logits whose scores x / T are the same float32 (IEEE division)."""
    a = torch.tensor(1.75)
    for _ in range(1000):
        b = torch.nextafter(a, torch.tensor(2.0))
        if torch.equal(a / temperature, b / temperature):
            return float(b), float(a)
        a = b
    raise AssertionError("no pair found")


def test_temperature_last_keeps_exactly_the_cut_where_scores_merge(lp):
    """The kept set is the cut's at T = 1 even where distinct logits have one score at T: top-1
    of two adjacent logits keeps the larger alone (temperature first keeps both: a tie at
    the cutoff), and at T = inf, where every score is 0, top-k keeps k tokens, uniform."""
    high, low = merged_pair(1.5)
    row = torch.tensor([[low, high, 0.5, -1.0, 1.0]])
    last = lp.filtered_probs(row, temperature=1.5, top_k=1, temperature_last=True)
    assert torch.equal(last, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(lp.filtered_probs(row, temperature=1.5, top_k=1) > 0,
                       torch.tensor([[True, True, False, False, False]]))
    out, kept = lp.sample_with_logprobs(row, temperature=1.5, top_k=1, temperature_last=True, return_kept=5)
    assert out.tokens.tolist() == [1] and kept.size.tolist() == [1] and out.logprobs[0, 0] == 0.0
    g = torch.Generator().manual_seed(2412)
    logits = torch.randn(4, 50, generator=g) * 2
    probs = lp.filtered_probs(logits, temperature=math.inf, top_k=5, temperature_last=True)
    assert torch.equal(probs > 0, logits >= logits.topk(5).values[:, -1:])
    assert torch.equal(probs[probs > 0], torch.full((20,), 0.2))
    tokens = lp.sample(logits.repeat(500, 1), temperature=math.inf, top_k=5, temperature_last=True)
    assert (probs.repeat(500, 1).gather(1, tokens[:, None]) > 0).all()
    out, kept = lp.sample_with_logprobs(logits, temperature=math.inf, top_k=5, temperature_last=True, return_kept=50)
    assert (kept.size == 5).all() and torch.allclose(out.logprobs[:, 0], torch.full((4,), -math.log(5)))


def test_temperature_last_origin_is_the_kept_sets_top(lp):
    """XTC at T = 1 drops the row's top; at a temperature where x / T overflows the scores are taken
    from the kept set's top, so the draw is its argmax (the limit), not a tie of clamped scores."""
    row = torch.tensor([[100.0, 99.9, 97.0, 96.8]])
    kwargs = dict(temperature=1e-40, xtc_probability=1.0, xtc_threshold=0.1, temperature_last=True)
    assert torch.equal(lp.filtered_probs(row, **kwargs), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert (lp.sample(row.repeat(64, 1), **kwargs) == 1).all()
    out, kept = lp.sample_with_logprobs(row, **kwargs, return_kept=4)
    assert out.logprobs[0, 0] == 0.0 and kept.size.tolist() == [3]


def test_temperature_last_draws(lp):
    """200k draws of one row with temperature_last fit filtered_probs' distribution (chi-square),
    which temperature first's fails; the logprobs and kept set are the drawn distribution's;
    token_logprobs reads the same."""
    g = torch.Generator().manual_seed(2413)
    vocab, n = 60, 200_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    params = dict(temperature=0.6, top_k=40, top_p=0.8, min_p=0.05, filter_apply_order="llama_cpp")
    expected = lp.filtered_probs(row, **params, temperature_last=True)[0].double()
    first = lp.filtered_probs(row, **params)[0].double()
    assert not torch.equal(expected > 0, first > 0)
    tokens = lp.sample(row.expand(n, vocab).contiguous(), **params, seed=3, temperature_last=True)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert chi_square_p_value(counts, expected * n) > 1e-4
    assert (counts[first == 0] > 0).any() or chi_square_p_value(counts, first * n) < 1e-6
    rows = row.expand(8, vocab).contiguous()
    out, kept = lp.sample_with_logprobs(rows, **params, seed=4, temperature_last=True, return_kept=vocab)
    assert torch.allclose(out.logprobs[:, 0].double(), expected[out.tokens].log(), rtol=0, atol=1e-6)
    assert (kept.size == int((expected > 0).sum())).all()
    given = lp.token_logprobs(rows, out.tokens, **params, seed=4, temperature_last=True)
    assert torch.equal(given, out.logprobs[:, 0])


def test_refused_where_not_taken(lp):
    logits = torch.randn(2, 100)
    with pytest.raises(RuntimeError, match="^filter_apply_order must be 'joint', 'top_k_first' or 'llama_cpp', got 'llama'"):
        lp.sample(logits, filter_apply_order="llama")
    with pytest.raises(RuntimeError, match='^filter_apply_order "llama_cpp" is not supported by sample_sharded'):
        lp.sample_sharded(logits, 0, 100, top_p=0.9, filter_apply_order="llama_cpp")
    assert math.isfinite(float(lp.sample_with_logprobs(logits, top_p=0.9, filter_apply_order="llama_cpp").logprobs[0, 0]))
    with pytest.raises(RuntimeError, match="^temperature_last is not supported by sample_sharded"):
        lp.sample_sharded(logits, 0, 100, controls=lp.SamplingControls(top_p=0.9, temperature_last=True))
    with pytest.raises(TypeError, match="^temperature_last must be a bool or a 1-D bool tensor, got int"):
        lp.sample(logits, temperature_last=1)
