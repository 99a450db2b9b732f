"""dry_bias (llama.cpp's DRY as logit biases) against an independent Python reference written from
llama_sampler_dry_apply (tests/reference.py's dry_bias_reference), llama.cpp's own test cases
(tests/test-sampling.cpp's test_dry), and the sampler reading the entries as fused logit
biases. tests/cuda_emulation/test_constraints_cuda.py runs the same cases through the CUDA kernel."""

from __future__ import annotations

import math

import pytest
import torch

from op_cases import dry_bias_case, dry_bias_op, with_many_breakers
from reference import dry_bias_reference


def no_state(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32), torch.zeros(rows, vocab, dtype=torch.int32)


def assert_matches(got, expected):
    """Ids equal; values equal to within one float32 rounding (the kernel's power is by squaring
    in double, the reference's Python's pow: they may round apart by an ulp)."""
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=2.0**-23, atol=0.0)


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("vocab", [1, 5, 70001])
def test_matches_reference(lp_variant, vocab, dtype, per_row):
    """Random rows (repeats at the end, short and empty rows), breakers of one and two ids, the
    parameters per row or shared: the reference's entries; some rows penalise several tokens and
    some a token whose candidates repeat it by different lengths."""
    g = torch.Generator().manual_seed(vocab * 5 + per_row)
    penalised = 0
    for _ in range(8):
        kwargs = dry_bias_case(9, vocab, g, dtype, per_row)
        got = lp_variant.dry_bias(**kwargs, vocab_size=vocab)
        assert_matches(got, dry_bias_reference(**kwargs, vocab=vocab))
        penalised += int((got[0] >= 0).sum())
    # (vocab 1: every token is 0, a one-id breaker's, so never penalised)
    assert penalised >= 4 or vocab == 1, "the cases penalised too few tokens"


# llama.cpp's tests/test-sampling.cpp, test_dry(probs, last tokens, expected probs, multiplier, base,
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
def test_breaker_table_in_any_order(lp_variant, per_row):
    """48 breakers in no order, first ids repeated: the Python layer's sorted table (the kernels'
    binary search) and the raw op given the table as it is (the scan over every breaker) give the
    reference's entries, and the two tables are looked up differently (the unsorted one would
    be searched wrong)."""
    g = torch.Generator().manual_seed(11 + per_row)
    penalised = unsorted = 0
    for vocab in (50, 70001):
        for _ in range(6):
            kwargs = with_many_breakers(dry_bias_case(9, vocab, g, per_row=per_row), vocab, g)
            expected = dry_bias_reference(**kwargs, vocab=vocab)
            assert_matches(lp_variant.dry_bias(**kwargs, vocab_size=vocab), expected)
            assert_matches(dry_bias_op(lp_variant, kwargs, vocab), expected)
            first = kwargs["sequence_breakers"][..., 0]
            unsorted += int((first[..., 1:] < first[..., :-1]).any())
            penalised += int((expected[0] >= 0).sum())
    assert unsorted == 12 and penalised >= 10, (unsorted, penalised)


# allowed length, penalty_last_n, breakers): the logits ln(probs), DRY, then the softmax.
LLAMA_CPP_CASES = [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
]


@pytest.mark.parametrize("case", LLAMA_CPP_CASES, ids=[str(i) for i in range(len(LLAMA_CPP_CASES))])
def test_llama_cpp_cases(lp_variant, case):
    probs, last, expected, multiplier, base, allowed, last_n, breakers = case
    vocab = len(probs)
    token_ids = torch.tensor([last])
    ids, values = lp_variant.dry_bias(token_ids, vocab, multiplier=multiplier, base=base, allowed_length=allowed,
                                      penalty_last_n=last_n,
                                      sequence_breakers=torch.tensor(breakers) if breakers else None)
    logits = torch.tensor([probs]).log()
    biased = lp_variant.apply_penalties_(logits, *no_state(1, vocab), logit_bias_ids=ids, logit_bias_values=values)
    torch.testing.assert_close(biased.softmax(-1)[0], torch.tensor(expected), rtol=0, atol=1e-6)


def entries(ids_values) -> set:
    """Row 0's (id, value) entries."""
    return {(int(i), float(v)) for i, v in zip(ids_values[0][0], ids_values[1][0]) if i >= 0}


