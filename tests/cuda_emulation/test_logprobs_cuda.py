"""The CUDA log-probability kernel against the CPU implementation, bit for bit.

Through the CUDA emulation (tests/cuda_emulation/: the .cu kernel built by the host compiler,
run through the binding's CUDA path on CPU tensors; also under ThreadSanitizer and ASan in
`make emulate`), and on a GPU where there is one: tokens,
logprobs, ids and ranks identical to the CPU variant's, every path of the sampler, both modes,
top-N beyond one chunk (N > 20, the slower path), and a row's results identical alone and in
batches of 1, 7 and 300 rows whatever the emulated GPU's size.
"""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from op_cases import zero_top_kept_sets, zero_top_logits
from reference import random_bitmask
from cuda_emulation.cases import (BIN_PATHS, ORDERED_PATHS, PATHS, SMALL_CASES, crowded_logits, row_params,
                                  special_bitmask, special_logits)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["processed", "raw"]
# (rows, vocab, num_logprobs); under ThreadSanitizer and ASan (an OS thread per CUDA thread,
# `make emulate`'s tsan and asan parts) smaller ones, N > 20 still among them.
SHAPES = ([(7, 1001, 5), (3, 9001, 45)] if SMALL_CASES else
          [(1, 1, 0), (7, 1001, 5), (40, 32000, 20), (3, 128256, 45), (60, 3000, 1)])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(got, expected, what=""):
    for field in expected._fields:
        a, b = getattr(got, field).cpu(), getattr(expected, field)
        assert torch.equal(bits(a), bits(b)), (what, field, (bits(a) != bits(b)).nonzero()[:5].tolist())


def on(device, **tensors):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,num_logprobs", SHAPES)
def test_sample_with_logprobs_agrees_with_cpu(cuda_target, lp_cpu, mode, dtype, rows, vocab, num_logprobs):
    g = torch.Generator().manual_seed(rows * vocab + num_logprobs)
    logits = special_logits(rows, vocab, dtype, g)
    # (Both rank conventions: the half-precision logits hold the most ties; both id dtypes.)
    kwargs = dict(row_params(rows, g), bitmask=special_bitmask(rows, vocab, g), num_logprobs=num_logprobs,
                  logprobs_mode=mode, rank_ties="min" if dtype == torch.float32 else "max",
                  ids_dtype=torch.int32 if mode == "raw" else torch.int64)
    expected = lp_cpu.sample_with_logprobs(logits, **kwargs)
    device = cuda_target.device
    got = cuda_target.lp.sample_with_logprobs(logits.to(device), **on(device, **kwargs))
    assert_same(got, expected)
    assert torch.equal(expected.tokens, lp_cpu.sample(logits, **{k: v for k, v in kwargs.items()
                                                                 if k not in ("num_logprobs", "logprobs_mode",
                                                                              "rank_ties")}).to(kwargs["ids_dtype"]))
    again = cuda_target.lp.token_logprobs(logits.to(device), got.tokens, logprobs_mode=mode,
                                          **on(device, **{k: kwargs[k] for k in ("temperature", "top_k", "top_p",
                                                                                  "min_p", "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "mirostat_mu",
                                                                                  "typical_p", "xtc_probability", "xtc_threshold",
                                                                                  "seed", "offset", "bitmask")}))
    assert torch.equal(bits(again.cpu()), bits(expected.logprobs[:, 0]))




@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", list(ORDERED_PATHS))
def test_scalar_parameters_and_any_token(cuda_target, lp_cpu, mode, path):
    g = torch.Generator().manual_seed(len(path))
    rows, vocab = 9, 5000
    logits = special_logits(rows, vocab, torch.float32, g)
    bitmask = special_bitmask(rows, vocab, g)
    kwargs = dict(ORDERED_PATHS[path], bitmask=bitmask, logprobs_mode=mode)
    device = cuda_target.device
    expected = lp_cpu.sample_with_logprobs(logits, seed=4, offset=2, num_logprobs=3, **kwargs)
    got = cuda_target.lp.sample_with_logprobs(logits.to(device), seed=4, offset=2, num_logprobs=3, **on(device, **kwargs))
    assert_same(got, expected, path)
    ids = torch.randint(-2, vocab + 2, (rows,), generator=g)
    cpu = lp_cpu.token_logprobs(logits, ids, **kwargs)
    gpu = cuda_target.lp.token_logprobs(logits.to(device), ids.to(device), **on(device, **kwargs))
    assert torch.equal(bits(gpu.cpu()), bits(cpu))


