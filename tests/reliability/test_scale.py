"""The sizes users hit, on the CPU: a 1024 x 256000 fp32 batch, more than 65535 rows, and rows
more than 2^31 elements apart (64-bit offsets), for the bitmask ops and the sampler."""

from __future__ import annotations

import time

import torch

from conftest import SANITIZED
from reference import bitmask_reference, random_bitmask, sampling_reference, unpack_bitmask

NEG_INF = float("-inf")


def allowed_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """tests/reference.py's unpack_bitmask through bytes (little-endian: token v is bit v % 8 of
    byte v // 8), fast enough for 2^28 tokens; checked against unpack_bitmask below."""
    rows = bitmask.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab].bool()


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Every row masked with -inf by its bitmask row, vectorised."""
    return torch.where(allowed_bits(bitmask, logits.shape[1]), logits, NEG_INF)


def test_fast_unpacking_matches_the_reference():
    bitmask = random_bitmask(5, 1000, torch.Generator().manual_seed(9), "words")
    assert torch.equal(allowed_bits(bitmask, 999), unpack_bitmask(bitmask, 999))


def test_batch_1024_by_256000_fp32(lp_cpu):
    """1 GiB of logits masked in place; all rows checked. CPU time is printed and bounded
    (2 s; not under the sanitizer)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 1024, 256_000
    logits = torch.arange(rows * vocab, dtype=torch.float32).view(rows, vocab)
    bitmask = random_bitmask(rows, vocab, g, "words")
    start = time.perf_counter()
    lp_cpu.apply_token_bitmask_inplace(logits, bitmask)
    elapsed = time.perf_counter() - start
    print(f"apply_token_bitmask_inplace 1024 x 256000 fp32: {elapsed * 1e3:.0f} ms")
    expected = masked(torch.arange(rows * vocab, dtype=torch.float32).view(rows, vocab), bitmask)
    assert torch.equal(logits, expected)
    if not SANITIZED:
        assert elapsed < 2.0


def test_sampler_256000_vocab_rows(lp_cpu):
    """64 rows of V=256000 with filters and a bitmask: tokens in range, and in the kept set of
    the reference for a spread of rows (the float64 reference is slow at this width)."""
    g = torch.Generator().manual_seed(1)
    rows, vocab = 64, 256_000
    logits = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    params = dict(temperature=0.8, top_k=torch.arange(rows) * 3, top_p=0.9, min_p=0.01, bitmask=bitmask)
    tokens = lp_cpu.sample(logits, seed=5, **params)
    assert ((tokens >= 0) & (tokens < vocab)).all()
    checked = torch.tensor([0, 1, 17, 40, 62, 63])
    kept = sampling_reference(logits[checked], slack=1e-3, **dict(params, top_k=params["top_k"][checked],
                                                                 bitmask=bitmask[checked])) > 0
    assert kept[torch.arange(len(checked)), tokens[checked]].all()


def test_more_than_65535_rows(lp_cpu):
    """70000 rows (past a 65535 grid limit): all rows masked, host indices reaching the last
    rows, and the sampler's -1 / kept-set answers near the end."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 70_000, 40
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    bitmask[-3] = 0  # a fully masked row near the end

    got = logits.clone()
    lp_cpu.apply_token_bitmask_inplace(got, bitmask)
    assert torch.equal(got, masked(logits, bitmask))

    indices = [rows - 1, 5, rows - 2, rows - 1]
    got = logits.clone()
    lp_cpu.apply_token_bitmask_inplace(got, bitmask, indices=torch.tensor(indices))
    assert torch.equal(got, bitmask_reference(logits, bitmask, indices=indices))

    tokens = lp_cpu.sample(logits, top_k=5, bitmask=bitmask, seed=3)
    assert tokens[-3] == -1
    tail = slice(rows - 50, rows)
    kept = sampling_reference(logits[tail], top_k=5, bitmask=bitmask[tail], slack=1e-3) > 0
    drawn = tokens[tail] >= 0
    assert torch.equal(drawn, kept.any(dim=1))
    assert kept[torch.arange(50)[drawn], tokens[tail][drawn]].all()


def test_rows_more_than_2_31_elements_apart(lp_cpu):
    """A strided bf16 view whose last row starts past element 2^31 of its storage: 32-bit row
    offsets would wrap into the first row. The 4 GiB storage is allocated but only the rows and
    their surroundings are ever touched, so little of it becomes resident."""
    g = torch.Generator().manual_seed(3)
    rows, vocab, stride = 3, 1000, 2**30 + 7
    guard = 64
    storage = torch.empty((rows - 1) * stride + vocab + guard, dtype=torch.bfloat16)
    assert (rows - 1) * stride > 2**31
    view = storage.as_strided((rows, vocab), (stride, 1))
    # Each row with `guard` elements either side (the first row's left guard is the start).
    windows = [storage[max(0, r * stride - guard) : r * stride + vocab + guard] for r in range(rows)]
    for w in windows:
        w.copy_(torch.randn(w.numel(), generator=g))
    logits = view.clone()
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    before = [w.clone() for w in windows]

    def check(expected_view: torch.Tensor) -> None:
        for r, (w, b) in enumerate(zip(windows, before)):
            start = min(r * stride, guard)
            b = b.clone()
            b[start : start + vocab] = expected_view[r]
            assert torch.equal(w.view(torch.int16), b.view(torch.int16)), f"row {r} or its surroundings"

    expected = bitmask_reference(logits, bitmask)
    out = lp_cpu.apply_packed_bitmask(view, bitmask)
    assert torch.equal(out, expected)
    check(logits)  # out of place: the storage is unchanged

    tokens = lp_cpu.sample(view, top_p=0.5, bitmask=bitmask, seed=1)
    kept = sampling_reference(logits, top_p=0.5, bitmask=bitmask, slack=1e-3) > 0
    assert kept[torch.arange(rows), tokens].all()

    lp_cpu.apply_token_bitmask_inplace(view, bitmask, indices=[2, 0])
    check(bitmask_reference(logits, bitmask, indices=[2, 0]))