def test_longest_repeat_and_breakers(lp):
    """A token after two earlier repeats counts the longer; a two-id breaker cuts the repeat at its
    end; a one-id breaker is never penalised; the window (penalty_last_n) hides older repeats."""
    vocab = 10
    #                     0  1  2  3  4  5  6  7  8  9 10 11
    token_ids = torch.tensor([[5, 1, 2, 3, 7, 2, 3, 4, 1, 2, 3, -1]])
    ids, values = lp.dry_bias(token_ids, vocab, multiplier=1.0, base=2.0, allowed_length=1)
    # "1 2 3" at 1..3 (followed by 7, repeat 3) and "2 3" at 5..6 (followed by 4, repeat 2)
    assert entries((ids, values)) == {(7, -4.0), (4, -2.0)}
    assert ids[0].tolist().index(7) == 4 and ids[0].tolist().index(4) == 7
    cut = lp.dry_bias(token_ids, vocab, multiplier=1.0, base=2.0, allowed_length=1,
                      sequence_breakers=torch.tensor([[1, 2]]))  # ends at 9: one token after it
    assert entries(cut) == {(7, -1.0), (4, -1.0)}
    single = lp.dry_bias(token_ids, vocab, multiplier=1.0, base=2.0, allowed_length=1,
                         sequence_breakers=torch.tensor([[7, -1], [9, 9]]))
    assert {int(i) for i in single[0][0] if i >= 0} == {4}
    window = lp.dry_bias(token_ids, vocab, multiplier=1.0, base=2.0, allowed_length=1, penalty_last_n=6)
    assert entries(window) == {(4, -2.0)}
    assert_matches(window, dry_bias_reference(token_ids, vocab, 1.0, 2.0, 1, 6))


@pytest.mark.parametrize("pattern", ["constant", "period2", "period3", "random"])
def test_periodic_rows(lp_variant, pattern):
    """Long periodic rows, where every position repeats (the CPU's Z-algorithm reuses its boxes,
    the CUDA kernel compares up to rep_limit): the reference's entries, with and without a window
    and a breaker."""
    g = torch.Generator().manual_seed(len(pattern))
    length = 300
    unit = {"constant": [3], "period2": [1, 4], "period3": [0, 2, 2], "random": None}[pattern]
    row = torch.randint(0, 6, (length,), generator=g) if unit is None else torch.tensor(unit * length)[:length]
    token_ids = torch.stack([row, row.roll(1), row])
    token_ids[2, 250:] = -1
    for kwargs in (dict(), dict(penalty_last_n=40), dict(sequence_breakers=torch.tensor([[2, 2]])),
                   dict(allowed_length=0, base=1.01)):
        kwargs = dict(dict(multiplier=0.5, base=1.1, allowed_length=2), **kwargs)
        assert_matches(lp_variant.dry_bias(token_ids, 6, **kwargs), dry_bias_reference(token_ids, 6, **kwargs))


def test_exponent_cap(lp):
    """base 1e10 and a repeat of 6 past the allowed length: llama.cpp caps the exponent at
    int(88.72 / ln 1e10) = 3 (the power stays within float32), and so does dry_bias; a multiplier
    past FLT_MAX / 1e30 makes the penalty inf (-inf: the token is out)."""
    token_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 9, 0, 1, 2, 3, 4, 5, 6]])
    for multiplier, penalty in ((2.0, 2e30), (1e9, math.inf)):
        ids, values = lp.dry_bias(token_ids, 10, multiplier=multiplier, base=1e10, allowed_length=1)
        assert ids[0].tolist().count(9) == 1 and float(values[ids == 9]) == -float(torch.tensor(penalty))
        assert_matches((ids, values), dry_bias_reference(token_ids, 10, multiplier, 1e10, 1))


