"""Token ids in int32, as vLLM holds them: every op that reads ids takes int32 as well as int64
(the same results), and the sampler ops write int32 ids on request (`ids_dtype`, or int32 `out`
tensors), the same ids as int64. vLLM's per-row top_k is int32 too: read as it is."""

import torch

from harness import bits
from op_cases import random_bias, random_penalties, random_state, tree_penalty_case
from test_verify_tree import PARENTS, tree_links

V = 45


def test_sampler_outputs_in_int32(lp):
    """The sampled tokens, the top-N, the ids past the support (written after the kernel) and -1
    for a row with nothing allowed: the int64 ids, in int32; the rest of the result unchanged."""
    g = torch.Generator().manual_seed(203)
    logits = torch.randn(6, 3000, generator=g) * 2
    logits[1] = float("-inf")  # nothing allowed: token -1
    params = dict(temperature=0.8, top_k=torch.tensor([0, 3, 40, 3, 0, 1]), seed=torch.arange(6))
    wide, wide_kept = lp.sample_with_logprobs(logits, **params, num_logprobs=8, return_kept=16)
    narrow, narrow_kept = lp.sample_with_logprobs(logits, **params, num_logprobs=8, return_kept=16,
                                                  ids_dtype=torch.int32)
    for field in ("tokens", "logprob_token_ids"):
        assert getattr(narrow, field).dtype == torch.int32, field
        assert torch.equal(getattr(narrow, field).long(), getattr(wide, field)), field
    assert torch.equal(bits(narrow.logprobs), bits(wide.logprobs)) and torch.equal(narrow.ranks, wide.ranks)
    assert all(torch.equal(a, b) for a, b in zip(narrow_kept, wide_kept))
    assert wide.tokens[1] == -1 and (wide.logprob_token_ids[3, 4:] >= 0).all()  # (filled past top_k = 3)
    tokens = torch.full((6,), 7, dtype=torch.int32)
    assert lp.sample(logits, **params, out=tokens) is tokens and torch.equal(tokens.long(), wide.tokens)
    assert torch.equal(lp.sample(logits, **params, ids_dtype=torch.int32).long(), wide.tokens)
    out = lp.SampleWithLogprobs(torch.full((6,), 7, dtype=torch.int32), torch.empty(6, 9),
                                torch.full((6, 9), 7, dtype=torch.int32), torch.empty(6, dtype=torch.int64))
    lp.sample_with_logprobs(logits, **params, num_logprobs=8, out=out)
    assert torch.equal(out.logprob_token_ids.long(), wide.logprob_token_ids)


def test_int32_top_k_reads_as_int64(lp):
    """A per-row int32 top_k (vLLM's SamplingMetadata.top_k) gives every sampler op the int64
    one's results, bit for bit: 0 and negative (off), 1, ties at the cut, past V."""
    g = torch.Generator().manual_seed(205)
    rows, vocab = 8, 600
    logits = (torch.randn(rows, vocab, generator=g) * 2).round()  # (rounded: ties at the cutoffs)
    top_k = torch.tensor([0, 1, 5, 17, -3, vocab + 9, 2, 40])
    params = dict(temperature=0.9, top_p=0.95, seed=torch.arange(rows), offset=3)
    for order in ("joint", "top_k_first"):
        wide = dict(params, top_k=top_k, filter_apply_order=order)
        narrow = dict(params, top_k=top_k.int(), filter_apply_order=order)
        assert torch.equal(lp.sample(logits, **narrow), lp.sample(logits, **wide)), order
        (got, got_kept), (expected, expected_kept) = (
            lp.sample_with_logprobs(logits, **narrow, num_logprobs=3, return_kept=64),
            lp.sample_with_logprobs(logits, **wide, num_logprobs=3, return_kept=64))
        for a, b in [*zip(got, expected), *zip(got_kept, expected_kept)]:
            assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)
        drawless = {k: v for k, v in wide.items() if k not in ("seed", "offset")}
        assert torch.equal(bits(lp.filtered_probs(logits, **dict(drawless, top_k=top_k.int()))),
                           bits(lp.filtered_probs(logits, **drawless))), order
        target = logits[:, None].expand(rows, 3, vocab).contiguous()
        drafts = torch.randint(0, vocab, (rows, 2), generator=g)
        assert all(torch.equal(a, b) for a, b in zip(lp.verify_draft(target, drafts, **narrow),
                                                     lp.verify_draft(target, drafts, **wide))), order


