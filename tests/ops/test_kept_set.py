"""sample_with_logprobs(..., return_kept=K): the kept set each token was drawn from, against the
float64 reference's (tests/reference.py: sampling_reference, whose nonzero probabilities are
its kept set), through the loader; and its replay by token_logprobs(..., support=).
"""

import math

import pytest
import torch

from harness import schema_order
from op_cases import FILTERS, random_state
from reference import (pack_bitmask, penalties_reference, random_bitmask, sampling_reference, unpack_bitmask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FILTERS = {**FILTERS, "top_k_large": dict(top_k=900)}


def case(rows, vocab, dtype, g):
    """Logits whose spread stays within float64's range at every temperature (so the
    reference's nonzero probabilities are its whole kept set), with ties at cutoffs, NaN and
    -inf columns, fully masked and greedy rows."""
    x = torch.randn(rows, vocab, generator=g) * 2
    x[1::6, :40] = x[1::6, :1]  # ties at every cutoff
    x[::7, ::9] = float("nan")
    x[3::10, ::2] = float("-inf")
    temperature = torch.rand(rows, generator=g) + 0.3
    temperature[::5] = 0.0  # greedy rows: the argmax alone
    bitmask = random_bitmask(rows, vocab, g, "words")
    bitmask[4::9] = 0  # nothing allowed: the empty set
    return x.to(dtype), temperature, bitmask


def check_kept(kept, reference, k):
    """The bitmask is the reference's kept set (rows ambiguous at a cutoff skipped by the
    caller); ids its members in top-N order when it has at most K, else all -1; size its size."""
    rows, vocab = reference.shape
    members = unpack_bitmask(kept.bitmask, vocab)
    assert torch.equal(members, reference > 0)
    assert torch.equal(kept.size, members.sum(-1))
    for r in range(rows):
        # Most likely first, ties by lowest id: the reference's probabilities, stable sort.
        order = torch.sort(-reference[r], stable=True).indices[: int(kept.size[r])]
        expected = torch.full((k,), -1, dtype=torch.int64)
        if len(order) <= k:
            expected[: len(order)] = order
        assert torch.equal(kept.ids[r], expected), r


def unambiguous(x, kwargs):
    tight = sampling_reference(x, **kwargs) > 0
    loose = sampling_reference(x, slack=1e-4, **kwargs) > 0
    return (tight == loose).all(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FILTERS))
def test_kept_set_matches_float64_reference(lp, dtype, name):
    g = torch.Generator().manual_seed(len(name) * 7 + DTYPES.index(dtype))
    rows, vocab, k = 30, 1500, 16
    x, temperature, bitmask = case(rows, vocab, dtype, g)
    kwargs = dict(FILTERS[name], temperature=temperature, bitmask=bitmask)
    out, kept = lp.sample_with_logprobs(x, seed=9, return_kept=k, **kwargs)
    plain = lp.sample_with_logprobs(x, seed=9, **kwargs)
    for a, b in zip(out, plain):  # tokens and logprobs unchanged
        assert torch.equal(a, b)
    clear = unambiguous(x, kwargs)
    assert clear.sum() >= rows // 2
    reference = sampling_reference(x, **kwargs)
    check_kept(type(kept)(*(t[clear] for t in kept)), reference[clear], k)
    # The token is always in its set; greedy rows' set is the token alone.
    drawn = out.tokens >= 0
    assert unpack_bitmask(kept.bitmask, vocab)[drawn].gather(1, out.tokens[drawn, None]).all()
    greedy = ~(temperature > 0) & drawn
    assert (kept.size[greedy] == 1).all() and torch.equal(kept.ids[greedy, 0], out.tokens[greedy])
    assert (kept.size[~drawn] == 0).all()