def test_off_and_edges(lp):
    """Off: multiplier 0, penalty_last_n 0, a window no longer than the allowed length; no rows,
    no columns, a row of padding; every entry (-1, 0)."""
    token_ids = torch.tensor([[1, 2, 1, 2, 1, 2], [1, 2, 1, 2, -1, -1], [-1] * 6])
    for kwargs in (dict(multiplier=0.0), dict(multiplier=1.0, penalty_last_n=0),
                   dict(multiplier=1.0, penalty_last_n=2, allowed_length=2)):
        ids, values = lp.dry_bias(token_ids, 4, **kwargs)
        assert (ids == -1).all() and (values == 0).all()
    ids, values = lp.dry_bias(token_ids, 4, multiplier=1.0)
    assert ids[0].tolist() == [-1, -1, 1, -1, -1, -1] and ids[1].tolist() == [-1, -1, 1, -1, -1, -1]
    assert (ids[2] == -1).all()
    assert lp.dry_bias(torch.zeros(0, 4, dtype=torch.int64), 4, multiplier=1.0)[0].shape == (0, 4)
    assert lp.dry_bias(torch.zeros(2, 0, dtype=torch.int64), 4, multiplier=1.0)[0].shape == (2, 0)


def test_fused_with_sequence_bias_and_sampler(lp):
    """DRY's entries beside sequence_bias' in one bias buffer (out= columns): apply_penalties_
    adds both (a token in both gets both), and the sampler with them fused draws what it draws
    from the biased logits."""
    g = torch.Generator().manual_seed(6)
    rows, vocab, length = 6, 5, 24
    kwargs = dry_bias_case(rows, vocab, g)
    sequences, biases = torch.tensor([[1, -1], [2, 3]]), torch.tensor([0.5, -1.5])
    bias_ids = torch.full((rows, length + 2), 7, dtype=torch.int64)
    bias_values = torch.full((rows, length + 2), 7.0)
    lp.dry_bias(**kwargs, vocab_size=vocab, out=(bias_ids[:, :length], bias_values[:, :length]))
    lp.sequence_bias(kwargs["token_ids"], sequences, biases, vocab, out=(bias_ids[:, length:], bias_values[:, length:]))
    dry = dry_bias_reference(**kwargs, vocab=vocab)
    assert_matches((bias_ids[:, :length], bias_values[:, :length]), dry)
    state = no_state(rows, vocab)
    for _ in range(3):
        logits = torch.randn(rows, vocab, generator=g) * 3
        dense = logits.clone()
        for ids, values in ((bias_ids[:, :length], bias_values[:, :length]),
                            (bias_ids[:, length:], bias_values[:, length:])):
            for b, i in (ids >= 0).nonzero().tolist():
                dense[b, ids[b, i]] += values[b, i]
        got = lp.apply_penalties_(logits.clone(), *state, logit_bias_ids=bias_ids, logit_bias_values=bias_values)
        assert torch.equal(got, dense)
        seed = torch.randint(0, 2**62, (rows,), generator=g)
        penalties = lp.Penalties(*state, logit_bias_ids=bias_ids, logit_bias_values=bias_values)
        assert torch.equal(lp.sample(logits, temperature=0.9, seed=seed, penalties=penalties),
                           lp.sample(dense, temperature=0.9, seed=seed))