def test_top_k_of_the_width_or_more_is_off(lp):
    """vLLM's "off" is top_k = vocab_size (the plugin passes it through): a per-row top_k >= V,
    int32 or int64, gives every sampler op the results of top_k = 0."""
    g = torch.Generator().manual_seed(206)
    rows, vocab = 6, 500
    logits = torch.randn(rows, vocab, generator=g) * 2
    for dtype in (torch.int32, torch.int64):
        top_k = torch.tensor([vocab, vocab + 1, 2**31 - 1, 0, vocab, 7], dtype=dtype)
        off = torch.where(top_k >= vocab, 0, top_k)
        for order in ("joint", "top_k_first"):
            params = dict(temperature=1.1, top_p=0.9, seed=torch.arange(rows) + 5, filter_apply_order=order)
            assert torch.equal(lp.sample(logits, top_k=top_k, **params), lp.sample(logits, top_k=off, **params))
            (got, got_kept), (expected, expected_kept) = (
                lp.sample_with_logprobs(logits, top_k=top_k, **params, num_logprobs=2, return_kept=vocab),
                lp.sample_with_logprobs(logits, top_k=off, **params, num_logprobs=2, return_kept=vocab))
            for a, b in [*zip(got, expected), *zip(got_kept, expected_kept)]:
                assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)


def test_penalty_state_and_biases_from_int32_ids(lp):
    """penalty_state_from_tokens, update_output_counts_ and logit_bias_ids read int32 ids as
    the int64 ones (-1 padding included)."""
    g = torch.Generator().manual_seed(204)
    rows = 8
    prompt = torch.randint(-1, V, (rows, 12), generator=g)
    output = torch.randint(-1, V, (rows, 20), generator=g)
    state = lp.penalty_state_from_tokens(prompt, output, V)
    narrow = lp.penalty_state_from_tokens(prompt.int(), output.int(), V)
    assert all(torch.equal(a, b) for a, b in zip(narrow, state))
    step = torch.randint(0, V, (rows,), generator=g)
    lp.update_output_counts_(state.output_counts, step)
    lp.update_output_counts_(narrow.output_counts, step.int())
    assert torch.equal(narrow.output_counts, state.output_counts)
    bias = random_bias(rows, V, g)
    kwargs = dict(random_penalties(rows, (True, True, True, False), True, g), **bias)
    logits = torch.randn(rows, V, generator=g) * 3
    expected = lp.sample(logits, seed=3, penalties=lp.Penalties(*state, **kwargs))
    kwargs["logit_bias_ids"] = kwargs["logit_bias_ids"].int()
    assert torch.equal(lp.sample(logits, seed=3, penalties=lp.Penalties(*state, **kwargs)), expected)


def test_verify_reads_int32_drafts(lp_cpu):
    """verify_draft and verify_tree (with path penalties, which count the drafts) take int32
    draft ids: the int64 drafts' tokens."""
    g = torch.Generator().manual_seed(205)
    rows = 32
    target = torch.randn(rows, 5, V, generator=g) * 2
    drafts = torch.randint(0, V, (rows, 4), generator=g)
    prompt_mask, counts = random_state(rows, V, g)
    penalties = lp_cpu.Penalties(prompt_mask, counts, repetition_penalty=1.3, frequency_penalty=0.4)
    call = dict(temperature=0.8, top_k=10, seed=torch.arange(rows), penalties=penalties)
    expected = lp_cpu.verify_draft(target, drafts, **call)
    got = lp_cpu.verify_draft(target, drafts.int(), **call)
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.num_accepted, expected.num_accepted)
    tree_target, tree_drafts, q, prompt_mask, counts, kwargs = tree_penalty_case(
        g, rows, PARENTS, V, (True, True, True, True), True, False, sampled=True)
    links = tree_links(PARENTS, rows)
    call = dict(draft_probs=q, temperature=0.9, seed=torch.arange(rows),
                penalties=lp_cpu.Penalties(prompt_mask, counts, **kwargs))
    expected = lp_cpu.verify_tree(tree_target, tree_drafts, *links, **call)
    got = lp_cpu.verify_tree(tree_target, tree_drafts.int(), *links, **call)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert expected.num_accepted.max() >= 1  # drafts were read, not only the root
