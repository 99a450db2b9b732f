"""The CUDA filtered distribution (filtered_probs, filtered_logits: logprobs_kernel's row_filtered)
against the CPU implementation, bit for bit.

Through the CUDA emulation (and on a GPU where there is one): every path of the sampler in both
filter orders, the three dtypes, special logits (NaN, ties, +-inf, rows with nothing allowed),
bitmasks, fused penalties and biases, tiny temperatures (the rows whose scores are taken from
their largest logit), and unaligned row views.
"""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import (BIN_PATHS, ORDERED_PATHS, PATHS, SMALL_CASES, assert_launched, crowded_logits,
                                  row_params, special_bitmask, special_logits, to_device, unaligned_rows)
from cuda_emulation.emulation import COUNTS_TRAFFIC
from op_cases import assert_same_logits, fused_cases

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUTPUTS = ["filtered_probs", "filtered_logits"]
SHAPES = [(7, 1001), (3, 9001)] if SMALL_CASES else [(1, 1), (7, 1001), (40, 32000), (3, 128256)]


def filters_of(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in ("seed", "offset")}


def check(cuda_target, lp_cpu, output, logits, **kwargs):
    expected = getattr(lp_cpu, output)(logits, **kwargs)
    device = cuda_target.device
    got = getattr(cuda_target.lp, output)(logits.to(device), **to_device(kwargs, device)).cpu()
    assert_same_logits(got, expected, output)
    return expected


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_filtered_agrees_with_cpu(cuda_target, lp_cpu, output, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab + len(output))
    logits = special_logits(rows, vocab, dtype, g)
    check(cuda_target, lp_cpu, output, logits, **filters_of(row_params(rows, g)),
          bitmask=special_bitmask(rows, vocab, g))


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("path", list(ORDERED_PATHS))
def test_each_path_in_both_orders(cuda_target, lp_cpu, output, path):
    g = torch.Generator().manual_seed(len(path) + len(output))
    rows, vocab = 9, 5000
    logits = special_logits(rows, vocab, torch.float32, g)
    check(cuda_target, lp_cpu, output, logits, **ORDERED_PATHS[path], bitmask=special_bitmask(rows, vocab, g))


@pytest.mark.parametrize("output", OUTPUTS)
def test_fused_penalties(cuda_target, lp_cpu, output):
    g = torch.Generator().manual_seed(8)
    rows, vocab = 6, 3001
    for i, (logits, prompt_mask, counts, kwargs, sampling) in enumerate(fused_cases(rows, vocab, torch.bfloat16, g)):
        penalties = dict(prompt_mask=prompt_mask, output_counts=counts, **kwargs)
        expected = getattr(lp_cpu, output)(logits, **filters_of(sampling), penalties=lp_cpu.Penalties(**penalties))
        device = cuda_target.device
        got = getattr(cuda_target.lp, output)(logits.to(device), **to_device(filters_of(sampling), device),
                                              penalties=cuda_target.lp.Penalties(**to_device(penalties, device)))
        assert_same_logits(got.cpu(), expected, (output, i))


@pytest.mark.parametrize("output", OUTPUTS)
def test_tiny_temperatures_and_huge_logits(cuda_target, lp_cpu, output):
    """Rows whose x / T overflows: their scores are taken from the row's largest logit."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 6, 2000
    logits = torch.randn(rows, vocab, generator=g) * 1e30
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1e25  # a tie at the top
    logits[2, :] = 3e38
    temperature = torch.tensor([1e-30, 1e-38, 1e-20, 0.5, 1e-45, 3.0])
    check(cuda_target, lp_cpu, output, logits, temperature=temperature, top_p=0.9, min_p=0.0)
    check(cuda_target, lp_cpu, output, logits, temperature=temperature, top_k=3)


@pytest.mark.parametrize("output", OUTPUTS)
def test_unaligned_rows(cuda_target, lp_cpu, output):
    g = torch.Generator().manual_seed(5)
    rows, vocab = 5, 3001
    logits = unaligned_rows(special_logits(rows, vocab, torch.float16, g))
    check(cuda_target, lp_cpu, output, logits, **filters_of(row_params(rows, g)),
          bitmask=special_bitmask(rows, vocab, g))


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("path", list(BIN_PATHS))
def test_cutoffs_inside_a_crowded_bin(cuda_target, lp_cpu, output, path):
    """The cut's boundary-bin paths (gathered in shared memory, or resolved by passes over the row)."""
    g = torch.Generator().manual_seed(len(path))
    rows, vocab = 3, 20000
    check(cuda_target, lp_cpu, output, crowded_logits(rows, vocab, 6000, torch.float32, g), **BIN_PATHS[path])


@pytest.mark.parametrize("output", OUTPUTS)
def test_empty_logits(cuda_target, output):
    for shape in [(0, 10), (3, 0)]:
        result = getattr(cuda_target.lp, output)(torch.randn(*shape, device=cuda_target.device))
        assert result.shape == shape


def test_runs_the_cuda_kernel(emulation, lp_cpu):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 777, generator=g)
    for output in OUTPUTS:
        before = emulation.launches()
        got = getattr(emulation.lp, output)(logits, temperature=0.7, top_k=30)
        assert_launched(emulation, before)
        assert_same_logits(got, getattr(lp_cpu, output)(logits, temperature=0.7, top_k=30), output)


# The passes over the row each op reads, measured (fp32, V = 128256, 4 rows on an 8-SM GPU: sample
# splits them over blocks): sample's, then the one-block cut of the log-probabilities kernel
# plus filtered_logits' writing pass, plus filtered_probs' pass for Z (docs/benchmarks.md).
TRAFFIC = {"top_k_50_top_p": (dict(top_k=50, top_p=0.9), 2, 4, 5),
           "top_p": (dict(top_p=0.9), 2.09, 4, 5),
           "min_p": (dict(min_p=0.05), 2, 2, 3),
           "unfiltered": (dict(), 1, 2, 3)}


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
@pytest.mark.parametrize("filters", TRAFFIC)
def test_filtered_traffic(emulation, filters):
    """The passes over the row of sample, filtered_logits and filtered_probs, and their writes:
    each filtered op writes its [B, V] float32 output once and nothing else."""
    rows, vocab = 4, 128256
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    kwargs, *expected = TRAFFIC[filters]
    row_bytes = rows * vocab * 4
    with emulation.gpu(8) as lp:
        for op, passes in zip(("sample", "filtered_logits", "filtered_probs"), expected):
            emulation.reset_traffic()
            getattr(lp, op)(logits, **kwargs, temperature=0.8)
            read, written = emulation.traffic()
            assert abs(read / row_bytes - passes) <= 0.01, (op, read / row_bytes)
            if op != "sample":
                assert written == row_bytes, (op, written)


@pytest.mark.parametrize("output", OUTPUTS)
def test_mirostat_edge_values(cuda_target, lp_cpu, output):
    """mirostat_mu per row at its edges (0 and below: the top alone; NaN, +inf, huge: off; tiny:
    the top alone), with and without other filters, in both orders: the CPU's bits."""
    g = torch.Generator().manual_seed(77)
    rows, vocab = 10, 3000
    logits = special_logits(rows, vocab, torch.float32, g)
    mu = torch.tensor([0.0, -2.0, float("nan"), float("inf"), 1e-30, 3.0, 9.5, 200.0, 3.4e38, 6.0])
    for extra in (dict(), dict(top_k=40, top_p=0.9, epsilon_cutoff=1e-3), dict(min_p=0.02, filter_apply_order="top_k_first")):
        check(cuda_target, lp_cpu, output, logits, temperature=0.9, mirostat_mu=mu, **extra)
