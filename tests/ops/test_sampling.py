"""The fused sampler against an independent float64 reference, through the loader."""

import pytest
import torch

from harness import names_as_subject
from op_cases import FILTERS, random_row_params
from reference import (chi_square_p_value, random_bitmask, sampling_reference, support_scores,
                       vllm_sampling_reference)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# op_cases' filters, with a top-k that cuts deeper into this file's small vocabularies.
FILTERS = FILTERS | {"all_three": dict(top_k=9, top_p=0.85, min_p=0.05)}


def draws(lp, logits, rows, **kwargs):
    """`rows` independent draws from one logits row: each row of a batch has its own stream."""
    return lp.sample(logits.expand(rows, -1).contiguous(), **kwargs)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", list(FILTERS))
def test_distribution_matches_float64_reference(lp_variant, name):
    """Frequencies over 400k draws match the filtered, renormalised softmax, in each variant."""
    g = torch.Generator().manual_seed(100)
    vocab, n = 40, 400_000
    logits = (torch.randn(1, vocab, generator=g) * 1.5)
    kwargs = dict(FILTERS[name], temperature=0.9)
    expected = sampling_reference(logits, **kwargs)[0]
    tokens = draws(lp_variant, logits, n, seed=7, **kwargs)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert (counts / n - expected).abs().max() < 0.002  # noise alone: sigma <= 8e-4
    assert chi_square_p_value(counts, expected * n) > 1e-4


# Filters where the orders differ: top-p cuts inside what top-k and min-p keep.
ORDER_FILTERS = {
    "top_k_top_p": dict(top_k=12, top_p=0.7),
    "top_p_min_p": dict(top_p=0.8, min_p=0.05),
    "all_three": dict(top_k=15, top_p=0.75, min_p=0.02),
}


@pytest.mark.parametrize("name", list(ORDER_FILTERS))
def test_top_k_first_distribution_matches_vllm_chain(lp, name):
    """filter_apply_order="top_k_first": frequencies over 400k draws match vLLM's filter chain
    in float64 (reference.vllm_sampling_reference), and the same check rejects them against
    the joint (intersection) reference, whose kept set is larger: it tells the orders apart."""
    g = torch.Generator().manual_seed(102)
    vocab, n = 40, 400_000
    logits = torch.randn(1, vocab, generator=g) * 1.5
    kwargs = dict(ORDER_FILTERS[name], temperature=0.9)
    expected = vllm_sampling_reference(logits, **kwargs)[0]
    joint = sampling_reference(logits, **kwargs)[0]
    assert (joint > 0).sum() > (expected > 0).sum()
    tokens = draws(lp, logits, n, seed=7, filter_apply_order="top_k_first", **kwargs)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert (counts / n - expected).abs().max() < 0.002
    assert chi_square_p_value(counts, expected * n) > 1e-4
    assert chi_square_p_value(counts, joint * n) < 1e-6


@pytest.mark.parametrize("order", ["joint", "top_k_first"])
def test_kept_set_and_logprobs_match_each_order_reference(lp, order):
    """Per-row filters on float32 rows (no ties): the support `sample_with_logprobs` reports is
    the reference's kept set for the order (sort-based: the intersection, or vLLM's chain), its
    log-probabilities that set's float64 log_softmax, the token inside it, and token_logprobs
    and verify_draft's emitted tokens take the same distribution."""
    g = torch.Generator().manual_seed(103)
    rows, vocab = 32, 700
    logits = torch.randn(rows, vocab, generator=g) * 2
    params = random_row_params(rows, g)
    params["top_p"] = params["top_p"] * 0.6 + 0.4
    result = lp.sample_with_logprobs(logits, seed=torch.arange(rows), num_logprobs=vocab, filter_apply_order=order,
                                     **params)
    scores = support_scores(logits, **params, filter_apply_order=order)
    ids, listed = result.logprob_token_ids[:, 1:], result.logprob_token_ids[:, 1:] >= 0
    got = torch.full((rows, vocab), float("-inf"))
    got[torch.arange(rows)[:, None].expand_as(ids)[listed], ids[listed]] = result.logprobs[:, 1:][listed]
    expected = torch.log_softmax(scores.double(), dim=-1)
    assert torch.equal(got > float("-inf"), expected > float("-inf"))
    kept = expected > float("-inf")
    assert (got[kept].double() - expected[kept]).abs().max() < 1e-5
    assert kept.gather(1, result.tokens[:, None]).all()
    again = lp.token_logprobs(logits, result.tokens, filter_apply_order=order, **params)
    assert torch.equal(again, result.logprobs[:, 0])
    verified = lp.verify_draft(logits[:, None], torch.empty(rows, 0, dtype=torch.int64), seed=torch.arange(rows),
                               filter_apply_order=order, **params)
    assert kept.gather(1, verified.tokens).all()


