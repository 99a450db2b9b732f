"""The CUDA sampling kernels, emulated on the CPU (tests/cuda_emulation/), against the CPU
implementation; and on a GPU where there is one.

Every emulated case runs torch_binding.cpp's CUDA path (validation, grid and split choice,
scratch, launch) on CPU tensors in the emulation build and compares with the CPU variant: the
same token ids, bit for bit, since both run sampling.h's arithmetic with the host compiler.
The emulated GPU's SM count (1, 8, 132) changes the grids: 1 and 8 put more rows than blocks,
132 splits rows over blocks in small batches. `make emulate` runs the emulated tests with
fibers in both thread orders, then under ThreadSanitizer and AddressSanitizer (smaller cases),
and the split rows with their blocks at the same time (the concurrent flavor).
"""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from cuda_emulation.cases import (BIN_PATHS, DTYPES, ORDER_PATHS, PATHS, SMALL_CASES, SMS, TEMPERATURE_LAST_PATHS,
                                  assert_launched, crowded_logits, row_params, special_bitmask, special_logits, unaligned_rows)
from cuda_emulation.emulation import FLAVOR
from op_cases import ZERO_TOP_ROWS, check_top_cell_refined, random_row_params, zero_top_kept_sets, zero_top_logits
from reference import random_bitmask

# (rows, vocab): V > 16384 with few rows is the split path; 256 rows exceed 1 or 8 SMs' blocks.
SAMPLER_SHAPES = ([(3, 50), (7, 1001), (3, 16411)] if SMALL_CASES else
                  [(1, 1), (3, 50), (7, 1001), (256, 1000), (40, 32000), (3, 128256), (2, 200003)])


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SAMPLER_SHAPES)
def test_sampler_agrees_with_cpu_per_row(emulation, lp_cpu, sms, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab + sms)
    logits = special_logits(rows, vocab, dtype, g)
    bitmask = special_bitmask(rows, vocab, g)
    params = row_params(rows, g)
    for with_bitmask, order in [(True, "joint"), (False, "joint"), (True, "top_k_first")]:
        extra = dict(bitmask=bitmask, filter_apply_order=order) if with_bitmask else dict(filter_apply_order=order)
        expected = lp_cpu.sample(logits, **extra, **params)
        ids = torch.int32 if order == "top_k_first" else torch.int64  # (the kernels write either)
        # (and read top_k in either: vLLM's int32, as it is, against the CPU's int64)
        device_params = dict(params, top_k=params["top_k"].to(ids))
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits, **extra, **device_params, ids_dtype=ids)
        assert_launched(emulation, before)
        assert got.dtype == ids
        got = got.long()
        assert torch.equal(got, expected), (with_bitmask, order, (got != expected).nonzero().flatten().tolist())


@pytest.mark.emulation
@pytest.mark.parametrize("float_dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,sms", [(7, 1001, 8), (2, 40000, 132)])  # one block a row; split rows
def test_parameters_read_in_the_callers_dtype(emulation, lp_cpu, float_dtype, rows, vocab, sms):
    """Per-row parameters in float64 (rounded to nearest), float16 or bfloat16 and int32 seeds and
    offsets, read by the kernels as they are (dtype.h's FloatArray, IntArray): the tokens and
    log-probabilities of the CPU given the same values as float32 and int64."""
    g = torch.Generator().manual_seed(vocab + sms)
    logits = special_logits(rows, vocab, torch.float32, g)
    params = row_params(rows, g)
    given = {k: (v % 2**31).int() if k in ("seed", "offset", "top_k") else v.to(float_dtype) + 1e-9
             for k, v in params.items()}
    converted = {k: v.long() if k in ("seed", "offset", "top_k") else v.float() for k, v in given.items()}
    expected = lp_cpu.sample_with_logprobs(logits, **converted, num_logprobs=2)
    with emulation.gpu(sms) as lp:
        got = lp.sample_with_logprobs(logits, **given, num_logprobs=2)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.emulation
