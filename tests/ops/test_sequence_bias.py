"""sequence_bias (transformers' sequence_bias as logit biases) against an independent Python
reference (tests/reference.py's sequence_bias_reference), transformers' own
SequenceBiasLogitsProcessor (with the repetition penalty after it, as generate() orders them),
and the sampler reading the entries as fused logit biases. tests/cuda_emulation/
test_constraints_cuda.py runs the same cases through the CUDA kernel."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from op_cases import assert_greedy_walk, per_position_case, sequence_bias_case
from reference import sequence_bias_reference


def no_state(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32), torch.zeros(rows, vocab, dtype=torch.int32)


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("vocab", [1, 4, 50, 70001])
def test_matches_reference(lp, vocab, dtype, per_row):
    """Random rows (some shorter than the sequences, some empty), sequences that complete, merge
    into one entry (several ending in one id), or are padding only: the reference's entries."""
    g = torch.Generator().manual_seed(vocab * 3 + per_row)
    matched = merged = 0
    for _ in range(6):
        kwargs = sequence_bias_case(9, vocab, g, dtype, per_row)
        ids, values = lp.sequence_bias(**kwargs, vocab_size=vocab)
        expected_ids, expected_values = sequence_bias_reference(**kwargs, vocab=vocab)
        assert torch.equal(ids, expected_ids) and torch.equal(values, expected_values)
        matched += int((ids >= 0).sum())
        counts = lp.sequence_bias(**{**kwargs, "biases": torch.ones_like(kwargs["biases"])}, vocab_size=vocab)[1]
        merged += int((counts > 1).sum())  # entries holding several sequences' biases
    assert matched > 0 and merged > 0, "the cases completed no sequence, or merged none"


def transformers_order(sequence_bias: list) -> list:
    """The order transformers sums a token's biases in: one-id sequences first, then grouped by
    prefix length in the order each length first occurs (SequenceBiasLogitsProcessor)."""
    lengths = list(dict.fromkeys(len(s) for s, _ in sequence_bias if len(s) > 1))
    return [e for e in sequence_bias if len(e[0]) == 1] + \
        [e for m in lengths for e in sequence_bias if len(e[0]) == m]


@pytest.mark.parametrize("length", [1, 2, 3, 8])
def test_matches_transformers_with_repetition_penalty(lp, length):
    """SequenceBiasLogitsProcessor then RepetitionPenaltyLogitsProcessor (generate()'s order) on
    random scores equal apply_penalties_ with the entries as logit biases, bit for bit, and the
    sampler with them fused draws what it draws from transformers' scores."""
    g = torch.Generator().manual_seed(length)
    vocab, rows = 30, 8
    input_ids = torch.randint(0, 3, (rows, length), generator=g)
    sequence_bias = [[[2], 1.5], [[0, 1], -2.25], [[1, 1], 0.75], [[2, 1], 3.0], [[0, 0, 2], -1.0],
                     [[1, 2, 1], 0.5], [[7], -math.inf], [[1, 2, 0, 1, 2, 9], 4.0]]
    sequence_bias = transformers_order(sequence_bias)
    processors = LogitsProcessorList([SequenceBiasLogitsProcessor(sequence_bias),
                                      RepetitionPenaltyLogitsProcessor(1.3)])
    sequences = torch.tensor([s + [-1] * (6 - len(s)) for s, _ in sequence_bias])
    biases = torch.tensor([b for _, b in sequence_bias])
    ids, values = lp.sequence_bias(input_ids, sequences, biases, vocab)
    multi = torch.tensor([len(s) > 1 for s, _ in sequence_bias])
    assert (ids[:, multi] >= 0).sum() >= rows, "few sequences of several ids completed"
    state = lp.penalty_state_from_tokens(input_ids, torch.empty(rows, 0, dtype=torch.int64), vocab)
    penalties = lp.Penalties(*state, repetition_penalty=1.3, logit_bias_ids=ids, logit_bias_values=values)
    for _ in range(3):
        scores = torch.randn(rows, vocab, generator=g) * 4
        expected = processors(input_ids, scores.clone())
        got = lp.apply_penalties_(scores.clone(), *state, 1.3, logit_bias_ids=ids, logit_bias_values=values)
        assert torch.equal(got, expected)
        seed = torch.randint(0, 2**62, (rows,), generator=g)
        assert torch.equal(lp.sample(scores, temperature=0.8, top_k=10, seed=seed, penalties=penalties),
                           lp.sample(expected, temperature=0.8, top_k=10, seed=seed))