def test_filter_order_is_checked_by_name(lp):
    x = torch.randn(2, 50)
    for op in [lambda **kw: lp.sample(x, **kw), lambda **kw: lp.sample_with_logprobs(x, **kw),
               lambda **kw: lp.token_logprobs(x, torch.zeros(2, dtype=torch.int64), **kw),
               lambda **kw: lp.verify_draft(x[:, None], torch.empty(2, 0, dtype=torch.int64), **kw)]:
        with pytest.raises(RuntimeError, match="^filter_apply_order must be 'joint', 'top_k_first' or 'llama_cpp', got 'vllm'$"):
            op(filter_apply_order="vllm")
        with pytest.raises((RuntimeError, TypeError), match="filter_apply_order"):
            op(filter_apply_order=1)


def test_chi_square_detects_a_wrong_distribution(lp):
    """The statistical check can fail: draws at T=1 tested against the T=0.9 reference."""
    g = torch.Generator().manual_seed(101)
    logits = torch.randn(1, 40, generator=g) * 1.5
    tokens = draws(lp, logits, 400_000, temperature=1.0, seed=3)
    wrong = sampling_reference(logits, temperature=0.9)[0] * tokens.numel()
    assert chi_square_p_value(torch.bincount(tokens, minlength=40).double(), wrong) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_heterogeneous_rows_with_bitmask(lp, dtype):
    """Per-row parameters and a bitmask in one batch: each row's frequencies match its reference."""
    g = torch.Generator().manual_seed(102)
    vocab, requests, n = 70, 4, 100_000
    logits = (torch.randn(requests, vocab, generator=g) * 2).to(dtype)
    bitmask = random_bitmask(requests, vocab, g, "mixed")
    params = dict(
        temperature=torch.tensor([0.7, 1.0, 1.3, 0.5]),
        top_k=torch.tensor([0, 5, 20, 3]),
        top_p=torch.tensor([0.9, 1.0, 0.6, 1.0]),
        min_p=torch.tensor([0.0, 0.2, 0.0, 0.05]),
    )
    expected = sampling_reference(logits, bitmask=bitmask, **params)
    batch = logits.repeat_interleave(n, 0)
    tokens = lp.sample(
        batch,
        **{k: v.repeat_interleave(n) for k, v in params.items()},
        seed=5,
        bitmask=bitmask.repeat_interleave(n, 0),
    ).view(requests, n)
    for r in range(requests):
        counts = torch.bincount(tokens[r], minlength=vocab).double()
        assert (counts / n - expected[r]).abs().max() < 0.006, r  # sigma <= 1.6e-3 at 100k draws
        assert chi_square_p_value(counts, expected[r] * n) > 1e-4, r


def _assert_in_kept_set(tokens, logits, slack=1e-4, **kwargs):
    loose = sampling_reference(logits, slack=slack, **kwargs) > 0
    for b, t in enumerate(tokens.tolist()):
        if not loose[b].any():
            assert t == -1, b
        else:
            assert 0 <= t < logits.shape[1] and loose[b, t], (b, t)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 33, 1000, 32000])
