"""Property tests of `sample` on the CPU against tests/reference.py's sampling_reference.

Each example draws a shape (B 0..300, V 1..300000 within MAX_ELEMENTS / 2), a dtype, a strided
view into a guarded buffer, logits mixing normal values with NaN, +-inf, huge, tiny and raw
bit patterns (and rows that are all -inf or NaN), an optional bitmask, and every parameter as
a number or a per-row tensor at and around its boundaries (temperature 0, negative or NaN in a
tensor; top_k 0, 1, V, past V; top_p 0, 1, outside [0, 1] or NaN in a tensor; min_p 0, 1, ...).
Invariants: each token lies in the reference kept set (with a small slack for rounding at the
cutoff), -1 exactly for rows with no allowed candidate, the same tokens on a second call with
the same seed and offset, and every input and the memory around `out` unchanged.

Example count: the "ci" profile (tests/harness.py); LP_HYPOTHESIS_PROFILE=long for more.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from harness import DTYPES, GUARD, MAX_ELEMENTS, backends, guarded, load, random_logits, same_bits, shapes
from reference import random_bitmask, sampling_reference

SLACK = 1e-3  # relative widening of the top-p / min-p cutoffs in the reference kept set
# The reference runs row by row in Python: a smaller budget than the bitmask tests.

if not hasattr(load("cpu"), "sample"):
    pytest.skip("this build has no `sample` op yet", allow_module_level=True)

NAN = math.nan
# Values at and around each parameter's boundaries. Numbers are validated on the host, so
# NaN and out-of-range top_p / min_p appear in per-row tensors only (documented: NaN or <= 0
# temperature is greedy, top_p and min_p clamp to [0, 1], NaN disables them).
PARAMS = {
    "temperature": ([0.0, -1.0, 1e-6, 0.05, 0.7, 1.0, 2.0, 1e4], [NAN]),
    "top_k": ([0, -1, 1, 2, 5, 50, 1000, 2**40], []),
    "top_p": ([0.0, 1e-6, 0.1, 0.5, 0.9, 0.999, 1.0], [-0.5, 1.5, NAN]),
    "min_p": ([0.0, 1e-6, 0.05, 0.5, 0.999, 1.0], [-0.5, 1.5, NAN]),
}


@st.composite
def parameter(draw, name: str, rows: int):
    numbers, tensor_only = PARAMS[name]
    if not draw(st.booleans()):
        return draw(st.sampled_from(numbers))
    values = draw(st.lists(st.sampled_from(numbers + tensor_only), min_size=rows, max_size=rows))
    if name == "top_k":
        return torch.tensor(values).to(draw(st.sampled_from([torch.int64, torch.int32])))
    return torch.tensor(values, dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])))


@st.composite
def calls(draw):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(DTYPES))
    rows, width = draw(shapes(allow_1d=False, max_elements=MAX_ELEMENTS // 2))
    special_rate = draw(st.sampled_from([0.0, 0.01, 0.3]))
    logits = draw(guarded(rows, width, lambda n: random_logits(n, dtype, g, special_rate)))
    view = logits.view
    dead = torch.rand(rows, generator=g) < draw(st.sampled_from([0.0, 0.2]))  # all -inf or NaN
    view[dead] = torch.tensor(draw(st.sampled_from([-math.inf, NAN])), dtype=dtype)

    kwargs = {name: draw(parameter(name, rows)) for name in PARAMS}
    for name in ("seed", "offset"):
        if draw(st.booleans()):
            kwargs[name] = torch.randint(0, 2**62, (rows,), generator=g)
        else:
            kwargs[name] = draw(st.integers(0, 2**62))
    if draw(st.booleans()):
        words = max(1, math.ceil(width / 32) + draw(st.integers(-1, 1)))
        pattern = draw(st.sampled_from(["mixed", "zeros", "ones", "words"]))
        kwargs["bitmask"] = random_bitmask(rows + draw(st.integers(0, 2)), 32 * words, g, pattern)
    out = None
    if draw(st.booleans()):
        out = torch.full((2 * GUARD + rows,), -7, dtype=torch.int64)
    return logits, kwargs, out


def check_call(lp, logits, kwargs, out) -> None:
    view = logits.view
    note(f"logits {tuple(view.shape)} {view.dtype} stride {view.stride()} "
         + " ".join(f"{k}={v if not isinstance(v, torch.Tensor) else v.tolist()[:8]}" for k, v in kwargs.items()))
    inputs_before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    logits_before = logits.buffer.clone()
    out_before = None if out is None else out.clone()
    out_view = None if out is None else out[GUARD : GUARD + view.shape[0]]

    tokens = lp.sample(view, **kwargs, out=out_view)
    again = lp.sample(view, **kwargs)

    rows, vocab = view.shape
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, again), "not deterministic in (seed, offset)"
    if out is not None:
        assert tokens is out_view
        expected_out = out_before.clone()
        expected_out[GUARD : GUARD + rows] = tokens
        assert torch.equal(out, expected_out), "memory around out was written"
    assert same_bits(logits.buffer, logits_before), "the logits (or their guard bands) changed"
    for k, v in inputs_before.items():
        assert same_bits(kwargs[k], v), f"{k} changed"

    ref_kwargs = {k: v.float() if k != "top_k" and isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items() if k not in ("seed", "offset")}
    kept = sampling_reference(view, slack=SLACK, **ref_kwargs) > 0
    none_allowed = ~kept.any(dim=1)
    assert torch.equal(tokens == -1, none_allowed), "-1 must mark exactly the rows with no candidate"
    drawn = ~none_allowed
    assert ((tokens[drawn] >= 0) & (tokens[drawn] < vocab)).all()
    assert kept[drawn.nonzero().flatten(), tokens[drawn]].all(), (
        f"tokens outside the reference kept set in rows {(~kept[torch.arange(rows)[drawn], tokens[drawn]]).nonzero().flatten().tolist()}")


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b or "default")
@given(call=calls())
def test_sample_token_in_reference_kept_set(backend, call):
    check_call(load(backend), *call)