@pytest.mark.parametrize("rows,vocab,sms", [(6, 3000, 8), (2, 40000, 132)])  # one block a row; split rows
def test_top_k_of_the_width_or_more_is_off(emulation, lp_cpu, rows, vocab, sms):
    """An int32 per-row top_k >= V (vLLM's vocab_size, which the plugin passes through) draws
    as top_k = 0 does on the CPU, in the whole-row and split-row kernels."""
    g = torch.Generator().manual_seed(rows + vocab)
    logits = special_logits(rows, vocab, torch.float32, g)
    top_k = torch.tensor([vocab, vocab + 1, 2**31 - 1, 0, vocab, 7][:rows], dtype=torch.int32)
    params = dict(temperature=1.1, top_p=0.9, seed=torch.arange(rows) + 5, filter_apply_order="top_k_first")
    expected = lp_cpu.sample(logits, top_k=torch.where(top_k >= vocab, 0, top_k).long(), **params)
    before = emulation.launches()
    with emulation.gpu(sms) as lp:
        got = lp.sample(logits, top_k=top_k, **params)
    assert_launched(emulation, before)
    assert torch.equal(got, expected)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows,vocab", [(5, 20000), (64, 3000)] if not SMALL_CASES else [(2, 9000)])
def test_sampler_agrees_with_cpu_scalar_parameters(emulation, lp_cpu, sms, path, rows, vocab):
    """One seed for the batch (each row its own Philox stream) and scalar filters."""
    g = torch.Generator().manual_seed(vocab + sms)
    dtype = DTYPES[(rows + sms) % len(DTYPES)]
    logits = special_logits(rows, vocab, dtype, g)
    bitmask = special_bitmask(rows, vocab, g)
    kwargs = dict(PATHS[path], seed=123, offset=7, bitmask=bitmask)
    with emulation.gpu(sms) as lp:
        got = lp.sample(logits, **kwargs)
    assert torch.equal(got, lp_cpu.sample(logits, **kwargs))


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("order,path", [(order, path) for order, paths in ORDER_PATHS.items() for path in paths])
@pytest.mark.parametrize("rows,vocab", [(5, 20000), (64, 3000)] if not SMALL_CASES else [(2, 9000)])
def test_filter_orders_agree_with_cpu(emulation, lp_cpu, sms, order, path, rows, vocab):
    """filter_apply_order="top_k_first" and "llama_cpp" (their cuts in one block, split rows over
    blocks at 132 SMs), scalar filters and per-row ones on the same rows: the CPU's tokens."""
    g = torch.Generator().manual_seed(vocab + sms + len(path))
    logits = special_logits(rows, vocab, DTYPES[(rows + sms) % len(DTYPES)], g)
    bitmask = special_bitmask(rows, vocab, g)
    per_row = {name: torch.full((rows,), value) for name, value in ORDER_PATHS[order][path].items()}
    for filters in [ORDER_PATHS[order][path], per_row]:
        kwargs = dict(filters, seed=123, offset=7, bitmask=bitmask, filter_apply_order=order)
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits, **kwargs)
        assert torch.equal(got, lp_cpu.sample(logits, **kwargs)), filters


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("path", list(TEMPERATURE_LAST_PATHS))
@pytest.mark.parametrize("rows,vocab", [(5, 20000), (64, 3000)] if not SMALL_CASES else [(2, 9000)])
def test_temperature_last_agrees_with_cpu(emulation, lp_cpu, sms, path, rows, vocab):
    """temperature_last (the cut at T = 1, the draw at T), for every row and per row (every other
    row), in one block a row and on rows a split batch samples whole (132 SMs): the CPU's tokens."""
    g = torch.Generator().manual_seed(vocab + sms + len(path) + 1)
    logits = special_logits(rows, vocab, DTYPES[(rows + sms) % len(DTYPES)], g)
    for last in (True, torch.arange(rows) % 2 == 0):
        kwargs = dict(TEMPERATURE_LAST_PATHS[path], seed=123, offset=7, bitmask=special_bitmask(rows, vocab, g),
                      temperature_last=last)
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits, **kwargs)
        assert torch.equal(got, lp_cpu.sample(logits, **kwargs))


# The filters of rows cut over several blocks (top-k up to 1024, min-p, top-p with top-k or
# without) and beyond them (top-k above 1024: one block per row).
SPLIT_FILTERS = [dict(top_k=1), dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_k=1024), dict(top_k=1025),
                 dict(min_p=0.1), dict(top_k=50, min_p=0.3), dict(top_k=7, min_p=1.0), dict(top_p=0.9),
                 dict(top_k=1024, top_p=0.3), dict(top_k=200, top_p=0.999, min_p=0.02), dict(top_k=1, top_p=0.0),
                 dict(top_p=0.5, min_p=0.05), dict(top_p=0.999), dict(top_p=0.0), dict(top_k=2000, top_p=0.8),
                 dict(epsilon_cutoff=1e-4), dict(eta_cutoff=1e-3), dict(top_n_sigma=2.0),
                 dict(top_k=50, xtc_probability=1.0, xtc_threshold=0.01), dict(typical_p=0.9)]  # (sampled whole, by one block)


