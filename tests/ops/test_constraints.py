"""Request constraints (constrain_bitmask_) against an independent Python reference
(tests/reference.py's constraints_reference), transformers' own logits processors, and the
sampler reading the result. tests/cuda_emulation/test_constraints_cuda.py runs the same cases
through the CUDA kernel."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, SuppressTokensLogitsProcessor)

from op_cases import assert_greedy_walk, constraint_case, per_position_case
from reference import constraints_reference, random_bitmask, unpack_bitmask


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("vocab", [1, 5, 33, 1000, 70001])
def test_matches_reference(lp, vocab, dtype, per_row):
    """Every constraint at once, on random rows (some match nothing, some everything), int64 and
    int32 ids, per-row tensors and lists or shared ones: the reference's allowed set. V = 70001:
    the allowed set built in three chunks of 2048 words."""
    g = torch.Generator().manual_seed(vocab * 7 + per_row)
    for _ in range(4 if vocab < 10_000 else 1):
        bitmask, kwargs = constraint_case(9, vocab, g, dtype, per_row)
        expected = constraints_reference(bitmask, vocab, **kwargs)
        got = bitmask.clone()
        assert lp.constrain_bitmask_(got, vocab, **kwargs) is got
        assert torch.equal(unpack_bitmask(got, vocab), expected)
        assert (unpack_bitmask(bitmask, vocab) >= expected).all()
        excluded = (unpack_bitmask(bitmask, vocab) & ~expected).sum()
        assert excluded > 0, "the case excluded nothing"


def transformers_mask(processor, input_ids: torch.Tensor, vocab: int, g: torch.Generator) -> torch.Tensor:
    """bool [B, V]: where `processor` leaves a finite score (True: allowed)."""
    scores = torch.randn(input_ids.shape[0], vocab, generator=g)
    return torch.isfinite(processor(input_ids, scores))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(lp, n):
    g = torch.Generator().manual_seed(n)
    for length in [0, 1, n - 1, n, 9, 30]:
        input_ids = torch.randint(0, 4, (6, length), generator=g)
        expected = transformers_mask(NoRepeatNGramLogitsProcessor(n), input_ids, 50, g)
        bitmask = lp.allocate_token_bitmask(6, 50)
        lp.constrain_bitmask_(bitmask, 50, input_ids, no_repeat_ngram_size=n)
        assert torch.equal(unpack_bitmask(bitmask, 50), expected), (n, length)


def test_bad_words_min_new_tokens_and_suppress_match_transformers(lp):
    g = torch.Generator().manual_seed(5)
    vocab = 40
    words = [[3], [1, 2], [2, 2, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8], [7, 7]]
    bad_words = torch.tensor([w + [-1] * (9 - len(w)) for w in words])
    for length in [0, 1, 2, 5, 12]:
        input_ids = torch.randint(0, 4, (8, length), generator=g)
        if length >= 2:
            input_ids[0, -2:] = torch.tensor([2, 2])
        bitmask = lp.allocate_token_bitmask(8, vocab)
        lp.constrain_bitmask_(bitmask, vocab, input_ids, bad_words=bad_words)
        expected = transformers_mask(NoBadWordsLogitsProcessor(words), input_ids, vocab, g)
        assert torch.equal(unpack_bitmask(bitmask, vocab), expected), length
        for prompt, minimum in [(0, 3), (2, 4), (length, 1), (1, 0)]:
            bitmask = lp.allocate_token_bitmask(8, vocab)
            lp.constrain_bitmask_(bitmask, vocab, input_ids, prompt_lengths=prompt, min_tokens=minimum,
                                  stop_token_ids=torch.tensor([5, 9, -1]))
            processor = MinNewTokensLengthLogitsProcessor(prompt, minimum, [5, 9])
            assert torch.equal(unpack_bitmask(bitmask, vocab), transformers_mask(processor, input_ids, vocab, g))
    bitmask = lp.allocate_token_bitmask(3, vocab)
    lp.constrain_bitmask_(bitmask, vocab, suppress_tokens=torch.tensor([0, 39, 17, 17]))
    processor = SuppressTokensLogitsProcessor([0, 39, 17])
    assert torch.equal(unpack_bitmask(bitmask, vocab), transformers_mask(processor, torch.zeros(3, 1), vocab, g))


def test_sampler_reads_the_constrained_bitmask(lp):
    """The sampler never draws an excluded token; a row with everything excluded gets the
    sampler's fully-masked result, as with an all-zero grammar bitmask."""
    g = torch.Generator().manual_seed(11)
    vocab = 64
    logits = torch.randn(6, vocab, generator=g)
    bitmask = lp.allocate_token_bitmask(6, vocab)
    allowed = torch.full((6, 3), -1)
    allowed[:5] = torch.randint(0, vocab, (5, 3), generator=g)
    allowed[5] = torch.tensor([1, 2, 3])
    suppress = torch.full((6, 3), -1)
    suppress[5] = torch.tensor([1, 2, 3])  # row 5: everything excluded
    lp.constrain_bitmask_(bitmask, vocab, allowed_token_ids=allowed, suppress_tokens=suppress)
    for offset in range(20):
        tokens = lp.sample(logits, seed=2, offset=offset, bitmask=bitmask)
        for b in range(5):
            assert int(tokens[b]) in allowed[b].tolist()
        empty = lp.sample(logits[5:], seed=2, offset=offset, bitmask=torch.zeros(1, 2, dtype=torch.int32))
        assert torch.equal(tokens[5:], empty)
    greedy = lp.sample(logits, temperature=0.0, bitmask=bitmask)
    masked = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(greedy[:5], masked[:5].argmax(-1))


