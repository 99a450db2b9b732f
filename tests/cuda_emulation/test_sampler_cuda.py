"""The CUDA kernels, emulated on the CPU (tests/cuda_emulation/), against the CPU implementation.

Every case runs torch_binding.cpp's CUDA path (validation, grid and split choice, scratch,
launch) on CPU tensors in the emulation build and compares with the CPU variant: the same
token ids and the same masked logits, bit for bit, since both run sampling.h's arithmetic
with the host compiler. The emulated GPU's SM count (1, 8, 132) changes the grids: 1 and 8
put more rows than blocks, 132 splits rows over blocks in small batches.
`make emulate` runs this file with fibers in both thread orders, then under ThreadSanitizer
and AddressSanitizer (one OS thread per CUDA thread, smaller cases).
"""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import (BIN_PATHS, DTYPES, PATHS, SANITIZED, SMS, assert_launched, crowded_logits,
                                  row_params, special_bitmask, special_logits, unaligned_rows)
from cuda_emulation.emulation import FLAVOR, LAUNCH_OUT_OF_RESOURCES
from reference import random_bitmask

pytestmark = pytest.mark.emulation

# (rows, vocab): V > 16384 with few rows is the split path; 256 rows exceed 1 or 8 SMs' blocks.
SAMPLER_SHAPES = ([(3, 50), (7, 1001), (3, 16411)] if SANITIZED else
                  [(1, 1), (3, 50), (7, 1001), (256, 1000), (40, 32000), (3, 128256), (2, 200003)])


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SAMPLER_SHAPES)
def test_sampler_agrees_with_cpu_per_row(emulation, lp_cpu, sms, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab + sms)
    logits = special_logits(rows, vocab, dtype, g)
    bitmask = special_bitmask(rows, vocab, g)
    params = row_params(rows, g)
    for with_bitmask in [True, False]:
        extra = dict(bitmask=bitmask) if with_bitmask else {}
        expected = lp_cpu.sample(logits, **extra, **params)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits, **extra, **params)
        assert_launched(emulation, before)
        assert torch.equal(got, expected), (with_bitmask, (got != expected).nonzero().flatten().tolist())


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows,vocab", [(5, 20000), (64, 3000)] if not SANITIZED else [(2, 9000)])
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


# The filters of rows cut over several blocks (top-k up to 1024, min-p, top-p with top-k or
# without) and beyond them (top-k above 1024: one block per row).
SPLIT_FILTERS = [dict(top_k=1), dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_k=1024), dict(top_k=1025),
                 dict(min_p=0.1), dict(top_k=50, min_p=0.3), dict(top_k=7, min_p=1.0), dict(top_p=0.9),
                 dict(top_k=1024, top_p=0.3), dict(top_k=200, top_p=0.999, min_p=0.02), dict(top_k=1, top_p=0.0),
                 dict(top_p=0.5, min_p=0.05), dict(top_p=0.999), dict(top_p=0.0), dict(top_k=2000, top_p=0.8)]


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


# (Sanitized: two cases, for the races and bounds within a block.)
SPLIT_CASES = ([(torch.bfloat16, "normal"), (torch.float32, "equal")] if SANITIZED else
               [(dtype, kind) for dtype in DTYPES for kind in ["normal", "ties", "equal", "heavy"]])