def test_token_always_in_reference_kept_set(lp_variant, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[::7, : vocab // 2] = logits[::7, :1]  # ties at every cutoff
    bitmask = random_bitmask(rows, vocab, g, "words")
    params = random_row_params(rows, g)
    for seed in range(3):
        tokens = lp_variant.sample(logits, seed=seed, offset=seed, bitmask=bitmask, **params)
        _assert_in_kept_set(tokens, logits, bitmask=bitmask, **params)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_and_top_k_1_equal_argmax_lowest_index(lp, dtype):
    g = torch.Generator().manual_seed(103)
    logits = torch.randn(50, 3000, generator=g).to(dtype)
    logits[:, 2000] = logits.max() + 1
    logits[:, 100] = logits[:, 2000]  # tie: the lower index wins
    logits[3, 100] = float("nan")  # NaN is -inf: row 3's argmax is 2000
    expected = torch.full((50,), 100)
    expected[3] = 2000
    assert torch.equal(lp.sample(logits, temperature=0.0), expected)
    assert torch.equal(lp.sample(logits, temperature=-1.0), expected)
    assert torch.equal(lp.sample(logits, temperature=torch.full((50,), float("nan"))), expected)
    logits[:, 100] -= 0.5  # no tie: top_k = 1 keeps exactly the argmax
    assert torch.equal(lp.sample(logits, top_k=1, seed=1), torch.full((50,), 2000))


def test_determinism_and_offset(lp):
    g = torch.Generator().manual_seed(104)
    logits = torch.randn(32, 5000, generator=g)
    a = lp.sample(logits, seed=11, offset=3)
    assert torch.equal(a, lp.sample(logits, seed=11, offset=3))
    assert (a != lp.sample(logits, seed=11, offset=4)).float().mean() > 0.9
    assert (a != lp.sample(logits, seed=12, offset=3)).float().mean() > 0.9
    offsets = torch.arange(32)
    assert torch.equal(lp.sample(logits, seed=11, offset=offsets)[3], lp.sample(logits[3:4].expand(32, -1).contiguous(), seed=11, offset=3)[3])


def test_per_row_seeds_follow_the_request_across_batches(lp):
    """A request keyed by its own seed draws the same tokens whatever row and batch it is in."""
    g = torch.Generator().manual_seed(105)
    logits = torch.randn(16, 2000, generator=g)
    seeds = torch.randint(0, 2**62, (16,), generator=g)
    offsets = torch.randint(0, 1000, (16,), generator=g)
    params = dict(temperature=torch.rand(16, generator=g) + 0.5, top_p=torch.rand(16, generator=g))
    full = lp.sample(logits, seed=seeds, offset=offsets, **params)
    perm = torch.randperm(16, generator=g)
    shuffled = lp.sample(logits[perm], seed=seeds[perm], offset=offsets[perm], **{k: v[perm] for k, v in params.items()})
    assert torch.equal(shuffled, full[perm])
    alone = lp.sample(logits[5:6], seed=seeds[5:6], offset=offsets[5:6], **{k: v[5:6] for k, v in params.items()})
    assert alone.item() == full[5].item()


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_bitmask_equals_mask_then_sample(lp, name, dtype):
    g = torch.Generator().manual_seed(106)
    logits = (torch.randn(40, 1500, generator=g) * 2).to(dtype)
    bitmask = random_bitmask(40, 1500, g, "words")
    bitmask[5] = 0  # a fully masked row
    kwargs = dict(FILTERS[name], seed=9, offset=2)
    before = logits.clone()
    fused = lp.sample(logits, bitmask=bitmask, **kwargs)
    assert torch.equal(logits, before)  # the fused bitmask does not write the logits
    masked = lp.apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(fused, lp.sample(masked, **kwargs))
    assert fused[5].item() == -1


def test_edge_cases(lp):
    g = torch.Generator().manual_seed(107)
    x = torch.randn(6, 45, generator=g)
    x[0] = float("-inf")
    x[1] = float("nan")
    x[2, :] = float("nan")
    x[2, 44] = 1.0  # the only finite logit
    x[3, 7] = float("inf")  # +inf wins all the mass
    for kwargs in [dict(), dict(top_k=3), dict(top_p=0.5), dict(min_p=0.5), dict(temperature=0.0)]:
        t = lp.sample(x, **kwargs, seed=1)
        assert t[0] == -1 and t[1] == -1 and t[2] == 44 and t[3] == 7, kwargs
        assert 0 <= t[4] < 45 and 0 <= t[5] < 45
    # Scores that overflow either way stay candidates: clamped to the finite range.
    huge = torch.tensor([[-3e38, -3e38, float("-inf")], [0.0, float("inf"), 1.0]])
    for temperature in [0.5, float("inf")]:
        t = lp.sample(huge, temperature=temperature, seed=5)
        assert 0 <= t[0] < 2 and 0 <= t[1] < 3, temperature
    one = torch.randn(8, 1, generator=g)
    assert torch.equal(lp.sample(one, top_k=5, top_p=0.3, seed=2), torch.zeros(8, dtype=torch.int64))
    ties = torch.zeros(4, 100)
    ties[:, 10:13] = 5.0
    for kwargs in [dict(top_p=0.0), dict(min_p=1.0), dict(top_k=1)]:
        t = lp.sample(ties.repeat(100, 1), **kwargs, seed=3)
        assert set(t.tolist()) == {10, 11, 12}, kwargs  # ties at the cutoff are all kept
    assert torch.equal(lp.sample(x[4:], top_k=1000, seed=4), lp.sample(x[4:], seed=4))  # top_k > V keeps all
    assert torch.equal(lp.sample(x[4:], top_k=-3, top_p=1.0, min_p=-0.5, seed=4), lp.sample(x[4:], seed=4))
    assert lp.sample(torch.empty(0, 10)).shape == (0,)
    assert torch.equal(lp.sample(torch.empty(3, 0)), torch.full((3,), -1))


@pytest.mark.parametrize("vocab", [128256, 256000])
def test_large_vocab_bf16(lp, vocab):
    g = torch.Generator().manual_seed(108)
    logits = (torch.randn(4, vocab, generator=g) * 4).to(torch.bfloat16)
    params = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    tokens = lp.sample(logits, seed=1, **params)
    _assert_in_kept_set(tokens, logits, **params)
    assert torch.equal(lp.sample(logits, temperature=0.0), logits.float().argmax(-1))


def test_out_and_return(lp):
    logits = torch.randn(3, 100)
    out = torch.empty(3, dtype=torch.int64)
    assert lp.sample(logits, seed=1, out=out) is out
    assert torch.equal(out, lp.sample(logits, seed=1))


def test_bad_input_raises_naming_the_argument(lp):
    x = torch.randn(4, 64)
    cases = [
        ("logits", dict(logits=x.double())),
        ("logits", dict(logits=x[0])),
        ("logits", dict(logits=x.t())),
        ("temperature", dict(temperature=float("nan"))),
        ("temperature", dict(temperature=torch.ones(3))),
        ("temperature", dict(temperature=torch.ones(4, dtype=torch.int64))),
        ("temperature", dict(temperature="hot")),
        ("top_k", dict(top_k=2.5)),
        ("top_k", dict(top_k=torch.ones(4))),
        ("top_p", dict(top_p=1.5)),
        ("top_p", dict(top_p=-0.1)),
        ("top_p", dict(top_p=float("nan"))),
        ("min_p", dict(min_p=2.0)),
        ("seed", dict(seed=torch.ones(5, dtype=torch.int64))),
        ("offset", dict(offset=torch.ones(4, 1, dtype=torch.int64))),
        ("bitmask", dict(bitmask=torch.zeros(4, 2, dtype=torch.int64))),
        ("bitmask", dict(bitmask=torch.zeros(3, 2, dtype=torch.int32))),
        ("out", dict(out=torch.empty(4, dtype=torch.int16))),
        ("out", dict(out=torch.empty(5, dtype=torch.int64))),
    ]
    for name, kwargs in cases:
        logits = kwargs.pop("logits", x)
        before = logits.clone()
        with pytest.raises((RuntimeError, TypeError, ValueError)) as info:
            lp.sample(logits, **kwargs)
        assert names_as_subject(str(info.value), name), (name, str(info.value))
        assert torch.equal(logits, before) or torch.isnan(before).any()


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(109)
    logits = torch.randn(4, 300, generator=g)
    bitmask = random_bitmask(4, 300, g, "mixed")
    out = torch.empty(4, dtype=torch.int64)
    no_penalties = (None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None)
    args = (logits, torch.rand(4) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0, "top_k_first", torch.tensor([True, False, True, False]), False, torch.full((4,), 1e-3), 0.0, None, 2e-3,
            torch.full((4,), 1.5), -1.0, torch.full((4,), 6.0), float("inf"), torch.full((4,), 0.9), 1.0, None, 1.0, torch.full((4,), 0.05), 0.1,
            torch.arange(4), 0, None, 3, bitmask,
            *no_penalties, out)
    torch.library.opcheck(lp._ops.ops.sample, args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, m, offset):
        return lp.sample(x * 1.0, temperature=0.7, top_k=20, top_p=0.9, seed=3, offset=offset, bitmask=m)

    offset = torch.full((4,), 5, dtype=torch.int64)
    assert torch.equal(step(logits, bitmask, offset), lp.sample(logits, temperature=0.7, top_k=20, top_p=0.9, seed=3, offset=5, bitmask=bitmask))
