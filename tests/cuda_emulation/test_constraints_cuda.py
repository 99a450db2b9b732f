"""Request constraints (constrain_bitmask_) and sequence_bias through the CUDA kernels, emulated:
the CPU's results, bit for bit, on the cases of tests/ops/test_constraints.py and
tests/ops/test_sequence_bias.py; and device values the host does not read (ids outside
[-1, V), negative counts) handled as the reference defines them."""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import SANITIZED
from op_cases import constraint_case, sequence_bias_case
from reference import constraints_reference, sequence_bias_reference, unpack_bitmask


def padded_long_rows(rows: int, length: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Sequences longer than the block (its threads each read several ids to find the length),
    over 3 tokens (n-grams repeat), -1 padded from a random end, one row unpadded."""
    token_ids = torch.randint(0, 3, (rows, length), generator=g)
    ends = torch.randint(0, length + 1, (rows,), generator=g)
    ends[0] = length
    token_ids[torch.arange(length) >= ends[:, None]] = -1
    return token_ids.to(dtype)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [1, 8] if SANITIZED else [1, 8, 132])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,vocab", [(9, 33), (3, 1000), (2, 70001)] if SANITIZED
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