def split_rows(kind: str, rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows in an unaligned view (one element in, odd V): 'normal'; 'ties' (rounded: every cutoff
    tied, across chunks); 'equal' (one key bin holds the row: more candidates than the gathered
    entries hold); 'heavy' (log-uniform over ~250 octaves: with k = 1024 each chunk lists hundreds
    of bins, more than the bin list holds)."""
    x = torch.randn(rows, vocab, generator=g) * 3
    if kind == "ties":
        x = x.round()
    elif kind == "equal":
        x = torch.full((rows, vocab), 0.5)
    elif kind == "heavy":
        x = torch.sign(x) * torch.exp2(torch.rand(rows, vocab, generator=g) * 250 - 125)
    buffer = torch.empty(rows, vocab + 3, dtype=dtype)
    buffer[:, 1:vocab + 1] = x.to(dtype)
    return buffer[:, 1:vocab + 1]


SPLIT_CASES = [(dtype, kind) for dtype in DTYPES for kind in ["normal", "ties", "equal", "heavy"]]
if SMALL_CASES:  # each kind's path once, the dtypes in turn: the dtype is a run-time value of the same code
    SPLIT_CASES = [(DTYPES[i % len(DTYPES)], kind) for i, kind in enumerate(["normal", "ties", "equal", "heavy"])]
if FLAVOR == "concurrent":  # (blocks at the same time under ThreadSanitizer: about 30 s a case)
    SPLIT_CASES = [(torch.float32, "normal"), (torch.bfloat16, "heavy")]


@pytest.mark.emulation
@pytest.mark.parametrize("dtype,kind", SPLIT_CASES)
def test_split_cut_agrees_with_cpu(emulation, lp_cpu, dtype, kind):
    """Top-k, min-p and top-p rows of small batches, cut over several blocks (two kernels: counts
    or estimated masses, then the draw) with their fallbacks, per-row filters and a single row,
    with a bitmask and fused penalties: the CPU's tokens."""
    g = torch.Generator().manual_seed(len(kind) + dtype.itemsize)
    vocab, sms = (65537, 64) if SMALL_CASES else (200003, 132)  # (fewer rows than SMs: split)
    rows = len(SPLIT_FILTERS)
    logits = split_rows(kind, rows, vocab, dtype, g)
    params = dict(temperature=torch.rand(rows, generator=g) + 0.5,
                  top_k=torch.tensor([f.get("top_k", 0) for f in SPLIT_FILTERS]),
                  min_p=torch.tensor([f.get("min_p", 0.0) for f in SPLIT_FILTERS]),
                  top_p=torch.tensor([f.get("top_p", 1.0) for f in SPLIT_FILTERS]),
                  epsilon_cutoff=torch.tensor([f.get("epsilon_cutoff", 0.0) for f in SPLIT_FILTERS]),
                  eta_cutoff=torch.tensor([f.get("eta_cutoff", 0.0) for f in SPLIT_FILTERS]),
                  top_n_sigma=torch.tensor([f.get("top_n_sigma", -1.0) for f in SPLIT_FILTERS]),
                  typical_p=torch.tensor([f.get("typical_p", 1.0) for f in SPLIT_FILTERS]),
                  xtc_probability=torch.tensor([f.get("xtc_probability", 0.0) for f in SPLIT_FILTERS]),
                  xtc_threshold=torch.tensor([f.get("xtc_threshold", 0.1) for f in SPLIT_FILTERS]),
                  seed=torch.randint(0, 2**62, (rows,), generator=g), offset=3)
    bitmask = random_bitmask(rows, vocab, g, "words")
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32)
    prompt_mask = random_bitmask(rows, vocab, g, "mixed")
    # (top_k_first: the split's top-p paths renormalise over what top-k and min-p keep.)
    extras = [{}, dict(bitmask=bitmask), dict(bitmask=bitmask, filter_apply_order="top_k_first")]
    launches = [(extra, penalized) for extra in extras for penalized in ([False, True] if extra else [False])]
    # Under ThreadSanitizer the plainest launch and the fullest (bitmask, penalties, top_k_first): their lines
    # are the others' (coverage.py), 40% of the time; the fibers and asan runs check every launch.
    if FLAVOR in ("tsan", "concurrent"):
        launches = [launches[0], launches[-1]]
    for extra, penalized in launches:
        penalty = lp_cpu.Penalties(prompt_mask, counts, 1.3, 0.2, 0.1) if penalized else None
        kwargs = dict(params, **extra, penalties=penalty)
        expected = lp_cpu.sample(logits, **kwargs)
        with emulation.gpu(sms) as lp:
            if penalized:
                kwargs["penalties"] = lp.Penalties(prompt_mask, counts, 1.3, 0.2, 0.1)
            got = lp.sample(logits, **kwargs)
        assert torch.equal(got, expected), (extra.keys(), penalized, (got != expected).nonzero().flatten())
    for r, filters in enumerate(SPLIT_FILTERS):
        orders = ["joint", "top_k_first"] if "top_p" in filters else ["joint"]
        for order in orders + (["llama_cpp"] if "top_p" in filters or "min_p" in filters else []):
            with emulation.gpu(sms) as lp:
                got = lp.sample(logits[r:r + 1], seed=r, temperature=0.7, filter_apply_order=order, **filters)
            expected = lp_cpu.sample(logits[r:r + 1], seed=r, temperature=0.7, filter_apply_order=order, **filters)
            assert torch.equal(got, expected), (filters, order)
    # Top-p with a top-k that cuts nothing (fewer candidates than k): sampled whole.
    few = logits[:1].clone()
    few[:, 500:] = float("-inf")
    with emulation.gpu(sms) as lp:
        got = lp.sample(few, seed=1, top_k=1000, top_p=0.5)
    assert torch.equal(got, lp_cpu.sample(few, seed=1, top_k=1000, top_p=0.5))