def test_per_position_biases_in_verify_draft(lp):
    """The recipe of docs/semantics-constraints.md: sequence_bias on rows (b, j) holding the
    request's tokens then drafts 0 .. j - 1, viewed as verify_draft's per-position bias lists
    [B, S + 1, N]. Greedy rows accept while the biased target prefers each draft, then emit the
    argmax of the biased row: the reference walks the positions one by one with transformers'
    SequenceBiasLogitsProcessor on each position's tokens."""
    g = torch.Generator().manual_seed(12)
    rows, drafts_count, vocab, length = 16, 4, 30, 6
    sequence_bias = transformers_order([[[0, 1], 6.0], [[1, 2, 0], -9.0], [[2], 1.5], [[0, 0], -7.0]])
    history, drafts, target, sequences = per_position_case(g, rows, drafts_count, vocab, length, 4.0)
    words = torch.tensor([w + [-1] * (3 - len(w)) for w, _ in sequence_bias])
    ids, values = lp.sequence_bias(sequences.view(rows * (drafts_count + 1), -1), words,
                                   torch.tensor([b for _, b in sequence_bias]), vocab)
    penalties = lp.Penalties(*no_state(rows, vocab), logit_bias_ids=ids.view(rows, drafts_count + 1, -1),
                             logit_bias_values=values.view(rows, drafts_count + 1, -1))
    got = lp.verify_draft(target, drafts, temperature=0.0, penalties=penalties)
    processor = SequenceBiasLogitsProcessor(sequence_bias)
    assert_greedy_walk(got, drafts, lambda b, j: int(processor(torch.cat([history[b], drafts[b, :j]])[None],
                                                               target[b, j][None].clone())[0].argmax()))
    row_only = lp.Penalties(*no_state(rows, vocab), logit_bias_ids=ids.view(rows, drafts_count + 1, -1)[:, 0],
                            logit_bias_values=values.view(rows, drafts_count + 1, -1)[:, 0])
    assert not torch.equal(got.tokens, lp.verify_draft(target, drafts, temperature=0.0, penalties=row_only).tokens)


def test_sums_in_list_order(lp):
    """Three sequences completed at token 9, biases 2^24, -2^24 and 1: the float32 sum depends on
    the order (2^24 + 1 rounds to 2^24). In list order from 0 here; in transformers' order (the
    one-id sequence first) after transformers_order, as SequenceBiasLogitsProcessor sums them."""
    given = [[[2, 9], 2.0**24], [[1, 2, 9], -(2.0**24)], [[9], 1.0]]
    input_ids = torch.tensor([[5, 1, 2]])
    scores = torch.zeros(1, 12)
    expected = SequenceBiasLogitsProcessor(given)(input_ids, scores.clone())
    assert expected[0, 9] == 0.0  # transformers: (1 + 2^24) - 2^24

    def entries(sequence_bias):
        sequences = torch.tensor([s + [-1] * (3 - len(s)) for s, _ in sequence_bias])
        return lp.sequence_bias(input_ids, sequences, torch.tensor([b for _, b in sequence_bias]), 12)

    ids, values = entries(given)
    assert ids.tolist() == [[9, -1, -1]] and values[0].tolist() == [1.0, 0.0, 0.0]  # (2^24 - 2^24) + 1
    ids, values = entries(transformers_order(given))
    assert ids.tolist() == [[9, -1, -1]] and values[0].tolist() == [0.0, 0.0, 0.0]
    state = no_state(1, 12)
    got = lp.apply_penalties_(scores.clone(), *state, logit_bias_ids=ids, logit_bias_values=values)
    assert torch.equal(got, expected)