def test_kept_set_with_penalties(lp):
    g = torch.Generator().manual_seed(12)
    rows, vocab = 12, 700
    x, temperature, bitmask = case(rows, vocab, torch.bfloat16, g)
    prompt_mask, output_counts = random_state(rows, vocab, g)
    penalties = lp.Penalties(prompt_mask, output_counts, repetition_penalty=1.3, frequency_penalty=0.2,
                             presence_penalty=0.1)
    kwargs = dict(temperature=temperature, top_k=20, top_p=0.9, bitmask=bitmask)
    _, kept = lp.sample_with_logprobs(x, seed=1, penalties=penalties, return_kept=8, **kwargs)
    penalised = penalties_reference(x, prompt_mask, output_counts, 1.3, 0.2, 0.1)
    clear = unambiguous(penalised, kwargs)
    check_kept(type(kept)(*(t[clear] for t in kept)), sampling_reference(penalised, **kwargs)[clear], 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_of_the_kept_set_is_the_samplers_logprob(lp, dtype):
    """The whole loop: the kept set passed back as support (the KeptSet itself, or either of its
    layouts) replays column 0 bit for bit on the rollout's logits, for every row that is not
    greedy (a greedy row's column 0 is over its unfiltered distribution, its kept set the token
    alone: logprob 0)."""
    g = torch.Generator().manual_seed(20 + DTYPES.index(dtype))
    rows, vocab = 40, 3000
    x, temperature, bitmask = case(rows, vocab, dtype, g)
    out, kept = lp.sample_with_logprobs(x, temperature, top_k=50, top_p=0.9, min_p=0.01, seed=4, bitmask=bitmask,
                                        return_kept=64)
    sampled = (temperature > 0) & (out.tokens >= 0)
    for support in (kept, kept.bitmask, kept.ids):
        replayed = lp.token_logprobs(x, out.tokens, temperature, support=support)
        assert torch.equal(replayed[sampled].view(torch.int32), out.logprobs[sampled, 0].view(torch.int32))
        assert (replayed[~sampled & (out.tokens >= 0)] == 0).all()
        assert (replayed[out.tokens < 0] == -math.inf).all()


def test_a_set_larger_than_k_fills_the_bitmask_only(lp):
    """A set of more than K tokens: its ids all -1 (a partial list would replay as a smaller
    set), the bitmask whole; K = its size: every id."""
    x = torch.zeros(2, 100)  # every token tied: all kept
    out, kept = lp.sample_with_logprobs(x, return_kept=5)
    assert torch.equal(kept.size, torch.tensor([100, 100]))
    assert (kept.ids == -1).all()
    assert torch.equal(lp.sample_with_logprobs(x, return_kept=100)[1].ids, torch.arange(100).expand(2, 100))
    assert (unpack_bitmask(kept.bitmask, 100)).all()
    assert torch.equal(pack_bitmask(torch.ones(2, 100, dtype=torch.bool)), kept.bitmask)


@pytest.mark.parametrize("k,error,message", [(0, RuntimeError, r"return_kept must be in \[1, 100\]"),
                                             (101, RuntimeError, r"return_kept must be in \[1, 100\]"),
                                             (2.0, TypeError, "return_kept must be an int")])
def test_bad_k_raises(lp, k, error, message):
    with pytest.raises(error, match=message):
        lp.sample_with_logprobs(torch.randn(2, 100), return_kept=k)


def test_out_takes_the_pair_the_call_returns(lp):
    """With return_kept, `out=` is the (SampleWithLogprobs, KeptSet) pair: written in place, the
    same bits as a call without it; a lone SampleWithLogprobs or a kept set of the wrong K is
    refused, naming `out` or the kept output."""
    g = torch.Generator().manual_seed(77)
    x = torch.randn(6, 500, generator=g)
    fresh, fresh_kept = lp.sample_with_logprobs(x, 0.8, top_k=30, top_p=0.9, seed=5, num_logprobs=3, return_kept=16)
    out = lp.SampleWithLogprobs(*(torch.full_like(t, 7) for t in fresh))
    kept = lp.KeptSet(*(torch.full_like(t, 7) for t in fresh_kept))
    result, result_kept = lp.sample_with_logprobs(x, 0.8, top_k=30, top_p=0.9, seed=5, num_logprobs=3,
                                                  return_kept=16, out=(out, kept))
    assert all(a is b for a, b in zip(result + result_kept, out + kept))
    assert all(torch.equal(a, b) for a, b in zip(out + kept, fresh + fresh_kept))
    with pytest.raises(TypeError, match="out: with return_kept, the pair"):
        lp.sample_with_logprobs(x, 0.8, num_logprobs=3, return_kept=16, out=out)
    with pytest.raises(RuntimeError, match="kept_ids"):
        lp.sample_with_logprobs(x, 0.8, num_logprobs=3, return_kept=8, out=(out, kept))


def test_opcheck_and_compile(lp):
    """opcheck of the kept set's op and of the replay's two ops, and sample_with_logprobs(return_kept=)
    with token_logprobs(support=kept) in one fullgraph compile, equal to eager."""
    g = torch.Generator().manual_seed(707)
    rows, vocab = 4, 300
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    ops = lp._ops.ops
    no_penalties = dict(prompt_mask=None, output_counts=None, repetition_penalty=None, repetition_penalty_value=1.0,
                        frequency_penalty=None, frequency_penalty_value=0.0, presence_penalty=None,
                        presence_penalty_value=0.0, logit_bias_ids=None, logit_bias_values=None, penalty_order="vllm",
                        penalty_rows=None)
    kept = (torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32), torch.empty(rows, 8, dtype=torch.int64),
            torch.empty(rows, dtype=torch.int64))
    torch.library.opcheck(ops.sample_with_kept, schema_order(
        ops.sample_with_kept, logits=logits, temperature=torch.rand(rows, generator=g) + 0.5, temperature_value=1.0,
        top_k=None, top_k_value=20, top_p=None, top_p_value=0.9, min_p=None, min_p_value=0.0,
        filter_apply_order="joint", temperature_last=torch.arange(rows) % 2 == 0, temperature_last_value=False,
        epsilon_cutoff=torch.full((rows,), 1e-4), epsilon_cutoff_value=0.0,
        eta_cutoff=None, eta_cutoff_value=2e-3, top_n_sigma=torch.full((rows,), 2.0), top_n_sigma_value=-1.0,
        mirostat_mu=torch.full((rows,), 9.0), mirostat_mu_value=float("inf"), typical_p=torch.full((rows,), 0.95),
        typical_p_value=1.0, xtc_probability=None, xtc_probability_value=0.5, xtc_threshold=torch.full((rows,), 0.05), xtc_threshold_value=0.1, seed=torch.arange(rows), seed_value=0, offset=None, offset_value=3,
        bitmask=bitmask, **no_penalties, num_logprobs=2, logprobs_mode="processed", rank_ties="min", kept_k=8,
        tokens=torch.empty(rows, dtype=torch.int64), logprobs=torch.empty(rows, 3),
        logprob_token_ids=torch.empty(rows, 3, dtype=torch.int64), ranks=torch.empty(rows, dtype=torch.int64),
        kept_bitmask=kept[0], kept_ids=kept[1], kept_size=kept[2]))
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    replay = dict(logits=logits, token_ids=tokens, temperature=None, temperature_value=0.8, support_bitmask=kept[0],
                  support_ids=None)
    logprobs, entropy, normaliser = torch.empty(rows), torch.empty(rows), torch.empty(rows, 3, dtype=torch.float64)
    torch.library.opcheck(ops.support_logprobs, schema_order(ops.support_logprobs, **replay, logprobs=logprobs,
                                                             entropy=entropy, normaliser=normaliser))
    ops.support_logprobs(*schema_order(ops.support_logprobs, **replay, logprobs=logprobs, entropy=entropy,
                                       normaliser=normaliser))
    torch.library.opcheck(ops.support_logprobs_backward, schema_order(
        ops.support_logprobs_backward, grad_logprobs=torch.randn(rows, generator=g),
        grad_entropy=torch.randn(rows, generator=g), **replay, logprobs=logprobs, entropy=entropy,
        normaliser=normaliser, grad_logits=torch.empty(rows, vocab)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, m):
        drawn, kept_set = lp.sample_with_logprobs(x * 1.0, temperature=0.7, top_k=20, top_p=0.9, seed=3, bitmask=m,
                                                  return_kept=8)
        return drawn, kept_set, lp.token_logprobs(x * 1.0, drawn.tokens, temperature=0.7, support=kept_set)

    drawn, kept_set, replayed = step(logits, bitmask)
    eager, eager_kept = lp.sample_with_logprobs(logits, temperature=0.7, top_k=20, top_p=0.9, seed=3, bitmask=bitmask,
                                                return_kept=8)
    assert all(torch.equal(a, b) for a, b in zip((*drawn, *kept_set), (*eager, *eager_kept)))
    assert torch.equal(replayed, eager.logprobs[:, 0])