@pytest.mark.emulation
def test_sampler_narrow_bitmask_and_strided_rows(emulation, lp_cpu):
    """A bitmask narrower than the vocabulary (the rest allowed) and rows of a padded buffer."""
    g = torch.Generator().manual_seed(5)
    buffer = torch.randn(6, 12000, generator=g)
    logits = buffer[:, 3:10003]
    bitmask = random_bitmask(6, 4000, g, "mixed")  # 125 words: tokens past 4000 are allowed
    params = row_params(6, g)
    with emulation.gpu(132) as lp:
        got = lp.sample(logits, bitmask=bitmask, **params)
    assert torch.equal(got, lp_cpu.sample(logits, bitmask=bitmask, **params))


# --- the sampler's cutoffs: key bins, the gathered boundary bin and its fallback ------------
# The filtered paths find each cutoff's key bin (the top 12 bits of the score key) in one or
# two passes, gather the boundary bin's candidates into shared memory (4096 of them at most)
# and resolve the cutoffs there; a larger bin is resolved by passes over the row.

BIN_CAPACITY = 4096


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("crowd", [3000, 6000] if not SMALL_CASES else [3000])
@pytest.mark.parametrize("path", list(BIN_PATHS))
def test_sampler_boundary_bin_agrees_with_cpu(emulation, lp_cpu, dtype, crowd, path):
    """Cutoffs inside a crowded key bin, gathered (3000 candidates) or too many to gather
    (6000), with ties at the cutoffs and at the bin's edges, odd V, unaligned strided rows,
    with and without a bitmask: the CPU's tokens."""
    rows, vocab = 5, 12289 if not SMALL_CASES else 5001
    g = torch.Generator().manual_seed(crowd + len(path))
    logits = crowded_logits(rows, vocab, min(crowd, vocab // 2), dtype, g)
    seeds = dict(seed=torch.randint(0, 2**62, (rows,), generator=g), offset=torch.randint(0, 2**40, (rows,), generator=g))
    for extra in [{}, dict(bitmask=random_bitmask(rows, vocab, g, "words"))]:
        for rows_of in [lambda t: t, unaligned_rows]:
            kwargs = dict(BIN_PATHS[path], **seeds, **extra)
            with emulation.gpu(8) as lp:
                got = lp.sample(rows_of(logits), **kwargs)
            assert torch.equal(got, lp_cpu.sample(logits, **kwargs)), (extra.keys(), rows_of)


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 9001] if not SMALL_CASES else [1000])
def test_sampler_all_equal_rows_agree_with_cpu(emulation, lp_cpu, dtype, vocab):
    """Every logit of a row equal (one bin holds the whole row, past the gathering's capacity
    at V = 9001): every cutoff is a tie of all candidates; the lowest index wins the draw's
    ties (equal noise never occurs, the noise decides)."""
    g = torch.Generator().manual_seed(vocab)
    rows = len(PATHS)
    logits = torch.full((rows, vocab), 0.75).to(dtype)
    params = row_params(rows, g)
    with emulation.gpu(8) as lp:
        got = lp.sample(logits, **params)
    assert torch.equal(got, lp_cpu.sample(logits, **params))


