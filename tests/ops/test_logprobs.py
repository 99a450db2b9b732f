"""sample_with_logprobs and token_logprobs against a float64 reference, through the loader.

The reference (tests/reference.py: logprobs_reference) is a float64 log_softmax of the same
float32 scores over the sort-based reference's kept set. Rows whose kept set is ambiguous
(a score within rounding of a top-p or min-p cutoff: the tight and the slightly widened
reference disagree) are left out of the value comparisons, and counted.
"""

import math

import pytest
import torch

from harness import bits
from op_cases import FILTERS, zero_top_kept_sets, zero_top_logits
from reference import logprobs_reference, random_bitmask, sampling_reference, support_scores

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["processed", "raw"]
TOLERANCE = 2e-6


def random_params(rows, g):
    """Per-row parameters, each filter often active, some rows greedy."""
    params = dict(
        temperature=torch.rand(rows, generator=g) * 1.5 + 0.05,
        top_k=torch.randint(0, 60, (rows,), generator=g),
        top_p=torch.rand(rows, generator=g),
        min_p=torch.rand(rows, generator=g) * 0.3,
    )
    params["temperature"][::5] = 0.0
    params["top_k"][1::4], params["top_p"][1::4], params["min_p"][1::4] = 0, 1.0, 0.0
    return params


def unambiguous_rows(logits, mode, **kwargs):
    """Rows whose support is the same in the reference and the widened reference."""
    if mode == "raw":
        return torch.ones(logits.shape[0], dtype=torch.bool)
    tight = logprobs_reference(logits, mode=mode, **kwargs) > -math.inf
    loose = logprobs_reference(logits, mode=mode, slack=1e-4, **kwargs) > -math.inf
    return (tight == loose).all(-1)


def expected_top(ref, scores, n):
    """(logprobs, ids) of the n most likely tokens of the whole vocabulary: the highest score
    first, ties by lowest id, the tokens outside the support (score -inf) tied below it, so the
    lowest ids outside it come in increasing order at -inf (logits_processor/logprob_ids.h)."""
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :n]
    return ref.gather(1, order), order


def check_against_reference(result, logits, n, mode, rows_checked_min=0.8, rank_ties="min", **kwargs):
    scores = support_scores(logits, mode=mode, **kwargs)
    ref = torch.log_softmax(scores.double(), dim=-1)
    good = unambiguous_rows(logits, mode, **kwargs) & (result.tokens >= 0)
    assert good.float().mean() >= rows_checked_min, f"only {int(good.sum())} rows unambiguous"
    tokens = result.tokens[good]
    got = result.logprobs[good].double()
    want0 = ref[good].gather(1, tokens[:, None])[:, 0]
    assert (want0 > -math.inf).all(), "a sampled token outside the reference support"
    assert ((got[:, 0] - want0).abs() <= TOLERANCE).all()
    assert torch.equal(result.logprob_token_ids[good, 0], tokens)
    values, ids = expected_top(ref[good], scores[good], n)
    assert torch.equal(result.logprob_token_ids[good, 1:], ids)
    finite = values > -math.inf
    assert torch.equal(got[:, 1:] > -math.inf, finite)
    assert ((got[:, 1:] - values).abs()[finite] <= TOLERANCE).all()
    # ranks, by score (equal scores are equally likely): "min", 1 + the tokens strictly more
    # likely; "max" (vLLM's), the tokens at least as likely, the sampled one included
    token_scores = scores[good].gather(1, tokens[:, None])
    if rank_ties == "min":
        assert torch.equal(result.ranks[good], (scores[good] > token_scores).sum(-1) + 1)
    else:
        assert torch.equal(result.ranks[good], (scores[good] >= token_scores).sum(-1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FILTERS))
