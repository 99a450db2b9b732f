"""Property tests of sample_with_logprobs and token_logprobs on the CPU, on the sampler's inputs.

Each example is one of test_properties_sampling.py's calls (any shape, dtype and strided view;
NaN, +-inf, huge, tiny and raw bit patterns; every parameter at and around its boundaries),
with a random num_logprobs and mode. Invariants: tokens are exactly `sample`'s; token_logprobs
returns column 0 bit for bit; rows with no token are all -inf / -1 with rank 0; every other
row has a finite column 0 <= 0 (the sampled token is in the support), rank >= 1, top-N ids in
[0, V) with finite logprobs in non-increasing order, then only padding (-1, -inf); the top-N's probabilities sum to
at most 1; inputs and the memory around the outputs are unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from harness import backends, load, same_bits
from test_properties_sampling import calls

if not hasattr(load("cpu"), "sample_with_logprobs"):
    pytest.skip("this build has no `sample_with_logprobs` op yet", allow_module_level=True)


def filters(kwargs):
    return {k: v for k, v in kwargs.items() if k not in ("seed", "offset")}


def check_call(lp, logits, kwargs, num_logprobs, mode) -> None:
    view = logits.view
    rows, vocab = view.shape
    num_logprobs = min(num_logprobs, vocab)
    note(f"logits {tuple(view.shape)} {view.dtype} num_logprobs={num_logprobs} mode={mode}")
    inputs_before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    logits_before = logits.buffer.clone()

    result = lp.sample_with_logprobs(view, **kwargs, num_logprobs=num_logprobs, logprobs_mode=mode)
    assert torch.equal(result.tokens, lp.sample(view, **kwargs))
    again = lp.token_logprobs(view, result.tokens, **filters(kwargs), logprobs_mode=mode)
    assert same_bits(again, result.logprobs[:, 0].contiguous())
    assert same_bits(logits.buffer, logits_before), "the logits (or their guard bands) changed"
    for k, v in inputs_before.items():
        assert same_bits(kwargs[k], v), f"{k} changed"

    none = result.tokens < 0
    assert (result.logprobs[none] == -math.inf).all() and (result.logprob_token_ids[none, 0] == -1).all()
    columns = result.logprob_token_ids.shape[1] - 1
    assert (result.logprob_token_ids[none, 1:] == torch.arange(columns)).all()
    assert (result.ranks[none] == 0).all()
    drawn = ~none
    first = result.logprobs[drawn, 0]
    assert torch.isfinite(first).all() and (first <= 0).all()
    assert torch.equal(result.logprob_token_ids[drawn, 0], result.tokens[drawn])
    assert (result.ranks[drawn] >= 1).all()
    top, ids = result.logprobs[drawn, 1:], result.logprob_token_ids[drawn, 1:]
    padding = top == -math.inf  # past the support: the lowest ids outside it, in order
    assert ((ids >= 0) & (ids < vocab)).all()
    assert (padding[:, :-1] <= padding[:, 1:]).all(), "padding before a token"
    for row_ids, row_padding in zip(ids.tolist(), padding.tolist()):
        listed = [i for i, p in zip(row_ids, row_padding) if not p]
        assert [i for i, p in zip(row_ids, row_padding) if p] == [v for v in range(len(row_ids)) if v not in listed][
            :len(row_ids) - len(listed)], "the ids past the support"
    assert (top[:, :-1] >= top[:, 1:]).all(), "top-N not in order"
    if top.shape[1]:
        assert (torch.logsumexp(top.double(), dim=1) <= 1e-5).all(), "the top-N's probabilities exceed 1"


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b or "default")
@given(call=calls(), num_logprobs=st.sampled_from([0, 1, 5, 20, 50]), mode=st.sampled_from(["processed", "raw"]))
def test_logprobs_invariants(backend, call, num_logprobs, mode):
    logits, kwargs, _ = call
    check_call(load(backend), logits, kwargs, num_logprobs, mode)