@pytest.mark.parametrize("crowd", [3000, 6000] if not SMALL_CASES else [3000])
@pytest.mark.parametrize("path", ["top_k_in_crowd", "top_p", "all"])
def test_cutoffs_in_a_crowded_bin(cuda_target, lp_cpu, crowd, path):
    """The cut without a draw (the log-probabilities' distribution, token_logprobs) when the
    cutoffs lie in one crowded key bin, gathered into shared memory (3000) or not (6000)."""
    g = torch.Generator().manual_seed(crowd)
    rows, vocab = 3, 12289
    logits = crowded_logits(rows, vocab, crowd, torch.float32, g)
    kwargs = dict(BIN_PATHS[path], logprobs_mode="processed")
    device = cuda_target.device
    expected = lp_cpu.sample_with_logprobs(logits, seed=5, num_logprobs=4, **kwargs)
    got = cuda_target.lp.sample_with_logprobs(logits.to(device), seed=5, num_logprobs=4, **kwargs)
    assert_same(got, expected, path)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    ids[0] = expected.tokens[0]
    cpu = lp_cpu.token_logprobs(logits, ids, **kwargs)
    gpu = cuda_target.lp.token_logprobs(logits.to(device), ids.to(device), **kwargs)
    assert torch.equal(bits(gpu.cpu()), bits(cpu))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_top_scores_agree_with_cpu(cuda_target, lp_cpu, mode, dtype):
    """Rows whose top score is -0.0, +0.0 or both (op_cases.zero_top_logits), with point-mass
    kept sets: the same bits (s_max is row_max_score on both devices, +0.0 for either zero)."""
    vocab = 40
    logits = zero_top_logits(vocab, dtype, torch.Generator().manual_seed(40))
    device = cuda_target.device
    for kwargs in zero_top_kept_sets(vocab):
        kwargs = dict(kwargs, logprobs_mode=mode)
        expected = lp_cpu.sample_with_logprobs(logits, seed=3, num_logprobs=3, **kwargs)
        got = cuda_target.lp.sample_with_logprobs(logits.to(device), seed=3, num_logprobs=3, **on(device, **kwargs))
        assert_same(got, expected, kwargs)
        cpu = lp_cpu.token_logprobs(logits, expected.tokens, **kwargs)
        gpu = cuda_target.lp.token_logprobs(logits.to(device), expected.tokens.to(device), **on(device, **kwargs))
        assert torch.equal(bits(gpu.cpu()), bits(cpu)), kwargs


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 8, 132])
def test_batch_invariance_emulated(emulation, lp_cpu, sms):
    """A row alone and in batches of 1, 7 and 300 rows, at any position, on GPUs of any size:
    the same bits (and the CPU's)."""
    g = torch.Generator().manual_seed(sms)
    rows, vocab = 300, 2000
    logits = special_logits(rows, vocab, torch.bfloat16, g)
    params = dict(row_params(rows, g), bitmask=random_bitmask(rows, vocab, g, "words"))

    def run(lp, index):
        return lp.sample_with_logprobs(logits[index], num_logprobs=6,
                                       **{k: v[index] for k, v in params.items()})

    everything = torch.arange(rows)
    with emulation.gpu(sms) as lp:
        full = run(lp, everything)
        parts = {(size, start): run(lp, torch.arange(start, start + size)) for size in (1, 7) for start in (0, 150, 293)}
    assert_same(full, run(lp_cpu, everything))
    for (size, start), part in parts.items():
        index = torch.arange(start, start + size)
        assert_same(part, type(full)(*(getattr(full, f)[index] for f in full._fields)), (size, start))


@requires_cuda
def test_cuda_graph_capture(lp, lp_cpu):
    """With `out` and device parameters, a step of both ops is captured and replayed."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 5000, generator=g).cuda()
    seeds = torch.arange(8, device="cuda")
    offset = torch.zeros(8, dtype=torch.int64, device="cuda")
    temperature = torch.full((8,), 0.8, device="cuda")
    out = lp.SampleWithLogprobs(torch.empty(8, dtype=torch.int64, device="cuda"), torch.empty(8, 6, device="cuda"),
                                torch.empty(8, 6, dtype=torch.int64, device="cuda"),
                                torch.empty(8, dtype=torch.int64, device="cuda"))
    recomputed = torch.empty(8, device="cuda")

    def step():
        lp.sample_with_logprobs(logits, temperature=temperature, top_k=50, top_p=0.9, seed=seeds, offset=offset,
                                num_logprobs=5, out=out)
        lp.token_logprobs(logits, out.tokens, temperature=temperature, top_k=50, top_p=0.9, out=recomputed)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    offset.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    expected = lp_cpu.sample_with_logprobs(logits.cpu(), temperature=0.8, top_k=50, top_p=0.9, seed=seeds.cpu(),
                                           offset=3, num_logprobs=5)
    assert_same(out, expected)
    assert torch.equal(bits(recomputed.cpu()), bits(expected.logprobs[:, 0]))


@pytest.mark.parametrize("vocab,num_logprobs", [(40, 8), (3001, 3001)] + ([] if SMALL_CASES else [(70003, 70001)]))
def test_ids_past_the_support_agree_with_cpu(cuda_target, lp_cpu, vocab, num_logprobs):
    """Rows whose support is smaller than N (nothing allowed, one token, a few, N - 1; and where
    N is small, N and listed ids above N), the rest of the columns the lowest ids outside it
    (logprob_ids.h): the CPU's ids, and beyond 65536 candidates the CUDA fill's chunks of its
    shared bitmap."""
    g = torch.Generator().manual_seed(vocab)
    # Rows 4 and 5 (a support of N and of more: no ids past it) only where N is small: a top-N
    # takes a pass over the row per TopList chunk, and at N = 70001 they were 35 s of fibers.
    rows = 6 if num_logprobs < 65536 else 4
    logits = torch.randn(6, vocab, generator=g)
    allowed = torch.zeros(6, vocab, dtype=torch.bool)
    allowed[1, vocab - 1] = True  # one token, at the end
    allowed[2, torch.randperm(vocab, generator=g)[:5]] = True
    allowed[3, torch.randperm(vocab, generator=g)[:num_logprobs - 1]] = True
    allowed[4, torch.randperm(vocab, generator=g)[:num_logprobs]] = True
    allowed[5] = True
    logits[~allowed] = float("-inf")  # row 0: nothing allowed
    logits = logits[:rows]
    device = cuda_target.device
    for mode in MODES:
        expected = lp_cpu.sample_with_logprobs(logits, seed=3, num_logprobs=num_logprobs, logprobs_mode=mode)
        got = cuda_target.lp.sample_with_logprobs(logits.to(device), seed=3, num_logprobs=num_logprobs,
                                                  logprobs_mode=mode)
        assert_same(got, expected, mode)
        ids = expected.logprob_token_ids[:, 1:]
        assert (ids >= 0).all() and all(len(set(r)) == num_logprobs for r in ids.tolist())
