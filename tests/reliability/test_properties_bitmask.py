"""Property tests of the bitmask ops on the CPU against tests/reference.py, bit for bit.

Each example draws a shape (B 0..300, V 1..300000, at most MAX_ELEMENTS logits), a dtype,
a layout (rows as a strided view into a buffer with guard bands, a column offset, 1-D or 2-D),
a bitmask (pattern, width narrower or wider than the logits, strided, more rows than the
logits), vocab_size, indices (None, a list or a tensor, any order, duplicates), a fill value
and logits that mix normal values with NaN (any payload), +-inf, huge, tiny and subnormal
values. The whole buffers, guard bands and row padding included, must come out exactly as
the reference says: masked where it masks, the same bits everywhere else, inputs unchanged.

Example count: the "ci" profile (tests/harness.py); LP_HYPOTHESIS_PROFILE=long for more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from harness import DTYPES, Guarded, backends, guarded, load, random_logits, same_bits, shapes
from reference import bitmask_reference, random_bitmask

FILLS = [float("-inf"), -1e4, 0.0, float("nan"), 1e30, -3.0e38]


@dataclass
class Case:
    op: str  # "inplace" or "packed"
    logits: Guarded
    bitmask: Guarded
    vocab_size: Optional[int]
    indices: object
    fill_value: float
    out: object  # packed only: None, "self" or a Guarded


@st.composite
def cases(draw) -> Case:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(["inplace", "packed"]))
    rows, width = draw(shapes(allow_1d=True))
    n_rows = 1 if rows is None else rows
    special_rate = draw(st.sampled_from([0.0, 0.01, 0.3]))
    logits = draw(guarded(rows, width, lambda n: random_logits(n, dtype, g, special_rate)))

    # The bitmask may cover fewer or more tokens than the logits have columns.
    words = max(0, math.ceil(width / 32) + draw(st.integers(-2, 2)))
    covered = min(width, 32 * words)
    use_indices = op == "inplace" and draw(st.booleans())
    mask_rows = draw(st.integers(0, n_rows + 3)) if use_indices else n_rows + draw(st.integers(0, 3))
    mask_1d = mask_rows == 1 and draw(st.booleans())
    pattern = draw(st.sampled_from(["mixed", "zeros", "ones", "words"]))

    def make_mask(n):
        # Random words everywhere (guards and padding too); the view is then overwritten.
        return random_bitmask(1, 32 * n, g, "mixed")[0]

    bitmask = draw(guarded(None if mask_1d else mask_rows, words, make_mask))
    bitmask.view.copy_(random_bitmask(mask_rows, 32 * words, g, pattern).view(bitmask.view.shape))

    vocab_size = None
    if op == "inplace" and draw(st.booleans()):
        vocab_size = draw(st.integers(0, covered))
    indices = None
    if use_indices:
        valid = min(n_rows, mask_rows)
        chosen = draw(st.lists(st.integers(0, valid - 1), max_size=2 * n_rows + 2)) if valid else []
        form = draw(st.sampled_from(["list", "int64", "int32"]))
        indices = chosen if form == "list" else torch.tensor(chosen, dtype=getattr(torch, form))
    out = None
    if op == "packed":
        out = draw(st.sampled_from([None, "self", "guarded"]))
        if out == "guarded":
            out = draw(guarded(rows, width, lambda n: random_logits(n, dtype, g, 0.3)))
    return Case(op, logits, bitmask, vocab_size, indices, draw(st.sampled_from(FILLS)), out)


def run_case(lp, case: Case) -> None:
    logits, mask = case.logits.view, case.bitmask.view
    note(f"{case.op} logits {tuple(logits.shape)} {logits.dtype} stride {logits.stride()} "
         f"bitmask {tuple(mask.shape)} stride {mask.stride()} vocab_size {case.vocab_size} "
         f"indices {case.indices if case.indices is None or len(case.indices) < 20 else len(case.indices)} "
         f"fill {case.fill_value} out {type(case.out).__name__ if case.out else case.out}")
    if mask.shape[-1] == 0:  # covers no token (and the reference cannot reshape it)
        expected = logits.clone()
    else:
        expected = bitmask_reference(logits.clone(), mask.clone(), vocab_size=case.vocab_size,
                                     indices=case.indices, fill_value=case.fill_value)
    mask_before = case.bitmask.buffer.clone()
    logits_before = case.logits.buffer.clone()
    out_before = case.out.buffer.clone() if isinstance(case.out, Guarded) else None
    indices_before = case.indices.clone() if isinstance(case.indices, torch.Tensor) else list(case.indices or [])

    if case.op == "inplace":
        lp.apply_token_bitmask_inplace(logits, mask, vocab_size=case.vocab_size, indices=case.indices,
                                       fill_value=case.fill_value)
        assert same_bits(case.logits.buffer, case.logits.after(logits_before, expected))
    elif case.out == "self":
        assert lp.apply_packed_bitmask(logits, mask, case.fill_value, out=logits) is logits
        assert same_bits(case.logits.buffer, case.logits.after(logits_before, expected))
    else:
        out_view = None if case.out is None else case.out.view
        result = lp.apply_packed_bitmask(logits, mask, case.fill_value, out=out_view)
        assert same_bits(case.logits.buffer, logits_before), "out of place: the logits changed"
        if case.out is None:
            assert same_bits(result, expected)
        else:
            assert result is out_view
            assert same_bits(case.out.buffer, case.out.after(out_before, expected))
    assert same_bits(case.bitmask.buffer, mask_before), "the bitmask changed"
    if isinstance(case.indices, torch.Tensor):
        assert torch.equal(case.indices, indices_before), "the indices changed"
    elif case.indices is not None:
        assert case.indices == indices_before, "the indices changed"


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b or "default")
@given(case=cases())
def test_bitmask_ops_match_reference_bit_for_bit(backend, case):
    run_case(load(backend), case)