@pytest.mark.emulation
@pytest.mark.traffic
def test_sampler_gathers_the_boundary_bin_unless_it_overflows(emulation, lp_cpu):
    """Top-k in a crowded bin takes two passes when the bin fits in shared memory, and more
    (the fallback's passes over the row) when it does not, with the CPU's token either way."""
    vocab = 12289
    g = torch.Generator().manual_seed(1)
    for crowd, fits in [(BIN_CAPACITY - 100, True), (BIN_CAPACITY + 100, False)]:
        logits = crowded_logits(1, vocab, crowd, torch.float32, g)
        kwargs = dict(top_k=crowd // 2, seed=3)
        with emulation.gpu(8) as lp:
            emulation.reset_traffic()
            got = lp.sample(logits, **kwargs)
            counted = emulation.traffic()  # (None unless the build counts: then the tokens alone)
        if counted:
            assert (sum(counted) / (4 * vocab) < 2.01) == fits, (crowd, counted)
        assert torch.equal(got, lp_cpu.sample(logits, **kwargs))


@pytest.mark.emulation
@pytest.mark.traffic
def test_split_top_p_brackets_or_samples_whole(emulation, lp_cpu):
    """A split top-p row without top-k takes two passes when the first pass's estimate brackets
    t_p; when it misses (scores in wide key bins, [512, 576) here, where the estimate rounds to
    nothing and t_p lies above the bracket, with t_minp inside it) or the bracket overflows the
    entries (equal logits), the last block samples the row whole: more passes, the CPU's tokens
    either way."""
    vocab = 128256
    g = torch.Generator().manual_seed(2)
    normal = torch.randn(4, vocab, generator=g) * 2
    wide = torch.full((4, vocab), float("-inf"))
    wide[:, :60] = 513 + 2 * torch.rand(60, generator=g)  # t_p among these, in the wide bin
    wide[:, 60:200] = 511 + 0.9 * torch.rand(140, generator=g)  # the bin below: all the estimate sees
    equal = torch.full((4, vocab), 0.5)
    for logits, min_p, two_passes in [(normal, 0.0, True), (wide, 0.03, False), (equal, 0.0, False)]:
        kwargs = dict(top_p=0.5, min_p=min_p)
        with emulation.gpu(8) as lp:
            emulation.reset_traffic()
            got = lp.sample(logits[:1], seed=3, **kwargs)
            counted = emulation.traffic()
            batch = lp.sample(logits, seed=torch.arange(4) + 11, **kwargs)
        if counted:
            assert (sum(counted) / (4 * vocab) < 2.3) == two_passes, counted
        assert torch.equal(got, lp_cpu.sample(logits[:1], seed=3, **kwargs))
        assert torch.equal(batch, lp_cpu.sample(logits, seed=torch.arange(4) + 11, **kwargs))


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [40, 20011])
def test_zero_top_scores_agree_with_cpu(emulation, lp_cpu, dtype, vocab):
    """Rows whose top score is -0.0, +0.0 or both (op_cases.zero_top_logits), point-mass kept
    sets: the CPU's tokens, a block per row (V = 40) or the rows split over blocks (20011)."""
    logits = zero_top_logits(vocab, dtype, torch.Generator().manual_seed(vocab))
    for kwargs in zero_top_kept_sets(vocab):
        with emulation.gpu(132) as lp:
            got = lp.sample(logits, seed=torch.arange(ZERO_TOP_ROWS), **kwargs)
        assert torch.equal(got, lp_cpu.sample(logits, seed=torch.arange(ZERO_TOP_ROWS), **kwargs)), kwargs