def test_per_position_constraints_in_verify_draft(lp):
    """The recipe of docs/semantics-constraints.md: verify_draft's [B, S + 1, W] bitmask viewed
    as rows, row (b, j) constrained with the request's tokens then drafts 0 .. j - 1. Greedy
    rows whose target prefers each draft accept while the constraints allow it, then emit the
    argmax of the constrained row: the reference walks the positions one by one."""
    g = torch.Generator().manual_seed(8)
    rows, drafts_count, vocab, length = 6, 4, 40, 7
    _, drafts, target, sequences = per_position_case(g, rows, drafts_count, vocab, length, 8.0)
    kwargs = dict(no_repeat_ngram_size=2, bad_words=torch.tensor([[1, 1], [2, 0]]))
    bitmask = lp.allocate_token_bitmask(rows * (drafts_count + 1), vocab)
    lp.constrain_bitmask_(bitmask, vocab, sequences.view(rows * (drafts_count + 1), -1), **kwargs)
    got = lp.verify_draft(target, drafts, temperature=0.0, bitmask=bitmask.view(rows, drafts_count + 1, -1))

    def choose(b, j):
        allowed = constraints_reference(lp.allocate_token_bitmask(1, vocab), vocab, sequences[b, j][None], **kwargs)[0]
        return int(target[b, j].masked_fill(~allowed, float("-inf")).argmax())

    assert_greedy_walk(got, drafts, choose)


def test_device_semantics_of_host_lists_out_of_range(lp):
    """Ids past the vocabulary end a host sequence check: they raise, before anything is written."""
    bitmask = random_bitmask(2, 40, torch.Generator().manual_seed(1))
    before = bitmask.clone()
    with pytest.raises(RuntimeError, match=r"^token_ids must lie in \[0, vocab_size\) or be -1"):
        lp.constrain_bitmask_(bitmask, 40, torch.tensor([[1, 40], [0, 0]]), no_repeat_ngram_size=2)
    assert torch.equal(bitmask, before)