@pytest.mark.parametrize("dtype,kind", SPLIT_CASES)
def test_split_cut_agrees_with_cpu(emulation, lp_cpu, dtype, kind):
    """Top-k, min-p and top-p rows of small batches, cut over several blocks (two kernels: counts
    or estimated masses, then the draw) with their fallbacks, per-row filters and a single row,
    with a bitmask and fused penalties: the CPU's tokens."""
    g = torch.Generator().manual_seed(len(kind) + dtype.itemsize)
    vocab, sms = (16411, 16) if SANITIZED else (200003, 132)
    rows = len(SPLIT_FILTERS)
    logits = split_rows(kind, rows, vocab, dtype, g)
    params = dict(temperature=torch.rand(rows, generator=g) + 0.5,
                  top_k=torch.tensor([f.get("top_k", 0) for f in SPLIT_FILTERS]),
                  min_p=torch.tensor([f.get("min_p", 0.0) for f in SPLIT_FILTERS]),
                  top_p=torch.tensor([f.get("top_p", 1.0) for f in SPLIT_FILTERS]),
                  seed=torch.randint(0, 2**62, (rows,), generator=g), offset=3)
    bitmask = random_bitmask(rows, vocab, g, "words")
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32)
    prompt_mask = random_bitmask(rows, vocab, g, "mixed")
    for extra in [{}, dict(bitmask=bitmask)]:
        penalties = [None, lp_cpu.Penalties(prompt_mask, counts, 1.3, 0.2, 0.1)] if extra else [None]
        for penalty in penalties:
            kwargs = dict(params, **extra, penalties=penalty)
            expected = lp_cpu.sample(logits, **kwargs)
            with emulation.gpu(sms) as lp:
                if penalty is not None:
                    kwargs["penalties"] = lp.Penalties(prompt_mask, counts, 1.3, 0.2, 0.1)
                got = lp.sample(logits, **kwargs)
            assert torch.equal(got, expected), (extra.keys(), penalty is None, (got != expected).nonzero().flatten())
    for r, filters in enumerate(SPLIT_FILTERS[:4] if SANITIZED else SPLIT_FILTERS):
        with emulation.gpu(sms) as lp:
            got = lp.sample(logits[r:r + 1], seed=r, temperature=0.7, **filters)
        assert torch.equal(got, lp_cpu.sample(logits[r:r + 1], seed=r, temperature=0.7, **filters)), filters
    # Top-p with a top-k that cuts nothing (fewer candidates than k): sampled whole.
    few = logits[:1].clone()
    few[:, 500:] = float("-inf")
    with emulation.gpu(sms) as lp:
        got = lp.sample(few, seed=1, top_k=1000, top_p=0.5)
    assert torch.equal(got, lp_cpu.sample(few, seed=1, top_k=1000, top_p=0.5))


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("crowd", [3000, 6000] if not SANITIZED else [3000])
@pytest.mark.parametrize("path", list(BIN_PATHS))
def test_sampler_boundary_bin_agrees_with_cpu(emulation, lp_cpu, dtype, crowd, path):
    """Cutoffs inside a crowded key bin, gathered (3000 candidates) or too many to gather
    (6000), with ties at the cutoffs and at the bin's edges, odd V, unaligned strided rows,
    with and without a bitmask: the CPU's tokens."""
    rows, vocab = 5, 12289 if not SANITIZED else 5001
    g = torch.Generator().manual_seed(crowd + len(path))
    logits = crowded_logits(rows, vocab, min(crowd, vocab // 2), dtype, g)
    seeds = dict(seed=torch.randint(0, 2**62, (rows,), generator=g), offset=torch.randint(0, 2**40, (rows,), generator=g))
    for extra in [{}, dict(bitmask=random_bitmask(rows, vocab, g, "words"))]:
        for rows_of in [lambda t: t, unaligned_rows]:
            kwargs = dict(BIN_PATHS[path], **seeds, **extra)
            with emulation.gpu(8) as lp:
                got = lp.sample(rows_of(logits), **kwargs)
            assert torch.equal(got, lp_cpu.sample(logits, **kwargs)), (extra.keys(), rows_of)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 9001] if not SANITIZED else [1000])
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


@pytest.mark.skipif(SANITIZED, reason="only the fibers build counts global-memory traffic")
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
            read, written = emulation.traffic()
        passes = (read + written) / (4 * vocab)
        assert (passes < 2.01) == fits, (crowd, passes)
        assert torch.equal(got, lp_cpu.sample(logits, **kwargs))


@pytest.mark.skipif(SANITIZED, reason="only the fibers build counts global-memory traffic")
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
            read, written = emulation.traffic()
            batch = lp.sample(logits, seed=torch.arange(4) + 11, **kwargs)
        passes = (read + written) / (4 * vocab)
        assert (passes < 2.3) == two_passes, passes
        assert torch.equal(got, lp_cpu.sample(logits[:1], seed=3, **kwargs))
        assert torch.equal(batch, lp_cpu.sample(logits, seed=torch.arange(4) + 11, **kwargs))


# --- bitmask -------------------------------------------------------------------------------

BITMASK_VOCABS = [1, 33, 1027] if SANITIZED else [1, 31, 33, 1000, 1027, 128257]
# (pad, offset): contiguous rows; rows of a padded buffer at an odd column; at an aligned one.
LAYOUTS = [(0, 0), (13, 3), (8, 8)]
ROWS = 5
# Repeated indices make two threads write the same fill value to the same logits: a race
# CUDA tolerates (equal values) and ThreadSanitizer rightly reports, so not under it.
INDICES = [4, 0, 2] if FLAVOR == "tsan" else [4, 0, 2, 2]


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", BITMASK_VOCABS)
def test_bitmask_agrees_with_cpu(emulation, lp_cpu, sms, dtype, vocab):
    """In place (all rows, indices in any order and repeated, a vocab_size short of the width)
    and out of place, in every layout: the whole buffer, guard bands and padding included,
    equals the CPU's bit for bit."""
    g = torch.Generator().manual_seed(vocab + sms)
    for pad, offset in LAYOUTS:
        def view(buffer):
            stride = vocab + pad
            return buffer[8 : 8 + ROWS * stride].view(ROWS, stride)[:, offset : offset + vocab]

        def buffer():  # 8 spare elements at each end: guard bands the op must not touch
            return (torch.randn(ROWS * (vocab + pad) + 16, generator=g) * 5).to(dtype)

        for pattern in ["mixed", "words", "zeros", "ones"]:
            bitmask = random_bitmask(ROWS + 2, vocab, g, pattern)
            source = view(buffer())
            calls = {
                "in place": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask),
                "indices": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask, indices=INDICES),
                "vocab_size": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask, vocab_size=max(vocab - 5, 1)),
                "out of place": lambda lp, b: lp.apply_packed_bitmask(source, bitmask, -7.5, out=view(b)),
            }
            for name, call in calls.items():
                ours = buffer()
                cpu = ours.clone()
                before = emulation.launches()
                with emulation.gpu(sms) as lp:
                    call(lp, ours)
                call(lp_cpu, cpu)
                assert_launched(emulation, before)
                assert same_bits(ours, cpu), (pad, offset, pattern, name)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


