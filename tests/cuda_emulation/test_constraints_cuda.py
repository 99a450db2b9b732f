"""Request constraints (constrain_bitmask_), sequence_bias and dry_bias through the CUDA kernels,
emulated: the CPU's results, bit for bit, on the cases of tests/ops/test_constraints.py,
tests/ops/test_sequence_bias.py and tests/ops/test_dry_bias.py; and device values the host does
not read (ids outside [-1, V), negative counts, DRY parameters out of range) handled as the
reference defines them."""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES
from op_cases import constraint_case, dry_bias_case, dry_bias_op, sequence_bias_case, with_many_breakers
from reference import constraints_reference, dry_bias_reference, sequence_bias_reference, unpack_bitmask


def padded_long_rows(rows: int, length: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Sequences longer than the block (its threads each read several ids to find the length),
    over 3 tokens (n-grams repeat), -1 padded from a random end, one row unpadded."""
    token_ids = torch.randint(0, 3, (rows, length), generator=g)
    ends = torch.randint(0, length + 1, (rows,), generator=g)
    ends[0] = length
    token_ids[torch.arange(length) >= ends[:, None]] = -1
    return token_ids.to(dtype)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8] if SMALL_CASES else [1, 8, 132])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,vocab", [(9, 33), (3, 1000), (2, 70001)] if SMALL_CASES
                         else [(9, 1), (9, 33), (20, 1000), (3, 9000), (2, 70001)])
def test_emulated_cuda_constraints_equal_cpu(emulation, lp_cpu, sms, per_row, dtype, rows, vocab):
    """Grid-stride over rows (1 SM: every row in one block), the sequence's length a block
    reduction, exclusions strided over the threads, bits of one word cleared by several threads
    (atomicAnd); V = 70001: the allowed set in three chunks of 2048 words."""
    g = torch.Generator().manual_seed(rows * vocab + sms + per_row)
    for _ in range(2):
        bitmask, kwargs = constraint_case(rows, vocab, g, dtype, per_row)
        if vocab > 1000:  # allowed lists longer than the block, n-grams past a warp
            kwargs["allowed_token_ids"] = torch.randint(-1, vocab, (rows, 300), generator=g).to(dtype)
            kwargs["token_ids"] = padded_long_rows(rows, 600, g, dtype)
        expected = lp_cpu.constrain_bitmask_(bitmask.clone(), vocab, **kwargs)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.constrain_bitmask_(bitmask.clone(), vocab, **kwargs)
        assert emulation.launches() > before, "the op did not launch an emulated kernel"
        assert torch.equal(got, expected)
        assert torch.equal(unpack_bitmask(got, vocab), constraints_reference(bitmask, vocab, **kwargs))


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,vocab,length,count", [(9, 4, 12, 7), (20, 50, 12, 7), (3, 70001, 600, 600)])
def test_emulated_cuda_sequence_bias_equal_cpu(emulation, lp_cpu, sms, per_row, dtype, rows, vocab, length, count):
    """A block per row (grid-stride: 1 SM runs every row in one block), the length a block
    reduction over sequences longer than the block, an entry per thread, merged a block's worth
    at a time (600 sequences: three groups, ids merged across them): the CPU's entries."""
    g = torch.Generator().manual_seed(rows * vocab + sms + per_row)
    for _ in range(2):
        kwargs = sequence_bias_case(rows, vocab, g, dtype, per_row, length, count)
        expected = lp_cpu.sequence_bias(**kwargs, vocab_size=vocab)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.sequence_bias(**kwargs, vocab_size=vocab)
        assert emulation.launches() > before, "the op did not launch an emulated kernel"
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        reference = sequence_bias_reference(**kwargs, vocab=vocab)
        assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


@pytest.mark.emulation
def test_emulated_cuda_device_values_out_of_range(emulation):
    """Device lists with ids below -1 or past V (padding), negative min_tokens, prompt_lengths
    and n (off or all generated): the reference's result, and nothing outside the bitmask
    (ASan in the asan part)."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 7, 70
    bitmask, kwargs = constraint_case(rows, vocab, g)
    for name in ("token_ids", "stop_token_ids", "allowed_token_ids", "suppress_tokens", "bad_words"):
        t = kwargs[name]
        wild = torch.randint(-(2**40), 2**40, t.shape, generator=g)
        kwargs[name] = torch.where(torch.rand(t.shape, generator=g) < 0.2, wild, t)
    for name in ("prompt_lengths", "min_tokens", "no_repeat_ngram_size"):
        kwargs[name] = kwargs[name] - 2
    with emulation.gpu(8) as lp, emulation.device_tensors():
        got = lp.constrain_bitmask_(bitmask.clone(), vocab, **kwargs)
    assert torch.equal(unpack_bitmask(got, vocab), constraints_reference(bitmask, vocab, **kwargs))
    # sequence_bias: wild ids in the sequence and the sequences are padding.
    kwargs = sequence_bias_case(rows, vocab, g)
    for name in ("token_ids", "sequences"):
        t = kwargs[name]
        wild = torch.randint(-(2**40), 2**40, t.shape, generator=g)
        kwargs[name] = torch.where(torch.rand(t.shape, generator=g) < 0.2, wild, t)
    with emulation.gpu(8) as lp, emulation.device_tensors():
        got = lp.sequence_bias(**kwargs, vocab_size=vocab)
    reference = sequence_bias_reference(**kwargs, vocab=vocab)
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,vocab,length", [(9, 5, 24), (12, 70001, 40), (3, 6, 600)])
def test_emulated_cuda_dry_bias_equal_cpu(emulation, lp_cpu, sms, per_row, dtype, rows, vocab, length):
    """A block per row (grid-stride: 1 SM runs every row in one block), the latest breaker a
    block reduction over the window, each entry's repeat compared backwards by its thread (the
    CPU's Z-algorithm gives the same), merged a block's worth at a time (L = 600: three groups,
    tokens merged across them); and rows of one token repeated 600 times: the CPU's entries."""
    g = torch.Generator().manual_seed(rows * vocab + sms + per_row)
    cases = [dry_bias_case(rows, vocab, g, dtype, per_row, length) for _ in range(2)]
    if length > 256:
        constant = dict(cases[0], token_ids=torch.full((rows, length), 2, dtype=dtype))
        constant["token_ids"][1, ::7] = 1  # a breaker's id in one of them
        cases.append(constant)
    for kwargs in cases:
        expected = lp_cpu.dry_bias(**kwargs, vocab_size=vocab)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.dry_bias(**kwargs, vocab_size=vocab)
        assert emulation.launches() > before, "the op did not launch an emulated kernel"
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        reference = dry_bias_reference(**kwargs, vocab=vocab)
        assert torch.equal(got[0], reference[0])
        torch.testing.assert_close(got[1], reference[1], rtol=2.0**-23, atol=0.0)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
def test_emulated_cuda_dry_bias_unsorted_equal_cpu(emulation, lp_cpu, sms, per_row):
    """300 breakers in no order (more than a block's threads: the block's check that a table is
    sorted is a reduction): the Python layer's sorted table, searched by first id, and the raw
    op's table as given, scanned whole: both the CPU's entries and the reference's."""
    g = torch.Generator().manual_seed(sms + per_row)
    for vocab in (50, 70001):
        kwargs = with_many_breakers(dry_bias_case(6, vocab, g, per_row=per_row, length=40), vocab, g, count=300)
        expected = dry_bias_reference(**kwargs, vocab=vocab)
        for run in (lambda lp: lp.dry_bias(**kwargs, vocab_size=vocab), lambda lp: dry_bias_op(lp, kwargs, vocab)):
            cpu = run(lp_cpu)
            before = emulation.launches()
            with emulation.gpu(sms) as lp:
                got = run(lp)
            assert emulation.launches() > before, "the op did not launch an emulated kernel"
            assert torch.equal(got[0], cpu[0]) and torch.equal(got[1], cpu[1])
            assert torch.equal(got[0], expected[0])
            torch.testing.assert_close(got[1], expected[1], rtol=2.0**-23, atol=0.0)


@pytest.mark.emulation
def test_emulated_cuda_dry_bias_device_values(emulation):
    """Device values the host would reject: ids outside [-1, V) in the rows and the breakers (they
    end them), a multiplier <= 0 or NaN and a base < 1, inf or NaN (the row is off), an allowed
    length below 0 (every position a candidate) and a window below -1 (the whole row): the
    reference's entries with those rows off, and nothing outside the outputs (ASan)."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 8, 6
    kwargs = dry_bias_case(rows, vocab, g)
    for name in ("token_ids", "sequence_breakers"):
        t = kwargs[name]
        wild = torch.randint(-(2**40), 2**40, t.shape, generator=g)
        kwargs[name] = torch.where(torch.rand(t.shape, generator=g) < 0.1, wild, t)
    kwargs["multiplier"][1:3] = torch.tensor([-1.0, float("nan")])
    kwargs["base"][3:5] = torch.tensor([0.5, float("nan")])
    kwargs["base"][7] = float("inf")
    kwargs["allowed_length"][5] = -3
    kwargs["token_ids"][5] = torch.arange(24) % 3
    kwargs["penalty_last_n"][6] = -(2**40)
    with emulation.gpu(8) as lp, emulation.device_tensors():
        got = lp.dry_bias(**kwargs, vocab_size=vocab)
    off = torch.tensor([False, True, True, True, True, False, False, True])
    reference = dry_bias_reference(**dict(kwargs, multiplier=kwargs["multiplier"].masked_fill(off, 0.0)),
                                   vocab=vocab)
    assert torch.equal(got[0], reference[0]) and (got[0][5] >= 0).sum() > 0
    torch.testing.assert_close(got[1], reference[1], rtol=2.0**-23, atol=0.0)