BAD = [
    (dict(bitmask=torch.zeros(2, 2, dtype=torch.int64)), "bitmask must be int32"),
    (dict(bitmask=torch.zeros(2, 3, dtype=torch.int32)), "bitmask must have ceil"),
    (dict(bitmask=torch.zeros(2, dtype=torch.int32)), "bitmask must be 2-D"),
    (dict(vocab_size=0), "vocab_size must lie in"),
    (dict(token_ids=torch.zeros(3, 4, dtype=torch.int64)), "token_ids must be"),
    (dict(token_ids=torch.zeros(2, 4)), "token_ids must be int64 or int32"),
    (dict(token_ids=torch.full((2, 4), -2)), "token_ids must lie in"),
    (dict(min_tokens=-1), "min_tokens must lie in"),
    (dict(min_tokens=torch.tensor([1, -1])), "min_tokens must lie in"),
    (dict(min_tokens=torch.tensor([1, 1, 1])), "min_tokens must be a number or a 1-D tensor of length 2"),
    (dict(min_tokens=2, stop_token_ids=None), "stop_token_ids must be given with min_tokens"),
    (dict(min_tokens=2, token_ids=None), "token_ids must be given with"),
    (dict(no_repeat_ngram_size=2, token_ids=None), "token_ids must be given with"),
    (dict(prompt_lengths=torch.tensor([0.5, 1.0])), "prompt_lengths must be int64 or int32"),
    (dict(stop_token_ids=torch.tensor([[1], [2], [3]])), "stop_token_ids must be"),
    (dict(allowed_token_ids=torch.tensor([[40], [2]])), "allowed_token_ids must lie in"),
    (dict(suppress_tokens=torch.zeros(2, 2, 2, dtype=torch.int64)), "suppress_tokens must be"),
    (dict(bad_words=torch.tensor([1, 2])), "bad_words must be"),
    (dict(bad_words=torch.tensor([[[1, 2]], [[1, 99]]])), "bad_words must lie in"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an int"),
    (dict(token_ids=torch.tensor([[1, -1, 2, -1], [0, 0, 0, 0]])), "token_ids must be -1 padded at the end"),
    (dict(bad_words=torch.tensor([[5, -1, 7]])), "bad_words must be -1 padded at the end"),
    (dict(bitmask=torch.zeros(1, 2, dtype=torch.int32).expand(2, 2)), "bitmask must not have overlapping rows"),
    (dict(bitmask=torch.zeros(3, dtype=torch.int32).as_strided((2, 2), (1, 1))), "bitmask must not have overlapping"),
    (dict(suppress_tokens="bitmask row"), "suppress_tokens must not share memory with bitmask"),
    (dict(suppress_tokens=torch.zeros(2, 2, dtype=torch.int64, device="meta")), "suppress_tokens must be on the bitmask"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_names_the_argument(lp, change, message):
    g = torch.Generator().manual_seed(3)
    arguments = dict(bitmask=random_bitmask(2, 40, g), vocab_size=40, token_ids=torch.randint(0, 40, (2, 4)),
                     min_tokens=1, stop_token_ids=torch.tensor([0, 1]))
    arguments.update(change)
    if isinstance(arguments.get("suppress_tokens"), str):  # a list that is the bitmask's own memory
        arguments["suppress_tokens"] = arguments["bitmask"][0]
    bitmask = arguments["bitmask"]
    before = bitmask.clone()
    with pytest.raises((RuntimeError, TypeError), match=message):
        lp.constrain_bitmask_(**arguments)
    assert torch.equal(bitmask, before)


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(4)
    bitmask, kwargs = constraint_case(5, 70, g)
    torch.library.opcheck(lp._ops.ops.constrain_bitmask_, (
        bitmask.clone(), 70, kwargs["token_ids"], kwargs["prompt_lengths"], 0, kwargs["min_tokens"], 0,
        kwargs["stop_token_ids"], kwargs["allowed_token_ids"], kwargs["suppress_tokens"], kwargs["bad_words"],
        kwargs["no_repeat_ngram_size"], 0))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(logits, bitmask, token_ids):
        lp.constrain_bitmask_(bitmask, 70, token_ids, no_repeat_ngram_size=2, suppress_tokens=kwargs["suppress_tokens"])
        return lp.sample(logits, seed=1, bitmask=bitmask)

    logits = torch.randn(5, 70, generator=g)
    eager = bitmask.clone()
    lp.constrain_bitmask_(eager, 70, kwargs["token_ids"], no_repeat_ngram_size=2, suppress_tokens=kwargs["suppress_tokens"])
    compiled = bitmask.clone()
    assert torch.equal(step(logits, compiled, kwargs["token_ids"]), lp.sample(logits, seed=1, bitmask=eager))
    assert torch.equal(compiled, eager)