BAD = [
    (dict(vocab_size=0), "vocab_size must lie in"),
    (dict(vocab_size=True), "vocab_size must be an int"),
    (dict(token_ids=torch.zeros(4, dtype=torch.int64)), "token_ids must be 2-D"),
    (dict(token_ids=torch.zeros(2, 4)), "token_ids must be int64 or int32"),
    (dict(token_ids=torch.full((2, 4), 40)), "token_ids must lie in"),
    (dict(token_ids=torch.tensor([[1, -1, 2, -1], [0, 0, 0, 0]])), "token_ids must be -1 padded at the end"),
    (dict(token_ids=[[1, 2]]), "token_ids must be a torch.Tensor"),
    (dict(sequence_breakers=torch.tensor([1, 2])), "sequence_breakers must be"),
    (dict(sequence_breakers=torch.zeros(3, 3, 2, dtype=torch.int64)), "sequence_breakers must be"),
    (dict(sequence_breakers=torch.zeros(3, 0, dtype=torch.int64)), "sequence_breakers must hold at least one id"),
    (dict(sequence_breakers=torch.tensor([[1, 99]])), "sequence_breakers must lie in"),
    (dict(sequence_breakers=torch.tensor([[-1, 2]])), "sequence_breakers must be -1 padded at the end"),
    (dict(sequence_breakers=torch.zeros(1, 2)), "sequence_breakers must be int64 or int32"),
    (dict(multiplier=-1.0), "multiplier must be finite and at least 0"),
    (dict(multiplier=math.nan), "multiplier must be finite"),
    (dict(multiplier=1e39), "multiplier must be finite"),
    (dict(base=1e39), "base must be finite"),
    (dict(multiplier=torch.tensor([1.0, math.inf])), "multiplier must be finite"),
    (dict(multiplier=torch.tensor([1, 2])), "multiplier must be a floating-point tensor"),
    (dict(multiplier=torch.ones(3)), "multiplier must be a number or a 1-D tensor of length 2"),
    (dict(multiplier="1"), "multiplier must be a number"),
    (dict(base=0.5), "base must be finite and at least 1"),
    (dict(base=torch.tensor([1.5, 0.9])), "base must be finite and at least 1"),
    (dict(base=torch.ones(2, device="meta")), "base must be on the token_ids' device"),
    (dict(allowed_length=-1), "allowed_length must lie in"),
    (dict(allowed_length=1.5), "allowed_length must be an int"),
    (dict(allowed_length=torch.tensor([1, -2])), "allowed_length must lie in"),
    (dict(penalty_last_n=-2), "penalty_last_n must lie in"),
    (dict(penalty_last_n=torch.tensor([-2, 3])), "penalty_last_n must lie in"),
    (dict(out="bad"), "out must be a tuple"),
    (dict(out=(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4))), "out_ids must be Long"),
    (dict(out=(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3))), "out_values must have shape"),
    (dict(out=(torch.zeros(1, 4, dtype=torch.int64).expand(2, 4), torch.zeros(2, 4))), "out_ids must not have"),
    (dict(out="token_ids"), "token_ids must not share memory with out_ids"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_names_the_argument(lp, change, message):
    g = torch.Generator().manual_seed(3)
    arguments = dict(token_ids=torch.randint(0, 40, (2, 4), generator=g), vocab_size=40, multiplier=1.0,
                     sequence_breakers=torch.tensor([[1, 2], [3, -1]]),
                     out=(torch.full((2, 4), 7, dtype=torch.int64), torch.full((2, 4), 7.0)))
    arguments.update(change)
    if arguments["out"] == "token_ids":  # token_ids that are the output's own memory
        arguments["out"] = (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4))
        arguments["token_ids"] = arguments["out"][0]
    before = [t.clone() for t in arguments["out"]] if isinstance(arguments["out"], tuple) else None
    with pytest.raises((RuntimeError, TypeError), match=message):
        lp.dry_bias(**arguments)
    if before is not None:
        assert all(torch.equal(t, b) for t, b in zip(arguments["out"], before))


def test_opcheck_and_compile(lp):
    g = torch.Generator().manual_seed(4)
    kwargs = dry_bias_case(5, 70, g)
    out = (torch.empty(5, 24, dtype=torch.int64), torch.empty(5, 24))
    torch.library.opcheck(lp._ops.ops.dry_bias, (kwargs["token_ids"], kwargs["sequence_breakers"], 70,
                                                 kwargs["multiplier"], 0.0, kwargs["base"], 0.0,
                                                 kwargs["allowed_length"], 0, kwargs["penalty_last_n"], 0, *out))
    state = no_state(5, 70)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(logits, token_ids, ids, values):
        lp.dry_bias(token_ids, 70, multiplier=kwargs["multiplier"], base=kwargs["base"],
                    sequence_breakers=kwargs["sequence_breakers"], out=(ids, values))
        return lp.sample(logits, seed=1, penalties=lp.Penalties(*state, logit_bias_ids=ids, logit_bias_values=values))

    logits = torch.randn(5, 70, generator=g)
    ids, values = lp.dry_bias(kwargs["token_ids"], 70, multiplier=kwargs["multiplier"], base=kwargs["base"],
                              sequence_breakers=kwargs["sequence_breakers"])
    eager = lp.sample(logits, seed=1, penalties=lp.Penalties(*state, logit_bias_ids=ids, logit_bias_values=values))
    assert torch.equal(step(logits, kwargs["token_ids"], *out), eager)
    assert torch.equal(out[0], ids) and torch.equal(out[1], values)