def test_out_columns_beside_logit_biases(lp):
    """out= as columns of a wider bias buffer, the request's own logit biases in the others:
    both apply; the other columns are not written."""
    g = torch.Generator().manual_seed(2)
    kwargs = sequence_bias_case(5, 40, g)
    bias_ids = torch.full((5, 10), -1, dtype=torch.int64)
    bias_values = torch.zeros(5, 10)
    bias_ids[:, :3] = torch.randint(0, 40, (5, 3), generator=g)
    bias_values[:, :3] = torch.randn(5, 3, generator=g)
    before = bias_ids[:, :3].clone(), bias_values[:, :3].clone()
    out = lp.sequence_bias(**kwargs, vocab_size=40, out=(bias_ids[:, 3:], bias_values[:, 3:]))
    assert out[0].data_ptr() == bias_ids[:, 3:].data_ptr()
    expected = sequence_bias_reference(**kwargs, vocab=40)
    assert torch.equal(bias_ids[:, 3:], expected[0]) and torch.equal(bias_values[:, 3:], expected[1])
    assert torch.equal(bias_ids[:, :3], before[0]) and torch.equal(bias_values[:, :3], before[1])
    logits = torch.randn(5, 40, generator=g)
    both = lp.apply_penalties_(logits.clone(), *no_state(5, 40), logit_bias_ids=bias_ids,
                               logit_bias_values=bias_values)
    own = lp.apply_penalties_(logits.clone(), *no_state(5, 40), logit_bias_ids=bias_ids[:, :3].contiguous(),
                              logit_bias_values=bias_values[:, :3].contiguous())
    sequence = lp.apply_penalties_(own, *no_state(5, 40), logit_bias_ids=expected[0], logit_bias_values=expected[1])
    assert torch.equal(both, sequence)


def test_edges(lp):
    """No history (only one-id sequences apply), a sequence exactly as long as history + 1, one
    longer (never), sequences of padding only, an empty set of sequences, no rows."""
    vocab = 10
    sequences = torch.tensor([[4, -1, -1], [1, 2, 3], [2, 3, -1], [-1, -1, -1], [0, 1, 2]])
    biases = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    token_ids = torch.tensor([[-1, -1], [1, 2], [2, -1]])
    ids, values = lp.sequence_bias(token_ids, sequences, biases, vocab)
    assert ids.tolist() == [[4, -1, -1, -1, -1], [4, 3, -1, -1, -1], [4, -1, 3, -1, -1]]
    # (row 1: [1, 2, 3] and [2, 3] both complete at 3, summed into the first entry)
    assert values.tolist() == [[1.0, 0, 0, 0, 0], [1.0, 5.0, 0, 0, 0], [1.0, 0, 3.0, 0, 0]]
    ids, values = lp.sequence_bias(torch.zeros(3, 0, dtype=torch.int64), sequences, biases, vocab)
    assert ids[:, 0].tolist() == [4, 4, 4] and (ids[:, 1:] == -1).all()
    ids, values = lp.sequence_bias(token_ids, torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0), vocab)
    assert ids.shape == (3, 0) and values.shape == (3, 0)
    ids, values = lp.sequence_bias(torch.zeros(0, 2, dtype=torch.int64), sequences, biases, vocab)
    assert ids.shape == (0, 5)