# --- on a GPU where there is one, and emulated --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 50, 32000, 128256])
# 3: rows split over blocks; 256: a block per row (not in the smaller cases: 5 minutes under
# ThreadSanitizer, an OS thread per CUDA thread; the per-row tests cover both grids there)
@pytest.mark.parametrize("rows", [3, pytest.param(256, marks=pytest.mark.skipif(SMALL_CASES, reason="the smaller cases"))])
def test_cuda_agrees_with_cpu(lp, cuda_target, dtype, vocab, rows):
    """The CPU replays the GPU's decisions: token agreement on the same inputs (on a GPU, and
    in the CUDA emulation, where the arithmetic is the host's and agreement must be exact)."""
    g = torch.Generator().manual_seed(110)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[::9, ::5] = float("nan")
    bitmask = random_bitmask(rows, vocab, g, "words")
    params = random_row_params(rows, g)
    params["seed"] = torch.randint(0, 2**62, (rows,), generator=g)
    params["offset"] = torch.randint(0, 2**40, (rows,), generator=g)
    params["temperature"][::4] = 0.0  # greedy rows
    params["top_k"][1::4], params["top_p"][1::4], params["min_p"][1::4] = 0, 1.0, 0.0  # unfiltered rows
    cpu = lp.sample(logits, bitmask=bitmask, **params)
    device = cuda_target.device
    gpu = cuda_target.lp.sample(logits.to(device), bitmask=bitmask.to(device),
                                **{k: v.to(device) for k, v in params.items()})
    agreement = (cpu == gpu.cpu()).float().mean().item()
    print(f"CUDA/CPU token agreement, {dtype}, B={rows}, V={vocab}: {agreement:.4f}")
    assert agreement >= (0.999 if device == "cuda" else 1.0)
    greedy = params["temperature"] == 0
    assert torch.equal(cpu[greedy], gpu.cpu()[greedy])


def test_top_cell_is_refined_cuda(cuda_target):
    check_top_cell_refined(cuda_target.lp, cuda_target.device)


# --- GPU only ------------------------------------------------------------------------------

@requires_cuda
def test_cuda_graph_decode_step(lp):
    g = torch.Generator().manual_seed(111)
    logits = torch.randn(8, 5000, generator=g).cuda()
    bitmask = random_bitmask(8, 5000, g, "mixed").cuda()
    seeds = torch.arange(8, device="cuda")
    offset = torch.zeros(8, dtype=torch.int64, device="cuda")
    temperature = torch.full((8,), 0.8, device="cuda")
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    work = logits.clone()

    def step():
        lp.apply_token_bitmask_inplace(work, bitmask)
        lp.sample(work, temperature=temperature, top_k=50, top_p=0.9, seed=seeds, offset=offset, out=out)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for step_index in [1, 2, 1]:
        work.copy_(logits)
        offset.fill_(step_index)
        graph.replay()
        results.append(out.clone())
    torch.cuda.synchronize()
    assert torch.equal(results[0], results[2])
    eager = lp.sample(logits.cpu(), temperature=0.8, top_k=50, top_p=0.9, seed=seeds.cpu(), offset=1, bitmask=bitmask.cpu())
    assert torch.equal(results[0].cpu(), eager)


def documented_split_workspace() -> tuple[int, int, int]:
    """docs/semantics-sampling.md's figures for a split row: the scratch bytes beyond 8 per
    split, the zeroed state and the merged bins' zeroed bytes."""
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "semantics-sampling.md").read_text().split())
    found = re.search(r"8 x \(splits \+ (\d+)\) bytes of scratch.*? and (\d+) bytes of state zeroed"
                      r".*?plus (\d+) bytes zeroed", text)
    assert found, "the split workspace's figures are missing from docs/semantics-sampling.md"
    return int(found[1]), int(found[2]), int(found[3])


@pytest.mark.emulation
@pytest.mark.skipif(SMALL_CASES, reason="host-side allocation sizes: the forward run checks them")
@pytest.mark.parametrize("merges", [False, True])
def test_split_workspace_is_what_the_docs_say(emulation, merges):
    """The op's own allocations for a split batch (two rows over many blocks), recorded by
    torch's profiler: one scratch buffer of rows x 8 x (splits + the documented words) bytes and
    one zeroed buffer of the documented state (plus the merged bins when a row may merge)."""
    from torch.profiler import ProfilerActivity, profile

    scratch_words, state_bytes, merged_bytes = documented_split_workspace()
    rows, vocab = 2, 128256
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5))
    filters = dict(top_k=50, top_p=0.9) if merges else dict(top_k=50)  # top-p < 1 may merge bins
    with emulation.gpu(132) as lp:
        lp.sample(logits, 1.0, seed=1, offset=0, out=torch.empty(rows, dtype=torch.int64), **filters)  # warm
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            lp.sample(logits, 1.0, seed=1, offset=0, out=torch.empty(rows, dtype=torch.int64), **filters)
    sizes = sorted(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)  # each allocation
    zeroed = rows * (state_bytes + (merged_bytes if merges else 0))
    scratch = [size for size in sizes if size % (rows * 8) == 0 and 2 <= size // (rows * 8) - scratch_words <= 64]
    assert zeroed in sizes and len(scratch) == 1, (sizes, zeroed)