def test_logprobs_match_float64_reference(lp, mode, name):
    g = torch.Generator().manual_seed(200)
    logits = torch.randn(64, 3000, generator=g) * 3
    kwargs = dict(FILTERS[name], temperature=0.8)
    result = lp.sample_with_logprobs(logits, seed=5, num_logprobs=5, logprobs_mode=mode, **kwargs)
    assert torch.equal(result.tokens, lp.sample(logits, seed=5, **kwargs))
    check_against_reference(result, logits, 5, mode, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_top_scores(lp, mode, dtype):
    """Rows whose top score is -0.0, +0.0 or both (op_cases.zero_top_logits): the reference's
    values, and a token alone in its kept set has logprob +0.0, as float64's log_softmax gives."""
    vocab = 40
    logits = zero_top_logits(vocab, dtype, torch.Generator().manual_seed(41))
    for kwargs in zero_top_kept_sets(vocab):
        result = lp.sample_with_logprobs(logits, seed=3, num_logprobs=3, logprobs_mode=mode, **kwargs)
        check_against_reference(result, logits, 3, mode, rows_checked_min=1.0, **kwargs)
        ref = logprobs_reference(logits, mode=mode, **kwargs).gather(1, result.tokens[:, None])[:, 0].float()
        certain = ref == 0
        assert torch.equal(bits(result.logprobs[certain, 0]), bits(ref[certain])), kwargs
        assert torch.equal(bits(lp.token_logprobs(logits, result.tokens, logprobs_mode=mode, **kwargs)),
                           bits(result.logprobs[:, 0])), kwargs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_row_parameters_bitmask_ties_and_greedy(lp, mode, dtype):
    g = torch.Generator().manual_seed(201)
    rows, vocab = 80, 2000
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[::6, : vocab // 3] = logits[::6, :1]  # ties everywhere, at every cutoff
    logits[4::6, : vocab // 3] = logits[4::6].max(-1, keepdim=True).values  # ties at the top too
    logits[2::9, 100] = float("nan")
    logits[3, 7] = float("inf")
    bitmask = random_bitmask(rows, vocab, g, "words")
    params = random_params(rows, g)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    result = lp.sample_with_logprobs(logits, seed=seeds, bitmask=bitmask, num_logprobs=20, logprobs_mode=mode, **params)
    assert torch.equal(result.tokens, lp.sample(logits, seed=seeds, bitmask=bitmask, **params))
    check_against_reference(result, logits, 20, mode, rows_checked_min=0.6, bitmask=bitmask, **params)
    # vLLM's rank convention: the same draw and columns, the ties counted against the token
    by_max = lp.sample_with_logprobs(logits, seed=seeds, bitmask=bitmask, num_logprobs=20, logprobs_mode=mode,
                                     rank_ties="max", **params)
    for field in ("tokens", "logprobs", "logprob_token_ids"):
        assert torch.equal(getattr(by_max, field), getattr(result, field)), field
    assert (by_max.ranks > result.ranks).any(), "no row had a tie with its token: the case tests nothing"
    check_against_reference(by_max, logits, 20, mode, rows_checked_min=0.6, rank_ties="max", bitmask=bitmask,
                            **params)
    greedy = params["temperature"] == 0
    assert torch.equal(result.tokens[greedy], lp.sample(logits[greedy], temperature=0.0, bitmask=bitmask[greedy]))


@pytest.mark.parametrize("mode", MODES)
def test_token_logprobs_equals_column_zero(lp, mode):
    g = torch.Generator().manual_seed(202)
    rows, vocab = 50, 5000
    logits = torch.randn(rows, vocab, generator=g) * 2
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    bitmask[4] = 0  # nothing allowed: token -1
    params = random_params(rows, g)
    result = lp.sample_with_logprobs(logits, seed=9, offset=3, bitmask=bitmask, logprobs_mode=mode, **params)
    again = lp.token_logprobs(logits, result.tokens, bitmask=bitmask, logprobs_mode=mode, **params)
    assert torch.equal(again.view(torch.int32), result.logprobs[:, 0].contiguous().view(torch.int32))
    assert result.tokens[4] == -1 and again[4] == -math.inf
    # Any token: the reference's value, -inf outside the support or outside [0, V).
    ids = torch.randint(-1, vocab + 1, (rows,), generator=g)
    got = lp.token_logprobs(logits, ids, bitmask=bitmask, logprobs_mode=mode, **params).double()
    ref = logprobs_reference(logits, bitmask=bitmask, mode=mode, **params)
    inside = (ids >= 0) & (ids < vocab)
    want = torch.full((rows,), -math.inf, dtype=torch.float64)
    want[inside] = ref[inside].gather(1, ids[inside, None])[:, 0]
    good = unambiguous_rows(logits, mode, bitmask=bitmask, **params)
    assert torch.equal(got[good] > -math.inf, want[good] > -math.inf)
    finite = good & (want > -math.inf)
    assert ((got - want).abs()[finite] <= TOLERANCE).all()


def test_padding_and_rows_with_nothing_allowed(lp):
    logits = torch.randn(4, 40)
    logits[1] = float("-inf")
    logits[2] = float("nan")
    logits[3, 5:] = float("-inf")  # five candidates
    result = lp.sample_with_logprobs(logits, top_k=3, seed=1, num_logprobs=8)
    by_max = lp.sample_with_logprobs(logits, top_k=3, seed=1, num_logprobs=8, rank_ties="max")
    for row in (1, 2):  # nothing allowed: token -1, and the columns the lowest ids, at -inf
        assert result.tokens[row] == -1 and result.ranks[row] == 0 and by_max.ranks[row] == 0
        assert (result.logprobs[row] == -math.inf).all() and result.logprob_token_ids[row, 0] == -1
        assert result.logprob_token_ids[row, 1:].tolist() == list(range(8))
    # top_k = 3 keeps three tokens: the other five columns are the lowest ids outside them.
    for row in (0, 3):
        listed = result.logprob_token_ids[row, 1:4].tolist()
        assert min(listed) >= 0 and len(set(listed)) == 3
        assert result.logprob_token_ids[row, 4:].tolist() == [v for v in range(8) if v not in listed][:5]
        assert (result.logprobs[row, 4:] == -math.inf).all()
        assert torch.logsumexp(result.logprobs[row, 1:4].double(), 0).abs() < 1e-6  # the whole support
    raw = lp.sample_with_logprobs(logits, top_k=3, seed=1, num_logprobs=8, logprobs_mode="raw")
    assert sorted(raw.logprob_token_ids[3, 1:6].tolist()) == [0, 1, 2, 3, 4]  # its five finite logits
    assert raw.logprob_token_ids[3, 6:].tolist() == [5, 6, 7] and (raw.logprobs[3, 6:] == -math.inf).all()
    empty = lp.sample_with_logprobs(torch.empty(0, 10), num_logprobs=2)
    assert empty.logprobs.shape == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128256, 256000])
def test_large_rows_within_tolerance(lp, dtype, vocab):
    """Rows of up to 256k tokens: the fine fixed point keeps ln Z within the tolerance."""
    g = torch.Generator().manual_seed(203)
    logits = (torch.randn(3, vocab, generator=g) * 2).to(dtype)
    logits[0] = (torch.rand(vocab, generator=g) * 0.01).to(dtype)  # flat: Z near V, every term counts
    for mode in MODES:
        result = lp.sample_with_logprobs(logits, seed=2, num_logprobs=20, logprobs_mode=mode)
        check_against_reference(result, logits, 20, mode, rows_checked_min=1.0)


def test_batch_invariance(lp):
    """A row's results are bit-identical alone and in batches of 1, 7 and 300 rows, at any position."""
    g = torch.Generator().manual_seed(204)
    vocab = 4000
    pool = torch.randn(300, vocab, generator=g) * 3
    seeds = torch.randint(0, 2**62, (300,), generator=g)
    params = random_params(300, g)
    bitmask = random_bitmask(300, vocab, g, "words")

    def run(index):
        return lp.sample_with_logprobs(pool[index], seed=seeds[index], bitmask=bitmask[index], num_logprobs=6,
                                       **{k: v[index] for k, v in params.items()})

    full = run(torch.arange(300))
    for size in (1, 7):
        for start in (0, 13, 293):
            index = torch.arange(start, start + size)
            part = run(index)
            for field in full._fields:
                assert torch.equal(getattr(part, field), getattr(full, field)[index]), (field, size, start)
    perm = torch.randperm(300, generator=g)
    shuffled = run(perm)
    for field in full._fields:
        assert torch.equal(getattr(shuffled, field), getattr(full, field)[perm]), field


def test_out_and_return(lp):
    logits = torch.randn(3, 100)
    out = lp.SampleWithLogprobs(torch.empty(3, dtype=torch.int64), torch.empty(3, 5), torch.empty(3, 5, dtype=torch.int64),
                                torch.empty(3, dtype=torch.int64))
    result = lp.sample_with_logprobs(logits, seed=1, num_logprobs=4, out=out)
    assert all(a is b for a, b in zip(result, out))
    fresh = lp.sample_with_logprobs(logits, seed=1, num_logprobs=4)
    assert all(torch.equal(a, b) for a, b in zip(result, fresh))
    target = torch.empty(3)
    assert lp.token_logprobs(logits, fresh.tokens, out=target) is target
    assert torch.equal(target, fresh.logprobs[:, 0])


def test_inputs_unchanged(lp):
    g = torch.Generator().manual_seed(205)
    logits = torch.randn(6, 500, generator=g)
    bitmask = random_bitmask(6, 500, g, "mixed")
    params = random_params(6, g)
    before = [logits.clone(), bitmask.clone()] + [v.clone() for v in params.values()]
    result = lp.sample_with_logprobs(logits, bitmask=bitmask, num_logprobs=3, **params)
    lp.token_logprobs(logits, result.tokens, bitmask=bitmask, **params)
    after = [logits, bitmask] + list(params.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(206)
    logits = torch.randn(4, 300, generator=g)
    bitmask = random_bitmask(4, 300, g, "mixed")
    # (vLLM's conventions: int32 ids, ties counted in the rank)
    outs = (torch.empty(4, dtype=torch.int32), torch.empty(4, 6), torch.empty(4, 6, dtype=torch.int32),
            torch.empty(4, dtype=torch.int64))
    no_penalties = (None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None)
    args = (logits, torch.rand(4) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0, "joint", None, False, None, 1e-4, torch.full((4,), 1e-3), 0.0, None, 1.5, torch.full((4,), 5.0), float("inf"),
            None, 0.9, torch.full((4,), 0.5), 0.0, None, 0.1, torch.arange(4), 0, None, 3,
            bitmask,
            *no_penalties, 5, "processed", "max", *outs)
    torch.library.opcheck(lp._ops.ops.sample_with_logprobs, args)
    tokens = torch.randint(0, 300, (4,), generator=g)
    torch.library.opcheck(lp._ops.ops.token_logprobs, (logits, tokens, None, 0.7, None, 20, None, 1.0, None, 0.0, "top_k_first", None, False, None, 0.0, None, 2e-3,
                                                       None, 2.0, None, 7.0, torch.full((4,), 0.8), 1.0, None, 1.0, torch.full((4,), 0.05), 0.1,
                                                       torch.arange(4), 0, None, 3, bitmask,
                                                       *no_penalties, "raw", torch.empty(4)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, m, offset):
        result = lp.sample_with_logprobs(x * 1.0, temperature=0.7, top_k=20, top_p=0.9, seed=3, offset=offset,
                                         bitmask=m, num_logprobs=5)
        return result, lp.token_logprobs(x * 1.0, result.tokens, temperature=0.7, top_k=20, top_p=0.9, bitmask=m)

    offset = torch.full((4,), 5, dtype=torch.int64)
    compiled, recomputed = step(logits, bitmask, offset)
    eager = lp.sample_with_logprobs(logits, temperature=0.7, top_k=20, top_p=0.9, seed=3, offset=5, bitmask=bitmask,
                                    num_logprobs=5)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert torch.equal(recomputed, eager.logprobs[:, 0])


def test_the_reference_comparison_can_fail(lp):
    """The checks above see a wrong distribution: logprobs at T = 1 against the T = 0.8 reference."""
    g = torch.Generator().manual_seed(207)
    logits = torch.randn(16, 1000, generator=g) * 3
    result = lp.sample_with_logprobs(logits, temperature=1.0, seed=1, num_logprobs=5)
    with pytest.raises(AssertionError):
        check_against_reference(result, logits, 5, "processed", temperature=0.8)


def test_kept_set_reference_agrees_with_sampling_reference(lp):
    """processed logprobs exponentiate to the sampling reference's probabilities."""
    g = torch.Generator().manual_seed(208)
    logits = torch.randn(8, 400, generator=g) * 2
    kwargs = dict(temperature=0.9, top_k=50, top_p=0.9)
    assert torch.allclose(logprobs_reference(logits, **kwargs).exp(), sampling_reference(logits, **kwargs), atol=1e-12)