BAD = [
    (dict(vocab_size=0), "vocab_size must lie in"),
    (dict(vocab_size=40.0), "vocab_size must be an int"),
    (dict(token_ids=torch.zeros(4, dtype=torch.int64)), "token_ids must be 2-D"),
    (dict(token_ids=torch.zeros(2, 4)), "token_ids must be int64 or int32"),
    (dict(token_ids=torch.full((2, 4), 40)), "token_ids must lie in"),
    (dict(token_ids=torch.tensor([[1, -1, 2, -1], [0, 0, 0, 0]])), "token_ids must be -1 padded at the end"),
    (dict(sequences=torch.tensor([1, 2])), "sequences must be"),
    (dict(sequences=torch.zeros(3, 3, 2, dtype=torch.int64)), "sequences must be"),
    (dict(sequences=torch.zeros(3, 0, dtype=torch.int64)), "sequences must hold at least one id"),
    (dict(sequences=torch.tensor([[1, 99], [1, 2], [3, -1]])), "sequences must lie in"),
    (dict(sequences=torch.tensor([[5, -1, 7], [1, 2, 3], [3, -1, -1]])), "sequences must be -1 padded at the end"),
    (dict(sequences=torch.zeros(3, 2)), "sequences must be int64 or int32"),
    (dict(biases=torch.zeros(2)), "biases must be"),
    (dict(biases=torch.zeros(2, 2)), "biases must be"),
    (dict(biases=torch.zeros(3, dtype=torch.int64)), "biases must be a floating-point tensor"),
    (dict(biases=torch.tensor([0.0, math.nan, 1.0])), "biases must not be NaN"),
    (dict(biases=torch.zeros(3, device="meta")), "biases must be on the token_ids"),
    (dict(out="bad"), "out must be a tuple"),
    (dict(out=(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3))), "out_ids must be Long"),
    (dict(out=(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4))), "out_values must have shape"),
    (dict(out=(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.float64))), "out_values must be"),
    (dict(out=(torch.zeros(3, 2, dtype=torch.int64).t(), torch.zeros(2, 3))), "out_ids must be contiguous"),
    (dict(out=(torch.zeros(1, 3, dtype=torch.int64).expand(2, 3), torch.zeros(2, 3))), "out_ids must not have"),
    (dict(out="aliased"), "out_ids must not share memory with out_values"),
    (dict(out="token_ids"), "token_ids must not share memory with out_ids"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_names_the_argument(lp, change, message):
    g = torch.Generator().manual_seed(3)
    arguments = dict(token_ids=torch.randint(0, 40, (2, 4), generator=g),
                     sequences=torch.tensor([[1, 2], [3, -1], [0, 0]]), biases=torch.randn(3, generator=g),
                     vocab_size=40, out=(torch.full((2, 3), 7, dtype=torch.int64), torch.full((2, 3), 7.0)))
    arguments.update(change)
    if arguments["out"] == "aliased":  # ids and values in one allocation
        buffer = torch.zeros(2, 6, dtype=torch.int64)
        arguments["out"] = (buffer[:, :3], buffer.view(torch.int32).view(torch.float32)[:, :3])
    elif arguments["out"] == "token_ids":  # token_ids that are the output's own memory
        arguments["out"] = (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3))
        arguments["token_ids"] = arguments["out"][0][:, :2]
    before = [t.clone() for t in arguments["out"]] if isinstance(arguments["out"], tuple) else None
    with pytest.raises((RuntimeError, TypeError), match=message):
        lp.sequence_bias(**arguments)
    if before is not None:
        assert all(torch.equal(t, b) for t, b in zip(arguments["out"], before))


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(4)
    kwargs = sequence_bias_case(5, 70, g)
    out = (torch.empty(5, 7, dtype=torch.int64), torch.empty(5, 7))
    torch.library.opcheck(lp._ops.ops.sequence_bias, (kwargs["token_ids"], kwargs["sequences"], kwargs["biases"], 70,
                                                      *out))
    state = no_state(5, 70)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(logits, token_ids, ids, values):
        lp.sequence_bias(token_ids, kwargs["sequences"], kwargs["biases"], 70, out=(ids, values))
        return lp.sample(logits, seed=1, penalties=lp.Penalties(*state, logit_bias_ids=ids, logit_bias_values=values))

    logits = torch.randn(5, 70, generator=g)
    ids, values = lp.sequence_bias(**kwargs, vocab_size=70)
    eager = lp.sample(logits, seed=1, penalties=lp.Penalties(*state, logit_bias_ids=ids, logit_bias_values=values))
    assert torch.equal(step(logits, kwargs["token_ids"], *out), eager)
    assert torch.equal(out[0], ids) and torch.equal(out[1], values)