# --- launch checks -------------------------------------------------------------------------

def test_failed_launch_raises_naming_op_and_gpu(emulation):
    logits = torch.randn(4, 100)
    bitmask = torch.zeros(4, 4, dtype=torch.int32)
    for op, call in [("sample", lambda lp: lp.sample(logits, seed=1)),
                     ("bitmask", lambda lp: lp.apply_token_bitmask_inplace(logits.clone(), bitmask))]:
        emulation.fail_next_launch(LAUNCH_OUT_OF_RESOURCES)
        with pytest.raises(RuntimeError) as info:
            call(emulation.lp)
        message = str(info.value)
        assert f"the {op} kernel failed to launch" in message, message
        assert "CUDA emulation (132 SMs) (cuda:0)" in message, message
        assert "too many resources requested for launch" in message, message
    call(emulation.lp)  # the failure was not sticky


def test_gpu_without_kernels_gets_a_clear_error(emulation):
    import tomllib

    from conftest import ROOT

    archs = tomllib.loads((ROOT / "build.toml").read_text())["kernel"]["logits_processor_cuda"]["cuda-capabilities"]
    with emulation.device(1, (7, 5), has_kernels=False) as lp:
        with pytest.raises(RuntimeError) as info:
            lp.sample(torch.randn(2, 10), seed=1)
    assert str(info.value) == ("logits-processor has no kernels for compute capability 7.5 "
                               "(CUDA emulation (132 SMs) (cuda:1)); supported: " + ", ".join(archs))
    emulation.lp.sample(torch.randn(2, 10), seed=1)  # device 0 still works


# --- the traffic counter behind `make traffic` ---------------------------------------------

@pytest.mark.skipif(SANITIZED, reason="only the fibers build counts global-memory traffic")
def test_traffic_counts_exactly_the_global_bytes(emulation):
    """Greedy reads each logit once and writes one id per row; split over blocks, each chunk
    also publishes its winner, counts its arrival (an atomic: read and write) and the last
    chunk reads every winner. Nothing else (stacks, shared memory, parameters) counts."""
    rows, vocab = 4, 50000
    logits = torch.randn(rows, vocab)
    for sms, splits in [(1, 1), (132, 4)]:  # 132 SMs, 4 rows: ceil(50000 / 16384) = 4 chunks
        with emulation.gpu(sms) as lp:
            emulation.reset_traffic()
            lp.sample(logits, temperature=0.0)
            read, written = emulation.traffic()
        scratch_read = 0 if splits == 1 else rows * splits * (4 + 8)
        scratch_written = 0 if splits == 1 else rows * splits * (8 + 4)
        assert (read, written) == (4 * rows * vocab + scratch_read, 8 * rows + scratch_written), sms


@pytest.mark.skipif(SANITIZED, reason="only the fibers build counts global-memory traffic")
@pytest.mark.parametrize("dtype", DTYPES)
def test_traffic_counts_vector_loads(emulation, lp_cpu, dtype):
    """The sampler reads logits and bitmask words by 16-byte loads wherever a row is aligned:
    greedy over rows of an odd stride that start one element in, with a bitmask of an odd row
    stride too, reads each logit and each word once, all but each row's edges (under 16 bytes
    at each end) by 16-byte loads."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 3, 10001
    size = torch.tensor([], dtype=dtype).element_size()
    logits = unaligned_rows(torch.randn(rows, vocab, generator=g).to(dtype))
    bitmask = random_bitmask(rows, vocab, g, "mixed")  # 313 words a row
    for extra, words in [({}, 0), (dict(bitmask=bitmask), bitmask.shape[1])]:
        with emulation.gpu(1) as lp:
            emulation.reset_traffic()
            got = lp.sample(logits, temperature=0.0, **extra)
            read, written = emulation.traffic()
            by_vectors = emulation.vector_read_bytes()
        assert torch.equal(got, lp_cpu.sample(logits, temperature=0.0, **extra))
        assert (read, written) == (rows * (vocab * size + 4 * words), 8 * rows), extra.keys()
        edges = 2 * 15 * (2 if words else 1)
        assert read - by_vectors <= rows * edges, (read, by_vectors)
