"""FlashInfer's names (top_k_renorm_probs, top_p_renorm_probs, top_k_mask_logits,
sampling_from_probs, top_k_top_p_sampling_from_probs, min_p_sampling_from_probs) against
FlashInfer's documented semantics (flashinfer/sampling.py 0.7.4: its docstrings' definitions and
examples), written here in float64 torch; the draws by chi-square; their arguments (indices,
seed and offset, generator, return_valid, check_nan) and the edge cases (zeros, NaN, negative
and subnormal probabilities, ties).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import bits
from reference import chi_square_p_value, sampling_reference, vllm_sampling_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# FlashInfer's docstring examples (flashinfer/sampling.py 0.7.4): probabilities and logits
# printed to 4 decimals, and what its kernels returned for them.
EXAMPLE_PROBS = [[0.2499, 0.2592, 0.1085, 0.2718, 0.1106], [0.2205, 0.0942, 0.2912, 0.3452, 0.0489],
                 [0.2522, 0.1602, 0.2346, 0.1532, 0.2000], [0.1543, 0.3182, 0.2062, 0.0958, 0.2255]]
EXAMPLE_TOP_K_3 = [[0.3201, 0.3319, 0.0000, 0.3480, 0.0000], [0.2573, 0.0000, 0.3398, 0.4028, 0.0000],
                   [0.3672, 0.0000, 0.3416, 0.0000, 0.2912], [0.0000, 0.4243, 0.2750, 0.0000, 0.3007]]
EXAMPLE_TOP_P_03 = [[0.0000, 0.4882, 0.0000, 0.5118, 0.0000], [0.0000, 0.0000, 0.0000, 1.0000, 0.0000],
                    [0.5181, 0.0000, 0.4819, 0.0000, 0.0000], [0.0000, 1.0000, 0.0000, 0.0000, 0.0000]]
EXAMPLE_LOGITS = [[1.9269, 1.4873, 0.9007, -2.1055, -0.7581], [1.0783, 0.8008, 1.6806, 0.3559, -0.6866],
                  [-0.4934, 0.2415, -0.2316, 0.0418, -0.2516], [0.8599, -0.3097, -0.3957, 0.8034, -0.6216]]
EXAMPLE_MASK_3 = [[1.9269, 1.4873, 0.9007, -math.inf, -math.inf], [1.0783, 0.8008, 1.6806, -math.inf, -math.inf],
                  [-math.inf, 0.2415, -0.2316, 0.0418, -math.inf], [0.8599, -0.3097, -math.inf, 0.8034, -math.inf]]


def top_k_renorm_reference(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """FlashInfer: "We keep the top-k probabilities, set the rest to zero, and renormalize"."""
    p = probs.double()
    kth = p.sort(-1, descending=True).values.gather(-1, (top_k.long() - 1).unsqueeze(-1))
    kept = torch.where(p >= kth, p, 0)
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_reference(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """FlashInfer: mask out the probabilities below the threshold where the cumulative sum of
    probs[probs >= threshold] reaches top_p, and renormalise (mass relative to the row's sum)."""
    p = probs.double()
    p = p / p.sum(-1, keepdim=True)
    ordered = p.sort(-1, descending=True).values
    before = ordered.cumsum(-1) - ordered  # mass above each sorted position
    threshold = torch.where(before < top_p.double().unsqueeze(-1), ordered, 2.0).min(-1, keepdim=True).values
    kept = torch.where(p >= threshold, p, 0)
    return kept / kept.sum(-1, keepdim=True)


def random_probs(rows: int, vocab: int, g: torch.Generator, scale: float = 2.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)


def test_flashinfer_docstring_examples(lp):
    """FlashInfer's own examples: top_k_mask_logits exactly, the renormalised rows to the
    printed inputs' rounding (FlashInfer printed its probabilities to 4 decimals)."""
    probs = torch.tensor(EXAMPLE_PROBS)
    assert torch.allclose(lp.top_k_renorm_probs(probs, 3), torch.tensor(EXAMPLE_TOP_K_3), atol=2e-4)
    assert torch.allclose(lp.top_p_renorm_probs(probs, 0.3), torch.tensor(EXAMPLE_TOP_P_03), atol=2e-4)
    assert torch.equal(lp.top_k_mask_logits(torch.tensor(EXAMPLE_LOGITS), 3), torch.tensor(EXAMPLE_MASK_3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_renorm_and_mask_match_float64_reference(lp, dtype):
    """Per-row top_k (int32, FlashInfer's dtype) and top_p tensors, and numbers: the kept sets
    are the references' on every row, the values their renormalised probabilities (to the
    dtype's rounding), the masked logits the logits themselves, in the input's dtype."""
    g = torch.Generator().manual_seed(900)
    rows, vocab = 48, 3000
    probs = random_probs(rows, vocab, g).to(dtype)
    top_k = torch.randint(1, vocab + 200, (rows,), generator=g, dtype=torch.int32)
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    for k in (top_k, 37):
        k_rows = k if isinstance(k, torch.Tensor) else torch.full((rows,), k)
        got = lp.top_k_renorm_probs(probs, k)
        ref = top_k_renorm_reference(probs, k_rows.clamp(max=vocab))
        assert got.dtype == dtype
        assert torch.equal(got > 0, ref > 0)
        assert torch.allclose(got.double(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=0)
        logits = torch.randn(rows, vocab, generator=g).to(dtype)
        masked = lp.top_k_mask_logits(logits, k)
        kept = top_k_renorm_reference(torch.softmax(logits.double(), -1), k_rows.clamp(max=vocab)) > 0
        assert masked.dtype == dtype
        assert torch.equal(masked[kept], logits[kept]) and (masked[~kept] == -math.inf).all()
    got = lp.top_p_renorm_probs(probs, top_p)
    ref = top_p_renorm_reference(probs, top_p)
    loose = top_p_renorm_reference(probs, top_p * (1 + 1e-4))
    clear = ((ref > 0) == (loose > 0)).all(-1)  # rows whose cut a relative 1e-4 does not move
    assert clear.float().mean() > 0.8
    assert got.dtype == torch.float32
    assert torch.equal(got[clear] > 0, ref[clear] > 0)
    assert torch.allclose(got[clear].double(), ref[clear], rtol=1e-5, atol=0)


def test_logits_from_probs_is_the_logarithm(lp):
    """ln p within 2 float32 ulp of float64's, subnormals included; the edge values defined."""
    g = torch.Generator().manual_seed(901)
    p = torch.cat([torch.rand(5000, generator=g), torch.exp(-torch.rand(5000, generator=g) * 100),
                   torch.tensor([1e-45, 3e-42, 1.1754942e-38, 1.17549435e-38, 1.0, 0.5, 2.0, 1e30])])
    got = lp._flashinfer.logits_from_probs(p.view(1, -1))[0]
    ref = torch.log(p.double())
    ulp = torch.nextafter(got.abs(), torch.tensor(math.inf)) - got.abs()
    assert ((got.double() - ref).abs() <= 2 * ulp.double() + 1e-300).all()
    special = torch.tensor([[0.0, -0.0, math.inf, math.nan, -1.0, -1e-40]])
    assert lp._flashinfer.logits_from_probs(special).tolist()[0][:3] == [-math.inf, -math.inf, math.inf]
    assert lp._flashinfer.logits_from_probs(special)[0, 3:].isnan().all()
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(bits(lp._flashinfer.logits_from_probs(p.view(1, -1).to(dtype))),
                           bits(lp._flashinfer.logits_from_probs(p.view(1, -1).to(dtype).float())))


def draws(lp, name, probs, n, **kwargs):
    """`n` independent draws from one probability row (each row of a batch its own stream)."""
    return getattr(lp, name)(probs.expand(n, -1).contiguous(), seed=5, offset=0, **kwargs)


@pytest.mark.parametrize("case", ["plain", "unnormalised", "top_k_first", "joint", "min_p"])
def test_draws_match_float64_distribution(lp, case):
    """400k draws: a chi-square against the float64 distribution FlashInfer defines (the
    filtered probabilities renormalised; vLLM's chain for "top_k_first"), which the other order
    or the unfiltered row fails where they differ."""
    g = torch.Generator().manual_seed(902)
    vocab, n = 40, 400_000
    probs = random_probs(1, vocab, g, scale=1.5) * (0.5 if case == "unnormalised" else 1.0)
    logits = probs.double().log()
    if case in ("plain", "unnormalised"):
        tokens = draws(lp, "sampling_from_probs", probs, n)
        expected = (probs / probs.sum())[0].double()
    elif case == "min_p":
        tokens = draws(lp, "min_p_sampling_from_probs", probs, n, min_p=0.1)
        expected = vllm_sampling_reference(logits, min_p=0.1)[0]
    else:
        tokens = draws(lp, "top_k_top_p_sampling_from_probs", probs, n, top_k=12, top_p=0.7,
                       filter_apply_order=case)
        reference = vllm_sampling_reference if case == "top_k_first" else sampling_reference
        expected = reference(logits, top_k=12, top_p=0.7)[0]
        other = (sampling_reference if case == "top_k_first" else vllm_sampling_reference)(logits, top_k=12, top_p=0.7)[0]
        assert not torch.equal(expected > 0, other > 0)  # the orders differ on this row
        assert chi_square_p_value(torch.bincount(tokens.long(), minlength=vocab).double()[other > 0],
                                  (other * n)[other > 0]) < 1e-6
    assert tokens.dtype == torch.int32
    counts = torch.bincount(tokens.long(), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    assert chi_square_p_value(counts, expected * n) > 1e-4
    if case in ("top_k_first", "min_p"):
        assert chi_square_p_value(counts[expected > 0], (probs[0].double() / probs[0].double().sum() * n)[expected > 0]) < 1e-6


def test_sampling_arguments(lp):
    """indices (output dtype theirs), return_valid (a row with no positive probability draws -1),
    seed and offset as numbers, int64 or uint64 tensors of length 1 or B (one stream), the
    generator's stream (reproducible, advancing), check_nan."""
    g = torch.Generator().manual_seed(903)
    probs = random_probs(4, 100, g)
    probs[2] = 0
    samples, valid = lp.sampling_from_probs(probs, seed=3, offset=1, return_valid=True)
    assert samples.dtype == torch.int32 and valid.tolist() == [True, True, False, True] and samples[2] == -1
    for dtype in (torch.int32, torch.int64):
        indices = torch.tensor([3, 0, 3, 1], dtype=dtype)
        got = lp.top_k_top_p_sampling_from_probs(probs, 5, 0.9, indices=indices, seed=3, offset=1)
        assert got.dtype == dtype
        same = lp.top_k_top_p_sampling_from_probs(probs[indices.long()], 5, 0.9, seed=3, offset=1)
        assert torch.equal(got, same.to(dtype))
    with pytest.raises(ValueError, match="indices must lie in"):
        lp.sampling_from_probs(probs, indices=torch.tensor([4]))
    one = torch.tensor([7], dtype=torch.int64)
    by_tensor = lp.sampling_from_probs(probs, seed=one, offset=torch.tensor([2]))
    assert torch.equal(by_tensor, lp.sampling_from_probs(probs, seed=one.expand(4).contiguous(),
                                                         offset=torch.full((4,), 2)))
    assert torch.equal(by_tensor, lp.sampling_from_probs(probs, seed=one.to(torch.uint64),
                                                         offset=torch.tensor([2], dtype=torch.uint64)))
    with pytest.raises(ValueError, match="seed and offset must both be tensors or both be numbers"):
        lp.sampling_from_probs(probs, seed=one, offset=2)
    wide = random_probs(64, 1000, g)
    first = lp.sampling_from_probs(wide, generator=torch.Generator().manual_seed(11))
    again = lp.sampling_from_probs(wide, generator=torch.Generator().manual_seed(11))
    assert torch.equal(first, again)
    shared = torch.Generator().manual_seed(11)
    assert not torch.equal(lp.sampling_from_probs(wide, generator=shared), lp.sampling_from_probs(wide, generator=shared))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        lp.sampling_from_probs(wide, generator=11)
    nan = probs.clone()
    nan[1, 4] = math.nan
    with pytest.raises(ValueError, match="probs contains NaN"):
        lp.sampling_from_probs(nan, check_nan=True)
    assert lp.sampling_from_probs(nan, seed=0, offset=0)[1] != 4  # NaN: never drawn


def test_edge_rows(lp):
    """Ties at the k-th all kept; negative, NaN and zero probabilities never kept; a row of one
    positive probability renormalises to 1; subnormal probabilities keep their order."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0],
                          [0.5, -0.1, math.nan, 0.0, 0.5],
                          [0.0, 0.0, 1e-3, 0.0, 0.0],
                          [1e-40, 3e-40, 2e-40, 0.0, 5e-41]])
    renorm = lp.top_k_renorm_probs(probs, 2)
    assert torch.equal(renorm[0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]))
    assert torch.equal(renorm[1], torch.tensor([0.5, 0.0, 0.0, 0.0, 0.5]))
    assert torch.equal(renorm[2], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(renorm[3] > 0, torch.tensor([False, True, True, False, False]))
    assert torch.allclose(renorm[3, 1:3].double(), torch.tensor([0.6, 0.4], dtype=torch.float64), rtol=1e-5)
    assert torch.equal(lp.top_p_renorm_probs(probs, 0.6)[1], torch.tensor([0.5, 0.0, 0.0, 0.0, 0.5]))


@pytest.mark.parametrize("call", ["top_k_renorm_probs", "top_p_renorm_probs", "top_k_mask_logits",
                                  "sampling_from_probs"])
def test_bad_arguments_name_the_argument(lp, call):
    probs = random_probs(2, 50, torch.Generator().manual_seed(904))
    fn = getattr(lp, call)
    extra = {"top_k_renorm_probs": (3,), "top_p_renorm_probs": (0.5,), "top_k_mask_logits": (3,)}.get(call, ())
    name = "logits" if call == "top_k_mask_logits" else "probs"
    with pytest.raises(RuntimeError if name == "probs" else (RuntimeError, ValueError), match=name):
        fn(probs[0], *extra)  # 1-D
    with pytest.raises((RuntimeError, TypeError), match=name):
        fn(probs.double(), *extra)
    if call == "top_p_renorm_probs":
        with pytest.raises(RuntimeError, match="top_p"):
            fn(probs, 1.5)
    if call in ("top_k_renorm_probs", "top_k_mask_logits"):
        with pytest.raises((RuntimeError, TypeError), match="top_k"):
            fn(probs, 2.5)


def test_opcheck_and_fullgraph_compile(lp):
    """logits_from_probs passes torch.library.opcheck; each name traces whole with
    torch.compile(fullgraph=True) when seed and offset are given, and returns what eager does."""
    g = torch.Generator().manual_seed(905)
    probs = random_probs(4, 300, g)
    torch.library.opcheck(lp._ops.ops.logits_from_probs, (probs, torch.empty(4, 300)))
    top_k = torch.tensor([3, 0, 50, 7])

    def step(p, offset):
        seed = torch.tensor([3, 4, 5, 6])
        return (lp.top_k_top_p_sampling_from_probs(p, top_k, 0.9, seed=seed, offset=offset),
                lp.sampling_from_probs(p, seed=torch.tensor([3]), offset=offset[:1]),
                lp.min_p_sampling_from_probs(p, 0.2, seed=seed, offset=offset, return_valid=True)[1],
                lp.top_k_renorm_probs(p, top_k), lp.top_p_renorm_probs(p, 0.8), lp.top_k_mask_logits(p, top_k))

    offset = torch.full((4,), 5, dtype=torch.int64)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(probs, offset)
    for got, want in zip(compiled, step(probs, offset)):
        assert torch.equal(got, want)
